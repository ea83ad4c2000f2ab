"""The sampler's native token choice draws what its PyTorch path draws and never a token of
probability zero.

``sample_tokens`` (native/sample_tokens.cpp) against a float64 reference of sampler._draw: softmax of
the logits over the temperature, the CDF, the first token whose cumulative mass exceeds u times
the total. Float32 rounding moves a CDF boundary by ~1e-7, so draws landing that close to one are
not compared; every other draw must be the reference's token.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from backend_helpers import sample_each

from grpo.backends.local import ServiceClient, sampler
from grpo.models import native_kernels
from grpo.types import SamplingParams


def _reference(logits: torch.Tensor, temperature: float, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The token of each row by sampler._draw's rule in float64, and how far its draw is from the
    nearest CDF boundary (relative to the total)."""
    probs = torch.softmax(logits.double() / temperature, -1)
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    draw = u[:, None] * total
    token = torch.searchsorted(cdf, draw, right=True)[:, 0]
    margin = ((cdf - draw).abs() / total).min(-1).values
    return token, margin


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_draws_are_the_inverted_cdf_of_the_tempered_softmax(native_ops, temperature) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 3000, generator=gen) * 4
    u = torch.rand(64, dtype=torch.float64, generator=gen)
    tokens, logprobs = native_ops.sample_tokens(logits, torch.full((64,), temperature, dtype=torch.float64), u)
    want, margin = _reference(logits, temperature, u)
    clear = margin > 1e-5
    assert clear.sum() >= 60  # the comparison is not vacuous
    assert torch.equal(tokens[clear], want[clear])
    # the logprob is the untempered policy's, whatever the temperature
    expected = torch.log_softmax(logits.double(), -1).gather(-1, tokens[:, None])[:, 0]
    assert (logprobs.double() - expected).abs().max() < 1e-5


def test_temperature_zero_is_the_first_argmax(native_ops) -> None:
    logits = torch.randn(5, 700, generator=torch.Generator().manual_seed(1))
    logits[2, 10] = logits[2, 300] = logits[2].max() + 1  # tied: the first, as torch.argmax
    tokens, logprobs = native_ops.sample_tokens(logits, torch.zeros(5, dtype=torch.float64),
                                                torch.full((5,), 0.5, dtype=torch.float64))
    assert torch.equal(tokens, logits.argmax(-1)) and tokens[2] == 10
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1).max(-1).values, atol=1e-5)


def test_a_token_of_probability_zero_is_never_drawn(native_ops) -> None:
    """Masked logits (-inf), and draws at the very ends of [0, 1)."""
    logits = torch.full((6, 2000), float("-inf"))
    allowed = [3, 1024, 1999]
    logits[:, allowed] = torch.tensor([0.5, -1.0, 2.0])
    u = torch.tensor([0.0, 1e-12, 0.5, 0.999999, 1 - 2.0**-53, 0.3], dtype=torch.float64)
    tokens, logprobs = native_ops.sample_tokens(logits, torch.ones(6, dtype=torch.float64), u)
    assert set(tokens.tolist()) <= set(allowed)
    assert tokens[0] == 3 and tokens[4] == 1999  # the first and the last token with mass
    assert torch.isfinite(logprobs).all()


@pytest.mark.parametrize("temperature", [1.0, 0.6, 0.0])
def test_bf16_logits_are_drawn_as_their_float32_widening(native_ops, temperature) -> None:
    """A bf16 model's logits read as they are: the same tokens and logprobs, bit for bit, as from the
    float32 copy the sampler made of them before; rows that are views of a wider tensor too."""
    gen = torch.Generator().manual_seed(4)
    wide = (torch.randn(9, 3100, generator=gen) * 5).bfloat16()
    logits = wide[:, :3001]  # (a vocabulary that is no multiple of the kernel's blocks; rows strided)
    temperatures = torch.full((9,), temperature, dtype=torch.float64)
    u = torch.rand(9, dtype=torch.float64, generator=gen)
    tokens, logprobs = native_ops.sample_tokens(logits, temperatures, u)
    want_tokens, want_logprobs = native_ops.sample_tokens(logits.float().contiguous(), temperatures, u)
    assert logprobs.dtype == torch.float32
    assert torch.equal(tokens, want_tokens) and torch.equal(logprobs, want_logprobs)


def test_the_sampler_takes_bf16_logits_with_the_kernels_and_without(monkeypatch, native_ops) -> None:
    logits = (torch.randn(6, 2000, generator=torch.Generator().manual_seed(6)) * 3).bfloat16()
    params = [SamplingParams(max_tokens=4, temperature=[1.0, 0.0][i % 2], seed=10 + i) for i in range(6)]
    native = sampler._choose_tokens(logits, _rows(params), torch.device("cpu"))
    widened = sampler._choose_tokens(logits.float(), _rows(params), torch.device("cpu"))
    assert torch.equal(native[0], widened[0]) and torch.equal(native[1], widened[1])
    monkeypatch.setattr(native_kernels, "kernels", lambda: None)  # PyTorch's path: it widens them first
    eager = sampler._choose_tokens(logits, _rows(params), torch.device("cpu"))
    assert eager[1].dtype == torch.float32
    assert torch.equal(eager[0], native[0]) and (eager[1] - native[1]).abs().max() < 1e-5


def test_bad_input_is_refused_with_what_was_expected(native_ops) -> None:
    ones = torch.ones(2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="sample_tokens: logits must be float32 or bfloat16"):
        native_ops.sample_tokens(torch.zeros(2, 5, dtype=torch.float64), ones, ones)
    with pytest.raises(RuntimeError, match=r"temperatures and uniforms must be float64 \[2\]"):
        native_ops.sample_tokens(torch.zeros(2, 5), ones[:1], ones)
    with pytest.raises(RuntimeError, match="row 1 has temperature -1"):
        native_ops.sample_tokens(torch.zeros(2, 5), torch.tensor([1.0, -1.0], dtype=torch.float64), ones)


def _rows(params: list[SamplingParams]) -> list[SimpleNamespace]:
    """What sampler._choose_tokens reads of a row: its index, its request's params, its generator
    (a seeded request's own)."""
    return [SimpleNamespace(index=i, request=SimpleNamespace(params=p),
                            generator=torch.Generator().manual_seed(p.seed) if p.seed is not None else None)
            for i, p in enumerate(params)]


def test_the_sampler_draws_through_the_kernel_what_its_pytorch_path_draws(monkeypatch, native_ops) -> None:
    """The same uniforms from the same generators, so the same tokens wherever a draw is clear of a
    CDF boundary; greedy rows and logprobs alike."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(12, 4000, generator=gen) * 3
    params = [SamplingParams(max_tokens=4, temperature=[1.0, 0.0, 0.7][i % 3], seed=100 + i if i % 2 else None)
              for i in range(12)]
    torch.manual_seed(5)
    native, native_lp = sampler._choose_tokens(logits, _rows(params), torch.device("cpu"))
    monkeypatch.setattr(native_kernels, "kernels", lambda: None)
    torch.manual_seed(5)
    eager, eager_lp = sampler._choose_tokens(logits, _rows(params), torch.device("cpu"))
    differ = (native != eager).nonzero()[:, 0].tolist()
    assert len(differ) <= 1, differ  # (a draw within ~1e-7 of a boundary may land either side)
    assert all(params[i].temperature != 0 for i in differ)
    same = native == eager
    assert (native_lp[same] - eager_lp[same]).abs().max() < 1e-5


def test_with_top_k_or_top_p_the_sampler_keeps_its_pytorch_path(monkeypatch, native_ops) -> None:
    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(max_tokens=4, temperature=1.0, seed=7), SamplingParams(max_tokens=4, top_k=20, seed=8)]
    native = sampler._choose_tokens(logits[:2], _rows(params), torch.device("cpu"))
    monkeypatch.setattr(native_kernels, "kernels", lambda: None)
    eager = sampler._choose_tokens(logits[:2], _rows(params), torch.device("cpu"))
    assert torch.equal(native[0], eager[0]) and torch.equal(native[1], eager[1])  # bit-equal: one path


def test_a_seeded_request_samples_alike_with_the_kernels_on_and_off_greedy(tmp_path, monkeypatch, native_ops) -> None:
    service = ServiceClient(checkpoint_dir=tmp_path, device="cpu", dtype="fp32")
    tc = service.create_lora_training_client("tiny", rank=4, seed=0)
    greedy, drawn = sample_each(tc, temperature=0.0), sample_each(tc, temperature=1.0, seed=11)
    assert sample_each(tc, temperature=1.0, seed=11) == drawn  # a seeded draw reproduces itself
    monkeypatch.setenv(native_kernels.ENV_SWITCH, "off")
    for (tokens, logprobs), (want, want_logprobs) in zip(sample_each(tc, temperature=0.0), greedy, strict=True):
        assert tokens == want
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-5


def test_the_draws_go_to_each_groups_rows_as_an_index_assignment_per_group_puts_them() -> None:
    """``_draw_inputs`` assembles the batch's temperatures and uniforms in a few calls; they must be
    what assigning each group's draw to its rows would give, whatever order the batch holds them in."""
    params = [SamplingParams(max_tokens=4, temperature=[1.0, 0.0, 0.7, 1.0][i % 4], seed=[3, None, 5, 3][i % 4])
              for i in range(9)]
    for batch_order in ([0, 1, 2, 3, 4, 5, 6, 7, 8], [8, 2, 5, 0, 7, 1, 4, 6, 3]):
        rows = _rows(params)
        batch = [rows[i] for i in batch_order]
        groups: dict[tuple, list[int]] = {}
        for b, row in sorted(enumerate(batch), key=lambda item: item[1].index):
            p = row.request.params
            groups.setdefault((p.temperature, p.top_k, p.top_p, id(row.generator)), []).append(b)
        temperatures, uniforms = sampler._draw_inputs(groups, batch)
        want_t, want_u = torch.zeros(9, dtype=torch.float64), torch.zeros(9, dtype=torch.float64)
        again = _rows(params)  # fresh generators: the same draws
        again_batch = [again[i] for i in batch_order]
        for (temperature, _, _, _), members in groups.items():
            if temperature != 0:
                want_t[members] = float(temperature)
                want_u[members] = torch.rand(len(members), dtype=torch.float64,
                                             generator=again_batch[members[0]].generator)
        assert torch.equal(temperatures, want_t) and torch.equal(uniforms, want_u)
        assert (uniforms[[b for b, row in enumerate(batch) if row.request.params.temperature == 0]] == 0).all()
