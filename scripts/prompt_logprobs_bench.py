"""A step's reference logprobs (a KL penalty's) through grpo against the plain transformers way, side by side.

    .venv/bin/python scripts/prompt_logprobs_bench.py [--model smollm2] [--precision auto|fp32|bf16]
                                                      [--groups 8] [--group 4] [--prompt-tokens 45]
                                                      [--answer-tokens 32] [--reps 3]

grpo: a sampling client of the base model, ``compute_logprobs`` of every sequence called together
and then waited on, as grpo's loop (``kl_penalty_coef``) and the cookbook's ``incorporate_kl_penalty``
call it (prompt_logprobs.py: one generation, a group's prompt once, the head in chunks). The peer: the
same model loaded as a transformers user has it (PyTorch's own Linears), one forward per sequence,
``log_softmax`` of its float32 logits gathered at the next tokens -- what grpo itself did before
prompt_logprobs.py. Both in the same precision (``auto``: what grpo's probe picks here), alternating,
``--reps`` times each after a warm-up; the sequences are ``--groups`` prompts of random tokens, each
with ``--group`` answers. Prints both medians, their ratio and how far the two sets of logprobs are
apart (bf16 rounds them differently; fp32 agrees to ~1e-5). Ratios within one run are what to read.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def sequences(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    out = []
    for _ in range(args.groups):
        prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_tokens)]
        out += [prompt + [rng.randrange(100, vocab) for _ in range(args.answer_tokens)] for _ in range(args.group)]
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=45)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)

    import torch

    from grpo import models
    from grpo.backends.local import ServiceClient
    from grpo.models import computing, dtype_probe, precision
    from grpo.types import ModelInput

    shapes = dtype_probe.Shapes.from_config(models.load_config(args.model))
    dtype = precision.resolve("sample_dtype", args.precision, torch.device("cpu"), shapes)
    name = "bf16" if dtype == torch.bfloat16 else "fp32"
    service = ServiceClient(device="cpu", train_dtype=name, sample_dtype=name)
    reference = service.create_sampling_client(base_model=args.model)
    seqs = sequences(args, len(reference.get_tokenizer()))

    def grpo() -> list[list[float]]:
        futures = [reference.compute_logprobs(ModelInput.from_ints(s)) for s in seqs]
        return [f.result()[1:] for f in futures]

    from bench import plain_model

    peer_model = plain_model(argparse.Namespace(model=args.model), "cpu", "bfloat16" if name == "bf16" else "float32")

    @torch.inference_mode()
    def plain() -> list[list[float]]:
        out = []
        for s in seqs:
            ids = torch.tensor([s])
            logits = peer_model(input_ids=ids).logits[0, :-1].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].tolist())
        return out

    def timed(fn) -> tuple[float, list[list[float]]]:
        t0 = time.perf_counter()
        values = fn()
        return time.perf_counter() - t0, values

    def peer() -> list[list[float]]:  # on grpo's computing thread, as a single-threaded script runs it
        return computing.run(plain)

    seconds: dict[str, list[float]] = {"grpo": [], "plain": []}
    values = {}
    for rep in range(args.reps + 1):  # the first of each is a warm-up
        for key, fn in (("grpo", grpo), ("plain", peer)) if rep % 2 == 0 else (("plain", peer), ("grpo", grpo)):
            s, values[key] = timed(fn)
            if rep:
                seconds[key].append(s)
    gaps = [abs(a - b) for x, y in zip(values["grpo"], values["plain"], strict=True) for a, b in zip(x, y, strict=True)]
    tokens = sum(len(s) for s in seqs)
    print(f"# {args.model}, {name}, {args.groups} prompts of {args.prompt_tokens} tokens x {args.group} answers of "
          f"{args.answer_tokens} ({tokens} tokens); {dtype_probe.cpu_description()}; torch {torch.__version__}")
    print("| logprobs of every sequence | median seconds | runs |")
    print("| --- | --- | --- |")
    for key, what in (("grpo", "grpo: compute_logprobs, called together"),
                      ("plain", "plain: a transformers forward per sequence, log_softmax")):
        print(f"| {what} | {statistics.median(seconds[key]):.3f} | {', '.join(f'{s:.3f}' for s in seconds[key])} |")
    print(f"grpo / plain: {statistics.median(seconds['grpo']) / statistics.median(seconds['plain']):.2f}; "
          f"logprobs apart: max {max(gaps):.2e}, median {statistics.median(gaps):.2e}")


if __name__ == "__main__":
    main()
