"""Start SkyRL's Tinker API server (skyrl 0.4.0) without uv. Run it with the SkyRL venv's python.

``python -m skyrl.tinker.api`` starts its engine subprocess by rebuilding a ``uv run ...`` command
from its parent's command line, and outside ``uv run`` it stops with "Unable to parse tinker API
server startup command". This starts the same FastAPI app, with the engine launched by this
interpreter instead; every flag is SkyRL's own (``--base-model``, ``--backend``, ``--backend-config``,
``--database-url``, ``--checkpoints-base``, ...) plus ``--host``/``--port``. Used by
scripts/skyrl_run.sh; see docs/remote.md, "SkyRL's Tinker server".
"""

from __future__ import annotations

import argparse
import sys

import uvicorn
from skyrl.tinker import api
from skyrl.tinker.config import EngineConfig, add_model, config_to_argv


def engine_command(parent_cmd: list[str], engine_config: EngineConfig) -> list[str]:
    # The engine in this venv, with the flags SkyRL would have passed it under uv.
    return [sys.executable, "-m", "skyrl.tinker.engine", *config_to_argv(engine_config)]


def main() -> None:
    parser = argparse.ArgumentParser(description="SkyRL's Tinker API server, started without uv")
    add_model(parser, EngineConfig)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    api._build_uv_run_cmd_engine = engine_command
    api.app.state.engine_config = EngineConfig.model_validate(
        {k: v for k, v in vars(args).items() if k in EngineConfig.model_fields})
    uvicorn.run(api.app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
