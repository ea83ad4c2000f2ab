"""forward / forward_backward on a list of Datums: validation, micro-batches, chunked logprobs.

Memory does not scale with batch x vocab: datums are packed into micro-batches under a token
budget, and target logprobs come from the unembedding applied to a few hundred positions at a
time under activation checkpointing, so only one chunk of logits ever exists.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from grpo import losses
from grpo.types import Datum, ForwardBackwardOutput, TensorData

LOGIT_CHUNK_POSITIONS = 256


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


def micro_batches(data: list[PreparedDatum], max_tokens: int) -> list[list[PreparedDatum]]:
    """Group datums of similar length so padding stays small and each batch fits the budget."""
    ordered = sorted(data, key=lambda d: len(d.input_ids))
    batches: list[list[PreparedDatum]] = []
    current: list[PreparedDatum] = []
    for d in ordered:
        width = len(d.input_ids)  # the longest so far, since sorted
        if current and width * (len(current) + 1) > max_tokens:
            batches.append(current)
            current = []
        current.append(d)
    if current:
        batches.append(current)
    return batches


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
    lm_head = model.get_output_embeddings()
    n = flat_hidden.shape[0]
    if active is None:
        active = torch.ones(n, dtype=torch.bool, device=device)
    active = active.to(device)
    if grad and not bool(active.any()):
        # Nothing counts, yet the loss must still reach the parameters (as zeros) so that
        # optim_step sees the same gradients as always.
        active = torch.ones_like(active)
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
    lengths = mask.sum(-1)
    return lp_all, ent_all, lengths


def run(model, data: list[PreparedDatum], loss_fn: str, loss_fn_config: Mapping[str, float] | None,
        device: torch.device, max_tokens: int, backward: bool) -> ForwardBackwardOutput:
    """Compute (and optionally backpropagate) the summed loss over ``data``."""
    cfg = losses.resolve_config(loss_fn, loss_fn_config)
    outputs: list[dict[str, TensorData] | None] = [None] * len(data)
    total_loss = 0.0
    entropy_sum = 0.0
    entropy_weight = 0.0
    for batch in micro_batches(data, max_tokens):
        with torch.set_grad_enabled(backward):
            inputs = {key: torch.cat([d.inputs[key] for d in batch]).to(device) for key in batch[0].inputs}
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
