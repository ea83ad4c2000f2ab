"""The float32 training kernel, the sampler's packed layout and the bf16 training attention's products
(grpo/models/kernel_probe.py): measured once per machine and model shape, the other kernel (layout)
only where it measured faster by the margin, and a model that trains through either computes the
same gradients. Timings are faked: this machine's decide nothing here."""

from __future__ import annotations

import json

import pytest
import torch
from peft.tuners.lora import Linear as LoraLinear
from torch import nn

from grpo import models, types
from grpo.backends.local import ServiceClient
from grpo.models import cpu_linear, dtype_probe, kernel_probe, native_kernels
from grpo.models.cpu_linear import OneDNNLinear


def shapes_of(name: str) -> dtype_probe.Shapes:
    return dtype_probe.Shapes.from_config(models.load_config(name))


SMOL = dtype_probe.Shapes(hidden=576, intermediate=1536, q_out=576, kv_out=192, vocab=49152, layers=30)
needs_onednn = pytest.mark.skipif(not (cpu_linear.wanted() and cpu_linear.onednn_works()),
                                  reason="this torch build has no oneDNN Linear: every kernel is PyTorch's")
needs_streaming = pytest.mark.skipif(not cpu_linear.stream_available(),
                                     reason="grpo's native kernels are not built here: no streaming layout to weigh")


class FakeTimer:
    """(oneDNN seconds, PyTorch seconds) per training pass as a machine would measure them."""

    def __init__(self, onednn_s: float, torch_s: float):
        self.result, self.calls = (onednn_s, torch_s), 0

    def __call__(self, shapes: dtype_probe.Shapes) -> tuple[float, float]:
        self.calls += 1
        return self.result


@pytest.fixture
def probe(monkeypatch, tmp_path):
    """The probe on (conftest turns it off), caching in a tmp file, timed by the FakeTimer given."""
    monkeypatch.setenv(dtype_probe.ENV_SWITCH, "on")
    monkeypatch.setattr(kernel_probe, "_memo", {})
    monkeypatch.setattr(dtype_probe, "cache_file", lambda: tmp_path / "precision.json")
    monkeypatch.setattr(dtype_probe, "machine_busy", lambda: None)

    def use(timer: FakeTimer, layouts: FakeTimer | None = None, bf16_layouts: FakeTimer | None = None,
            bf16_kernels: FakeTimer | None = None) -> FakeTimer:
        monkeypatch.setattr(kernel_probe, "measure", timer)
        monkeypatch.setattr(kernel_probe, "measure_layouts", layouts or FakeTimer(0.045, 0.032))
        monkeypatch.setattr(kernel_probe, "measure_bf16_layouts", bf16_layouts or FakeTimer(0.052, 0.030))
        monkeypatch.setattr(kernel_probe, "measure_bf16_stream_kernels", bf16_kernels or FakeTimer(0.030, 0.031))
        return timer

    return use


@needs_onednn
@pytest.mark.parametrize(("onednn_s", "torch_s", "expected"), [
    (0.43, 0.36, "torch"),  # an Intel Xeon with AMX, SmolLM2: PyTorch (MKL) 1.2x faster
    (0.40, 0.39, "onednn"),  # inside the margin: the kernel used so far stays
    (0.20, 0.44, "onednn"),  # an AMD EPYC: MKL 2.2x slower
])
def test_pytorchs_kernel_only_where_it_measured_faster_by_the_margin(probe, onednn_s, torch_s, expected) -> None:
    probe(FakeTimer(onednn_s, torch_s))
    assert kernel_probe.training_kernel(SMOL) == expected


@needs_onednn
def test_measured_once_per_machine_said_once_and_cached(probe, tmp_path, capsys) -> None:
    timer = probe(FakeTimer(0.432, 0.360))
    assert kernel_probe.training_kernel(SMOL) == "torch"
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (f"grpo: fp32 training kernel on {dtype_probe.cpu_name()} ({SMOL.signature()}): PyTorch (MKL) "
                    f"(per training pass: oneDNN 432.0 ms, PyTorch 360.0 ms, PyTorch 1.20x faster); "
                    f"cached in {tmp_path / 'precision.json'}")
    assert kernel_probe.training_kernel(SMOL) == "torch"  # same process
    kernel_probe._memo.clear()  # as a new process: the cache file answers
    assert kernel_probe.training_kernel(SMOL) == "torch"
    assert timer.calls == 1 and capsys.readouterr().err == ""
    stored = json.loads((tmp_path / "precision.json").read_text())
    assert stored == {kernel_probe.KEY_PREFIX + dtype_probe.machine_key(SMOL): {"onednn_s": 0.432, "torch_s": 0.36}}


@needs_onednn
def test_after_auto_resolved_to_fp32_its_numbers_choose_the_kernel_untimed(probe, monkeypatch, tmp_path, capsys) -> None:
    """``auto`` resolving to fp32 has timed fp32 training through both kernels (dtype_probe.py):
    the kernel probe answers from those numbers instead of timing the same ops again."""
    timer = FakeTimer(0.9, 0.1)  # would choose PyTorch's kernel too: only its calls tell
    monkeypatch.setattr(dtype_probe, "_memo", {})
    monkeypatch.setattr(dtype_probe, "_by_variant_memo", {})
    layouts = FakeTimer(0.9, 0.1)
    timer = probe(timer, layouts)
    streams = cpu_linear.stream_available()  # grpo's kernels built: the layouts were timed too
    monkeypatch.setattr(dtype_probe, "measure", lambda shapes: {  # bf16 slower in both roles: auto is fp32
        "sample": (0.030, 0.060), "train": (0.360, 0.500), dtype_probe.BY_KERNEL: {"onednn": 0.432, "torch": 0.360},
        **({dtype_probe.BY_LAYOUT["fp32"]: {"onednn": 0.045, "stream": 0.030},
            dtype_probe.BY_LAYOUT["bf16"]: {"onednn": 0.060, "stream": 0.061}} if streams else {})})
    engine = ServiceClient(device="cpu").create_lora_training_client("tiny", seed=0, rank=2).engine
    assert engine.dtype is torch.float32 and engine.fp32_kernel == "torch" and timer.calls == layouts.calls == 0
    assert engine.fp32_layout == ("stream" if streams else "onednn")
    precision_line, kernel_line, *layout_line = capsys.readouterr().err.splitlines()
    assert precision_line.startswith("grpo: auto precision on ")
    assert kernel_line.endswith("(per training pass: oneDNN 432.0 ms, PyTorch 360.0 ms, PyTorch 1.20x faster, as the "
                                f"precision probe timed them); cached in {tmp_path / 'precision.json'}")
    assert layout_line == ([f"grpo: fp32 decoding layout on {dtype_probe.cpu_name()} ({shapes_of('tiny').signature()}): "
                            "streaming (per decoding step: oneDNN 45.0 ms, streaming 30.0 ms, streaming 1.50x faster, "
                            f"as the precision probe timed them); cached in {tmp_path / 'precision.json'}"]
                           if streams else [])
    shapes = dtype_probe.Shapes.from_config(models.load_config("tiny"))
    stored = json.loads((tmp_path / "precision.json").read_text())
    key = dtype_probe.machine_key(shapes)
    assert stored[key][dtype_probe.BY_KERNEL] == {"onednn": 0.432, "torch": 0.36}
    assert stored[kernel_probe.KEY_PREFIX + key] == {"onednn_s": 0.432, "torch_s": 0.36}
    for memo in (dtype_probe._memo, dtype_probe._by_variant_memo, kernel_probe._memo):
        memo.clear()  # as a new process: the cache file answers all, silently
    engine = ServiceClient(device="cpu").create_lora_training_client("tiny", seed=0, rank=2).engine
    assert engine.fp32_kernel == "torch" and engine.fp32_layout == ("stream" if streams else "onednn")
    assert capsys.readouterr().err == "" and timer.calls == layouts.calls == 0


@needs_onednn
def test_a_precision_entry_without_both_kernels_numbers_is_timed(probe, monkeypatch, tmp_path) -> None:
    """An entry of a probe that timed one kernel (or a damaged one) answers nothing: measured."""
    timer = probe(FakeTimer(0.432, 0.360))
    monkeypatch.setattr(dtype_probe, "_by_variant_memo", {})
    key = dtype_probe.machine_key(SMOL)
    for numbers in ({"onednn": 0.2}, "damaged", {"onednn": "fast", "torch": 0.1}):
        kernel_probe._memo.clear()
        (tmp_path / "precision.json").write_text(json.dumps({key: {dtype_probe.BY_KERNEL: numbers}}))
        assert kernel_probe.training_kernel(SMOL) == "torch"
    assert timer.calls == 3


@needs_onednn
def test_a_busy_machine_is_not_measured_and_trains_through_onednn(probe, monkeypatch, tmp_path, capsys) -> None:
    timer = probe(FakeTimer(0.432, 0.360))
    monkeypatch.setattr(dtype_probe, "machine_busy", lambda: "load 6.4 on 2 cores")
    assert kernel_probe.training_kernel(SMOL) == "onednn"
    assert kernel_probe.training_kernel(SMOL) == "onednn"
    (line,) = capsys.readouterr().err.splitlines()  # said once per run
    assert line == ("grpo: fp32 training kernel not measured, the machine is busy (load 6.4 on 2 cores): oneDNN "
                    "for this run, measured by a later one")
    assert timer.calls == 0 and not (tmp_path / "precision.json").exists()


def test_nothing_is_measured_with_the_probe_off_or_without_shapes(probe, monkeypatch) -> None:
    timer = probe(FakeTimer(0.432, 0.360))
    assert kernel_probe.training_kernel(None) == "onednn"
    monkeypatch.setenv(dtype_probe.ENV_SWITCH, "off")
    assert kernel_probe.training_kernel(SMOL) == "onednn"
    monkeypatch.setenv(dtype_probe.ENV_SWITCH, "on")
    monkeypatch.setenv(cpu_linear.ENV_SWITCH, "torch")  # every Linear PyTorch's already
    assert kernel_probe.training_kernel(SMOL) == "onednn" and timer.calls == 0


def test_an_unknown_kernel_is_refused_naming_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown fp32 training kernel 'mkl'; valid: onednn, torch"):
        cpu_linear.use_kernel(nn.Linear(2, 2), "mkl")


def _lora_grads(engine_kernel: str, probe) -> tuple[list[str], dict[str, torch.Tensor], float]:
    probe(FakeTimer(0.432, 0.360) if engine_kernel == "torch" else FakeTimer(0.2, 0.44))
    kernel_probe._memo.clear()
    client = ServiceClient(device="cpu", train_dtype="fp32", sample_dtype="fp32").create_lora_training_client(
        "tiny", seed=0, rank=4)
    kernels = sorted({m.kernel for m in client.engine.model.modules() if type(m) is OneDNNLinear})
    tokens = list(range(3, 23))
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [0.0] * 5 + [1.0] * 14})
    loss = client.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
    grads = {n: p.grad.clone() for n, p in client.engine.peft_model.named_parameters() if p.grad is not None}
    return kernels, grads, loss


@needs_onednn
def test_a_model_trains_through_the_kernel_measured_and_to_the_same_gradients(probe, tmp_path) -> None:
    kernels_torch, grads_torch, loss_torch = _lora_grads("torch", probe)
    (tmp_path / "precision.json").unlink()  # a machine measured anew
    kernels_onednn, grads_onednn, loss_onednn = _lora_grads("onednn", probe)
    assert kernels_torch == ["torch"] and kernels_onednn == ["onednn"]
    assert loss_torch == pytest.approx(loss_onednn, rel=1e-5)
    assert grads_torch.keys() == grads_onednn.keys() and any("lora_A" in n for n in grads_torch)
    for name in grads_torch:  # two libraries' float32 sums: equal to rounding
        torch.testing.assert_close(grads_torch[name], grads_onednn[name], rtol=1e-4, atol=1e-6)


@needs_onednn
def test_the_kernel_decides_which_library_computes_a_float32_training_product(monkeypatch) -> None:
    """Through "torch" a OneDNNLinear is nn.Linear itself, bit for bit; oneDNN's kernel is not
    called (the one test above could pass with either library computing everything)."""
    calls = []
    real = cpu_linear._onednn
    monkeypatch.setattr(cpu_linear, "_onednn", lambda *a: calls.append(1) or real(*a))
    linear = nn.Linear(16, 8)
    fast = OneDNNLinear(16, 8)
    fast.load_state_dict(linear.state_dict())
    x = torch.randn(3, 5, 16, requires_grad=True)
    fast.kernel = "torch"
    (out,) = torch.autograd.grad(fast(x).square().sum(), x)
    assert out.equal(torch.autograd.grad(linear(x).square().sum(), x)[0]) and calls == []
    fast.kernel = "onednn"
    torch.autograd.grad(fast(x).square().sum(), x)
    assert len(calls) == 2  # forward and input gradient


needs_dot = pytest.mark.skipif(not cpu_linear.stream_dot_available(),
                               reason="grpo's kernels are not built with avx512_bf16 here")


@pytest.mark.parametrize(("question", "measure", "shapes"), [
    (kernel_probe.TRAINING_KERNEL, kernel_probe.measure, shapes_of("tiny")),
    pytest.param(kernel_probe.DECODING_LAYOUT["fp32"], kernel_probe.measure_layouts, shapes_of("tiny"),
                 marks=needs_streaming),
    pytest.param(kernel_probe.DECODING_LAYOUT["bf16"], kernel_probe.measure_bf16_layouts, shapes_of("tiny"),
                 marks=needs_streaming),
    pytest.param(kernel_probe.BF16_STREAM_KERNEL, kernel_probe.measure_bf16_stream_kernels, shapes_of("tiny"),
                 marks=needs_dot),
    # (tiny's heads are 16 wide, which the dot product does not take: two heads of 64 instead)
    pytest.param(kernel_probe.TRAINING_ATTENTION, kernel_probe.measure_attention_kernels,
                 kernel_probe.AttentionShapes(4, 2, 64), marks=needs_dot)])
def test_the_real_probe_times_both_options(tmp_path, monkeypatch, question, measure, shapes) -> None:
    """Only that measuring works and is reused: which option wins is this machine's."""
    monkeypatch.setattr(kernel_probe, "_memo", {})
    monkeypatch.setattr(dtype_probe, "machine_busy", lambda: None)
    first = question.timings(shapes, timer=lambda s: measure(s, budget_s=0.2), cache=tmp_path / "p.json")
    assert first.first_s > 0 and first.second_s > 0 and first.choice in question.options
    kernel_probe._memo.clear()

    def no_timing(shapes):
        raise AssertionError("measured again")

    assert question.timings(shapes, timer=no_timing, cache=tmp_path / "p.json") == first


def test_lora_layers_keep_their_base_as_a_onednn_linear() -> None:
    """The engine sets the kernel on the model's OneDNNLinears: peft's LoRA layers wrap them."""
    client = ServiceClient(device="cpu", train_dtype="fp32", sample_dtype="fp32").create_lora_training_client(
        "tiny", seed=0, rank=2)
    bases = [m.base_layer for m in client.engine.peft_model.modules() if isinstance(m, LoraLinear)]
    assert bases and all(type(b) is OneDNNLinear for b in bases) == (cpu_linear.wanted() and cpu_linear.onednn_works())



@needs_onednn
@needs_streaming
@pytest.mark.parametrize(("onednn_s", "stream_s", "expected"), [
    (0.0455, 0.0321, "stream"),  # an Intel Xeon (avx512), SmolLM2 at 16 rows: streaming 1.42x faster
    (0.0400, 0.0390, "onednn"),  # inside the margin: oneDNN's layout stays
    (0.0300, 0.0450, "onednn"),  # a CPU where the streaming product is slower
])
def test_the_streaming_layout_only_where_it_measured_faster_by_the_margin(probe, onednn_s, stream_s,
                                                                         expected) -> None:
    layouts = FakeTimer(onednn_s, stream_s)
    probe(FakeTimer(0.4, 0.4), layouts)
    assert kernel_probe.decoding_layout(SMOL) == expected
    assert kernel_probe.decoding_layout(SMOL) == expected and layouts.calls == 1


@needs_onednn
@needs_streaming
def test_the_layout_is_measured_once_said_once_and_cached(probe, tmp_path, capsys) -> None:
    layouts = FakeTimer(0.0455, 0.0321)
    probe(FakeTimer(0.4, 0.4), layouts)
    assert kernel_probe.decoding_layout(SMOL) == "stream"
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (f"grpo: fp32 decoding layout on {dtype_probe.cpu_name()} ({SMOL.signature()}): streaming (per "
                    f"decoding step: oneDNN 45.5 ms, streaming 32.1 ms, streaming 1.42x faster); cached in "
                    f"{tmp_path / 'precision.json'}")
    kernel_probe._memo.clear()  # as a new process
    assert kernel_probe.decoding_layout(SMOL) == "stream" and layouts.calls == 1
    stored = json.loads((tmp_path / "precision.json").read_text())
    assert stored == {kernel_probe.LAYOUT_KEY_PREFIX + dtype_probe.machine_key(SMOL):
                      {"onednn_s": 0.0455, "stream_s": 0.0321}}


def test_no_layout_is_measured_without_the_kernels_the_probe_or_shapes(probe, monkeypatch, capsys) -> None:
    """oneDNN's layout, untimed, wherever there is nothing to weigh it against or nothing to time;
    a busy machine is not measured either."""
    layouts = FakeTimer(0.0455, 0.0321)
    probe(FakeTimer(0.4, 0.4), layouts)
    assert kernel_probe.decoding_layout(None) == "onednn"
    monkeypatch.setenv(dtype_probe.ENV_SWITCH, "off")
    assert kernel_probe.decoding_layout(SMOL) == "onednn"
    monkeypatch.setenv(dtype_probe.ENV_SWITCH, "on")
    with monkeypatch.context() as patched:
        patched.setattr(native_kernels, "kernels", lambda: None)  # not built here (no compiler, switched off)
        patched.setattr(cpu_linear, "_stream", {"ops": None})
        assert kernel_probe.decoding_layout(SMOL) == "onednn"
    monkeypatch.setattr(dtype_probe, "machine_busy", lambda: "load 3.1 on 2 cores")
    if cpu_linear.stream_available() and cpu_linear.onednn_works():
        assert kernel_probe.decoding_layout(SMOL) == "onednn"
        assert "fp32 decoding layout not measured, the machine is busy" in capsys.readouterr().err
    assert layouts.calls == 0


@needs_onednn
@needs_streaming
@pytest.mark.parametrize(("widened_s", "dot_s", "expected"), [
    (0.0531, 0.0270, "stream_dot"),  # an AMD EPYC (Zen 4): the dot products ~2x the multiply-adds
    (0.0300, 0.0295, "stream"),  # inside the margin: the widened kernel, the one used so far, stays
    (0.0300, 0.0600, "stream"),  # a CPU whose dot product runs at half float32's rate
])
def test_bf16_streams_through_the_dot_product_only_where_it_measured_faster(probe, monkeypatch, widened_s, dot_s,
                                                                          expected) -> None:
    monkeypatch.setattr(cpu_linear, "stream_dot_available", lambda: True)
    kernels = FakeTimer(widened_s, dot_s)
    probe(FakeTimer(0.4, 0.4), bf16_layouts=FakeTimer(0.052, 0.030), bf16_kernels=kernels)
    assert kernel_probe.decoding_layout(SMOL, torch.bfloat16) == expected
    assert kernel_probe.decoding_layout(SMOL, torch.bfloat16) == expected and kernels.calls == 1


@needs_onednn
@needs_streaming
def test_no_bf16_streaming_kernel_is_weighed_where_there_is_one_or_onednn_won(probe, monkeypatch, tmp_path,
                                                                             capsys) -> None:
    """Built without the dot product: the widened kernel, untimed. oneDNN's layout measured faster
    than the streaming one (in its faster kernel): no kernel to choose."""
    kernels = FakeTimer(0.0531, 0.0270)
    monkeypatch.setattr(cpu_linear, "stream_dot_available", lambda: False)
    probe(FakeTimer(0.4, 0.4), bf16_layouts=FakeTimer(0.052, 0.030), bf16_kernels=kernels)
    assert kernel_probe.decoding_layout(SMOL, torch.bfloat16) == "stream"
    monkeypatch.setattr(cpu_linear, "stream_dot_available", lambda: True)
    kernel_probe._memo.clear()  # another machine: nothing cached
    (tmp_path / "precision.json").unlink()
    probe(FakeTimer(0.4, 0.4), bf16_layouts=FakeTimer(0.030, 0.052), bf16_kernels=kernels)
    assert kernel_probe.decoding_layout(SMOL, torch.bfloat16) == "onednn"
    assert kernels.calls == 0 and "streaming kernel" not in capsys.readouterr().err


@needs_onednn
@needs_streaming
def test_the_precision_probes_three_bf16_times_answer_both_questions_untimed(probe, monkeypatch, tmp_path,
                                                                             capsys) -> None:
    """The precision probe times bf16 decoding in oneDNN's layout and in both streaming kernels: the
    layout question weighs oneDNN's against the streaming layout in the kernel those numbers
    choose (an AMD EPYC: oneDNN 52.7 ms, widened 53.1 ms, dot products 27.0 ms), and the kernel
    question answers from them too; nothing is timed again."""
    monkeypatch.setattr(cpu_linear, "stream_dot_available", lambda: True)
    monkeypatch.setattr(dtype_probe, "_by_variant_memo", {})
    layouts, kernels = FakeTimer(0.9, 0.1), FakeTimer(0.9, 0.1)
    probe(FakeTimer(0.4, 0.4), bf16_layouts=layouts, bf16_kernels=kernels)
    key = dtype_probe.machine_key(SMOL)
    (tmp_path / "precision.json").write_text(json.dumps({key: {dtype_probe.BY_LAYOUT["bf16"]: {
        "onednn": 0.0527, "stream": 0.0531, "stream_dot": 0.0270}}}))
    assert kernel_probe.decoding_layout(SMOL, torch.bfloat16) == "stream_dot"
    assert layouts.calls == kernels.calls == 0
    layout_line, kernel_line = capsys.readouterr().err.splitlines()
    assert "bf16 decoding layout" in layout_line and "(per decoding step: oneDNN 52.7 ms, streaming 27.0 ms" in layout_line
    assert kernel_line.startswith(f"grpo: bf16 streaming kernel on {dtype_probe.cpu_name()} ({SMOL.signature()}): "
                                  "avx512_bf16 dot products (per decoding step: float32 multiply-adds 53.1 ms, bf16 dot "
                                  "products 27.0 ms, bf16 dot products 1.97x faster, as the precision probe timed them)")
    stored = json.loads((tmp_path / "precision.json").read_text())
    assert stored[kernel_probe.BF16_STREAM_KERNEL.key_prefix + key] == {"stream_s": 0.0531, "stream_dot_s": 0.027}


SMOL_HEADS = kernel_probe.AttentionShapes(heads=9, kv_heads=3, head_dim=64)


def test_attention_shapes_are_read_from_a_config() -> None:
    assert kernel_probe.AttentionShapes.from_config(models.load_config("smollm2")) == SMOL_HEADS
    assert kernel_probe.AttentionShapes.from_config(models.load_config("tiny")) == kernel_probe.AttentionShapes(4, 2, 16)
    assert kernel_probe.AttentionShapes.from_config(object()) is None


@pytest.mark.parametrize(("fma_s", "dot_s", "expected"), [
    (0.0071, 0.0049, "dot"),  # an AMD EPYC (Zen 4), SmolLM2's heads: the dot products 1.46x faster
    (0.0086, 0.0084, "fma"),  # inside the margin: the multiply-adds, the ones used so far, stay
    (0.0086, 0.0150, "fma"),  # a CPU whose dot product runs at half float32's rate
])
def test_bf16_attention_by_the_dot_product_only_where_it_measured_faster(probe, monkeypatch, tmp_path, capsys,
                                                                        fma_s, dot_s, expected) -> None:
    monkeypatch.setattr(cpu_linear, "stream_dot_available", lambda: True)
    timer = FakeTimer(fma_s, dot_s)
    assert kernel_probe.training_attention(SMOL_HEADS, timer=timer) == expected
    assert kernel_probe.training_attention(SMOL_HEADS, timer=timer) == expected and timer.calls == 1
    assert "bf16 training attention on" in capsys.readouterr().err
    kernel_probe._memo.clear()  # a later process: from the cache file, untimed
    assert kernel_probe.training_attention(SMOL_HEADS, timer=timer) == expected and timer.calls == 1
    assert "attention-h9-kv3-d64" in (tmp_path / "precision.json").read_text()


def test_no_attention_kernel_is_weighed_without_the_instruction_a_fit_or_the_probe(probe, monkeypatch) -> None:
    """Kernels built without avx512_bf16, a head dimension not a multiple of 32 (the kernel's pairs
    of dims, its fixed-width loops), or the probe off: the multiply-adds, untimed."""
    timer = FakeTimer(0.0086, 0.0040)
    monkeypatch.setattr(cpu_linear, "stream_dot_available", lambda: False)
    assert kernel_probe.training_attention(SMOL_HEADS, timer=timer) == "fma"
    monkeypatch.setattr(cpu_linear, "stream_dot_available", lambda: True)
    assert kernel_probe.training_attention(kernel_probe.AttentionShapes(4, 2, 16), timer=timer) == "fma"
    assert kernel_probe.training_attention(None, timer=timer) == "fma"
    monkeypatch.setenv(dtype_probe.ENV_SWITCH, "off")
    assert kernel_probe.training_attention(SMOL_HEADS, timer=timer) == "fma"
    assert timer.calls == 0


@pytest.mark.parametrize("answer", ["dot", "fma"])
def test_a_bf16_engine_attends_as_the_probe_answered(probe, monkeypatch, answer) -> None:
    """The engine asks once for its model's heads and the packed passes of its training take the answer."""
    from grpo.backends.local import packed_attention

    asked = []
    monkeypatch.setattr(packed_attention, "_DOT_PRODUCTS", set())
    monkeypatch.setattr(kernel_probe, "training_attention", lambda shapes: asked.append(shapes) or answer)
    probe(FakeTimer(0.4, 0.4))
    ServiceClient(device="cpu", train_dtype="bf16", sample_dtype="fp32").create_lora_training_client("tiny", rank=4)
    assert asked == [kernel_probe.AttentionShapes(4, 2, 16)]
    assert packed_attention._DOT_PRODUCTS == ({(4, 2, 16)} if answer == "dot" else set())
