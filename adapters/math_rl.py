"""Math word problems and arithmetic with exact, verifier-graded rewards.

Named ``math_rl`` so it never shadows the standard library's ``math``.

Where problems come from (``task``):

* ``addition``: ``a + b`` with ``digits``-digit operands, generated here from ``seed``. The
  default: SmolLM2-135M-Instruct gets 27% of sampled answers to one-digit sums right at T=0.8
  (62% greedy; step 0 of ``make demo``), so most groups are mixed and GRPO has signal from the
  first step.
* ``arithmetic``: reasoning-gym ``basic_arithmetic`` (``terms`` operands of up to ``digits``
  digits, + - * /), generated offline.
* ``gsm8k``: GSM8K-style word problems, from reasoning-gym ``gsm_symbolic`` offline, or from
  ``source`` when given (``openai/gsm8k`` with ``name=main``, or a local jsonl/parquet/csv
  file); answers in GSM8K's "reasoning #### 42" form are reduced to what follows ``####``.
* ``dataset``: any ``source`` with a question and an answer column (names configurable).

The held-out items never appear in training: generated tasks draw one pool of distinct
questions and split it; dataset tasks take ``eval_split``/``eval_source`` or carve the held-out
rows off the training rows, and training rows whose question is held out are dropped.

Prompts (``prompt_style``): ``chat`` renders the tokenizer's chat template with ``instruction``
after the question; ``fewshot`` is a plain "Q: ... A:" completion with ``num_shots`` solved
training examples. Reward: 1 for a correct answer; ``format_reward`` (default 0) for a wrong
answer that was at least given in the extraction's format; 0 otherwise.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from adapters.answers import EXTRACTIONS, Grader, extract_answer, gold_answer
from adapters.data import DataSourceError, load_rows, require_columns
from grpo.checks import ConfigError, check, check_choice, is_int, require_package
from grpo.rl.adapter import RLAdapter, chat_prompt_tokens

TASKS = ("addition", "arithmetic", "gsm8k", "dataset")
PROMPT_STYLES = ("chat", "fewshot")
DEFAULT_INSTRUCTION = "Give only the final answer."
# Reasoning-gym pools are drawn larger than needed, since duplicates are removed before the split.
POOL_OVERDRAW = 1.5


MathConfigError = ConfigError  # the name earlier versions raised; the one error class of grpo.checks


class MathAdapter(RLAdapter):
    """Math with exact verifiers: plain numbers compared in-process, anything else by math-verify.

    Every key is overridable, e.g.
      python -m grpo adapter=math adapter.task=gsm8k adapter.prompt_style=fewshot
      python -m grpo adapter=math adapter.task=dataset adapter.source=data/train.jsonl adapter.answer_column=solution
    Defaults are where SmolLM2-135M-Instruct's groups are mixed (27% of sampled answers to one-digit
    sums right at T=0.8, 62% greedy: step 0 of make demo), so GRPO learns from the first step.

    Args:
        task: addition | arithmetic (reasoning-gym basic_arithmetic) | gsm8k | dataset
        prompt_style: chat (chat template + instruction) | fewshot ("Q: ... A:" completion)
        extraction: last_number | boxed | answer_line | auto (boxed, then Answer:, then last number)
        digits: addition: operand digits; arithmetic: most digits per operand
        terms: arithmetic: operands per expression
        num_train: at most this many training problems (one-digit addition has 100 sums in all)
        num_eval: held-out problems, never trained on (at most half of a small problem space)
        seed: problem generation and the held-out split
        source: task=gsm8k or task=dataset: a hub id (e.g. openai/gsm8k with name=main), a local
            jsonl/parquet/csv file, or in-memory rows; null: generated problems
        name: hub dataset config name
        split: split of the source
        eval_source: held-out rows from another file/id; null: same source
        eval_split: e.g. test; with eval_source also null, held-out rows are carved off the training rows
        question_column: column with the question
        answer_column: column with the answer (GSM8K's "reasoning #### 42" is reduced to 42)
        instruction: appended to the question
        system_prompt: chat prompt_style: a system message; null: none
        num_shots: fewshot: solved examples before the question
        format_reward: partial credit in [0, 1) for a wrong answer in the right format
        grade_timeout_s: hard limit per math-verify comparison (any thread)
    """

    def __init__(
        self,
        task: str = "addition",
        prompt_style: str = "chat",
        extraction: str = "last_number",
        digits: int = 1,
        terms: int = 2,
        num_train: int = 1000,
        num_eval: int = 32,
        seed: int = 0,
        source: str | Sequence[Mapping[str, Any]] | None = None,
        name: str | None = None,
        split: str = "train",
        eval_source: str | Sequence[Mapping[str, Any]] | None = None,
        eval_split: str | None = None,
        question_column: str = "question",
        answer_column: str = "answer",
        instruction: str = DEFAULT_INSTRUCTION,
        system_prompt: str | None = None,
        num_shots: int = 1,
        format_reward: float = 0.0,
        grade_timeout_s: float = 5.0,
    ):
        check_choice("adapter.task", task, TASKS)
        if task in ("arithmetic", "gsm8k"):
            require_package("reasoning_gym", "reasoning-gym", "tasks", f"adapter.task={task}")
        check_choice("adapter.prompt_style", prompt_style, PROMPT_STYLES)
        check_choice("adapter.extraction", extraction, EXTRACTIONS)
        check(is_int(digits) and 1 <= digits <= 18, "adapter.digits", digits, "must be an integer from 1 to 18")
        check(is_int(terms) and 2 <= terms <= 6, "adapter.terms", terms, "must be an integer from 2 to 6")
        check(is_int(num_train) and num_train > 0, "adapter.num_train", num_train, "must be a positive integer")
        check(is_int(num_eval) and num_eval >= 0, "adapter.num_eval", num_eval, "must be an integer >= 0")
        check(is_int(num_shots) and num_shots >= 0, "adapter.num_shots", num_shots, "must be an integer >= 0")
        check(isinstance(format_reward, (int, float)) and 0 <= format_reward < 1, "adapter.format_reward",
              format_reward, "must be a number in [0, 1): partial credit below a correct answer's 1")
        check(isinstance(grade_timeout_s, (int, float)) and grade_timeout_s > 0, "adapter.grade_timeout_s",
              grade_timeout_s, "must be a positive number of seconds")
        if task == "dataset" and source is None:
            raise MathConfigError("task='dataset' needs adapter.source: a hub dataset id or a local "
                                  "jsonl/parquet/csv file with question and answer columns")
        if source is not None and task in ("addition", "arithmetic"):
            raise MathConfigError(f"adapter.source is only read by task='gsm8k' or task='dataset', "
                                  f"not task={task!r}; set task=dataset to train on {source!r}")

        self.task, self.prompt_style, self.extraction = task, prompt_style, extraction
        self.digits, self.terms, self.seed = digits, terms, seed
        self.instruction, self.system_prompt, self.num_shots = instruction, system_prompt, num_shots
        self.format_reward = float(format_reward)
        self.grader = Grader(timeout_s=grade_timeout_s)

        # Built here, not lazily: a missing column or unreadable source is a config error and
        # should stop the run before any model loads.
        if source is not None:
            train, held_out = _dataset_items(source, name, split, eval_source, eval_split,
                                             question_column, answer_column, num_train, num_eval, seed)
        else:
            pool = _generated_pool(task, digits, terms, num_train + num_eval, seed)
            # A small problem space (one-digit addition has 100 sums) holds out at most half.
            n_eval = min(num_eval, len(pool) // 2)
            held_out, train = pool[:n_eval], pool[n_eval:n_eval + num_train]
        if not train:
            raise MathConfigError(
                f"task={task!r} left no training items after holding out num_eval={num_eval}; "
                f"lower num_eval or choose a larger problem space (digits={digits} gives "
                f"{len(held_out)} held-out items)")
        self.train_items, self.eval_items = train, held_out
        self.shots = random.Random(seed).sample(train, min(num_shots, len(train)))

    # ------------------------------------------------------------------ RLAdapter

    def build_dataset(self) -> list[dict[str, str]]:
        return list(self.train_items)

    def build_eval_dataset(self) -> list[dict[str, str]]:
        return list(self.eval_items)

    def make_prompt(self, sample: Mapping[str, Any], tokenizer: Any) -> list[int]:
        if self.prompt_style == "chat":
            messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            content = f"{sample['question']}\n{self.instruction}".strip()
            messages.append({"role": "user", "content": content})
            return chat_prompt_tokens(tokenizer, messages)
        return list(tokenizer.encode(self.fewshot_text(sample), add_special_tokens=False))

    def fewshot_text(self, sample: Mapping[str, Any]) -> str:
        """The plain completion prompt: solved examples, then the question and "A:"."""
        shots = [s for s in self.shots if s["question"] != sample["question"]][: self.num_shots]
        parts = [f"Q: {s['question']}\nA: {self._shot_answer(s['answer'])}\n\n" for s in shots]
        head = f"{self.instruction}\n\n" if self.instruction and not shots else ""
        return head + "".join(parts) + f"Q: {sample['question']}\nA:"

    def _shot_answer(self, answer: str) -> str:
        # Shots show the answer in the form the extraction looks for.
        if self.extraction == "boxed":
            return f"\\boxed{{{answer}}}"
        if self.extraction == "answer_line":
            return f"Answer: {answer}"
        return answer

    def compute_reward(self, response: str, sample: Mapping[str, Any]) -> float:
        answer = extract_answer(response, self.extraction)
        if answer is None:
            return 0.0
        if self.grader.grade(answer, sample["answer"]):
            return 1.0
        return self.format_reward

    def is_correct(self, reward: float, sample: Any) -> bool:
        # With partial credit a wrong answer earns format_reward > 0, so "> 0" is not enough.
        return reward >= 1.0

    def stop_sequences(self, tokenizer: Any) -> list[str | int]:
        stops = super().stop_sequences(tokenizer)
        if self.prompt_style == "fewshot":
            stops += ["\nQ:", "\n\n"]  # the model would go on to write the next question
        return stops

    def sample_metrics(self, response: str, sample: Any) -> dict[str, float]:
        return {"answer_found": float(extract_answer(response, self.extraction) is not None),
                "chars": float(len(response))}

    def close(self) -> None:
        """Stop the grading child process (it is also stopped when the adapter is collected)."""
        self.grader.close()


# --------------------------------------------------------------------------- data


def _generated_pool(task: str, digits: int, terms: int, size: int, seed: int) -> list[dict[str, str]]:
    """``size`` distinct problems (fewer if the problem space is smaller), in seeded order."""
    if task == "addition":
        return _addition_pool(digits, size, seed)
    import reasoning_gym

    if task == "arithmetic":
        options = dict(min_terms=terms, max_terms=terms, min_digits=1, max_digits=digits)
        dataset_name = "basic_arithmetic"
    else:
        options, dataset_name = {}, "gsm_symbolic"
    dataset = reasoning_gym.create_dataset(dataset_name, size=int(size * POOL_OVERDRAW) + 8,
                                           seed=seed, **options)
    items, seen = [], set()
    for entry in dataset:
        question = entry["question"]
        if question not in seen:
            seen.add(question)
            items.append({"question": question, "answer": gold_answer(entry["answer"])})
        if len(items) == size:
            break
    return items


def _addition_pool(digits: int, size: int, seed: int) -> list[dict[str, str]]:
    # One-digit operands include 0 (100 distinct sums); longer ones have no leading zero.
    low, high = (0, 9) if digits == 1 else (10 ** (digits - 1), 10**digits - 1)
    span = high - low + 1
    rng = random.Random(seed)
    if span * span <= 4 * size:  # small space: enumerate and shuffle
        pairs = [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
        rng.shuffle(pairs)
        pairs = pairs[:size]
    else:  # large space: rejection-sample distinct pairs
        seen: set[tuple[int, int]] = set()
        pairs = []
        while len(pairs) < size:
            pair = (rng.randint(low, high), rng.randint(low, high))
            if pair not in seen:
                seen.add(pair)
                pairs.append(pair)
    return [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in pairs]


def _dataset_items(source: Any, name: str | None, split: str, eval_source: Any, eval_split: str | None,
                   question_column: str, answer_column: str, num_train: int, num_eval: int,
                   seed: int) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    def items(src: Any, which: str, limit: int | None) -> list[dict[str, str]]:
        try:
            rows = load_rows(src, split=which, name=name, limit=limit)
            require_columns(rows, [question_column, answer_column], src)
        except DataSourceError as err:
            raise MathConfigError(f"adapter.source: {err} (adapter.question_column="
                                  f"{question_column!r}, adapter.answer_column={answer_column!r})") from err
        return [{"question": str(r[question_column]).strip(), "answer": gold_answer(r[answer_column])}
                for r in rows]

    if eval_source is None and eval_split is None:
        # One set of rows: a seeded shuffle, the first num_eval held out.
        rows = items(source, split, None)
        random.Random(seed).shuffle(rows)
        held_out, train = rows[:num_eval], rows[num_eval:]
    else:
        train = items(source, split, None)
        held_out = items(eval_source if eval_source is not None else source, eval_split or split,
                         num_eval) if num_eval else []
    held_questions = {r["question"] for r in held_out}
    train = [r for r in train if r["question"] not in held_questions][:num_train]
    return train, held_out
