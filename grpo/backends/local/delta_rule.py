"""Qwen3.5's gated-delta-rule layers take their decoding steps through grpo's native kernel.

A hybrid's linear-attention layer keeps, per row, a float32 state of value heads x 128 x 128 (16
heads: 1 MiB a layer). transformers' CPU path for a decoding step (``torch_recurrent_gated_delta_rule``,
the fallback for a GPU kernel) takes a dozen operators, four of them over the whole state, each
writing a state-sized temporary; at 32 rows of a Qwen3.5-0.8B-sized model that was three quarters
of a 1.3 s decoding step (docs/benchmark.md). ``native/delta_rule.cpp`` updates each row's state in
place in one call (its output within float32 rounding of the reference's, tests/test_delta_rule.py).

``routed(model)`` gives each such layer ``decode_forward`` while a sampling call runs: a
single-token step on a cache whose states are float32 on the CPU runs the layer's projections and
gated norm as its forward does, with the recurrence, and the short convolution before it (SiLU
after, one dtype: else the model's own function), through the kernels; anything else (a prefill,
another cache, a tensor elsewhere) is the layer's own forward. A class is taken after its first
layer computed what its own forward computes on a random step (else nothing is routed), and each
layer gets its own forward back after.

A prefill and a training pass run transformers' reference functions where the GPU packages are not
installed (flash-linear-attention, causal-conv1d), and two of them cost more than their sums. The
chunked delta rule ran as ~40 operators over every head at once, and autograd ~80 more backward
(5.4 s of a 19 s training pass of a Qwen3.5-0.8B-sized model): ``fit_prefill`` gives the layers'
module (Qwen3.5's, Qwen3.5-MoE's, Qwen3-Next's) a function that runs it through
``native/chunked_delta_rule.cpp`` (each chunk of each head in a core's cache, forward and backward;
taken after a trial against the reference in each process) in chunks fitted to the sequence (as few
as of at most 64 positions, as even as can be: the same sums in another grouping), and, where the
kernels are not built, the reference in those chunks (which pads a sequence to a multiple of 64
positions and whose work grows with the chunk squared: a GRPO completion of 32 tokens costs half).
The short convolution's reference pads both ends, convolves, and applies its SiLU to a strided slice
of the result (9x slower than on contiguous values), and autograd mirrors each pass: its replacement
runs ``native/short_conv.cpp`` (SiLU fused, forward and backward, the layer's channels-last memory
read and written in place, so that q, k and v reach the delta rule's kernel as views), after a trial
as the delta rule's, and without the kernels pads on the left only (the same products; in bfloat16
the kernel's are the exact values rounded where the reference rounds, the reference's own bits where
oneDNN sums in float32, as on AVX-512). In a packed training pass (a micro-batch's sequences back to
back in one row: packed_attention.py) both functions run each sequence from its own history
(packed_recurrence.py; the delta rule through the kernel's segments), and ``packs`` says whether a
model's layers do. docs/benchmark.md has the numbers.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import sys
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from grpo.backends.local import packed_recurrence
from grpo.backends.local.native_layers import close_to
from grpo.backends.local.packed_attention import running_pass
from grpo.models import native_kernels

# the layers whose forward ``decode_forward`` restates (a class not listed keeps its own)
CLASSES = ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet")
# the layers whose modules ``fit_prefill`` gives its functions (their references read: the same code as Qwen3.5's)
PREFILL_CLASSES = (*CLASSES, "Qwen3NextGatedDeltaNet")
# how far the kernel's step may be from the layer's own on a random step, relative to the output's
# scale: float sums in another order move float32's last bits, and flip a bf16 rounding now and then
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2.0**-6}

_verdicts: dict[tuple[type, torch.dtype], bool] = {}


def decode_forward(self: nn.Module, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs):
    """A gated-delta-rule layer's forward, its single-token cached steps through the kernel."""
    ops = native_kernels.kernels()
    states = _step_states(self, hidden_states, cache) if ops is not None else None
    if states is None:
        return type(self).forward(self, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    conv_state, recurrent_state = states
    rows = hidden_states.shape[0]
    mixed_qkv = self.in_proj_qkv(hidden_states)
    z = self.in_proj_z(hidden_states).reshape(rows, -1, self.head_v_dim)
    b, a = self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)
    taps = self.conv1d.weight.squeeze(1)
    if _native_conv(self, conv_state, mixed_qkv):
        mixed_qkv = ops.causal_conv_step_(conv_state, mixed_qkv[:, 0], taps, self.conv1d.bias, True)
    else:  # (the model's own step: a kernel where one is installed)
        conv_update = sys.modules[type(self).__module__].causal_conv1d_update
        mixed_qkv = conv_update(mixed_qkv.transpose(1, 2), conv_state, taps, self.conv1d.bias, self.activation)[:, :, 0]
    query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    beta = b.sigmoid()
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
    out = ops.gated_delta_step_(recurrent_state, query.view(rows, -1, self.head_k_dim),
                                key.view(rows, -1, self.head_k_dim), value.view(rows, -1, self.head_v_dim), g, beta)
    # (the state is the cache's own tensor, updated in place: nothing to store back)
    out = self.norm(out.to(hidden_states.dtype).reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(out.reshape(rows, 1, -1))


def _native_conv(layer: nn.Module, conv_state: torch.Tensor, mixed_qkv: torch.Tensor) -> bool:
    """Whether the short convolution's step is the kernel's: SiLU after it, its window, input and taps
    of one dtype (transformers' own step runs where a kernel for it is installed)."""
    module = sys.modules[type(layer).__module__]
    weight = layer.conv1d.weight
    return (layer.activation in ("silu", "swish") and getattr(module.causal_conv1d_update, "__module__", None) == module.__name__
            and conv_state.is_contiguous() and conv_state.dtype == mixed_qkv.dtype == weight.dtype
            and (layer.conv1d.bias is None or layer.conv1d.bias.dtype == weight.dtype))


def _step_states(layer: nn.Module, hidden_states: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The layer's conv and recurrent states where this is a step the kernel takes, else None."""
    if cache is None or hidden_states.shape[1] != 1 or hidden_states.device.type != "cpu":
        return None
    if cache.is_recording_past(layer.layer_idx):
        return None
    conv_state = cache.get_conv_state(layer.layer_idx, state_idx=0)
    recurrent_state = cache.get_recurrent_state(layer.layer_idx, state_idx=0)
    if conv_state is None or recurrent_state is None:
        return None
    if recurrent_state.dtype != torch.float32 or not recurrent_state.is_contiguous():
        return None
    return conv_state, recurrent_state


def _computes_the_same(model: nn.Module, layer: nn.Module) -> bool:
    """Whether ``decode_forward`` gives what the layer's own forward gives on a step after a random
    3-token prefill (outputs and states), within ``TOLERANCE`` of its dtype."""
    from transformers import DynamicCache

    parameter = next(layer.parameters())
    if parameter.device.type != "cpu" or parameter.dtype not in TOLERANCE:
        return False
    generator = torch.Generator().manual_seed(0)
    prefill = torch.randn(2, 3, layer.hidden_size, generator=generator).to(parameter.dtype)
    step = torch.randn(2, 1, layer.hidden_size, generator=generator).to(parameter.dtype)
    try:
        with torch.no_grad():
            results = []
            for forward in (type(layer).forward, decode_forward):
                cache = DynamicCache(config=model.config)
                type(layer).forward(layer, prefill, cache=cache)
                out = forward(layer, step, cache=cache)
                results.append((out, cache.get_recurrent_state(layer.layer_idx, state_idx=0)))
    except (RuntimeError, TypeError, ValueError, AttributeError, IndexError, KeyError):
        return False
    return all(close_to(got, want, TOLERANCE[parameter.dtype]) for want, got in zip(*results, strict=True))


@contextlib.contextmanager
def routed(model: nn.Module) -> Iterator[int]:
    """While inside, ``model``'s gated-delta-rule layers take their decoding steps through the
    kernel (on a CPU, where the kernels are built); yields how many layers were routed."""
    layers = [m for m in model.modules() if type(m).__name__ in CLASSES and "forward" not in vars(m)]
    if not layers or native_kernels.kernels() is None:
        yield 0
        return
    taken = []
    for layer in layers:
        key = (type(layer), next(layer.parameters()).dtype)
        if key not in _verdicts:
            _verdicts[key] = _computes_the_same(model, layer)
        if _verdicts[key]:
            layer.forward = types.MethodType(decode_forward, layer)
            taken.append(layer)
    try:
        yield len(taken)
    finally:
        for layer in taken:
            del layer.forward


# the reference's chunk: the most positions a chunk of a fitted sequence takes
MOST_CHUNK = 64


def fitted_chunk(positions: int) -> int:
    """The chunk size for a sequence of ``positions``: the fewest chunks of at most ``MOST_CHUNK``,
    as even as can be (70 positions: two of 35, where the reference pads to two of 64)."""
    return math.ceil(positions / math.ceil(max(positions, 1) / MOST_CHUNK))


def fit_prefill(model: nn.Module) -> int:
    """Give the modules of ``model``'s gated-delta-rule layers the chunked delta rule through the
    native kernel (else the reference in fitted chunks) and the left-padded convolution; returns how
    many functions were taken (or were already). Once per module, for the whole process: the same sums
    as the references'. A function that is not transformers' reference (its kernel package installed,
    or replaced by a user) is kept."""
    names = {type(m).__module__ for m in model.modules() if type(m).__name__ in PREFILL_CLASSES}
    taken = 0
    for name in sorted(names):
        module = sys.modules[name]
        for function_name, (package, wrap) in REFERENCES.items():
            function = getattr(module, function_name, None)
            if getattr(function, "fitted_by_grpo", False):
                taken += 1
            elif _is_the_reference(module, function, function_name, package):
                faster = wrap(function)
                faster.fitted_by_grpo = True
                setattr(module, function_name, faster)
                taken += 1
    return taken


def packs(model: nn.Module) -> bool:
    """Whether ``model``'s decoder may run a packed training pass (packed_recurrence.py): its layers
    attention or linear attention only, each linear-attention layer's module running grpo's delta
    rule and convolution (``fit_prefill``), the kernels built. Whether it computes each sequence as
    alone is then tried (packed_attention.packs_as_alone)."""
    from grpo.backends.local.kv_cache import ATTENTION_LAYER_TYPES

    text = model.config.get_text_config(decoder=True)
    kinds = set(getattr(text, "layer_types", None) or [])
    if not kinds or not kinds <= {*ATTENTION_LAYER_TYPES, "linear_attention"} or native_kernels.kernels() is None:
        return False
    linear = [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
    if not linear or any(type(m).__name__ not in PREFILL_CLASSES for m in linear):
        return False
    modules = {sys.modules[type(m).__module__] for m in linear}
    return all(getattr(getattr(module, name, None), "fitted_by_grpo", False) for module in modules for name in REFERENCES)


def _is_the_reference(module, function, name: str, package: str) -> bool:
    """Whether ``function`` is ``module``'s own torch implementation ``name`` (transformers wraps it
    to take ``package``'s kernel instead where that is installed)."""
    wrapped = getattr(function, "__wrapped__", None)
    return (getattr(wrapped, "__module__", None) == module.__name__ and getattr(wrapped, "__name__", None) == name
            and importlib.util.find_spec(package) is None)


def _fitted_chunks(reference):
    @functools.wraps(reference)
    def chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, chunk_size: int | None = None,
                               initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                               use_qk_l2norm_in_kernel: bool = False, **kwargs):
        # (query: rows x positions x heads x dimension; a chunk size the caller names is kept)
        packed = running_pass()
        if packed is not None:  # (a training pass's sequences back to back in one row: packed_recurrence.py)
            if not _kernel_takes(reference, query, key, value, g, beta, None, kwargs) or initial_state is not None \
                    or output_final_state:
                raise NotImplementedError("a packed pass's delta rule runs through grpo's native kernel, from no "
                                          "state, keeping none")
            out = packed_recurrence.delta_rule(packed, *_kernel_inputs(query, key, value, g, beta),
                                               bool(use_qk_l2norm_in_kernel), fitted_chunk, _native_segments)
            return out.to(query.dtype), None
        chunk = fitted_chunk(query.shape[1]) if chunk_size is None else chunk_size
        if _kernel_takes(reference, query, key, value, g, beta, initial_state, kwargs):
            return _native_chunks(query, key, value, g, beta, chunk, initial_state, output_final_state,
                                  use_qk_l2norm_in_kernel)
        return reference(query, key, value, g, beta, chunk, initial_state, output_final_state,
                         use_qk_l2norm_in_kernel, **kwargs)

    return chunk_gated_delta_rule


class _NativeChunks(torch.autograd.Function):
    """The chunked delta rule through native/chunked_delta_rule.cpp, forward and backward: q, k, v in
    one dtype, each position's heads back to back (``_heads_dense``), g, beta and the states in
    float32, contiguous. With ``segments`` (the kernel's ``[row, start, length, chunk, state]`` rows:
    packed_recurrence.py) it runs those, each from the initial state it names, and gives each
    segment's final state; a state several segments start from gets the sum of their gradients."""

    @staticmethod
    def forward(ctx, query, key, value, g, beta, initial_state, chunk: int, final_state: bool, l2norm: bool,
                segments=None):
        ops = native_kernels.kernels()
        out, state = ops.chunk_delta_rule(query, key, value, g, beta, initial_state, chunk, final_state, l2norm,
                                          segments)
        ctx.save_for_backward(query, key, value, g, beta, initial_state, segments)
        ctx.chunk, ctx.l2norm = chunk, l2norm
        ctx.set_materialize_grads(False)  # (a state nobody reads has no gradient: None, not zeros)
        return out, state

    @staticmethod
    def backward(ctx, grad_out, grad_state):
        query, key, value, g, beta, initial_state, segments = ctx.saved_tensors
        grad_out = torch.zeros_like(value) if grad_out is None else grad_out.to(value.dtype).contiguous()
        grad_state = grad_state.float().contiguous() if grad_state is not None and grad_state.numel() else None
        dq, dk, dv, dg, dbeta, d_initial = native_kernels.kernels().chunk_delta_rule_backward(
            grad_out, grad_state, query, key, value, g, beta, initial_state, ctx.chunk, ctx.l2norm, segments)
        rows, positions, k_heads, dim = query.shape
        group = value.shape[2] // k_heads
        if group > 1:  # (the kernel gives each value head's share of its key head's gradients)
            dq, dk = (x.view(rows, positions, k_heads, group, dim).sum(3) for x in (dq, dk))
        if segments is not None and initial_state is not None:  # (per segment: summed per state it read)
            starts_from = segments[:, 4]
            if not bool((starts_from >= 0).all()):  # (as a rule every segment of a level after the first reads one)
                reads = (starts_from >= 0).nonzero()[:, 0]
                starts_from, d_initial = starts_from[reads], d_initial[reads]
            d_initial = torch.zeros_like(initial_state).index_add_(0, starts_from, d_initial)
        return (dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), dg, dbeta,
                d_initial if initial_state is not None else None, None, None, None, None)


def _kernel_inputs(query, key, value, g, beta):
    """q, k, v in one dtype the kernel computes in (else float32), each position's heads back to back
    and q, k at the same strides; g and beta float32, contiguous."""
    dtype = query.dtype if query.dtype == key.dtype == value.dtype and query.dtype in TOLERANCE else torch.float32
    q, k, v = (_heads_dense(x.to(dtype)) for x in (query, key, value))
    if q.stride() != k.stride():
        q, k = q.contiguous(), k.contiguous()
    return q, k, v, *(x.float().contiguous() for x in (g, beta))


def _native_chunks(query, key, value, g, beta, chunk: int, initial_state, output_final_state: bool, l2norm: bool):
    """The reference's result through the kernel: its output in the query's dtype, the final state in
    float32 (None where not asked for)."""
    state = initial_state.float().contiguous() if initial_state is not None else None
    out, final = _NativeChunks.apply(*_kernel_inputs(query, key, value, g, beta), state, chunk,
                                     bool(output_final_state), bool(l2norm))
    return out.to(query.dtype), final if output_final_state else None


def _native_segments(q, k, v, g, beta, initial, segments: torch.Tensor, final: bool, l2norm: bool):
    """One level of a packed pass's segments through the kernel (``packed_recurrence.delta_rule``)."""
    return _NativeChunks.apply(q, k, v, g, beta, initial, 1, final, l2norm, segments)


def _heads_dense(x: torch.Tensor) -> torch.Tensor:
    """``x`` (rows x positions x heads x dim) where each position's heads lie back to back, as the
    kernel reads them: the layer's q, k and v are such views of its convolution's channels-last
    output (no copy); anything else is copied."""
    dense = x.stride(3) == 1 and (x.shape[2] < 2 or x.stride(2) == x.shape[3])
    return x if dense else x.contiguous()


# whether the kernel computed what the reference computes on a small random case, per reference
_chunk_verdicts: dict[object, bool] = {}


def _kernel_takes(reference, query, key, value, g, beta, initial_state, kwargs) -> bool:
    """Whether the kernel takes this call: its kernels built, CPU tensors of the shapes it reads, no
    packed sequences (``cu_seqlens``: the reference says what it cannot do), and a first trial
    against the reference passed in this process."""
    if native_kernels.kernels() is None or kwargs.get("cu_seqlens") is not None:
        return False
    tensors = [query, key, value, g, beta] + ([initial_state] if initial_state is not None else [])
    if any(not isinstance(t, torch.Tensor) or t.device.type != "cpu" for t in tensors):
        return False
    if query.dim() != 4 or key.shape != query.shape or value.dim() != 4 or value.shape[:2] != query.shape[:2]:
        return False
    rows, positions, k_heads, dim = query.shape
    v_heads = value.shape[2]
    if positions == 0 or v_heads % k_heads or g.shape != (rows, positions, v_heads) or beta.shape != g.shape:
        return False
    if initial_state is not None and initial_state.shape != (rows, v_heads, dim, value.shape[3]):
        return False
    if reference not in _chunk_verdicts:
        _chunk_verdicts[reference] = _kernel_computes_the_reference(reference)
    return _chunk_verdicts[reference]


def _kernel_computes_the_reference(reference) -> bool:
    """Whether the kernel's output, final state and every gradient are the reference's (within
    float32 rounding) on 2 rows of 7 positions, 4 value heads over 2 key heads, in chunks of 4."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(2, 7, 2, 8), (2, 7, 2, 8), (2, 7, 4, 8), (2, 7, 4), (2, 7, 4), (2, 4, 8, 8)]
    inputs = [torch.randn(shape, generator=generator) for shape in shapes]
    inputs[3], inputs[4] = -inputs[3].abs(), inputs[4].sigmoid()  # (g: a log decay; beta in (0, 1))
    return _trial(reference, _native_chunks, inputs, lambda f, *x: list(f(*x[:5], 4, x[5], True, True)),
                  "chunked delta rule")


def _trial(reference, kernel, inputs: list[torch.Tensor], call, what: str) -> bool:
    """Whether ``call(kernel, *inputs)`` gives the outputs of ``call(reference, *inputs)``, and the
    same gradients of the inputs, within float32 rounding (said once where not)."""
    results = []
    try:  # (the first call may come in a sampler's no-grad prefill: the trial takes gradients all the same)
        with torch.inference_mode(False), torch.enable_grad():
            for function in (reference, kernel):
                leaves = [x.detach().clone().requires_grad_() for x in inputs]
                outputs = call(function, *leaves)
                sum(out.square().sum() if i else out.sum() for i, out in enumerate(outputs)).backward()
                results.append(outputs + [x.grad for x in leaves])
    except (RuntimeError, TypeError, ValueError) as exc:
        print(f"grpo: the native {what} failed its trial ({exc}); the reference runs", file=sys.stderr)
        return False
    if all(close_to(got, want, 1e-4) for want, got in zip(*results, strict=True)):
        return True
    print(f"grpo: the native {what} did not compute the reference's values in its trial; the reference runs",
          file=sys.stderr)
    return False


def _left_padded(reference):
    @functools.wraps(reference)
    def causal_conv1d_fn(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         activation: str | None = None, **kwargs):
        packed = running_pass()
        if packed is not None:  # (a training pass's sequences back to back in one row: packed_recurrence.py)
            return packed_recurrence.conv(packed, hidden_states, weight,
                                          lambda x: convolve(x, weight, bias, activation, **kwargs))
        return convolve(hidden_states, weight, bias, activation, **kwargs)

    def convolve(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
                 **kwargs):
        """The convolution of whole rows (a packed pass's laid out by packed_recurrence.conv)."""
        if kwargs.get("seq_idx") is not None:  # (packed sequences: the reference says what it cannot do)
            return reference(hidden_states, weight, bias, activation=activation, **kwargs)
        if _conv_kernel_takes(reference, hidden_states, weight, bias, activation):
            return _sequence_conv(hidden_states, weight, bias, activation)
        # rows x channels x positions, a filter of ``taps`` per channel: the output at t reads t-taps+1..t
        taps = weight.shape[-1]
        padded = F.pad(hidden_states.to(weight.dtype), (taps - 1, 0))
        out = F.conv1d(padded, weight.unsqueeze(1), bias, groups=hidden_states.shape[1])
        if activation is not None:
            out = ACT2FN[activation](out)
        return out.to(hidden_states.dtype)

    return causal_conv1d_fn


class _SequenceConv(torch.autograd.Function):
    """The short convolution (SiLU after it, or none) through native/short_conv.cpp, forward and
    backward, on rows x positions x channels with the channels contiguous."""

    @staticmethod
    def forward(ctx, x, weight, bias, silu: bool):
        ctx.save_for_backward(x, weight, bias)
        ctx.silu = silu
        return native_kernels.kernels().short_conv(x, weight, bias, silu)

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias = ctx.saved_tensors
        grad = grad if grad.stride(2) == 1 else grad.contiguous()
        weight_grads = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        dx, d_weight, d_bias = native_kernels.kernels().short_conv_backward(grad, x, weight, bias, ctx.silu,
                                                                            weight_grads)
        return (dx, d_weight.to(weight.dtype) if ctx.needs_input_grad[1] else None,
                d_bias.to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None, None)


def _sequence_conv(hidden_states, weight, bias, activation):
    """The reference's result through the kernel: ``hidden_states`` rows x channels x positions (the
    layer's view of its projection, channels contiguous), the output the same view of channels-last
    memory (the layer transposes it back)."""
    x = hidden_states.transpose(1, 2)
    x = x if x.stride(2) == 1 else x.contiguous()
    bias = bias.contiguous() if bias is not None else None
    return _SequenceConv.apply(x, weight.contiguous(), bias, activation is not None).transpose(1, 2)


_conv_verdicts: dict[object, bool] = {}


def _conv_kernel_takes(reference, hidden_states, weight, bias, activation) -> bool:
    """Whether the kernel takes this call: its kernels built, CPU tensors of one dtype it computes in,
    SiLU after or no activation, and a first trial against the reference passed in this process."""
    if native_kernels.kernels() is None or activation not in (None, "silu", "swish"):
        return False
    tensors = [hidden_states, weight] + ([bias] if bias is not None else [])
    if any(not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.dtype != weight.dtype for t in tensors):
        return False
    if weight.dtype not in TOLERANCE or hidden_states.dim() != 3 or weight.dim() != 2:
        return False
    if hidden_states.shape[1] != weight.shape[0] or (bias is not None and bias.shape != weight.shape[:1]):
        return False
    if reference not in _conv_verdicts:
        _conv_verdicts[reference] = _trial(reference, _sequence_conv, _conv_trial_inputs(),
                                           lambda f, x, w, b: [f(x, w, b, "silu")], "short convolution")
    return _conv_verdicts[reference]


def _conv_trial_inputs() -> list[torch.Tensor]:
    """3 rows, 24 channels, 9 positions, a filter of 4 taps, a bias: the layer's layout (channels
    contiguous), in float32."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 9, 24, generator=generator).transpose(1, 2)
    return [x, torch.randn(24, 4, generator=generator), torch.randn(24, generator=generator)]


# each reference ``fit_prefill`` takes: the package whose kernel transformers takes instead where it
# is installed, and grpo's wrapper of the reference
REFERENCES = {"torch_chunk_gated_delta_rule": ("fla", _fitted_chunks), "causal_conv1d_fn": ("causal_conv1d", _left_padded)}
