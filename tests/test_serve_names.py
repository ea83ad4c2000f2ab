"""One way in for names (issue #37): every string a client can send to grpo.serve is of a declared
kind (grpo/serve/bodies.py), and every kind that reaches the file system passes the one name rule
at the door. The routes are read from the server's own OpenAPI schema, so a route added later with
a string field nobody classified, or a path-like field without the rule, fails here."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient

from grpo.api import names
from grpo.backends.local import ServiceClient
from grpo.serve import bodies
from grpo.serve.app import create_app

API_KEY = "tml-names-test"
# The kinds that name a place on disk, and what a hostile client would try for each.
HOSTILE = {
    "name": ["/etc/evil", "../x", "a/b", "x.meta.json", ".hidden", "", " ", "a" * 129, "x.tmp"],
    "tinker_path": ["/etc/passwd", "../x", "tinker://../../etc/passwd", "tinker://run/weights/../../x",
                    "tinker://run/weights/a/b", "tinker://run/elsewhere/x", "tinker://.r/weights/x", "file:///etc"],
    "run_id": [".hidden", "-x", "a" * 129, "r.tmp", "a b"],
    "checkpoint_id": ["weights/../../x", "etc/passwd", "weights/.x", "weights", "weights/a/b", "weights/x.old"],
}
KINDS = {*HOSTILE, "model", "ref", "text"}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    return create_app(API_KEY, ServiceClient(checkpoint_dir=tmp_path_factory.mktemp("store")))


@pytest.fixture(scope="module")
def client(app):
    return TestClient(app, headers={"X-API-Key": API_KEY})


def resolve(schema: dict, spec: dict) -> dict:
    while "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def string_fields(schema: dict, spec: dict, where: str, seen: frozenset = frozenset()):
    """(where, schema) of every string a value of ``schema`` can hold, nested fields included."""
    ref = schema.get("$ref")
    if ref in seen:
        return
    seen = seen | {ref} if ref else seen
    schema = resolve(schema, spec)
    for option in schema.get("anyOf", []) + schema.get("oneOf", []) + schema.get("allOf", []):
        yield from string_fields({**option, **{k: v for k, v in schema.items() if k == bodies.FIELD_KIND}},
                                 spec, where, seen)
    if schema.get("type") == "string":
        yield where, schema
    for name, sub in schema.get("properties", {}).items():
        yield from string_fields(sub, spec, f"{where}.{name}", seen)
    if isinstance(schema.get("items"), dict):
        yield from string_fields(schema["items"], spec, f"{where}[]", seen)
    if isinstance(schema.get("additionalProperties"), dict):
        yield from string_fields(schema["additionalProperties"], spec, f"{where}{{}}", seen)


def every_string_field(app) -> list[tuple[str, str, dict]]:
    """(route, field, schema) of every string in a route's parameters and JSON body, and in every
    body model (forward_backward reads its body by hand, so the schema alone would miss it)."""
    spec = app.openapi()
    found = []
    for route, ops in spec["paths"].items():
        for method, op in ops.items():
            for param in op.get("parameters", []):
                found += [(f"{method.upper()} {route}", where, s)
                          for where, s in string_fields(param["schema"], spec, param["name"])]
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            if body:
                found += [(f"{method.upper()} {route}", where, s) for where, s in string_fields(body, spec, "body")]
    models = {cls for cls in _subclasses(bodies.Body)}
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        local = {"components": {"schemas": schema.get("$defs", {})}}
        found += [(model.__name__, where, s) for where, s in string_fields(schema, local, "body")]
    return found


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_every_string_a_client_sends_is_of_a_declared_kind(app):
    fields = every_string_field(app)
    assert len(fields) > 30  # the walk reaches the routes' fields
    unclassified = [(route, where) for route, where, schema in fields
                    if schema.get(bodies.FIELD_KIND) not in KINDS and "enum" not in schema and "const" not in schema]
    assert not unclassified, ("string fields without a kind (give them one of bodies.Name, TinkerPath, "
                              f"ModelName, Ref, Text or a *InPath type): {unclassified}")
    # a field called a path is one: calling it Text would take it past the rule
    assert all(schema.get(bodies.FIELD_KIND) in HOSTILE for _, where, schema in fields
               if where.rsplit(".", 1)[-1].endswith("path") or where.endswith("_id") and "{" in where)
    kinds = {schema.get(bodies.FIELD_KIND) for _, _, schema in fields}
    assert set(HOSTILE) <= kinds  # every kind that reaches the disk is used, so tested below


def filler(schema: dict, spec: dict) -> Any:
    """A value the schema accepts, as small as can be (required fields only)."""
    schema = resolve(schema, spec)
    if "anyOf" in schema:
        return filler(next(o for o in schema["anyOf"] if o.get("type") != "null"), spec)
    kind = schema.get(bodies.FIELD_KIND)
    if "enum" in schema or "const" in schema:
        return schema.get("const", (schema.get("enum") or [None])[0])
    return {"name": "ok", "tinker_path": "tinker://run/weights/ok", "run_id": "run",
            "checkpoint_id": "weights/ok"}.get(kind) if kind in HOSTILE else {
        "string": "ok", "integer": 1, "number": 1.0, "boolean": False, "array": [], "null": None,
        "object": {k: filler(v, spec) for k, v in schema.get("properties", {}).items()
                   if k in schema.get("required", [])}}.get(schema.get("type"), "ok")


def hostile_requests(app):
    """(method, url, json body, field, value) for every route field of a disk kind and every
    hostile value of that kind: each request is otherwise well formed."""
    spec = app.openapi()
    for route, ops in spec["paths"].items():
        for method, op in ops.items():
            params = {p["name"]: p for p in op.get("parameters", []) if p["in"] == "path"}
            good = {name: filler(p["schema"], spec) for name, p in params.items()}
            body_schema = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            body = filler(body_schema, spec) if body_schema else None
            for name, p in params.items():
                for value in HOSTILE.get(p["schema"].get(bodies.FIELD_KIND), []):
                    url = route.format(**{**good, name: quote(value, safe="/")})
                    yield method, url, body, name, value, True
            if body_schema:
                for field, sub in resolve(body_schema, spec).get("properties", {}).items():
                    kinds = {resolve(o, spec).get(bodies.FIELD_KIND) for o in [sub, *sub.get("anyOf", [])]}
                    for kind in kinds & set(HOSTILE):
                        for value in HOSTILE[kind]:
                            yield method, route.format(**good), {**body, field: value}, field, value, False


def test_every_field_that_names_a_file_passes_the_name_rule_at_the_door(app, client):
    checked = 0
    for method, url, body, field, value, in_url in hostile_requests(app):
        response = client.request(method.upper(), url, json=body)
        detail = response.json().get("detail")
        if in_url and ("/" in value or not value.strip()):
            # no longer one segment of the URL: the route parses differently (or not at all), a 4xx
            assert 400 <= response.status_code < 500, (method, url, response.status_code, detail)
            continue
        assert response.status_code == 422, (method, url, body, response.status_code, detail)
        assert isinstance(detail, list) and any(d["loc"][-1] == field for d in detail), (url, field, detail)
        checked += 1
    assert checked > 60


def test_a_servers_clients_never_save_into_a_directory(tmp_path):
    """Below the routes too: the server turns directory saves off on its ServiceClient, so a save
    that reached a client with a path would still be refused (in-process, a path stays a directory)."""
    service = ServiceClient(checkpoint_dir=tmp_path / "store")
    create_app(API_KEY, service)
    client = service.create_lora_training_client("tiny", rank=2)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    for save in (client.save_state, client.save_weights_for_sampler, client.save_weights_external):
        for target in (str(victim), "../victim", "a/b"):
            with pytest.raises(names.UnsafeName, match="a name is"):
                save(target)
    assert [p.name for p in victim.iterdir()] == ["keep.txt"] and not (tmp_path / "a").exists()
    in_process = ServiceClient(checkpoint_dir=tmp_path / "store2").create_lora_training_client("tiny", rank=2)
    in_process.save_weights_for_sampler(str(tmp_path / "mine")).result()
    assert (tmp_path / "mine" / "adapter_config.json").exists()
