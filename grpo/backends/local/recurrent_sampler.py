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

Requests beyond what the budget holds join the running batch as its rows finish, as the slot
cache admits them (continuous batching): their prompts are prefilled on their own, and one copy
builds the next batch from the running rows' states and theirs (``_joined``), the attention layers'
keys and values left-padded to the wider of the two. Before, each batch ran until its longest row
had finished and the next waited: at the ~30 rows a 24 GB machine's budget holds of a
Qwen3.5-0.8B-sized model, a GRPO step of more prompts decoded its batches' tails with few rows
(docs/benchmark.md has the numbers). A cache with layers of other kinds runs its batches one
after another, as before (``joinable``).

With a prefix cache, a multi-turn episode's next turn starts from the states its last turn left
(recurrent_prefix.py): every prompt and every finished row is stored with its layers' states, and
a prompt that extends a stored sequence runs only its new tokens, in the same batch as prompts
found nowhere (their states zero). On a CPU, Qwen3.5's linear-attention layers take their decoding
steps through grpo's kernels (delta_rule.py), and its attention layers their attention over the
cache (cached_attention.py); the rest of a step is the model's own forward.

Before this, requests ran one after another, each prompt prefilled once per row: the weights
were read once per request for every decoding step (docs/benchmark.md has the numbers).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

from grpo.backends.local import cached_attention, delta_rule, recurrent_prefix, sampler
from grpo.backends.local.prefix_cache import PrefixCache, left_padded
from grpo.backends.local.sections import section
from grpo.types import SampledSequence

# False: each batch runs until its last row finishes before the next requests are admitted (the
# behaviour before continuous batching; scripts/lockstep_bench.py measures against it)
JOIN_RUNNING_BATCH = True


@dataclass
class _Lockstep:
    """The rows decoding together: the model's cache (row b of every layer is ``rows[b]``), the
    attention mask of its columns, each row's next position and the token it is fed next (padding
    for a finished row, which rides along until the batch sheds it)."""

    cache: DynamicCache
    mask: torch.Tensor  # [rows, columns]
    positions: torch.Tensor  # [rows, 1]
    tokens: torch.Tensor  # [rows]
    rows: list[sampler._Row]

    def live(self) -> list[int]:
        return [b for b, row in enumerate(self.rows) if not row.done]

    def keep(self, kept: list[int]) -> None:
        """Only rows ``kept``, in that order (each layer's states copied once)."""
        index = torch.tensor(kept, dtype=torch.long, device=self.mask.device)
        self.cache.reorder_cache(index)
        self.mask, self.positions, self.tokens = self.mask[index], self.positions[index], self.tokens[index]
        self.rows = [self.rows[b] for b in kept]


@torch.inference_mode()
def generate_lockstep(model, requests: list[sampler.GenerationRequest], tokenizer, device: torch.device,
                      max_context: int | None = None, row_bytes: Callable[[int], int] | None = None,
                      budget: int | None = None, prefix_cache: PrefixCache | None = None) -> sampler.GenerationStats:
    """``sampler.generate``'s results (prompt logprobs excepted: the caller computes those), with at
    most ``sampler.batch_rows`` rows decoding at once (a larger request alone); requests are
    admitted in order as rows finish. ``prefix_cache``: read and written where the model's states
    can be restored (``recurrent_prefix.continuable``), else left alone."""
    stats = sampler.GenerationStats()
    if prefix_cache is not None and not recurrent_prefix.continuable(model):
        prefix_cache = None
    before = prefix_cache.stats.snapshot() if prefix_cache is not None else None
    limit = sampler.batch_rows(requests, row_bytes, budget, max_context)
    join = JOIN_RUNNING_BATCH and joinable(DynamicCache(config=model.config))
    pending = deque(requests)
    rows: list[sampler._Row] = []  # every row, in the order they draw
    batch: _Lockstep | None = None
    on_cpu = device.type == "cpu"  # (the linear layers' and the attention layers' decoding steps through grpo's kernels)
    with delta_rule.routed(model) if on_cpu else contextlib.nullcontext(), \
            cached_attention.routed() if on_cpu else contextlib.nullcontext():
        while True:
            live = batch.live() if batch is not None else []
            free = limit - len(live) if join or not live else 0
            admitted = sampler._admissions(pending, free, nothing_running=not live)
            if admitted:
                new_rows = [row for req in admitted
                            for row in sampler.request_rows(req, len(rows), max_context, device)]
                rows += new_rows
                with section("grpo.sample.prefill"):
                    batch = _admit(model, admitted, new_rows, batch if live else None, tokenizer, device, stats,
                                   prefix_cache)
                live = batch.live()
            if not live:  # (every row finished at its first token: the next requests, or the end)
                if pending:
                    continue
                break
            if 4 * (len(batch.rows) - len(live)) >= len(batch.rows):  # (each shrink copies every state kept)
                batch.keep(live)
            stats.peak_rows = max(stats.peak_rows, len(batch.rows))
            with section("grpo.sample.decode_forward"):
                batch.mask = torch.cat([batch.mask, batch.mask.new_ones(len(batch.rows), 1)], dim=1)
                logits = model(input_ids=batch.tokens[:, None], attention_mask=batch.mask,
                               position_ids=batch.positions, cache=batch.cache, use_cache=True).logits[:, -1].float()
            batch.positions = batch.positions + 1
            stats.decode_steps += 1
            stats.rows_decoded += len(batch.rows)
            live = batch.live()
            _choose(batch, logits if len(live) == len(batch.rows) else logits[torch.tensor(live, device=device)], live,
                    tokenizer, device, prefix_cache)
    for req in requests:
        req.sequences = [SampledSequence(tokens=row.tokens, logprobs=row.logprobs, stop_reason=row.stop_reason)
                         for row in rows if row.request is req]
    if prefix_cache is not None:
        done = prefix_cache.stats.since(before)
        stats.prefix_hits, stats.prefix_hit_tokens, stats.prefix_evictions = done.hits, done.hit_tokens, done.evictions
    return stats


def joinable(cache: DynamicCache) -> bool:
    """Whether new rows can join a running batch of this cache: its layers are plain keys and values
    or linear-attention states, each with the batch in its first dimension."""
    return all(type(layer) in (DynamicLayer, LinearAttentionLayer) for layer in cache.layers)


def _admit(model, requests: list[sampler.GenerationRequest], new_rows: list[sampler._Row], running: _Lockstep | None,
           tokenizer, device: torch.device, stats: sampler.GenerationStats,
           prefix_cache: PrefixCache | None) -> _Lockstep:
    """Prefill ``requests``' distinct prompts together (after their cached prefixes where
    ``prefix_cache`` has them), choose their rows' first tokens, and return the batch of the
    ``running`` batch's unfinished rows (None: none) followed by ``new_rows``."""
    pad = sampler._pad_id(tokenizer)
    prompts = list(dict.fromkeys(tuple(req.prompt) for req in requests))  # (a GRPO group's prompt, once)
    hits = [prefix_cache.lookup_end(p) if prefix_cache is not None else None for p in prompts]
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
    # each new row's prompt row of the prefill: the cache, the logits and the mask fanned out to the rows
    prompt_row = {prompt: i for i, prompt in enumerate(prompts)}
    owner = torch.tensor([prompt_row[tuple(row.request.prompt)] for row in new_rows], device=device)
    positions = torch.tensor([[len(row.request.prompt)] for row in new_rows], device=device)
    tokens = torch.full((len(new_rows),), pad, device=device)  # (their first, chosen below)
    if running is None:
        cache.reorder_cache(owner)
        batch = _Lockstep(cache, mask[owner], positions, tokens, new_rows)
    else:
        kept = running.live()
        index = torch.tensor(kept, dtype=torch.long, device=device)
        joined, joined_mask = _joined([(running.cache, running.mask, index), (cache, mask, owner)], model)
        batch = _Lockstep(joined, joined_mask, torch.cat([running.positions[index], positions]),
                          torch.cat([running.tokens[index], tokens]), [running.rows[b] for b in kept] + new_rows)
    first = len(batch.rows) - len(new_rows)
    _choose(batch, logits[owner], list(range(first, len(batch.rows))), tokenizer, device, prefix_cache)
    return batch


def _choose(batch: _Lockstep, logits: torch.Tensor, live: list[int], tokenizer, device: torch.device,
            prefix_cache: PrefixCache | None) -> None:
    """Rows ``live`` of ``batch`` (``logits``: one row each) choose their next tokens, fed at the next
    step; a row that stops is stored in ``prefix_cache`` and is fed padding from then on."""
    with section("grpo.sample.choose_tokens"):
        chosen, logprobs = sampler._choose_tokens(logits, [batch.rows[b] for b in live], device)
    for token, logprob, b in zip(chosen.tolist(), logprobs.tolist(), live, strict=True):
        sampler.record_token(batch.rows[b], token, logprob, tokenizer)
    if prefix_cache is not None:  # (before a finished row rides along on padding)
        _store_finished(prefix_cache, batch.cache, batch.rows, live, batch.mask)
    index = torch.tensor(live, dtype=torch.long, device=device)
    batch.tokens[index] = torch.where(torch.tensor([batch.rows[b].done for b in live], device=device),
                                      sampler._pad_id(tokenizer), chosen)


def _joined(parts: list[tuple[DynamicCache, torch.Tensor, torch.Tensor]], model) -> tuple[DynamicCache, torch.Tensor]:
    """One batch cache of each part's rows ``index`` (a part: a cache, its attention mask, the rows to
    take), in turn, and its mask: each layer's states copied once into the new batch, the attention
    layers' keys and values right-aligned in the widest part's columns behind zeros. The parts'
    caches are emptied layer by layer as they are read, so that their memory goes as the new one's
    comes: the running batch and the new prompts' prefill at most, never a third copy on top."""
    width = max(mask.shape[1] for _, mask, _ in parts)
    rows = sum(len(index) for _, _, index in parts)
    mask = torch.cat([torch.nn.functional.pad(m[index], (width - m.shape[1], 0)) for _, m, index in parts])
    cache = DynamicCache(config=model.config)
    for i, layer in enumerate(cache.layers):
        sources = [part[0].layers[i] for part in parts]
        if isinstance(layer, LinearAttentionLayer):
            for s in range(layer.number_of_states):
                conv, recurrent = (_stacked([getattr(source, name)[s] for source in sources], parts, rows)
                                   for name in ("conv_states", "recurrent_states"))
                recurrent_prefix.set_states(layer, s, conv, recurrent)
                for source in sources:
                    source.conv_states[s] = source.recurrent_states[s] = None
        else:
            cache.update(*left_padded([(source.keys[index], source.values[index])
                                       for source, (_, _, index) in zip(sources, parts, strict=True)], width), i)
            for source in sources:
                source.keys = source.values = None
    return cache, mask


def _stacked(states: list[torch.Tensor | None], parts: list, rows: int) -> torch.Tensor | None:
    """Each part's rows ``index`` of its state (batch first), in turn, copied once into one new
    tensor (None where the layer keeps no such state)."""
    if states[0] is None:
        return None
    out = states[0].new_empty((rows, *states[0].shape[1:]))
    start = 0
    for state, (_, _, index) in zip(states, parts, strict=True):
        torch.index_select(state, 0, index, out=out[start:start + len(index)])
        start += len(index)
    return out


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
