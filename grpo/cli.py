"""The ``grpo`` command: ``grpo serve ...`` starts the Tinker-compatible server, anything else
is a training run (``grpo adapter=math ...``, Hydra's command line)."""

from __future__ import annotations

import sys


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        from grpo.serve.__main__ import main as serve

        serve(sys.argv[2:])
        return
    from grpo.__main__ import cli as train

    train()
