"""ServiceClient, TrainingClient and SamplingClient of the Tinker API, run in this process.

Training calls run in order on one computing thread and return futures at once, so a caller can
submit forward_backward and optim_step back to back as on the service. Sampling calls go to a
batcher that runs the requests a caller issued before waiting as one generation (the same one on
every run, see _SampleBatcher), on that same thread. On a CPU it is the process's computing thread
(computing.py: PyTorch's work on several threads leaves a small machine's cores idle); on a GPU
each base model has its own.

Every method of the Tinker SDK (0.38) that has a local meaning is here under the SDK's name and
parameter names, with its ``_async`` twin; grpo/api/sdk_parity.py lists the rest and why. Saved
states live in a grpo.api.checkpoint_store.CheckpointStore under ``checkpoint_dir`` and are named by
``tinker://`` paths; every loader takes those or a plain directory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import itertools
import json
import math
import os
import pickle
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from grpo import models
from grpo.api import names
from grpo.api.checkpoint_store import CheckpointStore, default_root
from grpo.api.rest_client import RestClient
from grpo.backends.local import age_export, custom_loss, heap, memory, sampler, trainer
from grpo.backends.local.engine import Engine, LoraSpec
from grpo.backends.local.prefix_cache import PrefixCache
from grpo.backends.local.sections import section
from grpo.files import atomic_write_text, replace_dir, staging_path
from grpo.models import computing as local_computing
from grpo.models import precision
from grpo.types import (
    AdamParams,
    APIFuture,
    Datum,
    ForwardBackwardOutput,
    GetInfoResponse,
    GetServerCapabilitiesResponse,
    LoadWeightsResponse,
    ModelData,
    ModelInput,
    OptimStepResponse,
    SampleResponse,
    SamplingParams,
    SaveWeightsExternalResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    SupportedModel,
    async_twin,
    text_tokens,
)

STATE_FILE = "grpo_state.json"
OPTIMIZER_FILE = "optimizer.pt"
DEFAULT_MAX_TOKENS = 256


class _ClientFuture:
    """SDK 0.38's creation calls return an object that is both the client and a future of it
    (``create_lora_training_client(...).result()`` and ``await`` work); local clients are ready
    at once, so each is its own completed future."""

    def result(self, timeout: float | None = None) -> Any:
        return self

    async def result_async(self, timeout: float | None = None) -> Any:
        return self

    def done(self) -> bool:
        return True

    def __await__(self):
        return self.result_async().__await__()


def _read_precision_record(path: Path | None) -> dict[str, dict[str, str]]:
    """A precision record's contents; none yet (or no file asked for): empty. One that is not a
    record (hand-edited, cut) is an error naming it: guessing would silently change precision."""
    if path is None or not path.exists():
        return {}
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"precision record {path} cannot be read ({err}); delete it to resolve auto again") from err
    if not isinstance(record, dict) or not all(isinstance(v, dict) for v in record.values()):
        raise ValueError(f"precision record {path} is not a mapping of model -> roles; delete it to resolve auto again")
    return record


class ServiceClient:
    """Entry point, as ``tinker.ServiceClient`` / ``mint.ServiceClient``.

    Args beyond the SDK's (all optional): ``checkpoint_dir`` where named states are written
    (default ``$GRPO_CHECKPOINT_DIR``, else ``$GRPO_CACHE/checkpoints``), ``device``, ``train_dtype`` and ``sample_dtype`` (the
    precision of the base weights the trainer and the sampler run: fp32, bf16 or "auto": bf16 on
    CUDA, on a CPU whichever this machine measured faster for the model, decided for each of the
    two; LoRA weights and optimizer state stay fp32;
    see grpo/models/precision.py), ``dtype`` (both at once, where the two are not given),
    ``memory_budget_mb`` (working memory of one training micro-batch
    or of the rows the sampler decodes at once; "auto": a share of the device's memory, 0:
    unbounded; see memory.py), ``micro_batch_tokens`` (padded tokens per training micro-batch;
    overrides what the budget gives), ``prefix_cache_mb`` (the sampler's prefix cache, which keeps
    the keys and values of prompts and finished samples so that a later prompt extending them --
    the next turn of an episode -- is prefilled only on its new tokens; "auto": as large as the
    memory budget, or ``$GRPO_PREFIX_CACHE_MB`` where set; 0: off; see prefix_cache.py),
    ``precision_record`` (a JSON file keeping, per base model, the precision each role ran in:
    where it exists, a role left at ``auto`` takes the recorded precision instead of resolving
    again, so a resumed run trains and samples as it began even where ``auto`` would now decide
    otherwise -- another measurement, a machine that was too busy to measure the first time).
    The SDK's own arguments come first, in its order (``user_metadata``, ``project_id``, then
    keyword-only ``display_name``, ``base_url``, ``api_key``...); they are accepted and unused, so
    ``ServiceClient(base_url=...)`` written for the service runs unchanged. grpo's are keyword-only.
    """

    def __init__(self, user_metadata: dict[str, str] | None = None, project_id: str | None = None, *,
                 display_name: str | None = None, base_url: str | None = None, api_key: str | None = None,
                 default_headers_overrides: Any = None,
                 checkpoint_dir: str | os.PathLike | None = None, device: str | None = None,
                 dtype: str | None = None, micro_batch_tokens: int | None = None,
                 memory_budget_mb: int | float | str | None = "auto", train_dtype: str | None = None,
                 sample_dtype: str | None = None, prefix_cache_mb: int | float | str | None = "auto",
                 precision_record: str | os.PathLike | None = None, **_sdk_kwargs: Any):
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else default_root()
        self.device = device
        for key, value in (("dtype", dtype), ("train_dtype", train_dtype), ("sample_dtype", sample_dtype)):
            precision.check(key, value)  # fail fast, before any model loads
        self.train_dtype = train_dtype if train_dtype is not None else dtype
        self.sample_dtype = sample_dtype if sample_dtype is not None else self.train_dtype
        if micro_batch_tokens is not None and (not isinstance(micro_batch_tokens, int) or micro_batch_tokens <= 0):
            raise ValueError(f"micro_batch_tokens must be a positive integer or null, got {micro_batch_tokens!r}")
        self.micro_batch_tokens = micro_batch_tokens
        memory.resolve_budget(memory_budget_mb, torch.device("cpu"))  # fail fast on a bad value
        self.memory_budget_mb = memory_budget_mb
        if prefix_cache_mb in (None, "auto") and os.environ.get("GRPO_PREFIX_CACHE_MB"):
            # for programs that make their own ServiceClient (python -m grpo.tinker_run ...)
            prefix_cache_mb = memory.megabytes_from_text(os.environ["GRPO_PREFIX_CACHE_MB"])
        memory.resolve_prefix_cache(prefix_cache_mb, None)  # fail fast on a bad value
        self.prefix_cache_mb = prefix_cache_mb
        self.precision_record = Path(precision_record) if precision_record is not None else None
        _read_precision_record(self.precision_record)  # fail fast on one that cannot be read
        self.store = CheckpointStore(self.checkpoint_dir)
        # Whether a save may name a plain directory of this machine (in-process: yes; grpo.serve
        # turns it off, so no client of a server can write outside its store).
        self.directory_saves = True
        self._engines: dict[str, _EngineHandle] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()

    def _engine(self, base_model: str) -> _EngineHandle:
        # public_id fails fast on a bad name, before any thread starts, and gives one key to the
        # names of one model ("smollm2" and the id an exported adapter_config.json names)
        key = models.public_id(base_model)
        with self._lock:
            if key not in self._engines:
                record = _read_precision_record(self.precision_record)
                train_dtype, sample_dtype = self._recorded_precision(key, record)
                # The model is loaded on the thread that will compute with it (_EngineHandle): its own
                # on a GPU, the process's (None) on a CPU.
                own = _own_computing_thread() if models.resolve_device(self.device).type != "cpu" else None
                try:
                    engine = _call_on(own, Engine, base_model, self.device, train_dtype, sample_dtype)
                except BaseException:
                    if own is not None:
                        own.shutdown(wait=False)
                    raise
                self._record_precision(key, engine, record)
                budget = memory.Budget.for_model(self.memory_budget_mb, engine.model, engine.device)
                cache_bytes = memory.resolve_prefix_cache(self.prefix_cache_mb, budget.bytes, engine.device)
                self._engines[key] = _EngineHandle(engine, budget, cache_bytes, own)
            return self._engines[key]

    def _recorded_precision(self, key: str, record: dict[str, dict[str, str]]) -> tuple[Any, Any]:
        """This client's train_dtype and sample_dtype, a role left at ``auto`` replaced by the
        precision ``record`` (the precision record's contents) keeps for ``key``, if any."""
        chosen = {"train_dtype": self.train_dtype, "sample_dtype": self.sample_dtype}
        recorded = record.get(key, {})
        for role, value in chosen.items():
            if value in (None, "auto") and recorded.get(role) in ("fp32", "bf16"):
                chosen[role] = recorded[role]
                print(f"[grpo] {role} {recorded[role]}: auto as this run first resolved it ({self.precision_record})",
                      flush=True)
        return chosen["train_dtype"], chosen["sample_dtype"]

    def _record_precision(self, key: str, engine: Engine, record: dict[str, dict[str, str]]) -> None:
        """Write ``record`` back with ``key``'s precision as ``engine`` resolved it."""
        if self.precision_record is None:
            return
        names = {torch.float32: "fp32", torch.bfloat16: "bf16"}
        record = {**record, key: {"train_dtype": names.get(engine.dtype, str(engine.dtype)),
                                  "sample_dtype": names.get(engine.sample_dtype, str(engine.sample_dtype))}}
        self.precision_record.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.precision_record, json.dumps(record, indent=1, sort_keys=True) + "\n")

    # ------------------------------------------------------------------ session

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.close("success" if exc_type is None else "errored")

    def close(self, status: str = "success", detail: str | None = None) -> APIFuture[None]:
        """End the session: stop the worker threads of every loaded model. Clients made by this
        ServiceClient must not be used afterwards (as on the service); saved checkpoints stay."""
        if status not in ("success", "errored", "interrupted"):
            raise ValueError(f"close status {status!r} is invalid; valid: success, errored, interrupted")
        with self._lock:
            handles, self._engines = list(self._engines.values()), {}
        for handle in handles:
            handle.stop()
        return APIFuture.completed(None)

    def get_server_capabilities(self) -> GetServerCapabilitiesResponse:
        """The models this process can train: the tiny test model, the packaged SmolLM2, those
        already loaded; any local model directory or reachable hub id works as well."""
        names = ["tiny", "smollm2", *(m for m in self._engines if m not in ("tiny", "smollm2"))]
        return GetServerCapabilitiesResponse(supported_models=[
            SupportedModel(model_name=name, trainable=True, sampleable=True) for name in names])

    def get_telemetry(self) -> None:
        """No telemetry is collected locally (the SDK returns None too when it has none)."""
        return None

    def create_rest_client(self) -> RestClient:
        """Checkpoint and run management over this client's checkpoint store."""
        return RestClient(store=self.store, capabilities=self.get_server_capabilities)

    # ------------------------------------------------------------------ training clients

    def create_lora_training_client(self, base_model: str, rank: int = 16, seed: int | None = None,
                                    train_mlp: bool = True, train_attn: bool = True, train_unembed: bool = True,
                                    user_metadata: dict[str, str] | None = None, optimizer: Any = None,
                                    *, training_run_id: str | None = None, **_sdk_kwargs: Any) -> TrainingClient:
        """A new LoRA training run. ``training_run_id`` (grpo's own, optional) names it; grpo.serve
        passes the model id the SDK derives from its session, so that the id a client holds is the
        one in its checkpoints' tinker:// paths. By default a fresh ``run-...`` id."""
        _check_optimizer(optimizer)
        spec = LoraSpec(rank=rank, train_attn=train_attn, train_mlp=train_mlp, train_unembed=train_unembed)
        handle = self._engine(base_model)
        run = self.store.create_run(base_model, lora_rank=rank, train_mlp=train_mlp, train_attn=train_attn,
                                    train_unembed=train_unembed, user_metadata=user_metadata,
                                    run_id=training_run_id)
        name = f"lora{next(self._ids)}"
        handle.call(handle.engine.add_adapter, name, spec, seed=seed)
        return TrainingClient(self, handle, name, spec, run.training_run_id)

    def create_training_client_from_state(self, path: str, base_model: str | None = None,
                                          user_metadata: dict[str, str] | None = None,
                                          weights_access_token: str | None = None, optimizer: Any = None,
                                          *, training_run_id: str | None = None) -> TrainingClient:
        """A new training client with the weights saved at ``path`` and a fresh optimizer."""
        return self._from_state(path, base_model, user_metadata, optimizer, False, training_run_id)

    def create_training_client_from_state_with_optimizer(self, path: str, base_model: str | None = None,
                                                         user_metadata: dict[str, str] | None = None,
                                                         weights_access_token: str | None = None,
                                                         *, training_run_id: str | None = None) -> TrainingClient:
        """Resume: a new training client with the weights and the optimizer state saved at ``path``."""
        return self._from_state(path, base_model, user_metadata, None, True, training_run_id)

    def _from_state(self, path: str, base_model: str | None, user_metadata: dict[str, str] | None,
                    optimizer: Any, with_optimizer: bool, training_run_id: str | None) -> TrainingClient:
        state = _read_state(self.store.resolve(path), path)
        if base_model is not None and base_model != state["base_model"]:
            raise ValueError(f"{path} was trained from base model {state['base_model']!r}, not {base_model!r}")
        client = self.create_lora_training_client(state["base_model"], **state["lora"],
                                                  user_metadata=user_metadata, optimizer=optimizer,
                                                  training_run_id=training_run_id)
        client._submit(lambda: client._load(path, with_optimizer=with_optimizer)).result()
        return client

    # ------------------------------------------------------------------ sampling clients

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None,
                               retry_config: Any = None, record_stability_info: bool = False,
                               **_sdk_kwargs: Any) -> SamplingClient:
        if model_path is None and base_model is None:
            raise ValueError("create_sampling_client needs model_path (saved weights) or base_model")
        if model_path is None:
            return SamplingClient(self._engine(base_model), adapter=None)
        path = self.store.resolve(model_path)
        if not (path / "adapter_config.json").exists():
            raise FileNotFoundError(f"model_path {model_path} holds no adapter_config.json; pass a path returned "
                                    "by save_weights_for_sampler or save_state")
        base = base_model or json.loads((path / "adapter_config.json").read_text())["base_model_name_or_path"]
        handle = self._engine(base)
        name = f"sampler{next(self._ids)}"
        handle.engine.load_adapter_dir(name, path)
        client = SamplingClient(handle, adapter=name)
        client.owns_adapter = True
        return client

    def unload(self, client: TrainingClient | SamplingClient) -> None:
        """grpo's own: unload what ``client`` holds in memory, once the work already queued on
        its model is done -- a training client's adapter and optimizer, a sampling client's
        adapter loaded from saved weights (one sampling from a training client's weights or
        a base model holds none of its own). Saved checkpoints stay. The client must not be
        used afterwards. grpo.serve calls it for the clients of a finished session."""
        if isinstance(client, TrainingClient):
            client.optimizer = None
        elif not client.owns_adapter:
            return
        handle = client.handle
        if not handle.closed:
            handle.call(_remove_adapter, handle, client.adapter)

    # ------------------------------------------------------------------ weights

    def copy_weights(self, path: str, *, ttl_seconds: int | None = None,
                     weights_access_token: str | None = None) -> APIFuture[str]:
        """A copy of a checkpoint in a new training run (as the service's, which cannot be trained
        on); the future's value is the copy's tinker:// path."""
        return self.create_rest_client().copy_weights(path, ttl_seconds=ttl_seconds)

    get_server_capabilities_async = async_twin("get_server_capabilities")
    copy_weights_async = async_twin("copy_weights", awaited=True)
    create_training_client_from_state_async = async_twin("create_training_client_from_state")
    create_training_client_from_state_with_optimizer_async = async_twin(
        "create_training_client_from_state_with_optimizer")
    create_lora_training_client_async = async_twin("create_lora_training_client")
    create_sampling_client_async = async_twin("create_sampling_client")
    unload_async = async_twin("unload")


def _own_computing_thread() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpo-train")


def _call_on(own: concurrent.futures.ThreadPoolExecutor | None, fn: Callable[..., Any], *args: Any, **kwargs: Any
             ) -> Any:
    """``fn(*args, **kwargs)`` on an engine's own computing thread, or (None) the process's, waited for."""
    if own is None:
        return local_computing.run(fn, *args, **kwargs)
    return own.submit(fn, *args, **kwargs).result()


def _remove_adapter(handle: _EngineHandle, name: str) -> None:
    with handle.engine.lock:  # no generation reads the prefix cache meanwhile
        handle.batcher.release_prefix_cache(name)
        handle.engine.remove_adapter(name)


class _EngineHandle:
    """An engine plus its two workers: the thread that computes with the model (loading it,
    training calls, and the generations the sampling batcher forms), and the sampling batcher.

    One thread computes, whatever the call: on a CPU the process's computing thread
    (computing.py says why: PyTorch's OpenMP teams of several threads leave the cores idle), on a
    GPU one thread per engine, whose kernels queue on the device without that cost."""

    def __init__(self, engine: Engine, budget: memory.Budget, prefix_cache_bytes: int = 0,
                 own: concurrent.futures.ThreadPoolExecutor | None = None):
        """``own``: the engine's own computing thread (a GPU's); None: the process's (a CPU's)."""
        self.engine = engine
        self.budget = budget
        self.own = own
        self.closed = False
        # freed memory malloc may keep for the next call (heap.py): two working sets' worth, a
        # training call's and a sampling call's, which lie in different places of the heap
        self.keep_free = 2 * (budget.bytes or memory.default_budget(engine.device))
        heap.keep_for_reuse(engine.device)
        self.batcher = _SampleBatcher(engine, budget, prefix_cache_bytes, compute=self)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        """``fn(*args, **kwargs)`` queued on the computing thread; refused once the ServiceClient
        that loaded this engine is closed (as the SDK rejects a closed session)."""
        self._refuse_if_closed()
        return (self.own or local_computing.executor()).submit(fn, *args, **kwargs)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on the computing thread, waited for."""
        self._refuse_if_closed()
        return _call_on(self.own, fn, *args, **kwargs)

    def _refuse_if_closed(self) -> None:
        if self.closed:
            raise RuntimeError("this ServiceClient is closed: its training and sampling clients cannot be used")

    def stop(self) -> None:
        """Wait for this engine's queued work, refuse any more, and end its computing thread if
        it is its own (the process's computing thread serves every engine and stays)."""
        self.closed = True
        if self.own is not None:
            self.own.shutdown(wait=True)
        else:
            local_computing.run(lambda: None)


class TrainingClient(_ClientFuture):
    def __init__(self, service: ServiceClient, handle: _EngineHandle, adapter: str, spec: LoraSpec,
                 training_run_id: str):
        self.service = service
        self.handle = handle
        self.engine = handle.engine
        self.adapter = adapter
        self.spec = spec
        self.training_run_id = training_run_id
        self.model_id = training_run_id  # the SDK's name: one id per run, the one in its tinker:// paths
        self.optimizer: torch.optim.Optimizer | None = None
        self._sampler_ids = itertools.count()

    # ------------------------------------------------------------------ plumbing

    def _submit(self, fn, *args: Any) -> APIFuture:
        return APIFuture(self.handle.submit(fn, *args))

    def _run_in_engine(self, fn):
        try:
            with self.engine.use(self.adapter) as _:
                return fn(self.engine.causal_lm())
        finally:
            # what the call freed is kept for the next one, up to the handle's cap (heap.py)
            heap.release_free_memory(self.engine.device, self.handle.keep_free)

    # ------------------------------------------------------------------ forward / backward

    def forward(self, data: Sequence[Datum], loss_fn: str,
                loss_fn_config: dict[str, float] | None = None) -> APIFuture[ForwardBackwardOutput]:
        return self._loss_call(data, loss_fn, loss_fn_config, backward=False)

    def forward_backward(self, data: Sequence[Datum], loss_fn: str,
                         loss_fn_config: dict[str, float] | None = None) -> APIFuture[ForwardBackwardOutput]:
        return self._loss_call(data, loss_fn, loss_fn_config, backward=True)

    def forward_backward_custom(self, data: Sequence[Datum], loss_fn: custom_loss.CustomLossFn, *,
                                loss_type_input: str | None = None) -> APIFuture[ForwardBackwardOutput]:
        """Backpropagate any differentiable function of the target logprobs, as the SDK does:
        ``loss_fn(data, logprobs) -> (loss, metrics)`` with one logprob tensor per datum; the
        parameter gradient is autograd of that loss through the model (grpo/backends/local/
        custom_loss.py says how). ``metrics`` hold ``loss:sum`` (the custom loss), the function's
        own metrics and ``surrogate_loss:sum``; ``loss_fn_outputs`` hold the logprobs."""
        if loss_type_input not in (None, "logprobs"):
            raise ValueError(f"loss_type_input={loss_type_input!r} is invalid; the loss always receives logprobs")
        if not callable(loss_fn):
            raise TypeError(f"forward_backward_custom takes a function (data, logprobs) -> (loss, metrics), "
                            f"got {type(loss_fn).__name__}")
        data = list(data)
        forward_data = custom_loss.forward_data(data)
        prepared = trainer.prepare(forward_data, "cross_entropy", self.engine.vocab_size, self.engine.check_tokens)

        def run(datums: list, loss: str, config: dict | None, backward: bool) -> ForwardBackwardOutput:
            return self._run_in_engine(lambda model: trainer.run(
                model, datums, loss, config, self.engine.device, self._micro_batch_tokens(), backward))

        def work() -> ForwardBackwardOutput:
            forward = run(prepared, "cross_entropy", None, False)
            loss, metrics, coeffs = custom_loss.loss_gradient(data, loss_fn, forward)
            linear = custom_loss.linear_surrogate(forward_data, forward, coeffs)
            surrogate, surrogate_config = custom_loss.surrogate_loss()
            backward = run(trainer.prepare(linear, surrogate, self.engine.vocab_size, self.engine.check_tokens),
                           surrogate, surrogate_config, True)
            out_metrics = {**metrics, "loss:sum": loss, "surrogate_loss:sum": backward.metrics["loss:sum"]}
            return ForwardBackwardOutput(loss_fn_output_type=forward.loss_fn_output_type,
                                         loss_fn_outputs=forward.loss_fn_outputs, metrics=out_metrics)

        return self._submit(work)

    def _loss_call(self, data, loss_fn, loss_fn_config, backward: bool) -> APIFuture[ForwardBackwardOutput]:
        # Validate now, in the caller's thread, so a bad datum raises where it was built.
        prepared = trainer.prepare(list(data), loss_fn, self.engine.vocab_size, self.engine.check_tokens)
        trainer.losses.resolve_config(loss_fn, loss_fn_config)

        def run(model) -> ForwardBackwardOutput:
            # This call's gradients are made apart from those accumulated before it and added to
            # them only when finite: a non-finite loss fails this call alone and leaves the model
            # trainable (a NaN gradient would make every later step write NaN weights).
            if backward:
                self.handle.batcher.release_prefix_cache(self.adapter)
            params = list(self.engine.adapter_parameters(self.adapter).values()) if backward else []
            kept = [p.grad for p in params]
            for p in params:
                p.grad = None
            try:
                out = trainer.run(model, prepared, loss_fn, loss_fn_config, self.engine.device,
                                  self._micro_batch_tokens(), backward)
                problem = _not_finite(out.metrics, params)
                if problem:
                    raise ValueError(f"{'forward_backward' if backward else 'forward'} with loss_fn={loss_fn!r}: "
                                     f"{problem}; a loss input is beyond what the loss can take (logprobs "
                                     "far from the model's make exp(logprobs - sampler logprobs) overflow)"
                                     + ("; this call's gradients were dropped, earlier ones are kept" if backward else ""))
            except BaseException:
                for p, grad in zip(params, kept, strict=True):
                    p.grad = grad
                raise
            for p, grad in zip(params, kept, strict=True):
                if grad is not None:
                    p.grad = grad if p.grad is None else p.grad.add_(grad)
            return out

        return self._submit(lambda: self._run_in_engine(run))

    def _micro_batch_tokens(self) -> int:
        """Tokens per training micro-batch: the explicit setting, else what the memory budget allows."""
        return self.service.micro_batch_tokens or self.handle.budget.train_tokens()

    # ------------------------------------------------------------------ optimizer

    def optim_step(self, optim_params: AdamParams | None = None, *,
                   adam_params: AdamParams | None = None) -> APIFuture[OptimStepResponse]:
        """One Adam step with the gradients accumulated since the last step (then cleared).
        ``optim_step(AdamParams(...))`` and ``optim_step(adam_params=...)`` are the same call."""
        if (optim_params is None) == (adam_params is None):
            raise TypeError("optim_step takes one AdamParams: optim_step(params) or optim_step(adam_params=params)")
        params = optim_params if optim_params is not None else adam_params
        if not isinstance(params, AdamParams):
            raise TypeError(f"optim_step takes grpo.types.AdamParams (only Adam is implemented locally), "
                            f"got {type(params).__name__}")
        return self._submit(lambda: self._run_in_engine(lambda _: self._optim_step(params)))

    def _optim_step(self, adam: AdamParams) -> OptimStepResponse:
        params = list(self.engine.adapter_parameters(self.adapter).values())
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(params, lr=adam.learning_rate)
        for group in self.optimizer.param_groups:
            group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                         weight_decay=adam.weight_decay)
        grads = [p.grad for p in params if p.grad is not None]
        # One norm over all gradients (foreach kernels), computed once and reused by the clip: a
        # norm per tensor was two launches per LoRA matrix (840 on SmolLM2), and the clip then
        # computed the same norm again.
        total_norm = torch.nn.utils.get_total_norm(grads) if grads else None
        grad_norm = float(total_norm) if total_norm is not None else 0.0
        if not math.isfinite(grad_norm):  # the step would write non-finite weights: none is taken
            self.optimizer.zero_grad(set_to_none=True)
            raise ValueError(f"optim_step: the accumulated gradients are not finite (norm {grad_norm}); the step "
                             "was not taken and the gradients were dropped, the weights are unchanged")
        if adam.grad_clip_norm > 0 and grads:
            torch.nn.utils.clip_grads_with_norm_(params, adam.grad_clip_norm, total_norm)
        with section("grpo.train.optimizer"):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.engine.versions[self.adapter] += 1
        return OptimStepResponse(metrics={"grad_norm": grad_norm, "learning_rate": adam.learning_rate})

    # ------------------------------------------------------------------ state

    def _save(self, name: str, kind: str, with_optimizer: bool, ttl_seconds: int | None = None,
              user_metadata: dict[str, str] | None = None, overwrite: bool = True,
              encrypt_to: list[str] | None = None) -> APIFuture[str]:
        """Write the adapter (and optimizer) as checkpoint ``name`` of this run; the future's value
        is its tinker:// path. A name holding a path separator is a plain directory instead
        (written there and returned as given; not in the store, so no TTL, metadata or listing,
        and an existing directory is replaced)."""
        # In-process the caller owns this machine, so a directory path is theirs to choose; a
        # server's ServiceClient has directory_saves off, and a name is then all it admits.
        target = names.save_target(name, "name", directories=self.service.directory_saves)
        if isinstance(target, Path):
            def to_dir() -> str:
                with self.engine.use(self.adapter):
                    tmp = staging_path(target)  # <name>.<pid>.tmp, as the store stages (grpo.files)
                    shutil.rmtree(tmp, ignore_errors=True)
                    self._write_adapter(tmp, with_optimizer)
                    replace_dir(tmp, target)
                return name
            return self._submit(to_dir)

        def to_store() -> str:
            def write(staging: Path) -> None:
                with self.engine.use(self.adapter):
                    self._write_adapter(staging, with_optimizer)
                if encrypt_to:
                    age_export.encrypt_dir(staging, encrypt_to)
            return self.service.store.save(self.training_run_id, kind, name, write, ttl_seconds=ttl_seconds,
                                           user_metadata=user_metadata, overwrite=overwrite).tinker_path
        return self._submit(to_store)

    def _write_adapter(self, tmp: Path, with_optimizer: bool) -> None:
        from peft.utils import get_peft_model_state_dict
        from safetensors.torch import save_file

        tmp.mkdir(parents=True, exist_ok=True)
        peft_model = self.engine.peft_model
        # What other tools need to load it: a base id they resolve, and the task type that
        # AutoPeftModelForCausalLM picks its class by (a copy: the live adapter stays as it is).
        config = copy.copy(peft_model.peft_config[self.adapter])
        config.base_model_name_or_path = models.public_id(self.engine.base_model)
        config.task_type = config.task_type or "CAUSAL_LM"
        config.save_pretrained(str(tmp))
        # The base weights never change (tied lm_head included), so only LoRA tensors are saved.
        state = get_peft_model_state_dict(peft_model, adapter_name=self.adapter, save_embedding_layers=False)
        save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(tmp / "adapter_model.safetensors"))
        # "optimizer": "fresh" marks a state saved before the first optim_step, which resumes
        # with a new optimizer rather than failing for want of a file.
        meta = {"base_model": self.engine.base_model, "version": self.engine.versions[self.adapter],
                "optimizer": ("saved" if self.optimizer is not None else "fresh") if with_optimizer else "none",
                "lora": {"rank": self.spec.rank, "train_attn": self.spec.train_attn,
                         "train_mlp": self.spec.train_mlp, "train_unembed": self.spec.train_unembed}}
        (tmp / STATE_FILE).write_text(json.dumps(meta, indent=1))
        if with_optimizer and self.optimizer is not None:
            torch.save(self.optimizer.state_dict(), tmp / OPTIMIZER_FILE)

    def save_state(self, name: str, ttl_seconds: int | None = None, overwrite: bool = False,
                   user_metadata: dict[str, str] | None = None) -> APIFuture[SaveWeightsResponse]:
        """Adapter weights and optimizer state, for resuming training: ``tinker://<run>/weights/<name>``.
        Saving an existing name again needs ``overwrite=True`` (as on the service)."""
        fut = self._save(name, "training", True, ttl_seconds, user_metadata, overwrite)
        return _then(fut, lambda path: SaveWeightsResponse(path=path))

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None,
                                 user_metadata: dict[str, str] | None = None
                                 ) -> APIFuture[SaveWeightsForSamplerResponse]:
        """A PEFT adapter directory (``PeftModel.from_pretrained`` loads it):
        ``tinker://<run>/sampler_weights/<name>``."""
        fut = self._save(name, "sampler", False, ttl_seconds, user_metadata)
        return _then(fut, lambda path: SaveWeightsForSamplerResponse(path=path))

    def save_weights_external(self, name: str, ttl_seconds: int | None = None,
                              age_encryption_recipients: list[str] | None = None
                              ) -> APIFuture[SaveWeightsExternalResponse]:
        """The PEFT adapter as an ``external_weights`` checkpoint, for download through the
        RestClient's get_external_weights_urls. With ``age_encryption_recipients`` each file is
        ``<name>.age``, encrypted to those age keys (needs the pyrage package; see age_export.py)."""
        if age_encryption_recipients is not None and (isinstance(age_encryption_recipients, str)
                                                      or not all(age_encryption_recipients)):
            raise ValueError(f"age_encryption_recipients must be a list of age public keys, got "
                             f"{age_encryption_recipients!r}")
        fut = self._save(name, "external", False, ttl_seconds, encrypt_to=age_encryption_recipients or None)
        return _then(fut, lambda path: SaveWeightsExternalResponse(path=path))

    def load_state(self, path: str, weights_access_token: str | None = None) -> APIFuture[LoadWeightsResponse]:
        """Load the weights saved at ``path`` (tinker:// or a directory); the optimizer starts fresh."""
        return self._submit(lambda: self._load(path, with_optimizer=False))

    def load_state_with_optimizer(self, path: str, weights_access_token: str | None = None
                                  ) -> APIFuture[LoadWeightsResponse]:
        """Load the weights and the optimizer state saved at ``path`` by save_state."""
        return self._submit(lambda: self._load(path, with_optimizer=True))

    def _load(self, path: str, with_optimizer: bool) -> LoadWeightsResponse:
        from safetensors.torch import load_file

        folder = self.service.store.resolve(path)
        state = _read_state(folder, path)
        if state["lora"]["rank"] != self.spec.rank:
            raise ValueError(f"state at {path} has LoRA rank {state['lora']['rank']}, this client has rank {self.spec.rank}")
        weights = load_file(str(folder / "adapter_model.safetensors"))
        with self.engine.use(self.adapter):
            from peft.utils import set_peft_model_state_dict

            result = set_peft_model_state_dict(self.engine.peft_model, weights, adapter_name=self.adapter)
            unexpected = getattr(result, "unexpected_keys", [])
            if unexpected:
                raise ValueError(f"state at {path} does not fit this model: unexpected keys {unexpected[:3]}")
            self.engine.versions[self.adapter] += 1
            self.optimizer = None
            if with_optimizer:
                opt_file = folder / OPTIMIZER_FILE
                if state.get("optimizer") == "fresh":
                    return LoadWeightsResponse(path=str(path))
                if not opt_file.exists():
                    raise FileNotFoundError(f"{path} holds no optimizer state (saved with save_weights_for_sampler?)")
                params = list(self.engine.adapter_parameters(self.adapter).values())
                self.optimizer = torch.optim.AdamW(params)
                try:
                    saved = torch.load(opt_file, map_location=self.engine.device, weights_only=True)
                    self.optimizer.load_state_dict(saved)
                except (pickle.UnpicklingError, EOFError, RuntimeError, ValueError, KeyError, TypeError) as err:
                    self.optimizer = None  # a file torch cannot read (weights_only: it never runs code)
                    raise ValueError(f"{path}: {OPTIMIZER_FILE} is not an optimizer state this client can load "
                                     f"({type(err).__name__}: {' '.join(str(err).split())[:300]})") from err
        return LoadWeightsResponse(path=str(path))

    # ------------------------------------------------------------------ sampling

    def save_weights_and_get_sampling_client(self, name: str | None = None, retry_config: Any = None,
                                             record_stability_info: bool = False, kind: str = "snapshot"
                                             ) -> SamplingClient:
        """A sampler of the current weights. Nothing is written to disk (``name`` has no effect, as
        in SDK 0.38): the client keeps an in-memory snapshot, swapped in only if this adapter
        trains on before it samples."""
        if kind not in (None, "snapshot"):
            raise ValueError(f"kind={kind!r} is not supported by the local backend; valid: 'snapshot'")
        fut = self._submit(lambda: self._run_in_engine(
            lambda _: (self.engine.versions[self.adapter], self.engine.adapter_state(self.adapter))))
        return SamplingClient(self.handle, adapter=self.adapter, snapshot=fut.result())

    def create_sampling_client(self, model_path: str, retry_config: Any = None,
                               record_stability_info: bool = False) -> SamplingClient:
        return self.service.create_sampling_client(model_path=model_path)

    # ------------------------------------------------------------------ info

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_telemetry(self) -> None:
        return None

    def get_info(self) -> GetInfoResponse:
        return GetInfoResponse(
            model_id=self.training_run_id,
            model_data=ModelData(arch=type(self.engine.model).__name__, model_name=self.engine.base_model,
                                 tokenizer_id=self.engine.base_model),
            is_lora=True, lora_rank=self.spec.rank, model_name=self.engine.base_model)

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.engine.adapter_parameters(self.adapter).values())

    # ------------------------------------------------------------------ async twins

    forward_async = async_twin("forward")
    forward_backward_async = async_twin("forward_backward")
    forward_backward_custom_async = async_twin("forward_backward_custom")
    optim_step_async = async_twin("optim_step")
    save_state_async = async_twin("save_state")
    load_state_async = async_twin("load_state")
    load_state_with_optimizer_async = async_twin("load_state_with_optimizer")
    save_weights_for_sampler_async = async_twin("save_weights_for_sampler")
    save_weights_external_async = async_twin("save_weights_external")
    save_weights_and_get_sampling_client_async = async_twin("save_weights_and_get_sampling_client")
    create_sampling_client_async = async_twin("create_sampling_client")
    get_info_async = async_twin("get_info")
    num_trainable_parameters_async = async_twin("num_trainable_parameters")


class SamplingClient(_ClientFuture):
    def __init__(self, handle: _EngineHandle, adapter: str | None,
                 snapshot: tuple[int, dict[str, torch.Tensor]] | None = None):
        self.handle = handle
        self.engine = handle.engine
        self.adapter = adapter
        self.snapshot = snapshot
        self.owns_adapter = False  # loaded from saved weights for this client alone (ServiceClient.unload)

    def sample(self, prompt: ModelInput, num_samples: int = 1, sampling_params: SamplingParams | None = None,
               include_prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0,
               topk_sample_logprobs: int = 0, target_prompt_logprobs: Any = None, prompt_alt_tokens_k: int = 0,
               prompt_logprobs_last_n: int | None = None) -> APIFuture[SampleResponse]:
        """``num_samples`` completions of ``prompt``. The top-k and alternative-token options of the
        SDK are not implemented locally: leave them at their defaults (grpo/api/sdk_parity.py)."""
        for key, value in (("topk_prompt_logprobs", topk_prompt_logprobs), ("topk_sample_logprobs", topk_sample_logprobs),
                           ("target_prompt_logprobs", target_prompt_logprobs), ("prompt_alt_tokens_k", prompt_alt_tokens_k)):
            if value:
                raise ValueError(f"sample({key}=...) is not supported by the local backend; leave it at its default")
        tokens = _prompt_tokens(prompt, self.engine)
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be a positive integer, got {num_samples!r}")
        params = sampling_params if sampling_params is not None else SamplingParams()
        if params.max_tokens is None:
            params = SamplingParams(**{**params.__dict__, "max_tokens": DEFAULT_MAX_TOKENS})
        _, stop_ids = params.stop_strings_and_ids()
        self.engine.check_tokens(stop_ids, "SamplingParams.stop token ids")
        last_n = _check_last_n(prompt_logprobs_last_n, len(tokens))
        request = sampler.GenerationRequest(tokens, num_samples, params, include_prompt_logprobs or last_n is not None,
                                            last_n)
        return APIFuture(self.handle.batcher.submit(request, self.adapter, self.snapshot))

    sample_async = async_twin("sample", awaited=True)

    def compute_logprobs(self, prompt: ModelInput, prompt_logprobs_last_n: int | None = None
                         ) -> APIFuture[list[float | None]]:
        """The logprob of each prompt token given those before it (None for the first); with
        ``prompt_logprobs_last_n=N`` only the last N are given, earlier entries are None."""
        tokens = _prompt_tokens(prompt, self.engine)
        last_n = _check_last_n(prompt_logprobs_last_n, len(tokens))
        # through the sampler's batcher: calls made together share decoder calls (prompt_logprobs.py)
        request = sampler.GenerationRequest(tokens, 0, SamplingParams(), True, last_n)
        return APIFuture(self.handle.batcher.submit(request, self.adapter, self.snapshot,
                                                    answer=lambda response: response.prompt_logprobs))

    compute_logprobs_async = async_twin("compute_logprobs", awaited=True)

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_base_model(self) -> str:
        return self.engine.base_model

    get_base_model_async = async_twin("get_base_model")

    def get_telemetry(self) -> None:
        return None

    def sampler_stats(self) -> dict[str, float]:
        """grpo's own (not in the SDK): what the sampler of this client's base model has done since
        it was loaded, summed over every generation -- prompt tokens, tokens prefilled, prefix-cache
        hits, the tokens they covered, evictions -- and what the prefix cache holds now. Counters
        only grow: take the difference of two calls for a window (grpo.rl.loop does, per step)."""
        return self.handle.batcher.stats()

    sampler_stats_async = async_twin("sampler_stats")


def _prompt_tokens(prompt: ModelInput, engine: Engine) -> list[int]:
    if not isinstance(prompt, ModelInput):
        raise TypeError(f"prompt must be a grpo.types.ModelInput, got {type(prompt).__name__}")
    tokens = text_tokens(prompt, "prompt")
    if not tokens:
        raise ValueError("prompt is empty: sampling needs at least one prompt token")
    engine.check_tokens(tokens, "prompt")
    return tokens


class _SampleFuture(concurrent.futures.Future):
    """A sample call's future. Waiting on it closes the batch it belongs to (see _SampleBatcher)."""

    def __init__(self, batcher: _SampleBatcher, answer: Callable[[SampleResponse], Any] | None = None):
        super().__init__()
        self._batcher = batcher
        self._answer = answer  # what the caller gets of the response (compute_logprobs: its prompt logprobs)

    def set_answer(self, response: SampleResponse) -> None:
        self.set_result(response if self._answer is None else self._answer(response))

    def result(self, timeout: float | None = None):
        self._batcher.close_batch()
        return super().result(timeout)

    def exception(self, timeout: float | None = None):
        self._batcher.close_batch()
        return super().exception(timeout)

    def done(self) -> bool:
        self._batcher.close_batch()  # a caller polling for completion is waiting too
        return super().done()

    def add_done_callback(self, fn) -> None:
        # ``await`` (asyncio.wrap_future) lands here. Closing at once would cut an
        # asyncio.gather of sample calls after its first request; closing on the event loop's
        # next turn lets every task already scheduled submit its request first.
        try:
            asyncio.get_running_loop().call_soon(self._batcher.close_batch)
        except RuntimeError:  # not inside an event loop
            self._batcher.close_batch()
        super().add_done_callback(fn)


class _SampleBatcher:
    """Runs sample requests in batches whose make-up depends on the calls, never on timing.

    A batch is every request submitted since the previous batch closed; it closes when a caller
    waits on one of its futures (``result()``, ``await``, ``done()``). A caller that issues its
    requests and then waits -- the GRPO loop, ``asyncio.gather`` of ``sample_async`` -- gets all
    of them in one generation, and the same generation on every run: batch make-up changes float
    results (padding, matmul shapes), so a batch that closed whenever a timer said would make a
    seeded run depend on how busy the machine was. Requests nobody waits on still run, once
    ``IDLE_CLOSE_S`` has passed with no new request. Batches closed while the worker was busy run
    together (several threads sampling at once get batched; their make-up depends on their
    timing, as theirs always does).
    """

    IDLE_CLOSE_S = 0.5

    def __init__(self, engine: Engine, budget: memory.Budget, prefix_cache_bytes: int, compute: _EngineHandle):
        """``compute``: where the generations run (the engine's computing thread); the batcher's
        own thread only forms the batches."""
        self.engine = engine
        self.budget = budget
        self.compute = compute
        # One prefix cache per engine: every sampling client (and every session of grpo.serve)
        # of this base model reads from it, each generation bound to its own weights.
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self.totals = sampler.GenerationStats()
        self._cond = threading.Condition()
        self._open: list = []  # submitted, batch still open
        self._closed: list = []  # waiting for the worker
        self._last_submit = 0.0
        self.thread = threading.Thread(target=self._loop, name="grpo-sampler", daemon=True)
        self.thread.start()

    def submit(self, request: sampler.GenerationRequest, adapter: str | None, snapshot,
               answer: Callable[[SampleResponse], Any] | None = None) -> concurrent.futures.Future:
        """A future of the request's SampleResponse, or of ``answer(response)``."""
        future = _SampleFuture(self, answer)
        with self._cond:
            self._open.append((request, adapter, snapshot, future))
            self._last_submit = time.monotonic()
            self._cond.notify_all()
        return future

    def close_batch(self) -> None:
        with self._cond:
            if self._open:
                self._closed.extend(self._open)
                self._open = []
                self._cond.notify_all()

    def _next_batch(self) -> list:
        with self._cond:
            while not self._closed:
                if self._open:
                    idle = time.monotonic() - self._last_submit
                    if idle >= self.IDLE_CLOSE_S:
                        self._closed, self._open = self._open, []
                        break
                    self._cond.wait(self.IDLE_CLOSE_S - idle)
                else:
                    self._cond.wait()
            batch, self._closed = self._closed, []
            return batch

    def _loop(self) -> None:
        while True:
            pending = self._next_batch()
            # Requests for different weights cannot share a forward pass.
            by_weights: dict[tuple, list] = {}
            for item in pending:
                by_weights.setdefault((item[1], id(item[2])), []).append(item)
            for items in by_weights.values():
                try:
                    self.compute.submit(self._run, items).result()
                except Exception as err:  # never let the thread die: later sample() calls would hang
                    for *_, future in items:
                        if not future.done():
                            future.set_exception(err)

    def _run(self, items: list) -> None:
        live = [it for it in items if it[3].set_running_or_notify_cancel()]
        if not live:
            return
        _, adapter, snapshot, _ = live[0]
        requests = [it[0] for it in live]
        try:
            with self.engine.sampling_model(adapter, snapshot) as model:
                self._bind_prefix_cache(adapter, snapshot)
                # As many rows at once as the memory budget holds; the next requests take the
                # places of rows that finish (continuous batching).
                with section("grpo.sample.generate"):
                    stats = sampler.generate(model, requests, self.engine.tokenizer, self.engine.device,
                                             row_bytes=self.budget.row_bytes, budget=self.budget.bytes,
                                             prefix_cache=self.prefix_cache)
            self._count(stats)
        except Exception as err:  # delivered to every caller of this batch
            for it in live:
                it[3].set_exception(err)
            return
        finally:
            heap.release_free_memory(self.engine.device, self.compute.keep_free)  # before the callers train
        for request, _, _, future in live:
            future.set_answer(SampleResponse(sequences=request.sequences, prompt_logprobs=request.prompt_logprobs))

    def _bind_prefix_cache(self, adapter: str | None, snapshot) -> None:
        """Name the weights this generation samples with (the engine's key for them; the snapshot
        is held while bound); the cache drops what other weights computed. The sampler's precision
        is fixed per engine."""
        if self.prefix_cache is not None:
            self.prefix_cache.bind(self.engine.sampling_weights_key(adapter, snapshot), keepalive=snapshot)

    def release_prefix_cache(self, adapter: str) -> None:
        """Empty the prefix cache if it holds ``adapter``'s keys and values: its training step is
        about to need the memory, and the optimizer step that follows makes them stale. Called
        with the engine's lock held, so no generation is reading the cache."""
        cache = self.prefix_cache
        if cache is not None and len(cache) and isinstance(cache.identity, tuple) and cache.identity[0] == adapter:
            cache.stats.invalidations += 1
            cache.clear()

    def _count(self, stats: sampler.GenerationStats) -> None:
        with self._cond:
            for key, value in stats.__dict__.items():
                setattr(self.totals, key, max(self.totals.peak_rows, value) if key == "peak_rows"
                        else getattr(self.totals, key) + value)

    def stats(self) -> dict[str, float]:
        with self._cond:
            out = {key: float(value) for key, value in self.totals.__dict__.items()}
        cache = self.prefix_cache
        out["prefix_cache_bytes"] = float(cache.bytes if cache is not None else 0)
        out["prefix_cache_entries"] = float(len(cache) if cache is not None else 0)
        return out


def _read_state(folder: Path, path: str | None = None) -> dict:
    state_file = Path(folder) / STATE_FILE
    if not state_file.exists():
        raise FileNotFoundError(f"{path or folder} is not a grpo training state (no {STATE_FILE}); "
                                "pass a path from save_state")
    return json.loads(state_file.read_text())


def _check_last_n(last_n: int | None, n_tokens: int) -> int | None:
    if last_n is None:
        return None
    if isinstance(last_n, bool) or not isinstance(last_n, int) or not 1 <= last_n <= n_tokens - 1:
        raise ValueError(f"prompt_logprobs_last_n must be between 1 and len(prompt) - 1 = {n_tokens - 1}, got {last_n!r}")
    return last_n


def _check_optimizer(optimizer: Any) -> None:
    # The SDK can pick an optimizer per run; locally it is always Adam(W).
    kind = getattr(optimizer, "type", None) if not isinstance(optimizer, dict) else optimizer.get("type")
    if optimizer is not None and kind not in (None, "adam", "adamw"):
        raise ValueError(f"optimizer={optimizer!r} is not supported by the local backend: only Adam is; leave it None")


def _then(fut: APIFuture, fn: Callable[[Any], Any]) -> APIFuture:
    """A future of ``fn(fut's value)``, done when ``fut`` is."""
    out: concurrent.futures.Future = concurrent.futures.Future()

    def done(f: concurrent.futures.Future) -> None:
        try:
            out.set_result(fn(f.result()))
        except BaseException as err:
            out.set_exception(err)

    fut._future.add_done_callback(done)
    return APIFuture(out)


def _not_finite(metrics: dict[str, float], params: list) -> str | None:
    """What is not finite in a loss call's result: the loss, or its parameter gradients (other
    metrics, a ratio's maximum say, may overflow while the clipped loss and its gradients do not)."""
    for key, value in metrics.items():
        if key.startswith("loss") and not math.isfinite(float(value)):
            return f"the loss is not finite ({key}={value})"
    grads = [p.grad for p in params if p.grad is not None]
    if grads and not bool(torch.isfinite(torch.stack([torch.linalg.vector_norm(g) for g in grads])).all()):
        return "the loss's gradients are not finite"
    return None
