"""Rewards for open-ended chat: a pairwise judge language model and a rule-based scorer.

The judge reads, for two responses A and B to one instruction, the probability that A is better
from its next-token logits for " A" and " B" after "Better response:", and asks both orders so
that its (large, for a 135M model) position bias cancels:

    P(i > j) = ½ · [ P_A(i shown first) + 1 − P_A(j shown first) ]      so P(i > j) + P(j > i) = 1.

A response's reward is its win rate: the mean of P(i > j) over the other responses of its group.

How the comparison prompt was chosen (SmolLM2-135M-Instruct as judge in fp32, the 28 reference
answers of ``chat_prompts.REFERENCE_ANSWERS`` against six kinds of bad answer from
``chat_prompts.calibration_pairs``, 168 pairs, both orders; ``python -m adapters.judge``):

    prompt format                                    symmetrised accuracy
    chat template, "Reply with A or B.", read " A"/" B"      0.35
    chat template + judge system prompt, read at "Response"  0.73
    plain text, no worked examples                           0.54
    plain text, 4 worked examples                            0.78
    plain text, 6 worked examples (this module)              0.815
        by kind: empty 0.96, repetitive phrase 1.00, one word repeated 1.00, truncated 0.86,
        another prompt's answer 0.39, a fluent off-topic sentence 0.68
        one order only: good shown first 0.24, good shown second 0.99 (position bias -0.13);
        mean |P(good > bad) - 0.5| = 0.055

The chat-template framings do worse than chance: the raw model answers " A" with p ~ 0.9 whatever
it is shown. Worked examples (each label used equally often) fix most of that, and asking both
orders cancels what bias is left (one order alone would be right 24 % or 99 % of the time).
Relevance is beyond this judge (an answer to another question is preferred about as often as
not), so ``scorer=judge+rules`` mixes in the rule-based score below, whose prompt-overlap check
catches it (the rules alone rank the same 168 pairs right 98 % of the time: 93 % on both off-topic
kinds, 100 % on the rest). In bf16 the judge drops to 0.76: its margins are that small.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from grpo.models import computing

EMPTY_MARK = "(empty response)"
QUESTION = "Better response:"

# (instruction, response A, response B, better) — the judge's worked examples. Labels alternate so
# the examples themselves carry no position preference; each shows one failure a judge must catch.
JUDGE_EXAMPLES: tuple[tuple[str, str, str, str], ...] = (
    ("What color is grass?", "Grass is green.", "", "A"),
    ("Name two pets.", "pets pets pets pets pets pets pets pets", "Two common pets are dogs and cats.", "B"),
    ("What is the capital of Italy?", "My favourite food is pizza with cheese.", "The capital of Italy is Rome.", "B"),
    ("How many hours are in a day?", "A day has 24 hours.", "A day", "A"),
    ("Name a fruit.", "An apple is a fruit.", "The train leaves at noon from platform two.", "A"),
    ("Say hello in French.", "", "Hello in French is bonjour.", "B"),
)


def _one_line(text: str) -> str:
    """Whitespace collapsed, so a response cannot break the judge's line-based layout."""
    return " ".join(text.split())


def _shown(response: str) -> str:
    return _one_line(response) or EMPTY_MARK


@dataclass(frozen=True)
class PairJudgement:
    """One comparison of responses i and j, both orders.

    ``p_first``: the judge's P(A) with i shown as A. ``p_second``: its P(A) with j shown as A (so
    i is B). A judge without position bias would have p_second = 1 - p_first.
    """

    p_first: float
    p_second: float

    @property
    def p_i_over_j(self) -> float:
        return 0.5 * (self.p_first + 1.0 - self.p_second)

    @property
    def position_bias(self) -> float:
        """How much the judge prefers whatever is shown first: 0 for an unbiased judge."""
        return 0.5 * (self.p_first + self.p_second) - 0.5


class JudgeError(ValueError):
    pass


class PairwiseJudge:
    """A frozen causal LM that compares two responses to an instruction.

    ``model`` is anything ``grpo.models.load_model`` takes (``smollm2``, ``tiny``, a local
    directory, a hub id). The model loads on first use and is never trained: gradients are off,
    it stays in eval mode, and it is a separate module from the policy's LoRA model.
    """

    def __init__(self, model: str = "smollm2", *, device: str | None = None, dtype: str | None = "float32",
                 max_response_tokens: int = 96,
                 batch_size: int = 32, examples: Sequence[tuple[str, str, str, str]] = JUDGE_EXAMPLES):
        if not isinstance(model, str) or not model.strip():
            raise JudgeError(f"judge_model must be a model name (smollm2, tiny, a local dir, a hub id), got {model!r}")
        if max_response_tokens < 1 or batch_size < 1:
            raise JudgeError(f"judge max_response_tokens and batch_size must be >= 1, got "
                             f"{max_response_tokens} and {batch_size}")
        for ex in examples:
            if len(ex) != 4 or ex[3] not in ("A", "B"):
                raise JudgeError(f"a judge example is (instruction, response A, response B, 'A' or 'B'), got {ex!r}")
        self.model_name = model
        self.device = device
        self.dtype = dtype
        self.max_response_tokens = int(max_response_tokens)
        self.batch_size = int(batch_size)
        self.examples = tuple(tuple(ex) for ex in examples)
        self._model: Any = None
        self._tokenizer: Any = None
        self._prefix_cache: Any = None
        # False: full-vocabulary logits at every position, as before (kept to measure against).
        self.read_only_needed_positions = True

    # ------------------------------------------------------------------ prompt

    def prefix(self) -> str:
        """The worked examples every comparison starts with (identical, so its KV cache is shared)."""
        return "".join(f"Instruction: {_one_line(p)}\nResponse A: {_shown(a)}\nResponse B: {_shown(b)}\n"
                       f"{QUESTION} {label}\n\n" for p, a, b, label in self.examples)

    def query(self, instruction: str, a: str, b: str) -> str:
        """The part of a comparison after the examples; the judge's next token answers it."""
        return (f"Instruction: {_one_line(instruction)}\nResponse A: {_shown(self._clip(a))}\n"
                f"Response B: {_shown(self._clip(b))}\n{QUESTION}")

    def render(self, instruction: str, a: str, b: str) -> str:
        """The full text the judge reads for one comparison."""
        return self.prefix() + self.query(instruction, a, b)

    def _clip(self, response: str) -> str:
        # Long responses are cut to the judge's budget; what fits is what it judges.
        tok = self.tokenizer
        ids = tok.encode(response, add_special_tokens=False)
        return response if len(ids) <= self.max_response_tokens else tok.decode(ids[: self.max_response_tokens])

    # ------------------------------------------------------------------ model

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from grpo.models import load_tokenizer

            self._tokenizer = load_tokenizer(self.model_name)
        return self._tokenizer

    @property
    def model(self) -> Any:
        if self._model is None:
            from grpo.models import load_model

            # loaded, like every use of it, on the process's computing thread, with the policy's
            # engines (grpo/models/computing.py: PyTorch's work on a second thread would
            # leave a small machine's cores idle)
            model = computing.run(load_model, self.model_name, device=self.device, dtype=self.dtype)
            model.requires_grad_(False)
            model.eval()
            self._model = model
            self._answer_ids = (self._single_token(" A"), self._single_token(" B"))
        return self._model

    def _single_token(self, text: str) -> int:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise JudgeError(f"judge model {self.model_name!r}: {text!r} is {len(ids)} tokens in its tokenizer; "
                             "the judge reads one token per answer, so use a model whose tokenizer has ' A' and ' B'")
        return ids[0]

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def _prefix_kv(self) -> tuple[Any, int]:
        if self._prefix_cache is None:
            ids = self.tokenizer.encode(self.prefix(), add_special_tokens=False)
            if ids:
                # Only its KV cache is wanted: the decoder alone, no logits, where the head allows.
                runner = self.model.get_decoder() if self._plain_head() else self.model
                out = runner(input_ids=torch.tensor([ids], device=self._device()), use_cache=True)
                self._prefix_cache = (out.cache, len(ids))
            else:
                self._prefix_cache = (None, 0)
        return self._prefix_cache

    def prob_a(self, instructions: Sequence[str], firsts: Sequence[str], seconds: Sequence[str]) -> list[float]:
        """P(A better than B) for each comparison, softmax over the " A" and " B" logits.

        The worked examples are run once and their KV cache shared by every comparison; the
        comparisons themselves go through in batches of ``batch_size``, right-padded, each read
        at its own last token (padding after a token never reaches it under causal attention).
        Computed on the process's computing thread (see ``model``).
        """
        return computing.run(self._prob_a, instructions, firsts, seconds)

    @torch.no_grad()
    def _prob_a(self, instructions: Sequence[str], firsts: Sequence[str], seconds: Sequence[str]) -> list[float]:
        _ = self.model  # loads the model and sets the answer ids
        a_id, b_id = self._answer_ids
        queries = [self.tokenizer.encode(self.query(p, a, b), add_special_tokens=False)
                   for p, a, b in zip(instructions, firsts, seconds, strict=True)]
        past, offset = self._prefix_kv()
        device = self._device()
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        probs: list[float] = []
        for start in range(0, len(queries), self.batch_size):
            chunk = queries[start:start + self.batch_size]
            width = max(len(q) for q in chunk)
            input_ids = torch.tensor([q + [pad] * (width - len(q)) for q in chunk], device=device)
            positions = torch.arange(offset, offset + width, device=device).expand(len(chunk), -1)
            kwargs: dict[str, Any] = {"input_ids": input_ids, "position_ids": positions}
            if past is not None:
                cache = copy.deepcopy(past)  # the forward appends to it; the shared prefix stays intact
                cache.batch_repeat_interleave(len(chunk))
                kwargs["cache"] = cache
                kwargs["use_cache"] = True
            last = torch.tensor([len(q) - 1 for q in chunk], device=device)
            pair = self._logits_at(kwargs, last)[:, [a_id, b_id]].float()
            probs.extend(torch.softmax(pair, dim=-1)[:, 0].tolist())
        return probs

    def _logits_at(self, inputs: dict[str, Any], last: torch.Tensor) -> torch.Tensor:
        """Next-token logits at position ``last[r]`` of each row r: [rows, vocab].

        Only one position per row is read, so only those rows of hidden state go through the
        unembedding: the full [rows, width, vocab] logits (0.9 GB in fp32 for 32 comparisons of
        150 tokens with SmolLM2's 49k vocabulary) are never made. Heads that transform logits
        after the unembedding (soft-capping, a logit scale) take the full forward instead.
        """
        rows = torch.arange(len(last), device=last.device)
        if self._plain_head():
            hidden = self.model.get_decoder()(**inputs).last_hidden_state
            return self.model.get_output_embeddings()(hidden[rows, last])
        return self.model(**inputs).logits[rows, last]

    def _plain_head(self) -> bool:
        config = self.model.config
        transformed = any(getattr(config, k, None) not in (None, 1.0)
                          for k in ("final_logit_softcapping", "logit_scale", "logits_scaling"))
        return (not transformed and self.read_only_needed_positions and hasattr(self.model, "get_decoder")
                and self.model.get_output_embeddings() is not None)

    # ------------------------------------------------------------------ comparisons

    def compare(self, instruction: str, a: str, b: str) -> PairJudgement:
        p_first, p_second = self.prob_a([instruction, instruction], [a, b], [b, a])
        return PairJudgement(p_first, p_second)

    def p_better(self, instructions: Sequence[str], responses: Sequence[str], others: Sequence[str]) -> list[float]:
        """Symmetrised P(``responses[k]`` better than ``others[k]``) for each k, both orders asked
        in one batched pass."""
        n = len(responses)
        probs = self.prob_a(list(instructions) * 2, list(responses) + list(others), list(others) + list(responses))
        return [PairJudgement(probs[k], probs[n + k]).p_i_over_j for k in range(n)]

    def judge_group(self, instruction: str, responses: Sequence[str]) -> dict[tuple[int, int], PairJudgement]:
        """Every pair i < j of a group, both orders, in one batched pass (a group of 4: 12 prompts)."""
        pairs = [(i, j) for i in range(len(responses)) for j in range(i + 1, len(responses))]
        firsts = [responses[i] for i, j in pairs] + [responses[j] for i, j in pairs]
        seconds = [responses[j] for i, j in pairs] + [responses[i] for i, j in pairs]
        probs = self.prob_a([instruction] * len(firsts), firsts, seconds)
        n = len(pairs)
        return {pair: PairJudgement(probs[k], probs[n + k]) for k, pair in enumerate(pairs)}

    def win_rates(self, instruction: str, responses: Sequence[str]) -> list[float]:
        """Each response's mean probability of beating the others in its group."""
        if len(responses) < 2:
            raise JudgeError(f"a pairwise judge needs at least 2 responses to compare, got {len(responses)}")
        judged = self.judge_group(instruction, responses)
        wins = [0.0] * len(responses)
        for (i, j), result in judged.items():
            wins[i] += result.p_i_over_j
            wins[j] += 1.0 - result.p_i_over_j
        return [w / (len(responses) - 1) for w in wins]


# --------------------------------------------------------------------------- rule-based scorer

_WORD = re.compile(r"[a-z0-9']+")
_STOPWORDS = frozenset(
    "a an and are as at be but by can do does for from give how i if in into is it its me my name of on or "
    "one our so that the their them then there these this three to two was what when where which who why "
    "will with word words write you your sentence sentences answer briefly short simple list describe explain "
    "tell make some".split())
RULE_WEIGHTS = {"distinct": 0.4, "relevance": 0.3, "length": 0.15, "ending": 0.15}


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def rule_checks(response: str, instruction: str = "") -> dict[str, float]:
    """Cheap checks in [0, 1], each one a failure a small judge misses or a policy exploits.

    - empty: 1 when the response has no word at all
    - distinct: distinct word trigrams / trigrams (1 for fewer than 3 words): repetition lowers it
    - relevance: content words of the instruction (first 5 letters, stopwords dropped) the
      response shares, 2 or more counting as 1; 1 when the instruction has no content word
    - length: words / 5, capped at 1 (a one-word reply is rarely an answer to an instruction)
    - ending: 1 when the response ends like a finished sentence or list item
    """
    words = _words(response)
    if not words:
        return {"empty": 1.0, "distinct": 0.0, "relevance": 0.0, "length": 0.0, "ending": 0.0}
    trigrams = [tuple(words[k:k + 3]) for k in range(len(words) - 2)]
    distinct = len(set(trigrams)) / len(trigrams) if trigrams else 1.0
    if len(words) >= 4:  # one word over and over has distinct trigrams only in name
        distinct = min(distinct, len(set(words)) / len(words) * 2)
    content = {w[:5] for w in _words(instruction) if w not in _STOPWORDS and len(w) > 2}
    relevance = min(1.0, len(content & {w[:5] for w in words}) / 2) if content else 1.0
    ending = 1.0 if response.rstrip().endswith((".", "!", "?", ")", '"', "'", "”")) else 0.0
    return {"empty": 0.0, "distinct": min(1.0, distinct), "relevance": relevance,
            "length": min(1.0, len(words) / 5), "ending": ending}


def rule_score(response: str, instruction: str = "") -> float:
    """Weighted sum of ``rule_checks`` (weights ``RULE_WEIGHTS``, summing to 1); 0 when empty."""
    checks = rule_checks(response, instruction)
    if checks["empty"]:
        return 0.0
    return sum(RULE_WEIGHTS[k] * checks[k] for k in RULE_WEIGHTS)


# --------------------------------------------------------------------------- measuring a judge


def measure(judge: PairwiseJudge, pairs: Sequence[tuple[str, str, str, str]]) -> dict[str, float]:
    """How often the judge prefers the good answer, on (kind, instruction, good, bad) pairs.

    Returns ``accuracy`` (symmetrised P(good > bad) > 0.5), ``accuracy/<kind>``, the one-order
    numbers ``raw/good_first`` (P_A > 0.5 with the good answer shown as A) and ``raw/good_second``
    (P_A < 0.5 with it shown as B), ``position_bias`` (mean P_A − 0.5 over both orders) and
    ``margin`` (mean |P(good > bad) − 0.5|). All comparisons go through one batched call.
    """
    if not pairs:
        raise ValueError("measure() needs at least one (kind, instruction, good, bad) pair")
    instructions = [p for _, p, _, _ in pairs] * 2
    firsts = [g for _, _, g, _ in pairs] + [b for _, _, _, b in pairs]
    seconds = [b for _, _, _, b in pairs] + [g for _, _, g, _ in pairs]
    probs = judge.prob_a(instructions, firsts, seconds)
    n = len(pairs)
    results = [PairJudgement(probs[k], probs[n + k]) for k in range(n)]
    out = {
        "accuracy": sum(r.p_i_over_j > 0.5 for r in results) / n,
        "raw/good_first": sum(r.p_first > 0.5 for r in results) / n,
        "raw/good_second": sum(r.p_second < 0.5 for r in results) / n,
        "position_bias": sum(r.position_bias for r in results) / n,
        "margin": sum(abs(r.p_i_over_j - 0.5) for r in results) / n,
    }
    for kind in sorted({k for k, *_ in pairs}):
        picked = [r for (k, *_), r in zip(pairs, results, strict=True) if k == kind]
        out[f"accuracy/{kind}"] = sum(r.p_i_over_j > 0.5 for r in picked) / len(picked)
    return out


if __name__ == "__main__":  # python -m adapters.judge [model]: the calibration table for a judge model
    import sys

    from adapters.chat_prompts import calibration_pairs

    found = measure(PairwiseJudge(sys.argv[1] if len(sys.argv) > 1 else "smollm2"), calibration_pairs())
    for key, value in found.items():
        print(f"{key:24s} {value:.3f}")
