"""A hybrid's training pass packed in one row (packed_recurrence.py): the delta rule's kernel over
segments computes what it computes over each sequence alone; a packed pass of a Qwen3.5 -- sequences
back to back, answers continuing their prompt, prompts a system prompt -- computes each whole
sequence as run alone, gradients included; and the trainer's packed micro-batches equal its padded
ones, which test_prefix_sharing checks against the unshared path and plain forwards."""

from __future__ import annotations

import pytest
import torch
from backend_helpers import perturb_adapter, reference_function, tiny_qwen3_5
from test_packed_attention import assert_packed_equals_padded, run_trainer
from test_prefix_sharing import grpo_batch
from test_recurrent_prefix import tiny_qwen3_next
from transformers.models.qwen3_5 import modeling_qwen3_5

from grpo.backends.local import (
    ServiceClient,
    delta_rule,
    packed_attention,
    packed_recurrence,
    trainer,
)

CPU = torch.device("cpu")


def _segment_inputs(rows: int, positions: int, states: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(rows, positions, 2, 8, generator=generator) for _ in range(2))
    v = torch.randn(rows, positions, 4, 8, generator=generator)
    g = -torch.rand(rows, positions, 4, generator=generator)
    beta = torch.rand(rows, positions, 4, generator=generator)
    initial = 0.1 * torch.randn(states, 4, 8, 8, generator=generator)
    return q, k, v, g, beta, initial


def test_segments_compute_each_sequence_as_the_kernel_does_alone(native_ops) -> None:
    """Segments on two rows, in chunks of their own, two of them from the same initial state, one
    from none: each segment's output, final state and gradients are those of its sequence run alone
    (the same bits), positions outside every segment zeros, and a state read twice gets both
    segments' gradients."""
    q, k, v, g, beta, initial = _segment_inputs(2, 20, 2)
    # row, start, length, chunk, state
    segments = torch.tensor([[0, 0, 5, 5, -1], [0, 5, 9, 4, 0], [0, 14, 3, 3, 1], [1, 2, 12, 6, 0]])
    out, final = native_ops.chunk_delta_rule(q, k, v, g, beta, initial, 1, True, True, segments)
    grad_out, grad_final = torch.randn_like(out), torch.randn_like(final)
    grads = native_ops.chunk_delta_rule_backward(grad_out, grad_final, q, k, v, g, beta, initial, 1, True, segments)
    covered = torch.zeros(2, 20, dtype=torch.bool)
    for i, (row, start, length, chunk, state) in enumerate(segments.tolist()):
        cut = (slice(row, row + 1), slice(start, start + length))
        covered[cut] = True
        alone = [x[cut].contiguous() for x in (q, k, v, g, beta)]
        own = initial[state:state + 1] if state >= 0 else None
        want_out, want_final = native_ops.chunk_delta_rule(*alone, own, chunk, True, True)
        assert torch.equal(out[cut], want_out) and torch.equal(final[i], want_final[0])
        want = native_ops.chunk_delta_rule_backward(grad_out[cut].contiguous(), grad_final[i:i + 1].contiguous(),
                                                    *alone, own, chunk, True)
        for got_grad, want_grad in zip(grads[:5], want[:5], strict=True):
            assert torch.equal(got_grad[cut], want_grad)
        if state >= 0:
            assert torch.equal(grads[5][i], want[5][0])
    assert not out[~covered].any() and not any(x[~covered].any() for x in grads[:5])
    # through autograd: state 0 read by segments 1 and 3
    leaf = initial.clone().requires_grad_()
    out, final = delta_rule._native_segments(q, k, v, g, beta, leaf, segments, True, True)
    (out * grad_out).sum().add((final * grad_final).sum()).backward()
    torch.testing.assert_close(leaf.grad[0], grads[5][1] + grads[5][3], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(leaf.grad[1], grads[5][2], rtol=0, atol=0)


def test_segments_are_checked(native_ops) -> None:
    q, k, v, g, beta, initial = _segment_inputs(1, 10, 1)
    with pytest.raises(RuntimeError, match=r"segment 1 \(row 0, start 6, length 5, chunk 5, state 0\) is outside"):
        native_ops.chunk_delta_rule(q, k, v, g, beta, initial, 1, False, True,
                                    torch.tensor([[0, 0, 6, 6, -1], [0, 6, 5, 5, 0]]))
    with pytest.raises(RuntimeError, match="state 1\\) is outside 1 rows of 10 positions and 1 initial states"):
        native_ops.chunk_delta_rule(q, k, v, g, beta, initial, 1, False, True, torch.tensor([[0, 0, 6, 6, 1]]))
    with pytest.raises(RuntimeError, match=r"segments must be a contiguous int64 \[count, 5\]"):
        native_ops.chunk_delta_rule(q, k, v, g, beta, initial, 1, False, True, torch.tensor([[0, 0, 6, 6]]))


@pytest.fixture(scope="module")
def hybrid():
    model, _ = tiny_qwen3_5()
    assert delta_rule.fit_prefill(model) == 2
    return model


def _random_ids(gen: torch.Generator, lengths: list[int]) -> list[torch.Tensor]:
    return [torch.randint(3, 4000, (n,), generator=gen) for n in lengths]


def test_a_hybrids_packed_pass_computes_each_sequence_as_alone(native_ops, hybrid) -> None:
    """A system prompt of two tokens (fewer than the convolution's window), two prompts continuing it
    (one through a sequence of no tokens), answers continuing the prompts, and a lone sequence, in one
    row: every answer's hidden states
    are those of its whole sequence run alone, and the parameters' gradients of a loss on the
    answers are those of the same loss on the whole sequences."""
    assert packed_attention.supports(hybrid)
    decoder = hybrid.get_decoder()
    gen = torch.Generator().manual_seed(3)
    trunk, prompts, lone = _random_ids(gen, [2])[0], _random_ids(gen, [6, 1]), _random_ids(gen, [9])[0]
    owners, answer_lengths = [0, 1, 0, 1], [4, 7, 1, 3]
    answers = _random_ids(gen, answer_lengths)
    # trunk, lone, an empty sequence, the prompts (continuing the trunk, the first through the empty one),
    # the answers (continuing their prompt)
    lengths = [2, 9, 0, 6, 1, *answer_lengths]
    packed = packed_attention.PackedPass(lengths, CPU, continues=[None, None, 0, 2, 0, *[3 + o for o in owners]])
    params = [p for p in decoder.parameters() if p.requires_grad]
    weights = [torch.randn(n, hybrid.config.hidden_size, generator=gen) for n in answer_lengths]

    hidden = torch.split(packed.run(decoder, torch.cat([trunk, lone, *prompts, *answers])), lengths)
    assert packed.recurrent_calls == 3 and packed.calls == 1
    got = torch.autograd.grad(sum((h * w).sum() for h, w in zip(hidden[5:], weights, strict=True)), params)

    wholes = [torch.cat([trunk, prompts[o], a]) for o, a in zip(owners, answers, strict=True)]
    alone = [decoder(input_ids=ids[None]).last_hidden_state[0, -n:] for ids, n in zip(wholes, answer_lengths,
                                                                                      strict=True)]
    for h, want in zip(hidden[5:], alone, strict=True):
        torch.testing.assert_close(h, want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(hidden[1], decoder(input_ids=lone[None]).last_hidden_state[0], atol=1e-5, rtol=1e-4)
    want = torch.autograd.grad(sum((h * w).sum() for h, w in zip(alone, weights, strict=True)), params)
    scale = max(float(w.abs().max()) for w in want)
    assert scale > 0.1
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5 * scale, rtol=1e-4)


def test_a_hybrid_without_grpos_delta_rule_does_not_pack(native_ops, monkeypatch) -> None:
    """Packing needs the linear-attention layers to run grpo's functions, which read the pass: with
    the native kernels off, or transformers' own references, a hybrid trains padded."""
    model, _ = tiny_qwen3_5()
    delta_rule.fit_prefill(model)
    assert delta_rule.packs(model)
    monkeypatch.setenv("GRPO_NATIVE_KERNELS", "off")
    assert not delta_rule.packs(model)
    monkeypatch.delenv("GRPO_NATIVE_KERNELS")
    for name in delta_rule.REFERENCES:
        monkeypatch.setattr(modeling_qwen3_5, name, reference_function(modeling_qwen3_5, name))
    assert not delta_rule.packs(model) and not packed_attention.supports(tiny_qwen3_5()[0])


def test_a_pass_whose_linear_layers_miss_it_is_refused(native_ops, hybrid, monkeypatch) -> None:
    """A layer that does not hand the pass to the delta rule would run it over the whole row, mixing
    the sequences: the pass counts the layers that read it and refuses otherwise."""
    real, seen = packed_recurrence.delta_rule, []

    def one_uncounted(packed, *args):
        out = real(packed, *args)
        packed.recurrent_calls -= not seen  # (the first layer's call goes uncounted)
        seen.append(True)
        return out

    monkeypatch.setattr(packed_recurrence, "delta_rule", one_uncounted)
    with pytest.raises(RuntimeError, match="the packed delta rule ran in 2 of 3 linear-attention layers"):
        packed_attention.PackedPass([3, 4], CPU).run(hybrid.get_decoder(), torch.arange(3, 10))


# --------------------------------------------------------------------------- the trainer, packed vs padded


def _hybrid_client(directory, dtype: str, family: str = "qwen3_5"):
    """A training client on the tiny Qwen3.5 (or Qwen3-Next, saved in ``directory``), its adapter
    perturbed."""
    model, tokenizer = tiny_qwen3_5()
    if family == "qwen3_next":  # (on the same tokenizer)
        model = tiny_qwen3_next(len(tokenizer))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    svc = ServiceClient(checkpoint_dir=directory / "ckpt", device="cpu", dtype=dtype)
    client = svc.create_lora_training_client(str(directory), seed=0)
    perturb_adapter(client, 1)
    return client


@pytest.fixture(scope="module")
def hybrid_client(tmp_path_factory):
    return _hybrid_client(tmp_path_factory.mktemp("qwen3_5"), "float32")


@pytest.mark.parametrize(("loss_fn", "share", "max_tokens", "trunk"),
                         [("ppo", True, None, 0), ("ppo", True, 60, 5), ("importance_sampling", False, None, 0),
                          ("importance_sampling", True, None, 5), ("ppo", False, 60, 0)])
def test_a_hybrids_packed_micro_batches_equal_padded_ones(native_ops, hybrid_client, loss_fn, share, max_tokens,
                                                          trunk) -> None:
    """Groups sharing their prompt (under a system prompt, ``trunk``), cut into micro-batches by a
    budget or not: the packed path's logprobs, loss and gradients are the padded path's."""
    assert packed_attention.supports(hybrid_client.engine.causal_lm())
    assert_packed_equals_padded(hybrid_client, loss_fn, share, max_tokens, trunk)


@pytest.mark.parametrize(("share", "max_tokens"), [(True, None), (True, 60), (False, None)])
def test_qwen3_nexts_packed_micro_batches_equal_padded_ones(native_ops, tmp_path, share, max_tokens) -> None:
    """Qwen3-Next's linear layers (a and b from one projection, experts after them) pack as Qwen3.5's."""
    client = _hybrid_client(tmp_path, "float32", "qwen3_next")
    assert packed_attention.supports(client.engine.causal_lm())
    assert_packed_equals_padded(client, "ppo", share, max_tokens, trunk=5)


def test_a_hybrids_packed_pass_in_bf16_is_its_padded_pass_within_rounding(native_ops, tmp_path) -> None:
    """In bf16 the two paths round in other places (the padded path's left padding, the packed one's
    windows): logprobs agree within bf16's rounding of a tiny model's."""
    client = _hybrid_client(tmp_path, "bf16")
    prepared = trainer.prepare(grpo_batch(seed=5), "ppo", client.engine.vocab_size, client.engine.check_tokens)
    ref, _ = run_trainer(client, prepared, "ppo", None, True, packed=False)
    got, grads = run_trainer(client, prepared, "ppo", None, True, packed=True)
    assert grads
    worst = max(float((a["logprobs"].to_torch() - b["logprobs"].to_torch()).abs().max())
                for a, b in zip(got.loss_fn_outputs, ref.loss_fn_outputs, strict=True))
    assert worst < 0.05
