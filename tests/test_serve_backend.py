"""`python -m grpo ... backend=tinker` against grpo's own Tinker server, with the newest SDK:
a real HTTP round trip whose metrics equal the local backend's on the same seed (issue #21)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from serve_helpers import API_KEY, REPO, Server, free_port, sdk_overlay

from grpo.record.runlog import WALL_CLOCK_PREFIXES as TIMING_PREFIXES
from grpo.record.runlog import read_jsonl

NEWEST_SDK = "0.38.0"
TOY = ["adapter=custom", "adapter._target_=toy_adapter.ToyAdapter", "base_model=tiny", "batch_size=2",
       "group_size=4", "max_tokens=8", "report=false", "learning_rate=1e-3", "eval_samples=2", "steps=2", "seed=3"]
pytest.importorskip("fastapi")


def grpo(args: list[str], run_dir: Path, pythonpath: list[Path], extra_env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, pythonpath)), **(extra_env or {})}
    return subprocess.run([sys.executable, "-m", "grpo", *args, f"hydra.run.dir={run_dir}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


# The local backend's sampler counters (SamplingClient.sampler_stats: the prefix cache's hits): the
# SDK's sampling client has no such call, so a run through a service logs none of them.
LOCAL_SAMPLER_PREFIX = "sampler/"


def comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith((*TIMING_PREFIXES, LOCAL_SAMPLER_PREFIX))} for r in rows]


@pytest.mark.slow  # end to end, minutes on 2 cores: CI's slow stage runs it
def test_backend_tinker_on_grpo_server_with_newest_sdk_matches_local(tmp_path):
    overlay = sdk_overlay(NEWEST_SDK)
    tests = REPO / "tests"
    local = grpo(TOY, tmp_path / "local", [tests])
    assert local.returncode == 0, local.stderr[-3000:]
    server = Server(tmp_path / "server-checkpoints")
    try:
        probe = subprocess.run([sys.executable, "-c", "import tinker, importlib.metadata as m; "
                                "print(m.version('tinker'), tinker.__file__)"],
                               env={**os.environ, "PYTHONPATH": str(overlay)}, capture_output=True, text=True)
        assert probe.stdout.split()[0] == NEWEST_SDK and str(overlay) in probe.stdout, probe.stdout + probe.stderr
        remote = grpo([*TOY, "backend=tinker", f"backend.base_url={server.url}"], tmp_path / "remote",
                      [overlay, tests], {"TINKER_API_KEY": API_KEY, "TINKER_TELEMETRY": "0"})
        assert remote.returncode == 0, remote.stderr[-3000:] + server.log.read_text()[-2000:]
    finally:
        server.stop()
    assert any("sampler/prefix_hit_rate" in row for row in read_jsonl(tmp_path / "local" / "metrics.jsonl"))
    assert not any(k.startswith(LOCAL_SAMPLER_PREFIX) for row in read_jsonl(tmp_path / "remote" / "metrics.jsonl")
                   for k in row)
    for name in ("metrics.jsonl", "rollouts.jsonl"):
        expected = comparable(read_jsonl(tmp_path / "local" / name))
        got = comparable(read_jsonl(tmp_path / "remote" / name))
        assert len(got) == len(expected) > 0, name
        for want, have in zip(expected, got, strict=True):
            assert want.keys() == have.keys(), name
            for key, value in want.items():
                if isinstance(value, float):
                    assert have[key] == pytest.approx(value, rel=1e-4, abs=1e-5), (name, key)
                else:
                    assert have[key] == value, (name, key)
    assert "tinker://" in remote.stdout
    assert f"grpo: tinker SDK {NEWEST_SDK} fits the server at {server.url} (grpo serve" in remote.stdout


@pytest.mark.slow  # end to end, minutes on 2 cores: CI's slow stage runs it
def test_a_value_the_service_refuses_is_one_grpo_line_naming_the_config_key(tmp_path):
    """The server's 422 for LoRA rank 2000 (dev extra's SDK, over real HTTP) ends the run with one
    `grpo:` line naming the reason and the key, not a traceback."""
    server = Server(tmp_path / "server-checkpoints")
    try:
        run = grpo([*TOY, "rank=2000", "backend=tinker", f"backend.base_url={server.url}"], tmp_path / "run",
                   [REPO / "tests"], {"TINKER_API_KEY": API_KEY, "TINKER_TELEMETRY": "0"})
    finally:
        server.stop()
    assert run.returncode == 2, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("grpo: ") and "lora_config.rank" in last and "1024" in last and "`rank`" in last, last


def test_a_refusal_the_sdk_wraps_in_a_plain_error_is_still_one_line_naming_the_key():
    """SDK 0.25 (the one SkyRL 0.4.0 fits) reports a future's 400 as a ValueError("Error retrieving
    result ...") raised from its BadRequestError, as it did for SkyRL's refusal of rank 16."""
    import httpx
    import tinker

    from grpo.backends.remote.resilience import RemoteRequestError, as_request_error

    body = {"detail": "LoRA rank 16 must be between 1 and 8"}
    response = httpx.Response(400, json=body, request=httpx.Request("POST", "http://h:1/api/v1/retrieve_future"))
    try:
        try:
            raise tinker.BadRequestError(f"Error code: 400 - {body}", response=response, body=body)
        except tinker.BadRequestError as refused:
            raise ValueError(f"Error retrieving result: {refused} (status 400) for self.request_id='1' "
                             "— exceeded 3 retries") from refused
    except ValueError as err:
        wrapped = err
    line = as_request_error(wrapped, "create_lora_training_client", "http://h:1")
    assert isinstance(line, RemoteRequestError)
    assert str(line) == ("http://h:1 refused create_lora_training_client (400): LoRA rank 16 must be between 1 "
                         "and 8; check the config key `rank`")
    unrelated = ValueError("not a refusal")
    assert as_request_error(unrelated, "sample", "http://h:1") is unrelated


@pytest.mark.parametrize(("reason", "key"), [
    ("LoRA rank 16 must be between 1 and 8", "rank"),  # SkyRL's words for the same refusal
    ("lora_config.rank: Input should be less than or equal to 1024", "rank"),
    ("base_model 'x' is not served here", "base_model"),
    ("sampling_params.max_tokens: Input should be greater than or equal to 1", "max_tokens"),
    ("num_samples: too many", "group_size"),
    ("the server is tired", None),
])
def test_refusals_map_to_the_config_key_that_sets_the_value(reason, key):
    from grpo.backends.remote.resilience import config_key_for

    assert config_key_for(reason) == key


SKYRL_04 = {"forward": (404, {"detail": "Not Found"}), "json_fwdbwd": (415, {"detail": "Unsupported Media Type"})}
GRPO_SERVE = {"server": "grpo serve", "version": "0.1.0", "tested_sdks": ["0.22.0", "0.38.0"]}


def test_startup_check_says_when_sdk_and_server_do_not_fit():
    from grpo.backends.remote.compat import judge

    # SDK 0.22 (JSON) on a protobuf-only server, probed as SkyRL 0.4's answered: refused at start-up.
    verdict = judge("0.22.0", None, SKYRL_04["forward"], SKYRL_04["json_fwdbwd"], "http://h:1")
    assert verdict.fits is False
    assert "/forward and no JSON forward_backward" in verdict.line and "tinker>=0.25" in verdict.line
    # The same server with a protobuf SDK: nothing certain, so one informative line, no refusal.
    assert judge("0.38.0", None, *SKYRL_04.values(), "http://h:1").fits is None
    # grpo serve names itself and the SDKs it was tested with.
    assert judge("0.22.0", GRPO_SERVE, (422, {}), (422, {}), "http://h:1").fits is True
    newer = judge("0.41.0", GRPO_SERVE, (422, {}), (422, {}), "http://h:1")
    assert newer.fits is None and "newer than any SDK it was tested with" in newer.line


def test_startup_check_probes_a_real_server(tmp_path):
    from grpo.backends.remote.compat import check

    server = Server(tmp_path / "server-checkpoints")
    try:
        verdict = check("tinker", server.url, API_KEY, 10.0)
        assert server.call("GET", "/api/v1/healthz", key=None)[0] == 200  # open: says what it is, nothing else
    finally:
        server.stop()
    assert verdict.fits is True and verdict.line.startswith(f"tinker SDK {tinker_version()} fits the server at")


def tinker_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("tinker")


SKYRL_OPENAPI = REPO / "tests" / "skyrl_0.4.0_openapi.json"  # recorded from the live server, trimmed


def test_startup_check_reads_from_the_published_api_that_asample_answers_carry_no_sequence_ids():
    """SkyRL 0.4.0 declares asample's answer as {future_id, status, request_id}: SDKs from 0.26
    assert on the missing sample_sequence_ids at the first sample(), so they are refused at
    start-up, naming the SDK that fits; 0.25 is not refused."""
    import json

    from grpo.backends.remote.compat import asample_fields, judge

    document = json.loads(SKYRL_OPENAPI.read_text())
    fields = asample_fields(document)
    assert fields == {"future_id", "status", "request_id"}
    for version in ("0.26.0", "0.38.0"):
        verdict = judge(version, None, *SKYRL_04.values(), "http://h:1", fields)
        assert verdict.fits is False, version
        assert f"tinker SDK {version} does not fit" in verdict.line and "no sample_sequence_ids" in verdict.line
        assert "pip install 'tinker==0.25.0'" in verdict.line
    assert judge("0.25.0", None, *SKYRL_04.values(), "http://h:1", fields).fits is None
    # 0.22 is refused for the JSON routes, and pointed at the one SDK that fits both ways.
    old_sdk = judge("0.22.0", None, *SKYRL_04.values(), "http://h:1", fields)
    assert old_sdk.fits is False and "no /forward" in old_sdk.line and "pip install 'tinker==0.25.0'" in old_sdk.line
    # A server that declares the field, or declares nothing, is not refused on this ground.
    document["components"]["schemas"]["FutureResponse"]["properties"]["sample_sequence_ids"] = {"type": "array"}
    declared = asample_fields(document)
    assert "sample_sequence_ids" in declared
    assert judge("0.38.0", None, *SKYRL_04.values(), "http://h:1", declared).fits is None
    assert asample_fields(None) is None and asample_fields({"paths": {}}) is None
    assert judge("0.38.0", None, *SKYRL_04.values(), "http://h:1", None).fits is None


MISFIT_MID_RUN = """
from tinker import types
from tinker.lib.public_interfaces.sampling_client import _attach_sequence_ids
from grpo.backends.remote.resilience import RemoteRequestError, RetryPolicy, retrying

import numpy as np
sequence = types.SampledSequence(stop_reason="length", sequence_id="", tokens_np=np.array([1], dtype=np.int32))
answer = types.SampleResponse(sequences=[sequence])
try:
    retrying(lambda: _attach_sequence_ids(answer, None), lambda x: x, RetryPolicy(max_retries=2, backoff_s=0),
             "sample", "http://h:1", print).result()
except RemoteRequestError as err:
    print("ONE LINE:", err)
"""


def test_a_server_that_publishes_no_api_and_omits_sequence_ids_still_ends_in_one_line():
    """Where /openapi.json is missing the start-up check cannot tell; SDK 0.38's own assertion on
    the answer (its real code, on an answer without ids, as SkyRL 0.4.0 gives) becomes one line
    naming the SDK that fits, without retries."""
    overlay = sdk_overlay(NEWEST_SDK)
    run = subprocess.run([sys.executable, "-c", MISFIT_MID_RUN], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(overlay)}, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == (
        f"ONE LINE: sample: tinker SDK {NEWEST_SDK} does not fit the server at http://h:1: its asample answer has no "
        "sample_sequence_ids (the SDK: asample promises always carry sample_sequence_ids), which SDKs from 0.26 "
        "require; pip install 'tinker==0.25.0' (with backend=tinker)"), run.stdout


def test_startup_probe_reads_asample_fields_from_a_real_fastapi_server():
    """Over real HTTP: a FastAPI server declaring asample's answer the way SkyRL 0.4.0 does sends
    only the declared fields (so the declaration is what the SDK will get), and the probe reads them."""
    import threading

    import httpx
    import uvicorn
    from fastapi import FastAPI
    from pydantic import BaseModel

    from grpo.backends.remote.compat import probe

    class FutureResponse(BaseModel):
        future_id: str
        status: str = "pending"
        request_id: str

    app = FastAPI()

    @app.post("/api/v1/asample", response_model=FutureResponse)
    async def asample() -> dict:
        return {"future_id": "1", "request_id": "1", "sample_sequence_ids": ["1:0"]}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            if server.started:
                break
            threading.Event().wait(0.05)
        answer = httpx.post(url + "/api/v1/asample", json={}).json()
        _, forward, _, fields = probe(url, None, 10.0)
    finally:
        server.should_exit = True
        thread.join(10)
    assert answer == {"future_id": "1", "status": "pending", "request_id": "1"}  # the extra field is dropped
    assert fields == {"future_id", "status", "request_id"}
    assert forward == (404, {"detail": "Not Found"})



def test_the_tinker_extra_admits_each_sdk_tested_and_none_newer():
    """pyproject's bounds say what was run: 0.22 (JSON servers; MinT's pin), 0.25 (SkyRL 0.4.0,
    docs/remote.md), the newest SDK this file runs against grpo serve; the next minor is untested."""
    import tomllib

    from packaging.requirements import Requirement

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (requirement,) = [r for r in map(Requirement, extras["tinker"]) if r.name == "tinker"]
    bounds = requirement.specifier
    for version in ("0.22.0", "0.25.0", NEWEST_SDK):
        assert bounds.contains(version), version
    major, minor, _ = NEWEST_SDK.split(".")
    assert not bounds.contains(f"{major}.{int(minor) + 1}.0")
