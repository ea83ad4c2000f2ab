"""oneDNN Linears (grpo/models/cpu_linear.py) compute what nn.Linear computes, forward and backward,
and every CPU float32 model grpo loads uses them unless GRPO_CPU_LINEAR=torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from grpo import models
from grpo.backends.local import ServiceClient
from grpo.backends.local.engine import Engine, LoraSpec
from grpo.models import cpu_linear
from grpo.models.cpu_linear import OneDNNLinear, PackedLinear
from grpo.models.fused_projections import FusedMember
from grpo.rl.advantages import build_datum
from grpo.rl.rollouts import Rollout
from grpo.types import Datum, ModelInput, SamplingParams

pytestmark = pytest.mark.skipif(not cpu_linear.onednn_works(), reason="this torch build has no oneDNN linear kernel")
# bf16 where this CPU packs bf16 weights (oneDNN refuses without avx512bw/vl/dq or avx_ne_convert)
PACKED_DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not cpu_linear.packing_works(torch.bfloat16), reason="this CPU/torch build packs no bf16 weights"))]


def _pair(in_features: int, out_features: int, bias: bool, seed: int = 0) -> tuple[nn.Linear, OneDNNLinear]:
    torch.manual_seed(seed)
    plain = nn.Linear(in_features, out_features, bias=bias)
    fast = OneDNNLinear(in_features, out_features, bias=bias)
    fast.load_state_dict(plain.state_dict())
    return plain, fast


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7, 48), (3, 5, 48), (0, 48)])
def test_forward_equals_nn_linear(shape, bias):
    plain, fast = _pair(48, 96, bias)
    x = torch.randn(shape)
    torch.testing.assert_close(fast(x), plain(x), rtol=1e-5, atol=1e-5)


def test_non_contiguous_input():
    plain, fast = _pair(48, 96, True)
    x = torch.randn(48, 6).t()  # a transposed view, as attention outputs can be
    assert not x.is_contiguous()
    torch.testing.assert_close(fast(x), plain(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("train_weight", [True, False])
def test_gradients_equal_nn_linear(train_weight):
    """The input's gradient always (base weights are frozen); weight and bias gradients when the
    layer trains (LoRA's A and B)."""
    plain, fast = _pair(48, 96, True)
    for m in (plain, fast):
        m.requires_grad_(train_weight)
    x = torch.randn(2, 5, 48)
    upstream = torch.randn(2, 5, 96)
    grads = []
    for m in (plain, fast):
        xi = x.clone().requires_grad_(True)
        (m(xi) * upstream).sum().backward()
        grads.append((xi.grad, m.weight.grad, m.bias.grad))
    (gx_p, gw_p, gb_p), (gx_f, gw_f, gb_f) = grads
    torch.testing.assert_close(gx_f, gx_p, rtol=1e-5, atol=1e-5)
    if train_weight:
        torch.testing.assert_close(gw_f, gw_p, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gb_f, gb_p, rtol=1e-5, atol=1e-5)
    else:
        assert gw_f is None and gb_f is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_dense_product_is_x_times_w_transposed(dtype):
    """What the floors time each kernel by (scripts/hardware_floors.py): the same product, a
    transposed weight view (the input gradient's) too."""
    products = cpu_linear.dense_products(dtype)
    assert "torch" in products and ("onednn" in products) <= cpu_linear.onednn_works()
    if dtype == torch.float32:
        assert ("onednn" in products) == cpu_linear.onednn_works()
    gen = torch.Generator().manual_seed(0)
    x, w, g = (torch.randn(shape, generator=gen).to(dtype) for shape in ((7, 16), (24, 16), (7, 24)))
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for name, product in products.items():
        torch.testing.assert_close(product(x, w).float(), (x.float() @ w.float().t()), **tol, msg=name)
        torch.testing.assert_close(product(g, w.t()).float(), (g.float() @ w.float()), **tol, msg=name)


def test_other_dtypes_take_nn_linears_path():
    plain, fast = _pair(48, 96, True)
    plain.to(torch.bfloat16)
    fast.to(torch.bfloat16)
    x = torch.randn(4, 48, dtype=torch.bfloat16)
    assert torch.equal(fast(x), plain(x))


def test_loaded_models_use_onednn_and_keep_their_state_dict():
    model = models.load_model("tiny", device="cpu")
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is OneDNNLinear for m in linears)
    keys = set(model.state_dict())
    assert cpu_linear.use_torch_linears(model) == len(linears)
    assert set(model.state_dict()) == keys


def test_env_switch(monkeypatch):
    monkeypatch.setenv(cpu_linear.ENV_SWITCH, "torch")
    model = models.load_model("tiny", device="cpu")
    assert not any(type(m) is OneDNNLinear for m in model.modules())
    monkeypatch.setenv(cpu_linear.ENV_SWITCH, "mkl")
    with pytest.raises(ValueError, match="GRPO_CPU_LINEAR='mkl'.*'onednn'.*'torch'"):
        models.load_model("tiny", device="cpu")


def _datums(tokenizer) -> list[Datum]:
    prompt = tokenizer.encode("What is 2 + 3?")
    out = []
    for k, response in enumerate([" 5", " It is five.", " 6, I think"]):
        tokens = tokenizer.encode(response)
        rollout = Rollout(tokens=tokens, logprobs=[-1.0] * len(tokens), stop_reason="stop", text=response)
        out.append(build_datum(prompt, rollout, [0.5 - 0.4 * k] * len(tokens)))
    return out


def test_training_and_sampling_match_pytorch_kernels():
    """A LoRA forward_backward and a seeded sample through the engine agree, to float rounding,
    between oneDNN Linears (the default) and PyTorch's own: same loss, same gradients, and the
    sampler's logprobs of the same tokens."""
    service = ServiceClient(device="cpu", dtype="fp32")  # oneDNN Linears are the fp32 path
    tc = service.create_lora_training_client("tiny", rank=4, seed=0)
    engine = tc.engine
    model = engine.peft_model
    assert all(type(m) is OneDNNLinear for m in model.modules() if isinstance(m, nn.Linear))
    datums = _datums(tc.get_tokenizer())
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3)
    prompt = ModelInput.from_ints(tc.get_tokenizer().encode("Count: 1, 2,"))

    def run() -> tuple[float, dict[str, torch.Tensor], list[int], list[float]]:
        for p in engine.adapter_parameters(tc.adapter).values():
            p.grad = None
        out = tc.forward_backward(datums, "ppo").result()
        grads = {n: p.grad.clone() for n, p in engine.adapter_parameters(tc.adapter).items()}
        engine._folded = None  # fold afresh, with whichever Linear class is in place
        seq = tc.save_weights_and_get_sampling_client().sample(prompt, 1, params).result().sequences[0]
        return out.metrics["loss:sum"], grads, seq.tokens, seq.logprobs

    loss_fast, grads_fast, tokens_fast, lp_fast = run()
    assert cpu_linear.use_torch_linears(model) > 0
    loss_torch, grads_torch, tokens_torch, lp_torch = run()
    assert loss_fast == pytest.approx(loss_torch, rel=1e-5)
    for name, g in grads_torch.items():
        torch.testing.assert_close(grads_fast[name], g, rtol=1e-4, atol=1e-6, msg=name)
    assert tokens_fast == tokens_torch
    assert lp_fast == pytest.approx(lp_torch, abs=1e-5)


def test_folding_packs_the_folded_weights():
    engine = Engine("tiny", device="cpu", dtype="fp32")
    engine.add_adapter("policy", LoraSpec(rank=4))
    layer = engine.peft_model.get_submodule("base_model.model.model.layers.0.self_attn.q_proj")
    with torch.no_grad():  # a non-zero B, so that the fold is seen
        layer.lora_B["policy"].weight.normal_(std=0.1)
    expected_weight = (layer.base_layer.weight
                       + layer.scaling["policy"] * layer.lora_B["policy"].weight @ layer.lora_A["policy"].weight).detach()
    x = torch.randn(2, 3, 64)
    with engine.sampling_model("policy") as model:
        assert engine._folded is not None  # can_fold accepted OneDNNLinear bases
        folded = [m for m in model.modules() if isinstance(m, PackedLinear)]  # o_proj, down_proj
        assert folded and not [m for m in model.modules() if hasattr(m, "lora_A")]
        # q/k/v (and gate/up) folded into one stacked packed weight, each a member reading its slice
        q = model.get_submodule("base_model.model.model.layers.0.self_attn.q_proj")
        assert type(q) is FusedMember and q.group.sizes == [64, 32, 32] and q.group.packed.is_mkldnn
        torch.testing.assert_close(q(x), F.linear(x, expected_weight, layer.base_layer.bias), rtol=1e-5, atol=1e-5)
    # the LoRA layers are back in place for training
    assert type(engine.peft_model.get_submodule("base_model.model.model.layers.0.self_attn.q_proj")) is not PackedLinear


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
@pytest.mark.parametrize("shape", [(1, 48), (5, 48), (33, 48), (4, 1, 48), (2, 7, 48)])
def test_packed_linear_equals_linear(dtype, shape):
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 48, dtype=dtype), torch.randn(96, dtype=dtype)
    x = torch.randn(shape, dtype=dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    out = PackedLinear(weight, bias)(x)
    assert out.dtype == dtype and out.shape == (*shape[:-1], 96)
    torch.testing.assert_close(out.float(), F.linear(x.float(), weight.float(), bias.float()), rtol=tolerance,
                               atol=tolerance * 10)


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
@pytest.mark.parametrize("shape", [(1, 48), (13, 48), (4, 1, 48)])
def test_packed_lora_side_path_adds_what_addmm_adds(dtype, shape):
    """The sampler's LoRA side path through packed A and B (the sum in oneDNN's post-op) against
    the addmm_ path it replaces: equal up to the dtype's rounding."""
    from grpo.models.lora_linear import LoraSidePath

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 48, generator=gen).to(dtype)
    a, b = torch.randn(8, 48, generator=gen), torch.randn(96, 8, generator=gen) * 0.1
    x = torch.randn(shape, generator=gen).to(dtype)
    packed = LoraSidePath(PackedLinear(weight, None), a, b, 2.0, dtype)
    if packed.product.packed is None:
        pytest.skip("this CPU packs no such weights")
    plain = LoraSidePath(PackedLinear(weight, None), a, b, 2.0, dtype)
    plain.product.packed = None
    with torch.no_grad():
        got, want = packed(x), plain(x)
    assert got.shape == want.shape == (*shape[:-1], 96) and got.dtype == dtype
    reference = F.linear(x.float(), weight.float()) + 2.0 * F.linear(F.linear(x.float(), a), b)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance * 10)
    torch.testing.assert_close(got.float(), reference, rtol=tolerance, atol=tolerance * 10)


def test_packed_lora_side_path_needs_packable_weights(monkeypatch):
    monkeypatch.setattr(cpu_linear, "packing_works", lambda dtype: False)
    assert cpu_linear.LoraSideProduct(torch.randn(4, 8), torch.randn(8, 4)).packed is None


def test_pack_for_inference_replaces_linears_and_keeps_tied_weights():
    model = models.load_model("tiny", "cpu", torch.float32)
    x = torch.randint(0, 100, (2, 9))
    with torch.no_grad():
        expected = model(input_ids=x).logits
        assert cpu_linear.pack_for_inference(model) > 0
        assert not [m for m in model.modules() if type(m) in (nn.Linear, OneDNNLinear)]
        torch.testing.assert_close(model(input_ids=x).logits, expected, rtol=1e-5, atol=1e-5)


def test_inference_packed_layer_repacks_after_an_in_place_write():
    _, fast = _pair(48, 96, True)
    fast.weight.requires_grad_(False)
    fast.inference_packed = True
    x = torch.randn(3, 48)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), F.linear(x, fast.weight, fast.bias), rtol=1e-5, atol=1e-5)
        fast.weight.mul_(2.0)  # as folding writes: in place
        torch.testing.assert_close(fast(x), F.linear(x, fast.weight, fast.bias), rtol=1e-5, atol=1e-5)


def test_a_cpu_that_cannot_pack_keeps_plain_layers(monkeypatch):
    # e.g. a bf16 layout refused on a CPU without bf16 instructions: nothing is packed, all still runs
    monkeypatch.setattr(cpu_linear, "packing_works", lambda dtype: False)
    model = models.load_model("tiny", "cpu", torch.float32)
    x = torch.randint(0, 100, (2, 5))
    with torch.no_grad():
        expected = model(input_ids=x).logits
        assert cpu_linear.pack_for_inference(model) == 0
        assert cpu_linear.keep_packed_copies([model.get_output_embeddings()]) == 0
        torch.testing.assert_close(model(input_ids=x).logits, expected)


def test_a_bf16_copy_of_a_packed_layer_multiplies_by_its_weight_where_bf16_does_not_pack(monkeypatch):
    """The bf16 sampler copies the fp32 model, whose unembedding keeps a packed copy: on a CPU that
    packs no bf16 weight (oneDNN: no avx512bw/vl/dq, no avx_ne_convert) the copy's layer must not
    try to, but multiply by its weight as it is."""
    plain, fast = _pair(48, 96, bias=False)
    assert cpu_linear.keep_packed_copies([fast]) == 1 and fast.inference_packed
    fast.weight.data = fast.weight.data.bfloat16()
    real_pack = cpu_linear.pack_weight

    def refusing(weight):
        if weight.dtype == torch.bfloat16:
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")
        return real_pack(weight)

    monkeypatch.setattr(cpu_linear, "pack_weight", refusing)
    monkeypatch.setattr(cpu_linear, "packing_works", lambda dtype: dtype == torch.float32)
    x = torch.randn(5, 48).bfloat16()
    with torch.no_grad():
        assert torch.equal(fast(x), F.linear(x, fast.weight))
