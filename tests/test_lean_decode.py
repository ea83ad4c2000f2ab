"""The sampler's lean decoding step computes exactly what the model's own forward computes.

Reference: the same sampling calls with ``lean_decoder`` switched off, so that every decoding
step goes through transformers' forward of the same sampler model. Equal means bit-equal: the
same sampled tokens and the same float logprobs, with an adapter whose LoRA is not a no-op.
"""

from __future__ import annotations

import pytest
import torch
from backend_helpers import perturb_adapter, sample_each
from transformers import (
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from grpo.backends.local import ServiceClient, lean_decode, sampler
from grpo.models import native_kernels


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "phi3", "phi4_mini", "olmo2",
                                    "granite", "smollm3"])
@pytest.mark.parametrize(("train_dtype", "sample_dtype"), [("fp32", "fp32"), ("fp32", "bf16")])
def test_lean_decoding_steps_sample_what_the_models_forward_samples(tmp_path, monkeypatch, tiny_of, train_dtype,
                                                                    sample_dtype, family):
    """fp32: the trainer's model with LoRA folded (under peft); bf16: the sampler's own copy with
    stacked projections and LoRA side paths. Each family the lean step takes: Llama, Mistral (its
    layers windowed, the window longer than the rows), Qwen2 (biases on q/k/v), Qwen3 (each head of
    q and k normalised), Phi-3 (q/k/v and gate/up one Linear each; Phi-4-mini's partial rotary), OLMo2
    (norms after each sublayer, q and k normalised whole, rotated in float32), Granite (its multipliers),
    SmolLM3 (a layer that rotates nothing)."""
    # the eager lean step (the native one: test_native_decode.py), and the model's own modules
    # (switched on, its norms and MLPs would compute through native_layers.py)
    monkeypatch.setenv(native_kernels.ENV_SWITCH, "off")
    service = ServiceClient(checkpoint_dir=tmp_path, device="cpu", train_dtype=train_dtype, sample_dtype=sample_dtype)
    tc = service.create_lora_training_client(tiny_of(family), rank=4, seed=0)
    perturb_adapter(tc, seed=3)
    used = []

    def spied(model, capacity=None):
        lean = lean_decode.lean_decoder(model, capacity)
        used.append(lean is not None)
        return lean

    monkeypatch.setattr(sampler, "lean_decoder", spied)
    lean = sample_each(tc, temperature=1.0, seed=7)
    monkeypatch.setattr(sampler, "lean_decoder", lambda model, capacity=None: None)
    plain = sample_each(tc, temperature=1.0, seed=7)
    assert used and all(used)
    assert lean == plain
    assert len({tuple(tokens) for tokens, _ in lean}) > 1  # the draws differ: the check is not vacuous


def _tiny(config_class, model_class, **overrides):
    config = config_class(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, pad_token_id=0,
                          num_attention_heads=4, num_key_value_heads=2, **overrides)
    config._attn_implementation = overrides.pop("attn_implementation", "sdpa")
    return model_class(config)


def test_only_the_architectures_it_was_written_for_take_the_lean_step():
    assert lean_decode.lean_decoder(_tiny(LlamaConfig, LlamaForCausalLM)) is not None
    assert lean_decode.lean_decoder(_tiny(Qwen2Config, Qwen2ForCausalLM)) is not None
    assert lean_decode.lean_decoder(_tiny(Qwen3Config, Qwen3ForCausalLM)) is not None
    assert lean_decode.lean_decoder(_tiny(MistralConfig, MistralForCausalLM, sliding_window=None)) is not None
    # Phi-3's, OLMo2's and Granite's layers, each with its layout (on a CPU)
    phi3 = lean_decode.lean_decoder(_tiny(Phi3Config, Phi3ForCausalLM, sliding_window=None, partial_rotary_factor=0.5))
    olmo2 = lean_decode.lean_decoder(_tiny(Olmo2Config, Olmo2ForCausalLM))
    assert phi3.layout == lean_decode.Layout(fused=True) and olmo2.layout == lean_decode.Layout(post_norms=True)
    granite = lean_decode.lean_decoder(_tiny(GraniteConfig, GraniteForCausalLM, residual_multiplier=0.5))
    assert granite.layout == lean_decode.Layout(multipliers=True)
    smollm3 = lean_decode.lean_decoder(_tiny(SmolLM3Config, SmolLM3ForCausalLM, no_rope_layers=[1, 0]))
    assert smollm3.layout == lean_decode.Layout(unrotated=True) and smollm3.rotates == [True, False]
    dropping = _tiny(Phi3Config, Phi3ForCausalLM, sliding_window=None, resid_pdrop=0.1)
    assert lean_decode.lean_decoder(dropping.train()) is None  # (its dropout on each sublayer's output)
    assert lean_decode.lean_decoder(dropping.eval()) is not None
    # A layer attending to its last keys only: taken where no row holds more keys than its window
    # (the native step attends to all of a row's keys), the rows' capacity said by the sampler.
    for windowed in (_tiny(Qwen2Config, Qwen2ForCausalLM, use_sliding_window=True, sliding_window=4, max_window_layers=1),
                     _tiny(MistralConfig, MistralForCausalLM, sliding_window=4)):
        assert "sliding_attention" in lean_decode.attention_layers(windowed.config)[0]
        assert lean_decode.lean_decoder(windowed) is None
        assert lean_decode.lean_decoder(windowed, capacity=5) is None
        assert lean_decode.lean_decoder(windowed, capacity=4) is not None
    assert lean_decode.lean_decoder(_tiny(Qwen2Config, Qwen2ForCausalLM, layer_types=["full_attention", "linear_attention"])) is None
    assert lean_decode.lean_decoder(_tiny(MixtralConfig, MixtralForCausalLM, sliding_window=None)) is None  # another family
    eager = _tiny(LlamaConfig, LlamaForCausalLM)
    eager.config._attn_implementation = "eager"
    assert lean_decode.lean_decoder(eager) is None
    gelu = _tiny(LlamaConfig, LlamaForCausalLM, hidden_act="gelu")
    assert lean_decode.lean_decoder(gelu) is None
    with torch.device("meta"):
        on_meta = _tiny(LlamaConfig, LlamaForCausalLM)
    assert lean_decode.lean_decoder(on_meta) is None  # CPU and CUDA only
