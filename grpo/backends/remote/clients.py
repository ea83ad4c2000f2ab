"""ServiceClient / TrainingClient / SamplingClient over the MinT or Tinker SDK.

They take and return grpo.types objects (converted at the boundary), so run_grpo runs
unchanged on a service. Every call is submitted to the SDK at once and returns a future:
a batch's sampling requests are in flight together, and forward_backward and optim_step are
both submitted before either is awaited.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from grpo import types as g
from grpo.api.losses import check_loss_fn
from grpo.backends.remote import compat, convert
from grpo.backends.remote.resilience import (
    LazyFuture,
    RemoteStepError,
    RemoteTimeoutError,
    RetryPolicy,
    as_request_error,
    check_reachable,
    is_transient,
    retrying,
    sdk_future_done,
    submit_guarded,
    wait,
)
from grpo.backends.remote.sdk import RemoteConfigError, SdkSpec, get_spec
from grpo.checks import check_lora_targets
from grpo.types import async_twin

logger = logging.getLogger("grpo.remote")


class RemoteServiceClient:
    """Entry point for ``backend=mint`` / ``backend=tinker`` (options: conf/backend/<name>.yaml).

    Args:
        sdk: "mint" or "tinker".
        api_key, base_url: default to $MINT_API_KEY / $MINT_BASE_URL (or the TINKER_ ones).
        connect_timeout_s: the start-up reachability check's limit; ``preflight: false`` skips it.
        startup_timeout_s: limit for the SDK to open its session.
        max_retries, backoff_s, backoff_max_s: retries of transient errors, per request.
        call_timeout_s: how long one request may run before the run stops with an error.
        tokenizer: a name or directory for grpo.models.load_tokenizer; default: the SDK's
            tokenizer, falling back to grpo.models.load_tokenizer(base_model).
        persist_sampler_weights: keep each step's sampler weights on the service (named
            step_N) instead of ephemeral ones.
        checkpoint_ttl_seconds: expiry of saved states on the service (null: the service default).
        sdk_options: extra keyword arguments for the SDK's ServiceClient.
        service_client: an SDK ServiceClient (or one with the same API) to use as is; skips the
            key and endpoint checks.
    """

    def __init__(self, sdk: str = "tinker", *, api_key: str | None = None, base_url: str | None = None,
                 preflight: bool = True, connect_timeout_s: float = 10.0, startup_timeout_s: float = 120.0,
                 max_retries: int = 3, backoff_s: float = 1.0, backoff_max_s: float = 30.0,
                 call_timeout_s: float | None = 900.0, tokenizer: str | None = None,
                 persist_sampler_weights: bool = False, checkpoint_ttl_seconds: int | None = None,
                 sdk_options: Mapping[str, Any] | None = None, service_client: Any = None) -> None:
        self.spec: SdkSpec = get_spec(sdk)
        self.policy = RetryPolicy(max_retries=int(max_retries), backoff_s=float(backoff_s),
                                  backoff_max_s=float(backoff_max_s),
                                  call_timeout_s=None if call_timeout_s is None else float(call_timeout_s))
        self.tokenizer_name = tokenizer
        self.persist_sampler_weights = bool(persist_sampler_weights)
        self.checkpoint_ttl_seconds = checkpoint_ttl_seconds
        self._sdk = self.spec.import_sdk()
        self.types = self._sdk.types
        if service_client is not None:
            self.endpoint = f"the {sdk} service"
            self.sdk_client = service_client
            return
        key = self.spec.api_key(api_key)
        url = self.spec.base_url(base_url)
        self.endpoint = url
        if preflight:
            check_reachable(url, self.spec.url_var, float(connect_timeout_s))
            verdict = compat.check("tinker", url, key or None, float(connect_timeout_s))
            if verdict.fits is False:
                raise RemoteConfigError(verdict.line)
            print(f"grpo: {verdict.line}", flush=True)
        kwargs = {**dict(sdk_options or {}), "base_url": url}
        if key:
            kwargs["api_key"] = key
        self.sdk_client = self._start(lambda: self._sdk.ServiceClient(**kwargs), float(startup_timeout_s))

    def _start(self, make: Callable[[], Any], timeout_s: float) -> Any:
        """Build the SDK client in a thread so that a silent service cannot hang start-up."""
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grpo-remote-start")
        future = pool.submit(make)
        pool.shutdown(wait=False)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError as err:
            raise RemoteTimeoutError(
                f"the {self.spec.name} SDK could not open a session at {self.endpoint} within {timeout_s:g} s; "
                f"check {self.spec.url_var} / {self.spec.key_var} or raise backend.startup_timeout_s") from err
        except Exception as err:
            if getattr(err, "status_code", None) in (401, 403) or type(err).__name__ == "AuthenticationError":
                raise RemoteConfigError(f"{self.endpoint} rejected the API key: check {self.spec.key_var}") from err
            if is_transient(err):
                raise ConnectionError(f"the {self.spec.name} SDK could not reach {self.endpoint}: {err}; check "
                                      f"{self.spec.url_var} (or backend.base_url) and the network") from err
            raise

    # ------------------------------------------------------------------ plumbing

    def _ready(self, client: Any) -> Any:
        # Tinker >= 0.3x returns client-creation futures that double as the client; wait for them.
        future_cls = getattr(self._sdk, "APIFuture", None)
        if future_cls is not None and isinstance(client, future_cls):
            return wait(client, self.policy.call_timeout_s, "creating a client", self.endpoint)
        return client

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        """A blocking SDK call, retried on transient errors."""
        return retrying(lambda: _completed(fn), lambda x: x, self.policy, what, self.endpoint, logger.warning).result()

    # ------------------------------------------------------------------ the API

    def get_server_capabilities(self) -> Any:
        return self._call("get_server_capabilities", self.sdk_client.get_server_capabilities)

    def create_lora_training_client(self, base_model: str, rank: int = 16, seed: int | None = None,
                                    train_mlp: bool = True, train_attn: bool = True,
                                    train_unembed: bool = True, **sdk_kwargs: Any) -> RemoteTrainingClient:
        check_lora_targets(train_mlp, train_attn, train_unembed)
        client = self._call("create_lora_training_client", lambda: self._ready(
            self.sdk_client.create_lora_training_client(
                base_model=base_model, rank=int(rank), seed=seed, train_mlp=bool(train_mlp),
                train_attn=bool(train_attn), train_unembed=bool(train_unembed), **sdk_kwargs)))
        return RemoteTrainingClient(self, client, base_model)

    def create_training_client_from_state(self, path: str, base_model: str | None = None,
                                          **sdk_kwargs: Any) -> RemoteTrainingClient:
        """A training client with the weights saved at ``path`` and a fresh optimizer."""
        sdk_path = self.spec.to_sdk_path(path)
        client = self._call("create_training_client_from_state", lambda: self._ready(
            self.sdk_client.create_training_client_from_state(sdk_path, **sdk_kwargs)))
        return RemoteTrainingClient(self, client, base_model)

    def create_training_client_from_state_with_optimizer(self, path: str, base_model: str | None = None,
                                                         **sdk_kwargs: Any) -> RemoteTrainingClient:
        """Resume: a training client with the weights and optimizer state saved at ``path``."""
        sdk_path = self.spec.to_sdk_path(path)
        client = self._call("create_training_client_from_state_with_optimizer", lambda: self._ready(
            self.sdk_client.create_training_client_from_state_with_optimizer(sdk_path, **sdk_kwargs)))
        return RemoteTrainingClient(self, client, base_model)

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None,
                               **sdk_kwargs: Any) -> RemoteSamplingClient:
        if model_path is None and base_model is None:
            raise ValueError("create_sampling_client needs model_path (saved weights) or base_model")
        sdk_path = None if model_path is None else self.spec.to_sdk_path(model_path)
        client = self._call("create_sampling_client", lambda: self._ready(
            self.sdk_client.create_sampling_client(model_path=sdk_path, base_model=base_model, **sdk_kwargs)))
        return RemoteSamplingClient(self, client, tokenizer_source=lambda: self._tokenizer(None, base_model))

    get_server_capabilities_async = async_twin("get_server_capabilities")
    create_lora_training_client_async = async_twin("create_lora_training_client")
    create_training_client_from_state_async = async_twin("create_training_client_from_state")
    create_training_client_from_state_with_optimizer_async = async_twin(
        "create_training_client_from_state_with_optimizer")
    create_sampling_client_async = async_twin("create_sampling_client")

    def _tokenizer(self, sdk_client: Any, base_model: str | None) -> Any:
        """The tokenizer: backend.tokenizer if set; else the SDK's (it downloads from the
        Hugging Face hub); else grpo.models.load_tokenizer(base_model) (packaged / local)."""
        from grpo import models

        if self.tokenizer_name:
            return models.load_tokenizer(self.tokenizer_name)
        errors = []
        if sdk_client is not None:
            try:
                return sdk_client.get_tokenizer()
            except Exception as err:
                errors.append(f"the SDK's get_tokenizer: {type(err).__name__}: {err}")
        if base_model:
            try:
                return models.load_tokenizer(base_model)
            except Exception as err:
                errors.append(f"grpo.models.load_tokenizer({base_model!r}): {err}")
        raise RemoteConfigError("no tokenizer could be loaded (" + "; ".join(errors) + "); set backend.tokenizer "
                                "to a local tokenizer directory or a model name grpo knows")


def _completed(fn: Callable[[], Any]) -> concurrent.futures.Future:
    fut: concurrent.futures.Future = concurrent.futures.Future()
    fut.set_result(fn())
    return fut


class _TrainingCall:
    """One training request: how to (re)submit it, its SDK future, how to convert its value."""

    def __init__(self, what: str, submit: Callable[[], Any], convert: Callable[[Any], Any]):
        self.what = what
        self.submit = submit
        self.convert = convert
        self.future = submit_guarded(submit)
        self.outcome: tuple[bool, Any] | None = None


class RemoteTrainingClient:
    """Training calls, pipelined on the service and settled in submission order.

    A transient failure is retried by resubmitting the failed request and everything submitted
    after it, in order, but only when none of those later requests took effect (the usual case:
    the service was unreachable for all of them). If a later one did take effect (say
    optim_step ran after a lost forward_backward), replaying would apply the step out of order,
    so the run stops with RemoteStepError; rerunning the same command resumes from the last
    checkpoint.
    """

    def __init__(self, service: RemoteServiceClient, sdk_client: Any, base_model: str | None):
        self.service = service
        self.sdk_client = sdk_client
        self.base_model = base_model
        self.types = service.types
        self._pending: list[_TrainingCall] = []
        self._lock = threading.RLock()
        self._tokenizer: Any = None

    # ------------------------------------------------------------------ ordered pipeline

    def _submit(self, what: str, submit: Callable[[], Any], convert_fn: Callable[[Any], Any]) -> LazyFuture:
        with self._lock:
            call = _TrainingCall(what, submit, convert_fn)
            self._pending.append(call)
        return LazyFuture(lambda timeout: self._settle(call, timeout), lambda: sdk_future_done(call.future))

    def _settle(self, call: _TrainingCall, timeout: float | None) -> Any:
        with self._lock:
            if call.outcome is None:
                self._settle_pending(timeout or self.service.policy.call_timeout_s)
        ok, value = call.outcome
        if ok:
            return value
        refusal = as_request_error(value, call.what, self.service.endpoint)
        if refusal is not value:
            raise refusal from value
        raise value

    def _settle_pending(self, timeout: float | None) -> None:
        chain, self._pending = self._pending, []
        policy, endpoint = self.service.policy, self.service.endpoint
        start = 0  # calls before this index are settled
        for attempt in range(policy.max_retries + 1):
            outcomes = [_outcome(c, timeout, endpoint) for c in chain[start:]]
            bad = next((i for i, (ok, _) in enumerate(outcomes) if not ok), None)
            if bad is None or not is_transient(outcomes[bad][1]) or attempt == policy.max_retries:
                break
            applied = [c.what for c, (ok, _) in zip(chain[start + bad + 1:], outcomes[bad + 1:], strict=True) if ok]
            if applied:
                failed = chain[start + bad]
                err = RemoteStepError(
                    f"{failed.what} failed ({type(outcomes[bad][1]).__name__}: {outcomes[bad][1]}) but the later "
                    f"{', '.join(applied)} already ran on {endpoint}; replaying would apply them out of order. "
                    "Rerun the same command to resume from the last checkpoint.")
                outcomes = outcomes[:bad] + [(False, err)] * (len(outcomes) - bad)
                break
            for c, outcome in zip(chain[start:start + bad], outcomes[:bad], strict=True):
                c.outcome = outcome
            start += bad
            delay = policy.delay(attempt)
            logger.warning("%s: %s: %s; resubmitting %d request(s), retry %d/%d in %g s", chain[start].what,
                           type(outcomes[bad][1]).__name__, outcomes[bad][1], len(chain) - start, attempt + 1,
                           policy.max_retries, delay)
            time.sleep(delay)
            for c in chain[start:]:
                c.future = submit_guarded(c.submit)
        for c, outcome in zip(chain[start:], outcomes, strict=True):
            c.outcome = outcome

    def _settle_all(self) -> None:
        with self._lock:
            pending = list(self._pending)
        for call in pending:
            self._settle(call, None)

    # ------------------------------------------------------------------ training

    def forward_backward(self, data: Sequence[g.Datum], loss_fn: str, loss_fn_config: Mapping[str, Any] | None = None
                         ) -> LazyFuture[g.ForwardBackwardOutput]:
        check_loss_fn(loss_fn)
        sdk_data = [convert.datum(self.types, d) for d in data]
        config = convert.loss_fn_config(loss_fn_config)
        return self._submit("forward_backward", lambda: self.sdk_client.forward_backward(sdk_data, loss_fn, config),
                            convert.from_forward_backward)

    def forward(self, data: Sequence[g.Datum], loss_fn: str,
                loss_fn_config: Mapping[str, Any] | None = None) -> LazyFuture[g.ForwardBackwardOutput]:
        if loss_fn not in g.LOSS_FNS:  # as forward_backward: a bad name fails here, not on the service
            raise ValueError(f"loss_fn={loss_fn!r} is invalid; valid: {', '.join(g.LOSS_FNS)}")
        sdk_data = [convert.datum(self.types, d) for d in data]
        config = convert.loss_fn_config(loss_fn_config)
        return self._submit("forward", lambda: self.sdk_client.forward(sdk_data, loss_fn, config),
                            convert.from_forward_backward)

    def optim_step(self, optim_params: g.AdamParams | None = None, *,
                   adam_params: g.AdamParams | None = None) -> LazyFuture[g.OptimStepResponse]:
        if (optim_params is None) == (adam_params is None):
            raise TypeError("optim_step takes one AdamParams: optim_step(params) or optim_step(adam_params=params)")
        sdk_adam = convert.adam_params(self.types, optim_params if optim_params is not None else adam_params)
        return self._submit("optim_step", lambda: self.sdk_client.optim_step(sdk_adam), convert.from_optim_step)

    # ------------------------------------------------------------------ state

    def _save_kwargs(self, method: Callable[..., Any], **given: Any) -> dict[str, Any]:
        """The SDK keyword arguments this SDK version accepts: those given, else the backend's
        checkpoint_ttl_seconds as the TTL."""
        params = inspect.signature(method).parameters
        kwargs: dict[str, Any] = {}
        if self.service.checkpoint_ttl_seconds is not None and "ttl_seconds" in params:
            kwargs["ttl_seconds"] = int(self.service.checkpoint_ttl_seconds)
        kwargs.update({k: v for k, v in given.items() if v is not None and k in params})
        return kwargs

    def _path_response(self, cls: type) -> Callable[[Any], Any]:
        return lambda response: cls(path=self.service.spec.from_sdk_path(response.path))

    def save_state(self, name: str, ttl_seconds: int | None = None, overwrite: bool = False,
                   user_metadata: dict[str, str] | None = None) -> LazyFuture[g.SaveWeightsResponse]:
        """Weights and optimizer state on the service; the path is ``mint://...`` / ``tinker://...``."""
        kwargs = self._save_kwargs(self.sdk_client.save_state, ttl_seconds=ttl_seconds,
                                   overwrite=overwrite or None, user_metadata=user_metadata)
        return self._submit("save_state", lambda: self.sdk_client.save_state(name, **kwargs),
                            self._path_response(g.SaveWeightsResponse))

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None,
                                 user_metadata: dict[str, str] | None = None
                                 ) -> LazyFuture[g.SaveWeightsForSamplerResponse]:
        kwargs = self._save_kwargs(self.sdk_client.save_weights_for_sampler, ttl_seconds=ttl_seconds,
                                   user_metadata=user_metadata)
        return self._submit("save_weights_for_sampler", lambda: self.sdk_client.save_weights_for_sampler(name, **kwargs),
                            self._path_response(g.SaveWeightsForSamplerResponse))

    def load_state(self, path: str, weights_access_token: str | None = None) -> LazyFuture[g.LoadWeightsResponse]:
        sdk_path = self.service.spec.to_sdk_path(path)
        return self._submit("load_state", lambda: self.sdk_client.load_state(sdk_path),
                            lambda _: g.LoadWeightsResponse(path=str(path)))

    def load_state_with_optimizer(self, path: str, weights_access_token: str | None = None
                                  ) -> LazyFuture[g.LoadWeightsResponse]:
        sdk_path = self.service.spec.to_sdk_path(path)
        return self._submit("load_state_with_optimizer", lambda: self.sdk_client.load_state_with_optimizer(sdk_path),
                            lambda _: g.LoadWeightsResponse(path=str(path)))

    # ------------------------------------------------------------------ sampling

    def save_weights_and_get_sampling_client(self, name: str | None = None) -> RemoteSamplingClient:
        """A sampler of the current weights, after every training call submitted so far."""
        self._settle_all()  # a failed step must surface here, not as samples of stale weights
        sdk_name = name if self.service.persist_sampler_weights else None
        client = self.service._call("save_weights_and_get_sampling_client", lambda: self.service._ready(
            self.sdk_client.save_weights_and_get_sampling_client(sdk_name)))
        return RemoteSamplingClient(self.service, client, tokenizer_source=self.get_tokenizer)

    def create_sampling_client(self, model_path: str, **sdk_kwargs: Any) -> RemoteSamplingClient:
        return self.service.create_sampling_client(model_path=model_path, base_model=self.base_model, **sdk_kwargs)

    # ------------------------------------------------------------------ info

    def get_tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = self.service._tokenizer(self.sdk_client, self.base_model)
        return self._tokenizer

    def get_info(self) -> Any:
        return self.service._call("get_info", self.sdk_client.get_info)

    # ------------------------------------------------------------------ async twins

    forward_backward_async = async_twin("forward_backward")
    forward_async = async_twin("forward")
    optim_step_async = async_twin("optim_step")
    save_state_async = async_twin("save_state")
    load_state_async = async_twin("load_state")
    load_state_with_optimizer_async = async_twin("load_state_with_optimizer")
    save_weights_for_sampler_async = async_twin("save_weights_for_sampler")
    save_weights_and_get_sampling_client_async = async_twin("save_weights_and_get_sampling_client")


def _outcome(call: _TrainingCall, timeout: float | None, endpoint: str) -> tuple[bool, Any]:
    if call.outcome is not None:
        return call.outcome
    try:
        return True, call.convert(wait(call.future, timeout, call.what, endpoint))
    except Exception as err:
        return False, err


class RemoteSamplingClient:
    """sample / compute_logprobs on the service; each call is submitted at once, and a
    transient failure is retried when its result is asked for."""

    def __init__(self, service: RemoteServiceClient, sdk_client: Any, tokenizer_source: Callable[[], Any]):
        self.service = service
        self.sdk_client = sdk_client
        self.types = service.types
        self._tokenizer_source = tokenizer_source
        self._tokenizer: Any = None

    def _decode(self, token_id: int) -> str:
        return self.get_tokenizer().decode([int(token_id)], skip_special_tokens=False)

    def sample(self, prompt: g.ModelInput, num_samples: int = 1, sampling_params: g.SamplingParams | None = None,
               include_prompt_logprobs: bool = False) -> LazyFuture[g.SampleResponse]:
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be a positive integer, got {num_samples!r}")
        sdk_prompt = convert.model_input(self.types, prompt)
        if prompt.length == 0:
            raise ValueError("prompt is empty: sampling needs at least one prompt token")
        params = convert.sampling_params(self.types, sampling_params, decode=self._decode)
        return retrying(lambda: self.sdk_client.sample(prompt=sdk_prompt, num_samples=num_samples,
                                                       sampling_params=params,
                                                       include_prompt_logprobs=include_prompt_logprobs),
                        convert.from_sample_response, self.service.policy, "sample", self.service.endpoint,
                        logger.warning)

    def compute_logprobs(self, prompt: g.ModelInput) -> LazyFuture[list[float | None]]:
        sdk_prompt = convert.model_input(self.types, prompt)
        return retrying(lambda: self.sdk_client.compute_logprobs(sdk_prompt), convert.from_logprobs,
                        self.service.policy, "compute_logprobs", self.service.endpoint, logger.warning)

    sample_async = async_twin("sample", awaited=True)
    compute_logprobs_async = async_twin("compute_logprobs", awaited=True)

    def get_tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = self._tokenizer_source()
        return self._tokenizer
