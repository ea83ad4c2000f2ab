"""scripts/random_model.py: a local model directory with another model's architecture and tokenizer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from grpo import models

ROOT = Path(__file__).resolve().parent.parent


def test_random_model_has_the_architecture_and_tokenizer_it_copies_and_loads_as_base_model(tmp_path):
    out = tmp_path / "random-tiny"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "random_model.py"), str(out), "--like", "tiny"],
                   check=True, capture_output=True, text=True, timeout=300)
    like, made = models.load_config("tiny"), models.load_config(str(out))
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        assert getattr(made, key) == getattr(like, key), key
    text = [{"role": "user", "content": "What is 2 + 2?"}]
    assert (models.load_tokenizer(str(out)).apply_chat_template(text, tokenize=True, return_dict=False)
            == models.load_tokenizer("tiny").apply_chat_template(text, tokenize=True, return_dict=False))
    model = models.load_model(str(out), device="cpu", dtype="fp32")
    reference = models.load_model("tiny", device="cpu", dtype="fp32")
    weights = dict(model.named_parameters())
    assert weights.keys() == dict(reference.named_parameters()).keys()
    assert float(weights["model.layers.0.mlp.up_proj.weight"].std()) > 0  # initialised, not zeros


def test_like_takes_a_directory_of_config_and_tokenizer_files_only(tmp_path):
    """What a machine without the packaged weights gets: a few MB of config and tokenizer files."""
    import shutil

    models.load_tokenizer("smollm2")  # the packaged model's directory exists after its first use
    source = models.cache_dir() / "smollm2-135m-instruct"
    like = tmp_path / "cfg"
    like.mkdir()
    for f in source.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, like / f.name)
    out = tmp_path / "random-135m"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "random_model.py"), str(out), "--like", str(like)],
                   check=True, capture_output=True, text=True, timeout=300)
    made, packaged = models.load_config(str(out)), models.load_config("smollm2")
    assert (made.hidden_size, made.num_hidden_layers, made.vocab_size) == (packaged.hidden_size,
                                                                            packaged.num_hidden_layers,
                                                                            packaged.vocab_size)
    assert (out / "model.safetensors").stat().st_size > 200e6  # 135M parameters in bf16


def test_a_qwen3_5_hybrid_of_qwen3_5_0_8b_sizes(tmp_path, monkeypatch):
    """``--shape qwen3.5-0.8b``: the hybrid the benchmarks measure (its sizes counted on the meta
    device: 548 M parameters), built here at small sizes through the same code, loads as a base model."""
    import importlib.util

    import torch
    import transformers

    spec = importlib.util.spec_from_file_location("random_model", ROOT / "scripts" / "random_model.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    class_name, sizes = script.HYBRIDS["qwen3.5-0.8b"]
    with torch.device("meta"):
        full = transformers.Qwen3_5ForCausalLM(getattr(transformers, class_name)(vocab_size=49152, **sizes))
    assert 545e6 < sum(p.numel() for p in full.parameters()) < 550e6
    small = dict(sizes, hidden_size=64, intermediate_size=128, num_hidden_layers=4, head_dim=16, linear_key_head_dim=16,
                 linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                 layer_types=["linear_attention"] * 3 + ["full_attention"])
    monkeypatch.setitem(script.HYBRIDS, "qwen3.5-0.8b", (class_name, small))
    out = tmp_path / "hybrid"
    monkeypatch.setattr(sys, "argv", ["random_model.py", str(out), "--like", "tiny", "--shape", "qwen3.5-0.8b"])
    script.main()
    made = models.load_config(str(out))
    assert made.model_type == "qwen3_5_text" and made.layer_types == small["layer_types"]
    assert made.vocab_size == len(models.load_tokenizer("tiny"))
    model = models.load_model(str(out), device="cpu", dtype="fp32")
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
