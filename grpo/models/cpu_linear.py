"""Float32 ``nn.Linear`` layers on the CPU through oneDNN rather than the BLAS behind ``F.linear``.

PyTorch's CPU wheels send a float32 ``F.linear`` to MKL's sgemm, which on AMD CPUs (the
reference machine is an EPYC) runs well below what the same cores reach through oneDNN, the
library PyTorch already uses for bf16 matmuls on the CPU. Measured on the reference machine with
SmolLM2-135M's shapes: the unembedding (49,152 x 576) takes 22 ms through MKL and 9 ms through
oneDNN for 4 decoding rows, 95 and 43 ms for 128; a sampling call and a forward_backward of 32
sequences are each about 1.4x faster (alternating A/B, docs/benchmark.md).

``use_onednn_linears`` turns every plain float32 ``nn.Linear`` of a CPU model into a
``OneDNNLinear``: the same module with the same Parameters, whose forward calls oneDNN's linear
kernel (backward included, through a small autograd Function). Anything else (a GPU tensor, a
half-precision weight, a build without oneDNN) takes ``nn.Linear``'s own path. Results differ
from MKL's only by float rounding (different summation order); the sampler and the trainer use
the same kernels, so they still agree with each other as before.

On other CPUs MKL is the faster one for training: on an Intel Xeon with AMX its input gradients
ran up to 1.6x faster. So a float32 model's training products go to the kernel that measured
faster on the machine (``OneDNNLinear.kernel``, set by the engine from kernel_probe.py).

The sampler's gradient-free weights are packed once (``pack_weight``): into oneDNN's blocked
layout, or -- float32 or bf16, where grpo's native kernels are built and the machine measured it
faster for a decoding step in that precision (kernel_probe.py) -- into grpo's streaming layout,
whose product (native/stream_linear.cpp) reads each weight once for all of a
decoding step's rows and prefetches ahead: SmolLM2's Linears at 24 rows, 30 layers' distinct
weights, took 33 ms against oneDNN's 47 in fp32, 29 against 51 in bf16 (Intel Xeon, avx512, no
AMX, 2 cores; docs/benchmark.md). A bf16 weight streams in one of two kernels: widened to float32
for float32's multiply-adds (``stream``), or in pairs of values for avx512_bf16's dot product
(``stream_dot``), which on an AMD EPYC (Zen 4) ran SmolLM2's products at 32 rows 1.96x faster than
the widened kernel and 1.34x faster than oneDNN's bf16 product, and on an Intel Xeon without AMX
slower: which one a sampler packs in is measured too (kernel_probe.py). ``packed_product``
multiplies by any of them, with LoRA's side path (``LoraSideProduct``) inside the streaming
product's sums.

``GRPO_CPU_LINEAR=torch`` in the environment keeps PyTorch's default kernels.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

ENV_SWITCH = "GRPO_CPU_LINEAR"


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # oneDNN's Linear as PyTorch binds it for its own CPU compiler (inductor); it takes the dense
    # weight as it is (a transposed view too, for the input gradient), or oneDNN's packed one.
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


# The layouts a gradient-free weight may be packed in: oneDNN's, or grpo's streaming one
# (native/stream_linear.cpp): "stream" for float32 multiply-adds (bf16 widened), "stream_dot" for a bf16
# weight in pairs of values for avx512_bf16's dot product (a float32 weight asked for it streams as
# "stream"). The streaming layouts hold the output columns in panels of this many.
LAYOUTS = ("onednn", "stream", "stream_dot")
STREAMING = ("stream", "stream_dot")
STREAM_COLUMNS = 16
STREAM_DTYPES = (torch.float32, torch.bfloat16)
_stream: dict = {"ops": None}  # torch.ops.grpo_native, once loaded


def _stream_ops():
    """torch.ops.grpo_native where grpo's native kernels are built and loaded, else None."""
    if _stream["ops"] is None:
        from grpo.models import native_kernels  # (which builds them on first need, not on import)

        ops = native_kernels.kernels()
        if ops is not None and hasattr(ops, "stream_linear"):
            _stream["ops"] = ops
    return _stream["ops"]


def stream_dot_available() -> bool:
    """Whether bf16 weights can stream in pairs for avx512_bf16's dot product here (the "stream_dot"
    layout): grpo's native kernels loaded, and built for a CPU with that instruction."""
    ops = _stream_ops()
    return ops is not None and bool(ops.stream_dot_available())


def _in_pairs(weight: torch.Tensor, layout: str) -> bool:
    """Whether ``weight`` packed in ``layout`` streams in pairs: bf16 in "stream_dot" where built."""
    return layout == "stream_dot" and weight.dtype == torch.bfloat16 and stream_dot_available()


def layout_of(packed: torch.Tensor) -> str:
    """The layout a weight was packed in by ``pack_weight``."""
    if packed.is_mkldnn:
        return "onednn"
    return "stream_dot" if packed.shape[-1] == 2 * STREAM_COLUMNS else "stream"


def stream_available() -> bool:
    """Whether float32 weights can be packed in the streaming layout here: grpo's native kernels
    built and loaded (GRPO_NATIVE_KERNELS on, a compiler present)."""
    return _stream_ops() is not None


def packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                   lora: LoraSideProduct | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for a weight packed by ``pack_weight``, in whichever layout, plus LoRA's
    side path where given (in the streaming layout, part of the same sums: one rounding)."""
    if packed.is_mkldnn:
        out = _onednn(x, packed, bias)
        return out if lora is None else lora.add_to(out, x)
    ops = _stream["ops"]  # (loaded: the weight was packed by it)
    if lora is not None and lora.streams:
        return ops.stream_linear(x, packed, bias, *lora.packed)
    out = ops.stream_linear(x, packed, bias)
    return out if lora is None else lora.add_to(out, x)


class LoraSideProduct:
    """``base_out + (x @ A.T) @ B.T`` for the sampler's LoRA side paths, A and B given in the base's
    dtype (the scale already in B). Where oneDNN can, A and B are packed once and B's product adds
    the base output in its own post-op: two calls and no weight reorders, where ``F.linear`` with A
    and an ``addmm_`` into the output reorder A every call (the side paths of a bf16 decoding step,
    each a few microseconds of arithmetic, were ~13% of the step in calls). Beside a base packed in
    the streaming layout (``layout``), A and B are packed in it too (the rank padded with zeros to
    ``STREAM_COLUMNS``: zero products, the same sums), and ``packed_product`` computes the side path
    inside the base's product: on an Intel Xeon without AMX oneDNN's two bf16 calls took ~66 us a
    side path, 0.5 s of a 2.5 s bf16 sampling call, and two streaming products of their own 32-34%
    of a step's products (docs/benchmark.md). Elsewhere, that ``addmm_`` into ``base_out``, in
    place."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, layout: str = "onednn"):
        self.a, self.b = a, b
        self.packed = None
        self.streams = layout in STREAMING and streams(b) and streams(a, any_rows=True)
        if self.streams:  # (A as the base, in pairs where it is; B multiplies float32 d = x @ A.T: plain)
            pad = -a.shape[0] % STREAM_COLUMNS
            ops = _stream_ops()
            self.packed = (ops.stream_pack(F.pad(a.detach(), (0, 0, 0, pad)), _in_pairs(a, layout)),
                           ops.stream_pack(F.pad(b.detach(), (0, pad))))
        elif can_pack(a) and can_pack(b) and _binary_add_works(a.dtype):
            self.packed = (pack_weight(a, "onednn"), pack_weight(b, "onednn"))

    def add_to(self, base_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.streams:  # (beside a base of another layout: the side path's two products, out of place)
            ops, (a, b) = _stream["ops"], self.packed
            return base_out + ops.stream_linear(ops.stream_linear(x, a, None), b, None)
        if self.packed is not None:  # (oneDNN's layout: its binary post-op adds base_out)
            a, b = self.packed
            return torch.ops.mkldnn._linear_pointwise.binary(_onednn(x, a, None), base_out, b, None, "add")
        base_out.view(-1, base_out.shape[-1]).addmm_(F.linear(x.reshape(-1, x.shape[-1]), self.a), self.b.t())
        return base_out


def _on_computing_thread(check):
    """A cached check that multiplies a few values through oneDNN, run on the process's computing
    thread (computing.py) whoever asks: run on a caller's own thread, its one product left an OpenMP
    team there, a second one in the process, after which grpo's sampling ran 1.5x slower (a bf16
    decoding step 35 against 22.5 ms on an AMD EPYC; the bench resolved ``auto`` on its main
    thread and measured grpo that way; docs/benchmark.md)."""

    @functools.cache
    @functools.wraps(check)
    def checked(*args):
        from grpo.models import computing

        return computing.run(check, *args)

    return checked


@_on_computing_thread
def _binary_add_works(dtype: torch.dtype) -> bool:
    """Whether oneDNN's Linear with an ``add`` post-op computes ``other + x @ w.T`` here."""
    try:
        gen = torch.Generator().manual_seed(0)
        x, w, other = (torch.randn(shape, generator=gen).to(dtype) for shape in ((3, 1, 16), (24, 16), (3, 1, 24)))
        got = torch.ops.mkldnn._linear_pointwise.binary(x, other, pack_weight(w, "onednn"), None, "add")
        tolerance = 1e-4 if dtype == torch.float32 else 5e-2
        return torch.allclose(got.float(), (other + F.linear(x, w)).float(), rtol=tolerance, atol=tolerance)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


class _OneDNNLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # The input is kept only when the weight needs a gradient (LoRA's A and B, not the base)
        ctx.save_for_backward(x if weight.requires_grad else None, weight)
        ctx.has_bias = bias is not None
        return _onednn(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = _onednn(grad, weight.t(), None)
        flat_grad = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_weight = flat_grad.t() @ x.reshape(-1, x.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = flat_grad.sum(0)
        return grad_x, grad_weight, grad_bias


class OneDNNLinear(nn.Linear):
    """``nn.Linear`` whose float32 CPU forward and backward run through oneDNN.

    Given a plain row-major weight, oneDNN reorders it into its blocked layout inside every call;
    for a decoding step's few rows that reorder costs about as much as the product (SmolLM2's MLP
    at 32 rows: 376 us plain, 270 us packed in fp32, 217 / 148 us in bf16; AMD EPYC Zen 4 with
    avx512_bf16, docs/benchmark.md). The sampler's own layers therefore hold only the packed
    weight (``PackedLinear``: folded_lora.py, sampler_precision.py). A layer that is also trained
    through (the unembedding; every base Linear of a bf16 model, which samples through its LoRA
    layers unfolded) is marked ``inference_packed`` (``keep_packed_copies``): it keeps its weight
    and a packed copy, made on first gradient-free use and again whenever the weight changes.
    """

    inference_packed = False
    packed_layout = "onednn"  # the packed copy's (``pack_weight``)
    # The float32 kernel for products by the weight itself (training, and gradient-free calls
    # without a packed copy): oneDNN, or "torch" (``nn.Linear``'s own: MKL's sgemm in PyTorch's CPU
    # wheels) on a machine where that measured faster for training (kernel_probe.py).
    kernel = "onednn"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.dtype not in _ONEDNN_DTYPES or self.weight.dtype != x.dtype:
            return super().forward(x)
        by_onednn = x.dtype == torch.float32 and self.kernel == "onednn"
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad
                                        or (self.bias is not None and self.bias.requires_grad)):
            # bf16 training: PyTorch's own path (as fast at training's rows)
            return _OneDNNLinearFunction.apply(x, self.weight, self.bias) if by_onednn else super().forward(x)
        # (a copy of the model in another dtype keeps the mark: a CPU without bf16 instructions
        # packs no bf16 weight, and such a layer multiplies by its weight as it is)
        if self.inference_packed and can_pack(self.weight, self.packed_layout):
            return packed_product(x, self._packed_weight(), self.bias)
        return _onednn(x, self.weight, self.bias) if by_onednn else super().forward(x)

    def _packed_weight(self) -> torch.Tensor:
        key = (self.weight.data_ptr(), self.weight._version, self.packed_layout)
        if getattr(self, "_packed_key", None) != key:
            self._packed = pack_weight(self.weight, self.packed_layout)
            self._packed_key = key
        return self._packed


# oneDNN's Linear takes these weight dtypes on a CPU; bf16 runs natively with avx512_bf16 or AMX.
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


def streams(weight: torch.Tensor, any_rows: bool = False) -> bool:
    """Whether ``weight`` can be packed in the streaming layout: float32 or bf16, 2-d on the CPU,
    rows a multiple of ``STREAM_COLUMNS`` (unless ``any_rows``: a LoRA A, padded), grpo's kernels
    loaded, oneDNN's Linears not switched off (``GRPO_CPU_LINEAR=torch`` keeps PyTorch's kernels)."""
    return (weight.device.type == "cpu" and weight.dtype in STREAM_DTYPES and weight.dim() == 2
            and (any_rows or weight.shape[0] % STREAM_COLUMNS == 0) and wanted() and stream_available())


def pack_weight(weight: torch.Tensor, layout: str = "onednn") -> torch.Tensor:
    """``weight`` packed once for gradient-free products (``packed_product``), in ``layout``. The
    streaming layout takes the weights ``streams`` says it can; any other weight gets oneDNN's (an
    opaque mkldnn tensor ``_linear_pointwise`` takes), as does every weight asked for in oneDNN's."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown packed layout {layout!r}; valid: {', '.join(LAYOUTS)}")
    if layout in STREAMING and streams(weight):
        return _stream_ops().stream_pack(weight.detach(), _in_pairs(weight, layout))
    # The batch size is a hint for the layout; 32 rows is what a decoding step carries at most
    # as a rule, and the packed weight computes any number of rows.
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32)


class PackedLinear(nn.Module):
    """A gradient-free Linear holding only its packed weight (``pack_weight``: oneDNN's layout or the
    streaming one) and the bias: the sampler's layers, whose weights are built once per set of
    adapter weights and never trained."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, layout: str = "onednn"):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = pack_weight(weight, layout)
        self.bias = None if bias is None else bias.detach()
        self.dtype = weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_product(x, self.packed, self.bias)

    @property
    def layout(self) -> str:
        return layout_of(self.packed)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.dtype}, "
                f"packed ({self.layout})")


def keep_packed_copies(modules: list[nn.Module], layout: str = "onednn") -> int:
    """Mark these CPU Linears (float32 or bf16) to keep a packed copy of their weight, in
    ``layout`` (``pack_weight``), for gradient-free calls beside the weight training uses; the
    number marked. Costs one more copy of each weight, made on first use."""
    count = 0
    for module in modules:
        if type(module) in (nn.Linear, OneDNNLinear) and can_pack(module.weight, layout):
            module.__class__ = OneDNNLinear
            module.inference_packed = True
            module.packed_layout = layout
            count += 1
    return count


def can_pack(weight: torch.Tensor, layout: str = "onednn") -> bool:
    """Whether ``weight`` can be packed here, in ``layout`` or else in oneDNN's (``pack_weight``)."""
    if layout in STREAMING and streams(weight):
        return True
    return (weight.device.type == "cpu" and weight.dtype in _ONEDNN_DTYPES and weight.dim() == 2
            and wanted() and onednn_works() and packing_works(weight.dtype))


@_on_computing_thread
def packing_works(dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU pack a ``dtype`` weight and multiply by it as ``F.linear``
    does (a CPU without bf16 instructions may refuse a bf16 layout: its layers stay plain)."""
    try:
        gen = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(shape, generator=gen).to(dtype) for shape in ((3, 5, 16), (24, 16), (24,)))
        tolerance = 1e-4 if dtype == torch.float32 else 5e-2
        return torch.allclose(_onednn(x, pack_weight(w, "onednn"), b).float(), F.linear(x, w, b).float(),
                              rtol=tolerance, atol=tolerance)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def pack_for_inference(model: nn.Module, layout: str = "onednn") -> int:
    """Replace every CPU ``nn.Linear`` (float32 or bf16) of a gradient-free ``model`` by a
    ``PackedLinear`` (its weight packed in ``layout``, ``pack_weight``); the number replaced. A weight shared with another module (a tied
    unembedding) stays alive through that module; the others are dropped for their packed copy."""
    count = 0
    for name, module in list(model.named_modules()):
        if type(module) in (nn.Linear, OneDNNLinear) and can_pack(module.weight, layout):
            model.set_submodule(name, PackedLinear(module.weight, module.bias, layout))
            count += 1
    return count


@_on_computing_thread
def onednn_works() -> bool:
    """Whether this torch build has oneDNN's linear kernel and it computes what ``F.linear`` does."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        gen = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(shape, generator=gen) for shape in ((3, 5, 16), (24, 16), (24,)))
        return torch.allclose(_onednn(x, w, b), F.linear(x, w, b), rtol=1e-4, atol=1e-5)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def wanted() -> bool:
    """oneDNN Linears unless ``GRPO_CPU_LINEAR=torch``; a value other than those two is refused."""
    choice = os.environ.get(ENV_SWITCH, "onednn").strip().lower() or "onednn"
    if choice not in ("onednn", "torch"):
        raise ValueError(f"{ENV_SWITCH}={os.environ[ENV_SWITCH]!r}: valid values are 'onednn' (default) and 'torch'")
    return choice == "onednn"


def use_onednn_linears(model: nn.Module) -> int:
    """Turn the float32 CPU ``nn.Linear`` modules of ``model`` into ``OneDNNLinear`` in place;
    return how many. Module identity, Parameters and state dict are unchanged."""
    if not wanted() or not onednn_works():
        return 0
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32:
            module.__class__ = OneDNNLinear
            count += 1
    return count


# The float32 kernels an ``OneDNNLinear`` multiplies by its own weight through (its ``kernel``)
KERNELS = ("onednn", "torch")


def dense_products(dtype: torch.dtype = torch.float32) -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """``x @ w.T`` in ``dtype`` (``w`` as a Linear holds it, a transposed view too) through each dense
    CPU kernel of this build, by ``KERNELS``' names: PyTorch's own ``torch.mm`` (MKL's sgemm for
    float32 in PyTorch's CPU wheels) and oneDNN's where it computes that dtype here (an avx2-only CPU
    has no bf16 one). Which is faster is the machine's to say, not its flags': on an AMD EPYC Zen 5 a
    float32 ``torch.mm`` ran 220 GFLOP/s against oneDNN's 490 (MKL keeps to a slower path on AMD
    CPUs), bf16 ~980 both (docs/benchmark.md)."""
    products = {"torch": lambda x, w: torch.mm(x, w.t())}
    if _dense_onednn_works(dtype):
        products["onednn"] = lambda x, w: _onednn(x, w, None)
    return products


@_on_computing_thread
def _dense_onednn_works(dtype: torch.dtype) -> bool:
    """Whether oneDNN's linear computes ``x @ w.T`` in ``dtype`` from a plain weight, and from its
    transposed view, here."""
    if not onednn_works():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        x, w, g = (torch.randn(shape, generator=gen).to(dtype) for shape in ((3, 16), (24, 16), (3, 24)))
        tolerance = 1e-4 if dtype == torch.float32 else 5e-2
        return (torch.allclose(_onednn(x, w, None).float(), F.linear(x, w).float(), rtol=tolerance, atol=tolerance)
                and torch.allclose(_onednn(g, w.t(), None).float(), (g.float() @ w.float()), rtol=tolerance,
                                   atol=tolerance))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def use_kernel(model: nn.Module, kernel: str) -> int:
    """Give every ``OneDNNLinear`` of ``model`` the float32 ``kernel``; how many."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown fp32 training kernel {kernel!r}; valid: {', '.join(KERNELS)}")
    count = 0
    for module in model.modules():
        if type(module) is OneDNNLinear:
            module.kernel = kernel
            count += 1
    return count


def use_torch_linears(model: nn.Module) -> int:
    """Undo ``use_onednn_linears`` (for measuring against PyTorch's default kernels)."""
    count = 0
    for module in model.modules():
        if type(module) is OneDNNLinear:
            module.__class__ = nn.Linear
            count += 1
    return count
