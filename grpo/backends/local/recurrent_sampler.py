"""Sampling for models whose layers the slot cache cannot hold: every request's rows in lockstep, on the model's own cache.

The sampler's slot cache (kv_cache.py) keeps attention layers' keys and values, one row a slot,
each row at its own position. A hybrid decoder's linear-attention layers (Qwen3.5's and
Qwen3-Next's gated delta rule, Granite 4's state-space layers) keep a recurrent state instead,
which a slot cannot hold; those models sampled nothing here before (``attention_layers`` refused
them). ``generate_lockstep`` samples them as transformers' ``generate`` batches them: the distinct
prompts of as many requests as the memory budget holds are prefilled together, left-padded (a
hybrid's linear layers zero the padding's inputs, so a padded row's state is its prompt's), each
prompt once; the model's cache is then fanned out to the requests' rows, which decode together,
one step after another through the model's forward, each row at its own position behind its
padding. Finished rows ride along on padding until a quarter of the batch has finished, then
leave it. Tokens are chosen by the sampler's own ``_choose_tokens`` with each request's seed, so
a seeded request draws what it draws through the slot cache (tests/test_recurrent_sampler.py).
With a prefix cache, a multi-turn episode's next turn starts from the states its last turn left
(recurrent_prefix.py): every prompt and every finished row is stored with its layers' states, and
a prompt that extends a stored sequence runs only its new tokens, in the same batch as prompts
found nowhere (their states zero). On a CPU, Qwen3.5's linear-attention layers take their decoding
steps through grpo's kernels (delta_rule.py); there is no continuous batching across batches and
no native decoding step for the other layers.

Before this, requests ran one after another, each prompt prefilled once per row: the weights
were read once per request for every decoding step (docs/benchmark.md has the numbers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from transformers import DynamicCache

from grpo.backends.local import delta_rule, recurrent_prefix, sampler
from grpo.backends.local.prefix_cache import PrefixCache
from grpo.backends.local.sections import section
from grpo.types import SampledSequence


@torch.inference_mode()
def generate_lockstep(model, requests: list[sampler.GenerationRequest], tokenizer, device: torch.device,
                      max_context: int | None = None, row_bytes: Callable[[int], int] | None = None,
                      budget: int | None = None, prefix_cache: PrefixCache | None = None) -> sampler.GenerationStats:
    """``sampler.generate``'s results (prompt logprobs excepted: the caller computes those), in
    batches of whole requests of at most ``sampler.batch_rows`` rows (a larger request alone).
    ``prefix_cache``: read and written where the model's states can be restored
    (``recurrent_prefix.continuable``), else left alone."""
    stats = sampler.GenerationStats()
    if prefix_cache is not None and not recurrent_prefix.continuable(model):
        prefix_cache = None
    before = prefix_cache.stats.snapshot() if prefix_cache is not None else None
    limit = sampler.batch_rows(requests, row_bytes, budget, max_context)
    first_index = 0
    with delta_rule.routed(model) if device.type == "cpu" else contextlib.nullcontext():
        for batch in _batches(requests, limit):
            rows = []
            for req in batch:
                rows += sampler.request_rows(req, first_index + len(rows), max_context, device)
            first_index += len(rows)
            _decode_batch(model, batch, rows, tokenizer, device, stats, prefix_cache)
            for req in batch:
                req.sequences = [SampledSequence(tokens=row.tokens, logprobs=row.logprobs, stop_reason=row.stop_reason)
                                 for row in rows if row.request is req]
    if prefix_cache is not None:
        done = prefix_cache.stats.since(before)
        stats.prefix_hits, stats.prefix_hit_tokens, stats.prefix_evictions = done.hits, done.hit_tokens, done.evictions
    return stats


def _batches(requests: list[sampler.GenerationRequest], limit: int) -> list[list[sampler.GenerationRequest]]:
    """Consecutive requests, as many a batch as ``limit`` rows hold (a request of more rows alone:
    splitting its rows would change what its seed draws)."""
    batches: list[list[sampler.GenerationRequest]] = []
    rows = 0
    for req in requests:
        if not batches or rows + req.num_samples > limit:
            batches.append([])
            rows = 0
        batches[-1].append(req)
        rows += req.num_samples
    return batches


def _decode_batch(model, requests: list[sampler.GenerationRequest], rows: list[sampler._Row], tokenizer,
                  device: torch.device, stats: sampler.GenerationStats, prefix_cache: PrefixCache | None) -> None:
    """Prefill ``requests``' distinct prompts together (after their cached prefixes where
    ``prefix_cache`` has them), fan the cache out to their rows, then decode every row together
    until each one stops."""
    pad = sampler._pad_id(tokenizer)
    prompts = list(dict.fromkeys(tuple(req.prompt) for req in requests))  # (a GRPO group's prompt, once)
    hits = [prefix_cache.lookup_end(p) if prefix_cache is not None else None for p in prompts]
    with section("grpo.sample.prefill"):
        if any(hits):
            cache, mask, logits = _prefill_after(model, prompts, hits, pad, device)
        else:
            cache, mask, logits = _prefill(model, prompts, pad, device)
    stats.admissions += 1
    stats.prompt_tokens += sum(len(req.prompt) * req.num_samples for req in requests)
    stats.prefilled_tokens += sum(len(p) - (hit[0] if hit else 0) for p, hit in zip(prompts, hits, strict=True))
    if prefix_cache is not None:
        for j, prompt in enumerate(prompts):
            prefix_cache.store(prompt, *recurrent_prefix.row_entry(cache, j, mask[j].nonzero()[:, 0]))
    # each row's prompt row of the prefill: the cache, the logits and the mask fanned out to the rows
    prompt_row = {prompt: i for i, prompt in enumerate(prompts)}
    owner = torch.tensor([prompt_row[tuple(row.request.prompt)] for row in rows], device=device)
    cache.reorder_cache(owner)
    logits, mask = logits[owner], mask[owner]
    positions = torch.tensor([[len(row.request.prompt)] for row in rows], device=device)
    stats.peak_rows = max(stats.peak_rows, len(rows))
    batch = list(rows)  # the rows still in the cache, in its order
    finished_since = 0  # rows finished since the batch last shrank
    while True:
        live = [b for b, row in enumerate(batch) if not row.done]
        with section("grpo.sample.choose_tokens"):
            chosen, logprobs = sampler._choose_tokens(logits[live], [batch[b] for b in live], device)
        for token, logprob, b in zip(chosen.tolist(), logprobs.tolist(), live, strict=True):
            sampler.record_token(batch[b], token, logprob, tokenizer)
        if prefix_cache is not None:  # (before a finished row rides along on padding)
            _store_finished(prefix_cache, cache, batch, live, mask)
        still = [b for b in live if not batch[b].done]
        if not still:
            return
        finished_since += len(live) - len(still)
        tokens = torch.full((len(batch),), pad, dtype=torch.long, device=device)
        tokens[torch.tensor(live, device=device)] = chosen  # finished rows ride along on padding
        if 4 * finished_since >= len(batch):  # (each shrink copies every state the batch keeps)
            keep = torch.tensor(still, device=device)
            cache.reorder_cache(keep)
            batch, tokens, mask, positions = [batch[b] for b in still], tokens[keep], mask[keep], positions[keep]
            finished_since = 0
        mask = torch.cat([mask, mask.new_ones(len(batch), 1)], dim=1)
        with section("grpo.sample.decode_forward"):
            logits = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=positions, cache=cache,
                           use_cache=True).logits[:, -1].float()
        positions = positions + 1
        stats.decode_steps += 1
        stats.rows_decoded += len(batch)


def _prefill(model, prompts: list[tuple[int, ...]], pad: int, device: torch.device
             ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
    """Distinct prompts from nothing, left-padded together (a hybrid's linear layers zero the
    padding's inputs, so a padded row's state is its prompt's): the cache, its mask and each
    prompt's next-token logits."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=sampler.position_ids(mask), cache=cache,
                   use_cache=True, logits_to_keep=1).logits[:, -1].float()
    return cache, mask, logits


def _prefill_after(model, prompts: list[tuple[int, ...]], hits: list, pad: int, device: torch.device
                   ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
    """``_prefill``'s results where some prompts extend a cached sequence (``hits[j]``: its length,
    keys and values, states; None: nothing cached): each prompt's states restored and only its
    tokens after them run, left-padded behind the most new tokens, the padding made a no-op
    (recurrent_prefix.py)."""
    known = [hit[0] if hit else 0 for hit in hits]
    new = [len(p) - k for p, k in zip(prompts, known, strict=True)]
    width = max(new)
    cache, past = recurrent_prefix.restored_cache(model, hits)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    positions = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for j, (p, k, n) in enumerate(zip(prompts, known, new, strict=True)):
        ids[j, width - n:] = torch.tensor(p[k:], device=device)
        mask[j, width - n:] = 1
        positions[j, width - n:] = torch.arange(k, len(p), device=device)
    mask = torch.cat([past.to(device), mask], dim=1)
    with recurrent_prefix.neutral_left_padding(model, cache, [width - n for n in new], width):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                       logits_to_keep=1).logits[:, -1].float()
    return cache, mask, logits


def _store_finished(prefix_cache: PrefixCache, cache: DynamicCache, batch: list[sampler._Row], live: list[int],
                    mask: torch.Tensor) -> None:
    """Store each row that has just finished as its prompt and every token it fed back (its last,
    never fed, is the next turn's first new token), with the states they left: a next turn on that
    episode runs from there."""
    for b in live:
        row = batch[b]
        if row.done and len(row.tokens) > 1:
            prefix_cache.store([*row.request.prompt, *row.tokens[:-1]],
                               *recurrent_prefix.row_entry(cache, b, mask[b].nonzero()[:, 0]))
