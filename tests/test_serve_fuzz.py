"""No 5xx from anything a client can send (issue #37, deliverable 3): a property-based fuzzer of the
Tinker HTTP API against a real ``python -m grpo.serve`` on 127.0.0.1 with the tiny model.

Schemathesis generates requests for every route from the server's own OpenAPI schema; ids the
server issued (session, model, sampler: the ``ref`` kind in grpo/serve/bodies.py) are swapped for
live ones in half the cases, so requests reach the handlers and the model instead of stopping at
a 404. The protobuf forward_backward body, which the schema cannot express, gets Hypothesis
strategies of its own. Every answer must be below 500, every finished future a result or an error
result (never a 5xx), the server must answer a valid request after each route's cases, and nothing
may change outside the checkpoint store. The number of cases run is printed at the end.

Slow (about two minutes): CI's slow set runs it."""

from __future__ import annotations

import random
import tempfile

import numpy as np
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from serve_helpers import API_KEY, Server, served_tiny_model, wait

from grpo.backends.local import ServiceClient
from grpo.serve import proto
from grpo.serve.app import create_app

pytestmark = pytest.mark.slow

# Small limits, so fuzzed sizes reach them quickly and accepted work stays short on 2 cores.
LIMITS = ("--max-body-mb", "2", "--max-prompt-tokens", "64", "--max-new-tokens", "8", "--max-num-samples", "2",
          "--max-tensor-elements", "4096", "--max-datums", "4", "--client-timeout-s", "600")
CASES_PER_ROUTE = 30
COUNT = {"cases": 0, "statuses": {}}



def api_schema() -> dict:
    """The server's own OpenAPI schema (its /openapi.json is not served: nothing is without the key)."""
    with tempfile.TemporaryDirectory() as store:
        return create_app(API_KEY, ServiceClient(checkpoint_dir=store)).openapi()


SCHEMA = schemathesis.openapi.from_dict(api_schema())


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with served_tiny_model(tmp_path_factory.mktemp("fuzz"), LIMITS) as served:
        ids = {"session_id": served["session"], "model_id": served["model_id"], "run_id": served["model_id"],
               "sampling_session_id": served["sampler"], "sampler_id": served["sampler"]}
        yield {"srv": served["srv"], "ids": ids}
    print(f"\nfuzzed grpo.serve with {COUNT['cases']} cases; statuses {dict(sorted(COUNT['statuses'].items()))}")


def with_live_ids(case, ids: dict[str, str], rng: random.Random) -> None:
    """Half the time, an id field of the body or the URL names the live session/model/sampler."""
    if isinstance(case.body, dict):
        for key in list(case.body):
            if key in ids and rng.random() < 0.5:
                case.body[key] = ids[key]
    for key in list(case.path_parameters or {}):
        if key in ids and rng.random() < 0.5:
            case.path_parameters[key] = ids[key]


def check_answer(srv: Server, status: int, body: dict) -> None:
    COUNT["cases"] += 1
    COUNT["statuses"][status] = COUNT["statuses"].get(status, 0) + 1
    assert status < 500, body
    if status == 200 and isinstance(body, dict) and "request_id" in body:
        result = wait(srv, body["request_id"])  # a future's failure is an error result, not a 5xx
        assert isinstance(result, dict)


def answers_normally(srv: Server, ids: dict[str, str]) -> None:
    status, body = srv.call("POST", "/api/v1/asample", {
        "sampling_session_id": ids["sampling_session_id"], "num_samples": 1,
        "prompt": {"chunks": [{"tokens": [1, 2, 3]}]}, "sampling_params": {"max_tokens": 2, "temperature": 0.0}})
    assert status == 200, body
    assert len(wait(srv, body["request_id"])["sequences"][0]["tokens"]) == 2


@SCHEMA.parametrize()
@settings(max_examples=CASES_PER_ROUTE, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck))
def test_no_route_answers_5xx(case, live):
    srv, ids = live["srv"], live["ids"]
    with_live_ids(case, ids, random.Random(repr(case.body) + repr(case.path_parameters)))
    if case.operation.path.endswith("/sessions/{session_id}/finish") and case.path_parameters.get(
            "session_id") == ids["session_id"]:
        return  # ending the live session (its models unloaded) would turn every later case into a 404
    response = case.call(base_url=srv.url, headers={"X-API-Key": API_KEY}, timeout=120)
    try:
        body = response.json()
    except ValueError:
        body = {"raw": response.text[:300]}
    check_answer(srv, response.status_code, body)


@pytest.fixture(autouse=True)
def serves_on_after_each_route(live):
    yield
    answers_normally(live["srv"], live["ids"])


# ------------------------------------------------------------------ protobuf forward_backward

DIMS = st.one_of(st.integers(-3, 8), st.sampled_from([0, 2**31, 2**62, 2**63 - 1, -(2**63)]))
FLOATS = st.floats(width=32) | st.sampled_from([-1e30, 1e30, 0.0, -0.0])


@st.composite
def tensors(draw, n: int, ints: bool):
    """Mostly a well-formed tensor of ``n`` values (so the datum reaches the loss), else wild:
    another dtype, a declared shape that lies, random bytes, a sparse encoding."""
    values = draw(st.lists(st.integers(0, 60) | st.integers(-(2**63), 2**63 - 1), min_size=n, max_size=n)
                  if ints else st.lists(FLOATS, min_size=n, max_size=n))
    tensor = proto.Tensor(dtype=2 if ints else 1)
    tensor.dense = np.asarray(values, dtype=np.int64 if ints else np.float32).tobytes()
    tensor.shape.extend([n])
    wild = draw(st.integers(0, 5))
    if wild == 1:
        tensor.dtype = draw(st.integers(0, 4))
    elif wild == 2:
        del tensor.shape[:]
        tensor.shape.extend(draw(st.lists(DIMS, max_size=3)))
    elif wild == 3:
        tensor.dense = draw(st.binary(max_size=64))
    elif wild == 4:
        csr = tensor.sparse_csr
        csr.values = tensor.dense
        csr.crow_indices = np.asarray(draw(st.lists(st.integers(-2, 6), max_size=4)), dtype=np.int64).tobytes()
        csr.col_indices = np.asarray(draw(st.lists(st.integers(-2, 6), max_size=4)), dtype=np.int64).tobytes()
    return tensor


@st.composite
def forward_backward_bodies(draw, model_id: str):
    request = proto.ForwardBackwardRequest(
        model_id=draw(st.sampled_from([model_id, model_id, "nobody", ""])),
        loss_fn=draw(st.sampled_from(["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "", "x"])),
        forward_only=draw(st.booleans()))
    for _ in range(draw(st.integers(0, 3))):
        datum = request.data.add()
        tokens = draw(st.lists(st.integers(0, 60) | st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=8))
        datum.model_input.add().encoded_text.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        keys = ["target_tokens", "weights"] + draw(st.lists(st.sampled_from(["logprobs", "advantages", "x"]),
                                                            max_size=3, unique=True))
        for key in keys:
            datum.loss_fn_inputs[key].CopyFrom(draw(tensors(len(tokens), ints=key == "target_tokens")))
    for key, value in draw(st.dictionaries(st.sampled_from(["clip_low_threshold", "tis_cap", "beta", "x"]),
                                           st.floats(allow_nan=True, allow_infinity=True), max_size=2)).items():
        request.loss_fn_config[key] = value
    return request.SerializeToString()


def test_no_protobuf_forward_backward_answers_5xx(live):
    srv, ids = live["srv"], live["ids"]

    @settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(forward_backward_bodies(ids["model_id"]))
    def one(raw: bytes) -> None:
        status, body = srv.call("POST", "/api/v1/forward_backward", raw, content_type="application/x-protobuf")
        check_answer(srv, status, body)

    one()

