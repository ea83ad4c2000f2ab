"""A loss registered with ``@register_loss`` is a loss everywhere (issue #39): the loop folds its
aggregation where its spec says, the local backend trains with it, and grpo.serve accepts it
(the server is built in this process with create_app, so it sees this test's registry; a
subprocess server would import only the package's losses). An unknown loss is still refused
with a 422 naming loss_fn and the registered ones."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from grpo import types
from grpo.api import losses
from grpo.backends.local import ServiceClient
from grpo.rl.advantages import build_datums, compute_advantages, select_for_training
from grpo.rl.rollouts import Group, Rollout, ScoredGroup
from grpo.serve.app import create_app

LOSS = "test_scaled_reinforce"
API_KEY = "tml-registered-loss"
TOKENS, TARGETS = [1, 504, 3458, 314], [504, 3458, 314, 28]
WEIGHTS, ADVANTAGES = [0.0, 1.0, 0.5, 2.0], [0.0, 1.5, -1.0, 0.25]


@pytest.fixture(scope="module")
def registered():
    """``-scale·Σ w·A·lp`` registered for this module only (the registry is left as it was)."""

    @losses.register_loss(LOSS, defaults={"scale": 1.0}, aggregate_into="weights")
    def scaled_reinforce(lp, inputs, params):
        mask = losses.token_mask(inputs)
        weights = inputs["weights"].float().where(mask, 0.0)
        return -(params["scale"] * weights * inputs["advantages"].float().where(mask, 0.0) * lp)

    yield losses.LOSSES[LOSS]
    del losses.LOSSES[LOSS]


@pytest.fixture(scope="module")
def svc(tmp_path_factory) -> ServiceClient:
    return ServiceClient(checkpoint_dir=tmp_path_factory.mktemp("ckpt"), device="cpu", dtype="float32")


def datum() -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(TOKENS),
                       loss_fn_inputs={"target_tokens": TARGETS, "weights": WEIGHTS, "advantages": ADVANTAGES,
                                       "logprobs": [0.0] * len(TOKENS)})


def expected_loss(svc: ServiceClient, scale: float) -> float:
    """``-scale·Σ w·A·lp`` from the model's own logprobs (a cross_entropy forward)."""
    client = svc.create_sampling_client(base_model="tiny")
    lps = client.compute_logprobs(types.ModelInput.from_ints([*TOKENS, TARGETS[-1]])).result()[1:]
    return -scale * sum(w * a * lp for w, a, lp in zip(WEIGHTS, ADVANTAGES, lps, strict=True) if w > 0)


def test_the_loop_folds_the_aggregation_where_the_spec_says(registered) -> None:
    groups = [ScoredGroup(Group(0, None, [1, 2], [Rollout([3, 4], [-1.0, -1.0], "stop", "x"),
                                                  Rollout([5], [-2.0], "stop", "x")]), [1.0, 0.0], [{}, {}], [])]
    samples = select_for_training(groups, compute_advantages(groups, "center", "keep"), True, "keep")
    datums, _ = build_datums(samples, LOSS, "seq_mean")
    # seq_mean over 2 sequences: 1/(2*2) per token of the first; the advantage stays whole
    assert datums[0].loss_fn_inputs["weights"].tolist()[-2:] == pytest.approx([0.25, 0.25])
    assert datums[0].loss_fn_inputs["advantages"].tolist()[-2:] == pytest.approx([0.5, 0.5])


def test_the_local_backend_trains_with_it(registered, svc) -> None:
    training = svc.create_lora_training_client("tiny", seed=0, rank=4)
    out = training.forward_backward([datum()], LOSS, {"scale": 2.0}).result()
    assert out.metrics["loss:sum"] == pytest.approx(expected_loss(svc, 2.0), rel=1e-4, abs=1e-5)


def test_the_server_accepts_it_and_refuses_an_unknown_loss(registered, svc) -> None:
    client = TestClient(create_app(API_KEY, svc), headers={"X-API-Key": API_KEY})

    def result(request_id: str) -> dict:
        for _ in range(20):
            body = client.post("/api/v1/retrieve_future", json={"request_id": request_id}).json()
            if body.get("type") != "try_again":
                return body
        raise AssertionError(f"{request_id} never finished")

    session = client.post("/api/v1/create_session", json={"sdk_version": "test"}).json()["session_id"]
    made = client.post("/api/v1/create_model", json={"session_id": session, "base_model": "tiny",
                                                     "lora_config": {"rank": 4, "seed": 0}}).json()
    assert result(made["request_id"])["model_id"] == made["model_id"]
    wire_datum = {"model_input": {"chunks": [{"tokens": TOKENS}]},
                  "loss_fn_inputs": {name: {"data": values, "dtype": "int64" if name == "target_tokens" else "float32"}
                                     for name, values in (("target_tokens", TARGETS), ("weights", WEIGHTS),
                                                          ("advantages", ADVANTAGES), ("logprobs", [0.0] * 4))}}

    def forward_backward(loss_fn: str):
        return client.post("/api/v1/forward_backward", json={
            "model_id": made["model_id"], "seq_id": None,
            "forward_backward_input": {"data": [wire_datum], "loss_fn": loss_fn, "loss_fn_config": {"scale": 3.0}}})

    answer = forward_backward(LOSS)
    assert answer.status_code == 200, answer.text
    assert result(answer.json()["request_id"])["metrics"]["loss:sum"] == pytest.approx(
        expected_loss(svc, 3.0), rel=1e-4, abs=1e-5)

    refused = forward_backward("no_such_loss")
    assert refused.status_code == 422
    detail = refused.json()["detail"][0]
    assert detail["loc"] == ["body", "loss_fn"]
    assert "'no_such_loss'" in detail["msg"] and all(name in detail["msg"] for name in losses.LOSSES)
