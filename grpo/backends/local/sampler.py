"""Batched sampling with continuous batching: many prompts, many samples each, one decode loop.

Requests are admitted in order while the memory budget has room for their rows; each new
request's prompt is prefilled once and its KV cache fanned out to the rows of its group (and the
start the admitted prompts share, a chat template's system prompt, is prefilled once for all). Rows
leave the batch as soon as they stop, and the next requests' rows take their slots at once, so
a step with more rows than one batch holds keeps the batch full instead of waiting for each
batch's longest answer (kv_cache.py keeps each row at its own position). With a prefix cache
(prefix_cache.py), a prompt is prefilled only after its longest prefix whose keys and values an
earlier prompt or finished row left there, so a multi-turn episode's turn costs its new tokens.
Logprobs are those of the untempered policy (what the trainer computes); temperature, top-k and
top-p shape only the choice of token.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from grpo.backends.local import cached_attention, gemma_decode, graph_decode, native_decode
from grpo.backends.local.kv_cache import SlotCache, attention_layers, attention_only
from grpo.backends.local.lean_decode import lean_decoder
from grpo.backends.local.prefix_cache import PrefixCache, left_padded
from grpo.backends.local.sections import section
from grpo.backends.local.trunk import common_trunk
from grpo.models import native_kernels
from grpo.types import SampledSequence, SamplingParams

# Stop strings are matched on the decoded tail of a row; this many tokens is plenty for any
# stop string a tokenizer would split, and keeps decoding cheap.
STOP_STRING_TAIL_TOKENS = 16


@dataclass
class GenerationRequest:
    prompt: list[int]
    num_samples: int  # 0: the prompt's logprobs only (compute_logprobs), nothing sampled
    params: SamplingParams
    include_prompt_logprobs: bool = False
    prompt_logprobs_last_n: int | None = None  # only the last n prompt logprobs (the rest None)
    # filled in by generate()
    sequences: list[SampledSequence] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None


@dataclass
class _Row:
    index: int  # in the order of requests, then samples: the order a request's rows draw in
    request: GenerationRequest
    max_tokens: int
    stop_ids: frozenset[int]
    stop_strings: list[str]
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: str = "length"
    done: bool = False


@dataclass
class GenerationStats:
    """What one ``generate`` call did: prefills (admissions of requests), decoding steps, the
    rows those steps carried, and the most rows in the batch at once; the prompts' tokens, those
    actually prefilled (a prompt shared by several requests of one admission counts once, a
    prefix read from the prefix cache not at all), and the prefix cache's hits, the tokens they
    covered and its evictions."""

    admissions: int = 0
    decode_steps: int = 0
    rows_decoded: int = 0
    peak_rows: int = 0
    prompt_tokens: int = 0
    prefilled_tokens: int = 0
    prefix_hits: int = 0
    prefix_hit_tokens: int = 0
    prefix_evictions: int = 0


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each column's position in its row behind left padding (0 on the padding itself)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def row_capacity(requests: list[GenerationRequest], max_context: int | None = None) -> int:
    """Positions a row slot must hold: the longest prompt plus max_tokens of any request."""
    return max(len(req.prompt) + _max_tokens(req, max_context) for req in requests)


def batch_rows(requests: list[GenerationRequest], row_bytes: Callable[[int], int] | None, budget: int | None,
               max_context: int | None = None) -> int:
    """Rows in flight at once: as many as ``budget`` bytes hold (``row_bytes(positions)`` each),
    all rows when unbounded. A request larger than that still runs (``generate`` gives it the
    slots), with no other rows beside it: splitting its rows would change what its seed draws."""
    total = sum(req.num_samples for req in requests)
    if budget is None or row_bytes is None:
        return total
    return min(total, budget // row_bytes(row_capacity(requests, max_context)))


# inference_mode rather than no_grad: no version counters or view tracking on the ~1,200
# operators of a decoding step (a bf16 sampling call of the bench 2.17-2.26 -> 2.06-2.08 s,
# identical samples). Nothing it makes is ever trained through: the sequences leave as lists, and
# the KV tensors the prefix cache keeps are read only by later generations.
@torch.inference_mode()
def generate(model, requests: list[GenerationRequest], tokenizer, device: torch.device, max_context: int | None = None,
             compact: str | None = None, row_bytes: Callable[[int], int] | None = None,
             budget: int | None = None, prefix_cache: PrefixCache | None = None,
             cuda_graphs: bool | None = None) -> GenerationStats:
    """Sample every request's ``num_samples`` continuations; results go into the requests. The
    prompt logprobs of those asking for them (and of logprobs-only requests, ``num_samples`` 0)
    come first, in decoder calls they share (prompt_logprobs.py).

    At most ``batch_rows(requests, row_bytes, budget)`` rows decode at once; requests are
    admitted in order as rows leave. ``compact`` says when finished rows leave the batch:
    "eager" (as soon as one finishes) or "half" (once half the batch has, or when leaving lets
    the next request in). Default: eager on CPU, where a dropped row is compute saved, half on
    CUDA, where the decode step is launch-bound and each new batch shape costs more than a row
    saves. Finished rows that stay draw no random numbers, and a request's rows draw in their
    own order wherever they sit in the batch, so seeded samples depend on neither.

    ``prefix_cache`` (bound by the caller to the weights of ``model``): prompts are prefilled after
    their longest cached prefix, and every prompt and every finished row is stored there.

    ``cuda_graphs``: decoding steps replayed from CUDA graphs (graph_decode.py). Default: on CUDA
    where the lean step applies, unless ``$GRPO_CUDA_GRAPHS=0``. True on a CPU runs the graphs'
    static shapes without capturing (for tests).
    """
    compact = compact or ("half" if device.type == "cuda" else "eager")
    if compact not in ("eager", "half"):
        raise ValueError(f"compact must be 'eager' or 'half', got {compact!r}")
    for req in requests:
        req.sequences = []
    scored = [req for req in requests if req.include_prompt_logprobs or req.num_samples == 0]
    # a one-token sample asking for its prompt's logprobs (the Tinker SDK's compute_logprobs over
    # HTTP is one) draws from the logits of the same pass: its prompt is not prefilled again
    answered = [k for k, req in enumerate(scored) if req.num_samples > 0 and _max_tokens(req, max_context) == 1]
    if scored:  # every request's prompt logprobs in shared decoder calls
        # (imported here: it imports the trainer, which imports this module)
        from grpo.backends.local.prompt_logprobs import score_prompts

        with section("grpo.sample.prompt_logprobs"):
            logprobs, next_logits = score_prompts(model, [req.prompt for req in scored], device,
                                                  [req.prompt_logprobs_last_n for req in scored], follow=answered)
            for req, values in zip(scored, logprobs, strict=True):
                req.prompt_logprobs = values
    stats = GenerationStats()
    if answered:
        with section("grpo.sample.choose_tokens"):
            _sample_one_token([scored[k] for k in answered], [next_logits[k] for k in answered],
                              max_context, tokenizer, device, stats)
        done = {id(scored[k]) for k in answered}
        requests = [req for req in requests if id(req) not in done]
    requests = [req for req in requests if req.num_samples > 0]
    if not requests:
        return stats
    if not attention_only(model.config):  # (linear-attention or state-space layers: recurrent_sampler.py)
        from grpo.backends.local import recurrent_sampler

        done = recurrent_sampler.generate_lockstep(model, requests, tokenizer, device, max_context, row_bytes, budget,
                                                   prefix_cache)
        done.prompt_tokens += stats.prompt_tokens  # (of the one-token samples answered above)
        return done
    limit = batch_rows(requests, row_bytes, budget, max_context)
    slots = max(limit, max(req.num_samples for req in requests))  # an over-budget request, alone
    cache = SlotCache(model.config, slots, row_capacity(requests, max_context), device)
    pending = deque(requests)
    rows: list[_Row] = []
    batch: list[_Row] = []  # rows in slot order
    logits = None  # next-token logits of the batch's rows
    before = prefix_cache.stats.snapshot() if prefix_cache is not None else None
    lean = lean_decoder(model, cache.step.capacity)  # the decoding step without transformers' wrappers, where it applies
    graphed = None
    if lean is not None and (graph_decode.enabled(device) if cuda_graphs is None else cuda_graphs):
        graphed = graph_decode.StaticDecodeStep(lean, cache, _pad_id(tokenizer), capture=device.type == "cuda")
    elif device.type == "cuda":
        # without graphs the GPU runs the model's own forward, as before graphs: the lean step
        # eager measured no faster there (1.77 against 1.59 s a sampling call on an H100)
        lean = None
    elif lean is not None:  # on a CPU, the step's non-matmul work in native kernels where built (native_decode.py)
        lean = native_decode.native_decoder(lean, device)
    else:  # (Gemma 3's layers: gemma_decode.py; any other family's, None: the model's own forward)
        lean = gemma_decode.gemma_decoder(model, device)
    ops = native_kernels.kernels() if device.type == "cpu" else None  # (token choice's, looked up once)

    while True:
        admitted = _admissions(pending, limit - len(batch), nothing_running=not batch)
        if admitted:
            with section("grpo.sample.prefill"):
                new_rows, new_logits = _admit(model, admitted, cache, len(batch), len(rows), max_context, tokenizer,
                                              device, prefix_cache, stats)
            rows += new_rows
            batch += new_rows
            logits = new_logits if logits is None else torch.cat([logits, new_logits])
            stats.admissions += 1
            stats.peak_rows = max(stats.peak_rows, len(batch))
        if not batch:
            break
        live = [b for b, row in enumerate(batch) if not row.done]
        live_logits = logits if len(live) == len(batch) else logits[torch.tensor(live, device=device)]
        with section("grpo.sample.choose_tokens"):
            chosen, logprobs = _choose_tokens(live_logits, [batch[b] for b in live], device, ops=ops)
        # One device-to-host copy per step, not two per row (each a sync on a GPU).
        for token, logprob, b in zip(chosen.tolist(), logprobs.tolist(), live, strict=True):
            record_token(batch[b], token, logprob, tokenizer)
        if prefix_cache is not None:  # before their slots are reused
            _store_finished(prefix_cache, cache, batch, live)
        still = [b for b in live if not batch[b].done]
        if len(live) == len(batch):
            tokens = chosen
        else:
            tokens = torch.full((len(batch),), _pad_id(tokenizer), dtype=torch.long, device=device)
            tokens[torch.tensor(live, device=device)] = chosen  # finished rows ride along on padding
        finished = len(batch) - len(still)
        room_for_next = bool(pending) and limit - len(still) >= pending[0].num_samples
        if finished and (compact == "eager" or 2 * finished >= len(batch) or room_for_next or not still):
            order = cache.keep(still)
            keep = torch.tensor(order, dtype=torch.long, device=device)
            batch, logits, tokens = [batch[b] for b in order], logits[keep], tokens[keep]
        if not still:
            logits = None
            continue  # admit what is pending, or end
        if graphed is None:  # (the native step reads no mask: its attention takes each row's length)
            positions, mask = cache.set_step(mask=getattr(lean, "reads_mask", True))
        with section("grpo.sample.decode_forward"):
            if graphed is not None:  # its own positions and mask, at its static shapes
                logits = graphed(tokens, cache.lengths)
            elif lean is not None:
                logits = lean(tokens[:, None], mask, positions, cache)
            else:  # (its attention layers through grpo's kernel on a CPU: cached_attention.py)
                with cached_attention.routed() if device.type == "cpu" else contextlib.nullcontext():
                    logits = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=positions,
                                   cache=cache, use_cache=True).logits[:, -1].float()
        # a finished row riding along keeps its length: its slot never outgrows the capacity
        cache.lengths = [n + (not row.done) for n, row in zip(cache.lengths, batch, strict=True)]
        stats.decode_steps += 1
        stats.rows_decoded += len(batch)

    for row in rows:
        row.request.sequences.append(SampledSequence(tokens=row.tokens, logprobs=row.logprobs, stop_reason=row.stop_reason))
    if prefix_cache is not None:
        done = prefix_cache.stats.since(before)
        stats.prefix_hits, stats.prefix_hit_tokens, stats.prefix_evictions = done.hits, done.hit_tokens, done.evictions
    return stats


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def _admissions(pending: deque, free: int, nothing_running: bool) -> list[GenerationRequest]:
    """The next requests, in order, whose rows fit in ``free`` slots; a request larger than the
    whole batch is admitted alone once nothing else runs."""
    admitted: list[GenerationRequest] = []
    while pending and (pending[0].num_samples <= free or (nothing_running and not admitted)):
        free -= pending[0].num_samples
        admitted.append(pending.popleft())
    return admitted


def _admit(model, requests: list[GenerationRequest], cache: SlotCache, first_slot: int, first_index: int,
           max_context: int | None, tokenizer, device: torch.device, prefix_cache: PrefixCache | None,
           stats: GenerationStats) -> tuple[list[_Row], torch.Tensor]:
    """Prefill each request's prompt, write its KV cache into the slots of its rows from
    ``first_slot`` on; the new rows and their next-token logits.

    Prompts with a prefix in ``prefix_cache`` are prefilled together after their prefixes (the
    next turns of multi-turn episodes); the others together from scratch, left-padded. Each
    distinct prompt runs once (the requests of one group, or episodes that start alike, share
    it), and every prompt is stored in the prefix cache."""
    # each request's prompt keys and values: (a batch cache, its row, first column, end column)
    sources: list[tuple[DynamicCache, int, int, int | None]] = [None] * len(requests)  # type: ignore[list-item]
    next_logits: list[torch.Tensor] = [None] * len(requests)  # type: ignore[list-item]
    fresh: dict[tuple[int, ...], list[int]] = {}  # prompts with nothing cached -> their requests
    hits: dict[tuple[int, ...], tuple[int, list, list[int]]] = {}  # prompt -> cached length, its kv, requests
    for i, req in enumerate(requests):
        stats.prompt_tokens += len(req.prompt)
        prompt = tuple(req.prompt)
        hit = prefix_cache.lookup(req.prompt) if prefix_cache is not None else None
        if hit is None:
            fresh.setdefault(prompt, []).append(i)
        elif prompt in hits:  # the same prompt again: the same prefix, computed once
            hits[prompt][2].append(i)
        else:
            hits[prompt] = (*hit, [i])
    if hits:
        prompts = [list(p) for p in hits]
        past, last_logits, columns = _prefill_after_together(model, prompts, [h[:2] for h in hits.values()],
                                                              _pad_id(tokenizer), device)
        for j, (p, (known, _, owners)) in enumerate(hits.items()):
            start, end = columns[j]
            stats.prefilled_tokens += len(p) - known
            for i in owners:
                sources[i], next_logits[i] = (past, j, start, end), last_logits[j]
            prefix_cache.store(p, _row_copy(past, j, start, end))
    if fresh:
        prompts = [list(p) for p in fresh]
        prefill, last_logits, stats_tokens = _prefill_together(model, prompts, _pad_id(tokenizer), device)
        stats.prefilled_tokens += stats_tokens
        width = prefill.layers[0].keys.shape[-2]
        for j, p in enumerate(fresh):
            start = width - len(p)
            for i in fresh[p]:
                sources[i], next_logits[i] = (prefill, j, start, None), last_logits[j]
            if prefix_cache is not None:
                prefix_cache.store(p, _row_copy(prefill, j, start, None))

    rows: list[_Row] = []
    owner: list[int] = []
    # requests written from one source hold copies of the same keys and values (``sources`` keeps
    # every prompt cache alive here, so no two of them share an id)
    copies: dict[tuple, int] = {}
    for i, req in enumerate(requests):
        prompt_cache, source_row, start, end = sources[i]
        copy_of = copies.setdefault((id(prompt_cache), source_row, start, end), cache.new_copy())
        cache.write_prompt(first_slot + len(rows), req.num_samples, prompt_cache, source_row, start, end,
                           copy_of=copy_of)
        rows += request_rows(req, first_index + len(rows), max_context, device)
        owner += [i] * req.num_samples
    return rows, torch.stack([next_logits[i] for i in owner])


def _sample_one_token(requests: list[GenerationRequest], next_logits: list[torch.Tensor], max_context: int | None,
                      tokenizer, device: torch.device, stats: GenerationStats) -> None:
    """Each request's samples of one token, drawn from its prompt's next-token logits as a
    prefill's would be (its rows numbered and seeded alike); nothing enters the prefix cache."""
    rows: list[_Row] = []
    for req in requests:
        stats.prompt_tokens += len(req.prompt)
        rows += request_rows(req, len(rows), max_context, device)
    owner = [k for k, req in enumerate(requests) for _ in range(req.num_samples)]
    chosen, logprobs = _choose_tokens(torch.stack([next_logits[k] for k in owner]), rows, device)
    for row, token, logprob in zip(rows, chosen.tolist(), logprobs.tolist(), strict=True):
        record_token(row, token, logprob, tokenizer)
        row.request.sequences.append(SampledSequence(tokens=row.tokens, logprobs=row.logprobs,
                                                     stop_reason=row.stop_reason))


def request_rows(req: GenerationRequest, first_index: int, max_context: int | None, device: torch.device) -> list[_Row]:
    """A request's rows, numbered from ``first_index`` in the order they draw; a seeded request's
    rows share one generator, so that they draw in their own order wherever they sit."""
    stop_strings, stop_ids = req.params.stop_strings_and_ids()
    generator = None
    if req.params.seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(int(req.params.seed))
    return [_Row(first_index + i, req, _max_tokens(req, max_context), frozenset(stop_ids), stop_strings, generator)
            for i in range(req.num_samples)]


def record_token(row: _Row, token: int, logprob: float, tokenizer) -> None:
    """A row's chosen token and its logprob; the row is done where it stops or reaches its length."""
    row.tokens.append(token)
    row.logprobs.append(logprob)
    if token in row.stop_ids or _hits_stop_string(row, tokenizer):
        row.stop_reason, row.done = "stop", True
    elif len(row.tokens) >= row.max_tokens:
        row.stop_reason, row.done = "length", True


def _row_copy(cache: DynamicCache, row: int, start: int, end: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Row ``row``'s columns ``start`` to ``end`` of a batch prefill cache, per layer, copied (for
    the prefix cache, which must not keep the batch's padded tensors alive)."""
    return [(layer.keys[row:row + 1, :, start:end].clone(), layer.values[row:row + 1, :, start:end].clone())
            for layer in cache.layers]


def _prefill_together(model, prompts: list[list[int]], pad_id: int, device: torch.device
                      ) -> tuple[DynamicCache, torch.Tensor, int]:
    """Prefill distinct prompts in one batch: a cache whose row j holds prompt j left-padded (from
    column ``width - len(prompt)`` on), each prompt's next-token logits, and the tokens run.

    Prompts that begin alike (``common_trunk``: a chat template's system prompt, a few-shot
    preamble) run that trunk once and the rest of each prompt after it; the cache is then laid
    out as if each prompt had been run whole. Only the last position's logits are computed: the
    unembedding over every prompt position would cost a quarter of the prefill on a small model
    with a large vocabulary."""
    trunk = common_trunk(prompts) if attention_layers(model.config)[1] is None else 0
    width = max(len(p) for p in prompts) - trunk
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    attention = torch.zeros((len(prompts), trunk + width), dtype=torch.long, device=device)
    attention[:, :trunk] = 1
    for j, p in enumerate(prompts):
        input_ids[j, trunk + width - len(p):] = torch.tensor(p[trunk:], device=device)
        attention[j, 2 * trunk + width - len(p):] = 1
    cache = DynamicCache()
    if trunk:
        model.get_decoder()(input_ids=torch.tensor([prompts[0][:trunk]], device=device), cache=cache, use_cache=True)
        for layer in cache.layers:  # every prompt continues the one trunk
            layer.keys = layer.keys.expand(len(prompts), *layer.keys.shape[1:])
            layer.values = layer.values.expand(len(prompts), *layer.values.shape[1:])
    out = model(input_ids=input_ids, attention_mask=attention, position_ids=position_ids(attention)[:, trunk:],
                cache=cache, use_cache=True, logits_to_keep=1)
    if trunk:  # [trunk, padding, rest] -> [padding, trunk, rest]: each row as if prefilled whole
        for layer in cache.layers:
            layer.keys, layer.values = _trunk_after_padding(layer.keys, prompts, trunk), \
                _trunk_after_padding(layer.values, prompts, trunk)
    return cache, out.logits[:, -1].float(), trunk + sum(len(p) - trunk for p in prompts)


def _trunk_after_padding(t: torch.Tensor, prompts: list[list[int]], trunk: int) -> torch.Tensor:
    width = t.shape[-2]
    out = t.new_zeros(t.shape)
    for j, p in enumerate(prompts):
        start = width - len(p)
        out[j, :, start:start + trunk] = t[j, :, :trunk]  # the trunk moves after the padding
        out[j, :, start + trunk:] = t[j, :, start + trunk:]  # the prompt's own part stays where it is
    return out


def _prefill_after_together(model, prompts: list[list[int]], hits: list[tuple[int, list]], pad_id: int,
                            device: torch.device) -> tuple[DynamicCache, torch.Tensor, list[tuple[int, int]]]:
    """Prefill each prompt's tokens after its cached prefix, all prompts in one batch.

    ``hits[j]`` is prompt j's cached length and its per-layer ``[1, heads, known, dim]`` keys and
    values. Row j of the batch holds its cached prefix left-padded up to the longest one, then its
    new tokens, right-padded up to the most new tokens: a turn of many multi-turn episodes is one
    forward over its new tokens rather than one forward per episode (each a whole pass through the
    model at a few rows). Padding is masked; a right pad is never attended to by a real position
    (it is later in the sequence). Returns the batch cache, each prompt's next-token logits, and
    each prompt's ``(first, end)`` columns in the cache."""
    known = [k for k, _ in hits]
    new = [len(p) - k for p, k in zip(prompts, known, strict=True)]
    past_width, width = max(known), max(new)
    rows = len(prompts)
    past = DynamicCache()
    for layer in range(len(hits[0][1])):
        past.update(*left_padded([kv[layer] for _, kv in hits], past_width), layer)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long, device=device)
    attention = torch.zeros((rows, past_width + width), dtype=torch.long, device=device)
    positions = torch.empty((rows, width), dtype=torch.long, device=device)
    for j, (p, k, n) in enumerate(zip(prompts, known, new, strict=True)):
        input_ids[j, :n] = torch.tensor(p[k:], device=device)
        attention[j, past_width - k:past_width + n] = 1
        # a right pad repeats the last real position: never past the prompt's own length
        positions[j] = torch.arange(k, k + width, device=device).clamp_(max=len(p) - 1)
    last = sorted(set(n - 1 for n in new))  # the positions whose logits are wanted, once each
    out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, cache=past, use_cache=True,
                logits_to_keep=torch.tensor(last, device=device))
    logits = out.logits[torch.arange(rows, device=device), torch.tensor([last.index(n - 1) for n in new], device=device)]
    columns = [(past_width - k, past_width + n) for k, n in zip(known, new, strict=True)]
    return past, logits.float(), columns


def _store_finished(prefix_cache: PrefixCache, cache: SlotCache, batch: list[_Row], live: list[int]) -> None:
    """Store the rows of ``live`` that have just finished: their slot holds the keys and values
    of the prompt and every sampled token but the last (which was never fed back), which is
    where the next turn of a multi-turn episode starts."""
    for b in live:
        row = batch[b]
        if row.done:
            known = row.request.prompt + row.tokens[:-1]
            prefix_cache.store(known, cache.read_row(b, cache.lengths[b]))


def _max_tokens(req: GenerationRequest, max_context: int | None) -> int:
    return req.params.max_tokens or (max_context - len(req.prompt) if max_context else 256)


_LOOK_UP = object()  # (_choose_tokens' ops: not looked up by the caller)


def _choose_tokens(logits: torch.Tensor, rows: list[_Row], device: torch.device,
                   ops=_LOOK_UP) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; return it with its logprob under the untempered policy. ``ops``: the
    native kernels (None: none) as the caller looked them up -- generate does, once a call -- else
    looked up here."""
    # Rows sharing sampling settings are drawn together; a row with its own seed draws from its
    # own generator so that a seeded request reproduces whatever else is in the batch.
    # Members of a group are taken in row order, not batch order: a seeded request's rows then
    # draw the same numbers wherever continuous batching has put them.
    groups: dict[tuple, list[int]] = {}
    for b, row in sorted(enumerate(rows), key=lambda item: item[1].index):
        p = row.request.params
        groups.setdefault((p.temperature, p.top_k, p.top_p, id(row.generator)), []).append(b)
    if ops is _LOOK_UP:
        ops = native_kernels.kernels() if device.type == "cpu" else None
    if logits.dtype not in (torch.float32, torch.bfloat16):
        ops = None
    if ops is not None and not any(_filters(top_k, top_p, logits.shape[-1]) for _, top_k, top_p, _ in groups):
        # one native pass per row (grpo/models/native/sample_tokens.cpp): the same draw as below -- the same uniforms
        # from the same generators, the same inverted CDF -- in about a quarter of its time on a CPU
        temperatures, uniforms = _draw_inputs(groups, rows)
        return tuple(ops.sample_tokens(logits if logits.stride(-1) == 1 else logits.contiguous(), temperatures,
                                       uniforms))
    logits = logits.float()  # (a native decoder's are bf16 for a bf16 model: widened, as the kernel reads them)
    logprobs_all = torch.log_softmax(logits, dim=-1)
    chosen = torch.empty(len(rows), dtype=torch.long, device=device)
    for (temperature, top_k, top_p, _), members in groups.items():
        idx = torch.tensor(members, device=device)
        in_place = members == list(range(len(rows)))  # as a rule, one group in batch order: no copy
        mine = logits if in_place else logits[idx]
        if temperature == 0:
            chosen[idx] = mine.argmax(-1)
            continue
        scores = mine if temperature == 1 else mine / temperature
        scores = _filter_top_k_top_p(scores, top_k, top_p)
        chosen[idx] = _draw(torch.softmax(scores, dim=-1), rows[members[0]].generator)
    return chosen, logprobs_all.gather(-1, chosen[:, None])[:, 0]


def _draw_inputs(groups: dict[tuple, list[int]], rows: list[_Row]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's temperature and uniform draw for ``sample_tokens`` (float64): a group's uniforms
    drawn together from its generator, in its rows' order; a greedy group's none. A draw per group,
    then two or three calls for the whole batch, where an index assignment per group (two) made a
    GRPO batch of 8 seeded requests ~26 operator calls a step: on a CPU every call of a decoding
    step runs after the step's weight stream has evicted the interpreter from the caches (~10x its
    warm cost), and one group's five calls were ~0.2 ms of a one-row bf16 step of ~12 ms."""
    n = len(rows)
    temperatures = [0.0] * n
    draws, order = [], []
    for (temperature, _, _, _), members in groups.items():
        if temperature != 0:
            for b in members:
                temperatures[b] = float(temperature)
            draws.append(torch.rand(len(members), dtype=torch.float64, generator=rows[members[0]].generator))
            order += members
    if order == list(range(n)):  # (the usual batch: every row drawn, in batch order)
        uniforms = draws[0] if len(draws) == 1 else torch.cat(draws)
    else:  # greedy rows keep 0; continuous batching moved rows: each draw to its row's place
        uniforms = torch.zeros(n, dtype=torch.float64)
        if draws:
            uniforms.index_copy_(0, torch.tensor(order), torch.cat(draws))
    return torch.tensor(temperatures, dtype=torch.float64), uniforms


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


def _filters(top_k: int | None, top_p: float, vocab: int) -> bool:
    """Whether top-k or top-p cuts anything from a vocabulary of ``vocab`` tokens."""
    return (top_k is not None and 0 < top_k < vocab) or top_p < 1.0


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
