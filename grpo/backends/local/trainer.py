"""forward / forward_backward on a list of Datums: validation, micro-batches, chunked logprobs.

Memory does not scale with batch x vocab: datums are packed into micro-batches under a token
budget, and target logprobs come from the unembedding applied to a few hundred positions at a
time under activation checkpointing, so only one chunk of logits ever exists.

Prefix sharing: datums whose leading positions the loss does not count are the same tokens (a
GRPO group: one prompt, several responses) run that prefix through the decoder once; its KV cache
is fanned out to the group, so the prompt's forward and backward are paid once per group instead
of once per datum. Autograd carries the group's gradient back through the fan-out into the one
prefix pass, so results equal the unshared path up to float summation order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache

from grpo import losses
from grpo.types import Datum, ForwardBackwardOutput, TensorData

LOGIT_CHUNK_POSITIONS = 256
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
    losses.check_loss_fn(loss_fn)
    if not isinstance(data, (list, tuple)) or not data:
        raise ValueError("forward_backward needs a non-empty list of Datum")
    required = ("target_tokens", *losses.REQUIRED_INPUTS[loss_fn])
    prepared: list[PreparedDatum] = []
    for i, datum in enumerate(data):
        if not isinstance(datum, Datum):
            raise TypeError(f"data[{i}] is a {type(datum).__name__}, expected grpo.types.Datum")
        tokens = datum.model_input.to_ints()
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


def pack(items: list, cost, max_tokens: int) -> list[list]:
    """Greedy packing in order: a batch grows until ``cost(batch)`` would pass the budget (an item
    too big for any batch still gets one of its own)."""
    batches: list[list] = []
    current: list = []
    for item in items:
        if current and cost([*current, item]) > max_tokens:
            batches.append(current)
            current = []
        current.append(item)
    if current:
        batches.append(current)
    return batches


def micro_batches(data: list[PreparedDatum], max_tokens: int) -> list[list[PreparedDatum]]:
    """Group datums of similar length so padding stays small and each batch fits the budget."""
    ordered = sorted(data, key=lambda d: len(d.input_ids))
    # padded tokens: the last datum is the longest, since sorted
    return pack(ordered, lambda batch: len(batch[-1].input_ids) * len(batch), max_tokens)


def _chunk_logprobs(lm_head, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = lm_head(hidden).float()
    logz = torch.logsumexp(logits, dim=-1)
    target_logits = logits.gather(-1, targets[:, None])[:, 0]
    probs = torch.softmax(logits, dim=-1)
    entropy = logz - (probs * logits).sum(-1)
    return target_logits - logz, entropy


@torch.no_grad()
def _chunk_logprobs_only(lm_head, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = lm_head(hidden).float()
    return logits.gather(-1, targets[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)


def _position_logprobs(lm_head, flat_hidden: torch.Tensor, flat_targets: torch.Tensor,
                       active: torch.Tensor, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs (with autograd at ``active`` positions when ``grad``) and entropies (0 elsewhere)."""
    n = flat_hidden.shape[0]
    device = flat_hidden.device
    lp_all = torch.empty(n, dtype=torch.float32, device=device)
    ent_all = torch.zeros(n, dtype=torch.float32, device=device)
    passive_idx = (~active).nonzero()[:, 0]
    for start in range(0, passive_idx.numel(), LOGIT_CHUNK_POSITIONS):
        idx = passive_idx[start:start + LOGIT_CHUNK_POSITIONS]
        lp_all[idx] = _chunk_logprobs_only(lm_head, flat_hidden[idx].detach(), flat_targets[idx])
    active_idx = active.nonzero()[:, 0]
    lps = []
    for start in range(0, active_idx.numel(), LOGIT_CHUNK_POSITIONS):
        idx = active_idx[start:start + LOGIT_CHUNK_POSITIONS]
        h, t = flat_hidden[idx], flat_targets[idx]
        if grad:
            # Recompute this chunk's logits in backward instead of keeping them alive.
            lp, ent = checkpoint(_chunk_logprobs, lm_head, h, t, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(lm_head, h, t)
        lps.append(lp)
        ent_all[idx] = ent.detach()
    if lps:
        # Out of place, so the active logprobs keep their graph inside the full-length tensor.
        lp_all = lp_all.index_put((active_idx,), torch.cat(lps))
    return lp_all, ent_all


def target_logprobs(model, batch: list[PreparedDatum], device: torch.device, grad: bool,
                    active: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs and entropies at every valid position of a micro-batch, flattened in datum order.

    ``active`` (flat, bool) marks the positions the loss counts. The others (prompt tokens, as a
    rule most of a GRPO datum) get their logprob without autograd and no entropy (0): every loss
    masks them out, so their gradient is exactly zero anyway and the entropy metric weighs them 0.
    Returns (logprobs, entropy, lengths).
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
    flat_targets = targets[valid]
    n = flat_hidden.shape[0]
    if active is None:
        active = torch.ones(n, dtype=torch.bool, device=device)
    active = active.to(device)
    if grad and not bool(active.any()):
        # Nothing counts, yet the loss must still reach the parameters (as zeros) so that
        # optim_step sees the same gradients as always.
        active = torch.ones_like(active)
    lp_all, ent_all = _position_logprobs(model.get_output_embeddings(), flat_hidden, flat_targets,
                                         active, grad)
    lengths = mask.sum(-1)
    return lp_all, ent_all, lengths


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


def _shared_cost(units: list[SharedGroup]) -> int:
    """Padded tokens of a shared micro-batch: each prefix once, each suffix once per datum."""
    rows = sum(len(u.members) for u in units)
    return (len(units) * max(len(u.prefix) for u in units)
            + rows * max(u.suffix_width() for u in units))


def shared_micro_batches(groups: list[SharedGroup], max_tokens: int) -> list[list[SharedGroup]]:
    """Pack groups under the token budget, splitting a group too big for it (each part then
    pays for its own prefix pass, which is still exact)."""
    units: list[SharedGroup] = []
    for g in groups:
        members = sorted(g.members, key=lambda d: len(d.input_ids))
        parts = pack(members, lambda part, prefix=g.prefix: _shared_cost([SharedGroup(prefix, part)]), max_tokens)
        units.extend(SharedGroup(g.prefix, part) for part in parts)
    # Similar prefix and suffix lengths together, so padding stays small.
    units.sort(key=lambda u: (len(u.prefix), u.suffix_width()))
    return pack(units, _shared_cost, max_tokens)


@torch.no_grad()
def _prefix_logprobs(lm_head, hidden: torch.Tensor, targets: list[list[int]]) -> list[torch.Tensor]:
    """Logprobs of each member's own targets over one shared prefix's hidden states: the logits
    are computed once; the targets differ at least at the last prefix position."""
    device = hidden.device
    target_ids = torch.tensor(targets, dtype=torch.long, device=device)  # (members, p)
    pieces = []
    for start in range(0, hidden.shape[0], LOGIT_CHUNK_POSITIONS):
        logits = lm_head(hidden[start:start + LOGIT_CHUNK_POSITIONS]).float()
        logz = torch.logsumexp(logits, dim=-1)
        t = target_ids[:, start:start + LOGIT_CHUNK_POSITIONS]
        pieces.append(logits.gather(-1, t.T).T - logz)
    return list(torch.cat(pieces, dim=1).unbind(0))


def shared_target_logprobs(model, units: list[SharedGroup], device: torch.device, grad: bool,
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As ``target_logprobs`` for the members of ``units`` (in unit, then member order), with each
    unit's prefix run once and its KV cache fanned out to the unit's suffixes.

    Prefix positions are uncounted by construction, so their logprobs need no gradient; the
    suffix passes attend to the fanned-out K/V, whose gradient autograd sums back over the group
    into the one prefix pass.
    """
    decoder = model.get_decoder()
    lm_head = model.get_output_embeddings()
    members = [d for u in units for d in u.members]
    owner = torch.tensor([k for k, u in enumerate(units) for _ in u.members], device=device)
    plens = torch.tensor([len(u.prefix) for u in units], device=device)

    # ---- prefixes, right padded, batch = number of units
    width = int(plens.max())
    ids = torch.zeros((len(units), width), dtype=torch.long, device=device)
    pmask = torch.zeros((len(units), width), dtype=torch.long, device=device)
    for k, u in enumerate(units):
        ids[k, :len(u.prefix)] = torch.tensor(u.prefix, device=device)
        pmask[k, :len(u.prefix)] = 1
    cache = DynamicCache(config=model.config)
    prefix_hidden = decoder(input_ids=ids, attention_mask=pmask, past_key_values=cache,
                            use_cache=True).last_hidden_state
    cache.batch_select_indices(owner)  # indexing, so autograd sums the fan-out's gradient back

    # ---- suffixes, right padded, batch = number of members
    swidth = max(len(d.input_ids) - len(u.prefix) for u in units for d in u.members)
    sids = torch.zeros((len(members), swidth), dtype=torch.long, device=device)
    smask = torch.zeros((len(members), swidth), dtype=torch.long, device=device)
    stargets = torch.zeros((len(members), swidth), dtype=torch.long, device=device)
    active_rows = torch.zeros((len(members), swidth), dtype=torch.bool, device=device)
    for i, d in enumerate(members):
        p = len(units[int(owner[i])].prefix)
        s = len(d.input_ids) - p
        sids[i, :s] = torch.tensor(d.input_ids[p:], device=device)
        stargets[i, :s] = torch.tensor(d.targets[p:], device=device)
        smask[i, :s] = 1
        active_rows[i, :s] = losses.token_mask({k: v[p:] for k, v in d.inputs.items()}).to(device)
    positions = plens[owner][:, None] + torch.arange(swidth, device=device)[None, :]
    hidden = decoder(input_ids=sids, attention_mask=torch.cat([pmask[owner], smask], dim=1),
                     position_ids=positions, past_key_values=cache, use_cache=True).last_hidden_state
    valid = smask.bool()
    suffix_lp, suffix_ent = _position_logprobs(lm_head, hidden[valid], stargets[valid],
                                               active_rows[valid], grad)

    # ---- per datum: prefix logprobs (no grad, entropy 0) then its suffix
    prefix_lps: list[torch.Tensor] = []
    for k, u in enumerate(units):
        p = len(u.prefix)
        prefix_lps += _prefix_logprobs(lm_head, prefix_hidden[k, :p].detach(),
                                       [d.targets[:p] for d in u.members])
    suffix_lens = smask.sum(-1).tolist()
    lp_parts, ent_parts = [], []
    for plp, slp, sent in zip(prefix_lps, torch.split(suffix_lp, suffix_lens),
                              torch.split(suffix_ent, suffix_lens), strict=True):
        lp_parts += [plp, slp]
        ent_parts += [torch.zeros_like(plp), sent]
    lengths = torch.tensor([len(d.input_ids) for d in members])
    return torch.cat(lp_parts), torch.cat(ent_parts), lengths


def run(model, data: list[PreparedDatum], loss_fn: str, loss_fn_config: Mapping[str, float] | None,
        device: torch.device, max_tokens: int, backward: bool,
        share_prefixes: bool = True) -> ForwardBackwardOutput:
    """Compute (and optionally backpropagate) the summed loss over ``data``.

    ``share_prefixes=False`` runs every datum in full (the reference the shared path must equal).
    """
    cfg = losses.resolve_config(loss_fn, loss_fn_config)
    groups, alone = plan_sharing(data) if share_prefixes else ([], list(data))
    work: list[tuple[list[PreparedDatum], list[SharedGroup] | None]] = [
        (batch, None) for batch in micro_batches(alone, max_tokens)]
    work += [([d for u in units for d in u.members], units)
             for units in shared_micro_batches(groups, max_tokens)]
    outputs: list[dict[str, TensorData] | None] = [None] * len(data)
    total_loss = 0.0
    entropy_sum = 0.0
    entropy_weight = 0.0
    for batch, units in work:
        with torch.set_grad_enabled(backward):
            inputs = {key: torch.cat([d.inputs[key] for d in batch]).to(device) for key in batch[0].inputs}
            if units is not None:
                lp, ent, lengths = shared_target_logprobs(model, units, device, grad=backward)
            else:
                # Positions every loss masks out need no gradient (see target_logprobs).
                active = losses.token_mask(inputs) if ("weights" in inputs or "advantages" in inputs) else None
                lp, ent, lengths = target_logprobs(model, batch, device, grad=backward, active=active)
            loss = losses.LOSSES[loss_fn](lp, inputs, cfg)
            if backward:
                loss.backward()
        total_loss += float(loss.detach())
        w = losses.token_weights(inputs) if ("weights" in inputs or "advantages" in inputs) else torch.ones_like(ent)
        entropy_sum += float((ent * w).sum())
        entropy_weight += float(w.sum())
        for d, chunk in zip(batch, torch.split(lp.detach().float().cpu(), lengths.tolist()), strict=True):
            outputs[d.index] = {"logprobs": TensorData.from_torch(chunk)}
    metrics = {"loss:sum": total_loss}
    if entropy_weight > 0:
        metrics["entropy:mean"] = entropy_sum / entropy_weight
    return ForwardBackwardOutput(loss_fn_output_type="target_logprobs", loss_fn_outputs=outputs, metrics=metrics)
