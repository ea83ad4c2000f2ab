"""grpo's in-process API against the Tinker SDK's public surface (tests/tinker_manifest.json).

Every name, method and field of the manifest is implemented by grpo under the SDK's name, with
the SDK's parameter names in the SDK's order, or listed in grpo/api/sdk_parity.py with the reason.
An entry listed as unsupported that grpo does implement fails too, so the lists stay true.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
from pathlib import Path

import pytest

import grpo
from grpo import types
from grpo.api import sdk_parity
from grpo.api.rest_client import RestClient
from grpo.backends.local.clients import SamplingClient, ServiceClient, TrainingClient

MANIFEST = json.loads(sdk_parity.MANIFEST.read_text())
CLIENTS = {"ServiceClient": ServiceClient, "TrainingClient": TrainingClient, "SamplingClient": SamplingClient,
           "RestClient": RestClient}
DOC = Path(__file__).resolve().parent.parent / "docs" / "tinker-api.md"


def test_manifest_is_of_the_sdk_version_the_readme_names() -> None:
    assert MANIFEST["version"] == "0.38.0"
    assert set(MANIFEST["clients"]) == set(CLIENTS)


@pytest.mark.parametrize("name", MANIFEST["top_level"])
def test_top_level_name_is_exported_or_declared_unsupported(name: str) -> None:
    has = hasattr(grpo, name)
    reason = sdk_parity.UNSUPPORTED_TOP_LEVEL.get(name)
    assert has != bool(reason), (f"grpo.{name}: " + ("implemented but listed as unsupported" if has else
                                                       "missing and not listed in sdk_parity.UNSUPPORTED_TOP_LEVEL"))


def _methods() -> list[tuple[str, str]]:
    return [(client, method) for client, methods in MANIFEST["clients"].items() for method in methods]


def _signature_problems(client: str, method: str, sdk: dict, fn) -> list[str]:
    params = [p for p in inspect.signature(fn).parameters.values()][1:]  # drop self
    named = {p.name: p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    problems = []
    missing = [n for n in sdk["params"] if n not in named]
    if missing:
        problems.append(f"lacks the SDK's parameters {missing}")
    sdk_positional = [n for n in sdk["params"] if n not in sdk["keyword_only"]]
    if positional[:len(sdk_positional)] != sdk_positional:
        problems.append(f"positional parameters {positional} do not start with the SDK's {sdk_positional}")
    extra_required = [n for n, p in named.items() if p.default is p.empty and n not in sdk["required"]]
    if extra_required:
        problems.append(f"requires {extra_required}, which the SDK does not")
    if inspect.iscoroutinefunction(fn) != sdk["async"]:
        problems.append("is " + ("not " if sdk["async"] else "") + "a coroutine function, unlike the SDK's")
    unsupported_params = [k.rsplit(".", 1)[1] for k in sdk_parity.UNSUPPORTED_PARAMS
                          if k.startswith(f"{client}.{method}.")]
    problems += [f"declares unsupported parameter {p!r} that it does not take" for p in unsupported_params
                 if p not in named]
    return problems


@pytest.mark.parametrize(("client", "method"), _methods())
def test_client_method_has_the_sdk_signature_or_is_declared_unsupported(client: str, method: str) -> None:
    sdk = MANIFEST["clients"][client][method]
    fn = getattr(CLIENTS[client], method, None)
    reason = sdk_parity.UNSUPPORTED_METHODS.get(f"{client}.{method}")
    if reason:
        assert fn is None, f"{client}.{method} is implemented but listed as unsupported"
        return
    assert fn is not None, f"{client}.{method} is missing and not listed in sdk_parity.UNSUPPORTED_METHODS"
    assert not _signature_problems(client, method, sdk, fn), f"{client}.{method}: {_signature_problems(client, method, sdk, fn)}"


def _readable(cls: type) -> set[str]:
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    return fields | {n for n in dir(cls) if not n.startswith("_")}


@pytest.mark.parametrize("type_name", sorted(MANIFEST["types"]))
def test_type_has_the_sdk_fields_or_declares_them_unsupported(type_name: str) -> None:
    cls = getattr(types, type_name)
    for field in MANIFEST["types"][type_name]:
        key = f"{type_name}.{field}"
        has = field in _readable(cls)
        assert has != (key in sdk_parity.UNSUPPORTED_FIELDS), (
            f"{key}: " + ("present but listed as unsupported" if has else "missing and not listed as unsupported"))


def test_unsupported_lists_name_only_what_the_sdk_has() -> None:
    methods = {f"{c}.{m}" for c, m in _methods()}
    assert set(sdk_parity.UNSUPPORTED_METHODS) <= methods
    assert set(sdk_parity.UNSUPPORTED_TOP_LEVEL) <= set(MANIFEST["top_level"])
    fields = {f"{t}.{f}" for t, fs in MANIFEST["types"].items() for f in fs}
    assert set(sdk_parity.UNSUPPORTED_FIELDS) <= fields
    for key in sdk_parity.UNSUPPORTED_PARAMS:
        client, method, param = key.split(".")
        assert param in MANIFEST["clients"][client][method]["params"], key
    reasons = [*sdk_parity.UNSUPPORTED_TOP_LEVEL.values(), *sdk_parity.UNSUPPORTED_METHODS.values(),
               *sdk_parity.UNSUPPORTED_PARAMS.values(), *sdk_parity.UNSUPPORTED_FIELDS.values()]
    assert all(len(r) > 20 for r in reasons)  # a reason, not a placeholder


def test_readme_shows_the_counts() -> None:
    text = DOC.read_text()
    for section, (done, total) in sdk_parity.counts(MANIFEST).items():
        assert re.search(rf"\|\s*{re.escape(section)}\s*\|\s*{done}\s*\|\s*{total}\s*\|", text), (
            f"docs/tinker-api.md's SDK parity table should have the row | {section} | {done} | {total} |")


def test_every_implemented_sync_method_has_its_async_twin() -> None:
    # Beyond the manifest: grpo's own public calls come in pairs too.
    for name, cls in CLIENTS.items():
        for attr in dir(cls):
            fn = getattr(cls, attr)
            if attr.startswith("_") or attr.endswith("_async") or not inspect.isfunction(fn):
                continue
            if attr in ("result", "done", "get_tokenizer", "get_telemetry", "close", "create_rest_client"):
                continue  # future protocol and calls the SDK itself has no twin for
            assert hasattr(cls, f"{attr}_async"), f"{name}.{attr} has no {attr}_async"
