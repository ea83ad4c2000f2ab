"""Sampling for models whose layers the slot cache cannot hold: one request at a time, on the model's own cache.

The sampler's slot cache (kv_cache.py) keeps attention layers' keys and values, one row a slot,
each row at its own position. A hybrid decoder's linear-attention layers (Qwen3.5's and
Qwen3-Next's gated delta rule, Granite 4's state-space layers) keep a recurrent state instead,
which a slot cannot hold; those models sampled nothing here before (``attention_layers`` refused
them). ``generate_each`` samples them as transformers would: a request's rows start from one
prompt, so they run in lockstep -- the prompt prefilled for all of them at once, then one decoding
step after another through the model's forward and its own cache, with no padding and no mask (a
finished row rides along until its group ends). Tokens are chosen by the sampler's own
``_choose_tokens`` with the request's seed, so a seeded request draws what it draws through the
slot cache (tests/test_recurrent_sampler.py); there is no continuous batching across requests,
no prefix cache and no native decoding step: slower, but correct.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from grpo.backends.local import sampler
from grpo.types import SampledSequence


@torch.inference_mode()
def generate_each(model, requests: list[sampler.GenerationRequest], tokenizer, device: torch.device,
                  max_context: int | None = None) -> sampler.GenerationStats:
    """``sampler.generate``'s results, one request after another (prompt logprobs excepted: the
    caller computes those)."""
    stats = sampler.GenerationStats()
    first_index = 0
    for req in requests:
        rows = sampler.request_rows(req, first_index, max_context, device)
        first_index += len(rows)
        _decode_group(model, req, rows, tokenizer, device, stats)
        req.sequences = [SampledSequence(tokens=row.tokens, logprobs=row.logprobs, stop_reason=row.stop_reason)
                         for row in rows]
    return stats


def _decode_group(model, req: sampler.GenerationRequest, rows: list[sampler._Row], tokenizer, device: torch.device,
                  stats: sampler.GenerationStats) -> None:
    """Prefill ``req``'s prompt for its rows, then decode them together until every one stops."""
    n, length = len(rows), len(req.prompt)
    cache = DynamicCache(config=model.config)
    prompt = torch.tensor([req.prompt], device=device).expand(n, length)
    logits = model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1].float()
    stats.admissions += 1
    stats.prompt_tokens += length
    stats.prefilled_tokens += length
    stats.peak_rows = max(stats.peak_rows, n)
    pad = sampler._pad_id(tokenizer)
    position = length
    while True:
        live = [r for r, row in enumerate(rows) if not row.done]
        chosen, logprobs = sampler._choose_tokens(logits[live], [rows[r] for r in live], device)
        for token, logprob, r in zip(chosen.tolist(), logprobs.tolist(), live, strict=True):
            sampler.record_token(rows[r], token, logprob, tokenizer)
        if all(row.done for row in rows):
            return
        tokens = torch.tensor([row.tokens[-1] if not row.done else pad for row in rows], device=device)
        positions = torch.full((n, 1), position, dtype=torch.long, device=device)
        logits = model(input_ids=tokens[:, None], position_ids=positions, cache=cache,
                       use_cache=True).logits[:, -1].float()
        position += 1
        stats.decode_steps += 1
        stats.rows_decoded += n
