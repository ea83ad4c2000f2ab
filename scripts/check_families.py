"""Does an architecture sample and train consistently through grpo's local backend? One row a family.

Usage (from the repository root; offline, a minute or two on 2 cores):

    .venv/bin/python scripts/check_families.py                      # every family below, bf16
    .venv/bin/python scripts/check_families.py gemma2 phi4_mini --dtype fp32

For each family: a tiny random model of transformers' class (SmolLM2's tokenizer, hidden 64, two
layers, windows of 4 tokens where the family has windows, so that 10 sampled tokens after an
8-token prompt run past them) is saved, loaded as a LoRA training client, sampled (3 rows), and
the same tokens' logprobs are computed by the sampling client (``compute_logprobs``: the model's
own forward) and by the trainer (``forward``), after one training step (so that the adapter is
not the no-op peft starts it as). All three are the same numbers up to the
precision's rounding when the family is supported; a gap of 0.1 or more is a bug (each row below
once had one: tests/test_model_families.py). A family that grpo refuses says why.

Not the hub's weights: shapes and code paths only. A real model's logits are larger (Gemma's
soft-cap acts on them), so the tests scale some weights where that matters.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import traceback
from pathlib import Path

SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
PROMPT = [1, 504, 3458, 314, 253, 1345, 28, 9906, 42, 43, 44, 45, 46, 47, 48, 49]  # (16: a prefix the trainer shares)

# name: (config class, model class, config arguments, whether SIZES come first)
FAMILIES: dict[str, tuple[str, str, dict, bool]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, True),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=4), True),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, True),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}, True),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16), True),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, sliding_window=4), True),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=16, sliding_window=4), True),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=4), True),
    "phi4_mini": ("Phi3Config", "Phi3ForCausalLM", dict(partial_rotary_factor=0.75, sliding_window=None), True),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", {}, True),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, True),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                                                            attention_multiplier=0.015625, logits_scaling=8.0), True),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(sliding_window=4), True),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(sliding_window=4, num_local_experts=4,
                                                            num_experts_per_tok=2), True),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2,
                                                               moe_intermediate_size=32,
                                                               shared_expert_intermediate_size=64), True),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2,
                                                               moe_intermediate_size=32), True),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {}, True),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}, True),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}, True),
    "phi": ("PhiConfig", "PhiForCausalLM", {}, True),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}, True),
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                         num_kv_heads=2, new_decoder_architecture=True), False),
    "ministral": ("MinistralConfig", "MinistralForCausalLM", dict(head_dim=16, sliding_window=4,
                                                                  layer_types=["sliding_attention", "full_attention"]),
                  True),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", dict(sliding_window=4,
                                                            layer_types=["sliding_attention", "full_attention"]), True),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                                                          sliding_window=4), True),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", dict(num_local_experts=2, head_dim=16,
                                                             intermediate_size_mlp=128), True),
    # multi-head latent attention (keys and values through a low-rank projection; as many key/value heads as heads)
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, q_lora_rank=None,
        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1), True),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, q_lora_rank=32,
        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1, n_group=1,
        topk_group=1), True),
    # hybrids: linear-attention layers beside attention ones (recurrent_sampler.py samples them)
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(layer_types=["linear_attention", "full_attention"]),
                True),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(layer_types=["linear_attention", "full_attention"],
                                                                   num_experts=4, num_experts_per_tok=2,
                                                                   moe_intermediate_size=32,
                                                                   shared_expert_intermediate_size=32), True),
    # Gemma 3 from 4B on: a multimodal checkpoint, loaded whole, its decoder's sizes in a nested config
    "gemma3_multimodal": ("Gemma3Config", "Gemma3ForConditionalGeneration", dict(
        text_config=dict(head_dim=16, sliding_window=4, **SIZES),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=8),
        mm_tokens_per_image=4, boi_token_index=5, eoi_token_index=6, image_token_index=7), False),
}


def _answer_weights(length: int):
    """The loss counts the answer only, as GRPO's datums do: the group's prompt is a prefix the
    trainer runs once for its rows (trainer.plan_sharing)."""
    import torch

    return torch.cat([torch.zeros(len(PROMPT) - 1), torch.ones(length - len(PROMPT))])


def train_one_step(tc) -> None:
    """One cross-entropy step at a large learning rate: peft starts LoRA's B at zero, where the
    adapter is a no-op and a sampler that applied it wrongly would still agree."""
    import torch

    from grpo import types

    tokens = PROMPT * 2
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": torch.tensor(tokens[1:]), "weights": torch.ones(len(tokens) - 1)})
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=0.05)).result()


def check(family: str, directory: Path, dtype: str) -> str:
    """One family's row: the largest gaps between the three logprobs of the same tokens."""
    import torch
    import transformers

    from grpo import models, types
    from grpo.backends.local import ServiceClient

    config_name, model_name, extra, with_sizes = FAMILIES[family]
    tokenizer = models.load_tokenizer("tiny")
    if "text_config" in extra:  # (the vocabulary goes where the decoder's sizes are)
        extra = {**extra, "text_config": {**extra["text_config"], "vocab_size": len(tokenizer)}}
    else:
        extra = {"vocab_size": len(tokenizer), **({**SIZES, **extra} if with_sizes else extra)}
    config = getattr(transformers, config_name)(bos_token_id=tokenizer.bos_token_id,
                                                eos_token_id=tokenizer.eos_token_id,
                                                pad_token_id=tokenizer.pad_token_id, **extra)
    torch.manual_seed(0)
    getattr(transformers, model_name)(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    service = ServiceClient(checkpoint_dir=directory / "checkpoints", device="cpu", dtype=dtype)
    tc = service.create_lora_training_client(str(directory), rank=4, seed=0)
    train_one_step(tc)
    sampler = tc.save_weights_and_get_sampling_client("weights")
    result = sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples=3,
                            sampling_params=types.SamplingParams(max_tokens=10, temperature=1.0, seed=1)).result()
    computed_gap, data = 0.0, []
    for sequence in result.sequences:
        tokens = PROMPT + list(sequence.tokens)
        computed = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[len(PROMPT):]
        computed_gap = max(computed_gap, max(abs(a - b) for a, b in zip(computed, sequence.logprobs, strict=True)))
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                loss_fn_inputs={"target_tokens": torch.tensor(tokens[1:]),
                                                "weights": _answer_weights(len(tokens))}))
    out = tc.forward(data, "cross_entropy").result()
    trained_gap = max(float((o["logprobs"].to_torch()[len(PROMPT) - 1:] - torch.tensor(s.logprobs)).abs().max())
                      for o, s in zip(out.loss_fn_outputs, result.sequences, strict=True))
    verdict = "ok" if max(computed_gap, trained_gap) < 0.1 else "GAP"
    return f"{verdict:4s} sampled vs computed {computed_gap:.1e}, sampled vs trained {trained_gap:.1e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("families", nargs="*", help=f"of: {', '.join(FAMILIES)} (default: all)")
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "auto"],
                        help="the backend's train and sample precision")
    args = parser.parse_args()
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    with tempfile.TemporaryDirectory() as scratch:
        for family in args.families or FAMILIES:
            try:
                row = check(family, Path(scratch) / family, args.dtype)
            except Exception as err:  # a refused or failing family is a row, not the end of the table
                row = f"refused or failed: {type(err).__name__}: {str(err)[:200]}"
                traceback.print_exc(file=sys.stderr)
            print(f"{family:11s} {row}", flush=True)


if __name__ == "__main__":
    main()
