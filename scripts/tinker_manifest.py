"""Write the Tinker SDK's public surface as JSON: the manifest grpo's in-process clients are held to.

Run it with a Python that has the SDK installed (NOT the project's .venv, whose dev extra pins an
older tinker through mindlab-toolkit)::

    python3 -m venv /tmp/tinker038 && /tmp/tinker038/bin/pip install tinker==0.38.0
    /tmp/tinker038/bin/python scripts/tinker_manifest.py > tests/tinker_manifest.json

tests/test_sdk_parity.py reads the output: every entry must be implemented by grpo with the same
parameter names / fields, or listed in grpo/api/sdk_parity.py as unsupported with a reason.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import json
import sys
import typing

CLIENTS = ("ServiceClient", "TrainingClient", "SamplingClient", "RestClient")


def method_entry(fn) -> dict:
    params = list(inspect.signature(fn).parameters.values())[1:]  # drop self
    return {
        "async": inspect.iscoroutinefunction(inspect.unwrap(fn)),  # @deprecated wrappers hide it
        "params": [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)],
        "keyword_only": [p.name for p in params if p.kind == p.KEYWORD_ONLY],
        "required": [p.name for p in params if p.default is p.empty
                     and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)],
    }


def constructor_entry(cls) -> dict:
    """``__init__``'s parameters plus their defaults (as repr), which a program relies on when it
    calls ``RestClient()`` or ``ServiceClient(base_url=...)`` with few arguments."""
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return {**method_entry(cls.__init__),
            "defaults": {p.name: repr(p.default) for p in params if p.default is not p.empty}}


def client_methods(cls) -> dict:
    out = {}
    for name in sorted(dir(cls)):
        if name.startswith("_"):
            continue
        attr = inspect.getattr_static(cls, name)
        if isinstance(attr, property):
            continue
        fn = attr.__func__ if isinstance(attr, staticmethod | classmethod) else attr
        if inspect.isfunction(fn):
            entry = method_entry(fn) if not isinstance(attr, staticmethod) else {
                **method_entry(lambda self, *a, **k: None), "params": list(inspect.signature(fn).parameters)}
            out[name] = entry
    return out


def type_fields(cls) -> list[str]:
    """Public fields plus public properties (0.38 reads ``SampledSequence.tokens`` through one)."""
    import pydantic

    if dataclasses.is_dataclass(cls):
        fields, inherited = {f.name for f in dataclasses.fields(cls)}, set()
    elif issubclass(cls, pydantic.BaseModel):
        fields, inherited = set(cls.model_fields), set(dir(pydantic.BaseModel))  # model_dump & co.
    else:
        raise TypeError(f"{cls} is neither a pydantic model nor a dataclass")
    props = {n for n in dir(cls)
             if isinstance(inspect.getattr_static(cls, n, None), property | functools.cached_property)}
    return sorted(n for n in fields | props - inherited if not n.startswith("_"))


def types_module(types_mod) -> tuple[dict, dict]:
    """Every public name of ``tinker.types``: data types with their fields, and the other names
    (type aliases, ``Literal`` sets, enums) with their values where they have any. Submodules
    (``tinker.types.datum``...) are the SDK's file layout, not names a program uses, so they are left out."""
    classes, aliases = {}, {}
    for name in sorted(n for n in dir(types_mod) if not n.startswith("_")):
        obj = getattr(types_mod, name)
        if inspect.ismodule(obj) or name == "annotations":  # `from __future__ import annotations`
            continue
        if inspect.isclass(obj) and issubclass(obj, enum.Enum):
            aliases[name] = sorted(str(m.value) for m in obj)
        elif inspect.isclass(obj) and obj.__module__ != "builtins":
            classes[name] = type_fields(obj)
        else:  # ModelID = str, Literal[...], Union[...], Dict[str, TensorData]
            args = typing.get_args(obj)
            aliases[name] = sorted(map(str, args)) if typing.get_origin(obj) is typing.Literal else None
    return classes, aliases


def main() -> None:
    import tinker

    classes, aliases = types_module(tinker.types)
    manifest = {
        "sdk": "tinker",
        "version": tinker.__version__,
        "top_level": sorted(n for n in tinker.__all__ if not n.startswith("__")),
        "clients": {name: client_methods(getattr(tinker, name)) for name in CLIENTS},
        # Constructors are part of what a program calls (``RestClient()``, ``ServiceClient(base_url=...)``).
        "constructors": {name: constructor_entry(getattr(tinker, name)) for name in CLIENTS},
        "types": classes,
        "type_aliases": aliases,
    }
    json.dump(manifest, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
