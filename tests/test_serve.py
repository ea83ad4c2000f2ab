"""The Tinker-compatible server (python -m grpo.serve), driven over real HTTP by the real,
unmodified tinker SDK: the dev extra's 0.22 here (JSON), the newest (0.38, protobuf) in
test_serve_sdk038.py. Every server is a subprocess on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading

import pytest
from serve_helpers import API_KEY, Server, assert_matches_in_process, replay_in_process

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("serve") / "checkpoints")
    yield srv
    srv.stop()


def test_requests_without_the_key_are_401(server):
    assert server.call("POST", "/api/v1/create_session", {}, key=None)[0] == 401
    status, body = server.call("POST", "/api/v1/create_session", {}, key="tml-wrong")
    assert status == 401 and "X-API-Key" in body["detail"]
    assert server.call("POST", "/api/v1/create_session", {}, key=API_KEY)[0] == 200
    # The key is checked before the body: without it, a bad body reveals nothing of the schema.
    assert server.call("POST", "/api/v1/asample", {"num_samples": "x"}, key=None)[0] == 401
    assert server.call("GET", "/openapi.json", key=None)[0] == 401  # nothing but healthz without the key
    assert server.call("GET", "/openapi.json")[0] == 404


def test_malformed_bodies_are_422_naming_the_field(server):
    status, body = server.call("POST", "/api/v1/asample", {"num_samples": "many", "sampling_session_id": "x",
                                                           "prompt": {"chunks": [{"tokens": [1, 2]}]}})
    assert status == 422
    assert [e["loc"] for e in body["detail"]] == [["body", "num_samples"]]
    status, body = server.call("POST", "/api/v1/asample", {"sampling_session_id": "x"})
    assert status == 422 and ["body", "prompt"] in [e["loc"] for e in body["detail"]]
    status, body = server.call("POST", "/api/v1/create_model", {"session_id": "s", "base_model": "tiny",
                                                                "lora_config": {"rank": 0}})
    assert status == 422 and body["detail"][0]["loc"] == ["body", "lora_config", "rank"]
    # A protobuf forward_backward that is not one.
    status, body = server.call("POST", "/api/v1/forward_backward", b"\xff\xff not protobuf",
                               content_type="application/x-protobuf")
    assert status == 422 and body["detail"][0]["loc"] == ["body", "body"]
    # Not JSON at all.
    status, body = server.call("POST", "/api/v1/optim_step", b"{nope")
    assert status == 422


def test_unknown_ids_are_404_not_retried(server):
    status, body = server.call("POST", "/api/v1/retrieve_future", {"request_id": "req-nope"})
    assert status == 404 and body["detail"][0]["loc"] == ["body", "request_id"]
    status, body = server.call("POST", "/api/v1/get_info", {"model_id": "nope:train:0"})
    assert status == 404 and "create_model" in body["detail"][0]["msg"]


def test_sdk_minimal_loop_matches_in_process_backend(server, tmp_path):
    """Create LoRA client, sample, forward_backward(importance_sampling), optim_step, save,
    resume: loss and logprobs equal the in-process backend's on the same data."""
    result = server.run_sdk_loop(sys.executable, "tiny")
    assert result["sdk_version"] == tinker.__version__
    assert_matches_in_process(result, replay_in_process(result, "tiny", tmp_path / "ckpt"))


def test_bad_request_fails_alone_and_the_model_trains_on(server):
    service = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    training = service.create_lora_training_client(base_model="tiny", rank=2)
    types = tinker.types
    good = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                       loss_fn_inputs={"target_tokens": types.TensorData(data=[2, 3, 4], dtype="int64", shape=[3]),
                                       "weights": types.TensorData(data=[1.0, 1.0, 1.0], dtype="float32", shape=[3])})
    bad = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 10**8]),
                      loss_fn_inputs={"target_tokens": types.TensorData(data=[2, 3, 4], dtype="int64", shape=[3]),
                                      "weights": types.TensorData(data=[1.0, 1.0, 1.0], dtype="float32", shape=[3])})
    with pytest.raises(Exception, match="vocab|token"):
        training.forward_backward([bad], "cross_entropy").result()
    with pytest.raises(Exception, match="loss_fn"):
        training.forward_backward([good], "stable_reinforce").result()
    out = training.forward_backward([good], "cross_entropy").result()
    assert out.metrics["loss:sum"] > 0
    assert len(out.loss_fn_outputs[0]["logprobs"].tolist()) == 3


def test_eight_clients_sampling_at_once_all_complete(server):
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            service = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
            sampler = service.create_sampling_client(base_model="tiny")
            response = sampler.sample(tinker.types.ModelInput.from_ints([1, 2, 3 + i]), num_samples=2,
                                      sampling_params=tinker.types.SamplingParams(max_tokens=5)).result()
            results[i] = [len(s.tokens) for s in response.sequences]
        except BaseException as err:  # reported below with the others
            errors.append(err)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert sorted(results) == list(range(8))
    assert all(len(lengths) == 2 and all(1 <= n <= 5 for n in lengths) for lengths in results.values())


KILLED_CLIENT = textwrap.dedent("""
    import sys, tinker
    service = tinker.ServiceClient()
    sampler = service.create_sampling_client(base_model="tiny")
    future = sampler.sample(tinker.types.ModelInput.from_ints([1, 2, 3]), num_samples=8,
                            sampling_params=tinker.types.SamplingParams(max_tokens=400))
    print("submitted", flush=True)
    future.result()
    print("finished", flush=True)
""")


def test_killing_a_client_mid_request_leaves_the_server_serving(server):
    # A client killed -9 while its sample request is being worked on and polled.
    proc = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT], env=server.client_env(),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "submitted"
    threading.Event().wait(1.0)
    assert proc.poll() is None, "the client finished before it could be killed mid-request"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # A connection dropped half-way through sending its body.
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\nX-API-Key: " + API_KEY.encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"tags\"")
    # Still serving: a new client samples, and the server process is alive.
    service = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    sampler = service.create_sampling_client(base_model="tiny")
    response = sampler.sample(tinker.types.ModelInput.from_ints([5, 6]), num_samples=1,
                              sampling_params=tinker.types.SamplingParams(max_tokens=3)).result()
    assert 1 <= len(response.sequences[0].tokens) <= 3
    assert server.proc.poll() is None
    assert server.call("GET", "/api/v1/healthz")[0] == 200


def test_rest_client_lists_expires_publishes_and_deletes_checkpoints(server):
    service = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    training = service.create_lora_training_client(base_model="tiny", rank=2)
    state = training.save_state("kept").result().path
    sampler = training.save_weights_for_sampler("for-sampling").result().path
    run_id = state.split("/")[2]
    rest = service.create_rest_client()

    listed = rest.list_checkpoints(run_id).result().checkpoints
    assert sorted(c.tinker_path for c in listed) == sorted([state, sampler])
    assert {c.checkpoint_type for c in listed} == {"training", "sampler"}
    assert all(c.size_bytes and c.size_bytes > 0 for c in listed)
    run = rest.get_training_run(run_id).result()
    assert (run.base_model, run.lora_rank, run.is_lora) == ("tiny", 2, True)

    rest.set_checkpoint_ttl_from_tinker_path(sampler, 3600).result()
    rest.publish_checkpoint_from_tinker_path(state).result()
    listed = {c.tinker_path: c for c in rest.list_checkpoints(run_id).result().checkpoints}
    assert listed[sampler].expires_at is not None and listed[state].expires_at is None
    assert listed[state].public and not listed[sampler].public

    rest.delete_checkpoint_from_tinker_path(sampler).result()
    assert [c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints] == [state]
    # A deleted checkpoint is gone for loading too: a 404 the SDK does not retry.
    with pytest.raises(tinker.NotFoundError, match="model_path"):
        service.create_sampling_client(model_path=sampler).sample(
            tinker.types.ModelInput.from_ints([1, 2]), num_samples=1).result()


MINT_PROGRAM = textwrap.dedent("""
    import mint
    from mint import types
    service = mint.ServiceClient()
    training = service.create_lora_training_client(base_model="tiny", rank=2)
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={
        "target_tokens": types.TensorData(data=[2, 3, 4], dtype="int64", shape=[3]),
        "weights": types.TensorData(data=[1.0, 1.0, 1.0], dtype="float32", shape=[3])})
    out = training.forward_backward([datum], "cross_entropy").result()
    print(out.metrics["loss:sum"], -sum(out.loss_fn_outputs[0]["logprobs"].tolist()))
""")


def test_mint_sdk_trains_on_the_server_through_its_own_variables(server):
    env = {k: v for k, v in server.client_env().items() if not k.startswith("TINKER_")}
    env.update(MINT_BASE_URL=server.url, MINT_API_KEY=API_KEY)
    done = subprocess.run([sys.executable, "-c", MINT_PROGRAM], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    loss, minus_logprob_sum = map(float, done.stdout.split())
    assert loss > 0 and abs(loss - minus_logprob_sum) < 1e-4  # cross-entropy = -sum of target logprobs


def test_grpo_serve_command_and_its_safety_defaults(tmp_path):
    from pathlib import Path

    grpo_cmd = Path(sys.executable).parent / "grpo"
    if not grpo_cmd.exists():
        pytest.skip("the grpo console script is not installed in this venv")
    helped = subprocess.run([str(grpo_cmd), "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "--host" in helped.stdout and "127.0.0.1" in helped.stdout
    # A key that the SDK would refuse is refused at start.
    bad = subprocess.run([sys.executable, "-m", "grpo.serve", "--api-key", "sk-nope"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode != 0 and "tml-" in bad.stderr
    # Training still goes through the same command.
    train = subprocess.run([str(grpo_cmd), "adapter=nope"], capture_output=True, text=True, timeout=120,
                           cwd=tmp_path)
    assert train.returncode != 0 and "adapter" in (train.stdout + train.stderr)


def test_binding_beyond_loopback_is_warned_about():
    from grpo.serve.__main__ import exposure_warning, parse_args

    assert parse_args([]).host == "127.0.0.1"
    assert exposure_warning("127.0.0.1") is None and exposure_warning("localhost") is None
    assert "WARNING" in exposure_warning("0.0.0.0") and "network" in exposure_warning("0.0.0.0")
