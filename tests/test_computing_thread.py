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
