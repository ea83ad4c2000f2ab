"""Tool use learned with GRPO: a calculator on two-digit arithmetic, or Python in the sandbox.

``tool=calc`` (the default): problems ``a op b`` with two-digit operands, generated from
``seed``. The model may write ``<calc>37*48</calc>``; the environment evaluates the expression
(numbers, + - * / // % and parentheses; nothing else) and answers ``<result>1776</result>``,
and the model goes on to its final answer. SmolLM2-135M-Instruct gets two-digit sums right
about 2% of the time unaided; copying a number out of its context is within its reach.

``tool=python`` (for larger models): GSM8K-style word problems from reasoning-gym, and a
``<python>...</python>`` code interpreter that runs the code in the sandbox (adapters/sandbox.py)
and shows what it printed.

``tool=none`` is the baseline: the same problems and prompt with no tool mentioned (a tool call
gets no answer), so held-out accuracy with and without the tool is measured on the same items.

Reward: 1 for a correct final answer (the last number of the last model turn), 0 otherwise,
minus ``call_cost`` per tool call.
"""

from __future__ import annotations

import ast
import operator
import random
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

from adapters.answers import Grader, extract_answer
from grpo.checks import check, check_choice, is_int, require_package
from grpo.rl.adapter import chat_prompt_tokens
from grpo.rl.agent import AgentAdapter, AgentConfigError, ToolError

TOOLS = ("calc", "python", "none")
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}

# How the prompt sets the starting point, measured on SmolLM2-135M-Instruct (two-digit + and *, 24
# problems x 4 samples, T=1) with one worked example: this instruction got a tool call in 16% of
# episodes (9% correct, 54% of groups mixed). A terser one ("Use the calculator:
# <calc>expression</calc>.", example answer "... 42") already called it in 57% (greedy held-out
# accuracy 0.88 before any training). Two worked examples (EXAMPLES below) are what a 135M model
# needs to call a tool reliably (issue #38: 1 in 16 samples with one, 63 in 64 with two).
CALC_INSTRUCTION = ("Always use the calculator: write the expression between <calc> and </calc>, and its "
                    "result appears between <result> and </result>. Then state the final answer.")
PYTHON_INSTRUCTION = ("You can run Python. Write code between <python> and </python> that prints what you "
                      "need; its output appears between <result> and </result>. Then state the final answer.")
# Worked exchanges shown before the question, so a small model sees the call syntax in use. Each
# reads exactly as an episode's context does: the turn stops at the closing tag, and the inline
# observation starts with a space (format_observation). Written "</calc><result>", the example
# would teach SmolLM2's single "><" token, and a turn would end on "</calc><" (issue #38).
OBSERVATION_SEPARATOR = " "
CALC_EXAMPLES = (("What is 12 + 30?", "<calc>12+30</calc> <result>42</result> The answer is 42."),
                 ("What is 7 * 8?", "<calc>7*8</calc> <result>56</result> The answer is 56."))
PYTHON_EXAMPLES = (("Tom has 3 boxes of 12 apples and eats 5. How many apples are left?",
                    "<python>print(3 * 12 - 5)</python> <result>31</result> The answer is 31."),
                   ("A shelf holds 4 rows of 9 books; 6 are taken. How many books are on it?",
                    "<python>print(4 * 9 - 6)</python> <result>30</result> The answer is 30."))


class ToolsAdapter(AgentAdapter):
    """Agentic RL: multi-turn episodes with a tool (protocol in grpo/rl/agent.py), rewarded on the final answer.

      python -m grpo adapter=tools                         calculator on two-digit + and *
      python -m grpo adapter=tools adapter.tool=none steps=0   the same held-out items without the tool
      python -m grpo adapter=tools adapter.tool=python base_model=Qwen/Qwen3-0.6B max_tokens=256

    Args:
        tool: calc | python (word problems, code in the sandbox) | none (baseline: no tool)
        ops: calc: operators of the problems (any of + - *)
        digits: calc: operand digits
        num_train: training problems
        num_eval: held-out problems, never trained on
        seed: problem generation and the held-out split
        example: two worked tool calls shown before the question
        call_cost: subtracted from the reward per tool call
        max_turns: model turns per episode
        max_context_tokens: prompt + turns + observations; a turn never samples past it
        tool_timeout_s: per tool call; a hanging tool becomes an error observation
        tool_workers: threads that run tool calls; a hung call holds one until it returns
        observation_style: inline: <result>..</result> after the call | chat: a tool message | user: a user message
        tool_errors: observe: the error message is the observation | end: it ends the episode
        system_prompt: a system message before each problem; null: none
        python_timeout_s: python tool: wall clock per program in the sandbox
        python_memory_mb: python tool: address-space limit per program in the sandbox
    """

    loop_overrides = {
        "max_tokens": (24, "per model turn: a tool call or a short final answer"),
        "learning_rate": (3e-4, "LoRA on a 135M model learns the tool format in a few steps (docs/agentic.md)"),
        "steps": (16, "the run docs/agentic.md measures"),
        "eval_samples": (2, "pass@2 on the held-out problems"),
    }

    def __init__(self, tool: str = "calc", ops: str = "+*", digits: int = 2, num_train: int = 2000,
                 num_eval: int = 32, seed: int = 0, example: bool = True, call_cost: float = 0.02,
                 max_turns: int = 3, max_context_tokens: int = 1024, tool_timeout_s: float = 5.0,
                 tool_workers: int = 32, observation_style: str = "inline", tool_errors: str = "observe", system_prompt: str | None = None,
                 python_timeout_s: float = 5.0, python_memory_mb: int = 256):
        check_choice("adapter.tool", tool, TOOLS)
        if tool == "python":  # its word problems come from reasoning-gym
            require_package("reasoning_gym", "reasoning-gym", "tasks", "adapter.tool=python")
        check(bool(ops) and all(op in OPS for op in ops), "adapter.ops", ops, f"one or more of {''.join(OPS)}")
        check(is_int(digits) and 1 <= digits <= 6, "adapter.digits", digits, "must be an integer from 1 to 6")
        self.tool, self.ops, self.digits, self.seed, self.example = tool, ops, digits, seed, example
        self.system_prompt = system_prompt
        self.max_turns, self.max_context_tokens, self.tool_timeout_s = max_turns, max_context_tokens, tool_timeout_s
        self.tool_call_cost, self.tool_workers = call_cost, tool_workers
        self.observation_style, self.tool_errors = observation_style, tool_errors
        self.check_agent_config()  # a bad limit fails here, before any model loads
        self.python_timeout_s, self.python_memory_mb = python_timeout_s, python_memory_mb
        self._sandbox = None
        self.grader = Grader(use_math_verify=False)
        pool = (_word_problems(num_train + num_eval, seed) if tool == "python"
                else _arithmetic(ops, digits, num_train + num_eval, seed))
        self.eval_items, self.train_items = pool[:num_eval], pool[num_eval:]
        if not self.train_items:
            raise AgentConfigError(f"adapter.num_train={num_train} with num_eval={num_eval} leaves no training items")

    # ------------------------------------------------------------------ RLAdapter

    def build_dataset(self) -> list[dict[str, str]]:
        return list(self.train_items)

    def build_eval_dataset(self) -> list[dict[str, str]]:
        return list(self.eval_items)

    def make_prompt(self, sample: Mapping[str, Any], tokenizer: Any) -> list[int]:
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        if self.tool == "none":
            messages.append({"role": "user", "content": f"{sample['question']}\nGive the final answer."})
            return chat_prompt_tokens(tokenizer, messages)
        instruction, examples = ((PYTHON_INSTRUCTION, PYTHON_EXAMPLES) if self.tool == "python"
                                 else (CALC_INSTRUCTION, CALC_EXAMPLES))
        prefix = f"{instruction}\n"  # the instruction opens the first user message
        for question, answer in examples if self.example else ():
            messages += [{"role": "user", "content": prefix + question}, {"role": "assistant", "content": answer}]
            prefix = ""
        messages.append({"role": "user", "content": prefix + sample["question"]})
        return chat_prompt_tokens(tokenizer, messages)

    def format_observation(self, result: str, error: bool) -> str:
        """``<result>..</result>``; inline, after a space, as the worked examples show it."""
        text = super().format_observation(result, error)
        return OBSERVATION_SEPARATOR + text if self.observation_style == "inline" else text

    def compute_reward(self, response: str, sample: Mapping[str, Any]) -> float:
        return 1.0 if self.grader.grade(extract_answer(response, "last_number"), sample["answer"]) else 0.0

    def is_correct(self, reward: float, sample: Any) -> bool:
        return reward > 0.5  # 1 minus a few call costs

    # ------------------------------------------------------------------ AgentAdapter

    def tools(self) -> dict[str, Callable[[str], Any]]:
        if self.tool == "calc":
            return {"calc": calculate}
        if self.tool == "python":
            return {"python": self.run_python}
        return {}

    def run_python(self, code: str) -> str:
        """Run ``code`` in the sandbox; its printed output (or its error) is the result."""
        if self._sandbox is None:
            from adapters.sandbox import Sandbox, SandboxLimits

            self._sandbox = Sandbox(SandboxLimits(timeout_s=self.python_timeout_s, test_timeout_s=self.python_timeout_s,
                                                  memory_mb=self.python_memory_mb), workers=2)
        # One empty test, so the harness reports how loading the program went (crash, timeout).
        result = self._sandbox.run(code, ["pass"])
        if result.killed or result.statuses == ["timeout"]:
            raise ToolError(f"the program was stopped ({result.killed or 'timeout'})")
        if result.statuses != ["pass"]:
            details = result.details[0] if result.details else "crashed"
            return (result.output + details).strip()
        return result.output.strip()

    def sample_metrics(self, response: str, sample: Any) -> dict[str, float]:
        return {"answer_found": float(extract_answer(response, "last_number") is not None)}


# --------------------------------------------------------------------------- the calculator


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
MAX_CALC_CHARS = 200
MAX_CALC_MAGNITUDE = 10**30


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression exactly (numbers, + - * / // %, parentheses); raise
    ToolError with a message the model can read for anything else."""
    if len(expression) > MAX_CALC_CHARS:
        raise ToolError(f"expression longer than {MAX_CALC_CHARS} characters")
    try:
        tree = ast.parse(expression.replace("×", "*").replace("÷", "/").strip(), mode="eval")
    except SyntaxError as err:
        raise ToolError(f"cannot parse {expression!r}") from err
    value = _evaluate(tree.body)
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6g}"


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ToolError("division by zero")
        value = Fraction(_BINARY[type(node.op)](left, right))
        if abs(value) > MAX_CALC_MAGNITUDE:
            raise ToolError("result too large")
        return value
    raise ToolError(f"unsupported: {ast.unparse(node)!r} (numbers, + - * / // % and parentheses only)")


# --------------------------------------------------------------------------- data


def _arithmetic(ops: str, digits: int, size: int, seed: int) -> list[dict[str, str]]:
    """``size`` distinct problems ``a op b`` with ``digits``-digit operands, in seeded order."""
    low, high = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
    rng = random.Random(seed)
    space = len(ops) * (high - low + 1) ** 2
    seen: set[tuple[int, str, int]] = set()
    items = []
    while len(items) < min(size, space):
        a, op, b = rng.randint(low, high), rng.choice(ops), rng.randint(low, high)
        if (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        items.append({"question": f"What is {a} {op} {b}?", "answer": str(OPS[op](a, b))})
    return items


def _word_problems(size: int, seed: int) -> list[dict[str, str]]:
    from adapters.math_rl import _generated_pool

    return _generated_pool("gsm8k", 1, 2, size, seed)
