"""Resolving base_model names without the hub, and the errors for names that resolve to nothing."""

from __future__ import annotations

import pytest
import torch

from grpo import models


def test_builtin_names_resolve_without_loading() -> None:
    assert models.resolve("tiny").kind == "tiny"
    assert models.resolve("tiny-random").kind == "tiny"
    for name in ("smollm2", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert models.resolve(name).kind == "packaged"
    # Dots in hub ids are common and must not make them look like file paths.
    for hub_id in ("Qwen/Qwen3-0.6B", "Qwen/Qwen2.5-1.5B-Instruct", "meta-llama/Llama-3.1-8B"):
        assert models.resolve(hub_id) == models.ModelSpec(hub_id, "hub", hub_id)


def test_unknown_name_says_where_it_looked(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(models.ModelNotFoundError) as err:
        models.resolve("llama-9000")
    message = str(err.value)
    assert "unknown base_model 'llama-9000'" in message
    assert "built-in names" in message and "'smollm2'" in message and "'tiny'" in message
    assert f"local directory {tmp_path / 'llama-9000'} (does not exist)" in message
    assert "hub" in message and "reachable" in message


def test_path_like_names_and_non_model_directories(tmp_path) -> None:
    with pytest.raises(models.ModelNotFoundError, match=r"looks like a path but .*missing does not exist"):
        models.resolve(str(tmp_path / "missing"))
    with pytest.raises(models.ModelNotFoundError, match="has no config.json; it is not a transformers model"):
        models.resolve(str(tmp_path))
    with pytest.raises(models.ModelNotFoundError, match="looks like a path"):
        models.resolve("weights/model.gguf")
    with pytest.raises(models.ModelNotFoundError, match="non-empty string"):
        models.resolve("  ")


def test_unreachable_hub_id_fails_with_the_hub_named(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(models.ModelNotFoundError) as err:
        models.load_tokenizer("nobody-here/no-such-model")
    message = str(err.value)
    assert message.startswith("base_model 'nobody-here/no-such-model' cannot be loaded: HF_HUB_OFFLINE is set "
                              "and it is not in the local Hugging Face cache")
    assert "base_model=smollm2" in message and "\n" not in message


def test_unreachable_hub_fails_in_seconds_naming_the_endpoint(monkeypatch) -> None:
    # Without HF_HUB_OFFLINE transformers would retry for most of a minute; one connection
    # attempt to a closed local port answers at once.
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    t0 = time.perf_counter()
    with pytest.raises(models.ModelNotFoundError) as err:
        models.load_tokenizer("nobody-here/no-such-model")
    assert time.perf_counter() - t0 < 10
    assert f"http://127.0.0.1:{port} cannot be reached" in str(err.value) and "\n" not in str(err.value)


def test_public_id_is_what_other_libraries_resolve(tmp_path) -> None:
    for name in ("smollm2", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert models.public_id(name) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert models.public_id("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    assert models.public_id("tiny") == "tiny"  # random weights: no id anywhere else
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert models.public_id(str(tmp_path / "m")) == str((tmp_path / "m").resolve())


def test_service_client_rejects_unknown_base_model_before_loading(service) -> None:
    with pytest.raises(models.ModelNotFoundError, match="unknown base_model 'gpt-17'"):
        service.create_lora_training_client("gpt-17")
    with pytest.raises(models.ModelNotFoundError, match="unknown base_model 'gpt-17'"):
        service.create_sampling_client(base_model="gpt-17")
    assert not service._engines  # nothing was loaded


def test_tiny_model_is_seeded_and_matches_its_config(tokenizer) -> None:
    a = models.load_model("tiny", device="cpu", seed=0)
    b = models.load_model("tiny", device="cpu", seed=0)
    c = models.load_model("tiny", device="cpu", seed=1)
    wa, wb, wc = (m.model.layers[0].mlp.up_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert a.config.vocab_size == len(tokenizer) and a.config.hidden_size == models.TINY_CONFIG["hidden_size"]
    assert next(a.parameters()).dtype == torch.float32 and not a.training
    assert tokenizer.pad_token_id is not None


def test_dtype_names() -> None:
    assert models._as_dtype("bf16") is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'float8'; valid: float32"):
        models.load_model("tiny", device="cpu", dtype="float8")
