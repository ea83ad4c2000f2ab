"""Does the installed SDK fit the server? Said in one line at start-up, not found out mid-run.

Tinker SDKs changed wire format twice: up to 0.24 they send forward_backward as JSON (and
forward to its own /forward route); from 0.25 as protobuf, reading sample and forward_backward
results only as protobuf; from 0.26 they also require ``sample_sequence_ids`` in asample's answer
(``assert sample_sequence_ids is not None`` in SamplingClient; 0.25.0 has no such check). A
server built for one generation fails the other mid-run with an opaque error (SkyRL 0.4's server
answers SDK 0.22's /forward with 404 and its JSON forward_backward with 415, and SDK 0.38's first
sample() ends in that AssertionError).

Cheap requests tell: each JSON route is probed with an empty JSON body, which a server that has
the route and reads JSON rejects for the missing fields (4xx naming them), and a server without it
answers 404 Not Found or 415. A FastAPI server that publishes its API (/openapi.json, SkyRL's
does) declares asample's response model, and FastAPI sends only that model's fields: if
``sample_sequence_ids`` is not among them, no answer will carry it. A server that says what it is
and which SDKs it was tested with (grpo serve does, in /healthz) is named in the line too.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from typing import Any

PROTOBUF_SINCE = (0, 25)  # first SDK that sends forward_backward as protobuf
SEQUENCE_IDS_SINCE = (0, 26)  # first SDK that requires sample_sequence_ids from asample
FITS_BOTH = "tinker==0.25.0"  # protobuf, and no sample_sequence_ids needed
ASAMPLE = "/api/v1/asample"


@dataclass(frozen=True)
class Compatibility:
    fits: bool | None  # None: nothing certain either way
    line: str


def sdk_version(package: str = "tinker") -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _route_missing(status: int, body: Any) -> bool:
    return status == 404 and body == {"detail": "Not Found"}


def asample_fields(openapi: Any) -> frozenset[str] | None:
    """The fields of asample's 200 answer as an OpenAPI document declares them; None when it
    declares none (no document, no such route, or an untyped answer)."""
    try:
        schema = openapi["paths"][ASAMPLE]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
        ref = schema.get("$ref", "")
        if ref.startswith("#/components/schemas/"):
            schema = openapi["components"]["schemas"][ref.rsplit("/", 1)[1]]
        properties = schema["properties"]
    except (KeyError, TypeError, AttributeError):
        return None
    return frozenset(properties) if isinstance(properties, dict) else None


def no_sequence_ids_line(version: str, server: str, evidence: str) -> str:
    return (f"tinker SDK {version} does not fit the server at {server}: its asample answer has no "
            f"sample_sequence_ids ({evidence}), which SDKs from {'.'.join(map(str, SEQUENCE_IDS_SINCE))} "
            f"require; pip install '{FITS_BOTH}' (with backend=tinker)")


def mid_run_misfit(err: BaseException, endpoint: str) -> str | None:
    """The line for an SDK assertion that shows the server does not fit, where the start-up check
    could not tell (a server that publishes no /openapi.json); None for anything else."""
    if isinstance(err, AssertionError) and "sample_sequence_ids" in str(err):
        return no_sequence_ids_line(sdk_version(), endpoint, f"the SDK: {err}")
    return None


def judge(version: str, server: dict[str, Any] | None, forward: tuple[int, Any] | None,
          json_fwdbwd: tuple[int, Any] | None, endpoint: str,
          sample_fields: frozenset[str] | None = None) -> Compatibility:
    """The verdict from what the probes saw: (status, JSON body) of an empty POST to /forward and
    a JSON POST to /forward_backward; ``server`` is /healthz's JSON when it names the server;
    ``sample_fields`` are asample's answer fields as the server's OpenAPI document declares them."""
    name = f"tinker SDK {version}"
    who = ""
    if server and server.get("server"):
        tested = server.get("tested_sdks")
        who = f" ({server['server']} {server.get('version', '')}".rstrip() + (
            f", tested with SDK {', '.join(tested)})" if tested else ")")
    json_sdk = bool(_version_tuple(version)) and _version_tuple(version) < PROTOBUF_SINCE
    no_sequence_ids = sample_fields is not None and "sample_sequence_ids" not in sample_fields
    if json_sdk:
        missing = [what for what, probe in (("/forward", forward), ("JSON forward_backward", json_fwdbwd))
                   if probe is not None and (_route_missing(*probe) or probe[0] == 415)]
        if missing:
            return Compatibility(False, f"{name} does not fit the server at {endpoint}{who}: it has no "
                                 f"{' and no '.join(missing)}, which this SDK needs; it wants protobuf: "
                                 f"pip install '{FITS_BOTH if no_sequence_ids else 'tinker>=0.25'}' (with backend=tinker)")
    if no_sequence_ids and _version_tuple(version) >= SEQUENCE_IDS_SINCE:
        evidence = f"its /openapi.json declares only {', '.join(sorted(sample_fields or ()))}"
        return Compatibility(False, no_sequence_ids_line(version, endpoint + who, evidence))
    if server and server.get("tested_sdks"):
        newest = max(_version_tuple(v) for v in server["tested_sdks"])
        if _version_tuple(version) > newest:
            return Compatibility(None, f"{name} with the server at {endpoint}{who}: newer than any SDK it was "
                                 "tested with; if a call fails oddly, try that version")
        return Compatibility(True, f"{name} fits the server at {endpoint}{who}")
    return Compatibility(None, f"{name} with the server at {endpoint}{who}")


def probe(base_url: str, api_key: str | None, timeout_s: float
          ) -> tuple[dict | None, tuple | None, tuple | None, frozenset[str] | None]:
    """(healthz JSON naming a server or None, /forward probe, JSON /forward_backward probe,
    asample's declared answer fields or None)."""
    import httpx

    headers = {"X-API-Key": api_key} if api_key else {}
    results: list[Any] = []
    with httpx.Client(timeout=httpx.Timeout(timeout_s), headers=headers) as client:
        for method, path in (("GET", "/api/v1/healthz"), ("POST", "/api/v1/forward"),
                             ("POST", "/api/v1/forward_backward"), ("GET", "/openapi.json")):
            try:
                response = client.request(method, base_url + path, json={} if method == "POST" else None)
                try:
                    body = response.json()
                except ValueError:
                    body = None
                results.append((response.status_code, body))
            except (httpx.HTTPError, OSError):
                results.append(None)
    health = results[0]
    server = health[1] if health and health[0] == 200 and isinstance(health[1], dict) else None
    openapi = results[3]
    fields = asample_fields(openapi[1]) if openapi and openapi[0] == 200 else None
    return server, results[1], results[2], fields


def check(sdk_package: str, base_url: str, api_key: str | None, timeout_s: float) -> Compatibility:
    server, forward, json_fwdbwd, sample_fields = probe(base_url, api_key, timeout_s)
    return judge(sdk_version(sdk_package), server, forward, json_fwdbwd, base_url, sample_fields)
