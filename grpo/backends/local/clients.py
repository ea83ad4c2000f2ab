"""ServiceClient, TrainingClient and SamplingClient of the Tinker API, run in this process.

Training calls run in order on one worker thread per base model and return futures at once,
so a caller can submit forward_backward and optim_step back to back as on the service.
Sampling calls go to a batcher that gathers whatever arrives together into one generation.
"""

from __future__ import annotations

import concurrent.futures
import copy
import itertools
import json
import os
import queue
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from grpo import models
from grpo.backends.local import sampler, trainer
from grpo.backends.local.engine import Engine, LoraSpec
from grpo.types import (
    AdamParams,
    APIFuture,
    Datum,
    ForwardBackwardOutput,
    GetInfoResponse,
    ModelData,
    ModelInput,
    OptimStepResponse,
    SampleResponse,
    SamplingParams,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    async_twin,
)

STATE_FILE = "grpo_state.json"
OPTIMIZER_FILE = "optimizer.pt"
DEFAULT_MAX_TOKENS = 256


class ServiceClient:
    """Entry point, as ``tinker.ServiceClient`` / ``mint.ServiceClient``.

    Args beyond the SDK's (all optional): ``checkpoint_dir`` where named states are written
    (default ``$GRPO_CACHE/checkpoints``), ``device`` and ``dtype`` ("auto": CUDA bf16 when
    available, else CPU fp32), ``micro_batch_tokens`` (padded tokens per training micro-batch).
    """

    def __init__(self, checkpoint_dir: str | os.PathLike | None = None, device: str | None = None,
                 dtype: str | None = None, micro_batch_tokens: int = 4096, **_sdk_kwargs: Any):
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else models.cache_dir() / "checkpoints"
        self.device = device
        self.dtype = dtype
        if micro_batch_tokens <= 0:
            raise ValueError(f"micro_batch_tokens must be positive, got {micro_batch_tokens}")
        self.micro_batch_tokens = int(micro_batch_tokens)
        self._engines: dict[str, _EngineHandle] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()

    def _engine(self, base_model: str) -> _EngineHandle:
        # public_id fails fast on a bad name, before any thread starts, and gives one key to the
        # names of one model ("smollm2" and the id an exported adapter_config.json names)
        key = models.public_id(base_model)
        with self._lock:
            if key not in self._engines:
                self._engines[key] = _EngineHandle(Engine(base_model, self.device, self.dtype))
            return self._engines[key]

    def get_server_capabilities(self) -> dict[str, Any]:
        return {"supported_models": ["tiny", "smollm2", "<local dir>", "<hub id>"], "backend": "local"}

    def create_lora_training_client(self, base_model: str, rank: int = 16, seed: int | None = None,
                                    train_mlp: bool = True, train_attn: bool = True,
                                    train_unembed: bool = True, **_sdk_kwargs: Any) -> TrainingClient:
        spec = LoraSpec(rank=rank, train_attn=train_attn, train_mlp=train_mlp, train_unembed=train_unembed)
        handle = self._engine(base_model)
        name = f"lora{next(self._ids)}"
        handle.engine.add_adapter(name, spec, seed=seed)
        return TrainingClient(self, handle, name, spec)

    create_lora_training_client_async = async_twin("create_lora_training_client")

    def create_training_client_from_state(self, path: str, **kwargs: Any) -> TrainingClient:
        state = _read_state(path)
        client = self.create_lora_training_client(state["base_model"], **state["lora"], **kwargs)
        client.load_state_with_optimizer(path).result()
        return client

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None,
                               **_sdk_kwargs: Any) -> SamplingClient:
        if model_path is None and base_model is None:
            raise ValueError("create_sampling_client needs model_path (saved weights) or base_model")
        if model_path is None:
            return SamplingClient(self._engine(base_model), adapter=None)
        path = Path(model_path)
        if not (path / "adapter_config.json").exists():
            raise FileNotFoundError(f"model_path {path} holds no adapter_config.json; pass a path returned by "
                                    "save_weights_for_sampler or save_state")
        base = base_model or json.loads((path / "adapter_config.json").read_text())["base_model_name_or_path"]
        handle = self._engine(base)
        name = f"sampler{next(self._ids)}"
        handle.engine.load_adapter_dir(name, path)
        return SamplingClient(handle, adapter=name)


class _EngineHandle:
    """An engine plus its two workers: an ordered training queue and a sampling batcher."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.train_executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpo-train")
        self.batcher = _SampleBatcher(engine)


class TrainingClient:
    def __init__(self, service: ServiceClient, handle: _EngineHandle, adapter: str, spec: LoraSpec):
        self.service = service
        self.handle = handle
        self.engine = handle.engine
        self.adapter = adapter
        self.spec = spec
        self.optimizer: torch.optim.Optimizer | None = None
        self._sampler_ids = itertools.count()

    # ------------------------------------------------------------------ plumbing

    def _submit(self, fn, *args: Any) -> APIFuture:
        return APIFuture(self.handle.train_executor.submit(fn, *args))

    def _run_in_engine(self, fn):
        with self.engine.use(self.adapter) as _:
            return fn(self.engine.causal_lm())

    # ------------------------------------------------------------------ forward / backward

    def forward(self, data: Sequence[Datum], loss_fn: str = "cross_entropy",
                loss_fn_config: dict[str, float] | None = None) -> APIFuture[ForwardBackwardOutput]:
        return self._loss_call(data, loss_fn, loss_fn_config, backward=False)

    def forward_backward(self, data: Sequence[Datum], loss_fn: str = "cross_entropy",
                         loss_fn_config: dict[str, float] | None = None) -> APIFuture[ForwardBackwardOutput]:
        return self._loss_call(data, loss_fn, loss_fn_config, backward=True)

    def _loss_call(self, data, loss_fn, loss_fn_config, backward: bool) -> APIFuture[ForwardBackwardOutput]:
        # Validate now, in the caller's thread, so a bad datum raises where it was built.
        prepared = trainer.prepare(list(data), loss_fn, self.engine.vocab_size, self.engine.check_tokens)
        trainer.losses.resolve_config(loss_fn, loss_fn_config)

        def work() -> ForwardBackwardOutput:
            return self._run_in_engine(lambda model: trainer.run(
                model, prepared, loss_fn, loss_fn_config, self.engine.device,
                self.service.micro_batch_tokens, backward))

        return self._submit(work)

    # ------------------------------------------------------------------ optimizer

    def optim_step(self, adam_params: AdamParams) -> APIFuture[OptimStepResponse]:
        if not isinstance(adam_params, AdamParams):
            raise TypeError(f"optim_step takes grpo.types.AdamParams, got {type(adam_params).__name__}")
        return self._submit(lambda: self._run_in_engine(lambda _: self._optim_step(adam_params)))

    def _optim_step(self, adam: AdamParams) -> OptimStepResponse:
        params = list(self.engine.adapter_parameters(self.adapter).values())
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(params, lr=adam.learning_rate)
        for group in self.optimizer.param_groups:
            group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                         weight_decay=adam.weight_decay)
        grads = [p.grad for p in params if p.grad is not None]
        grad_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0
        if adam.grad_clip_norm > 0 and grads:
            torch.nn.utils.clip_grad_norm_(params, adam.grad_clip_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.engine.versions[self.adapter] += 1
        return OptimStepResponse(metrics={"grad_norm": grad_norm, "learning_rate": adam.learning_rate})

    # ------------------------------------------------------------------ state

    def _state_path(self, name: str) -> Path:
        if not name or not isinstance(name, str):
            raise ValueError(f"checkpoint name must be a non-empty string, got {name!r}")
        path = Path(name)
        return path if (path.is_absolute() or os.sep in name) else self.service.checkpoint_dir / name

    def _write_adapter(self, path: Path, with_optimizer: bool) -> None:
        from peft.utils import get_peft_model_state_dict
        from safetensors.torch import save_file

        tmp = path.with_name(path.name + ".tmp")
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
        _replace_dir(tmp, path)

    def save_state(self, name: str) -> APIFuture[SaveWeightsResponse]:
        """Adapter weights and optimizer state, for resuming training."""
        path = self._state_path(name)

        def work():
            with self.engine.use(self.adapter):
                self._write_adapter(path, with_optimizer=True)
            return SaveWeightsResponse(path=str(path))

        return self._submit(work)

    def save_weights_for_sampler(self, name: str) -> APIFuture[SaveWeightsForSamplerResponse]:
        """A PEFT adapter directory (``PeftModel.from_pretrained`` loads it)."""
        path = self._state_path(name)

        def work():
            with self.engine.use(self.adapter):
                self._write_adapter(path, with_optimizer=False)
            return SaveWeightsForSamplerResponse(path=str(path))

        return self._submit(work)

    def load_state(self, path: str) -> APIFuture:
        return self._submit(lambda: self._load(path, with_optimizer=False))

    def load_state_with_optimizer(self, path: str) -> APIFuture:
        return self._submit(lambda: self._load(path, with_optimizer=True))

    def _load(self, path: str, with_optimizer: bool):
        from safetensors.torch import load_file

        from grpo.types import LoadWeightsResponse

        state = _read_state(path)
        if state["lora"]["rank"] != self.spec.rank:
            raise ValueError(f"state at {path} has LoRA rank {state['lora']['rank']}, this client has rank {self.spec.rank}")
        weights = load_file(str(Path(path) / "adapter_model.safetensors"))
        with self.engine.use(self.adapter):
            from peft.utils import set_peft_model_state_dict

            result = set_peft_model_state_dict(self.engine.peft_model, weights, adapter_name=self.adapter)
            unexpected = getattr(result, "unexpected_keys", [])
            if unexpected:
                raise ValueError(f"state at {path} does not fit this model: unexpected keys {unexpected[:3]}")
            self.engine.versions[self.adapter] += 1
            self.optimizer = None
            if with_optimizer:
                opt_file = Path(path) / OPTIMIZER_FILE
                if state.get("optimizer") == "fresh":
                    return LoadWeightsResponse(path=str(path))
                if not opt_file.exists():
                    raise FileNotFoundError(f"{path} holds no optimizer state (saved with save_weights_for_sampler?)")
                params = list(self.engine.adapter_parameters(self.adapter).values())
                self.optimizer = torch.optim.AdamW(params)
                self.optimizer.load_state_dict(torch.load(opt_file, map_location=self.engine.device, weights_only=True))
        return LoadWeightsResponse(path=str(path))

    # ------------------------------------------------------------------ sampling

    def save_weights_and_get_sampling_client(self, name: str | None = None) -> SamplingClient:
        """A sampler of the current weights. Nothing is written to disk: the client keeps an
        in-memory snapshot, swapped in only if this adapter trains on before it samples."""
        fut = self._submit(lambda: self._run_in_engine(
            lambda _: (self.engine.versions[self.adapter], self.engine.adapter_state(self.adapter))))
        return SamplingClient(self.handle, adapter=self.adapter, snapshot=fut.result())

    save_weights_and_get_sampling_client_async = async_twin("save_weights_and_get_sampling_client")

    def create_sampling_client(self, model_path: str) -> SamplingClient:
        return self.service.create_sampling_client(model_path=model_path)

    # ------------------------------------------------------------------ info

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_info(self) -> GetInfoResponse:
        return GetInfoResponse(
            model_id=self.adapter,
            model_data=ModelData(arch=type(self.engine.model).__name__, model_name=self.engine.base_model,
                                 tokenizer_id=self.engine.base_model),
            is_lora=True, lora_rank=self.spec.rank, model_name=self.engine.base_model)

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.engine.adapter_parameters(self.adapter).values())

    # ------------------------------------------------------------------ async twins

    forward_async = async_twin("forward")
    forward_backward_async = async_twin("forward_backward")
    optim_step_async = async_twin("optim_step")
    save_state_async = async_twin("save_state")
    load_state_async = async_twin("load_state")
    load_state_with_optimizer_async = async_twin("load_state_with_optimizer")
    save_weights_for_sampler_async = async_twin("save_weights_for_sampler")


class SamplingClient:
    def __init__(self, handle: _EngineHandle, adapter: str | None,
                 snapshot: tuple[int, dict[str, torch.Tensor]] | None = None):
        self.handle = handle
        self.engine = handle.engine
        self.adapter = adapter
        self.snapshot = snapshot

    def sample(self, prompt: ModelInput, num_samples: int = 1, sampling_params: SamplingParams | None = None,
               include_prompt_logprobs: bool = False) -> APIFuture[SampleResponse]:
        tokens = _prompt_tokens(prompt, self.engine)
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be a positive integer, got {num_samples!r}")
        params = sampling_params if sampling_params is not None else SamplingParams()
        if params.max_tokens is None:
            params = SamplingParams(**{**params.__dict__, "max_tokens": DEFAULT_MAX_TOKENS})
        _, stop_ids = params.stop_strings_and_ids()
        self.engine.check_tokens(stop_ids, "SamplingParams.stop token ids")
        request = sampler.GenerationRequest(tokens, num_samples, params, include_prompt_logprobs)
        return APIFuture(self.handle.batcher.submit(request, self.adapter, self.snapshot))

    sample_async = async_twin("sample", awaited=True)

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture[list[float | None]]:
        tokens = _prompt_tokens(prompt, self.engine)

        def work():
            with self.engine.sampling_model(self.adapter, self.snapshot) as model, torch.no_grad():
                return sampler.prompt_logprobs(model, [tokens], 0, self.engine.device)[0]

        return APIFuture(self.handle.train_executor.submit(work))

    compute_logprobs_async = async_twin("compute_logprobs", awaited=True)

    def get_tokenizer(self):
        return self.engine.tokenizer


def _prompt_tokens(prompt: ModelInput, engine: Engine) -> list[int]:
    if not isinstance(prompt, ModelInput):
        raise TypeError(f"prompt must be a grpo.types.ModelInput, got {type(prompt).__name__}")
    tokens = prompt.to_ints()
    if not tokens:
        raise ValueError("prompt is empty: sampling needs at least one prompt token")
    engine.check_tokens(tokens, "prompt")
    return tokens


class _SampleBatcher:
    """Gathers sample requests arriving close together into one batched generation."""

    GATHER_WINDOW_S = 0.01

    def __init__(self, engine: Engine):
        self.engine = engine
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="grpo-sampler", daemon=True)
        self.thread.start()

    def submit(self, request: sampler.GenerationRequest, adapter: str | None, snapshot) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.queue.put((request, adapter, snapshot, future))
        return future

    def _loop(self) -> None:
        while True:
            pending = [self.queue.get()]
            deadline = time.monotonic() + self.GATHER_WINDOW_S
            while True:
                try:
                    pending.append(self.queue.get(timeout=max(0.0, deadline - time.monotonic())))
                    deadline = time.monotonic() + self.GATHER_WINDOW_S
                except queue.Empty:
                    break
            # Requests for different weights cannot share a forward pass.
            by_weights: dict[tuple, list] = {}
            for item in pending:
                by_weights.setdefault((item[1], id(item[2])), []).append(item)
            for items in by_weights.values():
                try:
                    self._run(items)
                except Exception as err:  # never let the thread die: later sample() calls would hang
                    for *_, future in items:
                        if not future.done():
                            future.set_exception(err)

    def _run(self, items: list) -> None:
        live = [it for it in items if it[3].set_running_or_notify_cancel()]
        if not live:
            return
        _, adapter, snapshot, _ = live[0]
        try:
            with self.engine.sampling_model(adapter, snapshot) as model:
                sampler.generate(model, [it[0] for it in live], self.engine.tokenizer, self.engine.device)
        except Exception as err:  # delivered to every caller of this batch
            for it in live:
                it[3].set_exception(err)
            return
        for request, _, _, future in live:
            future.set_result(SampleResponse(sequences=request.sequences, prompt_logprobs=request.prompt_logprobs))


def _read_state(path: str) -> dict:
    state_file = Path(path) / STATE_FILE
    if not state_file.exists():
        raise FileNotFoundError(f"{path} is not a grpo training state (no {STATE_FILE}); pass a path from save_state")
    return json.loads(state_file.read_text())


def _replace_dir(tmp: Path, path: Path) -> None:
    import shutil

    if path.exists():
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        path.replace(old)
        tmp.replace(path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.replace(path)
