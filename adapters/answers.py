"""Answer extraction and exact grading for math tasks.

Two steps, kept apart so each can be tested on its own:

* ``extract_answer(text, mode)`` pulls the final answer out of a response: the last
  ``\\boxed{...}``, the last "Answer: ..." line, or the last number (``auto`` tries them in
  that order).
* ``Grader.grade(prediction, gold)`` decides equivalence. Plain numbers (integers, decimals,
  ``a/b``, thousands separators) are compared exactly with ``fractions.Fraction`` in-process:
  fast, no sympy, and exact for huge integers where a float would round. Everything else
  (LaTeX, symbolic forms, percentages) goes to ``math-verify``.

Why math-verify runs in a child process: its own timeout uses ``signal.alarm``, which raises
when called off the main thread (the loop or a user may score in worker threads), clobbers any
SIGALRM handler the host owns (pytest-timeout uses one) and cannot interrupt a long C-level
operation such as a huge integer power. A child process that is killed after ``timeout_s`` works
from any thread and always returns. The child is started lazily, only when a non-numeric answer
needs it, and is reused across calls.
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import threading
from fractions import Fraction
from pathlib import Path

EXTRACTIONS = ("last_number", "boxed", "answer_line", "auto")

# Answers longer than this are not parsed at all: real final answers are short, and a long
# string is where a parser's worst case lives.
MAX_ANSWER_CHARS = 300
# Exact Fraction arithmetic on numbers up to this many digits; longer decimals are compared as
# canonical digit strings (still exact) because int() refuses > 4300 digits by default.
MAX_FRACTION_DIGITS = 1000

# A number as people write it: optional sign, digits with optional thousands separators,
# optional decimals, optional "/denominator". The minus only counts when not preceded by a
# word character or closing bracket, so "10-7" yields 7 rather than -7.
_NUMBER = r"(?:(?<![\w)\]}])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_PLAIN_NUMBER_RE = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")
_PLAIN_FRACTION_RE = re.compile(r"([-+]?\d+)\s*/\s*(\d+)")
_ANSWER_LINE_RE = re.compile(r"answer\s*(?:is)?\s*[:：]\s*([^\n]*)", re.IGNORECASE)
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")


class GradingError(ValueError):
    pass


# --------------------------------------------------------------------------- extraction


def last_boxed(text: str) -> str | None:
    """Content of the last closed ``\\boxed{...}`` (braces may nest); None if there is none.

    One pass matches every brace, so a response full of unclosed ``\\boxed{`` stays linear.
    """
    starts = [m.end() for m in _BOXED_RE.finditer(text)]
    if not starts:
        return None
    closing: dict[int, int] = {}
    stack: list[int] = []
    for i in range(starts[0] - 1, len(text)):
        ch = text[i]
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            closing[stack.pop()] = i
    for start in reversed(starts):
        end = closing.get(start - 1)
        if end is not None:
            return text[start:end].strip()
    return None


def last_answer_line(text: str) -> str | None:
    """What follows the last "Answer:" (or "answer is:"), up to the end of that line."""
    matches = list(_ANSWER_LINE_RE.finditer(text))
    if not matches:
        return None
    value = matches[-1].group(1).strip()
    boxed = last_boxed(value)
    if boxed is not None:
        value = boxed
    value = value.strip().strip("$").strip().rstrip(".").strip()
    return value or None


def last_number(text: str) -> str | None:
    """The last number in ``text`` as written (sign, separators, decimals, a/b)."""
    match = None
    for match in _NUMBER_RE.finditer(text):  # noqa: B007 (the loop leaves the last match)
        pass
    return match.group(0) if match is not None else None


def extract_answer(text: str, mode: str = "auto") -> str | None:
    """The final answer in ``text`` according to ``mode`` (one of EXTRACTIONS), or None."""
    if mode not in EXTRACTIONS:
        raise GradingError(f"extraction={mode!r} is invalid; valid: {', '.join(EXTRACTIONS)}")
    if not text:
        return None
    if mode == "boxed":
        return last_boxed(text)
    if mode == "answer_line":
        return last_answer_line(text)
    if mode == "last_number":
        return last_number(text)
    for finder in (last_boxed, last_answer_line, last_number):
        found = finder(text)
        if found:
            return found
    return None


def gold_answer(value: object) -> str:
    """A dataset's answer field as a gold string: GSM8K's "reasoning #### 42" keeps what follows
    the last ``####``, numbers become their text, thousands separators are left to grading."""
    text = str(value).strip()
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip()
    return text


# --------------------------------------------------------------------------- plain numbers


def _strip_decorations(answer: str) -> str:
    """Drop what does not change a number's value: spaces, surrounding $, a currency $, a
    trailing full stop, a leading +."""
    s = answer.strip().strip("$").strip()
    if s.startswith("\\$"):
        s = s[2:]
    if s.endswith("."):
        s = s[:-1]
    return s.replace(" ", "").replace("\\,", "").replace("{,}", ",")


def _canonical_decimal(s: str) -> tuple[bool, str, str]:
    """(negative, integer digits, fraction digits) without leading/trailing zeros: equal tuples
    mean equal values, with no conversion to int (exact for any length)."""
    negative = s.startswith("-")
    s = s.lstrip("+-").replace(",", "")
    whole, _, frac = s.partition(".")
    whole, frac = whole.lstrip("0"), frac.rstrip("0")
    if not whole and not frac:
        negative = False  # -0 == 0
    return negative, whole, frac


def plain_number(answer: str) -> Fraction | tuple[bool, str, str] | None:
    """An exact value for a plain number (``-1,234.50``, ``3/4``, ``$5.``): a Fraction, or a
    canonical digit tuple for decimals too long for Fraction; None if not a plain number."""
    s = _strip_decorations(answer)
    if _PLAIN_NUMBER_RE.fullmatch(s):
        if len(s) > MAX_FRACTION_DIGITS:
            return _canonical_decimal(s)
        return Fraction(s.replace(",", ""))
    m = _PLAIN_FRACTION_RE.fullmatch(s)
    if m and len(s) <= MAX_FRACTION_DIGITS and int(m.group(2)) != 0:
        return Fraction(int(m.group(1)), int(m.group(2)))
    return None


def numbers_equal(a: Fraction | tuple, b: Fraction | tuple) -> bool | None:
    """Exact comparison of two ``plain_number`` values; None when one is a long-digit tuple and
    the other a fraction (rare; the caller then falls back to string equality)."""
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        return a == b
    if isinstance(a, tuple) and isinstance(b, tuple):
        return a == b
    # A short Fraction can never equal a > MAX_FRACTION_DIGITS-digit integer part.
    long = a if isinstance(a, tuple) else b
    return False if len(long[1]) > MAX_FRACTION_DIGITS // 2 else None


# --------------------------------------------------------------------------- grading


class Grader:
    """Exact grading with a hard time limit that works from any thread.

    ``grade(prediction, gold)``: plain numbers in-process; anything else through math-verify in
    a reusable child process that is killed (and later restarted) when a comparison runs past
    ``timeout_s``, in which case the answer counts as wrong.
    """

    def __init__(self, timeout_s: float = 5.0, use_math_verify: bool = True,
                 startup_timeout_s: float = 120.0):
        if not timeout_s > 0:
            raise GradingError(f"grade_timeout_s={timeout_s!r} is invalid: must be > 0 seconds")
        self.timeout_s = float(timeout_s)
        self.use_math_verify = use_math_verify
        self.startup_timeout_s = startup_timeout_s
        self._lock = threading.Lock()  # one request at a time on the child's pipe
        self._proc: subprocess.Popen | None = None
        self.timeouts = 0  # comparisons that ran past the limit (for tests and logs)

    def grade(self, prediction: str | None, gold: str) -> bool:
        if prediction is None:
            return False
        prediction, gold = str(prediction).strip(), str(gold).strip()
        if not prediction or not gold:
            return False
        # Plain numbers of any length are compared exactly (and in linear time) first.
        a, b = plain_number(prediction), plain_number(gold)
        if a is not None and b is not None:
            equal = numbers_equal(a, b)
            if equal is not None:
                return equal
        if _strip_decorations(prediction) == _strip_decorations(gold):
            return True
        if len(prediction) > MAX_ANSWER_CHARS or not self.use_math_verify:
            return False
        return self._verify(gold, prediction)

    # ------------------------------------------------------------------ the child process

    def _verify(self, gold: str, prediction: str) -> bool:
        with self._lock:
            proc = self._ensure_child()
            try:
                proc.stdin.write(json.dumps([gold, prediction]) + "\n")
                proc.stdin.flush()
            except (BrokenPipeError, OSError):
                self._kill_child()
                return False
            ready, _, _ = select.select([proc.stdout], [], [], self.timeout_s)
            if not ready:
                self.timeouts += 1
                self._kill_child()
                return False
            line = proc.stdout.readline()
            if not line:  # the child died (e.g. hit its memory limit)
                self._kill_child()
                return False
            return line.strip() == "1"

    def _ensure_child(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.Popen(
            [sys.executable, "-c", "from adapters.answers import _serve; _serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, bufsize=1, env=env)
        # The import of sympy/math-verify is not counted against the per-answer limit.
        ready, _, _ = select.select([proc.stdout], [], [], self.startup_timeout_s)
        hello = proc.stdout.readline() if ready else ""
        if hello.strip() != "ready":
            proc.kill()
            proc.wait()
            raise GradingError("the math-verify grading process did not start; is math-verify "
                               "installed in this environment? (pip install math-verify)")
        self._proc = proc
        return proc

    def _kill_child(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for stream in (self._proc.stdin, self._proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
            self._proc = None

    def close(self) -> None:
        with self._lock:
            self._kill_child()

    def __del__(self) -> None:  # best effort: never leave a child behind
        try:
            self._kill_child()
        except Exception:
            pass

    def __getstate__(self) -> dict:  # picklable (copied adapters get their own child)
        state = self.__dict__.copy()
        state["_proc"] = None
        state["_lock"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


def _serve() -> None:
    """Child process: read ``[gold, prediction]`` JSON lines, answer "1" or "0" per line."""
    import logging

    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything a library prints goes to stderr, never into the protocol
    try:
        import resource

        limit = 2 * 1024**3  # a runaway sympy expansion dies here instead of eating the host
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ImportError, ValueError, OSError):
        pass
    logging.disable(logging.CRITICAL)  # math-verify logs whole inputs on every timeout
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    out.write("ready\n")
    for line in sys.stdin:
        try:
            gold, prediction = json.loads(line)
            # Wrapped in $...$ so bare LaTeX (\frac12) and bare expressions (1/2) both parse.
            # The parent enforces the time limit, so math-verify's signal timeouts stay off.
            g = parse(f"${gold}$", configs, parsing_timeout=None)
            p = parse(f"${prediction}$", configs, parsing_timeout=None)
            ok = bool(g) and bool(p) and verify(g, p, timeout_seconds=None)
        except (Exception, MemoryError, RecursionError):
            ok = False
        out.write("1\n" if ok else "0\n")
