"""Batched sampling: many prompts, many samples each, one decode loop.

Each distinct prompt is prefilled once; its KV cache is then fanned out to the rows of its
group. Rows leave the batch as soon as they stop, so a group with one long answer does not keep
the others decoding. Logprobs are those of the untempered policy (what the trainer computes);
temperature, top-k and top-p shape only the choice of token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from grpo.backends.local.kv_cache import preallocated_cache
from grpo.types import SampledSequence, SamplingParams

# Stop strings are matched on the decoded tail of a row; this many tokens is plenty for any
# stop string a tokenizer would split, and keeps decoding cheap.
STOP_STRING_TAIL_TOKENS = 16


@dataclass
class GenerationRequest:
    prompt: list[int]
    num_samples: int
    params: SamplingParams
    include_prompt_logprobs: bool = False
    # filled in by generate()
    sequences: list[SampledSequence] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None


@dataclass
class _Row:
    request: GenerationRequest
    max_tokens: int
    stop_ids: frozenset[int]
    stop_strings: list[str]
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: str = "length"


def _position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def waves(requests: list[GenerationRequest], row_bytes, budget: int | None) -> list[list[GenerationRequest]]:
    """Consecutive runs of whole requests whose rows' working memory (``row_bytes(length)`` per
    row, length = prompt + max_tokens) stays within ``budget`` bytes (None: all in one wave).
    A request over the budget on its own still runs, alone: splitting its rows would change
    what its seed draws."""
    if budget is None:
        return [requests]
    out: list[list[GenerationRequest]] = []
    used = 0
    for req in requests:
        need = req.num_samples * row_bytes(len(req.prompt) + (req.params.max_tokens or 0))
        if out and used + need <= budget:
            out[-1].append(req)
            used += need
        else:
            out.append([req])
            used = need
    return out


@torch.no_grad()
def prompt_logprobs(model, prompts: list[list[int]], device: torch.device) -> list[list[float | None]]:
    """Logprob of every prompt token given the ones before it (None for the first)."""
    out: list[list[float | None]] = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        logits = model(input_ids=ids).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
        out.append([None, *lp.tolist()])
    return out


@torch.no_grad()
def generate(model, requests: list[GenerationRequest], tokenizer, device: torch.device, max_context: int | None = None,
             compact: str | None = None) -> None:
    """Sample every request's ``num_samples`` continuations; results go into the requests.

    ``compact`` says when finished rows leave the batch: "eager" (as soon as one finishes) or
    "half" (once half the batch has). Default: eager on CPU, where a dropped row is compute saved,
    half on CUDA, where the decode step is launch-bound and each new batch shape costs more than a
    row saves. Finished rows that stay draw no random numbers, so samples do not depend on it.
    """
    compact = compact or ("half" if device.type == "cuda" else "eager")
    if compact not in ("eager", "half"):
        raise ValueError(f"compact must be 'eager' or 'half', got {compact!r}")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    for req in requests:
        if req.include_prompt_logprobs:
            req.prompt_logprobs = prompt_logprobs(model, [req.prompt], device)[0]

    # ---- prefill each distinct prompt once, left-padded into one batch
    prompts = [req.prompt for req in requests]
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    attention = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p, device=device)
        attention[i, width - len(p):] = 1
    longest = max(_max_tokens(req, max_context) for req in requests)
    cache = preallocated_cache(model.config, capacity=width + longest)
    # Only the last position's logits are needed: the unembedding over every prompt position
    # would cost a quarter of the prefill on a small model with a large vocabulary.
    out = model(input_ids=input_ids, attention_mask=attention, position_ids=_position_ids(attention),
                past_key_values=cache, use_cache=True, logits_to_keep=1)
    last_logits = out.logits[:, -1].float()

    # ---- fan each prompt out to its rows
    rows: list[_Row] = []
    owner: list[int] = []
    for i, req in enumerate(requests):
        stop_strings, stop_ids = req.params.stop_strings_and_ids()
        max_tokens = _max_tokens(req, max_context)
        generator = None
        if req.params.seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(int(req.params.seed))
        for _ in range(req.num_samples):
            rows.append(_Row(req, max_tokens, frozenset(stop_ids), stop_strings, generator))
            owner.append(i)
    index = torch.tensor(owner, device=device)
    cache.batch_select_indices(index)
    attention = attention[index]
    logits = last_logits[index]
    positions = attention.sum(-1, keepdim=True) - 1
    batch = list(range(len(rows)))  # row ids in the batch, in batch order
    done = [False] * len(rows)

    while True:
        live = [b for b, r in enumerate(batch) if not done[r]]
        live_logits = logits if len(live) == len(batch) else logits[torch.tensor(live, device=device)]
        chosen, logprobs = _choose_tokens(live_logits, [rows[batch[b]] for b in live], device)
        # One device-to-host copy per step, not two per row (each a sync on a GPU).
        for token, logprob, b in zip(chosen.tolist(), logprobs.tolist(), live, strict=True):
            row = rows[batch[b]]
            row.tokens.append(token)
            row.logprobs.append(logprob)
            if token in row.stop_ids or _hits_stop_string(row, tokenizer):
                row.stop_reason, done[batch[b]] = "stop", True
            elif len(row.tokens) >= row.max_tokens:
                row.stop_reason, done[batch[b]] = "length", True
        still = [b for b in live if not done[batch[b]]]
        if not still:
            break
        tokens = torch.full((len(batch),), pad_id, dtype=torch.long, device=device)
        tokens[torch.tensor(live, device=device)] = chosen  # finished rows ride along on padding
        finished = len(batch) - len(still)
        if finished and (compact == "eager" or 2 * finished >= len(batch)):
            sel = torch.tensor(still, device=device)
            cache.batch_select_indices(sel)
            attention, positions, tokens = attention[sel], positions[sel], tokens[sel]
            batch = [batch[b] for b in still]
        attention = torch.cat([attention, attention.new_ones((len(batch), 1))], dim=1)
        positions = positions + 1
        out = model(input_ids=tokens[:, None], attention_mask=attention, position_ids=positions,
                    past_key_values=cache, use_cache=True)
        logits = out.logits[:, -1].float()

    for req in requests:
        req.sequences = []
    for row in rows:
        row.request.sequences.append(SampledSequence(tokens=row.tokens, logprobs=row.logprobs, stop_reason=row.stop_reason))


def _max_tokens(req: GenerationRequest, max_context: int | None) -> int:
    return req.params.max_tokens or (max_context - len(req.prompt) if max_context else 256)


def _choose_tokens(logits: torch.Tensor, rows: list[_Row], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; return it with its logprob under the untempered policy."""
    logprobs_all = torch.log_softmax(logits, dim=-1)
    chosen = torch.empty(len(rows), dtype=torch.long, device=device)
    # Rows sharing sampling settings are drawn together; a row with its own seed draws from its
    # own generator so that a seeded request reproduces whatever else is in the batch.
    groups: dict[tuple, list[int]] = {}
    for b, row in enumerate(rows):
        p = row.request.params
        groups.setdefault((p.temperature, p.top_k, p.top_p, id(row.generator)), []).append(b)
    for (temperature, top_k, top_p, _), members in groups.items():
        idx = torch.tensor(members, device=device)
        mine = logits if len(members) == len(rows) else logits[idx]  # as a rule, one group: no copy
        if temperature == 0:
            chosen[idx] = mine.argmax(-1)
            continue
        scores = mine if temperature == 1 else mine / temperature
        scores = _filter_top_k_top_p(scores, top_k, top_p)
        chosen[idx] = _draw(torch.softmax(scores, dim=-1), rows[members[0]].generator)
    return chosen, logprobs_all.gather(-1, chosen[:, None])[:, 0]


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs`` by inverting its cumulative distribution.

    ``torch.multinomial`` draws one exponential per vocabulary entry (49k per row per step on a
    small model, ~15% of a CPU decode step); inverting the CDF needs one uniform per row. The CDF
    is summed in float64 so that rounding cannot shift mass between neighbouring tokens. With
    ``right=True`` the first index whose cumulative mass exceeds the draw is taken, so a token of
    zero probability (cut by top-k/top-p) is never chosen: its CDF equals its predecessor's.
    """
    cdf = probs.double().cumsum_(-1)
    total = cdf[:, -1:]
    u = torch.rand(total.shape, dtype=torch.float64, device=probs.device, generator=generator)
    # u < 1, but u * total can round up to total itself; keep the draw strictly inside the mass
    draw = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, draw, right=True)[:, 0]


def _filter_top_k_top_p(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k is not None and 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_scores, -1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop_sorted = (cumulative - torch.softmax(sorted_scores, -1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def _hits_stop_string(row: _Row, tokenizer) -> bool:
    if not row.stop_strings:
        return False
    tail = tokenizer.decode(row.tokens[-STOP_STRING_TAIL_TOKENS:], skip_special_tokens=False)
    return any(s in tail for s in row.stop_strings)
