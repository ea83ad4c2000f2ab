"""The sampler's packed layouts side by side: oneDNN's and grpo's streaming one (cpu_linear.py), and
in bf16, where grpo's kernels are built with avx512_bf16, the streaming layout's dot-product kernel.

Usage (from the repository root):

    .venv/bin/python scripts/packed_layouts.py                  # the products, 1 to 512 rows
    .venv/bin/python scripts/packed_layouts.py --rows 8 24 --steps 4   # and whole sampling calls
    .venv/bin/python scripts/packed_layouts.py --dtype bf16            # the same in bf16

``products``: the model's Linears and unembedding at its own shapes (SmolLM2-135M: 30 layers'
q/k/v, o, gate/up and down, each layer's weights its own, 539 MB in fp32, 269 in bf16), random weights packed
both ways, each product called once per layer in a pass, as a decoding step reads them; the best of
``--passes`` timed passes per row count, the layouts alternating, and their ratio. A decoding step
carries a few dozen rows, a prefill hundreds.

``--steps N``: N seeded GRPO steps of the bench's shape (8 prompts x 4 samples x 32 tokens, an fp32
trainer) per layout through the local backend, one client per layout, alternating: the sampling call
and its sections per step, and the medians.

``--dtype bf16``: the products in bf16, and the steps' sampler in bf16 (its own copy of the model,
LoRA as side paths: sampler_precision.py); a third column, ``stream_dot``, where the kernels have
avx512_bf16's dot product.
Ratios within one run are what to read: this machine kind's speed drifts between runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

NAMES = {"onednn": "oneDNN packed", "stream": "streaming", "stream_dot": "streaming, bf16 dot products"}


def layouts_of(dtype_name: str) -> tuple[str, ...]:
    """oneDNN's layout and the streaming ones a sampler in ``dtype_name`` could pack in here."""
    from grpo.models import dtype_probe

    return ("onednn", *[layout for layout in dtype_probe.sampler_layouts(dtype_name) if layout != "onednn"])


def product(x, weight):
    """x @ W.T by a packed weight (cpu_linear.packed_product), or by a plain one as F.linear does."""
    import torch

    from grpo.models import cpu_linear

    if weight.is_mkldnn or weight.dim() == 3:
        return cpu_linear.packed_product(x, weight, None)
    return torch.nn.functional.linear(x, weight)


def products(model: str, rows: list[int], passes: int, dtype_name: str = "fp32") -> None:
    import torch

    from grpo import models
    from grpo.models import cpu_linear
    from grpo.models.dtype_probe import Shapes

    shapes = Shapes.from_config(models.load_config(model))
    h, i, q, kv = shapes.hidden, shapes.intermediate, shapes.q_out, shapes.kv_out
    layer = [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]  # as the sampler stacks them: q/k/v, o, gate/up, down
    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    layouts = layouts_of(dtype_name)
    dense = [torch.empty(shape).uniform_(-0.05, 0.05).to(dtype) for _ in range(shapes.layers) for shape in layer]
    dense.append(torch.empty(shapes.vocab, h).uniform_(-0.05, 0.05).to(dtype))
    # (where oneDNN packs no bf16 weight -- a CPU without avx512 -- the sampler keeps the plain weight)
    packed = {layout: [cpu_linear.pack_weight(w, layout) if cpu_linear.can_pack(w, layout) else w for w in dense]
              for layout in layouts}
    fan_ins = [w.shape[1] for w in dense]
    elements = sum(w.numel() for w in dense)
    nbytes, flops_per_row = elements * dense[0].element_size(), 2 * elements
    del dense
    print(f"# {model}: {len(packed['onednn'])} products, {nbytes / 1e6:.0f} MB of {dtype_name} weights a pass; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    first = NAMES["onednn"] if any(w.is_mkldnn for w in packed["onednn"]) else "plain (oneDNN packs none here)"
    others = layouts[1:]
    print(f"| rows | {first} | {' | '.join(NAMES[layout] for layout in others)} | "
          f"{' | '.join(f'{first.split()[0]} / {NAMES[layout]}' for layout in others)} |")
    print("| --- " * (2 + 2 * len(others)) + "|")
    with torch.inference_mode():
        for m in rows:
            inputs = {n: torch.randn(m, n).to(dtype) for n in set(fan_ins)}
            best = {layout: float("inf") for layout in layouts}
            for _ in range(passes):
                for layout in layouts:
                    start = time.perf_counter()
                    for w, fan_in in zip(packed[layout], fan_ins, strict=True):
                        product(inputs[fan_in], w)
                    best[layout] = min(best[layout], time.perf_counter() - start)
            o = best["onednn"]
            streamed = " | ".join(f"{best[layout] * 1e3:.1f} ms ({m * flops_per_row / best[layout] / 1e9:.0f} GFLOP/s, "
                                  f"{nbytes / best[layout] / 1e9:.1f} GB/s)" for layout in others)
            print(f"| {m} | {o * 1e3:.1f} ms ({m * flops_per_row / o / 1e9:.0f} GFLOP/s) | {streamed} | "
                  f"{' | '.join(f'{o / best[layout]:.2f}' for layout in others)} |")


def steps(model: str, count: int, dtype_name: str = "fp32") -> None:
    from bench import make_problems, timed_trainable_step

    from grpo.backends.local import ServiceClient, sections
    from grpo.models import kernel_probe
    from grpo.types import AdamParams, SamplingParams

    # one client per layout (an fp32 trainer; the sampler in ``dtype_name``), each packing its
    # sampler in its layout, as on a machine that measured that layout faster
    clients = {}
    layouts = layouts_of(dtype_name)
    for layout in layouts:
        kernel_probe.decoding_layout = lambda shapes, dtype=None, layout=layout: layout
        clients[layout] = ServiceClient(device="cpu", train_dtype="fp32", sample_dtype=dtype_name
                                        ).create_lora_training_client(model, rank=16, seed=0, train_unembed=False)
    tokenizer = clients["onednn"].get_tokenizer()
    adam = AdamParams(learning_rate=2e-5, grad_clip_norm=1.0)
    params = SamplingParams(max_tokens=32, temperature=1.0, seed=1, stop=[tokenizer.eos_token_id])

    def step(tc, seed: int) -> tuple[dict, dict]:
        problems = make_problems(8, seed=seed)
        prompts = [tokenizer.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False) for p in problems]
        with sections.recording() as (seconds, _):
            _, timing = timed_trainable_step(tc, problems, prompts, 4, params, tokenizer, adam)
        return timing, dict(seconds)

    for tc in clients.values():
        step(tc, 100)  # warm-up
    calls: dict[str, list[float]] = {layout: [] for layout in layouts}
    print(f"\n{dtype_name} sampler, fp32 trainer\n\n| step | layout | sampling call | decoding forward | prefill | "
          "installing LoRA |")
    print("| --- | --- | --- | --- | --- | --- |")
    for seed in range(count):
        for layout, tc in clients.items():
            timing, seconds = step(tc, seed)
            calls[layout].append(timing["sample_s"])
            print(f"| {seed} | {layout} | {timing['sample_s']:.2f} s | {seconds.get('grpo.sample.decode_forward', 0):.3f} s"
                  f" | {seconds.get('grpo.sample.prefill', 0):.3f} s | {seconds.get('grpo.sample.install_lora', 0):.3f} s |")
    medians = {layout: statistics.median(v) for layout, v in calls.items()}
    print("\nsampling call, median: " + ", ".join(f"{NAMES[layout]} {medians[layout]:.2f} s" for layout in layouts)
          + "; " + ", ".join(f"{NAMES[layout]} / oneDNN {medians[layout] / medians['onednn']:.2f}" for layout in layouts[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 24, 32, 48, 64, 128, 256, 512])
    parser.add_argument("--passes", type=int, default=9, help="timed passes per layout and row count")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="the weights' and inputs' dtype")
    parser.add_argument("--steps", type=int, default=0, help="also time this many GRPO steps per layout")
    args = parser.parse_args()

    from grpo.models import computing, cpu_linear

    if not computing.run(cpu_linear.stream_available):
        raise SystemExit("grpo's native kernels are not built here (no compiler, or GRPO_NATIVE_KERNELS=off): "
                         "there is no streaming layout to compare")
    # on grpo's computing thread, where its kernels run: products timed on this thread would leave a
    # second OpenMP team in the process, which slows every later kernel of grpo's (computing.py)
    computing.run(products, args.model, args.rows, args.passes, args.dtype)
    if args.steps:
        steps(args.model, args.steps, args.dtype)


if __name__ == "__main__":
    main()
