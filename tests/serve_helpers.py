"""A real ``python -m grpo.serve`` subprocess for tests, and a plain HTTP caller for it."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

API_KEY = "tml-grpo-test-key"
REPO = Path(__file__).resolve().parent.parent
SDK_LOOP = REPO / "tests" / "tinker_sdk_loop.py"


def sdk_venv(name: str, requirements: list[str], env_var: str) -> str:
    """The python of a throwaway venv holding ``requirements`` (an SDK the test venv cannot hold
    beside the dev extra's): ``$env_var`` if set, else built once under $GRPO_CACHE/venvs/<name>
    from the package registry and reused."""
    explicit = os.environ.get(env_var)
    if explicit:
        return explicit
    from grpo import models

    venv = models.cache_dir() / "venvs" / name
    python = venv / "bin" / "python"
    stamp = venv / ".installed"
    with built_once(venv):
        if not stamp.exists() or stamp.read_text() != " ".join(requirements):
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
            subprocess.run([str(python), "-m", "pip", "install", "-q", *requirements], check=True, timeout=1800)
            stamp.write_text(" ".join(requirements))
    return str(python)


@contextlib.contextmanager
def built_once(target: Path) -> Iterator[None]:
    """Hold an exclusive lock beside ``target`` while it is checked and built: parallel test
    workers (pytest -n) that need the same venv wait for the first one's build instead of
    racing it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def sdk_overlay(version: str) -> Path:
    """A directory holding only ``tinker==version`` (pip --no-deps --target), built once under
    $GRPO_CACHE/sdk-overlays/. Put first on PYTHONPATH, it replaces the dev venv's tinker 0.22 for
    one subprocess, which keeps the dev venv's grpo, torch and the SDK's dependencies."""
    from grpo import models

    target = models.cache_dir() / "sdk-overlays" / f"tinker-{version}"
    with built_once(target):
        _build_overlay(target, version)
    return target


def _build_overlay(target: Path, version: str) -> None:
    if not (target / ".installed").exists():
        staging = target.with_name(target.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(staging)]
        subprocess.run([*pip, f"tinker=={version}"], check=True, timeout=600)
        missing = _unmet_requirements(next(staging.glob("tinker-*.dist-info")) / "METADATA")
        if missing:  # dependencies the dev venv lacks or holds in a version the SDK refuses
            subprocess.run([*pip, *missing], check=True, timeout=600)
        (staging / ".installed").touch()
        shutil.rmtree(target, ignore_errors=True)
        staging.replace(target)


def _unmet_requirements(metadata: Path) -> list[str]:
    import importlib.metadata
    from email.parser import Parser

    from packaging.requirements import Requirement

    unmet = []
    for line in Parser().parsestr(metadata.read_text()).get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            if req.specifier.contains(importlib.metadata.version(req.name), prereleases=True):
                continue
        except importlib.metadata.PackageNotFoundError:
            pass
        unmet.append(str(req).split(";")[0])
    return unmet


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    def __init__(self, checkpoint_dir: Path, long_poll_s: float = 30.0, cwd: Path = REPO,
                 extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = checkpoint_dir.parent / "server.log"
        self._log_file = open(self.log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "grpo.serve", "--port", str(self.port), "--api-key", API_KEY,
             "--checkpoint-dir", str(checkpoint_dir), "--long-poll", str(long_poll_s), *extra_args],
            stdout=self._log_file, stderr=subprocess.STDOUT, cwd=cwd, env=env)
        deadline = time.monotonic() + 120
        while True:
            try:
                status, _ = self.call("GET", "/api/v1/healthz")
                if status == 200:
                    return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start:\n{self.log.read_text()}")
            time.sleep(0.2)

    def call(self, method: str, path: str, body: bytes | dict | None = None, key: str | None = API_KEY,
             content_type: str = "application/json", timeout: float = 60) -> tuple[int, dict]:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("Content-Type", content_type)
        if key is not None:
            request.add_header("X-API-Key", key)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"{}")

    def client_env(self) -> dict[str, str]:
        return {**os.environ, "TINKER_BASE_URL": self.url, "TINKER_API_KEY": API_KEY, "TINKER_TELEMETRY": "0",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

    def run_sdk_loop(self, python: str, base_model: str, timeout: float = 600) -> dict:
        """tests/tinker_sdk_loop.py under ``python`` (an interpreter with some tinker SDK)."""
        done = subprocess.run([python, str(SDK_LOOP), base_model], env=self.client_env(), capture_output=True,
                              text=True, timeout=timeout, cwd=REPO)
        # the exit status too: a negative one is the signal that ended it (no traceback then)
        assert done.returncode == 0, (f"SDK loop failed with exit status {done.returncode}:\n{done.stderr[-4000:]}\n"
                                      f"server log:\n{self.log.read_text()[-4000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log_file.close()


def wait(srv: Server, request_id: str) -> dict:
    """A future's result, polled until it is no longer ``try_again``."""
    for _ in range(200):
        status, body = srv.call("POST", "/api/v1/retrieve_future", {"request_id": request_id})
        assert status == 200, body
        if body.get("type") != "try_again":
            return body
    raise AssertionError("future never finished")


def tree(root: Path) -> dict[str, bytes | None]:
    """Every entry under ``root`` with its bytes (None for a directory)."""
    return {p.relative_to(root).as_posix(): (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}


@contextlib.contextmanager
def served_tiny_model(base: Path, extra_args: tuple[str, ...] = ()) -> Iterator[dict]:
    """A server (run with cwd in ``base/work``, so relative writes would land there) with a session,
    a tiny model and a sampler of the base model, and ``base/outside``: a directory beside the
    store that must never change, checked on exit with ``work``."""
    outside, work = base / "outside", base / "work"
    (outside / "victim").mkdir(parents=True)
    (outside / "victim" / "keep.txt").write_text("precious")
    (outside / "passwd").write_text("root:x:0:0")
    work.mkdir()
    srv = Server(base / "checkpoints", cwd=work, extra_args=extra_args)
    try:
        session = srv.call("POST", "/api/v1/create_session", {})[1]["session_id"]
        created = srv.call("POST", "/api/v1/create_model", {"session_id": session, "base_model": "tiny",
                                                            "lora_config": {"rank": 2}})[1]
        wait(srv, created["request_id"])
        sampler = srv.call("POST", "/api/v1/create_sampling_session", {"session_id": session, "base_model": "tiny"})
        before = tree(outside), tree(work)
        yield {"srv": srv, "model_id": created["model_id"], "session": session, "outside": outside, "work": work,
               "sampler": sampler[1]["sampling_session_id"], "base": base}
        assert (tree(outside), tree(work)) == before, "the file system outside the store changed"
    finally:
        srv.stop()


def replay_in_process(result: dict, base_model: str, checkpoint_dir: Path) -> dict:
    """The SDK loop's training steps on the in-process backend, with the server's sampled data."""
    import numpy as np

    from grpo import types as g
    from grpo.backends.local import ServiceClient

    service = ServiceClient(checkpoint_dir=checkpoint_dir)
    training = service.create_lora_training_client(base_model, rank=4, seed=0)
    prompt, sample, old_logprobs = result["prompt"], result["samples"][0], result["sample_logprobs"][0]
    tokens = prompt + sample
    n_prompt = len(prompt) - 1
    datum = g.Datum(model_input=g.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": np.asarray(tokens[1:], dtype=np.int64),
        "logprobs": np.asarray([0.0] * n_prompt + old_logprobs, dtype=np.float32),
        "advantages": np.asarray([0.0] * n_prompt + [1.0] * len(sample), dtype=np.float32)})
    before = training.save_weights_and_get_sampling_client()
    sample_logprobs_forward = [
        before.compute_logprobs(g.ModelInput.from_ints(prompt + s)).result()[len(prompt):]
        for s in result["samples"]]
    fwdbwd = training.forward_backward([datum], "importance_sampling").result()
    # The SDK's AdamParams defaults (beta2 0.95, eps 1e-12), which it sends explicitly.
    optim = training.optim_step(g.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-12)).result()
    after = training.save_weights_and_get_sampling_client()
    return {"sample_logprobs_forward": sample_logprobs_forward,
            "loss": fwdbwd.metrics["loss:sum"],
            "train_logprobs": fwdbwd.loss_fn_outputs[0]["logprobs"].tolist(),
            "optim_metrics": optim.metrics,
            "logprobs_after": after.compute_logprobs(g.ModelInput.from_ints(tokens)).result()}


def assert_matches_in_process(result: dict, local: dict, tol: float = 1e-4) -> None:
    import numpy as np

    n_sampled = len(result["samples"][0])
    # Importance sampling at the sampling weights: every ratio is 1, so loss = -(sum of advantages).
    assert abs(result["loss"] - (-n_sampled)) < 1e-3, result["loss"]
    assert abs(result["loss"] - local["loss"]) < tol
    for served, forward in zip(result["sample_logprobs"], local["sample_logprobs_forward"], strict=True):
        np.testing.assert_allclose(served, forward, atol=tol)
    np.testing.assert_allclose(result["train_logprobs"], local["train_logprobs"], atol=tol)
    assert abs(result["optim_metrics"]["grad_norm"] - local["optim_metrics"]["grad_norm"]) < 1e-3 * max(
        1.0, local["optim_metrics"]["grad_norm"])
    after = np.asarray(result["logprobs_after"][1:], dtype=float)
    np.testing.assert_allclose(after, np.asarray(local["logprobs_after"][1:], dtype=float), atol=tol)
    assert result["logprobs_after"][0] is None
    # The step changed the model, and a resumed state / sampler path carry exactly its weights.
    assert np.abs(after - np.asarray(result["train_logprobs"])).max() > 1e-3
    np.testing.assert_allclose(result["resumed_logprobs"], after, atol=tol)
    np.testing.assert_allclose(np.asarray(result["logprobs_from_path"][1:], dtype=float), after, atol=tol)
    assert result["state_path"].startswith("tinker://") and "/weights/" in result["state_path"]
    assert result["sampler_path"].startswith("tinker://") and "/sampler_weights/" in result["sampler_path"]
