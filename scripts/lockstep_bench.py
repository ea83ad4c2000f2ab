"""A hybrid's sampling call with its requests joining the running batch as rows finish (continuous
batching, grpo/backends/local/recurrent_sampler.py) against its batches run one after another, in
one process, alternating (docs/benchmark.md records the numbers).

    python scripts/lockstep_bench.py MODEL [PROMPTS GROUP MAX_TOKENS STOP_SHARE BUDGET_MB REPEATS]

MODEL: a directory or a packaged name (a random hybrid from ``scripts/random_model.py OUT --shape
qwen3.5-0.8b`` does). One GRPO sampling call: PROMPTS prompts of 40-70 tokens, GROUP samples each,
at most MAX_TOKENS tokens a row, each row stopping at any of a STOP_SHARE of the vocabulary (so
that, as with a real model's end of answer, rows finish apart: a random model never says it is
done); through a local sampling client whose memory budget is BUDGET_MB ("auto": grpo's default,
a sixteenth of the machine's memory), which sets how many rows decode at once. Prints one JSON
line a call and the ratio of the medians (joining / one after another).
"""

from __future__ import annotations

import json
import statistics
import sys
import time


def main(model: str, prompts: int = 16, group: int = 4, max_tokens: int = 96, stop_share: float = 1 / 48,
         budget_mb: str = "auto", repeats: int = 2) -> None:
    import torch

    from grpo.backends.local import recurrent_sampler
    from grpo.backends.local.clients import ServiceClient
    from grpo.types import ModelInput, SamplingParams

    service = ServiceClient(memory_budget_mb=budget_mb if budget_mb == "auto" else float(budget_mb),
                            prefix_cache_mb=0)
    client = service.create_sampling_client(base_model=model)
    vocab = client.get_tokenizer().vocab_size
    generator = torch.Generator().manual_seed(0)
    contexts = [torch.randint(100, vocab, (40 + (7 * i) % 31,), generator=generator).tolist() for i in range(prompts)]
    stop = torch.randperm(vocab - 100, generator=generator)[:max(1, round(stop_share * vocab))].add(100).tolist()
    client.sample(ModelInput.from_ints(list(range(10, 18))), 1, SamplingParams(max_tokens=2)).result()  # (warm)

    def call(join: bool) -> dict:
        recurrent_sampler.JOIN_RUNNING_BATCH = join
        before = client.sampler_stats()
        t0 = time.perf_counter()
        futures = [client.sample(ModelInput.from_ints(c), group, SamplingParams(
            max_tokens=max_tokens, temperature=1.0, seed=i, stop=stop)) for i, c in enumerate(contexts)]
        lengths = [len(s.tokens) for f in futures for s in f.result().sequences]
        seconds = time.perf_counter() - t0
        after = client.sampler_stats()
        done = {key: int(after[key] - before[key]) for key in ("admissions", "decode_steps", "rows_decoded")}
        return {"join": join, "sample_s": round(seconds, 2), "rows": len(lengths), "tokens": sum(lengths),
                "longest": max(lengths), **done, "rows_a_step": round(done["rows_decoded"] / done["decode_steps"], 1),
                "peak_rows": int(after["peak_rows"])}

    runs = []
    for _ in range(repeats):
        for join in (True, False):
            runs.append(call(join))
            print(json.dumps(runs[-1]), flush=True)
    service.close()
    joined, apart = (statistics.median(r["sample_s"] for r in runs if r["join"] is join) for join in (True, False))
    print(json.dumps({"ratio_joining_over_one_after_another": round(joined / apart, 2)}))


if __name__ == "__main__":
    model, *rest = sys.argv[1:]
    kinds = (int, int, int, float, str, int)
    main(model, *(kind(value) for kind, value in zip(kinds, rest, strict=False)))
