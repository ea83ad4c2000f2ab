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

import runpy
import sys


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0].startswith("-"):
        sys.exit("usage: python -m grpo.tinker_run MODULE|SCRIPT.py [ARGS...]  (runs MODULE with `import tinker` giving grpo)")
    import grpo

    grpo.as_tinker()
    sys.argv = [args[0], *args[1:]]
    if args[0].endswith(".py"):
        runpy.run_path(args[0], run_name="__main__")
    else:
        runpy.run_module(args[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
