"""A random-weight model with a given model's architecture and tokenizer, saved as a local directory.

    python scripts/random_model.py OUT [--like smollm2] [--shape 1.7b | qwen3.5-0.8b] [--seed 0]

For benchmarks on machines that cannot get the weights (no hub, or a transfer limit smaller than
the packaged GGUF): the same config, tokenizer and chat template as ``--like``, weights from
``from_config`` (bf16), so every matmul has the real shapes. ``--like`` is any base_model name, or
a directory holding only a model's config and tokenizer files (a few MB: what to copy to such a
machine, e.g. grpo's cache of the packaged SmolLM2 without its model.safetensors). ``--shape 1.7b`` widens SmolLM2-135M's
config to SmolLM2-1.7B's (hidden 2048, 24 layers, 32 heads, MLP 8192); ``--shape qwen3.5-0.8b`` builds instead a
Qwen3.5 hybrid of Qwen3.5-0.8B's text layer sizes (hidden 1024, 24 layers: three gated-delta-rule layers of 16
heads of 128 to one attention layer of 8 query and 2 key heads of 256; MLP 3584; 548 M parameters with
SmolLM2's vocabulary) on ``--like``'s tokenizer: the hybrid docs/benchmark.md measures. A random model almost never
samples EOS: every row runs to ``max_tokens``. Then ``scripts/bench.py --model OUT``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

SHAPES = {
    "1.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                 num_key_value_heads=32, rope_parameters={"rope_theta": 130000.0, "rope_type": "default"}),
}

# hybrids: a config class of their own, the vocabulary and special tokens of ``--like``'s tokenizer
HYBRIDS = {
    "qwen3.5-0.8b": ("Qwen3_5TextConfig", dict(
        hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
        tie_word_embeddings=True)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--like", default="smollm2", help="base_model, or a directory of config + tokenizer files, whose config and tokenizer are taken")
    parser.add_argument("--shape", choices=sorted([*SHAPES, *HYBRIDS]), help="override the config's shapes")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from grpo import models

    tokenizer = models.load_tokenizer(args.like)
    if args.shape in HYBRIDS:
        import transformers

        class_name, sizes = HYBRIDS[args.shape]
        config = getattr(transformers, class_name)(
            vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, **sizes)
    else:
        config = models.load_config(args.like)
        for key, value in SHAPES.get(args.shape, {}).items():
            setattr(config, key, value)
    torch.manual_seed(args.seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # initialising 1.7B on a GPU: seconds
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"{args.out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, random (seed {args.seed})")


if __name__ == "__main__":
    main()
