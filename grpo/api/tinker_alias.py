"""``grpo.as_tinker()``: make ``import tinker`` (and its submodules) give grpo, in this process.

A program written for the Tinker SDK, or a library built on it (the tinker-cookbook), imports
``tinker`` itself, and some of it reaches into the SDK's submodules: ``from tinker.types.tensor_data
import TensorData``, ``from tinker.lib.public_interfaces import APIFuture``. Putting grpo into
``sys.modules["tinker"]`` alone is not enough for those: Python would then look for
``tinker/types/tensor_data.py`` inside grpo's folder and fail (or load grpo.types a second time,
with classes unequal to the first). So an import hook answers every ``tinker.*`` name:

- ``tinker``, ``tinker.lib``, ``tinker.lib.public_interfaces[.*]`` -> ``grpo`` (the clients and futures);
- ``tinker.types`` and any ``tinker.types.<submodule>`` -> ``grpo.types`` (every name lives there);
- anything else -> ModuleNotFoundError naming the module and saying grpo does not provide it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types as pytypes

# SDK submodule prefixes and the grpo module that holds their public names.
_ALIASES = (
    ("tinker.types", "grpo.types"),
    ("tinker.lib.public_interfaces", "grpo"),
    ("tinker.lib", "grpo"),
    ("tinker", "grpo"),
)


def target(fullname: str) -> str | None:
    """The grpo module that stands for SDK module ``fullname``, or None if grpo has no counterpart."""
    for prefix, module in _ALIASES:
        if fullname == prefix:
            return module
        if fullname.startswith(prefix + ".") and prefix in ("tinker.types", "tinker.lib.public_interfaces"):
            return module  # tinker.types.datum, tinker.lib.public_interfaces.rest_client, ...
    return None


class _TinkerAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path=None, target_=None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "tinker" and not fullname.startswith("tinker."):
            return None
        if target(fullname) is None:
            raise ModuleNotFoundError(f"No module named {fullname!r}: grpo stands in for the tinker SDK's public "
                                      "API (tinker, tinker.types) only, not its internals", name=fullname)
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> pytypes.ModuleType:
        return importlib.import_module(target(spec.name))  # the grpo module itself, not a copy

    def exec_module(self, module: pytypes.ModuleType) -> None:
        pass  # already executed when grpo imported it


_HOOK = _TinkerAlias()


def install() -> pytypes.ModuleType:
    """Route ``import tinker`` to grpo for the rest of this process; returns ``grpo``. Idempotent.
    Any tinker modules imported before (a real SDK) are dropped so that nothing mixes the two."""
    for name in [n for n in sys.modules if n == "tinker" or n.startswith("tinker.")]:
        del sys.modules[name]
    if _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)
    sys.modules["tinker"] = importlib.import_module("grpo")
    types_module = sys.modules["tinker.types"] = importlib.import_module("grpo.types")
    # `import tinker.types.tensor_data` asks the parent for __path__ before any finder runs
    # ("'tinker.types' is not a package" otherwise); an empty one sends the name to the hook above.
    if not hasattr(types_module, "__path__"):
        types_module.__path__ = []
    return sys.modules["tinker"]
