"""The streaming layout (cpu_linear.pack_weight, native/stream_linear.cpp), float32 and
bf16: the product it computes, against float64 within the error bound of a sequential float32 sum
(and, in bf16, one rounding); its independence of the other rows; LoRA's side path in it; where it
is taken and where oneDNN's layout stays; and samplers whose weights are packed in it, against the
trainer and against oneDNN's layout.
"""

from __future__ import annotations

import sys

import pytest
import torch
from backend_helpers import DECODE_PROMPTS, perturb_adapter, rl_datum, sample_each
from torch import nn

from grpo import types
from grpo.backends.local import ServiceClient, heap, native_decode
from grpo.models import cpu_linear, kernel_probe, native_kernels
from grpo.models.cpu_linear import OneDNNLinear, PackedLinear, pack_weight, packed_product

needs_onednn = pytest.mark.skipif(not cpu_linear.onednn_works(), reason="no oneDNN Linear in this torch build")
needs_dot = pytest.mark.skipif(not cpu_linear.stream_dot_available(),
                               reason="grpo's kernels are not built with avx512_bf16's dot product here")


@pytest.fixture
def ops(native_ops):
    return native_ops


def _within_sum_bound(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                      add: torch.Tensor | None = None) -> None:
    """|got - exact| <= (K + 3) u (|x| |w|^T + |b| + |add|), u = 2^-24: the bound of a float32 sum of
    K products taken one fused multiply-add at a time, then the bias and ``add`` (Higham, gamma_n);
    a bf16 result is that sum rounded once more, to within half a bf16 step (2^-8 relative)."""
    extra = [t.double() for t in (b, add) if t is not None]
    exact = x.double() @ w.double().T + sum(extra)
    scale = x.double().abs() @ w.double().abs().T + sum(t.abs() for t in extra)
    bound = (x.shape[-1] + 3) * 2.0**-24 * scale
    if got.dtype == torch.bfloat16:
        bound = bound * (1 + 2.0**-8) + 2.0**-8 * exact.abs()
    excess = ((got.double() - exact).abs() - bound).max().item()
    assert excess <= 0, f"{excess} beyond the float32 sum's bound"


DTYPES = (torch.float32, torch.bfloat16)


# rows: one and a few (a decoding step), a whole block (32 on avx512, 6 on avx2) and one more (the
# second block across a pair of panels), two blocks, beyond two (every block across the pair), an
# odd number of panels (48 / 16 = 3: the last one alone)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 23, 32, 33, 40, 64, 65, 130])
@pytest.mark.parametrize(("out_features", "in_features"), [(48, 7), (960, 576), (32, 300)])
def test_the_product_is_within_a_float32_sums_bound_of_float64(ops, rows, out_features, in_features, dtype) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    w = (torch.randn(out_features, in_features, generator=gen) * in_features**-0.5).to(dtype)
    b = torch.randn(out_features, generator=gen).to(dtype)
    packed = ops.stream_pack(w)
    assert packed.shape == (out_features // 16, in_features, 16) and packed.dtype == dtype
    got = ops.stream_linear(x, packed, b)
    assert got.dtype == dtype
    _within_sum_bound(got, x, w, b)
    _within_sum_bound(ops.stream_linear(x, packed, None), x, w, None)


@needs_dot
@pytest.mark.parametrize("rows", [1, 5, 31, 32, 33, 64, 65, 130])
@pytest.mark.parametrize(("out_features", "in_features"), [(48, 7), (960, 576), (32, 300)])
def test_bf16_in_pairs_is_within_a_float32_sums_bound_of_float64(ops, rows, out_features, in_features) -> None:
    """A bf16 weight packed in pairs for avx512_bf16's dot product ([N / 16, ceil(K / 2), 32], an odd
    K completed with a zero): each instruction adds two exact products to the float32 sum, one
    rounding each, so the bound of K fused multiply-adds holds (the inputs hold no denormals, which
    the instruction takes as zero); and it agrees with the widened kernel to bf16's rounding."""
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    w = (torch.randn(out_features, in_features, generator=gen) * in_features**-0.5).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16()
    packed = ops.stream_pack(w, True)
    assert packed.shape == (out_features // 16, (in_features + 1) // 2, 32) and packed.dtype == torch.bfloat16
    assert cpu_linear.layout_of(packed) == "stream_dot" and cpu_linear.layout_of(ops.stream_pack(w)) == "stream"
    got = ops.stream_linear(x, packed, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    _within_sum_bound(got, x, w, b)
    _within_sum_bound(ops.stream_linear(x, packed, None), x, w, None)
    widened = ops.stream_linear(x, ops.stream_pack(w), b).float()
    assert torch.allclose(got.float(), widened, rtol=2.0**-7, atol=1e-6)


@pytest.mark.parametrize(("dtype", "pairs"), [(torch.float32, False), (torch.bfloat16, False),
                                              pytest.param(torch.bfloat16, True, marks=needs_dot)])
def test_a_rows_result_is_the_same_alone_or_among_any_other_rows(ops, dtype, pairs) -> None:
    """Each output is the same sum in the same order whatever the batch: a decoding row's logits
    do not depend on which other rows share its step (unlike a kernel that blocks by row count)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(130, 576, generator=gen).to(dtype)
    w, b = (torch.randn(960, 576, generator=gen) * 0.04).to(dtype), torch.randn(960, generator=gen).to(dtype)
    packed = ops.stream_pack(w, pairs)
    everything = ops.stream_linear(x, packed, b)
    for rows in ([0], [7, 3], list(range(24)), list(range(32)), list(range(33)), list(range(100, 130)),
                 list(range(60)), list(range(70))):
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
    with pytest.raises(RuntimeError, match="stream_pack: a float32 or bfloat16 CPU weight"):
        ops.stream_pack(w.half())
    packed = ops.stream_pack(w)
    with pytest.raises(RuntimeError, match="a Float CPU input with 8 features last \\(the weight's\\), got Float"):
        ops.stream_linear(torch.randn(2, 9), packed, None)
    with pytest.raises(RuntimeError, match="a Float CPU input with 8 features last \\(the weight's\\), got BFloat16"):
        ops.stream_linear(torch.randn(2, 8).to(torch.bfloat16), packed, None)  # a bf16 input by a float32 weight
    with pytest.raises(RuntimeError, match="the weight must come from stream_pack"):
        ops.stream_linear(torch.randn(2, 8), w, None)
    with pytest.raises(RuntimeError, match=r"bias must be Float \[32\]"):
        ops.stream_linear(torch.randn(2, 8), packed, torch.randn(31))
    if not cpu_linear.stream_dot_available():
        with pytest.raises(RuntimeError, match="pairs need avx512_bf16's dot product, which this build"):
            ops.stream_pack(w.bfloat16(), True)
        return
    with pytest.raises(RuntimeError, match="pairs are for bfloat16 weights, got Float"):
        ops.stream_pack(w, True)
    pairs = ops.stream_pack(w.bfloat16(), True)
    with pytest.raises(RuntimeError, match="a BFloat16 CPU input with 8 \\(or one fewer\\) features last"):
        ops.stream_linear(torch.randn(2, 9).bfloat16(), pairs, None)


def _mapping_of(address: int) -> dict[str, str] | None:
    """The /proc/self/smaps entry of the mapping holding ``address`` (its fields), or None."""
    entry = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                if entry is not None:
                    return entry
                entry = {} if start <= address < end else None
            elif entry is not None:
                key, _, value = line.partition(":")
                entry[key] = value.strip()
    return entry


needs_linux_smaps = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


@needs_linux_smaps
def test_large_packed_weights_sit_in_memory_advised_for_huge_pages(ops) -> None:
    """A weight streamed at every decoding step (at least 1 MiB) is placed in a mapping asked for
    2 MiB pages (VmFlags ``hg``: whether the kernel grants them is its setting); a small one (LoRA's
    packed A and B) stays in the ordinary heap."""
    gen = torch.Generator().manual_seed(3)
    big = ops.stream_pack(torch.randn(3072, 576, generator=gen))  # 7 MiB
    small = ops.stream_pack(torch.randn(32, 576, generator=gen))  # 72 KiB
    assert "hg" in _mapping_of(big.data_ptr())["VmFlags"].split()
    assert "hg" not in _mapping_of(small.data_ptr())["VmFlags"].split()


def test_packed_weights_sharing_memory_outlive_each_other(ops) -> None:
    """Weights packed one after another share chunks of memory: each stays intact while others are
    freed and more are packed (no two live weights overlap), and a chunk freed whole is reused
    rather than mapped again (its first weight's address comes back)."""
    gen = torch.Generator().manual_seed(4)
    weights = [torch.randn(n, 576, generator=gen) for n in (1536, 576, 960, 1536)]
    seen: set[int] = set()

    def pack(w: torch.Tensor) -> torch.Tensor:
        packed = ops.stream_pack(w)
        seen.add(packed.data_ptr())
        return packed

    packed = [pack(w) for w in weights]
    x = torch.randn(5, 576, generator=gen)
    del packed[1]
    weights.pop(1)
    packed += [pack(w) for w in weights[:2]]
    weights += weights[:2]
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * 4) for p in packed)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
    for w, p in zip(weights, packed, strict=True):
        assert torch.equal(ops.stream_linear(x, p, None), ops.stream_linear(x, pack(w), None))
    packed.clear()  # every weight gone: the next pack takes a kept chunk, at its start
    again = pack(weights[0])
    assert again.data_ptr() in seen or not sys.platform.startswith("linux")


@needs_linux_smaps
def test_memory_kept_for_the_next_pack_is_given_back_after_each_call(ops) -> None:
    """A freed packed weight's chunk is kept for the next pack until the engine's end-of-call
    release (heap.release_free_memory) unmaps it; nothing is kept twice."""
    native_kernels.release_kept_memory()  # (what earlier tests left kept: none counts against this one)
    big = ops.stream_pack(torch.randn(9008, 1024))  # 37 MB: a chunk of its own
    address = big.data_ptr()
    del big
    assert _mapping_of(address) is not None  # kept, still mapped
    assert heap.release_free_memory(torch.device("cpu"), keep=2**62) is False  # (malloc's cap not passed)
    assert _mapping_of(address) is None  # the kept chunk unmapped whatever malloc's cap
    assert native_kernels.release_kept_memory() == 0


@needs_onednn
def test_pack_weight_takes_the_streaming_layout_only_where_it_applies(ops) -> None:
    """float32 and bf16 weights whose rows are a multiple of 16; others (33 rows) keep oneDNN's, and
    both multiply through packed_product as F.linear does."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 24, generator=gen)
    for w, layout in ((torch.randn(32, 24, generator=gen), "stream"), (torch.randn(33, 24, generator=gen), "onednn")):
        module = PackedLinear(w, None, "stream")
        assert module.layout == layout and f"packed ({layout})" in repr(module)
        assert torch.allclose(module(x), nn.functional.linear(x, w), atol=1e-5)
    assert PackedLinear(torch.randn(32, 24, generator=gen), None).layout == "onednn"  # the default
    assert not pack_weight(torch.randn(32, 24).to(torch.bfloat16), "stream").is_mkldnn
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
    monkeypatch.setattr(kernel_probe, "decoding_layout", lambda shapes, dtype=None: "stream")


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
        monkeypatch.setattr(kernel_probe, "decoding_layout", lambda shapes, dtype=None, layout=layout: layout)
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
    for layout in cpu_linear.LAYOUTS:  # (a float32 weight asked for "stream_dot" streams as "stream")
        assert torch.allclose(packed_product(x, pack_weight(w, layout), b), nn.functional.linear(x, w, b), atol=1e-5)
        xb, wb, bb = x.bfloat16(), w.bfloat16(), b.bfloat16()
        if not cpu_linear.can_pack(wb, layout):  # (oneDNN packs no bf16 on a CPU without avx512)
            continue
        assert torch.allclose(packed_product(xb, pack_weight(wb, layout), bb).float(),
                              nn.functional.linear(xb.float(), wb.float(), bb.float()), atol=0.05, rtol=0.01)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_layouts_script_prints_both_layouts_per_row_count(ops, dtype) -> None:
    """scripts/packed_layouts.py, which docs/benchmark.md's tables come from, runs (tiny model, a few
    passes, each precision): one row per row count, both layouts timed, their ratio."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    if not cpu_linear.onednn_works():
        pytest.skip("no oneDNN Linear in this torch build")
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, str(root / "scripts" / "packed_layouts.py"), "--model", "tiny", "--rows",
                          "1", "30", "--passes", "2", "--dtype", dtype], capture_output=True, text=True, timeout=300,
                         cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = re.findall(r"^\| (\d+) \| [\d.]+ ms .*\| [\d.]+ ms .*\| ([\d.]+) \|$", out.stdout, re.M)
    assert [r for r, _ in rows] == ["1", "30"] and all(float(ratio) > 0 for _, ratio in rows)
    assert f"MB of {dtype} weights a pass" in out.stdout


@pytest.mark.parametrize(("dtype", "layout"), [(torch.float32, "stream"), (torch.bfloat16, "stream"),
                                               pytest.param(torch.bfloat16, "stream_dot", marks=needs_dot)])
@pytest.mark.parametrize("rows", [1, 5, 32, 33, 49, 70])
@pytest.mark.parametrize("rank", [8, 16, 20])
def test_a_lora_side_path_is_part_of_the_streaming_products_sums(ops, dtype, layout, rows, rank) -> None:
    """A and B packed in the streaming layout beside their base, the rank padded with zeros to 16:
    x @ W.T + (x @ A.T) @ B.T + bias, each output one float32 sum over [x, x @ A.T] against [W, B]
    (d = x @ A.T itself a float32 sum), rounded once; a row's result still its own. Beside a base
    in pairs (bf16's dot product), A is in pairs too and B plain (it multiplies float32 d)."""
    gen = torch.Generator().manual_seed(rank * 100 + rows)
    x = torch.randn(rows, 40, generator=gen).to(dtype)
    w, bias = (torch.randn(64, 40, generator=gen) * 0.2).to(dtype), torch.randn(64, generator=gen).to(dtype)
    a, b = (torch.randn(rank, 40, generator=gen) * 0.2).to(dtype), (torch.randn(64, rank, generator=gen) * 0.2).to(dtype)
    side = cpu_linear.LoraSideProduct(a, b, layout)
    in_pairs = layout == "stream_dot"
    assert side.streams and side.packed[0].shape == ((-(-rank // 16), 20, 32) if in_pairs else (-(-rank // 16), 40, 16))
    assert side.packed[1].shape == (4, -(-rank // 16) * 16, 16)
    packed = pack_weight(w, layout)
    assert cpu_linear.layout_of(packed) == layout
    got = packed_product(x, packed, bias, side)
    assert got.dtype == dtype and got.shape == (rows, 64)
    # the bound of [x, d] @ [W, B].T + bias, d's own sums' error carried through |B|
    down = x.double() @ a.double().T
    down_error = (40 + 2) * 2.0**-24 * (x.double().abs() @ a.double().abs().T) @ b.double().abs().T
    exact = x.double() @ w.double().T + down @ b.double().T + bias.double()
    scale = x.double().abs() @ w.double().abs().T + down.abs() @ b.double().abs().T + bias.double().abs()
    bound = (40 + rank + 3) * 2.0**-24 * scale + down_error
    if dtype == torch.bfloat16:
        bound = bound * (1 + 2.0**-8) + 2.0**-8 * exact.abs()
    assert ((got.double() - exact).abs() - bound).max().item() <= 0
    assert torch.equal(packed_product(x[-1:], packed, bias, side), got[-1:])
    # a side path beside a base of another layout (out of place, two roundings): the same to within one
    assert torch.allclose(side.add_to(ops.stream_linear(x, packed, bias), x).float(), got.float(), atol=0.07, rtol=0.02)


def test_a_lora_side_path_is_refused_unless_packed_to_match(ops) -> None:
    w, a, b = ops.stream_pack(torch.randn(32, 8)), ops.stream_pack(torch.randn(16, 8)), ops.stream_pack(torch.randn(32, 16))
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="needs both A and B"):
        ops.stream_linear(x, w, None, a, None)
    with pytest.raises(RuntimeError, match="LoRA's B must have 32 rows \\(the weight's\\), got 48"):
        ops.stream_linear(x, w, None, a, ops.stream_pack(torch.randn(48, 16)))
    with pytest.raises(RuntimeError, match="LoRA's A must come from stream_pack .* in = 8"):
        ops.stream_linear(x, w, None, ops.stream_pack(torch.randn(16, 9)), b)
    with pytest.raises(RuntimeError, match="LoRA's B must come from stream_pack .*BFloat16"):
        ops.stream_linear(x.bfloat16(), ops.stream_pack(torch.randn(32, 8).bfloat16()), None,
                          ops.stream_pack(torch.randn(16, 8).bfloat16()), b)
    if cpu_linear.stream_dot_available():
        wb, ab, bb = (t.bfloat16() for t in (torch.randn(32, 8), torch.randn(16, 8), torch.randn(32, 16)))
        with pytest.raises(RuntimeError, match="LoRA's A must be packed as the weight is \\(in pairs\\) and its B plain"):
            ops.stream_linear(x.bfloat16(), ops.stream_pack(wb, True), None, ops.stream_pack(ab), ops.stream_pack(bb))
        with pytest.raises(RuntimeError, match="LoRA's A must be packed as the weight is \\(plain\\) and its B plain"):
            ops.stream_linear(x.bfloat16(), ops.stream_pack(wb), None, ops.stream_pack(ab, True), ops.stream_pack(bb))


@pytest.fixture
def bf16_mixed(monkeypatch, tmp_path):
    """A bf16 sampler beside an fp32 trainer, each engine's sampler packed in ``layout``."""
    import warnings

    def make(layout: str):
        monkeypatch.setattr(kernel_probe, "decoding_layout", lambda shapes, dtype=None: layout)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # bf16 where it measured slower warns (test_precision.py)
            service = ServiceClient(checkpoint_dir=tmp_path / layout, device="cpu", train_dtype="fp32",
                                    sample_dtype="bf16")
        client = service.create_lora_training_client("tiny", seed=0, rank=8)
        perturb_adapter(client, seed=7, scale=0.1)
        return client

    return make


@pytest.mark.parametrize("layout", ["stream", pytest.param("stream_dot", marks=needs_dot)])
def test_a_bf16_sampler_in_the_streaming_layout_tracks_the_fp32_trainer(ops, bf16_mixed, layout) -> None:
    """Every weight of the bf16 copy streams (LoRA's side paths too, in the one native call), and
    its logprobs stay within bf16 rounding of the fp32 trainer's, as oneDNN's bf16 sampler's do --
    widened or in pairs for the dot product."""
    client = bf16_mixed(layout)
    assert client.engine.sample_layout == layout
    decoders, real = [], native_decode.native_decoder
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(native_decode, "native_decoder", lambda lean, device: decoders.append(real(lean, device))
                        or decoders[-1])
        runs = sample_each(client, temperature=1.0, seed=5)
    plan = decoders[-1].plan
    assert plan is not None and all(w.dim() == 3 and w.dtype == torch.bfloat16 for w in plan.weights)
    assert {cpu_linear.layout_of(w) for w in plan.weights} == {layout}
    assert all(e is None or (e.dim() == 3 and e.dtype == torch.bfloat16) for e in plan.extras)
    assert any(e is not None for e in plan.extras)  # the side paths are there
    data, sampled = [], []
    for prompt, (tokens, logprobs) in zip([p for p in DECODE_PROMPTS for _ in range(3)], runs, strict=True):
        data.append(rl_datum(prompt, tokens, advantage=1.0, sampler_logprobs=logprobs))
        sampled.append((len(prompt) - 1, logprobs))
    out = client.forward(data, "importance_sampling").result()
    worst = max(float((o["logprobs"].to_torch()[start:] - torch.tensor(q)).abs().max())
                for (start, q), o in zip(sampled, out.loss_fn_outputs, strict=True))
    assert 0 < worst < 0.02, worst  # bf16 is not fp32, but close (0.002-0.008 here, either layout)


@pytest.mark.skipif(not cpu_linear.packing_works(torch.bfloat16), reason="this CPU/torch build packs no bf16 weights")
def test_both_bf16_layouts_score_the_same_tokens_alike(ops, bf16_mixed) -> None:
    """The two bf16 samplers differ only in the order of float32 sums and in rounding the side path
    once here, twice in oneDNN's: every token of a sequence (a prefill's many rows) and of a
    sampling call (the decoding steps' few) scored within bf16 rounding of each other. (Greedy
    tokens are not compared: a near-tie of the tiny random model's logits flips on bf16's last bit.)"""
    clients = {layout: bf16_mixed(layout) for layout in cpu_linear.LAYOUTS}
    samplers = {layout: c.save_weights_and_get_sampling_client() for layout, c in clients.items()}
    tokens = [1, *range(40, 90)]
    scored = {layout: s.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:]
              for layout, s in samplers.items()}
    for layout in cpu_linear.STREAMING:
        assert max(abs(a - b) for a, b in zip(scored[layout], scored["onednn"], strict=True)) < 0.02
    (seq,) = samplers["stream"].sample(types.ModelInput.from_ints(tokens[:8]), 1, types.SamplingParams(
        max_tokens=12, temperature=1.0, seed=3)).result().sequences
    rescored = samplers["onednn"].compute_logprobs(types.ModelInput.from_ints(tokens[:8] + seq.tokens)).result()[8:]
    assert max(abs(a - b) for a, b in zip(seq.logprobs, rescored, strict=True)) < 0.02
