"""The fused LoRA forward (grpo/models/lora_linear.py) computes peft's LoRA Linear, forward and
gradients, and hands back to peft's own path wherever it does not apply."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import Linear as LoraLinear
from torch import nn

from grpo.backends.local.engine import Engine, LoraSpec
from grpo.models.lora_linear import MARK, fuse_lora_linears


class TwoLayers(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.up = nn.Linear(24, 40, bias=True, dtype=dtype)
        self.down = nn.Linear(40, 24, bias=False, dtype=dtype)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _peft(dropout: float = 0.0, base_dtype: torch.dtype = torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    model = get_peft_model(TwoLayers(base_dtype), LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                                                               target_modules=["up", "down"]))
    # peft starts B at zero; a random B makes the LoRA term count in every comparison
    for module in model.modules():
        if isinstance(module, LoraLinear):
            nn.init.normal_(module.lora_B["default"].weight, std=0.5)
    return model


def _outputs_and_grads(model, x):
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.detach(), grads


@pytest.mark.parametrize("shape", [(5, 24), (2, 3, 24)])
def test_fused_equals_peft_forward_and_gradients(shape):
    reference, fused = _peft(), _peft()
    assert fuse_lora_linears(fused) == 2
    x = torch.randn(shape)
    out_ref, grads_ref = _outputs_and_grads(reference, x)
    out_fused, grads_fused = _outputs_and_grads(fused, x)
    torch.testing.assert_close(out_fused, out_ref, rtol=1e-5, atol=1e-5)
    assert grads_fused.keys() == grads_ref.keys() and any("lora_A" in n for n in grads_ref)
    for name in grads_ref:
        torch.testing.assert_close(grads_fused[name], grads_ref[name], rtol=1e-4, atol=1e-5)


def test_bf16_base_computes_lora_in_bf16_and_reaches_fp32_master_weights():
    fused = _peft(base_dtype=torch.bfloat16)
    fuse_lora_linears(fused)
    lora_a = fused.base_model.model.up.lora_A["default"].weight
    assert lora_a.dtype == torch.float32  # peft keeps the adapter in fp32
    x = torch.randn(6, 24, dtype=torch.bfloat16)
    out, grads = _outputs_and_grads(fused, x)
    assert out.dtype == torch.bfloat16  # no fp32 activations leak out of a bf16 layer
    assert all(g.dtype == torch.float32 for g in grads.values())
    # the same sum in fp32 throughout, from the bf16 weights: equal to bf16 rounding
    with torch.no_grad():
        up, down = fused.base_model.model.up, fused.base_model.model.down

        def layer(m, h):
            s = m.scaling["default"]
            return (m.base_layer(h.bfloat16()).float()
                    + s * (h.float() @ m.lora_A["default"].weight.t()) @ m.lora_B["default"].weight.t())

        expected = layer(down, torch.relu(layer(up, x.float())))
    torch.testing.assert_close(out.float(), expected, rtol=3e-2, atol=3e-2)


def test_peft_path_where_the_fused_one_does_not_apply():
    fused = _peft(dropout=0.5)  # dropout: peft's own forward draws its mask
    fuse_lora_linears(fused)
    fused.train()
    x = torch.randn(4, 24)
    torch.manual_seed(1)
    a = fused(x)
    reference = _peft(dropout=0.5)
    reference.train()
    torch.manual_seed(1)
    torch.testing.assert_close(a, reference(x))

    plain = _peft()
    fuse_lora_linears(plain)
    with plain.disable_adapter():  # a disabled adapter: the base model alone
        base_only = plain.base_model.model.down.base_layer(torch.relu(plain.base_model.model.up.base_layer(x)))
        torch.testing.assert_close(plain(x), base_only)


def test_engine_adapters_use_the_fused_forward():
    engine = Engine("tiny", device="cpu", dtype="fp32")
    engine.add_adapter("first", LoraSpec(rank=4))
    engine.add_adapter("second", LoraSpec(rank=4))  # a second adapter: its layers are the same modules
    layers = [m for m in engine.peft_model.modules() if isinstance(m, LoraLinear)]
    assert layers and all(getattr(m, MARK, False) for m in layers)

