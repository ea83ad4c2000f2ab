"""``python -m grpo.tinker_run MODULE|SCRIPT.py [ARGS...]``: run a program written for the Tinker SDK
in-process on grpo, unchanged.

It routes ``import tinker`` to grpo (``grpo.as_tinker()``), then runs MODULE (or the script
SCRIPT.py) as ``__main__`` with ARGS as its command line, as ``python -m MODULE ARGS`` (or
``python SCRIPT.py ARGS``) would. For example the tinker-cookbook's
math RL recipe on the packaged SmolLM2::

    python -m grpo.tinker_run tinker_cookbook.recipes.math_rl.train \\
        model_name=$(python -m grpo.models smollm2) renderer_name=qwen3_instruct env=arithmetic ...
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path
from types import TracebackType

GRPO_DIR = Path(__file__).resolve().parent
# The errors grpo raises for what a user can get wrong (a model name, a chunk, a checkpoint path).
USER_ERRORS = (ValueError, TypeError, FileNotFoundError, KeyError)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0].startswith("-"):
        sys.exit("usage: python -m grpo.tinker_run MODULE|SCRIPT.py [ARGS...]  (runs MODULE with `import tinker` giving grpo)")
    import grpo

    grpo.as_tinker()
    sys.argv = [args[0], *args[1:]]
    try:
        if args[0].endswith(".py"):
            runpy.run_path(args[0], run_name="__main__")
        else:
            runpy.run_module(args[0], run_name="__main__", alter_sys=True)
    except Exception as err:
        line = one_line(err)
        if line is None or os.environ.get("GRPO_TRACEBACK"):
            raise
        sys.exit(f"{line}\n(GRPO_TRACEBACK=1 shows the traceback)")


def one_line(err: BaseException) -> str | None:
    """``Outer: msg <- Inner: msg`` when grpo raised a user error somewhere in ``err``'s chain of
    causes (the program may wrap it, as the cookbook wraps download failures); else None, and
    the program's own error keeps its traceback."""
    chain: list[BaseException] = []
    while err is not None and err not in chain:
        chain.append(err)
        err = err.__cause__ or err.__context__
    ours = [i for i, e in enumerate(chain) if isinstance(e, USER_ERRORS) and _raised_in_grpo(e)]
    if not ours:
        return _renderer_mismatch(chain[0])
    # the program's wrappers, then grpo's own message; what grpo's error wraps is detail
    return " <- ".join(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                       for e in chain[:ours[0] + 1])


def _renderer_mismatch(err: BaseException) -> str | None:
    """A cookbook renderer that failed on the tokenizer it was given (a renderer of another model
    family: its special tokens are not single tokens there) as one line naming the renderer's
    file and line; None for any other error."""
    where = None
    for tb in _frames(err):
        parts = Path(tb.tb_frame.f_code.co_filename).parts
        if "tinker_cookbook" in parts and "renderers" in parts:
            where = f"{'/'.join(parts[parts.index('tinker_cookbook'):])}:{tb.tb_lineno}"
    if where is None or not isinstance(err, (ValueError, AssertionError, KeyError, IndexError, TypeError)):
        return None
    detail = str(err).splitlines()[0][:200] if str(err) else ""
    return (f"the renderer failed on this model's tokenizer ({type(err).__name__}: {detail}, at {where}); "
            "a renderer made for another model's chat format fails like this: choose the renderer_name of this model's chat format")


def _raised_in_grpo(err: BaseException) -> bool:
    frames = _frames(err)
    return bool(frames) and Path(frames[-1].tb_frame.f_code.co_filename).resolve().is_relative_to(GRPO_DIR)


def _frames(err: BaseException) -> list[TracebackType]:
    """``err``'s traceback entries, outermost first."""
    out, tb = [], err.__traceback__
    while tb is not None:
        out.append(tb)
        tb = tb.tb_next
    return out


if __name__ == "__main__":
    main()
