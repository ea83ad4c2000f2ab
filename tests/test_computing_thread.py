"""The local backend computes on one thread: loading, training and sampling alike.

PyTorch's CPU kernels run on an OpenMP team per calling thread; with two teams on a machine with
fewer cores than their threads, GNU OpenMP makes every idle team thread sleep after a short spin
and each parallel region waits for wake-ups (clients.py, _EngineHandle: a sampling call took
1.7x as long). These tests check where the work runs, not how fast.
"""

from __future__ import annotations

import threading

import pytest
import torch

from grpo import types
from grpo.backends.local import ServiceClient, engine, sampler, trainer
from grpo.models import computing


@pytest.fixture
def threads_seen(monkeypatch):
    seen: dict[str, set[str]] = {"load": set(), "adapter": set(), "generate": set(), "train": set()}

    def record(what, fn):
        def wrapped(*args, **kwargs):
            seen[what].add(threading.current_thread().name)
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(engine.Engine, "__init__", record("load", engine.Engine.__init__))
    monkeypatch.setattr(engine.Engine, "add_adapter", record("adapter", engine.Engine.add_adapter))
    monkeypatch.setattr(sampler, "generate", record("generate", sampler.generate))
    monkeypatch.setattr(trainer, "run", record("train", trainer.run))
    return seen


def test_loading_training_and_sampling_run_on_one_thread(threads_seen, tmp_path) -> None:
    service = ServiceClient(checkpoint_dir=tmp_path, dtype="fp32")
    client = service.create_lora_training_client("tiny", seed=0, rank=2)
    prompt = types.ModelInput.from_ints([1, 504, 3457, 28])
    sampling = client.save_weights_and_get_sampling_client()
    seq = sampling.sample(prompt, 2, types.SamplingParams(max_tokens=4, seed=0)).result().sequences[0]
    tokens = prompt.to_ints() + seq.tokens
    datum = types.Datum(types.ModelInput.from_ints(tokens[:-1]),
                        {"target_tokens": types.TensorData.from_torch(torch.tensor(tokens[1:]))})
    client.forward_backward([datum], "cross_entropy").result()
    names = set().union(*threads_seen.values())
    assert all(threads_seen.values()), threads_seen  # every kind of work was seen
    assert len(names) == 1 and threading.current_thread().name not in names, threads_seen
    service.close()


def test_every_engine_of_the_process_and_the_judge_compute_on_one_thread(threads_seen, tmp_path) -> None:
    """Two ServiceClients (two engines) and the chat adapter's judge: one computing thread between
    them (grpo/models/computing.py), which can hand itself work without waiting on itself."""
    from adapters.judge import PairwiseJudge

    for run in ("a", "b"):
        ServiceClient(checkpoint_dir=tmp_path / run, dtype="fp32").create_lora_training_client("tiny", seed=0, rank=2)
    judged = []
    judge = PairwiseJudge("tiny")
    real = judge._prob_a
    judge._prob_a = lambda *a: judged.append(threading.current_thread().name) or real(*a)
    assert len(judge.prob_a(["Name a colour."], ["Red."], [""])) == 1
    assert len(threads_seen["load"] | set(judged)) == 1, (threads_seen, judged)
    assert computing.run(computing.run, computing.on_computing_thread) is True


def test_a_closed_service_refuses_training_and_sampling_but_the_computing_thread_serves_on(tmp_path) -> None:
    first = ServiceClient(checkpoint_dir=tmp_path / "a", dtype="fp32")
    client = first.create_lora_training_client("tiny", seed=0, rank=2)
    sampling = client.save_weights_and_get_sampling_client()
    first.close()
    prompt = types.ModelInput.from_ints([1, 504, 3457, 28])
    with pytest.raises(RuntimeError, match="closed"):
        client.save_weights_and_get_sampling_client()
    with pytest.raises(RuntimeError, match="closed"):
        sampling.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()
    other = ServiceClient(checkpoint_dir=tmp_path / "b", dtype="fp32").create_lora_training_client("tiny", rank=2)
    sample = other.save_weights_and_get_sampling_client().sample(prompt, 1, types.SamplingParams(max_tokens=2, seed=0))
    assert 1 <= len(sample.result().sequences[0].tokens) <= 2


def test_the_probes_measure_on_the_computing_thread_whoever_asks(tmp_path, monkeypatch) -> None:
    """A probe timed on a caller's own thread left a second OpenMP team in the process, after which
    every kernel of grpo's ran ~1.7x slower (docs/benchmark.md): they measure on the computing thread."""
    from grpo import models
    from grpo.models import dtype_probe, kernel_probe

    monkeypatch.setattr(dtype_probe, "_memo", {})
    monkeypatch.setattr(kernel_probe, "_memo", {})
    monkeypatch.setattr(dtype_probe, "machine_busy", lambda: None)
    seen: list[str] = []

    def precision_timer(shapes):
        seen.append(threading.current_thread().name)
        return {"sample": (1.0, 2.0), "train": (1.0, 2.0)}

    def kernel_timer(shapes):
        seen.append(threading.current_thread().name)
        return 1.0, 2.0

    shapes = dtype_probe.Shapes.from_config(models.load_config("tiny"))
    dtype_probe.timings(shapes, timer=precision_timer, cache=tmp_path / "p.json")
    kernel_probe.timings(shapes, timer=kernel_timer, cache=tmp_path / "p.json")
    assert len(seen) == 2 and seen[0] == seen[1] and seen[0].startswith("grpo-compute"), seen
    assert threading.current_thread().name not in seen


def test_the_linear_kernels_checks_leave_no_openmp_team_on_the_callers_thread() -> None:
    """cpu_linear's capability checks (oneDNN present, bf16 packing, the add post-op) multiply a few
    values through oneDNN; asked from a program's main thread (the bench resolving ``auto`` before
    it made its client), that one product left an OpenMP team there, and grpo's sampling then ran
    1.5x slower. They run on the computing thread: the process's threads stay as many. A product
    on the main thread does add a team's thread (the count can tell). Its own process: this one's
    threads are whatever earlier tests left."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import os, torch
        import torch.nn.functional as F
        from grpo.models import computing, cpu_linear
        torch.set_num_threads(2)
        threads = lambda: len(os.listdir("/proc/self/task"))
        x, w = torch.randn(64, 256), torch.randn(256, 256)
        computing.run(lambda: F.linear(x, w))  # the computing thread and its team, as an engine makes them
        before = threads()
        cpu_linear.onednn_works(), cpu_linear.packing_works(torch.bfloat16), cpu_linear.packing_works(torch.float32)
        cpu_linear._binary_add_works(torch.float32)
        after_checks = threads()
        F.linear(x, w)  # a product on this thread: its own team
        print(before, after_checks, threads())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stderr[-2000:]
    before, after_checks, after_product = map(int, out.stdout.split())
    assert after_checks == before, (before, after_checks)
    assert after_product > before, "a product on the main thread should have added a team's thread"
