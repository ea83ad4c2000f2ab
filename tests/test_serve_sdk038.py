"""The server against the newest tinker SDK (0.38: protobuf forward_backward and results), and
the docs' minimal loop on the packaged SmolLM2.

SDK 0.38 cannot share the test venv with the dev extra's MinT SDK (which pins tinker 0.22), so
it lives in its own venv: $GRPO_TINKER_NEW_PYTHON if set (an interpreter with it installed),
else one built once under $GRPO_CACHE/venvs/ with `pip install tinker==0.38.0` (the package
registry is all it needs). Slow: CI runs it in `make test-ci-slow`.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from serve_helpers import Server, assert_matches_in_process, replay_in_process, sdk_venv

NEW_SDK = "0.38.0"

pytest.importorskip("fastapi")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sdk_python() -> str:
    python = sdk_venv(f"tinker-{NEW_SDK}", [f"tinker=={NEW_SDK}"], "GRPO_TINKER_NEW_PYTHON")
    version = subprocess.run([python, "-c", "import tinker; print(tinker.__version__)"], capture_output=True,
                             text=True, check=True).stdout.strip()
    assert version == NEW_SDK, f"{python} has tinker {version}, not {NEW_SDK}"
    return python


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("serve038") / "checkpoints")
    yield srv
    srv.stop()


def test_newest_sdk_minimal_loop_matches_in_process_backend(server, sdk_python, tmp_path):
    result = server.run_sdk_loop(sdk_python, "tiny")
    assert result["sdk_version"] == NEW_SDK
    assert_matches_in_process(result, replay_in_process(result, "tiny", tmp_path / "ckpt"))


def test_minimal_loop_on_the_packaged_model(server, sdk_python, tmp_path):
    """The MinT docs' loop on SmolLM2-135M-Instruct: the tokenizer the SDK loads (offline, from
    the directory get_info names) is the model's, and the numbers match the in-process run."""
    result = server.run_sdk_loop(sdk_python, "smollm2")
    from grpo import models

    tokenizer = models.load_tokenizer("smollm2")
    assert result["prompt"] == tokenizer.encode("The capital of France is")
    assert_matches_in_process(result, replay_in_process(result, "smollm2", Path(tmp_path) / "ckpt"))


def test_the_server_keeps_the_sdk_off_pyqwest(server, sdk_python):
    """SDK 0.38 speaks HTTP through pyqwest (Rust threads) unless /client/config says otherwise;
    a response landing while such a client's interpreter finalizes aborted it (SIGABRT after its
    last line, ~1 run in 10 of the minimal loop; grpo/serve/routes/sessions.py). The server turns
    it off, so a client that has created a training client has never imported pyqwest."""
    script = ("import sys, tinker\n"
              "service = tinker.ServiceClient()\n"
              "training = service.create_lora_training_client(base_model='tiny', rank=4).result()\n"
              "print('pyqwest' in sys.modules)\n")
    done = subprocess.run([sdk_python, "-c", script], env=server.client_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "False", done.stdout
