"""grpo.serve's limits on a request as a whole and its bounds on every number (issue #37 B, C):
a real server with the tiny model. A request is measured from what it declares (shapes, buffer and
list lengths, JSON items and depth) before anything of its size is built; every bad number is a
422 naming its field; the server serves on afterwards and nothing accumulated is lost."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import psutil
import pytest
from serve_helpers import served_tiny_model, wait
from test_serve_hostile import refused

from grpo import types as g
from grpo.serve import proto
from grpo.serve.guard import JsonScan

LIMITS = ("--max-prompt-tokens", "1024", "--max-request-elements", "2000",
          "--max-request-tokens", "1000", "--max-json-depth", "16")
PROTOBUF = "application/x-protobuf"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with served_tiny_model(tmp_path_factory.mktemp("limits"), LIMITS) as served:
        yield {**served, "rss": psutil.Process(served["srv"].proc.pid)}


def rss_growth(env, send) -> tuple[float, object]:
    """MB the server's resident memory grew by while answering ``send()``, and its answer."""
    before = env["rss"].memory_info().rss
    answer = send()
    return (env["rss"].memory_info().rss - before) / 2**20, answer


def datum(n: int = 3, **inputs) -> dict:
    inputs = inputs or {"target_tokens": {"data": [2] * n, "dtype": "int64"},
                        "weights": {"data": [1.0] * n, "dtype": "float32"}}
    return {"model_input": {"chunks": [{"tokens": list(range(1, n + 1))}]}, "loss_fn_inputs": inputs}


def loss(env, data: list[dict], route: str = "forward_backward", loss_fn: str = "cross_entropy"):
    key = "forward_backward_input" if route == "forward_backward" else "forward_input"
    return env["srv"].call("POST", f"/api/v1/{route}", {"model_id": env["model_id"],
                                                         key: {"data": data, "loss_fn": loss_fn}})


def trains_on(env) -> float:
    """A valid forward_backward still works; its loss."""
    status, body = loss(env, [datum()])
    assert status == 200, body
    result = wait(env["srv"], body["request_id"])
    assert "error" not in result, result
    return result["metrics"]["loss:sum"]


def samples_on(env) -> None:
    status, body = env["srv"].call("POST", "/api/v1/asample", {
        "sampling_session_id": env["sampler"], "prompt": {"chunks": [{"tokens": [1, 2, 3]}]},
        "sampling_params": {"max_tokens": 2, "temperature": 0.0}})
    assert status == 200, body
    assert len(wait(env["srv"], body["request_id"])["sequences"][0]["tokens"]) == 2


def proto_datum(request, n: int = 3):
    d = request.data.add()
    d.model_input.add().encoded_text.tokens = np.arange(1, n + 1, dtype=np.int32).tobytes()
    return d


def empty_csr(d, key: str, shape: list[int]) -> None:
    tensor = d.loss_fn_inputs[key]
    tensor.dtype = 1
    tensor.shape.extend(shape)
    tensor.sparse_csr.crow_indices = np.zeros(2 if len(shape) == 1 else shape[0] + 1, dtype=np.int64).tobytes()


# ------------------------------------------------------------------ B. nothing allocated before a refusal

def test_sparse_tensors_are_refused_from_their_declared_size_before_allocation(env):
    # The 347-byte body: 8 empty CSR tensors of 2**24 declared entries on a 3-token datum
    # (1.2 GB and 3.3 s before its 422 when each was made dense first).
    request = proto.ForwardBackwardRequest(model_id=env["model_id"], loss_fn="cross_entropy")
    d = proto_datum(request)
    for k in range(8):
        empty_csr(d, f"k{k}", [2**24])
    grew, answer = rss_growth(env, lambda: env["srv"].call("POST", "/api/v1/forward_backward",
                                                           request.SerializeToString(), content_type=PROTOBUF))
    refused(answer, 422, "data[0].loss_fn_inputs.k", "declares 16777216 entries but model_input has 3 tokens")
    assert grew < 50, f"the server grew by {grew:.0f} MB for a refused 347-byte request"
    trains_on(env)


def test_tensor_elements_are_summed_over_the_whole_request(env):
    # Each tensor fits its datum; together they pass --max-request-elements 2000 (at 3 x 250 a datum,
    # the third datum's last tensor), while the tokens (4 x 250) are within --max-request-tokens.
    request = proto.ForwardBackwardRequest(model_id=env["model_id"], loss_fn="cross_entropy")
    for _ in range(4):
        d = proto_datum(request, 250)
        empty_csr(d, "weights", [250])
        empty_csr(d, "advantages", [250])
        d.loss_fn_inputs["target_tokens"].CopyFrom(proto.Tensor(dtype=2, dense=np.ones(250, np.int64).tobytes()))
    refused(env["srv"].call("POST", "/api/v1/forward_backward", request.SerializeToString(), content_type=PROTOBUF),
            422, "data[2].loss_fn_inputs", "request to 2250 tensor elements, more than this server's limit of 2000 "
            "for a whole request (set by --max-request-elements)")
    # Tokens too: 5 datums of 250 tokens pass --max-request-tokens 1000, whatever their tensors.
    refused(loss(env, [datum(250) for _ in range(5)]), 422, "data[4].model_input",
            "request to 1250 tokens, more than this server's limit of 1000 for a whole request "
            "(set by --max-request-tokens)")
    trains_on(env)


def test_a_json_tensor_without_shape_is_held_to_the_element_limits(env):
    # Without "shape" a tensor's length is its declared size (it used to skip the element limits).
    refused(loss(env, [datum(target_tokens={"data": [0] * 600, "dtype": "int64"})]), 422, "target_tokens",
            "declares 600 entries but model_input has 3 tokens")
    three = {k: {"data": [1] * 700, "dtype": "int64"} for k in ("target_tokens", "weights", "advantages")}
    refused(loss(env, [datum(700, **three)]), 422, "data[0].loss_fn_inputs.advantages",
            "request to 2100 tensor elements, more than this server's limit of 2000")
    trains_on(env)


def refused_while_arriving(env, route: str, body: bytes, flag: str) -> None:
    """``body`` is refused by its JSON item count (422 naming ``flag``) before a parser builds it:
    the server grows by less than 60 MB."""
    grew, answer = rss_growth(env, lambda: env["srv"].call("POST", route, body))
    refused(answer, 422, "body", "JSON items")
    assert flag in answer[1]["detail"]
    assert grew < 60, f"the server grew by {grew:.0f} MB for a refused {len(body) >> 20} MB body"


def test_a_json_body_with_more_numbers_than_a_request_may_declare_is_refused_while_it_arrives(env):
    # 5 million numbers (11 MB) for a route that may declare 2000 + 1000 + slack: refused by the
    # body's item count before any parser builds a list of them.
    body = json.dumps({"model_id": env["model_id"], "forward_backward_input": {"data": [
        datum(target_tokens={"data": [0.5] * 5_000_000, "dtype": "float32"})]}}, separators=(",", ":")).encode()
    refused_while_arriving(env, "/api/v1/forward_backward", body, "--max-request-elements")
    trains_on(env)


def test_a_huge_sample_prompt_is_refused_before_it_is_parsed(env):
    # The asample body: 22 MB, 11.5 M tokens (it grew the server by 320 MB before its 422).
    tokens = ",".join(["1"] * (11 * 2**20))
    body = (f'{{"sampling_session_id":"{env["sampler"]}","prompt":{{"chunks":[{{"tokens":[{tokens}]}}]}},'
            '"sampling_params":{"max_tokens":2}}').encode()
    refused_while_arriving(env, "/api/v1/asample", body, "--max-prompt-tokens")
    samples_on(env)


def test_json_nested_deeper_than_the_limit_is_refused(env):
    deep: object = "x"
    for _ in range(40):
        deep = {"a": [deep]}
    refused(env["srv"].call("POST", "/api/v1/create_session", {"user_metadata": deep}), 422, "body",
            "deep is more than this server's limit of 16 (set by --max-json-depth)")
    # Brackets inside strings are text, not nesting.
    status, _ = env["srv"].call("POST", "/api/v1/create_session", {"user_metadata": {"k": "[[[{{{\\\"" * 50}})
    assert status == 200
    samples_on(env)


def test_json_scan_measures_depth_and_items_exactly_across_pieces():
    def depth(v):
        return 1 + max(map(depth, v.values() if isinstance(v, dict) else v), default=0) \
            if isinstance(v, (list, dict)) else 0

    def items(v):
        inner = list(v.values()) if isinstance(v, dict) else v if isinstance(v, list) else []
        return len(inner) + sum(map(items, inner))

    def value(rng: random.Random, level: int = 0):
        r = rng.random()
        if level < 6 and r < 0.3:
            return [value(rng, level + 1) for _ in range(rng.randint(0, 4))]
        if level < 6 and r < 0.5:
            return {rng.choice(['a', 'b"[', 'c\\', '{x', ',']) + str(i): value(rng, level + 1)
                    for i in range(rng.randint(0, 3))}
        return rng.choice(['[', '{"', '\\"]', 'x\\\\', '\\\\"', ',,', '', '\\', '\\\\\\"', 1.5, None])

    rng = random.Random(0)
    for _ in range(500):
        v = value(rng)
        text = json.dumps(v).encode()
        scan = JsonScan()
        cuts = sorted(rng.sample(range(len(text) + 1), min(6, len(text) + 1)))
        for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
            scan.feed(text[start:end])
        opened = text.count(b"[") + text.count(b"{")  # an upper bound on containers (strings may hold some)
        assert scan.max_depth == depth(v) and scan.depth == 0, text
        assert items(v) <= scan.items <= items(v) + opened, text


# ------------------------------------------------------------------ C. bad input: a 4xx naming the field

def test_shapes_no_array_can_have_are_422(env):
    refused(loss(env, [datum(target_tokens={"data": [], "dtype": "int64", "shape": [0, 2**70]})]), 422,
            "target_tokens.shape", "in one dimension")
    request = proto.ForwardBackwardRequest(model_id=env["model_id"], loss_fn="cross_entropy")
    tensor = proto_datum(request).loss_fn_inputs["target_tokens"]
    tensor.dtype = 2
    tensor.shape.extend([0, 2**62])
    refused(env["srv"].call("POST", "/api/v1/forward_backward", request.SerializeToString(), content_type=PROTOBUF),
            422, "target_tokens.shape", "in one dimension")
    trains_on(env)


def test_a_token_beyond_int64_is_422(env):
    refused(loss(env, [datum(target_tokens={"data": [2**70, 1, 2], "dtype": "int64"})]), 422,
            "target_tokens.data", "int64")
    trains_on(env)


def test_a_base_model_name_too_long_for_a_path_is_422(env):
    refused(env["srv"].call("POST", "/api/v1/create_model", {"session_id": env["session"], "model_seq_id": 7,
                                                             "base_model": "x" * 10_000}),
            422, "base_model", "10000 characters")
    trains_on(env)


@pytest.mark.parametrize(("name", "value", "says"), [
    ("temperature", math.nan, "finite"), ("temperature", math.inf, "finite"), ("top_p", math.nan, "(0, 1]"),
    ("top_k", 10**12, "2147483647"), ("seed", 2**80, "int64")])
def test_sampling_numbers_out_of_bounds_are_422_naming_the_field(env, name, value, says):
    refused(env["srv"].call("POST", "/api/v1/asample", {
        "sampling_session_id": env["sampler"], "prompt": {"chunks": [{"tokens": [1, 2]}]},
        "sampling_params": {"max_tokens": 2, name: value}}), 422, f"sampling_params.{name}", says)
    samples_on(env)


@pytest.mark.parametrize(("name", "value"), [("learning_rate", 1e308), ("learning_rate", math.inf),
                                             ("eps", math.inf), ("weight_decay", math.inf),
                                             ("grad_clip_norm", math.nan), ("beta2", math.nan)])
def test_optimizer_numbers_out_of_bounds_are_422_and_the_model_trains_on(env, name, value):
    refused(env["srv"].call("POST", "/api/v1/optim_step", {"model_id": env["model_id"], "adam_params": {name: value}}),
            422, f"adam_params.{name}", "must be a finite number")
    assert math.isfinite(trains_on(env))  # it used to be a 500 on every forward after one such step


def test_a_non_finite_loss_is_the_callers_error_and_keeps_earlier_gradients(env):
    srv = env["srv"]
    trains_on(env)  # gradients accumulated before the bad call
    bad = datum(target_tokens={"data": [2, 3, 4], "dtype": "int64"},
                logprobs={"data": [-1e30] * 3, "dtype": "float32"}, advantages={"data": [1.0] * 3, "dtype": "float32"})
    status, body = loss(env, [bad], loss_fn="importance_sampling")
    assert status == 200, body
    result = wait(srv, body["request_id"])  # a 500 here is retried by the SDK without end
    assert result["category"] == "user" and "loss is not finite" in result["error"], result
    status, body = srv.call("POST", "/api/v1/optim_step", {"model_id": env["model_id"],
                                                           "adam_params": {"learning_rate": 1e-3}})
    assert status == 200, body
    metrics = wait(srv, body["request_id"])["metrics"]
    assert 0 < metrics["grad_norm"] < math.inf, metrics  # the good call's gradients survived
    assert math.isfinite(trains_on(env))


def test_the_bounds_hold_in_process_and_admit_the_sdks_defaults():
    g.AdamParams(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-12)  # the Tinker SDK's AdamParams
    g.AdamParams(learning_rate=5e-4, weight_decay=0.1, grad_clip_norm=1.0)
    g.SamplingParams(max_tokens=16, temperature=0.0, top_k=-1, top_p=1.0, seed=0)
    g.SamplingParams(top_k=50, top_p=0.9, seed=2**63 - 1)
    for kwargs, name in [({"learning_rate": math.inf}, "learning_rate"), ({"eps": 0.0}, "eps"),
                         ({"learning_rate": 10.0, "weight_decay": 0.5}, "weight_decay")]:
        with pytest.raises(g.ParamError) as err:
            g.AdamParams(**kwargs)
        assert err.value.field == name
    with pytest.raises(g.ParamError, match="top_p") as err:
        g.SamplingParams(top_p=math.nan)
    assert err.value.field == "top_p"
