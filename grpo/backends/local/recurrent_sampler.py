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
On a CPU, Qwen3.5's linear-attention layers take their decoding steps through grpo's kernels
(delta_rule.py); there is no continuous batching across batches, no prefix cache and no native
decoding step for the other layers.

Before this, requests ran one after another, each prompt prefilled once per row: the weights
were read once per request for every decoding step (docs/benchmark.md has the numbers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from transformers import DynamicCache

from grpo.backends.local import delta_rule, sampler
from grpo.backends.local.sections import section
from grpo.types import SampledSequence


@torch.inference_mode()
def generate_lockstep(model, requests: list[sampler.GenerationRequest], tokenizer, device: torch.device,
                      max_context: int | None = None, row_bytes: Callable[[int], int] | None = None,
                      budget: int | None = None) -> sampler.GenerationStats:
    """``sampler.generate``'s results (prompt logprobs excepted: the caller computes those), in
    batches of whole requests of at most ``sampler.batch_rows`` rows (a larger request alone)."""
    stats = sampler.GenerationStats()
    limit = sampler.batch_rows(requests, row_bytes, budget, max_context)
    first_index = 0
    with delta_rule.routed(model) if device.type == "cpu" else contextlib.nullcontext():
        for batch in _batches(requests, limit):
            rows = []
            for req in batch:
                rows += sampler.request_rows(req, first_index + len(rows), max_context, device)
            first_index += len(rows)
            _decode_batch(model, batch, rows, tokenizer, device, stats)
            for req in batch:
                req.sequences = [SampledSequence(tokens=row.tokens, logprobs=row.logprobs, stop_reason=row.stop_reason)
                                 for row in rows if row.request is req]
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
                  device: torch.device, stats: sampler.GenerationStats) -> None:
    """Prefill ``requests``' distinct prompts together, fan the cache out to their rows, then decode
    every row together until each one stops."""
    pad = sampler._pad_id(tokenizer)
    prompts = list(dict.fromkeys(tuple(req.prompt) for req in requests))  # (a GRPO group's prompt, once)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    cache = DynamicCache(config=model.config)
    with section("grpo.sample.prefill"):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=sampler.position_ids(mask), cache=cache,
                       use_cache=True, logits_to_keep=1).logits[:, -1].float()
    stats.admissions += 1
    stats.prompt_tokens += sum(len(req.prompt) * req.num_samples for req in requests)
    stats.prefilled_tokens += sum(len(p) for p in prompts)
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
