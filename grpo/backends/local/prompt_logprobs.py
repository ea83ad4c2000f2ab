"""Prompt logprobs under the sampler's weights: ``compute_logprobs`` and ``sample(include_prompt_logprobs=True)``.

The logprob of each prompt token given those before it (None for the first). The decoder runs
once over several prompts, right-padded to the longest of a batch: in a causal model a position
after a prompt's end cannot reach the prompt's own, so the padding costs its compute and changes
nothing. The unembedding then takes a chunk of positions at a time through the trainer's head
(trainer.gradient_free_logprobs: grpo's native loss head on a CPU), with the family's scaling or
soft-cap (logit_head.py), so no [tokens, vocabulary] tensor is made: the model's own forward made
three (its logits, their float32 copy, log_softmax), 15.3 GB above the loaded model for one 8,192-token
prompt of a Gemma-3-270M-shaped model of 262,144 tokens (docs/benchmark.md). Only the positions asked
for (``last_n``) go through the head.

Requests submitted together (a KL penalty's reference logprobs of a whole batch, the SDK's
``compute_logprobs_async`` under ``asyncio.gather``) arrive here together through the sampler's
batcher (clients.py) and share decoder calls. Prompts that begin alike (a GRPO group's samples:
its prompt, then each its own answer) run that beginning once, as the trainer runs a group's
shared prompt (trainer.run_decoder_shared: the prefix's keys and values fanned out to the rest).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from grpo.backends.local import trainer
from grpo.backends.local.logit_head import logit_head

# Padded positions one decoder call takes (at least one whole prompt): a batch's activations are
# this many positions wide, whatever its prompts' lengths
BATCH_POSITIONS = 8192
# and none of a batch's prompts shorter than its widest by more than this share: 32 prompts of 60-100
# tokens took 1.17 s in four such batches, 1.40 s padded in one (SmolLM2, bf16 sampler, AMD EPYC Zen 5)
MAX_PADDING = 0.125


def prompt_logprobs(model, prompts: Sequence[Sequence[int]], device: torch.device,
                    last_n: Sequence[int | None] | None = None) -> list[list[float | None]]:
    """Each prompt's logprobs, ``len(prompt)`` entries, the first None; where ``last_n[i]`` is
    given, only the last ``last_n[i]`` are computed and the entries before them are None."""
    return score_prompts(model, prompts, device, last_n)[0]


@torch.inference_mode()
def score_prompts(model, prompts: Sequence[Sequence[int]], device: torch.device,
                  last_n: Sequence[int | None] | None = None, follow: Collection[int] = ()
                  ) -> tuple[list[list[float | None]], dict[int, torch.Tensor]]:
    """``prompt_logprobs``, and for each index in ``follow`` the float32 logits of the token after
    its prompt, from the same pass: a one-token sample that asks for its prompt's logprobs (the
    Tinker SDK's ``compute_logprobs`` over HTTP) draws from these instead of prefilling its prompt
    a second time (sampler.generate)."""
    last_n = list(last_n) if last_n is not None else [None] * len(prompts)
    follow = set(follow)
    out: list[list[float | None]] = [[] for _ in prompts]
    after: dict[int, torch.Tensor] = {}  # index -> the hidden state of its prompt's last position
    decoder, head = model.get_decoder(), logit_head(model)
    short = [i for i, prompt in enumerate(prompts) if len(prompt) < 2 and i not in follow]  # nothing to score
    for i in short:
        out[i] = [None] * len(prompts[i])
    groups = _shared_prefixes(prompts, skip=set(short), follow=follow)
    for units in trainer.shared_micro_batches(groups, BATCH_POSITIONS):
        decoded = trainer.run_decoder_shared(model, units, device)
        values = decoded.logprobs.tolist()
        # (the only positions counted are the last of each prompt in ``follow``, in datum order)
        last_hidden = iter(decoded.hidden)
        start = 0
        for d in (d for unit in units for d in unit.members):
            n = len(prompts[d.index])
            first = _first_scored(n, last_n[d.index])
            out[d.index] = [None] * (first + 1) + values[start + first:start + n - 1]
            if d.index in follow:
                after[d.index] = next(last_hidden)
            start += len(d.input_ids)
    shared = {d.index for group in groups for d in group.members}
    for batch in _batches(prompts, skip=set(short) | shared):
        width = len(prompts[batch[0]])
        ids = torch.zeros(len(batch), width, dtype=torch.long)  # padded with token 0: never read
        for row, i in enumerate(batch):
            ids[row, :len(prompts[i])] = torch.as_tensor(prompts[i], dtype=torch.long)
        ids = ids.to(device)
        hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state
        # the position before each token asked for: tokens first+1 .. n-1 of a prompt of n
        spans = [(row, i, _first_scored(len(prompts[i]), last_n[i])) for row, i in enumerate(batch)]
        rows = torch.cat([hidden[row, first:len(prompts[i]) - 1] for row, i, first in spans])
        targets = torch.cat([ids[row, first + 1:len(prompts[i])] for row, i, first in spans])
        values = trainer.gradient_free_logprobs(head, rows, targets).tolist()
        start = 0
        for row, i, first in spans:
            scored = max(0, len(prompts[i]) - 1 - first)
            out[i] = [None] * (first + 1) + values[start:start + scored]
            start += scored
            if i in follow:
                after[i] = hidden[row, len(prompts[i]) - 1]
    if not after:
        return out, {}
    order = sorted(after)
    logits = head(torch.stack([after[i] for i in order])).float()
    return out, dict(zip(order, logits, strict=True))


def _first_scored(length: int, last_n: int | None) -> int:
    """The first position whose next token is scored: 0, or where the last ``last_n`` tokens begin."""
    return 0 if last_n is None else max(0, length - 1 - last_n)


def _shared_prefixes(prompts: Sequence[Sequence[int]], skip: set[int], follow: set[int]) -> list[trainer.SharedGroup]:
    """Groups of prompts (but ``skip``) that begin with the same ``trainer.MIN_SHARED_PREFIX`` or
    more tokens, each prompt as a datum of nothing counted (but, for a prompt in ``follow``, its
    last position: the decoder then hands back its hidden state). Neighbours in sorted order join
    a group while that saves more positions than it gives up: four answers to one 45-token prompt
    stay a group of 45 shared positions rather than joining the next group's over the 25 of a
    chat template they share with it."""
    order = sorted((i for i in range(len(prompts)) if i not in skip), key=lambda i: list(prompts[i]))
    runs: list[tuple[int, list[int]]] = []  # (shared length, members)
    for i in order:
        width = len(prompts[i]) - 2  # the positions before the prompt's last, which it scores alone
        if runs:
            shared, members = runs[-1]
            common = min(shared, width, _common_length(prompts[members[-1]], prompts[i]))
            if common >= trainer.MIN_SHARED_PREFIX and len(members) * common >= (len(members) - 1) * shared:
                runs[-1] = (common, [*members, i])
                continue
        runs.append((width, [i]))
    return [trainer.SharedGroup(list(prompts[members[0]][:shared]), [_datum(i, prompts[i], i in follow) for i in members])
            for shared, members in runs if len(members) > 1]


def _datum(index: int, prompt: Sequence[int], follow: bool) -> trainer.PreparedDatum:
    """A prompt as the trainer's datum: each position scores the next token; where ``follow``, the
    prompt's last position too (its target a placeholder), the one position counted."""
    if not follow:
        return trainer.PreparedDatum(index, list(prompt[:-1]), list(prompt[1:]), {"weights": torch.zeros(len(prompt) - 1)})
    weights = torch.zeros(len(prompt))
    weights[-1] = 1.0
    return trainer.PreparedDatum(index, list(prompt), [*prompt[1:], 0], {"weights": weights})


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _batches(prompts: Sequence[Sequence[int]], skip: set[int] = frozenset()) -> list[list[int]]:
    """Prompt indices but ``skip`` in batches of like lengths (longest first), each at most
    ``BATCH_POSITIONS`` padded positions wide unless one prompt alone is wider."""
    order = sorted((i for i in range(len(prompts)) if i not in skip), key=lambda i: len(prompts[i]), reverse=True)
    batches: list[list[int]] = []
    for i in order:
        width = len(prompts[batches[-1][0]]) if batches else 0
        if (batches and width * (len(batches[-1]) + 1) <= BATCH_POSITIONS
                and len(prompts[i]) >= width * (1 - MAX_PADDING)):
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches
