"""A finished session's models leave the server's memory: closed by its client (the SDK's
``ServiceClient.close``) at once, silent past ``--session-timeout-s`` when the next client
arrives or polls. Every loaded adapter made the server's later sessions slower (peft's
per-adapter operations walk them all: +0.45 s per earlier session of the docs' minimal loop),
so a long-running server must not keep what its finished sessions left. Its clients are told
the session finished; the other sessions and every saved checkpoint are untouched.

In-process (FastAPI's TestClient over one local ServiceClient), so the engine's adapters can be
counted; the tiny model.
"""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from grpo.backends.local import ServiceClient
from grpo.serve.app import create_app
from grpo.serve.limits import Limits

API_KEY = "tml-sessions"
TOKENS = [1, 504, 3458, 314, 253, 1345, 28]


@pytest.fixture()
def server(tmp_path):
    service = ServiceClient(checkpoint_dir=tmp_path / "checkpoints", device="cpu", dtype="float32")
    app = create_app(API_KEY, service, long_poll_s=5.0, limits=Limits(session_timeout_s=600.0))
    with TestClient(app, headers={"X-API-Key": API_KEY}) as client:
        yield client, app.state.grpo, service
    service.close()


def result(client: TestClient, request_id: str) -> dict:
    for _ in range(50):
        body = client.post("/api/v1/retrieve_future", json={"request_id": request_id}).json()
        if body.get("type") != "try_again":
            return body
    raise AssertionError(f"{request_id} never finished")


def open_session(client: TestClient) -> dict[str, str]:
    """A session with a training model, a checkpoint of its weights and a sampler loaded from it:
    two adapters in the engine."""
    session = client.post("/api/v1/create_session", json={"sdk_version": "test"}).json()["session_id"]
    made = client.post("/api/v1/create_model", json={"session_id": session, "base_model": "tiny",
                                                     "lora_config": {"rank": 4, "seed": 0}}).json()
    assert result(client, made["request_id"])["model_id"] == made["model_id"]
    saved = client.post("/api/v1/save_weights_for_sampler", json={"model_id": made["model_id"], "path": "w"}).json()
    path = result(client, saved["request_id"])["path"]
    sampler = client.post("/api/v1/create_sampling_session", json={"session_id": session, "model_path": path}
                          ).json()["sampling_session_id"]
    return {"session": session, "model": made["model_id"], "path": path, "sampler": sampler}


def forward(client: TestClient, model_id: str):
    datum = {"model_input": {"chunks": [{"tokens": TOKENS[:-1]}]},
             "loss_fn_inputs": {"target_tokens": {"data": TOKENS[1:], "dtype": "int64"},
                                "weights": {"data": [1.0] * (len(TOKENS) - 1), "dtype": "float32"}}}
    return client.post("/api/v1/forward", json={"model_id": model_id, "forward_input": {
        "data": [datum], "loss_fn": "cross_entropy"}})


def sample(client: TestClient, sampler_id: str):
    return client.post("/api/v1/asample", json={
        "sampling_session_id": sampler_id, "num_samples": 1, "prompt": {"chunks": [{"tokens": TOKENS}]},
        "sampling_params": {"max_tokens": 3, "temperature": 1.0, "seed": 1}})


def loaded_adapters(service: ServiceClient, expected: int) -> set[str]:
    """The engine's adapters once it holds ``expected`` (unloading runs in the background)."""
    engine = service._engines["tiny"].engine
    deadline = time.monotonic() + 30
    while len(engine.versions) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(engine.peft_model.peft_config if engine.peft_model is not None else ()) == set(engine.versions)
    return set(engine.versions)


@pytest.mark.parametrize("ending", ["closed", "silent"])
def test_a_finished_sessions_models_leave_memory_and_its_client_is_told(server, ending):
    client, state, service = server
    gone, kept = open_session(client), open_session(client)
    assert len(loaded_adapters(service, 4)) == 4
    kept_adapters = {state.models[kept["model"]].client.adapter, state.samplers[kept["sampler"]].client.adapter}

    if ending == "closed":
        assert client.post(f"/api/v1/sessions/{gone['session']}/finish", json={}).status_code == 200
    else:  # no request has named it for longer than the timeout; the next client to arrive notices
        state.sessions[gone["session"]]["heartbeat"] -= 601
        client.post("/api/v1/create_session", json={"sdk_version": "test"})
    assert loaded_adapters(service, 2) == kept_adapters

    refused = forward(client, gone["model"])
    assert refused.status_code == 404 and "has finished" in refused.text, refused.text
    refused = sample(client, gone["sampler"])
    assert refused.status_code == 404 and "has finished" in refused.text, refused.text
    heartbeat = client.post("/api/v1/session_heartbeat", json={"session_id": gone["session"]})
    assert heartbeat.status_code == 410  # the SDK stops heartbeating on a 410

    # the other session works as before; the finished one's checkpoint still loads
    assert "loss_fn_outputs" in result(client, forward(client, kept["model"]).json()["request_id"])
    assert "sequences" in result(client, sample(client, kept["sampler"]).json()["request_id"])
    again = client.post("/api/v1/create_sampling_session", json={"session_id": kept["session"], "model_path": gone["path"],
                                                                 "sampling_session_seq_id": 1}).json()
    assert "sequences" in result(client, sample(client, again["sampling_session_id"]).json()["request_id"])


def test_a_session_that_keeps_using_its_models_is_not_silent(server):
    client, state, service = server
    live = open_session(client)
    state.sessions[live["session"]]["heartbeat"] -= 601
    assert "loss_fn_outputs" in result(client, forward(client, live["model"]).json()["request_id"])  # a request of its own
    client.post("/api/v1/create_session", json={"sdk_version": "test"})
    assert live["session"] in state.sessions and len(loaded_adapters(service, 2)) == 2


def test_after_every_session_finished_a_new_one_trains(server):
    """The last adapter unloaded leaves the plain base model, which takes the next one."""
    client, _, service = server
    first = open_session(client)
    assert client.post(f"/api/v1/sessions/{first['session']}/finish", json={}).status_code == 200
    assert loaded_adapters(service, 0) == set()
    second = open_session(client)
    assert "loss_fn_outputs" in result(client, forward(client, second["model"]).json()["request_id"])
    assert "sequences" in result(client, sample(client, second["sampler"]).json()["request_id"])
