"""Shared fixtures. Tests run offline: the hub is never asked, wandb stays offline."""

from __future__ import annotations

import os
import shutil

import pytest

# Set before transformers/wandb import anywhere: no network calls, quick failures.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The Tinker SDK sends telemetry to its service unless told not to: a test talking to grpo.serve
# in-process otherwise logged a failed connection's traceback into the suite's output
os.environ.setdefault("TINKER_TELEMETRY", "0")
# ``auto`` precision is fp32 on a CPU without timing the model (grpo/models/dtype_probe.py): what a
# test computes must not depend on this machine's timing, nor write to the user's cache.
# tests/test_precision.py turns the probe on with fake and real timers.
os.environ["GRPO_PRECISION_PROBE"] = "off"
# The suite runs several processes at once on few cores (xdist workers, the servers and CLI runs
# they start). Each grpo process computes on one OpenMP team (grpo/models/computing.py),
# whose idle threads by default spin ~3 ms after every parallel region: good for one process on
# its cores, CPU stolen from the others when processes outnumber cores (the slow suite ran ~3x
# longer). Passive waiting is OpenMP's setting for such a machine; set before torch loads libgomp.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session")
def tokenizer():
    """The real SmolLM2 tokenizer (the tiny test model shares it)."""
    from grpo import models

    return models.load_tokenizer("tiny")


@pytest.fixture(scope="session")
def tiny_of(tmp_path_factory):
    """``tiny_of(family)``: a base model name for the tiny model of a decoder family the sampler's
    lean and native steps take -- "llama" (the packaged tiny model), "mistral", "qwen2", "qwen3", "phi3",
    "phi4_mini", "olmo2", "granite", "smollm3" (saved once a session by backend_helpers.save_tiny_model)."""
    from backend_helpers import save_tiny_model

    saved = {"llama": "tiny"}

    def tiny_of(family: str) -> str:
        if family not in saved:
            saved[family] = save_tiny_model(tmp_path_factory.mktemp(f"tiny-{family}"), family)
        return saved[family]

    return tiny_of


@pytest.fixture
def service(tmp_path):
    """A fresh local ServiceClient writing checkpoints under the test's tmp dir."""
    from grpo.backends.local import ServiceClient

    return ServiceClient(checkpoint_dir=tmp_path / "checkpoints")


@pytest.fixture
def fp32_service(tmp_path):
    """A local ServiceClient that trains and samples in fp32 whatever ``auto`` picks on this machine:
    for tests that check the sampler and the trainer agree to fp32 rounding (a bf16 default, where
    this CPU measures bf16 faster, is tested against bf16's own bound)."""
    from grpo.backends.local import ServiceClient

    return ServiceClient(checkpoint_dir=tmp_path / "checkpoints", dtype="fp32")


def pytest_sessionstart(session):
    """grpo builds its native CPU kernels on a model's first load and says so on stderr
    (grpo/models/native_kernels.py). Built here, before any test (under xdist the controller
    builds, each worker then loads the build), no test's captured stderr depends on whether it
    happened to be the first to sample."""
    from grpo.models import native_kernels

    native_kernels.kernels()


@pytest.fixture(scope="session")
def native_ops():
    """torch.ops.grpo_native; the test is skipped where no C++ compiler is found, and fails where
    one is found but the kernels did not build."""
    from grpo.models import native_kernels

    found = native_kernels.kernels()
    if found is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler on this machine: grpo runs without its native kernels")
    if found is None:
        pytest.fail(f"the native kernels did not build here: {native_kernels._loaded.get('error')}")
    return found
