"""Prefix sharing in the local trainer: a group's prompt runs once, results equal the full path.

The reference is the same trainer with ``share_prefixes=False`` (every datum run in full, which
test_local_backend checks against plain forward passes) and, for logprobs, a plain forward pass.
"""

from __future__ import annotations

import pytest
import torch
from backend_helpers import adapter_tensors, perturb_adapter, plain_logprobs, rl_datum

from grpo import types
from grpo.backends.local import ServiceClient, trainer
from grpo.backends.local.trunk import common_trunk

VOCAB = 4000
LOG_UNIFORM = -10.8  # log(1 / 49152), the tiny model's vocabulary


def _tokens(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=gen).tolist()


def _prepare(data: list[types.Datum], loss_fn: str) -> list[trainer.PreparedDatum]:
    return trainer.prepare(data, loss_fn, VOCAB, lambda tokens, what: None)


def grpo_batch(seed: int = 0, trunk: int = 0) -> list[types.Datum]:
    """Groups of 4, 3 and 2 samples (prompts of 20, 13 and 30 tokens, responses of different
    lengths) with a lone datum in between that shares its prompt with nobody. Each datum counts
    from its last prompt position, so the shared prefix is the prompt less its last token.
    ``trunk``: the groups' prompts begin with the same ``trunk`` tokens (a system prompt)."""
    gen = torch.Generator().manual_seed(seed)
    common = _tokens(gen, trunk)
    data = []
    for g, (prompt_len, size) in enumerate([(20, 4), (13, 3), (30, 2)]):
        prompt = common + _tokens(gen, prompt_len)
        for j in range(size):
            response = _tokens(gen, 3 + 4 * j + g)
            # Near the tiny model's own (about uniform) logprobs, so the ratios are O(1), ppo
            # clips some, and the gradients are large enough for the tolerances to bite.
            sampler_lp = (LOG_UNIFORM + 0.2 * torch.randn(len(response), generator=gen)).tolist()
            data.append(rl_datum(prompt, response, advantage=0.5 - 0.3 * j, sampler_logprobs=sampler_lp))
    data.insert(2, rl_datum(_tokens(gen, 15), _tokens(gen, 7), 0.7, [LOG_UNIFORM] * 7))
    return data


# --------------------------------------------------------------------------- planning (no model)


def test_plan_sharing_groups_datums_by_their_uncounted_prefix() -> None:
    prepared = _prepare(grpo_batch(), "importance_sampling")
    groups, alone = trainer.plan_sharing(prepared)
    assert sorted(len(g.prefix) for g in groups) == [12, 19, 29]
    assert sorted(len(g.members) for g in groups) == [2, 3, 4]
    assert [d.index for d in alone] == [2]
    for g in groups:
        for d in g.members:
            assert d.input_ids[:len(g.prefix)] == g.prefix
            assert float(d.inputs["weights"][:len(g.prefix)].sum()) == 0.0
            assert float(d.inputs["weights"][len(g.prefix)]) == 1.0
    # Prefixes shorter than the minimum are not worth a shared pass.
    groups, alone = trainer.plan_sharing(prepared, min_prefix=13)
    assert sorted(len(g.prefix) for g in groups) == [19, 29]
    assert sorted(d.index for d in alone) == [2, 5, 6, 7]


def test_plan_sharing_leaves_datums_without_a_counted_position_or_mask_alone() -> None:
    prompt = list(range(10, 30))
    silent = rl_datum(prompt, [5, 6, 7], 0.0, [-1.0] * 3, weight=0.0)  # nothing counts
    data = [silent, silent, rl_datum(prompt, [8, 9], 1.0, [-1.0] * 2)]
    groups, alone = trainer.plan_sharing(_prepare(data, "importance_sampling"))
    assert groups == [] and [d.index for d in alone] == [0, 1, 2]
    # cross_entropy without weights or advantages counts every position: nothing to share.
    plain = [types.Datum(model_input=types.ModelInput.from_ints(prompt),
                         loss_fn_inputs={"target_tokens": prompt[1:] + [3]})] * 2
    groups, alone = trainer.plan_sharing(_prepare(plain, "cross_entropy"))
    assert groups == [] and len(alone) == 2


def test_shared_micro_batches_count_each_prefix_once_and_split_big_groups() -> None:
    prepared = _prepare(grpo_batch(), "importance_sampling")
    groups, _ = trainer.plan_sharing(prepared)
    big = next(g for g in groups if len(g.members) == 4)  # prefix 19, suffixes 3, 7, 11, 15
    assert [len(d.input_ids) - 19 for d in big.members] == [3, 7, 11, 15]
    assert trainer._shared_cost([big]) == 19 + 4 * 15  # not 4 * 34 as unshared
    assert len(trainer.shared_micro_batches([big], 79)) == 1
    # 45 tokens: 19 + 2 * 7 = 33 fits, 19 + 3 * 11 = 52 does not; then 19 + 2 * 15 = 49 neither.
    parts = trainer.shared_micro_batches([big], 45)
    sizes = sorted(len(u.members) for batch in parts for u in batch)
    assert sizes == [1, 1, 2]
    assert all(trainer._shared_cost(batch) <= 45 for batch in parts)
    members = sorted(d.index for batch in parts for u in batch for d in u.members)
    assert members == sorted(d.index for d in big.members)


# --------------------------------------------------------------------------- exactness (tiny model)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    svc = ServiceClient(checkpoint_dir=tmp_path_factory.mktemp("ckpt"), device="cpu", dtype="float32")
    c = svc.create_lora_training_client("tiny", seed=0)
    perturb_adapter(c, 1)  # nonzero LoRA B, so the adapter (and its gradient) matter
    return c


def _run(client, prepared, loss_fn: str, max_tokens: int, backward: bool, share: bool):
    for p in client.engine.adapter_parameters(client.adapter).values():
        p.grad = None
    with client.engine.use(client.adapter):
        out = trainer.run(client.engine.causal_lm(), prepared, loss_fn, None, client.engine.device,
                          max_tokens, backward, share_prefixes=share)
    grads = {k: v for k, v in adapter_tensors(client, "grad").items() if v is not None}
    return out, grads


@pytest.fixture(scope="module")
def hybrid_client(tmp_path_factory):
    """A tiny Qwen3.5: three gated-delta-rule layers, whose recurrent states fan out, and one
    attention layer."""
    import transformers

    from grpo import models

    directory = tmp_path_factory.mktemp("qwen3_5")
    tokenizer = models.load_tokenizer("tiny")
    config = transformers.Qwen3_5TextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                            linear_value_head_dim=16, layer_types=["linear_attention"] * 3 + ["full_attention"])
    torch.manual_seed(0)
    transformers.Qwen3_5ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    svc = ServiceClient(checkpoint_dir=directory / "ckpt", device="cpu", dtype="float32")
    c = svc.create_lora_training_client(str(directory), seed=0)
    perturb_adapter(c, 1)
    return c


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cross_entropy"])
def test_shared_prefix_equals_unshared_logprobs_loss_and_grads(client, loss_fn) -> None:
    _assert_shared_equals_unshared(client, loss_fn)


@pytest.mark.parametrize(("loss_fn", "budget"), [("importance_sampling", 60), ("ppo", 60), ("ppo", 4096)])
def test_a_hybrids_shared_prefix_fans_out_its_recurrent_states(hybrid_client, loss_fn, budget) -> None:
    """Qwen3.5's prefixes run once, left-padded (its linear layers' states would decay over
    padding after them: at a budget of 4,096 tokens the three prompts, of 12, 19 and 29 shared
    tokens, run in one batch), their states fanned out to the group: the unshared path's results."""
    _assert_shared_equals_unshared(hybrid_client, loss_fn, budget)


def _assert_shared_equals_unshared(client, loss_fn: str, budget: int = 60) -> None:
    data = grpo_batch()
    prepared = trainer.prepare(data, loss_fn, client.engine.vocab_size, client.engine.check_tokens)
    groups, _ = trainer.plan_sharing(prepared)
    batches = trainer.shared_micro_batches(groups, budget)
    if budget == 60:  # splits the 4-sample group (19 + 4 * 15 > 60) and packs the others apart
        assert len([u for batch in batches for u in batch]) > len(groups)
    else:
        assert len(batches) == 1 and len(batches[0]) == len(groups)

    ref, ref_grads = _run(client, prepared, loss_fn, budget, backward=True, share=False)
    got, grads = _run(client, prepared, loss_fn, budget, backward=True, share=True)
    for d, a, b in zip(data, got.loss_fn_outputs, ref.loss_fn_outputs, strict=True):
        lp, want = a["logprobs"].to_torch(), b["logprobs"].to_torch()
        assert lp.shape == (len(d.model_input.to_ints()),)
        assert float((lp - want).abs().max()) <= 1e-5
    assert got.metrics["loss:sum"] == pytest.approx(ref.metrics["loss:sum"], rel=1e-5)
    assert got.metrics["entropy:mean"] == pytest.approx(ref.metrics["entropy:mean"], rel=1e-5)
    assert ref_grads and set(grads) == set(ref_grads)
    assert max(float(g.abs().max()) for g in ref_grads.values()) > 0.1  # atol 1e-5 can bite
    for name, g in ref_grads.items():
        assert torch.allclose(grads[name], g, atol=1e-5, rtol=1e-4), (name, (grads[name] - g).abs().max())

    # Prefix logprobs come from the shared pass but with each datum's own targets (the last
    # prompt position predicts the datum's first response token): check against a plain pass.
    for i in (0, 1, 8):
        tokens = data[i].model_input.to_ints()
        targets = [int(t) for t in data[i].loss_fn_inputs["target_tokens"].data]
        want = plain_logprobs(client, tokens, targets)
        assert float((got.loss_fn_outputs[i]["logprobs"].to_torch() - want).abs().max()) <= 1e-5


def test_shared_forward_matches_and_leaves_no_gradient(client) -> None:
    prepared = trainer.prepare(grpo_batch(seed=1), "ppo", client.engine.vocab_size, client.engine.check_tokens)
    ref, _ = _run(client, prepared, "ppo", 4096, backward=False, share=False)
    got, grads = _run(client, prepared, "ppo", 4096, backward=False, share=True)
    assert not grads
    for a, b in zip(got.loss_fn_outputs, ref.loss_fn_outputs, strict=True):
        assert float((a["logprobs"].to_torch() - b["logprobs"].to_torch()).abs().max()) <= 1e-5
    assert got.metrics["loss:sum"] == pytest.approx(ref.metrics["loss:sum"], rel=1e-5)


def test_a_trunk_every_group_shares_runs_once_and_changes_nothing(client) -> None:
    """Prompts under one system prompt: the trunk runs once per micro-batch, and each group's own
    part of the prompt once, in the one decoder call with the answers; logprobs, loss and
    gradients equal the unshared path."""
    data = grpo_batch(seed=2, trunk=16)
    prepared = trainer.prepare(data, "ppo", client.engine.vocab_size, client.engine.check_tokens)
    groups, _ = trainer.plan_sharing(prepared)
    assert common_trunk([g.prefix for g in groups]) == 16
    assert common_trunk([groups[0].prefix]) == 0  # one group: nothing to share across groups

    embed = client.engine.causal_lm().get_input_embeddings()
    seen: list[int] = []
    hook = embed.register_forward_pre_hook(lambda _m, args: seen.append(args[0].numel()))
    try:
        ref, ref_grads = _run(client, prepared, "ppo", 4096, backward=True, share=False)
        seen.clear()
        got, grads = _run(client, prepared, "ppo", 4096, backward=True, share=True)
    finally:
        hook.remove()
    shared = [d for g in groups for d in g.members]
    lone = [d for d in prepared if d not in shared]
    # one decoder call: the trunk once, each group's prompt past it once, each member's own part
    want = 16 + sum(len(g.prefix) - 16 + sum(len(d.input_ids) - len(g.prefix) for d in g.members) for g in groups)
    assert sorted(seen) == sorted([*(len(d.input_ids) for d in lone), want])
    for a, b in zip(got.loss_fn_outputs, ref.loss_fn_outputs, strict=True):
        assert float((a["logprobs"].to_torch() - b["logprobs"].to_torch()).abs().max()) <= 1e-5
    assert got.metrics["loss:sum"] == pytest.approx(ref.metrics["loss:sum"], rel=1e-5)
    assert set(grads) == set(ref_grads) and max(float(g.abs().max()) for g in ref_grads.values()) > 0.1
    for name, g in ref_grads.items():
        assert torch.allclose(grads[name], g, atol=1e-5, rtol=1e-4), (name, (grads[name] - g).abs().max())
