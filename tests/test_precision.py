"""Sampling and training precision: what ``auto`` picks, bad input, and a bf16 sampler beside an
fp32 trainer (its own bf16 copy of the base weights, LoRA unmerged, refreshed as training moves)."""

from __future__ import annotations

import warnings

import pytest
import torch

from grpo import types
from grpo.backends.local import ServiceClient
from grpo.models import precision

ZEN3_FLAGS = "flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_vnni\n"  # avx512, no bf16
ZEN4_FLAGS = "flags\t\t: fpu sse2 avx avx2 avx512f avx512bw avx512_bf16\n"
SPR_FLAGS = "flags\t\t: fpu avx2 avx512f amx_tile amx_int8 amx_bf16\n"
CPU, CUDA = torch.device("cpu"), torch.device("cuda")
PROMPT = [1, 504, 3457, 28, 216, 17, 1183, 19, 30, 40, 41]


def test_the_flags_tell_which_cpus_multiply_bf16_natively() -> None:
    """Used for the warning below only: a default is never decided from flags."""
    assert not precision.cpu_supports_bf16(precision.cpu_flags(ZEN3_FLAGS))
    assert precision.cpu_supports_bf16(precision.cpu_flags(ZEN4_FLAGS))
    assert precision.cpu_supports_bf16(precision.cpu_flags(SPR_FLAGS))


def test_auto_is_fp32_on_every_cpu_and_bf16_on_cuda() -> None:
    """Whatever the flags (bf16 measured slower than fp32 for sampling on an AMX Xeon, and off
    policy on SmolLM2: precision.py), until auto is decided by timing the model."""
    assert precision.auto_dtype(CPU) is torch.float32
    assert precision.auto_dtype(CUDA) is torch.bfloat16
    assert precision.resolve("train_dtype", "auto", CPU) is torch.float32
    svc = ServiceClient(device="cpu")  # nothing asked: auto for both
    engine = svc.create_lora_training_client("tiny", seed=0, rank=2).engine
    assert engine.dtype is torch.float32 and engine.sample_dtype is torch.float32


def test_unknown_dtype_fails_in_one_line_naming_the_key_and_the_valid_values() -> None:
    with pytest.raises(ValueError, match=r"^sample_dtype='fp8' is invalid; valid: auto, fp32, bf16") as err:
        ServiceClient(device="cpu", sample_dtype="fp8")  # before any model loads
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"^train_dtype='half' is invalid; valid: auto, fp32, bf16"):
        precision.resolve("train_dtype", "half", CPU)


def test_bf16_on_a_cpu_without_bf16_warns_once_naming_the_key() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert precision.resolve("sample_dtype", "bf16", CPU, cpu_bf16=False) is torch.bfloat16
    (warning,) = caught
    assert str(warning.message).startswith("sample_dtype=bf16 on a CPU without avx512_bf16/AMX")
    assert "\n" not in str(warning.message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning where bf16 is native
        assert precision.resolve("sample_dtype", "bf16", CPU, cpu_bf16=True) is torch.bfloat16


def _logprob_gap(sampler_lp: list[float], trainer_lp: list[float]) -> float:
    return max(abs(a - b) for a, b in zip(sampler_lp, trainer_lp, strict=True))


@pytest.fixture(scope="module")
def mixed():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bf16 on this CPU warns; tested above
        svc = ServiceClient(device="cpu", train_dtype="fp32", sample_dtype="bf16")
        return svc.create_lora_training_client("tiny", seed=3, rank=4)


def test_bf16_sampler_beside_an_fp32_trainer_keeps_lora_and_adam_in_fp32(mixed) -> None:
    engine = mixed.engine
    assert engine.dtype is torch.float32 and engine.sample_dtype is torch.bfloat16
    assert {p.dtype for p in engine.model.parameters()} == {torch.float32}
    copy = engine._sampler_copy
    assert {p.dtype for p in copy.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in engine.adapter_parameters(mixed.adapter).values()} == {torch.float32}


def _trainer_logprobs(client, tokens: list[int]) -> list[float]:
    datum = types.Datum(types.ModelInput.from_ints(tokens[:-1]),
                        {"target_tokens": types.TensorData.from_torch(torch.tensor(tokens[1:]))})
    out = client.forward([datum], "cross_entropy").result()
    return out.loss_fn_outputs[0]["logprobs"].tolist()


def test_bf16_sampler_tracks_the_fp32_trainer_through_training(mixed) -> None:
    """The sampler's logprobs stay within bf16 rounding of the trainer's before and after a step
    that moves the policy by far more than that rounding: the copy is refreshed with the new LoRA
    weights and the (small) LoRA delta is not rounded away against the bf16 base weights."""
    client = mixed
    params = types.SamplingParams(max_tokens=8, seed=0, temperature=1.0)
    before = client.save_weights_and_get_sampling_client()
    seqs = before.sample(types.ModelInput.from_ints(PROMPT), 4, params).result().sequences
    gaps, old_lp = [], []
    for s in seqs:
        trainer = _trainer_logprobs(client, PROMPT + s.tokens)[len(PROMPT) - 1:]
        gaps.append(_logprob_gap(s.logprobs, trainer))
        old_lp.append(trainer)
    bf16_gap = max(gaps)
    assert 0 < bf16_gap < 0.02  # bf16 is not fp32, but close (0.0014 here)

    # Train on the sampled tokens: raise their likelihood
    data = [types.Datum(types.ModelInput.from_ints((PROMPT + s.tokens)[:-1]),
                        {"target_tokens": types.TensorData.from_torch(torch.tensor((PROMPT + s.tokens)[1:])),
                         "weights": types.TensorData.from_torch(
                             torch.tensor([0.0] * (len(PROMPT) - 1) + [1.0] * len(s.tokens)))}) for s in seqs]
    for _ in range(3):
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=3e-3)).result()
    after = client.save_weights_and_get_sampling_client()
    moved, gaps_after = [], []
    for s, old in zip(seqs, old_lp, strict=True):
        full = PROMPT + s.tokens
        trainer = _trainer_logprobs(client, full)[len(PROMPT) - 1:]
        sampler = after.compute_logprobs(types.ModelInput.from_ints(full)).result()[len(PROMPT):]
        moved.append(max(a - b for a, b in zip(trainer, old, strict=True)))
        gaps_after.append(_logprob_gap(sampler, trainer))
    assert min(moved) > 20 * bf16_gap  # the policy moved well beyond bf16 noise ...
    assert max(gaps_after) < 0.02  # ... and the bf16 sampler moved with it
    # The sampling client made before the steps still samples its own weights
    again = before.sample(types.ModelInput.from_ints(PROMPT), 4, params).result().sequences
    assert [s.tokens for s in again] == [s.tokens for s in seqs]
    assert [s.logprobs for s in again] == [s.logprobs for s in seqs]
