"""The sampler/trainer logprob gap of one precision on the packaged model (docs/benchmark.md).

Usage: .venv/bin/python scripts/precision_gap.py fp32|bf16-sample|bf16

Samples 8 arithmetic prompts x 4 responses x 32 tokens at temperature 1 with fresh LoRA, scores
the same tokens with the trainer (forward, cross_entropy) and prints the gap on the sampled
tokens: KL by the plain (k1) and k3 estimators, the largest |q - p|, the share of tokens whose
trainer/sampler ratio is above 1.2 and 2 (what tis_cap would cap), and the two calls' times.
"""

from __future__ import annotations

import math
import sys
import time
import warnings

import torch

from grpo import types
from grpo.backends.local import ServiceClient

PRECISIONS = {"fp32": ("fp32", "fp32"), "bf16-sample": ("fp32", "bf16"), "bf16": ("bf16", "bf16")}
PAIRS = [(3, 4), (12, 7), (5, 9), (21, 13), (8, 8), (30, 11), (2, 6), (17, 25)]


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "bf16-sample"
    if name not in PRECISIONS:
        sys.exit(f"precision {name!r} is invalid; valid: {', '.join(PRECISIONS)}")
    train_dtype, sample_dtype = PRECISIONS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bf16 on a CPU without bf16 instructions warns
        service = ServiceClient(device="cpu", train_dtype=train_dtype, sample_dtype=sample_dtype)
    trainer = service.create_lora_training_client("smollm2", seed=0, rank=16)
    tokenizer = trainer.get_tokenizer()
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}?"}],
                                                              add_generation_prompt=True, tokenize=False),
                                add_special_tokens=False) for a, b in PAIRS]
    sampler = trainer.save_weights_and_get_sampling_client()
    t0 = time.perf_counter()
    futures = [sampler.sample(types.ModelInput.from_ints(p), 4, types.SamplingParams(max_tokens=32, seed=i, temperature=1.0))
               for i, p in enumerate(prompts)]
    results = [f.result() for f in futures]
    sample_s = time.perf_counter() - t0
    data, seqs = [], []
    for prompt, result in zip(prompts, results, strict=True):
        for s in result.sequences:
            full = prompt + s.tokens
            data.append(types.Datum(types.ModelInput.from_ints(full[:-1]),
                                    {"target_tokens": types.TensorData.from_torch(torch.tensor(full[1:]))}))
            seqs.append((len(prompt), s))
    t0 = time.perf_counter()
    out = trainer.forward(data, "cross_entropy").result()
    forward_s = time.perf_counter() - t0
    diffs = []  # q - p on every sampled token
    for (n, s), o in zip(seqs, out.loss_fn_outputs, strict=True):
        diffs += [q - p for q, p in zip(s.logprobs, o["logprobs"].tolist()[n - 1:], strict=True)]
    k1 = sum(diffs) / len(diffs)
    k3 = sum(math.exp(-d) - 1 + d for d in diffs) / len(diffs)
    above = {c: sum(math.exp(-d) > c for d in diffs) / len(diffs) for c in (1.2, 2.0)}
    print(f"{name}: {len(diffs)} tokens, sample {sample_s:.1f} s, forward {forward_s:.1f} s, KL k1 {k1:.2e}, "
          f"k3 {k3:.2e}, max |q - p| {max(abs(d) for d in diffs):.3f}, ratio > 1.2: {above[1.2]:.4f}, "
          f"> 2: {above[2.0]:.4f}")


if __name__ == "__main__":
    main()
