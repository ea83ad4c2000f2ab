"""The sampler's prefix cache: the keys and values of token sequences it has already computed.

A multi-turn episode samples turn after turn on a context that only grows: turn k+1's prompt is
turn k's prompt, the tokens turn k sampled and an observation. Prefilling that whole context again
every turn costs the episode's length squared; with this cache a turn costs its new tokens.

Each entry holds, for one token sequence, every layer's keys and values
(``[1, kv_heads, length, head_dim]``, the sampler's dtype). Attention is causal, so the first m
columns of an entry are the keys and values of its first m tokens whatever follows them: a lookup
may use any stored sequence that shares a prefix with the prompt, not only one that is a whole
prefix of it. That matters when a client re-renders the conversation (the tinker-cookbook's
environments do) and the re-rendered turn differs from the sampled one a few tokens in.

A token trie finds the longest shared prefix in O(prompt): every node lists the entries whose
sequence passes through it, so the deepest node the prompt reaches names an entry to read from.
Entries are evicted least recently used first to stay within ``max_bytes``; an entry whose
sequence is a prefix of a newly stored one is dropped at once (the new one covers it), so the
common pattern -- store the prompt, later store prompt + answer -- does not keep two copies.

What a hit saves is recomputed no differently, but what is left of the prompt is: its tokens go
through the model in a smaller product than a whole prefill's, so a sampled logprob can part from
a cold prefill's in the last bit (and a seeded draw that falls on that bit, its token;
tests/test_sampling.py compares waves that find a prompt alike).

A hybrid's linear-attention layers keep no keys and values but a recurrent state, valid only at
the end of the sequence that made it (recurrent_prefix.py). Such an entry (``states``: each of
those layers' conv window and recurrent state at its last token, beside its attention layers' keys
and values) is read only whole, by ``lookup_end``: the longest stored sequence that is a whole
prefix of the prompt. A longer entry does not hold what a shorter one does, so storing one drops
nothing it extends: a finished row's prompt stays for its siblings, and for a next turn whose
client re-rendered the answer (the least recently used still go first).

Keys and values are only valid for the weights that computed them. ``bind(identity)`` names the
sampling weights (adapter, its version or snapshot); a different identity empties the cache, so
nothing computed before an optimizer step is ever read after it.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, kv_heads, length, head_dim]
States = list[tuple[torch.Tensor, torch.Tensor]]  # per linear-attention layer: its state at the end (see above)


def left_padded(parts: Sequence[tuple[torch.Tensor, torch.Tensor] | None], width: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's keys and values of a batch, ``[rows, kv_heads, width, head_dim]``, from each part's
    ``[n, kv_heads, length, head_dim]`` pair in turn (n rows: one cached row, or a running batch's;
    None: one row with nothing cached), each right-aligned in ``width`` columns behind zeros (the
    left padding the rows' mask leaves out)."""
    like_k, like_v = next(pair for pair in parts if pair is not None)
    counts = [1 if pair is None else pair[0].shape[0] for pair in parts]
    keys = like_k.new_zeros((sum(counts), like_k.shape[1], width, like_k.shape[-1]))
    values = like_v.new_zeros((sum(counts), like_v.shape[1], width, like_v.shape[-1]))
    start = 0
    for pair, count in zip(parts, counts, strict=True):
        if pair is not None:
            keys[start:start + count, :, width - pair[0].shape[-2]:] = pair[0]
            values[start:start + count, :, width - pair[1].shape[-2]:] = pair[1]
        start += count
    return keys, values


@dataclass
class PrefixStats:
    """Counters since the cache was made (``snapshot()`` copies them; subtract two for a window).

    ``lookups``/``lookup_tokens``: prompts looked up and their tokens; ``hits``/``hit_tokens``:
    prompts that found a stored prefix and the tokens it covered (not prefilled);
    ``stores``/``evictions``: entries written and dropped for room; ``invalidations``: times the
    sampling weights changed and everything was dropped."""

    lookups: int = 0
    lookup_tokens: int = 0
    hits: int = 0
    hit_tokens: int = 0
    stores: int = 0
    evictions: int = 0
    invalidations: int = 0

    def snapshot(self) -> PrefixStats:
        return PrefixStats(**self.__dict__)

    def since(self, before: PrefixStats) -> PrefixStats:
        return PrefixStats(**{k: v - getattr(before, k) for k, v in self.__dict__.items()})

    @property
    def hit_rate(self) -> float:
        """Share of looked-up prompt tokens that were read from the cache instead of prefilled."""
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0


@dataclass
class _Node:
    children: dict[int, _Node] = field(default_factory=dict)
    entries: dict[int, None] = field(default_factory=dict)  # ids of entries through here (ordered set)
    ends: int | None = None  # the entry whose sequence ends exactly here


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    kv: KV
    nbytes: int
    states: States | None = None  # (an entry read only whole: lookup_end)


class PrefixCache:
    """Keys and values of token prefixes, for one set of sampling weights, within ``max_bytes``."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"prefix cache size must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.identity: Hashable | None = None
        self._keepalive: object = None
        self._root = _Node()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._ids = itertools.count()
        self.stats = PrefixStats()

    def __len__(self) -> int:
        return len(self._entries)

    def bind(self, identity: Hashable, keepalive: object = None) -> None:
        """Say which weights the next lookups and stores are for; other weights' entries are dropped.

        ``keepalive`` is held while bound: an identity built from ``id(snapshot)`` must not be
        reused by a later snapshot that Python allocates at the same address."""
        if identity != self.identity:
            if self._entries:
                self.stats.invalidations += 1
            self.clear()
            self.identity = identity
        self._keepalive = keepalive

    def clear(self) -> None:
        self._root, self._entries, self.bytes = _Node(), OrderedDict(), 0

    # ------------------------------------------------------------------ lookup

    def lookup(self, tokens: Sequence[int]) -> tuple[int, KV] | None:
        """The longest stored prefix of ``tokens`` that leaves at least one token to compute (the
        next-token logits come from that forward), as (length, per-layer keys/values views of
        that length); None when nothing is shared. Entries with end states are not read here."""
        self.stats.lookups += 1
        self.stats.lookup_tokens += len(tokens)
        node, depth = self._root, 0
        for token in itertools.islice(tokens, len(tokens) - 1):
            child = node.children.get(token)
            if child is None:
                break
            node, depth = child, depth + 1
        # the most recently stored entry through here (one cache serves one model: all of one kind)
        entry_id = next((e for e in reversed(node.entries) if self._entries[e].states is None), None)
        if depth == 0 or entry_id is None:
            return None
        entry = self._hit(entry_id, depth)
        return depth, [(k[:, :, :depth], v[:, :, :depth]) for k, v in entry.kv]

    def lookup_end(self, tokens: Sequence[int]) -> tuple[int, KV, States] | None:
        """The longest stored sequence with end states that is a whole prefix of ``tokens`` and
        leaves at least one token to compute, as (its length, its keys/values, its states)."""
        self.stats.lookups += 1
        self.stats.lookup_tokens += len(tokens)
        node, depth, found = self._root, 0, None
        for token in itertools.islice(tokens, len(tokens) - 1):
            node = node.children.get(token)
            if node is None:
                break
            depth += 1
            if node.ends is not None and self._entries[node.ends].states is not None:
                found = (depth, node.ends)
        if found is None:
            return None
        entry = self._hit(found[1], found[0])
        return found[0], entry.kv, entry.states

    def _hit(self, entry_id: int, depth: int) -> _Entry:
        self._entries.move_to_end(entry_id)
        self.stats.hits += 1
        self.stats.hit_tokens += depth
        return self._entries[entry_id]

    # ------------------------------------------------------------------ store

    def store(self, tokens: Sequence[int], kv: KV, states: States | None = None) -> None:
        """Keep ``kv`` (the caller's tensors, not copied: they must not change afterwards) as the
        keys and values of ``tokens`` (and ``states`` as the linear-attention layers' states after
        its last token). Without states, nothing is stored when a stored sequence already starts
        with ``tokens``, and the entries it extends are dropped (its keys hold theirs); with
        states, nothing is stored when one is ``tokens``. Nothing either when one entry alone would
        pass the budget."""
        tokens = tuple(tokens)
        if not tokens or any(k.shape[-2] != len(tokens) for k, _ in kv) or (not kv and states is None):
            covered = kv[0][0].shape[-2] if kv else 0
            raise ValueError(f"keys/values cover {covered} positions, tokens {len(tokens)}")
        nbytes = sum(t.numel() * t.element_size() for pair in (*kv, *(states or [])) for t in pair)
        if nbytes > self.max_bytes:
            return
        node, covered = self._root, []
        for token in tokens:
            node = node.children.get(token)
            if node is None:
                break
            if node.ends is not None:
                covered.append(node.ends)
        else:  # the whole sequence is already in the cache, as (a prefix of) another entry
            if states is None or node.ends is not None:
                self._entries.move_to_end(node.ends if node.ends is not None else next(reversed(node.entries)))
                return
        for entry_id in covered if states is None else ():
            self._remove(entry_id)  # a prefix of the new sequence: the new entry holds all it held
        while self.bytes + nbytes > self.max_bytes:
            self._remove(next(iter(self._entries)))
            self.stats.evictions += 1
        entry_id = next(self._ids)
        node = self._root
        for token in tokens:
            node = node.children.setdefault(token, _Node())
            node.entries[entry_id] = None
        node.ends = entry_id
        self._entries[entry_id] = _Entry(tokens, kv, nbytes, states)
        self.bytes += nbytes
        self.stats.stores += 1

    def _remove(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        self.bytes -= entry.nbytes
        node = self._root
        for token in entry.tokens:
            child = node.children[token]
            del child.entries[entry_id]
            if not child.entries:  # no other entry passes here: drop the rest of the path
                del node.children[token]
                return
            node = child
        if node.ends == entry_id:
            node.ends = None
