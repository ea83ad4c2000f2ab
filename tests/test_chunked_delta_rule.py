"""The gated delta rule over a sequence through the native kernel (native/chunked_delta_rule.cpp,
delta_rule.py's fitted function): outputs, final states and every gradient against autograd through
transformers' reference (``torch_chunk_gated_delta_rule``), and a hybrid's prefill and training."""

from __future__ import annotations

import pytest
import torch
from backend_helpers import reference_function, tiny_qwen3_5
from transformers.models.qwen3_5 import modeling_qwen3_5

from grpo.backends.local import delta_rule


def _reference():
    return reference_function(modeling_qwen3_5, "torch_chunk_gated_delta_rule")


def _inputs(rows, positions, k_heads, v_heads, dim, dtype, state, seed=0, unit=False):
    """Random inputs; ``unit``: q and k of norm 1 already (as a caller that does not ask the rule to
    normalise them gives them: with keys of norm sqrt(dim) the recurrence grows without bound)."""
    generator = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(rows, positions, k_heads, dim, generator=generator) for _ in range(2))
    if unit:
        q, k = (torch.nn.functional.normalize(x, dim=-1) for x in (q, k))
    q, k = q.to(dtype), k.to(dtype)
    v = torch.randn(rows, positions, v_heads, dim, generator=generator).to(dtype)
    g = -torch.rand(rows, positions, v_heads, generator=generator)  # (a log decay: float32, as the layer makes it)
    beta = torch.rand(rows, positions, v_heads, generator=generator).to(dtype)
    initial = torch.randn(rows, v_heads, dim, dim, generator=generator) if state else None
    return [q, k, v, g, beta, initial]


def _run(function, inputs, chunk, final_state, l2norm, seed=1):
    """The function's output and final state, and the gradients of a random weighting of both."""
    leaves = [x.clone().requires_grad_() if x is not None else None for x in inputs]
    out, final = function(*leaves[:5], chunk, leaves[5], final_state, l2norm)
    generator = torch.Generator().manual_seed(seed)
    loss = (out.float() * torch.randn(out.shape, generator=generator)).sum()
    if final_state:
        loss = loss + (final * torch.randn(final.shape, generator=generator)).sum()
    loss.backward()
    return [out, final] + [x.grad if x is not None else None for x in leaves]


def _assert_close(got, want, tolerance=1e-5):
    """Each within ``tolerance`` of its magnitude (or of the mean magnitude, where that is larger)."""
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert (a is None) == (b is None), i
        if a is None:
            continue
        assert a.shape == b.shape, (i, a.shape, b.shape)
        a, b = a.float(), b.float()
        scale = b.abs().mean().item() + 1e-12
        assert ((a - b).abs() <= tolerance * (b.abs() + scale)).all(), (i, ((a - b).abs() / (b.abs() + scale)).max())


CASES = [  # rows, positions, key heads, value heads, dim, a state in, the final state asked for, L2-normalised
    (2, 1, 2, 4, 16, True, True, True),
    (2, 20, 2, 4, 16, False, False, True),
    (2, 70, 2, 4, 16, True, True, True),
    (1, 130, 1, 1, 32, True, True, True),
    (3, 33, 2, 2, 128, True, False, False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}-heads{c[2]}/{c[3]}-dim{c[4]}")
def test_the_kernel_computes_the_references_values_and_gradients(native_ops, dtype, case) -> None:
    """Grouped heads, a state carried in or not, the final state read or not, in fitted chunks (70
    positions: two of 35, the last chunk of 130 shorter) -- each against the reference's chunks of
    the same size."""
    rows, positions, k_heads, v_heads, dim, state, final_state, l2norm = case
    inputs = _inputs(rows, positions, k_heads, v_heads, dim, dtype, state, unit=not l2norm)
    chunk = delta_rule.fitted_chunk(positions)
    want = _run(_reference(), inputs, chunk, final_state, l2norm)
    got = _run(delta_rule._native_chunks, inputs, chunk, final_state, l2norm)
    assert [x.dtype for x in got if x is not None] == [x.dtype for x in want if x is not None]
    if dtype == torch.float32:
        _assert_close(got, want)
        return
    # bfloat16: the output and the gradients of q, k, v and beta are rounded to it, as the reference
    # rounds them, from float32 sums in another order. Each is as close to the float32 truth (the
    # reference on the same values in float32) as the reference's own: within 5% of its error (q's and
    # k's gradients closer, for grouped heads: the reference rounds each value head's share before
    # summing them). The float32 ones (the final state, g's and the state's gradients) within float32
    # rounding of the reference's.
    truth = _run(_reference(), [x.float() if x is not None else None for x in inputs], chunk, final_state, l2norm)
    for i, (a, b, t) in enumerate(zip(got, want, truth, strict=True)):
        if a is None:
            continue
        if a.dtype == torch.float32:
            _assert_close([a], [b])
        else:
            assert (a.float() - t).norm() <= 1.05 * (b.float() - t).norm(), i


def test_the_loops_compute_what_blas_computes(native_ops) -> None:
    """Where PyTorch links no BLAS the kernel's products run as loops: the same values."""
    inputs = _inputs(2, 70, 2, 4, 16, torch.float32, True)
    with_blas = _run(delta_rule._native_chunks, inputs, 35, True, True)
    native_ops.chunk_delta_rule_blas(False)
    try:
        loops = _run(delta_rule._native_chunks, inputs, 35, True, True)
    finally:
        native_ops.chunk_delta_rule_blas(True)
    _assert_close(loops, with_blas)


def test_the_kernel_names_what_is_wrong(native_ops) -> None:
    q, k, v, g, beta, state = _inputs(2, 5, 2, 4, 16, torch.float32, True)
    with pytest.raises(RuntimeError, match="g and beta must be float32"):
        native_ops.chunk_delta_rule(q, k, v, g, beta.double(), state, 5, True, True)
    with pytest.raises(RuntimeError, match="4 value heads over 3 key heads"):
        q3 = torch.zeros(2, 5, 3, 16)
        native_ops.chunk_delta_rule(q3, q3, v, g, beta, state, 5, True, True)
    with pytest.raises(RuntimeError, match=r"initial states must be a contiguous float32 \[states, 4, 16, 16\]"):
        native_ops.chunk_delta_rule(q, k, v, g, beta, state[:, :2], 5, True, True)
    with pytest.raises(RuntimeError, match="1 initial states for 2 rows"):
        native_ops.chunk_delta_rule(q, k, v, g, beta, state[:1], 5, True, True)
    with pytest.raises(RuntimeError, match="q, k and v differ in dtype"):
        native_ops.chunk_delta_rule(q, k, v.bfloat16(), g, beta, state, 5, True, True)
    with pytest.raises(RuntimeError, match="q, k and v must hold each position's heads back to back"):
        native_ops.chunk_delta_rule(q.transpose(2, 3), k, v, g, beta, state, 5, True, True)
    with pytest.raises(RuntimeError, match="q and k at different strides"):
        native_ops.chunk_delta_rule(q, torch.cat([k, k], 1)[:, :5], v, g, beta, state, 5, True, True)
    with pytest.raises(RuntimeError, match="grad_out must be a contiguous Float"):
        native_ops.chunk_delta_rule_backward(v.bfloat16(), None, q, k, v, g, beta, state, 5, True)


def _spied(monkeypatch) -> list[int]:
    """The module's fitted function over a reference that records the chunk sizes it is called with."""
    reference, calls = _reference(), []

    def spy(*args, **kwargs):
        calls.append(args[5] if len(args) > 5 else kwargs.get("chunk_size"))
        return reference(*args, **kwargs)

    monkeypatch.setattr(delta_rule, "_chunk_verdicts", {})
    monkeypatch.setattr(modeling_qwen3_5, "torch_chunk_gated_delta_rule", delta_rule._fitted_chunks(spy))
    return calls


def test_a_hybrid_prefills_and_trains_through_the_kernel_as_through_the_reference(native_ops, monkeypatch) -> None:
    """A model's 70-position pass (two chunks of 35): logits and every parameter's gradient within
    float32 rounding of the reference's; the reference runs once, in the kernel's trial, not for the
    model's three linear-attention layers."""
    model, _ = tiny_qwen3_5()
    model.train()
    ids = torch.tensor([[1, *range(40, 109)], [1, *range(140, 209)]])
    calls = _spied(monkeypatch)
    results = []
    for switch in ("on", "off"):
        monkeypatch.setenv("GRPO_NATIVE_KERNELS", switch)
        model.zero_grad()
        logits = model(input_ids=ids).logits
        logits.float().logsumexp(-1).sum().backward()
        results.append([logits] + [p.grad.clone() for p in model.parameters()])
        if switch == "on":
            assert calls == [4]  # (the trial's chunks of 4)
    assert calls == [4, 35, 35, 35]
    # each within float32 rounding of its largest value, or of the largest gradient where a sum of
    # terms that cancel leaves a small one (the decays' parameters: a few heads' sums over positions)
    largest = max(want.abs().max().item() for want in results[1][1:])
    for got, want in zip(*results, strict=True):
        assert (got - want).abs().max() <= 1e-5 * want.abs().max() + 1e-7 * largest, (got - want).abs().max()


def test_a_kernel_that_fails_its_trial_is_not_taken(native_ops, monkeypatch, capsys) -> None:
    calls = _spied(monkeypatch)
    real = delta_rule._native_chunks
    monkeypatch.setattr(delta_rule, "_native_chunks", lambda *args: (lambda o, s: (o * 1.01, s))(*real(*args)))
    q, k, v, g, beta, state = _inputs(1, 8, 2, 4, 16, torch.float32, True)
    modeling_qwen3_5.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state,
                                                  use_qk_l2norm_in_kernel=True)
    assert calls == [4, 8]  # (the trial's, then the call's own: the reference's)
    assert "did not compute the reference's values in its trial" in capsys.readouterr().err


def test_packed_sequences_go_to_the_reference(native_ops, monkeypatch) -> None:
    """``cu_seqlens`` (sequences packed in one row) is not what the kernel computes: the reference
    is called, and says what it cannot do without flash-linear-attention."""
    calls = _spied(monkeypatch)
    q, k, v, g, beta, _ = _inputs(1, 8, 2, 4, 16, torch.float32, False)
    with pytest.raises(ValueError, match="packed sequences"):
        modeling_qwen3_5.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, cu_seqlens=torch.tensor([0, 3, 8]))
    assert calls == [8]


def test_the_kernels_trial_runs_in_a_no_grad_prefill_too(native_ops, monkeypatch) -> None:
    """The first call of a process may be a sampler's prefill, under inference mode: the trial takes
    its gradients all the same, and the kernel is taken (the reference ran only in the trial)."""
    calls = _spied(monkeypatch)
    inputs = _inputs(2, 9, 2, 4, 16, torch.float32, True)
    with torch.inference_mode():
        out, final = modeling_qwen3_5.torch_chunk_gated_delta_rule(
            *inputs[:3], g=inputs[3], beta=inputs[4], initial_state=inputs[5], output_final_state=True,
            use_qk_l2norm_in_kernel=True)
    assert calls == [4]
    want = _reference()(*inputs[:5], 9, inputs[5], True, True)
    _assert_close([out, final], list(want))
