"""Validation of user settings: one message shape everywhere, naming the key and what is valid.

The loop's config, the adapters' arguments and the backends' options all raise ConfigError
through these helpers, so a bad value reads the same wherever it was set; the CLI turns it into
one ``grpo: configuration error: ...`` line. Free of heavy imports, so it runs before any model.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any


class ConfigError(ValueError):
    """A setting a user chose is invalid; the message names it and what would be valid."""


def check(ok: bool, key: str, value: Any, valid: str) -> None:
    """Raise ``ConfigError("key=value is invalid: valid")`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: {valid}")


def check_choice(key: str, value: Any, choices: Iterable[str]) -> None:
    choices = list(choices)
    check(value in choices, key, value, f"valid values: {', '.join(map(str, choices))}")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def env_switch(name: str) -> bool:
    """Whether the environment switch ``name`` is on: on (the default, or empty) or off; any other
    value is refused with one line naming it and the valid ones (a ValueError, raised where the
    switch is read)."""
    value = os.environ.get(name, "on").strip().lower() or "on"
    if value not in ("on", "off"):
        raise ValueError(f"{name}={os.environ[name]!r} is invalid; valid: on, off")
    return value == "on"


def check_lora_targets(train_mlp: bool, train_attn: bool, train_unembed: bool) -> None:
    """LoRA must adapt something: the one rule every backend shares."""
    if not (train_mlp or train_attn or train_unembed):
        raise ConfigError("train_mlp, train_attn and train_unembed are all false: at least one must be true")


def require_package(module: str, package: str, extra: str, needed_by: str) -> None:
    """Raise ConfigError unless ``module`` can be imported: a setting that needs an optional
    package says so in one line, with the install command, before any model loads."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"{needed_by} needs the {package} package, which is not installed: "
                          f"pip install -e '.[{extra}]' in your grpo checkout (or pip install {package})")
