"""backend=mint / backend=tinker: conversions against the real SDK classes, fail-fast start-up
against 127.0.0.1, and the remote clients driven end to end.

No network: the end-to-end tests put the *service* side in this process. ``LocalService``
answers the SDK's ServiceClient API in the SDK's own types (built with the installed SDK's
classes) by running the local torch backend, so everything grpo does (convert, submit,
pipeline, retry, convert back) runs for real, and numbers can be checked against the local
backend called directly.
"""

from __future__ import annotations

import concurrent.futures
import socket
import time
from pathlib import Path

import numpy as np
import pytest
from backend_helpers import rl_datum
from toy_adapter import ToyAdapter

from grpo import types as g
from grpo.backends import create_service_client
from grpo.backends.remote import (
    RemoteConfigError,
    RemoteConnectionError,
    RemoteServiceClient,
    RemoteStepError,
    RemoteTimeoutError,
    convert,
)
from grpo.backends.remote.sdk import SDKS

# mindlab-toolkit (in the dev extra) brings the Tinker SDK it pins; importorskip is only a fallback.
tinker = pytest.importorskip("tinker")
T = tinker.types

ENV_VARS = ("MINT_API_KEY", "MINT_BASE_URL", "TINKER_API_KEY", "TINKER_BASE_URL", "TINKER_CREDENTIAL_CMD")
FAST = {"backoff_s": 0.01, "backoff_max_s": 0.02, "call_timeout_s": 60}


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.tinker/credentials.json
    return monkeypatch


def sdk_sequence(tokens: list[int], logprobs: list[float], stop_reason: str) -> object:
    """An SDK SampledSequence, whichever SDK version is installed (0.3x added sequence_id)."""
    kwargs = {"stop_reason": stop_reason, "tokens_np": np.asarray(tokens, dtype=np.int32),
              "logprobs_np": np.asarray(logprobs, dtype=np.float32)}
    if "sequence_id" in getattr(T.SampledSequence, "__dataclass_fields__", {}):
        kwargs["sequence_id"] = f"seq-{len(tokens)}"
    return T.SampledSequence(**kwargs)


# --------------------------------------------------------------------------- conversions


def test_datum_becomes_the_sdk_datum_with_the_same_tokens_and_arrays():
    datum = rl_datum(prompt=[5, 6, 7], response=[8, 9], advantage=0.75, sampler_logprobs=[-0.5, -1.25])
    out = convert.datum(T, datum)
    assert isinstance(out, T.Datum) and isinstance(out.model_input, T.ModelInput)
    assert out.model_input.to_ints() == [5, 6, 7, 8]
    inputs = out.loss_fn_inputs
    assert set(inputs) == {"target_tokens", "weights", "logprobs", "advantages"}
    assert all(isinstance(v, T.TensorData) for v in inputs.values())
    assert inputs["target_tokens"].dtype == "int64" and inputs["weights"].dtype == "float32"
    np.testing.assert_array_equal(inputs["target_tokens"].to_numpy(), [6, 7, 8, 9])
    np.testing.assert_array_equal(inputs["weights"].to_numpy(), [0, 0, 1, 1])
    np.testing.assert_array_equal(inputs["logprobs"].to_numpy(), np.float32([0, 0, -0.5, -1.25]))
    np.testing.assert_array_equal(inputs["advantages"].to_numpy(), np.float32([0, 0, 0.75, 0.75]))
    assert inputs["advantages"].shape == [4]


def test_sampling_params_carry_every_field_and_stop_token_ids_become_stop(tokenizer):
    params = g.SamplingParams(max_tokens=7, temperature=0.6, top_k=20, top_p=0.9, seed=11, stop_token_ids=[2, 2])
    out = convert.sampling_params(T, params)
    assert isinstance(out, T.SamplingParams)
    assert (out.max_tokens, out.temperature, out.top_k, out.top_p, out.seed) == (7, 0.6, 20, 0.9, 11)
    assert list(out.stop) == [2]
    assert list(convert.sampling_params(T, g.SamplingParams(stop=["\n\n", "Q:"])).stop) == ["\n\n", "Q:"]
    assert convert.sampling_params(T, g.SamplingParams()).stop is None
    # The SDK takes strings or ids, not both: ids are decoded with the tokenizer.
    eos = tokenizer.eos_token_id
    decode = lambda i: tokenizer.decode([i], skip_special_tokens=False)  # noqa: E731
    mixed = convert.sampling_params(T, g.SamplingParams(stop=["\n\n", eos]), decode=decode)
    assert list(mixed.stop) == ["\n\n", tokenizer.eos_token]
    with pytest.raises(ValueError, match="mixes strings and token ids"):
        convert.sampling_params(T, g.SamplingParams(stop=["x", eos]))


def test_adam_params_keep_grpo_values_not_sdk_defaults():
    out = convert.adam_params(T, g.AdamParams(learning_rate=3e-4, betas=(0.8, 0.999), eps=1e-8,
                                              weight_decay=0.01, grad_clip_norm=1.5))
    assert isinstance(out, T.AdamParams)
    # The SDK's own defaults are beta2=0.95, eps=1e-12: grpo's values must win.
    assert (out.learning_rate, out.beta1, out.beta2, out.eps, out.weight_decay, out.grad_clip_norm) == \
        (3e-4, 0.8, 0.999, 1e-8, 0.01, 1.5)


def test_sdk_results_come_back_as_grpo_types():
    response = T.SampleResponse(sequences=[sdk_sequence([4, 5, 2], [-0.5, -0.25, -2.0], "stop"),
                                           sdk_sequence([9], [-3.0], "length")])
    out = convert.from_sample_response(response)
    assert isinstance(out, g.SampleResponse) and out.prompt_logprobs is None
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in out.sequences] == [
        ([4, 5, 2], [-0.5, -0.25, -2.0], "stop"), ([9], [-3.0], "length")]

    fb = T.ForwardBackwardOutput(
        loss_fn_output_type="TorchLossReturn",
        loss_fn_outputs=[{"logprobs": T.TensorData.from_numpy(np.float32([-1.5, -0.5]))}],
        metrics={"loss:sum": 2.0})
    out_fb = convert.from_forward_backward(fb)
    assert isinstance(out_fb, g.ForwardBackwardOutput) and out_fb.metrics == {"loss:sum": 2.0}
    assert isinstance(out_fb.loss_fn_outputs[0]["logprobs"], g.TensorData)
    assert out_fb.loss_fn_outputs[0]["logprobs"].tolist() == [-1.5, -0.5]
    assert convert.from_optim_step(T.OptimStepResponse(metrics={"grad_norm": 0.5})).metrics == {"grad_norm": 0.5}


def test_checkpoint_paths_use_the_backends_scheme():
    mint, tk = SDKS["mint"], SDKS["tinker"]
    assert mint.from_sdk_path("tinker://run-1/weights/step_000002") == "mint://run-1/weights/step_000002"
    assert mint.to_sdk_path("mint://run-1/weights/step_000002") == "tinker://run-1/weights/step_000002"
    assert tk.from_sdk_path("tinker://r/w") == "tinker://r/w" and tk.to_sdk_path("mint://r/w") == "tinker://r/w"
    with pytest.raises(RemoteConfigError, match=r"mint:// \(or tinker://\).*local"):
        mint.to_sdk_path("/tmp/run/checkpoints/step_000002")


def test_mint_sdk_is_the_tinker_sdk_plus_patches():
    mint = pytest.importorskip("mint")
    # Why one implementation serves both backends.
    assert mint.ServiceClient is tinker.ServiceClient and mint.types is tinker.types


# --------------------------------------------------------------------------- failing fast


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_missing_api_key_names_the_variable(clean_env):
    with pytest.raises(RemoteConfigError, match="MINT_API_KEY"):
        create_service_client({"name": "mint"}, Path("unused"))
    with pytest.raises(RemoteConfigError, match="TINKER_API_KEY"):
        create_service_client({"name": "tinker"}, Path("unused"))


def test_refused_connection_fails_fast_naming_endpoint_and_variable(clean_env):
    port = closed_port()
    clean_env.setenv("TINKER_API_KEY", "tml-test")
    clean_env.setenv("TINKER_BASE_URL", f"http://127.0.0.1:{port}")
    t0 = time.monotonic()
    with pytest.raises(RemoteConnectionError) as info:
        RemoteServiceClient(sdk="tinker", connect_timeout_s=5)
    assert time.monotonic() - t0 < 5
    assert f"127.0.0.1:{port}" in str(info.value) and "TINKER_BASE_URL" in str(info.value)


def test_silent_endpoint_times_out_naming_endpoint_and_variable(clean_env):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)  # accepts connections (kernel backlog) and never answers
    port = server.getsockname()[1]
    try:
        clean_env.setenv("MINT_API_KEY", "sk-test")
        t0 = time.monotonic()
        with pytest.raises(RemoteTimeoutError) as info:
            RemoteServiceClient(sdk="mint", base_url=f"http://127.0.0.1:{port}", connect_timeout_s=0.5)
        assert time.monotonic() - t0 < 4
        assert f"127.0.0.1:{port}" in str(info.value) and "MINT_BASE_URL" in str(info.value)
    finally:
        server.close()


def test_bad_url_and_unknown_sdk_are_config_errors(clean_env):
    clean_env.setenv("TINKER_API_KEY", "tml-test")
    with pytest.raises(RemoteConfigError, match="backend.base_url='127.0.0.1:80' is not an http"):
        RemoteServiceClient(sdk="tinker", base_url="127.0.0.1:80")
    with pytest.raises(RemoteConfigError, match="valid: mint, tinker"):
        RemoteServiceClient(sdk="modal")


# --------------------------------------------------------------------------- a service in this process


def transient_error() -> Exception:
    import httpx

    return tinker.APIConnectionError(request=httpx.Request("POST", "http://127.0.0.1/api/v1/x"))


class Recorded(concurrent.futures.Future):
    """The SDK's future: records when grpo waits on it."""

    def __init__(self, log: list, what: str):
        super().__init__()
        self._log, self._what = log, what

    def result(self, timeout=None):
        self._log.append(("await", self._what))
        return super().result(timeout)


class LocalService:
    """The SDK's ServiceClient API, in the SDK's types, served by the local backend.

    ``fail[what]`` lists exceptions to return for the next requests of that kind (requests that
    never reached the service). ``log`` records submissions and awaits in order.
    """

    def __init__(self, local):
        self.local = local
        self.log: list[tuple[str, str]] = []
        self.fail: dict[str, list[Exception]] = {}
        self.paths: dict[str, str] = {}
        self.trainers: list = []

    def call(self, what: str, make_local, to_sdk) -> Recorded:
        self.log.append(("submit", what))
        fut = Recorded(self.log, what)
        if self.fail.get(what):
            fut.set_exception(self.fail[what].pop(0))
            return fut
        local = make_local()

        def done(f):
            try:
                fut.set_result(to_sdk(f.result()))
            except Exception as err:
                fut.set_exception(err)

        local._future.add_done_callback(done)
        return fut

    def create_lora_training_client(self, base_model, rank, seed, train_mlp, train_attn, train_unembed):
        client = self.local.create_lora_training_client(base_model, rank=rank, seed=seed, train_mlp=train_mlp,
                                                        train_attn=train_attn, train_unembed=train_unembed)
        self.trainers.append(client)
        return LocalTraining(self, client)

    def create_sampling_client(self, model_path=None, base_model=None):
        path = self.paths[model_path] if model_path else None
        return LocalSampling(self, self.local.create_sampling_client(model_path=path, base_model=base_model))


def to_grpo_datum(d) -> g.Datum:
    return g.Datum(g.ModelInput.from_ints(d.model_input.to_ints()),
                   {k: v.to_numpy() for k, v in d.loss_fn_inputs.items()})


class LocalTraining:
    def __init__(self, service: LocalService, client):
        self.service, self.client = service, client

    def forward_backward(self, data, loss_fn, loss_fn_config=None):
        assert all(isinstance(d, T.Datum) for d in data)
        return self.service.call(
            "forward_backward",
            lambda: self.client.forward_backward([to_grpo_datum(d) for d in data], loss_fn, loss_fn_config),
            lambda out: T.ForwardBackwardOutput(
                loss_fn_output_type=out.loss_fn_output_type, metrics=out.metrics,
                loss_fn_outputs=[{k: T.TensorData.from_numpy(v.to_numpy()) for k, v in o.items()}
                                 for o in out.loss_fn_outputs]))

    def optim_step(self, adam):
        assert isinstance(adam, T.AdamParams)
        params = g.AdamParams(learning_rate=adam.learning_rate, beta1=adam.beta1, beta2=adam.beta2, eps=adam.eps,
                              weight_decay=adam.weight_decay, grad_clip_norm=adam.grad_clip_norm)
        return self.service.call("optim_step", lambda: self.client.optim_step(params),
                                 lambda out: T.OptimStepResponse(metrics=out.metrics))

    def _named(self, name: str, local_path: str) -> str:
        path = f"tinker://run-0/{name}"
        self.service.paths[path] = local_path
        return path

    def save_state(self, name, ttl_seconds=None, overwrite=False):
        return self.service.call("save_state", lambda: self.client.save_state(name),
                                 lambda out: T.SaveWeightsResponse(path=self._named(name, out.path)))

    def save_weights_for_sampler(self, name, ttl_seconds=None):
        return self.service.call("save_weights_for_sampler", lambda: self.client.save_weights_for_sampler(name),
                                 lambda out: T.SaveWeightsForSamplerResponse(path=self._named(name, out.path)))

    def load_state_with_optimizer(self, path):
        assert path.startswith("tinker://"), path
        return self.service.call("load_state_with_optimizer",
                                 lambda: self.client.load_state_with_optimizer(self.service.paths[path]),
                                 lambda out: T.LoadWeightsResponse(path=path))

    def save_weights_and_get_sampling_client(self, name=None):
        return LocalSampling(self.service, self.client.save_weights_and_get_sampling_client(name))

    def get_tokenizer(self):
        return self.client.get_tokenizer()


class LocalSampling:
    def __init__(self, service: LocalService, client):
        self.service, self.client = service, client

    def sample(self, prompt, num_samples, sampling_params, include_prompt_logprobs=False):
        assert isinstance(prompt, T.ModelInput) and isinstance(sampling_params, T.SamplingParams)
        p = sampling_params
        params = g.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                                  stop=p.stop, seed=p.seed)
        return self.service.call(
            "sample", lambda: self.client.sample(g.ModelInput.from_ints(prompt.to_ints()), num_samples, params),
            lambda out: T.SampleResponse(sequences=[sdk_sequence(s.tokens, s.logprobs, s.stop_reason)
                                                    for s in out.sequences]))

    def compute_logprobs(self, prompt):
        return self.service.call("compute_logprobs",
                                 lambda: self.client.compute_logprobs(g.ModelInput.from_ints(prompt.to_ints())),
                                 list)


@pytest.fixture
def local_service(fp32_service):
    """fp32, so that on-policy checks through the SDK hold to fp32 rounding on every CPU."""
    return LocalService(fp32_service)


def remote(local_service, sdk="tinker", **options) -> RemoteServiceClient:
    return RemoteServiceClient(sdk=sdk, service_client=local_service, **{**FAST, **options})


def batch(tokenizer, seed: int) -> list[g.Datum]:
    rng = np.random.default_rng(seed)
    prompt = tokenizer.encode("What is two plus two?")
    return [rl_datum(prompt, [int(t) for t in rng.integers(100, 2000, 5)], adv,
                     [float(x) for x in -rng.random(5)]) for adv in (1.0, -0.5)]


def assert_same_weights(client, reference, datum: g.Datum) -> None:
    """The two adapters give the same logprobs on ``datum``'s tokens (the first has none)."""
    tokens = g.ModelInput.from_ints(datum.model_input.to_ints())
    ours = client.save_weights_and_get_sampling_client().compute_logprobs(tokens).result()
    theirs = reference.save_weights_and_get_sampling_client().compute_logprobs(tokens).result()
    np.testing.assert_allclose(np.array(ours[1:]), np.array(theirs[1:]), atol=1e-6)


def test_training_matches_the_local_backend_and_forward_backward_and_optim_step_are_pipelined(
        local_service, tokenizer):
    data = batch(tokenizer, 0)
    adam = g.AdamParams(learning_rate=1e-2)
    client = remote(local_service).create_lora_training_client("tiny", rank=4, seed=3)
    reference = local_service.local.create_lora_training_client("tiny", rank=4, seed=3)

    fb, opt = client.forward_backward(data, "importance_sampling"), client.optim_step(adam)
    # Both requests reached the service before grpo waited on either.
    assert local_service.log[:2] == [("submit", "forward_backward"), ("submit", "optim_step")]
    fb_out, opt_out = fb.result(), opt.result()
    assert local_service.log.index(("await", "forward_backward")) > 1

    ref_fb = reference.forward_backward(data, "importance_sampling").result()
    ref_opt = reference.optim_step(adam).result()
    assert isinstance(fb_out, g.ForwardBackwardOutput) and isinstance(fb_out.loss_fn_outputs[0]["logprobs"], g.TensorData)
    assert fb_out.metrics["loss:sum"] == pytest.approx(ref_fb.metrics["loss:sum"], rel=1e-6)
    for ours, theirs in zip(fb_out.loss_fn_outputs, ref_fb.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(ours["logprobs"].to_numpy(), theirs["logprobs"].to_numpy(), atol=1e-6)
    assert opt_out.metrics["grad_norm"] == pytest.approx(ref_opt.metrics["grad_norm"], rel=1e-6)

    # After the step, both adapters give the same logprobs.
    assert_same_weights(client, reference, data[0])


def test_sampling_requests_are_in_flight_together_and_convert_back(local_service, tokenizer):
    sampler = remote(local_service).create_lora_training_client("tiny", rank=4, seed=0) \
        .save_weights_and_get_sampling_client()
    prompts = [tokenizer.encode(f"Count to {i}.") for i in range(3)]
    params = g.SamplingParams(max_tokens=5, temperature=1.0, seed=1, stop_token_ids=[tokenizer.eos_token_id])
    futures = [sampler.sample(g.ModelInput.from_ints(p), num_samples=2, sampling_params=params) for p in prompts]
    assert [e for e in local_service.log if e[1] == "sample"] == [("submit", "sample")] * 3
    results = [f.result() for f in futures]
    for response in results:
        assert isinstance(response, g.SampleResponse) and len(response.sequences) == 2
        for seq in response.sequences:
            assert 1 <= len(seq.tokens) <= 5 and len(seq.logprobs) == len(seq.tokens)
            assert seq.stop_reason in ("stop", "length") and all(lp <= 0 for lp in seq.logprobs)


def test_transient_sampling_errors_are_retried_with_backoff(local_service, tokenizer):
    sampler = remote(local_service, max_retries=2, backoff_s=0.05, backoff_max_s=1.0).create_sampling_client(base_model="tiny")
    local_service.fail["sample"] = [transient_error(), transient_error()]
    t0 = time.monotonic()
    out = sampler.sample(g.ModelInput.from_ints(tokenizer.encode("Hi")), 1, g.SamplingParams(max_tokens=3)).result()
    assert time.monotonic() - t0 >= 0.05 + 0.1  # backoff 0.05 s, then 0.1 s
    assert len(out.sequences) == 1 and local_service.log.count(("submit", "sample")) == 3
    # Errors that are not transient are not retried.
    local_service.fail["compute_logprobs"] = [ValueError("bad request")]
    with pytest.raises(ValueError, match="bad request"):
        sampler.compute_logprobs(g.ModelInput.from_ints([1, 2, 3])).result()
    assert local_service.log.count(("submit", "compute_logprobs")) == 1


def test_an_outage_during_a_step_replays_it_without_losing_it(local_service, tokenizer):
    data = batch(tokenizer, 1)
    adam = g.AdamParams(learning_rate=1e-2)
    client = remote(local_service, max_retries=2).create_lora_training_client("tiny", rank=4, seed=5)
    reference = local_service.local.create_lora_training_client("tiny", rank=4, seed=5)
    local_service.fail = {"forward_backward": [transient_error()], "optim_step": [transient_error()]}

    fb, opt = client.forward_backward(data, "ppo"), client.optim_step(adam)
    fb_out, _ = fb.result(), opt.result()
    submits = [w for e, w in local_service.log if e == "submit"]
    assert submits == ["forward_backward", "optim_step", "forward_backward", "optim_step"]  # replayed in order

    ref_fb = reference.forward_backward(data, "ppo").result()
    reference.optim_step(adam).result()
    assert fb_out.metrics["loss:sum"] == pytest.approx(ref_fb.metrics["loss:sum"], rel=1e-6)
    # Exactly one step was applied: the weights equal the reference's after its one step.
    assert_same_weights(client, reference, data[1])


def test_a_step_that_half_ran_is_not_replayed(local_service, tokenizer):
    client = remote(local_service).create_lora_training_client("tiny", rank=4, seed=5)
    local_service.fail = {"forward_backward": [transient_error()]}  # lost, while optim_step runs
    fb, opt = client.forward_backward(batch(tokenizer, 2), "importance_sampling"), client.optim_step(g.AdamParams())
    with pytest.raises(RemoteStepError, match="optim_step already ran.*resume"):
        fb.result()
    with pytest.raises(RemoteStepError):
        opt.result()
    assert [w for e, w in local_service.log if e == "submit"] == ["forward_backward", "optim_step"]


def test_run_grpo_on_the_remote_client_checkpoints_with_the_scheme_and_resumes(local_service, tmp_path):
    from grpo.record.runlog import read_jsonl
    from grpo.rl.loop import run_grpo

    cfg = {"base_model": "tiny", "rank": 4, "batch_size": 2, "group_size": 2, "max_tokens": 6, "report": False,
           "progress": False, "learning_rate": 1e-3, "save_every": 1, "steps": 2}
    final = run_grpo(ToyAdapter(eval_items=0), cfg, service_client=remote(local_service, sdk="mint"),
                     run_dir=tmp_path)
    assert final == "mint://run-0/final"
    rows = read_jsonl(tmp_path / "checkpoints.jsonl")
    assert [r["path"] for r in rows if r["kind"] == "state"] == ["mint://run-0/step_000001", "mint://run-0/step_000002"]
    steps = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
    assert len(steps) == 2 and all(np.isfinite(r["loss"]) for r in steps)
    # On-policy: the service's sampler and trainer agree on the sampled tokens' logprobs.
    assert all(abs(r["kl/sample_train"]) < 1e-4 for r in steps if "kl/sample_train" in r)

    # Rerun with more steps: resume goes through load_state_with_optimizer with a tinker:// path.
    run_grpo(ToyAdapter(eval_items=0), {**cfg, "steps": 3}, service_client=remote(local_service, sdk="mint"),
             run_dir=tmp_path)
    loads = [w for e, w in local_service.log if e == "submit" and w == "load_state_with_optimizer"]
    assert loads == ["load_state_with_optimizer"]
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r] == [0, 1, 2]


# --------------------------------------------------------------------------- multi-turn episodes


def test_multi_turn_datum_keeps_its_observation_mask_through_conversion():
    from grpo.rl.advantages import build_datum
    from grpo.rl.rollouts import Rollout

    # prompt 5 6 7 ▸ model 8 9 ▸ observation 10 11 ▸ model 12
    episode = Rollout(tokens=[8, 9, 10, 11, 12], logprobs=[-0.5, -1.0, 0.0, 0.0, -0.25], stop_reason="stop",
                      text="", mask=(1, 1, 0, 0, 1))
    out = convert.datum(T, build_datum([5, 6, 7], episode, [0.75] * 5))
    assert out.model_input.to_ints() == [5, 6, 7, 8, 9, 10, 11]
    inputs = out.loss_fn_inputs
    np.testing.assert_array_equal(inputs["target_tokens"].to_numpy(), [6, 7, 8, 9, 10, 11, 12])
    np.testing.assert_array_equal(inputs["weights"].to_numpy(), [0, 0, 1, 1, 0, 0, 1])
    np.testing.assert_array_equal(inputs["logprobs"].to_numpy(), np.float32([0, 0, -0.5, -1.0, 0, 0, -0.25]))
    np.testing.assert_array_equal(inputs["advantages"].to_numpy(), np.float32([0, 0, 0.75, 0.75, 0, 0, 0.75]))


def test_run_grpo_runs_multi_turn_episodes_through_the_sdk_unchanged(local_service, tmp_path):
    from toy_agent import ToyAgent

    from grpo.record.runlog import read_jsonl
    from grpo.rl.loop import run_grpo

    cfg = {"base_model": "tiny", "rank": 4, "batch_size": 2, "group_size": 2, "max_tokens": 16, "report": False,
           "progress": False, "learning_rate": 1e-3, "steps": 1}
    run_grpo(ToyAgent(num_items=4, max_turns=3), cfg, service_client=remote(local_service, sdk="tinker"),
             run_dir=tmp_path)
    (row,) = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
    assert row["episode/turns"] == 3 and row["episode/observations"] == 2 and row["datums"] == 4
    # turn 1: one request per prompt; turns 2 and 3: one per episode, all through the SDK's types
    assert local_service.log.count(("submit", "sample")) == 2 + 4 + 4
    # on-policy through the service: the trainer's logprobs of model tokens equal the sampler's
    assert abs(row["kl/sample_train"]) < 1e-4 and row["logprob/max_abs_diff"] < 1e-4
