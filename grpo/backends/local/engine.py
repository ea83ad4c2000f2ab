"""One loaded base model, the LoRA adapters trained on it, and the lock that serialises them.

Every training and sampling client of a base model shares one ``Engine``: the base weights are
in memory once, each training client owns a named peft adapter on top, and sampling clients hold
snapshots of adapter weights. A float32 model samples through a snapshot folded into a copy of the
adapted weights (folded_lora.py); otherwise the snapshot is swapped into the adapter only when
training has moved past it. Where ``sample_dtype`` differs from ``train_dtype``, and for bf16
sampling on a CPU, the sampler runs its own packed copy of the base weights in that precision
(sampler_precision.py); the trainer's LoRA weights and optimizer state are fp32 either way.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from grpo import models
from grpo.backends.local import delta_rule, long_lived, native_layers, packed_attention
from grpo.backends.local.folded_lora import FoldedAdapter, SidePathAdapter, can_fold, can_side_path
from grpo.backends.local.logit_head import check_logit_head
from grpo.backends.local.sampler_precision import SamplerCopy, takes_adapter
from grpo.backends.local.sections import section
from grpo.checks import check_lora_targets
from grpo.models import dtype_probe, kernel_probe, native_kernels, precision
from grpo.models.cpu_linear import (
    STREAMING,
    OneDNNLinear,
    keep_packed_copies,
    packing_works,
    use_kernel,
    use_onednn_linears,
)
from grpo.models.lora_linear import fuse_lora_linears

ATTN_PARENTS = ("attn", "attention")
MLP_PARENTS = ("mlp", "feed_forward", "ffn")


@dataclass(frozen=True)
class LoraSpec:
    rank: int = 16
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    alpha: float | None = None  # default 2 * rank, see lora_config
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"rank must be a positive integer, got {self.rank!r}")
        check_lora_targets(self.train_mlp, self.train_attn, self.train_unembed)


def lora_target_modules(model: nn.Module, spec: LoraSpec) -> list[str]:
    """Full names of the Linear layers the train_* flags select.

    Classified by the name of the parent block (``self_attn``/``mlp``) rather than by a per-arch
    list of projection names, so any decoder with the usual layout works. Only the decoder's
    Linears (and the unembedding): a multimodal checkpoint's vision tower has blocks of those
    names too, which text-only training never runs.
    """
    output = model.get_output_embeddings()
    # Once a first adapter is injected, every adapted Linear sits at ``<name>.base_layer`` next to
    # its ``lora_A``/``lora_B`` Linears; a later adapter must target ``<name>`` again, never those.
    output = getattr(output, "base_layer", output)
    decoder = {id(m) for m in model.get_decoder().modules()} if hasattr(model, "get_decoder") else None
    targets: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if decoder is not None and id(module) not in decoder and module is not output:
            continue
        parts = name.split(".")
        if any(p.startswith("lora_") for p in parts):
            continue
        if parts[-1] == "base_layer":
            parts = parts[:-1]
            name = ".".join(parts)
        if module is output:
            if spec.train_unembed:
                targets.append(name)
            continue
        parents = parts[:-1]
        in_attn = any(p.endswith(ATTN_PARENTS) for p in parents)
        in_mlp = any(p.endswith(MLP_PARENTS) for p in parents)
        if (in_attn and spec.train_attn) or (in_mlp and spec.train_mlp):
            targets.append(name)
    if not targets:
        raise ValueError(f"no Linear layers match train_attn/train_mlp/train_unembed in {type(model).__name__}")
    return targets


def _shapes(base_model: str) -> dtype_probe.Shapes | None:
    """The model's Linear shapes, for the probes that time them on this CPU before the weights load
    (auto precision: dtype_probe.py; the fp32 training kernel: kernel_probe.py); None where the
    config names none (then auto is fp32, and the kernel oneDNN)."""
    try:
        return dtype_probe.Shapes.from_config(models.load_config(base_model))
    except (OSError, ValueError):  # not a model config (an adapter directory...): load_model says what is wrong
        return None


class Engine:
    """A base model on one device plus its named LoRA adapters."""

    def __init__(self, base_model: str, device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                 sample_dtype: str | torch.dtype | None = None):
        """``dtype``: the trainer's precision (``train_dtype``), ``sample_dtype`` the sampler's
        (None: the same name as ``dtype``); each fp32, bf16 or auto (grpo/models/precision.py).
        ``auto`` is decided per role: sampling and training may measure differently."""
        # the imports set aside from the garbage collector's full passes, before any model loads
        long_lived.freeze_once()
        self.base_model = base_model
        self.device = models.resolve_device(device)
        sample_dtype = dtype if sample_dtype is None else sample_dtype
        # read once, for the probes; none times anything on a GPU or with the probes off
        shapes = _shapes(base_model) if self.device.type == "cpu" and dtype_probe.enabled() else None
        train_dtype = precision.resolve("train_dtype", dtype, self.device, shapes)
        self.sample_dtype = precision.resolve("sample_dtype", sample_dtype, self.device, shapes)
        self.tokenizer = models.load_tokenizer(base_model)
        self.model = models.load_model(base_model, device=self.device, dtype=train_dtype)
        check_logit_head(self.model)  # (the trainer unembeds as the model's forward does, or refuses it)
        self.dtype = next(self.model.parameters()).dtype
        # a float32 CPU model (oneDNN Linears) trains through the kernel measured faster here
        has_onednn = any(type(m) is OneDNNLinear for m in self.model.modules())
        self.fp32_kernel = kernel_probe.training_kernel(shapes) if has_onednn else "onednn"
        use_kernel(self.model, self.fp32_kernel)
        # Sampling multiplies by packed weights (cpu_linear.py), at the cost of one more copy of the
        # weights it reads there: in fp32 the unembedding's (the LoRA layers are folded into packed
        # copies of their own); in bf16 a whole packed copy of the model. Each is packed in the
        # layout measured faster for a decoding step in its precision here (kernel_probe.py).
        self.fp32_layout = kernel_probe.decoding_layout(shapes) if has_onednn else "onednn"
        keep_packed_copies([self.model.get_output_embeddings()], self.fp32_layout)
        for p in self.model.parameters():
            p.requires_grad_(False)
        # a hybrid's chunked delta rule (prefills, training) through grpo's native kernel (else in
        # chunks fitted to the sequence, not padded to 64 positions), and its short convolution
        # padded on the left only (delta_rule.py)
        if delta_rule.fit_prefill(self.model) and self.device.type == "cpu":
            how = ("grpo's native chunked kernel" if native_kernels.kernels() is not None
                   else "transformers' reference code, in chunks fitted to the sequence")
            print(f"grpo: {base_model}'s linear-attention layers prefill and train through {how} (the "
                  "flash-linear-attention and causal-conv1d that transformers suggests installing are GPU kernels)",
                  file=sys.stderr, flush=True)
        if self.device.type == "cpu":
            # RMSNorms, SiLU * up and the rotary embedding through grpo's native kernels, forward
            # and backward (native_layers.py; the kernels are built on first need, once per machine, or
            # by the probes above, which time the streaming layout). The sampler's copy below is made
            # from these modules and keeps them.
            native_layers.install(self.model)
        if shapes is not None and self.dtype == torch.bfloat16:
            # the trainer's bf16 attention takes its products by avx512_bf16's dot product where that
            # measured faster here than float32's multiply-adds (kernel_probe.py)
            heads = kernel_probe.AttentionShapes.from_config(self.model.config)
            if heads is not None:
                packed_attention.use_dot_products(heads.heads, heads.kv_heads, heads.head_dim,
                                                  kernel_probe.training_attention(heads) == "dot")
        # bf16 sampling on a CPU runs its own packed copy (sampler_precision.py) even beside a bf16
        # trainer: sibling projections stacked, LoRA side paths made once per set of weights. A
        # sampling call of the bench (8 x 4 x 32 tokens) took 3.2 s against 4.4 s through peft's
        # layers over the trainer's weights (Intel Xeon with AMX), in the bytes that those
        # layers' packed copies took before. (A CPU that packs no bf16 weights, in neither layout,
        # gets no copy: it would only hold the weights twice.) Made before any adapter is injected,
        # so that it copies the plain base model.
        self.sample_layout = (self.fp32_layout if self.sample_dtype == self.dtype == torch.float32
                              else kernel_probe.decoding_layout(shapes, self.sample_dtype))
        own_copy = self.sample_dtype != self.dtype or (
            self.device.type == "cpu" and self.sample_dtype == torch.bfloat16
            and (packing_works(torch.bfloat16) or self.sample_layout in STREAMING))
        self._sampler_copy = SamplerCopy(self.model, self.sample_dtype, self.sample_layout) if own_copy else None
        self._copy_refused: set[str] = set()  # adapters whose LoRA the copy does not take (said once each)
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.lock = threading.RLock()
        self.peft_model = None
        self.specs: dict[str, LoraSpec] = {}
        self.versions: dict[str, int] = {}
        self._active: str | None = None
        # Sampling folds LoRA into the base weights where that is exact (float32, folded_lora.py),
        # and elsewhere takes it as side paths made once per weights; off: the trainer's LoRA layers.
        self.fold_lora_for_sampling = True
        self._folded: FoldedAdapter | None = None  # the last folded weights, reused while current
        self._side_paths: SidePathAdapter | None = None  # (where folding is not exact: bf16 on a GPU)
        self._parameters: dict[str, dict[str, nn.Parameter]] = {}  # adapter_parameters, per adapter

    # ------------------------------------------------------------------ adapters

    def add_adapter(self, name: str, spec: LoraSpec, seed: int | None = None) -> None:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(
            r=spec.rank,
            lora_alpha=spec.alpha if spec.alpha is not None else 2 * spec.rank,
            lora_dropout=spec.dropout,
            target_modules=lora_target_modules(self.model if self.peft_model is None else self.peft_model.get_base_model(), spec),
            bias="none",
        )
        with self.lock, torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            if seed is not None:
                torch.manual_seed(seed)
            with warnings.catch_warnings():
                # LoRA on a tied lm_head adapts the output projection only, which is what
                # train_unembed means; peft warns that the tie is not mirrored into the input.
                warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
                # peft reads transformers' deprecated is_gradient_checkpointing; not ours to fix
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
                if self.peft_model is None:
                    self.peft_model = get_peft_model(self.model, config, adapter_name=name)
                else:
                    self.peft_model.add_adapter(name, config)
            self._own_lora_layers()
            self.specs[name] = spec
            self.versions[name] = 0
            self._activate(name)

    def load_adapter_dir(self, name: str, path) -> None:
        """Load a saved PEFT adapter directory as adapter ``name`` (for sampling from it)."""
        from peft import PeftModel

        with self.lock, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")  # see add_adapter
            if self.peft_model is None:
                self.peft_model = PeftModel.from_pretrained(self.model, str(path), adapter_name=name)
            else:
                self.peft_model.load_adapter(str(path), adapter_name=name)
            self._own_lora_layers()
            self.versions[name] = 0
            self._activate(name)
            for p in self.adapter_parameters(name).values():
                p.requires_grad_(False)

    def adapter_parameters(self, name: str) -> dict[str, nn.Parameter]:
        """The trainable tensors of adapter ``name``, keyed by module path. Found once per adapter:
        a walk of the model's parameters passes every loaded adapter's, and a server holding many
        made each training call of every one of them slower."""
        params = self._parameters.get(name)
        if params is None:
            marker = f".{name}."
            params = {n: p for n, p in self.peft_model.named_parameters() if "lora_" in n and marker in n}
            self._parameters[name] = params
        return params

    def remove_adapter(self, name: str) -> None:
        """Unload adapter ``name``: its LoRA layers, weights and whatever was built from them (a
        folded or side-path sampler copy) leave memory; saved checkpoints are untouched. peft's
        own per-adapter operations walk every loaded adapter, so a long-running server unloads
        what its finished sessions leave behind (grpo/serve)."""
        with self.lock:
            if self.peft_model is None or name not in self.versions:
                return
            if self._sampler_copy is not None and self._sampler_copy.key is not None and self._sampler_copy.key[0] == name:
                self._sampler_copy.forget()
            if self._folded is not None and self._folded.key[0] == name:
                self._folded = None
            if self._side_paths is not None and self._side_paths.key[0] == name:
                self._side_paths = None
            if len(self.versions) == 1:
                # peft has no model without an adapter (its active config would name the deleted
                # one): take the LoRA layers out, and the next adapter wraps the model afresh
                self.peft_model.unload()
                self.peft_model = None
            else:
                with warnings.catch_warnings():  # that another adapter is active now: _active says so below
                    warnings.filterwarnings("ignore", message=".*was active which is now deleted.*")
                    self.peft_model.delete_adapter(name)
            del self.versions[name]
            self.specs.pop(name, None)
            self._parameters.pop(name, None)
            self._active = None  # peft made another adapter (or none) active: set_adapter again before use

    def adapter_state(self, name: str) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.adapter_parameters(name).items()}

    def load_adapter_state(self, name: str, state: dict[str, torch.Tensor]) -> None:
        params = self.adapter_parameters(name)
        missing = set(params) - set(state)
        if missing:
            raise ValueError(f"adapter state is missing {len(missing)} tensors, e.g. {sorted(missing)[:2]}")
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(state[n].to(p.device, p.dtype))

    def _activate(self, name: str) -> None:
        if self._active != name:
            self.peft_model.set_adapter(name)
            # set_adapter marks the active adapter trainable; that is what the trainer wants.
            self._active = name

    # ------------------------------------------------------------------ running

    @contextlib.contextmanager
    def use(self, adapter: str | None, snapshot: tuple[int, dict[str, torch.Tensor]] | None = None) -> Iterator[nn.Module]:
        """Hold the lock with ``adapter`` active (None: the bare base model).

        ``snapshot`` is (version, weights) of a sampling client; when the adapter has been
        trained since, its live weights are swapped out for the snapshot and back afterwards.
        """
        with self.lock:
            if adapter is None:
                if self.peft_model is None:
                    yield self.model
                else:
                    with self.peft_model.disable_adapter():
                        yield self.peft_model
                return
            self._activate(adapter)
            stale = snapshot is not None and snapshot[0] != self.versions[adapter]
            live = self.adapter_state(adapter) if stale else None
            if stale:
                self.load_adapter_state(adapter, snapshot[1])
            try:
                yield self.peft_model
            finally:
                if live is not None:
                    self.load_adapter_state(adapter, live)

    def _copy_takes(self, adapter: str) -> bool:
        """Whether the sampler's own copy computes ``adapter``'s LoRA; said once where it does not."""
        if takes_adapter(self.peft_model, adapter):
            return True
        if adapter not in self._copy_refused:
            self._copy_refused.add(adapter)
            print(f"grpo: adapter {adapter!r} has LoRA layers the {str(self.sample_dtype)[6:]} sampler copy does not take "
                  f"(on fused expert weights, or DoRA): sampling through the trainer's model, in its precision",
                  file=sys.stderr, flush=True)
        return False

    def sampling_weights_key(self, adapter: str | None, snapshot: tuple[int, dict[str, torch.Tensor]] | None
                             ) -> tuple:
        """The weights a sampling call runs, as a key for what is built from them (the folded or
        side-path copy, the prefix cache): the bare base model; a snapshot, by identity (whoever
        keys by it holds the snapshot, so that no later one takes its address); or the live adapter
        at its version, which every optimizer step and every load moves on."""
        if adapter is None or self.peft_model is None:
            return (None,)
        if snapshot is not None:
            return (adapter, id(snapshot[1]))
        return (adapter, self.versions[adapter], None)

    @contextlib.contextmanager
    def sampling_model(self, adapter: str | None, snapshot: tuple[int, dict[str, torch.Tensor]] | None = None
                       ) -> Iterator[nn.Module]:
        """``use()`` for sampling: gradient-free, so LoRA may be folded into the base weights.

        The sampler's own copy where it has one (sampler_precision.py); else folded wherever
        ``folded_lora.can_fold`` allows (float32 weights), and elsewhere (bf16 on a GPU) side paths
        cast and scaled once (``folded_lora.SidePathAdapter``), unless ``fold_lora_for_sampling`` is
        turned off (then the trainer's own LoRA layers). One folded or side-path set is kept, keyed
        by the snapshot it came from (or the adapter's version), so that every sampling call of a
        training step after the first reuses it.
        """
        with self.lock:
            weights = snapshot[1] if snapshot is not None else None
            key = self.sampling_weights_key(adapter, snapshot)
            if self._sampler_copy is not None and (adapter is None or self._copy_takes(adapter)):
                # its own copy (sampler_precision.py)
                with section("grpo.sample.install_lora"):
                    model = self._sampler_copy.install(self.causal_lm(), adapter, weights, key)
                yield model
                return
            if adapter is not None and self.fold_lora_for_sampling and can_fold(self.peft_model, adapter):
                if self._folded is None or self._folded.key != key:
                    # The outdated copy's tensors are overwritten; were that to fail half way, no
                    # half-written copy may stay cached.
                    outdated, self._folded = self._folded, None
                    with section("grpo.sample.install_lora"):
                        self._folded = FoldedAdapter(self.peft_model, adapter, weights, key, recycle=outdated,
                                                     layout=self.fp32_layout)
                self._activate(adapter)
                with self._folded.installed(self.peft_model) as model:
                    yield model
                return
            if adapter is not None and self.fold_lora_for_sampling and can_side_path(self.peft_model, adapter):
                # not foldable (bf16 base weights) and no copy of the sampler's own: the LoRA layers
                # as side paths cast and scaled once per weights key (folded_lora.SidePathAdapter)
                if self._side_paths is None or self._side_paths.key != key:
                    self._side_paths = None
                    with section("grpo.sample.install_lora"):
                        self._side_paths = SidePathAdapter(self.peft_model, adapter, weights, key)
                self._activate(adapter)
                with self._side_paths.installed(self.peft_model) as model:
                    yield model
                return
            with self.use(adapter, snapshot) as model:
                yield model

    def _own_lora_layers(self) -> None:
        """The Linears peft just added (lora_A, lora_B) on this engine's kernels, and its LoRA
        layers on grpo's forward (lora_linear.py)."""
        use_onednn_linears(self.peft_model)
        use_kernel(self.peft_model, self.fp32_kernel)
        fuse_lora_linears(self.peft_model)

    def causal_lm(self) -> nn.Module:
        """The transformers model with LoRA layers injected (peft's wrapper stripped)."""
        return self.peft_model.get_base_model() if self.peft_model is not None else self.model

    def check_tokens(self, tokens: list[int], what: str) -> None:
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"{what} has token ids outside the vocabulary of {self.base_model} "
                f"(valid: 0..{self.vocab_size - 1}), e.g. {bad[:5]}"
            )
