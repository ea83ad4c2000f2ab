"""The float32 streaming layout (cpu_linear.pack_weight, native_kernels.cpp's stream_linear): the
product it computes, against float64 within the error bound of a sequential float32 sum; its
independence of the other rows; where it is taken and where oneDNN's layout stays; and a sampler
whose weights are packed in it, against the trainer and against oneDNN's layout.
"""

from __future__ import annotations

import pytest
import torch
from backend_helpers import perturb_adapter, rl_datum, sample_each
from torch import nn

from grpo import types
from grpo.backends.local import ServiceClient, native_decode
from grpo.models import cpu_linear, kernel_probe
from grpo.models.cpu_linear import OneDNNLinear, PackedLinear, pack_weight, packed_product

needs_onednn = pytest.mark.skipif(not cpu_linear.onednn_works(), reason="no oneDNN Linear in this torch build")


@pytest.fixture
def ops(native_ops):
    return native_ops


def _within_sum_bound(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """|got - exact| <= (K + 2) u (|x| |w|^T + |b|), u = 2^-24: the bound of a float32 sum of K
    products taken one fused multiply-add at a time, then the bias (Higham, gamma_n)."""
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    scale = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    bound = (x.shape[-1] + 2) * 2.0**-24 * scale
    excess = ((got.double() - exact).abs() - bound).max().item()
    assert excess <= 0, f"{excess} beyond the float32 sum's bound"


# rows: one and a few (a decoding step), a whole block and one more (24 on avx512), beyond two
# blocks (k in slices, panels in pairs), an odd number of panels (48 / 16 = 3)
@pytest.mark.parametrize("rows", [1, 5, 23, 24, 25, 49, 130])
@pytest.mark.parametrize(("out_features", "in_features"), [(48, 7), (960, 576), (32, 300)])
def test_the_product_is_within_a_float32_sums_bound_of_float64(ops, rows, out_features, in_features) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen) * in_features**-0.5
    b = torch.randn(out_features, generator=gen)
    packed = ops.stream_pack(w)
    assert packed.shape == (out_features // 16, in_features, 16)
    _within_sum_bound(ops.stream_linear(x, packed, b), x, w, b)
    _within_sum_bound(ops.stream_linear(x, packed, None), x, w, None)


def test_a_rows_result_is_the_same_alone_or_among_any_other_rows(ops) -> None:
    """Each output is the same sum in the same order whatever the batch: a decoding row's logits
    do not depend on which other rows share its step (unlike a kernel that blocks by row count)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(130, 576, generator=gen)
    w, b = torch.randn(960, 576, generator=gen) * 0.04, torch.randn(960, generator=gen)
    packed = ops.stream_pack(w)
    everything = ops.stream_linear(x, packed, b)
    for rows in ([0], [7, 3], list(range(24)), list(range(100, 130)), list(range(60))):
        assert torch.equal(ops.stream_linear(x[rows], packed, b), everything[rows])


def test_inputs_of_any_leading_shape_and_layout(ops) -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 40, generator=gen)
    packed = ops.stream_pack(w)
    x = torch.randn(3, 1, 40, generator=gen)  # the sampler's [rows, 1, hidden]
    assert ops.stream_linear(x, packed, None).shape == (3, 1, 64)
    wide = torch.randn(5, 80, generator=gen)
    strided = wide[:, ::2]  # not contiguous
    assert torch.equal(ops.stream_linear(strided, packed, None), ops.stream_linear(strided.contiguous(), packed, None))
    assert ops.stream_linear(torch.empty(0, 40), packed, None).shape == (0, 64)


def test_bad_input_is_refused_naming_what_was_expected(ops) -> None:
    w = torch.randn(32, 8)
    with pytest.raises(RuntimeError, match="out_features must be a multiple of 16 \\(got 33\\)"):
        ops.stream_pack(torch.randn(33, 8))
    with pytest.raises(RuntimeError, match="stream_pack: a float32 CPU weight"):
        ops.stream_pack(w.to(torch.bfloat16))
    packed = ops.stream_pack(w)
    with pytest.raises(RuntimeError, match="float32 CPU input with 8 features last"):
        ops.stream_linear(torch.randn(2, 9), packed, None)
    with pytest.raises(RuntimeError, match="a weight from stream_pack"):
        ops.stream_linear(torch.randn(2, 8), w, None)
    with pytest.raises(RuntimeError, match=r"bias must be float32 \[32\]"):
        ops.stream_linear(torch.randn(2, 8), packed, torch.randn(31))


@needs_onednn
def test_pack_weight_takes_the_streaming_layout_only_where_it_applies(ops) -> None:
    """float32 weights whose rows are a multiple of 16; others (bf16, 33 rows) keep oneDNN's, and
    both multiply through packed_product as F.linear does."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 24, generator=gen)
    for w, layout in ((torch.randn(32, 24, generator=gen), "stream"), (torch.randn(33, 24, generator=gen), "onednn")):
        module = PackedLinear(w, None, "stream")
        assert module.layout == layout and f"packed ({layout})" in repr(module)
        assert torch.allclose(module(x), nn.functional.linear(x, w), atol=1e-5)
    assert PackedLinear(torch.randn(32, 24, generator=gen), None).layout == "onednn"  # the default
    if cpu_linear.packing_works(torch.bfloat16):
        assert pack_weight(torch.randn(32, 24).to(torch.bfloat16), "stream").is_mkldnn
    with pytest.raises(ValueError, match="unknown packed layout 'blocked'; valid: onednn, stream"):
        pack_weight(torch.randn(32, 24), "blocked")


@needs_onednn
def test_a_kept_packed_copy_in_the_streaming_layout_follows_its_weight(ops) -> None:
    """The unembedding keeps a packed copy beside the weight training uses: remade after the
    weight changes, in the layout it was marked with."""
    layer = nn.Linear(24, 48, bias=False)
    assert cpu_linear.keep_packed_copies([layer], "stream") == 1
    x = torch.randn(3, 24)
    with torch.no_grad():
        first = layer(x)
        assert not layer._packed.is_mkldnn
        layer.weight.mul_(2)
        assert torch.allclose(layer(x), 2 * first, atol=1e-5)
    assert type(layer) is OneDNNLinear


@pytest.fixture
def stream_layout(monkeypatch, ops):
    """Engines made in the test pack their fp32 sampler in the streaming layout, as on a machine
    that measured it faster (the measurement is kernel_probe's own test's)."""
    if not cpu_linear.onednn_works():
        pytest.skip("no oneDNN Linear in this torch build: the engine packs nothing")
    monkeypatch.setattr(kernel_probe, "decoding_layout", lambda shapes: "stream")


def _trained(tmp_path, layout_name: str):
    service = ServiceClient(checkpoint_dir=tmp_path / layout_name, device="cpu", dtype="float32")
    client = service.create_lora_training_client("tiny", seed=0, rank=8)
    perturb_adapter(client, seed=7, scale=0.2)
    return client


def test_a_sampler_packed_in_the_streaming_layout_samples_what_the_trainer_scores(stream_layout, tmp_path) -> None:
    client = _trained(tmp_path, "stream")
    assert client.engine.fp32_layout == "stream"
    sampling_client = client.save_weights_and_get_sampling_client()
    prompts = [[1, 504, 3458, 314, 253, 1345, 28], [1, 9906, 30]]
    results = [sampling_client.sample(types.ModelInput.from_ints(p), 3, types.SamplingParams(
        max_tokens=10, temperature=1.0, seed=i)).result() for i, p in enumerate(prompts)]
    folded = client.engine._folded.replacements
    assert folded and all(m.group.packed.dim() == 3 if hasattr(m, "group") else m.layout == "stream"
                          for m in folded.values())
    data, sampled = [], []
    for prompt, res in zip(prompts, results, strict=True):
        for seq in res.sequences:
            data.append(rl_datum(prompt, seq.tokens, advantage=1.0, sampler_logprobs=seq.logprobs))
            sampled.append((len(prompt) - 1, seq.logprobs))
    out = client.forward(data, "importance_sampling").result()
    worst = max(float((o["logprobs"].to_torch()[start:] - torch.tensor(q)).abs().max())
                for (start, q), o in zip(sampled, out.loss_fn_outputs, strict=True))
    assert worst <= 1e-4, worst


def test_both_layouts_sample_the_same_greedy_tokens(monkeypatch, ops, tmp_path) -> None:
    if not cpu_linear.onednn_works():
        pytest.skip("no oneDNN Linear in this torch build")
    runs = {}
    for layout in cpu_linear.LAYOUTS:
        monkeypatch.setattr(kernel_probe, "decoding_layout", lambda shapes, layout=layout: layout)
        runs[layout] = sample_each(_trained(tmp_path, layout), temperature=0.0)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(runs["stream"], runs["onednn"], strict=True):
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-5


def test_the_one_native_call_takes_streaming_weights_bit_for_bit_as_the_loop(stream_layout, monkeypatch,
                                                                             tmp_path) -> None:
    client = _trained(tmp_path, "stream")
    decoders, real = [], native_decode.native_decoder

    def kept(lean, device):
        decoders.append(real(lean, device))
        return decoders[-1]

    monkeypatch.setattr(native_decode, "native_decoder", kept)
    one_call = sample_each(client, temperature=1.0, seed=11)
    assert decoders and decoders[-1].plan is not None
    assert all(w.dim() == 3 for w in decoders[-1].plan.weights)  # every decoder weight streams
    monkeypatch.setattr(native_decode, "ONE_CALL", False)
    assert sample_each(client, temperature=1.0, seed=11) == one_call
    assert decoders[-1].plan is None


def test_packed_product_multiplies_by_either_layout(ops) -> None:
    if not cpu_linear.onednn_works():
        pytest.skip("no oneDNN Linear in this torch build")
    gen = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(6, 24, generator=gen), torch.randn(32, 24, generator=gen), torch.randn(32, generator=gen)
    for layout in cpu_linear.LAYOUTS:
        assert torch.allclose(packed_product(x, pack_weight(w, layout), b), nn.functional.linear(x, w, b), atol=1e-5)


def test_the_layouts_script_prints_both_layouts_per_row_count(ops) -> None:
    """scripts/packed_layouts.py, which docs/benchmark.md's table comes from, runs (tiny model, a few
    passes): one row per row count, both layouts timed, their ratio."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    if not cpu_linear.onednn_works():
        pytest.skip("no oneDNN Linear in this torch build")
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, str(root / "scripts" / "packed_layouts.py"), "--model", "tiny", "--rows",
                          "1", "30", "--passes", "2"], capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = re.findall(r"^\| (\d+) \| [\d.]+ ms .*\| [\d.]+ ms .*\| ([\d.]+) \|$", out.stdout, re.M)
    assert [r for r, _ in rows] == ["1", "30"] and all(float(ratio) > 0 for _, ratio in rows)
