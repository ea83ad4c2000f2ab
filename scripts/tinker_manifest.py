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
import functools
import inspect
import json
import sys

CLIENTS = ("ServiceClient", "TrainingClient", "SamplingClient", "RestClient")
# The types a user builds (inputs) or reads (results) in ordinary SDK programs.
TYPES = (
    "ModelInput", "EncodedTextChunk", "TensorData", "Datum", "SamplingParams", "AdamParams",
    "SampleResponse", "SampledSequence", "ForwardBackwardOutput", "OptimStepResponse",
    "SaveWeightsResponse", "SaveWeightsForSamplerResponse", "LoadWeightsResponse", "GetInfoResponse",
    "ModelData", "GetServerCapabilitiesResponse", "SupportedModel", "Checkpoint", "CheckpointsListResponse",
    "Cursor", "TrainingRun", "TrainingRunsResponse", "WeightsInfoResponse", "ExternalWeightsUrlsResponse",
    "ParsedCheckpointTinkerPath",
)


def method_entry(fn) -> dict:
    params = list(inspect.signature(fn).parameters.values())[1:]  # drop self
    return {
        "async": inspect.iscoroutinefunction(inspect.unwrap(fn)),  # @deprecated wrappers hide it
        "params": [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)],
        "keyword_only": [p.name for p in params if p.kind == p.KEYWORD_ONLY],
        "required": [p.name for p in params if p.default is p.empty
                     and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)],
    }


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


def main() -> None:
    import tinker

    manifest = {
        "sdk": "tinker",
        "version": tinker.__version__,
        "top_level": sorted(n for n in tinker.__all__ if not n.startswith("__")),
        "clients": {name: client_methods(getattr(tinker, name)) for name in CLIENTS},
        "types": {name: type_fields(getattr(tinker.types, name)) for name in TYPES},
    }
    json.dump(manifest, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
