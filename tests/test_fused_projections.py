"""Sibling projections (q/k/v, gate/up) as one matmul: the same outputs as each Linear alone.

References: the Linears' own forward (and ``base + scaling * (x @ A.T) @ B.T`` written out for
LoRA), on the packaged tiny model and on hand-made inputs.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from grpo import models
from grpo.models import fused_projections
from grpo.models.cpu_linear import packing_works
from grpo.models.fused_projections import FusedMember, FusedProjections, fuse_siblings, stackable

CPU = torch.device("cpu")
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not packing_works(torch.bfloat16), reason="this CPU/torch build packs no bf16 weights"))]


def _fused_copy(model: nn.Module) -> tuple[nn.Module, list[FusedProjections]]:
    fused = copy.deepcopy(model)
    return fused, list(fuse_siblings(fused).values())


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_model_with_fused_siblings_computes_what_it_did(dtype) -> None:
    torch.manual_seed(0)
    model = models.load_model("tiny", CPU, dtype).eval()
    fused, groups = _fused_copy(model)
    layers = model.config.num_hidden_layers
    assert len(groups) == 2 * layers  # q/k/v and gate/up in every layer
    assert isinstance(fused.model.layers[0].self_attn.k_proj, FusedMember)
    ids = torch.randint(3, 1000, (2, 9))
    with torch.no_grad():
        want, got = model(input_ids=ids).logits.float(), fused(input_ids=ids).logits.float()
    torch.testing.assert_close(got, want, atol=1e-4 if dtype == torch.float32 else 2e-2, rtol=1e-4)
    assert all(g._input is None for g in groups)  # no layer's activations held once it is done


def _group(gen: torch.Generator, dtype, sizes=(12, 4, 4), fan_in=16):
    weights = [torch.randn(n, fan_in, generator=gen) for n in sizes]
    return weights, FusedProjections(torch.cat(weights).to(dtype), None, list(sizes))


@pytest.mark.parametrize("dtype", DTYPES)
def test_stacked_lora_side_paths_equal_each_members_own(dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    weights, group = _group(gen, dtype)
    loras = [(torch.randn(r, 16, generator=gen), torch.randn(w.shape[0], r, generator=gen), s)
             for w, r, s in zip(weights, (2, 3, 2), (2.0, 0.5, 1.0), strict=True)]
    group.set_lora(loras)
    x = torch.randn(5, 16, generator=gen).to(dtype)
    with torch.no_grad():
        got = [group.output(x, i).float() for i in range(3)]
    xf = x.float()
    for out, w, (a, b, s) in zip(got, weights, loras, strict=True):
        want = xf @ w.to(dtype).float().T + s * (xf @ a.T) @ b.T
        tolerance = 1e-4 if dtype == torch.float32 else 0.15  # bf16: 8 bits of mantissa, sums of 16
        torch.testing.assert_close(out, want, atol=tolerance, rtol=tolerance)
    group.set_lora(None)
    with torch.no_grad():
        torch.testing.assert_close(group.output(x, 0).float(), xf @ weights[0].to(dtype).float().T,
                                   atol=1e-4 if dtype == torch.float32 else 0.15, rtol=1e-2)


def test_a_sibling_without_lora_gets_none() -> None:
    """An adapter on q and v only (a common target_modules): k's output is its base product."""
    gen = torch.Generator().manual_seed(2)
    weights, group = _group(gen, torch.float32)
    a, b = torch.randn(2, 16, generator=gen), torch.randn(12, 2, generator=gen)
    a_v, b_v = torch.randn(2, 16, generator=gen), torch.randn(4, 2, generator=gen)
    group.set_lora([(a, b, 2.0), (torch.zeros(0, 16), torch.zeros(4, 0), 1.0), (a_v, b_v, 2.0)])
    x = torch.randn(3, 16, generator=gen)
    with torch.no_grad():
        q, k, v = (group.output(x, i) for i in range(3))
    torch.testing.assert_close(k, x @ weights[1].T, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(q, x @ weights[0].T + 2.0 * (x @ a.T) @ b.T, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v, x @ weights[2].T + 2.0 * (x @ a_v.T) @ b_v.T, atol=1e-4, rtol=1e-4)


def test_members_called_in_any_order_or_on_new_inputs_get_their_own_product(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(3)
    weights, group = _group(gen, torch.float32)
    products = []
    real = fused_projections.packed_product
    monkeypatch.setattr(fused_projections, "packed_product", lambda *a: products.append(1) or real(*a))
    x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 16, generator=gen)
    with torch.no_grad():
        for i in (2, 0, 1):  # one product serves all three, whatever the order
            torch.testing.assert_close(group.output(x, i), x @ weights[i].T, atol=1e-5, rtol=1e-5)
        assert len(products) == 1 and group._input is None
        group.output(x, 0)
        torch.testing.assert_close(group.output(y, 1), y @ weights[1].T, atol=1e-5, rtol=1e-5)  # another input
        torch.testing.assert_close(group.output(y, 1), y @ weights[1].T, atol=1e-5, rtol=1e-5)  # the same member twice
        group.output(x, 0)
        x.mul_(2)  # written in place since its product: computed again
        torch.testing.assert_close(group.output(x, 1), x @ weights[1].T, atol=1e-5, rtol=1e-5)
    assert len(products) == 6


def test_only_plain_linears_of_one_width_and_dtype_are_stacked() -> None:
    assert stackable([nn.Linear(8, 4, bias=False), nn.Linear(8, 2, bias=False)])
    assert not stackable([nn.Linear(8, 4), nn.Linear(6, 2)])  # other input widths
    assert not stackable([nn.Linear(8, 4), nn.Linear(8, 2, bias=False)])  # a bias on one only
    assert not stackable([nn.Linear(8, 4), nn.Linear(8, 2).to(torch.float64)])
