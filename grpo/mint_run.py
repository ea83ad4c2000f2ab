"""The MinT entry point: the quickstart's ``RLConfig`` and ``run_grpo(adapter, RLConfig)``, so its
RL demos run with ``from grpo import ...``. Like tinker_run.py it sits above the loop and the
backends and joins them (as ``python -m grpo`` does for Hydra configs); nothing below imports it.

The demos (``demos/rl/adapters/*.py`` in mint-quickstart) do::

    from rl_core import RLAdapter, RLConfig, run_grpo      # here: from grpo import ...
    cfg = RLConfig.from_env()
    cfg.steps = int(os.environ.get("MINT_RL_STEPS", "5"))
    run_grpo(MyAdapter(), cfg)

``RLConfig`` keeps rl_core's eight fields and defaults, and ``from_env`` reads the same
``MINT_*`` variables after loading ``.env`` (from the current directory) the way rl_core does:
``KEY=value`` lines, ``export`` and quotes allowed, never overriding a variable already set.

What such a run does (``run_grpo(adapter, RLConfig)``; decided here, tested in
tests/test_mint_compat.py):

- backend: with ``MINT_API_KEY`` set (in the environment or ``.env``) the MinT service, as a MinT
  user expects (``MINT_BASE_URL`` optional); otherwise this machine (torch + peft).
- the fields become grpo's keys (model -> base_model, batch -> batch_size, group -> group_size,
  lr -> learning_rate); every other key keeps grpo's default.
- MinT's default model ``Qwen/Qwen3-0.6B`` trains locally only where it is on disk or the hub
  is reachable. Otherwise, and for any user error (bad value, unreachable service), the run ends
  with one ``grpo:`` line naming the variable to change, exit status 2, no traceback: these are
  scripts, and ``python -m grpo`` answers user errors the same way.
- the demos wrote ``list(tokenizer.apply_chat_template(..., tokenize=True))`` for transformers
  v4, which returned token ids; v5 returns a mapping (whose ``list`` is its keys), so the
  adapter's ``make_prompt`` is handed a tokenizer whose ``apply_chat_template`` keeps v4's answer.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo.checks import ConfigError

# rl_core's RLConfig field -> (environment variable, type). Defaults are the dataclass's.
ENV_VARS: dict[str, tuple[str, type]] = {
    "model": ("MINT_BASE_MODEL", str),
    "rank": ("MINT_LORA_RANK", int),
    "steps": ("MINT_RL_STEPS", int),
    "batch": ("MINT_RL_BATCH", int),
    "group": ("MINT_RL_GROUP", int),
    "lr": ("MINT_RL_LR", float),
    "max_tokens": ("MINT_RL_MAX_TOKENS", int),
    "temperature": ("MINT_RL_TEMPERATURE", float),
}
API_KEY_VAR = "MINT_API_KEY"
ENV_FILE = ".env"
USER_ERROR_EXIT = 2  # as python -m grpo's configuration errors


@dataclass
class RLConfig:
    """rl_core's RLConfig: the same fields, defaults and ``from_env``."""

    model: str = "Qwen/Qwen3-0.6B"
    rank: int = 16
    steps: int = 5
    batch: int = 8
    group: int = 4
    lr: float = 1e-4
    max_tokens: int = 16
    temperature: float = 1.0

    @classmethod
    def from_env(cls, env_file: str | Path | None = ENV_FILE) -> RLConfig:
        """Fields from the ``MINT_*`` variables (after loading ``env_file`` if it exists);
        a variable that is not set keeps the default. A value that does not parse is a
        ``ConfigError`` naming the variable."""
        if env_file is not None:
            load_env_file(Path(env_file))
        values: dict[str, Any] = {}
        for name, (var, kind) in ENV_VARS.items():
            raw = os.environ.get(var)
            if raw is None:
                continue
            try:
                values[name] = kind(raw.strip()) if kind is not str else raw.strip()
            except ValueError:
                raise ConfigError(f"{var}={raw!r} is invalid: must be {_KIND_NAMES[kind]} "
                                  f"(RLConfig.{name}, default {getattr(cls, name)!r})") from None
        return cls(**values)

    def to_grpo_config(self) -> Any:
        """The same run as grpo's ``GRPOConfig`` (validated: a bad value is a ``ConfigError``
        naming the RLConfig field and its variable)."""
        from grpo.rl.config import GRPOConfig

        try:
            return GRPOConfig.from_any(dataclasses.asdict(self))
        except ConfigError as err:
            raise ConfigError(f"{err} [{_fields_and_vars()}]") from None


_KIND_NAMES = {int: "an integer", float: "a number", str: "a string"}


def _fields_and_vars() -> str:
    return "RLConfig fields and their variables: " + ", ".join(f"{f}={v}" for f, (v, _) in ENV_VARS.items())


def load_env_file(path: Path) -> dict[str, str]:
    """Set the ``KEY=value`` lines of ``path`` that are not already in the environment, as
    rl_core does: blank lines and ``#`` comments skipped, an ``export`` prefix and surrounding
    quotes dropped. Returns what was set. A missing file sets nothing."""
    if not path.is_file():
        return {}
    added: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if text.startswith("export "):
            text = text[len("export "):].lstrip()
        key, sep, value = text.partition("=")
        key = key.strip()
        if not sep or not key or key in os.environ:
            continue
        os.environ[key] = added[key] = value.strip().strip('"').strip("'")
    return added


def uses_mint_service() -> bool:
    """The backend rule for RLConfig runs: MinT's service when MINT_API_KEY is set."""
    return bool(os.environ.get(API_KEY_VAR, "").strip())


def run_grpo(adapter: Any, cfg: Any = None, *, service_client: Any = None, run_dir: str | Path | None = None,
             resolved_config: dict | None = None) -> str:
    """``grpo.run_grpo``: the loop (grpo/rl/loop.py), and MinT's ``run_grpo(adapter, RLConfig)``.

    An RLConfig without a service client is a MinT demo's call and follows its backend rule
    (run_rlconfig); anything else goes to the loop as it is. The dispatch lives here, so the
    loop knows nothing of MinT."""
    if isinstance(cfg, RLConfig) and service_client is None:
        return run_rlconfig(adapter, cfg, run_dir=run_dir)
    from grpo.rl import loop

    return loop.run_grpo(adapter, cfg, service_client=service_client, run_dir=run_dir,
                         resolved_config=resolved_config)


def run_rlconfig(adapter: Any, cfg: RLConfig, *, run_dir: str | Path | None = None) -> str:
    """``run_grpo(adapter, RLConfig)``: pick the backend, check the model, then run grpo's loop.
    User errors end the process with one ``grpo:`` line (see the module docstring)."""
    from grpo.backends.remote import RemoteConfigError
    from grpo.rl.loop import run_grpo

    load_env_file(Path(ENV_FILE))
    try:
        grpo_cfg = cfg.to_grpo_config()
        if uses_mint_service():
            from grpo.backends.remote import RemoteServiceClient

            service_client: Any = RemoteServiceClient(sdk="mint")
        else:
            service_client = _local_service_client(cfg.model, run_dir)
    except (ConfigError, RemoteConfigError) as err:
        _exit(f"configuration error: {err}")
    except (ConnectionError, TimeoutError) as err:
        _exit(f"cannot reach the MinT service ({API_KEY_VAR} is set, so this run uses it): {err}")
    _keep_v4_chat_template(adapter)
    return run_grpo(adapter, grpo_cfg, service_client=service_client, run_dir=run_dir)


def _local_service_client(model: str, run_dir: str | Path | None) -> Any:
    """A local ServiceClient, after checking that ``model`` can be loaded on this machine
    (its tokenizer: cheap, and fails the same way the weights would)."""
    from grpo import models
    from grpo.backends.local import ServiceClient

    try:
        models.load_tokenizer(model)
    except models.ModelNotFoundError as err:
        _exit(f"MINT_BASE_MODEL={model!r} is not available on this machine ({_first_sentence(err)}). "
              f"Set MINT_BASE_MODEL=smollm2 (SmolLM2-135M-Instruct, packaged with grpo), a local model "
              f"directory or a hub id on disk, or set {API_KEY_VAR} to train on the MinT service.")
    # run_grpo's default run directory is decided inside the loop; checkpoints go under it.
    return None if run_dir is None else ServiceClient(checkpoint_dir=Path(run_dir) / "checkpoints")


def _first_sentence(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text.split(". ")[0][:300]


def _exit(message: str) -> None:
    print(f"grpo: {' '.join(message.split())}", file=sys.stderr)
    raise SystemExit(USER_ERROR_EXIT)


class _V4ChatTemplate:
    """A tokenizer whose ``apply_chat_template(tokenize=True)`` returns token ids (transformers
    v4's answer, which the MinT demos were written against); everything else is the tokenizer's."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("tokenize", True) and "return_dict" not in kwargs:
            kwargs["return_dict"] = False
        return self._tokenizer.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:  # dunder methods are looked up on the type, so these are spelled out
        return len(self._tokenizer)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._tokenizer(*args, **kwargs)


def _keep_v4_chat_template(adapter: Any) -> None:
    # Only this adapter instance's make_prompt sees the view; the loop's tokenizer is untouched.
    make_prompt = adapter.make_prompt
    adapter.make_prompt = lambda sample, tokenizer: make_prompt(sample, _V4ChatTemplate(tokenizer))
