"""Command line: ``python -m grpo adapter=math group_size=8 loss_fn=ppo``.

Hydra composes conf/ (adapter, backend and every hyperparameter); a sweep is
``python -m grpo -m learning_rate=1e-5,2e-5``. Rerunning a command with the same
``hydra.run.dir=...`` resumes that run.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from grpo.config import ConfigError, GRPOConfig

NON_LOOP_KEYS = ("adapter", "backend")


def build_adapter(adapter_cfg: DictConfig, cli_keys: set[str]) -> Any:
    """Instantiate ``adapter._target_`` with the group's arguments.

    When ``_target_`` is swapped for a user's class, the group file's own arguments (meant for
    the built-in adapter) are passed only where the new constructor accepts them; arguments
    given on the command line are always passed, so a typo there is an error, not ignored.
    """
    options = OmegaConf.to_container(adapter_cfg, resolve=True)
    target = options.pop("_target_", None)
    if not target or target == "???":
        raise ConfigError("adapter._target_ is not set: choose adapter=math|chat|code or set "
                          "adapter._target_=your_pkg.YourAdapter")
    module_name, _, class_name = str(target).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(f"adapter._target_={target!r} does not import ({type(err).__name__}: {err}); "
                          "give a dotted path to an RLAdapter subclass importable from here") from err
    params = inspect.signature(cls).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in options.items() if takes_any or k in params or k in cli_keys}
    unknown = [k for k in kwargs if not takes_any and k not in params]
    if unknown:
        raise ConfigError(f"adapter {target} does not take argument(s) {unknown}; it takes: "
                          f"{', '.join(n for n in params if n != 'self') or 'none'}")
    return cls(**kwargs)


def _cli_adapter_keys() -> set[str]:
    from hydra.core.hydra_config import HydraConfig

    keys = set()
    for override in HydraConfig.get().overrides.task:
        key = override.split("=", 1)[0].lstrip("+~")
        if key.startswith("adapter."):
            keys.add(key.split(".", 1)[1])
    return keys


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> str | None:
    from hydra.core.hydra_config import HydraConfig

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        # Validate everything cheap before anything heavy (torch, models) is imported.
        loop_cfg = GRPOConfig.from_any({k: v for k, v in cfg.items() if k not in NON_LOOP_KEYS})
        backend_cfg = OmegaConf.to_container(cfg.backend, resolve=True)
        adapter = build_adapter(cfg.adapter, _cli_adapter_keys())
        from grpo.backends import create_service_client

        if backend_cfg.get("name", "local") == "local":  # a service resolves its own model names
            from grpo.models import resolve

            resolve(loop_cfg.base_model)  # a missing directory or a malformed name: one line, now
        service_client = create_service_client(backend_cfg, run_dir)
    except (ConfigError, ValueError, TypeError) as err:
        print(f"grpo: configuration error: {err}", file=sys.stderr)
        sys.exit(2)
    except (ConnectionError, TimeoutError) as err:  # a remote backend that cannot be reached
        print(f"grpo: cannot reach the backend: {err}", file=sys.stderr)
        sys.exit(3)
    from grpo.loop import run_grpo
    from grpo.models import ModelNotFoundError

    try:
        return run_grpo(adapter, loop_cfg, service_client=service_client, run_dir=run_dir,
                        resolved_config=OmegaConf.to_container(cfg, resolve=True))
    except ModelNotFoundError as err:  # a hub id that is neither cached nor reachable, a broken dir
        print(f"grpo: {' '.join(str(err).split())}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
