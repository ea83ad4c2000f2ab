"""forward / forward_backward on a list of Datums: validation, micro-batches, chunked logprobs.

Memory does not scale with batch x vocab: datums are packed into micro-batches under a token
budget, and target logprobs come from the unembedding applied to a few hundred positions at a
time. In training, each chunk's share of the loss is backpropagated through the unembedding as
soon as it is computed (``unembed_counted``), so only one chunk of logits ever exists and none is
recomputed; the decoder then runs one backward for the whole micro-batch.

Packing: where the model allows (packed_attention.py; a hybrid's linear-attention layers through
packed_recurrence.py), a micro-batch's datums run back to back in one row, so no position is
padding; the padded path (``packed=False``) is the fallback and the reference.

Prefix sharing: datums whose leading positions the loss does not count are the same tokens (a
GRPO group: one prompt, several responses) run that prefix through the decoder once; its KV cache
is fanned out to the group, so the prompt's forward and backward are paid once per group instead
of once per datum (a hybrid's prefix fans out its linear layers' recurrent states too). Autograd
carries the group's gradient back through the fan-out into the one prefix pass, so results equal
the unshared path up to float summation order. Where the groups'
prompts themselves begin alike (a chat template's system prompt, a few-shot preamble), the packed
path runs that common trunk once per micro-batch and each group's prompt after it.
"""

from __future__ import annotations

import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise

import torch
from transformers import DynamicCache

from grpo.api import losses
from grpo.backends.local import native_layers, packed_attention
from grpo.backends.local.kv_cache import attention_only
from grpo.backends.local.logit_head import logit_head
from grpo.backends.local.sampler import position_ids
from grpo.backends.local.sections import section
from grpo.backends.local.trunk import common_trunk
from grpo.types import Datum, ForwardBackwardOutput, TensorData, text_tokens

LOGIT_CHUNK_POSITIONS = 256
# On a CPU a chunk's float32 logits stay under this many bytes: below glibc's 32 MiB mmap
# ceiling, a logits-sized tensor (the logits, their log_softmax, its exp) reuses heap memory
# (heap.py) instead of being a fresh mmap whose every page faults. 128 positions on a 49k
# vocabulary; never fewer than CPU_MIN_CHUNK_POSITIONS, so a large vocabulary's unembedding weight
# is not streamed once per handful of positions.
CPU_LOGIT_CHUNK_BYTES = 24 * 2**20
CPU_MIN_CHUNK_POSITIONS = 64
# Rows of the entropy's row-wise dot product per pass: their product stays in cache.
ENTROPY_BLOCK_ROWS = 16
# Shorter common prefixes are not worth the extra decoder call a shared group costs.
MIN_SHARED_PREFIX = 8


@dataclass
class PreparedDatum:
    index: int
    input_ids: list[int]
    targets: list[int]
    inputs: dict[str, torch.Tensor]  # float tensors of length n, besides target_tokens


def prepare(data: Sequence[Datum], loss_fn: str, vocab_size: int, check_tokens) -> list[PreparedDatum]:
    """Validate every datum up front so a bad one fails before any gradient is touched."""
    spec = losses.check_loss_fn(loss_fn)
    if not isinstance(data, (list, tuple)) or not data:
        raise ValueError("forward_backward needs a non-empty list of Datum")
    required = ("target_tokens", *spec.inputs)
    prepared: list[PreparedDatum] = []
    for i, datum in enumerate(data):
        if not isinstance(datum, Datum):
            raise TypeError(f"data[{i}] is a {type(datum).__name__}, expected grpo.types.Datum")
        tokens = text_tokens(datum.model_input, f"data[{i}]")
        if not tokens:
            raise ValueError(f"data[{i}] has an empty model_input")
        missing = [k for k in required if k not in datum.loss_fn_inputs]
        if missing:
            raise ValueError(
                f"data[{i}] is missing loss input(s) {missing} required by loss_fn={loss_fn!r} "
                f"(needs {list(required)}, optional: weights)"
            )
        check_tokens(tokens, f"data[{i}].model_input")
        targets = [int(t) for t in datum.loss_fn_inputs["target_tokens"].data]
        check_tokens(targets, f"data[{i}].loss_fn_inputs['target_tokens']")
        inputs = {
            k: v.to_torch().float().reshape(-1)
            for k, v in datum.loss_fn_inputs.items()
            if k != "target_tokens"
        }
        if prepared and set(inputs) != set(prepared[0].inputs):
            raise ValueError(
                f"data[{i}] has loss inputs {sorted(datum.loss_fn_inputs)} but data[0] has "
                f"{sorted(['target_tokens', *prepared[0].inputs])}; all datums of one call need the same keys"
            )
        prepared.append(PreparedDatum(i, tokens, targets, inputs))
    return prepared


# What one more decoder call costs beyond its tokens, in tokens: Python and kernel-launch
# overhead of a forward and backward through every layer, and the matmuls' lower efficiency on
# few rows. Keeps the partition below from cutting a batch to save a handful of padded tokens.
# Measured on a CPU (AMD EPYC, bf16; docs/benchmark.md): ~55 tokens' time for SmolLM2 packed and
# for a Qwen3.5 hybrid, ~118 for SmolLM2 padded; 32 had the padded path cut the bench's groups
# into four micro-batches where two ran 0.90x the time.
MICRO_BATCH_OVERHEAD_TOKENS = 64
# How far back the partition looks for a batch start: bounds its cost on very large calls.
PARTITION_LOOKBACK = 512


def partition(items: list, prefix_of, prefix_len, length, max_tokens: int | None, packed: bool = False) -> list[list]:
    """Cut ``items`` (in this order) into consecutive micro-batches, minimising the tokens the
    decoder processes plus a fixed cost per batch, with every batch's tokens within
    ``max_tokens`` (None: no limit; an item too big for any batch gets its own).

    A batch's tokens: each distinct prefix (``prefix_of(item)``, None for none) once plus every
    item's own ``length``. Padded (``packed=False``), each prefix counts as the batch's longest
    and each item as its longest, so items sorted by length keep padding small and this picks
    the cuts; packed, tokens are what they are and only the budget and the per-batch cost cut.
    """
    n = len(items)
    best = [0.0] + [float("inf")] * n
    start = [0] * (n + 1)
    for j in range(1, n + 1):
        prefixes: set = set()
        longest_prefix = longest = prefix_sum = length_sum = 0
        for i in range(j - 1, max(-1, j - 1 - PARTITION_LOOKBACK), -1):
            item = items[i]
            key = prefix_of(item)
            if key is not None and key not in prefixes:
                prefixes.add(key)
                longest_prefix = max(longest_prefix, prefix_len(item))
                prefix_sum += prefix_len(item)
            longest = max(longest, length(item))
            length_sum += length(item)
            if packed:
                tokens = prefix_sum + length_sum
            else:
                tokens = len(prefixes) * longest_prefix + (j - i) * longest
            if max_tokens is not None and tokens > max_tokens and i < j - 1:
                break
            cost = best[i] + tokens + MICRO_BATCH_OVERHEAD_TOKENS
            if cost < best[j]:
                best[j], start[j] = cost, i
    batches: list[list] = []
    j = n
    while j > 0:
        batches.append(items[start[j]:j])
        j = start[j]
    return batches[::-1]


def micro_batches(data: list[PreparedDatum], max_tokens: int | None, packed: bool = False) -> list[list[PreparedDatum]]:
    """Datums sorted by length, cut where padding or the budget says (``partition``)."""
    ordered = sorted(data, key=lambda d: len(d.input_ids))
    return partition(ordered, lambda d: None, lambda d: 0, lambda d: len(d.input_ids), max_tokens, packed)


@dataclass
class DecoderOutput:
    """A micro-batch after the decoder: everything but the unembedding of the counted positions.

    Positions are flat, in datum order. Positions the loss does not count (as a rule the prompt,
    most of a GRPO datum) already have their logprob, computed without autograd, and entropy 0:
    every loss masks them out, so their gradient is exactly zero and the entropy metric weighs
    them 0.
    """

    logprobs: torch.Tensor  # (N,) float32; the counted positions are filled in by unembed_counted
    entropy: torch.Tensor  # (N,)
    lengths: torch.Tensor  # positions per datum
    counted: torch.Tensor  # (M,) indices into the N positions
    hidden: torch.Tensor  # (M, d) their final hidden states, in the decoder's graph when training
    targets: torch.Tensor  # (M,)


class _TargetLogprobs(torch.autograd.Function):
    """log_softmax(logits)[target] and the entropy of each row, in as few passes over the
    (positions x vocabulary) logits as possible: the largest tensors the trainer touches.

    Autograd's own version (logsumexp, gather, softmax for the entropy) allocates and sweeps a
    logits-sized tensor about ten times between forward and backward; here it is four.
    The entropy is a metric and carries no gradient.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logp = torch.log_softmax(logits, dim=-1)
        probs = logp.exp()
        # Row-wise dot products a block of rows at a time: a cache-sized temporary, where bmm's
        # batched dot ran 5x slower on a CPU (18 vs 3.8 ms for 256 x 49k) and the whole
        # product would be one more logits-sized tensor.
        entropy = torch.empty(logits.shape[0], dtype=logp.dtype, device=logp.device)
        for i in range(0, logits.shape[0], ENTROPY_BLOCK_ROWS):
            block = slice(i, i + ENTROPY_BLOCK_ROWS)
            torch.sum(probs[block] * logp[block], dim=-1, out=entropy[block])
        entropy.neg_()
        ctx.save_for_backward(probs, targets)
        ctx.mark_non_differentiable(entropy)
        return logp.gather(-1, targets[:, None])[:, 0], entropy

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _grad_entropy: torch.Tensor) -> tuple[torch.Tensor, None]:
        probs, targets = ctx.saved_tensors
        # d logp[t] / d logits = onehot(t) - softmax(logits); probs is not needed again.
        grad_logits = probs.mul_(-grad[:, None])
        grad_logits[torch.arange(targets.numel(), device=targets.device), targets] += grad
        return grad_logits, None


def _chunk_logprobs(lm_head, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Target logprobs (differentiable) and entropies (not) of one chunk of positions: through
    the native kernels on a CPU where they are built (native_layers.py), else PyTorch's operators.
    A family's soft-cap on its logits (Gemma 2's) is then the kernel's too, in its pass over them."""
    softcap = getattr(lm_head, "softcap", None)
    if softcap is not None and native_layers.takes_logits(hidden):
        logits = lm_head.uncapped(hidden)
        native = native_layers.target_logprobs(logits, targets, softcap)
        return native if native is not None else _TargetLogprobs.apply(lm_head.cap(logits).float(), targets)
    logits = lm_head(hidden)
    native = native_layers.target_logprobs(logits, targets)
    return native if native is not None else _TargetLogprobs.apply(logits.float(), targets)


@torch.no_grad()
def _chunk_logprobs_only(lm_head, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = lm_head(hidden).float()
    return logits.gather(-1, targets[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)


def _chunks(n: int, lm_head, hidden: torch.Tensor, native_head: bool = False) -> list[slice]:
    """Slices of at most LOGIT_CHUNK_POSITIONS positions, the unembedding's unit of work. On a CPU,
    where PyTorch's operators take the logits (each pass a logits-sized float32 tensor of its own),
    as many as keep a chunk's float32 logits under CPU_LOGIT_CHUNK_BYTES. The native loss head
    (``native_head``: native_layers.target_logprobs) keeps no tensor beside the logits and takes the
    whole unit: at vocabularies of 151,936 and 262,144 tokens (Qwen's, Gemma 3's), 256 positions a
    chunk against the 64 the cap gave took 0.89x and 0.87x the time of a bf16 ``forward_backward``
    (Gemma's bf16 unembedding product alone: ~270 GFLOP/s at 64 rows, ~316 at 256; its input
    gradient ~260 and ~384; SmolLM2's 49,152 the same either way: docs/benchmark.md)."""
    width = LOGIT_CHUNK_POSITIONS
    vocab = getattr(lm_head, "out_features", None)
    if hidden.device.type == "cpu" and vocab and not native_head:
        width = min(width, max(CPU_MIN_CHUNK_POSITIONS, CPU_LOGIT_CHUNK_BYTES // (4 * vocab)))
    return [slice(i, i + width) for i in range(0, n, width)]


@torch.no_grad()
def gradient_free_logprobs(lm_head, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Logprobs of positions no gradient flows through (those no loss reads; prompt logprobs,
    prompt_logprobs.py), a chunk of positions at a time: the native loss head's forward where it
    runs (whole chunks, the logits read as they are), else log_softmax's value by logsumexp."""
    native_head = native_layers.takes_logits(hidden)
    parts = [_chunk_logprobs(lm_head, hidden[sl], targets[sl])[0] if native_head
             else _chunk_logprobs_only(lm_head, hidden[sl], targets[sl])
             for sl in _chunks(hidden.shape[0], lm_head, hidden, native_head)]
    return torch.cat(parts) if parts else hidden.new_empty(0, dtype=torch.float32)


def _split_counted(lm_head, flat_hidden: torch.Tensor, flat_targets: torch.Tensor, counted_mask: torch.Tensor,
                   where: torch.Tensor, n: int, lengths: torch.Tensor) -> DecoderOutput:
    """Fill the uncounted positions' logprobs; leave the counted ones' hidden states for the head.
    ``where`` gives each row of ``flat_hidden`` its index among the batch's ``n`` positions."""
    logprobs = torch.zeros(n, dtype=torch.float32, device=flat_hidden.device)
    uncounted = (~counted_mask).nonzero()[:, 0]
    logprobs[where[uncounted]] = gradient_free_logprobs(lm_head, flat_hidden[uncounted].detach(), flat_targets[uncounted])
    counted = counted_mask.nonzero()[:, 0]
    return DecoderOutput(logprobs=logprobs, entropy=torch.zeros_like(logprobs), lengths=lengths,
                        counted=where[counted], hidden=flat_hidden[counted], targets=flat_targets[counted])


def _counted_positions(counted_mask: torch.Tensor | None, n: int, grad: bool, device: torch.device) -> torch.Tensor:
    """The flat bool mask of the positions the loss counts (None: all ``n``)."""
    counted = torch.ones(n, dtype=torch.bool, device=device) if counted_mask is None else counted_mask.to(device)
    if grad and not bool(counted.any()):
        # Nothing counts, yet the loss must still reach the parameters (as zeros) so that
        # optim_step sees the same gradients as always.
        counted = torch.ones_like(counted)
    return counted


def run_decoder(model, batch: list[PreparedDatum], device: torch.device, counted_mask: torch.Tensor | None,
                 grad: bool) -> DecoderOutput:
    """Run a micro-batch of datums through the decoder, each in full (right padded).

    ``counted_mask`` (flat, bool) marks the positions the loss counts; None: all of them.
    """
    width = max(len(d.input_ids) for d in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long, device=device)
    mask = torch.zeros((len(batch), width), dtype=torch.long, device=device)
    targets = torch.zeros((len(batch), width), dtype=torch.long, device=device)
    for i, d in enumerate(batch):
        n = len(d.input_ids)
        ids[i, :n] = torch.tensor(d.input_ids, device=device)
        targets[i, :n] = torch.tensor(d.targets, device=device)
        mask[i, :n] = 1
    hidden = model.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    valid = mask.bool()
    flat_hidden = hidden[valid]
    n = flat_hidden.shape[0]
    return _split_counted(logit_head(model), flat_hidden, targets[valid],
                          _counted_positions(counted_mask, n, grad, device), torch.arange(n, device=device), n,
                          mask.sum(-1))


def run_decoder_packed(model, batch: list[PreparedDatum], device: torch.device, counted_mask: torch.Tensor | None,
                       grad: bool) -> DecoderOutput:
    """``run_decoder`` on the datums packed in one row: no position is padding."""
    lengths = [len(d.input_ids) for d in batch]
    ids = torch.tensor([t for d in batch for t in d.input_ids], dtype=torch.long, device=device)
    flat_targets = torch.tensor([t for d in batch for t in d.targets], dtype=torch.long, device=device)
    flat_hidden = packed_attention.PackedPass(lengths, device).run(model.get_decoder(), ids)
    n = flat_hidden.shape[0]
    return _split_counted(logit_head(model), flat_hidden, flat_targets,
                          _counted_positions(counted_mask, n, grad, device), torch.arange(n, device=device), n,
                          torch.tensor(lengths))


def unembed_counted(lm_head, dec_out: DecoderOutput, chunk_loss=None) -> float | None:
    """Logprobs and entropies of the counted positions, a chunk of positions at a time.

    With ``chunk_loss(logprobs, positions)`` (training) each chunk's loss is backpropagated
    through the unembedding at once, its hidden-state gradient kept, and one backward through the
    decoder follows; returns the summed loss. Every loss is a sum over positions of a function of
    that position alone (losses.py), so the chunks' losses add up to the batch's loss and their
    gradients to its gradient. Only one chunk of logits exists at a time, and none is recomputed
    in backward, as activation checkpointing of the unembedding would.
    """
    native_head = native_layers.takes_logits(dec_out.hidden)  # (the logits take the hidden states' dtype)
    if chunk_loss is None:
        with torch.no_grad():
            for sl in _chunks(dec_out.counted.numel(), lm_head, dec_out.hidden, native_head):
                lp, ent = _chunk_logprobs(lm_head, dec_out.hidden[sl], dec_out.targets[sl])
                dec_out.logprobs[dec_out.counted[sl]] = lp
                dec_out.entropy[dec_out.counted[sl]] = ent
        return None
    grad_hidden = torch.zeros_like(dec_out.hidden)
    total = 0.0
    for sl in _chunks(dec_out.counted.numel(), lm_head, dec_out.hidden, native_head):
        h = dec_out.hidden[sl].detach().requires_grad_(True)
        lp, ent = _chunk_logprobs(lm_head, h, dec_out.targets[sl])
        loss = chunk_loss(lp, dec_out.counted[sl])
        loss.backward()
        grad_hidden[sl] = h.grad
        dec_out.logprobs[dec_out.counted[sl]] = lp.detach()
        dec_out.entropy[dec_out.counted[sl]] = ent
        total += float(loss.detach())
    if dec_out.hidden.requires_grad:  # False when only lm_head is adapted
        with section("grpo.train.decoder_backward"):
            dec_out.hidden.backward(grad_hidden)
    return total


# --------------------------------------------------------------------------- prefix sharing


@dataclass
class SharedGroup:
    """Datums whose first ``len(prefix)`` positions are these tokens and none of them counts."""

    prefix: list[int]
    members: list[PreparedDatum]

    def suffix_width(self) -> int:
        return max(len(d.input_ids) for d in self.members) - len(self.prefix)


def _first_counted(d: PreparedDatum) -> int | None:
    """The first position the loss counts, or None where the datum cannot share a prefix."""
    n = len(d.input_ids)
    if ("weights" not in d.inputs and "advantages" not in d.inputs) or len(d.targets) != n:
        return None
    if any(v.numel() != n for v in d.inputs.values()):
        return None  # malformed: the unshared path raises its usual error
    counted = losses.token_mask(d.inputs).nonzero()
    return int(counted[0, 0]) if counted.numel() else None


def plan_sharing(data: list[PreparedDatum], min_prefix: int = MIN_SHARED_PREFIX,
                 ) -> tuple[list[SharedGroup], list[PreparedDatum]]:
    """Split ``data`` into groups that share an uncounted prefix and the datums that go alone.

    A datum's shareable prefix is everything before its first counted position: only there is
    its hidden state needed without gradient of its own, and only there do group members agree.
    """
    by_prefix: dict[tuple[int, ...], list[PreparedDatum]] = {}
    alone: list[PreparedDatum] = []
    for d in data:
        p = _first_counted(d)
        if p is None or p < min_prefix:
            alone.append(d)
        else:
            by_prefix.setdefault(tuple(d.input_ids[:p]), []).append(d)
    groups: list[SharedGroup] = []
    for prefix, members in by_prefix.items():
        if len(members) >= 2:
            groups.append(SharedGroup(list(prefix), members))
        else:
            alone.extend(members)
    alone.sort(key=lambda d: d.index)  # the unshared path sees the caller's order, as before
    return groups, alone


def _shared_cost(units: list[SharedGroup], packed: bool = False) -> int:
    """Tokens of a shared micro-batch: each prefix once, each suffix once per datum; padded to
    the batch's longest prefix and suffix unless ``packed``."""
    if packed:
        return sum(len(u.prefix) + sum(len(d.input_ids) - len(u.prefix) for d in u.members) for u in units)
    rows = sum(len(u.members) for u in units)
    return (len(units) * max(len(u.prefix) for u in units)
            + rows * max(u.suffix_width() for u in units))


def shared_micro_batches(groups: list[SharedGroup], max_tokens: int | None,
                         packed: bool = False) -> list[list[SharedGroup]]:
    """Micro-batches of group members, each batch running the prefixes of its members once.

    Members are ordered by the length of their own part (the suffix after the prefix), so that
    long and short responses are not padded to each other; a group whose members land in
    several batches pays its prefix pass in each (still exact). The other order -- group by
    group -- is kept when it costs fewer tokens (few groups, similar lengths; as a rule, packed).
    """
    members = [(g.prefix, d) for g in groups for d in g.members]

    def cut(order: list) -> list[list]:
        return partition(order, lambda m: id(m[0]), lambda m: len(m[0]), lambda m: len(m[1].input_ids) - len(m[0]),
                         max_tokens, packed)

    def as_units(batches: list[list]) -> list[list[SharedGroup]]:
        out = []
        for batch in batches:
            units: dict[int, SharedGroup] = {}
            for prefix, d in batch:
                units.setdefault(id(prefix), SharedGroup(prefix, [])).members.append(d)
            out.append(list(units.values()))
        return out

    def cost(batches: list[list[SharedGroup]]) -> int:
        return sum(_shared_cost(b, packed) + MICRO_BATCH_OVERHEAD_TOKENS for b in batches)

    by_suffix = as_units(cut(sorted(members, key=lambda m: len(m[1].input_ids) - len(m[0]))))
    group_of = {id(g.prefix): k for k, g in enumerate(groups)}
    by_group = as_units(cut(sorted(members, key=lambda m: (group_of[id(m[0])], len(m[1].input_ids)))))
    return by_suffix if cost(by_suffix) <= cost(by_group) else by_group


def _fan_out(cache: DynamicCache, counts: list[int], owner: torch.Tensor) -> None:
    """Repeat each unit's cached K/V (and a hybrid's linear layers' states) once per member (a
    unit's members are contiguous), so that autograd sums the members' gradients back into the one
    prefix pass.

    Done with expand + cat, not by indexing with ``owner``: indexing with repeated indices has a
    scatter-add for its gradient, whose float sums on a multi-threaded CPU depend on thread timing,
    so two runs of one seed parted in the last bits (issue #16). expand's gradient is a plain sum.
    """
    layers = getattr(cache, "layers", None)
    if layers is None:  # a Cache without per-layer tensors (older transformers): index as before
        cache.batch_select_indices(owner)
        return

    def repeat(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[k:k + 1].expand(n, *t.shape[1:]) for k, n in enumerate(counts)], dim=0)

    for layer in layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys, layer.values = repeat(layer.keys), repeat(layer.values)
        for states in (getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)):
            # (a hybrid's linear layers: their states by index, each a tensor of one row a unit)
            for i, state in list(states.items() if isinstance(states, dict) else enumerate(states or [])):
                if isinstance(state, torch.Tensor) and state.numel():
                    states[i] = repeat(state)
        if getattr(layer, "recurrent_states", None) is not None:
            layer.update_recurrent_state = types.MethodType(_replace_recurrent_state, layer)
        if getattr(layer, "conv_states", None) is not None and not getattr(layer, "record_past", False):
            layer.update_conv_state = types.MethodType(_channels_last_conv_window, layer)


def _replace_recurrent_state(layer, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
    """A linear-attention cache layer's ``update_recurrent_state`` for the suffix pass: the new
    state replaces the fanned-out one instead of being copied into it, which autograd keeps for
    the backward of the suffix's recurrence (an in-place copy would fail it)."""
    layer.recurrent_states[state_idx] = recurrent_states
    return recurrent_states


def _channels_last_conv_window(layer, conv_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
    """A linear-attention cache layer's ``update_conv_state`` for the suffix pass: the fanned-out
    window of the prefix's last inputs before the suffix's (as the layer's own), as a rows x channels
    x positions view of channels-last memory -- the layout of the suffix's own inputs (a view of its
    projection), which the short convolution's kernel reads in place (delta_rule.py): the layer's
    own concatenation was channels-first, a copy to make and another to undo. The window is not
    written back: nothing reads the suffix pass's cache after it."""
    window = layer.conv_states[state_idx]
    if not layer.has_previous_state[state_idx]:  # (a first pass: the layer's own padding)
        return type(layer).update_conv_state(layer, conv_states, state_idx, **kwargs)
    return torch.cat([window.transpose(1, 2), conv_states.transpose(1, 2)], dim=1).transpose(1, 2)


@torch.no_grad()
def _fill_prefix_logprobs(lm_head, dec_out: DecoderOutput, units: list[SharedGroup], hidden: torch.Tensor,
                          unit_rows: Sequence[Sequence[int]]) -> None:
    """Each member's logprobs over its unit's prefix, written where the member's positions start
    in ``dec_out``. ``hidden``: the prefix passes' hidden states, each row once (a trunk the
    units share is one set of rows); ``unit_rows[k]``: the rows of unit k's prefix, in order.

    The unembedding runs once per row, in chunks of every unit's rows together (not one small
    product per unit); each member then reads its own targets from its unit's rows: members of
    a unit differ at least at its last prefix position, units at the trunk's last."""
    device = hidden.device
    starts = (torch.cumsum(dec_out.lengths, 0) - dec_out.lengths).tolist()
    rows, targets, out = [], [], []
    i = 0
    for u, own_rows in zip(units, unit_rows, strict=True):
        p = len(u.prefix)
        for d in u.members:
            rows += own_rows
            targets += d.targets[:p]
            out += range(starts[i], starts[i] + p)
            i += 1
    rows_t = torch.tensor(rows, dtype=torch.long, device=device)
    targets_t = torch.tensor(targets, dtype=torch.long, device=device)
    out_t = torch.tensor(out, dtype=torch.long, device=device)
    hidden = hidden.detach()
    native_head = native_layers.takes_logits(hidden)
    for sl in _chunks(hidden.shape[0], lm_head, hidden, native_head):
        logits = lm_head(hidden[sl])
        here = ((rows_t >= sl.start) & (rows_t < sl.start + logits.shape[0])).nonzero()[:, 0]
        local = rows_t[here] - sl.start
        picked = logits[local, targets_t[here]].float()
        if native_head:  # each row's normaliser in one pass over its logits as they are, no float32 copy
            top, log_total = native_layers.logit_stats(logits.contiguous())  # (a logit head's output may be a view)
            dec_out.logprobs[out_t[here]] = (picked - top[local]) - log_total[local]
        else:
            dec_out.logprobs[out_t[here]] = picked - torch.logsumexp(logits.float(), dim=-1)[local]


def run_decoder_shared(model, units: list[SharedGroup], device: torch.device) -> DecoderOutput:
    """``run_decoder`` for the members of ``units`` (in unit, then member order), with each
    unit's prefix run once and its KV cache fanned out to the unit's suffixes.

    Prefix positions are uncounted by construction, so their logprobs need no gradient; the
    suffix passes attend to the fanned-out K/V, whose gradient autograd sums back over the group
    into the one prefix pass.
    """
    decoder = model.get_decoder()
    lm_head = logit_head(model)
    members = [d for u in units for d in u.members]
    owner = torch.tensor([k for k, u in enumerate(units) for _ in u.members], device=device)
    plens = torch.tensor([len(u.prefix) for u in units], device=device)

    # ---- prefixes, batch = number of units: right padded, or left padded where the decoder keeps
    # a recurrent state (a hybrid's linear layers zero the padding's inputs, but their state would
    # decay over padding after the prefix; before it, it is still zero)
    recurrent = not attention_only(model.config)
    width = int(plens.max())
    ids = torch.zeros((len(units), width), dtype=torch.long, device=device)
    pmask = torch.zeros((len(units), width), dtype=torch.long, device=device)
    for k, u in enumerate(units):
        columns = slice(width - len(u.prefix), width) if recurrent else slice(0, len(u.prefix))
        ids[k, columns] = torch.tensor(u.prefix, device=device)
        pmask[k, columns] = 1
    cache = DynamicCache(config=model.config)
    prefix_positions = position_ids(pmask) if recurrent else None
    prefix_hidden = decoder(input_ids=ids, attention_mask=pmask, position_ids=prefix_positions, cache=cache,
                            use_cache=True).last_hidden_state
    _fan_out(cache, [len(u.members) for u in units], owner)

    # ---- suffixes, right padded, batch = number of members
    swidth = max(len(d.input_ids) - len(u.prefix) for u in units for d in u.members)
    sids = torch.zeros((len(members), swidth), dtype=torch.long, device=device)
    smask = torch.zeros((len(members), swidth), dtype=torch.long, device=device)
    stargets = torch.zeros((len(members), swidth), dtype=torch.long, device=device)
    scounted = torch.zeros((len(members), swidth), dtype=torch.bool, device=device)
    where = torch.zeros((len(members), swidth), dtype=torch.long, device=device)  # index among all positions
    offset = 0
    for i, d in enumerate(members):
        p = len(units[int(owner[i])].prefix)
        s = len(d.input_ids) - p
        sids[i, :s] = torch.tensor(d.input_ids[p:], device=device)
        stargets[i, :s] = torch.tensor(d.targets[p:], device=device)
        smask[i, :s] = 1
        scounted[i, :s] = losses.token_mask({k: v[p:] for k, v in d.inputs.items()}).to(device)
        where[i, :s] = torch.arange(offset + p, offset + p + s, device=device)
        offset += len(d.input_ids)
    positions = plens[owner][:, None] + torch.arange(swidth, device=device)[None, :]
    hidden = decoder(input_ids=sids, attention_mask=torch.cat([pmask[owner], smask], dim=1),
                     position_ids=positions, cache=cache, use_cache=True).last_hidden_state
    valid = smask.bool()
    lengths = torch.tensor([len(d.input_ids) for d in members])
    dec_out = _split_counted(lm_head, hidden[valid], stargets[valid], scounted[valid], where[valid], offset, lengths)

    starts = [0, *accumulate(len(u.prefix) for u in units)]
    _fill_prefix_logprobs(lm_head, dec_out, units, prefix_hidden[pmask.bool()],
                          [range(a, b) for a, b in pairwise(starts)])
    return dec_out


def run_decoder_shared_packed(model, units: list[SharedGroup], device: torch.device) -> DecoderOutput:
    """``run_decoder_shared`` as one packed decoder call: each unit's prefix once, then its
    members' suffixes, each suffix attending to its unit's prefix (``PackedPass``'s ``continues``).

    Where the units' prefixes begin alike (``common_trunk``: GRPO prompts under one chat
    template's system prompt or one few-shot preamble), that trunk is a sequence of its own that
    each prefix continues: its forward and backward are paid once per micro-batch instead of
    once per group. One call instead of a pass per level (trunk, prefixes, suffixes): a pass
    costs ~0.17 s of fixed forward + backward on SmolLM2 whatever its rows (docs/benchmark.md)."""
    decoder = model.get_decoder()
    lm_head = logit_head(model)
    members = [d for u in units for d in u.members]
    owner = [k for k, u in enumerate(units) for _ in u.members]
    trunk = common_trunk([u.prefix for u in units])
    plens = [len(units[k].prefix) for k in owner]
    suffix_lengths = [len(d.input_ids) - p for d, p in zip(members, plens, strict=True)]
    # the sequences of the pass: [the trunk,] each unit's prefix (after the trunk), each suffix
    heads = 1 if trunk else 0
    lengths = [trunk] * heads + [len(u.prefix) - trunk for u in units] + suffix_lengths
    continues = [None] * heads + [0 if trunk else None] * len(units) + [heads + k for k in owner]
    whole = packed_attention.PackedPass(lengths, device, continues=continues)
    ids = torch.tensor(units[0].prefix[:trunk] + [t for u in units for t in u.prefix[trunk:]]
                       + [t for d, p in zip(members, plens, strict=True) for t in d.input_ids[p:]],
                       dtype=torch.long, device=device)
    targets = torch.tensor([t for d, p in zip(members, plens, strict=True) for t in d.targets[p:]],
                           dtype=torch.long, device=device)
    counted = torch.cat([losses.token_mask({k: v[p:] for k, v in d.inputs.items()})
                         for d, p in zip(members, plens, strict=True)]).to(device)
    lengths_t = torch.tensor([len(d.input_ids) for d in members])
    starts = torch.cumsum(lengths_t, 0) - lengths_t
    where = torch.cat([torch.arange(int(s) + p, int(s) + p + m) for s, p, m in zip(starts, plens, suffix_lengths,
                                                                                    strict=True)]).to(device)
    hidden = whole.run(decoder, ids)
    prefix_rows = trunk + sum(len(u.prefix) - trunk for u in units)  # the trunk's and prefixes' rows come first
    dec_out = _split_counted(lm_head, hidden[prefix_rows:], targets, counted, where, int(lengths_t.sum()), lengths_t)
    # each unit's prefix is its key rows in the pass: the trunk's rows (if any), then its own
    _fill_prefix_logprobs(lm_head, dec_out, units, hidden[:prefix_rows], whole.key_rows[heads:heads + len(units)])
    return dec_out


def run(model, data: list[PreparedDatum], loss_fn: str, loss_fn_config: Mapping[str, float] | None,
        device: torch.device, max_tokens: int | None, backward: bool,
        share_prefixes: bool = True, packed: bool | None = None) -> ForwardBackwardOutput:
    """Compute (and optionally backpropagate) the summed loss over ``data``.

    ``share_prefixes=False`` runs every datum in full (the reference the shared path must equal).
    ``packed`` (default: wherever packed_attention supports the model) runs micro-batches as
    packed sequences; ``packed=False`` pads them (the reference the packed path must equal).
    """
    params = losses.resolve_config(loss_fn, loss_fn_config)
    if packed is None:
        packed = packed_attention.supports(model)
    groups, alone = plan_sharing(data) if share_prefixes else ([], list(data))
    work: list[tuple[list[PreparedDatum], list[SharedGroup] | None]] = [
        (batch, None) for batch in micro_batches(alone, max_tokens, packed)]
    work += [([d for u in units for d in u.members], units)
             for units in shared_micro_batches(groups, max_tokens, packed)]
    decode_shared = run_decoder_shared_packed if packed else run_decoder_shared
    decode = run_decoder_packed if packed else run_decoder
    outputs: list[dict[str, TensorData] | None] = [None] * len(data)
    lm_head = logit_head(model)
    total_loss = 0.0
    entropy_sum = 0.0
    entropy_weight = 0.0
    for batch, units in work:
        inputs = {key: torch.cat([d.inputs[key] for d in batch]).to(device) for key in batch[0].inputs}
        with torch.set_grad_enabled(backward), section("grpo.train.decoder_forward"):
            if units is not None:
                dec_out = decode_shared(model, units, device)
            else:
                counted = losses.token_mask(inputs) if ("weights" in inputs or "advantages" in inputs) else None
                dec_out = decode(model, batch, device, counted, grad=backward)
        if backward:
            def chunk_loss(lp: torch.Tensor, positions: torch.Tensor, inputs=inputs) -> torch.Tensor:
                return losses.LOSSES[loss_fn](lp, {k: v[positions] for k, v in inputs.items()}, params)

            with section("grpo.train.unembed_loss_backward"):
                total_loss += unembed_counted(lm_head, dec_out, chunk_loss)
        else:
            unembed_counted(lm_head, dec_out)
            total_loss += float(losses.LOSSES[loss_fn](dec_out.logprobs, inputs, params))
        w = losses.token_weights(inputs) if ("weights" in inputs or "advantages" in inputs) else torch.ones_like(dec_out.entropy)
        entropy_sum += float((dec_out.entropy * w).sum())
        entropy_weight += float(w.sum())
        for d, chunk in zip(batch, torch.split(dec_out.logprobs.cpu(), dec_out.lengths.tolist()), strict=True):
            outputs[d.index] = {"logprobs": TensorData.from_torch(chunk)}
    metrics = {"loss:sum": total_loss}
    if entropy_weight > 0:
        metrics["entropy:mean"] = entropy_sum / entropy_weight
    return ForwardBackwardOutput(loss_fn_output_type="target_logprobs", loss_fn_outputs=outputs, metrics=metrics)
