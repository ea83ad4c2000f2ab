"""Sampling through LoRA side paths where the fold is not exact (folded_lora.SidePathAdapter): bf16
base weights and no sampler copy of their own, the layout of a GPU's bf16 sampler, run here on the
CPU. The side path computes what the trainer's LoRA layer computes, shares the base weights, and
follows the adapter's versions and snapshots."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import Linear as LoraLinear
from torch import nn

from grpo import types
from grpo.backends.local import ServiceClient
from grpo.backends.local.folded_lora import SidePathAdapter, can_fold, can_side_path
from grpo.models.lora_linear import LoraSidePath, fuse_lora_linears


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(24, 40, bias=True, dtype=torch.bfloat16)
        self.down = nn.Linear(40, 24, bias=False, dtype=torch.bfloat16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _bf16_peft(alpha: int, use_dora: bool = False):
    torch.manual_seed(0)
    model = get_peft_model(TwoLayers(), LoraConfig(r=4, lora_alpha=alpha, target_modules=["up", "down"],
                                                   use_dora=use_dora))
    for module in model.modules():  # (peft starts B at zero: a random B makes the LoRA term count)
        if isinstance(module, LoraLinear):
            nn.init.normal_(module.lora_B["default"].weight, std=0.5)
    fuse_lora_linears(model)
    return model


@pytest.mark.parametrize("alpha, exact", [(8, True), (6, False)])
def test_side_paths_compute_the_trainers_lora_layers(alpha, exact):
    model = _bf16_peft(alpha)
    assert can_side_path(model, "default") and not can_fold(model, "default")
    x = torch.randn(7, 24, dtype=torch.bfloat16)
    base_up = model.base_model.model.up.base_layer
    with torch.inference_mode():
        trained = model(x)
        side = SidePathAdapter(model, "default", None, key=("default", 0, None))
        with side.installed(model) as installed:
            assert isinstance(installed.base_model.model.up, LoraSidePath)
            assert installed.base_model.model.up.base is base_up  # the base Linear itself: no copy
            sampled = installed(x)
    assert type(model.base_model.model.up) is LoraLinear  # restored on exit
    if exact:  # a power-of-two scale (alpha / r = 2) moves from the rank-side product into B exactly
        assert torch.equal(sampled, trained)
    else:  # 1.5: B * 1.5 rounded to bf16 once, against (x A^T) * 1.5 rounded at every call
        torch.testing.assert_close(sampled.float(), trained.float(), rtol=2e-2, atol=2e-2)
        assert not torch.equal(sampled, trained)


def test_side_paths_take_a_snapshots_weights_not_the_live_ones():
    model = _bf16_peft(8)
    snapshot = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    x = torch.randn(5, 24, dtype=torch.bfloat16)
    with torch.inference_mode():
        before = model(x)
    with torch.no_grad():  # the live adapter moves on
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(1.0)
    with torch.inference_mode(), SidePathAdapter(model, "default", snapshot, ("default", id(snapshot))).installed(model) as m:
        assert torch.equal(m(x), before)


def test_no_side_paths_for_dora():
    assert not can_side_path(_bf16_peft(8, use_dora=True), "default")


def test_engine_samples_bf16_through_side_paths_where_it_keeps_no_copy():
    """The engine's sampler where it has no copy of its own (a GPU's bf16 layout; on a CPU bf16
    sampling keeps one, so the copy is taken away here): side paths installed, built once per
    weights, rebuilt after a step, and the sampled logprobs those of the trainer's own forward."""
    service = ServiceClient(device="cpu", dtype="bf16")
    client = service.create_lora_training_client("tiny", seed=0, rank=4)
    engine = client.engine
    engine._sampler_copy = None  # (the layout CUDA runs: engine.py makes the copy on a CPU only)
    with torch.no_grad():  # a LoRA that counts
        for n, p in engine.peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.02)
    prompt = [1, 5, 9, 14, 3]
    sampler = client.save_weights_and_get_sampling_client()
    result = sampler.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=6, seed=0)).result()
    first = engine._side_paths
    assert first is not None and engine._folded is None and first.replacements
    assert all(type(m) is LoraLinear for n, m in engine.peft_model.named_modules() if n in first.replacements)
    for seq in result.sequences:
        tokens = prompt + seq.tokens
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
        trained = client.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        # the sampler's steps one token at a time against the trainer's whole sequence: bf16 rounding apart
        assert seq.logprobs == pytest.approx(trained[len(prompt) - 1:], abs=0.1)
    sampler.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=2, seed=0)).result()
    assert engine._side_paths is first  # the same weights: reused
    client.forward_backward([datum], "cross_entropy").result()
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    client.save_weights_and_get_sampling_client().sample(
        types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=2, seed=0)).result()
    assert engine._side_paths is not first and engine._side_paths.key != first.key  # the new weights
