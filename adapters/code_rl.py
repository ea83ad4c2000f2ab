"""Code adapter: the model writes a Python function, the sandbox runs it against the problem's tests.

Reward = fraction of tests passed (``reward=fraction``) or 1 only when all pass
(``reward=all_or_nothing``). A response with no code block, code that does not run, or a hostile
program scores 0; nothing it does can raise out of ``compute_reward``.

    python -m grpo adapter=code adapter.problems=humaneval adapter.reward=all_or_nothing max_tokens=256
"""

from __future__ import annotations

import ast
import random
import re
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from adapters.code_problems import (
    BUILTIN,
    CodeProblem,
    ProblemError,
    from_humaneval_row,
    load_humaneval,
)
from adapters.sandbox import Job, RunResult, Sandbox, SandboxLimits
from grpo.checks import check, check_choice, is_int
from grpo.rl.adapter import RLAdapter, chat_prompt_tokens

REWARDS = ("fraction", "all_or_nothing")
BUILTIN_SOURCES = ("builtin", "humaneval", "all")
DEFAULT_SYSTEM_PROMPT = "You are a careful Python programmer."
INSTRUCTION = ("Complete the Python function below. Reply with the whole function (and any imports it "
               "needs) in one ```python code block.\n\n```python\n{prompt}```")

# A fenced block: ```python / ```py / ``` ... ```; an unclosed last block (cut by max_tokens) counts.
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


def extract_code(response: str, entry_point: str | None = None) -> str | None:
    """The code the response offers: the first fenced block that defines ``entry_point``, else the
    first fenced block; None when there is none."""
    blocks = [b for b in _FENCE.findall(response) if b.strip()]
    if not blocks:
        return None
    if entry_point:
        for block in blocks:
            if _defines(block, entry_point):
                return block
    return blocks[0]


def build_program(code: str, problem: CodeProblem) -> str:
    """A runnable program from the model's code. A complete function gets the prompt's header
    (imports, helpers the tests use) in front; a bare body is appended to the prompt, HumanEval's
    completion style."""
    if _defines(code, problem.entry_point):
        return problem.header() + "\n" + code
    return problem.prompt + code


def _defines(code: str, name: str) -> bool:
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return False
    return any(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name for n in tree.body)


class CodeAdapter(RLAdapter):
    """Code: write a Python function, scored by running its tests in the sandbox (adapters/sandbox.py).

      python -m grpo adapter=code adapter.problems=humaneval adapter.reward=all_or_nothing

    Args:
        problems: builtin | humaneval (164, offline) | all | jsonl/parquet path or hub id (HumanEval columns)
        reward: fraction (of tests passed) | all_or_nothing
        eval_fraction: share of problems held out for evaluation (seeded split)
        seed: the held-out split
        limit: keep only the first N problems
        split: split of a hub dataset source
        system_prompt: a system message before each problem; null: none
        timeout_s: sandbox (docs/sandbox.md): wall clock per program, all tests
        test_timeout_s: sandbox: per test
        memory_mb: sandbox: address-space limit per program
        workers: sandbox: programs run in parallel
        guard: sandbox: in-interpreter audit hook on top of the OS limits
    """

    loop_overrides = {"max_tokens": (256, "a function needs room; the loop's default (16) is for short answers")}

    def __init__(self, problems: str | Sequence[Any] = "builtin", reward: str = "fraction",
                 eval_fraction: float = 0.25, seed: int = 0, limit: int | None = None,
                 split: str = "test", system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
                 timeout_s: float = 10.0, test_timeout_s: float = 3.0, memory_mb: int = 512,
                 workers: int = 2, guard: bool = True):
        check_choice("adapter.reward", reward, REWARDS)
        check(isinstance(eval_fraction, int | float) and 0.0 <= eval_fraction < 1.0, "adapter.eval_fraction",
              eval_fraction, "must be in [0, 1)")
        check(limit is None or (is_int(limit) and limit >= 1), "adapter.limit", limit,
              "must be a positive integer or null")
        self.reward = reward
        self.system_prompt = system_prompt
        all_problems = _load_problems(problems, split, limit)
        order = list(range(len(all_problems)))
        random.Random(seed).shuffle(order)
        n_eval = int(len(order) * float(eval_fraction))
        self.eval_problems = [all_problems[i] for i in sorted(order[:n_eval])]
        self.train_problems = [all_problems[i] for i in sorted(order[n_eval:])]
        # Built now so a bad limit or a missing unshare fails before any model loads.
        self.sandbox = Sandbox(SandboxLimits(timeout_s=timeout_s, test_timeout_s=min(test_timeout_s, timeout_s),
                                             cpu_s=max(1, int(timeout_s)), memory_mb=memory_mb),
                               workers=workers, guard=guard)
        self._results: OrderedDict[tuple[str, str], RunResult | None] = OrderedDict()

    # ------------------------------------------------------------------ RLAdapter

    def build_dataset(self) -> list[CodeProblem]:
        return list(self.train_problems)

    def build_eval_dataset(self) -> list[CodeProblem]:
        return list(self.eval_problems)

    def make_prompt(self, sample: CodeProblem, tokenizer: Any) -> list[int]:
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": INSTRUCTION.format(prompt=sample.prompt)})
        return chat_prompt_tokens(tokenizer, messages)

    def compute_reward(self, response: str, sample: CodeProblem) -> float:
        return self._reward(self.run(response, sample))

    def compute_group_rewards(self, responses: Sequence[str], sample: CodeProblem) -> list[float]:
        """The group's programs run in parallel on the sandbox pool."""
        return [self._reward(r) for r in self.run_group(responses, sample)]

    def is_correct(self, reward: float, sample: Any) -> bool:
        return reward >= 1.0 - 1e-9  # every test passed, whichever reward is configured

    def sample_metrics(self, response: str, sample: CodeProblem) -> dict[str, float]:
        result = self._results.get((sample.task_id, response))
        if (sample.task_id, response) not in self._results:
            result = self.run(response, sample)
        metrics = {"has_code": float(result is not None)}
        if result is not None:
            metrics["tests_passed"] = result.fraction
            for status in ("fail", "timeout", "crash"):
                metrics[f"tests_{status}"] = sum(s == status for s in result.statuses) / len(result.statuses)
        return metrics

    # ------------------------------------------------------------------ running

    def run(self, response: str, sample: CodeProblem) -> RunResult | None:
        return self.run_group([response], sample)[0]

    def run_group(self, responses: Sequence[str], sample: CodeProblem) -> list[RunResult | None]:
        """Sandbox results per response (None: no code block). Never raises for a response."""
        codes = [extract_code(r, sample.entry_point) for r in responses]
        jobs = [Job(build_program(c, sample), sample.tests, sample.setup) for c in codes if c is not None]
        ran = iter(self.sandbox.run_many(jobs))
        results = [next(ran) if c is not None else None for c in codes]
        for response, result in zip(responses, results, strict=True):
            self._remember((sample.task_id, response), result)
        return results

    def _reward(self, result: RunResult | None) -> float:
        if result is None:
            return 0.0
        if self.reward == "all_or_nothing":
            return 1.0 if result.all_passed else 0.0
        return result.fraction

    def _remember(self, key: tuple[str, str], result: RunResult | None) -> None:
        self._results[key] = result
        self._results.move_to_end(key)
        while len(self._results) > 4096:
            self._results.popitem(last=False)


def _load_problems(problems: str | Sequence[Any], split: str, limit: int | None) -> list[CodeProblem]:
    if isinstance(problems, str) and problems in BUILTIN_SOURCES:
        chosen = list(BUILTIN) if problems in ("builtin", "all") else []
        if problems in ("humaneval", "all"):
            chosen += load_humaneval()
    else:
        from adapters.data import load_rows

        if isinstance(problems, str) and not any(ch in problems for ch in "/.~"):
            raise ValueError(f"adapter.problems={problems!r} is not one of {BUILTIN_SOURCES} nor a data source "
                             "(a jsonl/parquet path or a hub dataset id with HumanEval columns)")
        try:
            chosen = [from_humaneval_row(row) for row in load_rows(problems, split=split)]
        except ProblemError as err:
            raise ValueError(f"adapter.problems={problems!r}: {err}") from err
    if not chosen:
        raise ValueError(f"adapter.problems={problems!r} has no problems")
    return chosen[:limit] if limit is not None else chosen
