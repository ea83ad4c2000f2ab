"""Sampling time of multi-turn episodes with the sampler's prefix cache off and on, side by side
(docs/agentic.md records the numbers).

    python -m grpo.tinker_run scripts/prefix_cache_bench.py guess_number [GROUPS GROUP_SIZE MAX_TOKENS]
        the tinker-cookbook's multiplayer guess_number episodes (needs the cookbook on PYTHONPATH,
        e.g. tests/cookbook_helpers.cookbook_overlay(), and SmolLM2 under its hub id in
        $HF_HUB_CACHE), rolled out by the cookbook's own do_group_rollout on one sampling client
        of the base model: once with the cache off, once on, same seed, one process
    python scripts/prefix_cache_bench.py tools [STEPS]
        python -m grpo adapter=tools steps=STEPS batch_size=2 group_size=4 eval_size=0, with
        backend.prefix_cache_mb=0 and =auto; time/sample and the sampler/ metrics per step
    python scripts/prefix_cache_bench.py episodes MODEL [EPISODES TURNS MAX_TOKENS REPLY]
        EPISODES multi-turn episodes of any model (a directory, a packaged name: a random one does,
        e.g. a hybrid from scripts/random_model.py), every episode's turn sent at once as grpo's
        loop sends them: turn k+1 is turn k's context, its MAX_TOKENS sampled tokens (no stop) and
        a REPLY of fixed tokens; through a local sampling client, the cache off, then on

Prints one JSON line per setting and the ratio. The two settings run one after the other on the
same machine; on a shared machine run it more than once.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def guess_number(groups: int, group_size: int, max_tokens: int) -> None:
    import tinker  # grpo, under python -m grpo.tinker_run
    import torch
    from tinker_cookbook.completers import TinkerTokenCompleter
    from tinker_cookbook.recipes.multiplayer_rl.guess_number.env import GuessNumberDatasetBuilder
    from tinker_cookbook.rl.rollouts import do_group_rollout

    async def rollouts(cache_mb: float | str) -> dict:
        service = tinker.ServiceClient(prefix_cache_mb=cache_mb)
        client = service.create_sampling_client(base_model=MODEL)
        builder = GuessNumberDatasetBuilder(batch_size=groups, model_name=MODEL, renderer_name="qwen3_instruct",
                                            train_group_size=group_size)
        train, _ = await builder()
        policy = TinkerTokenCompleter(client, max_tokens=max_tokens)
        torch.manual_seed(0)
        t0 = time.perf_counter()
        done = await asyncio.gather(*[do_group_rollout(b, policy) for b in train.get_batch(0)])
        seconds = time.perf_counter() - t0
        stats = client.sampler_stats()
        service.close()
        turns = sum(len(t.transitions) for g in done for t in g.trajectories_G)
        return {"prefix_cache_mb": cache_mb, "sample_s": round(seconds, 1), "episodes": groups * group_size,
                "turns": turns, "prompt_tokens": int(stats["prompt_tokens"]),
                "prefilled_tokens": int(stats["prefilled_tokens"]),
                "prefix_hit_rate": round(stats["prefix_hit_tokens"] / max(1, stats["prompt_tokens"]), 3)}

    off = asyncio.run(rollouts(0))
    print(json.dumps(off), flush=True)
    on = asyncio.run(rollouts("auto"))
    print(json.dumps(on), flush=True)
    print(json.dumps({"speedup": round(off["sample_s"] / on["sample_s"], 2)}))


def episodes(model: str, count: int, turns: int, max_tokens: int, reply_tokens: int) -> None:
    import torch

    from grpo.backends.local.clients import ServiceClient
    from grpo.types import ModelInput, SamplingParams

    def run(cache_mb: float | str) -> dict:
        service = ServiceClient(prefix_cache_mb=cache_mb)
        client = service.create_sampling_client(base_model=model)
        generator = torch.Generator().manual_seed(0)
        vocab = client.get_tokenizer().vocab_size
        contexts = [torch.randint(100, vocab, (48 + 8 * (i % 4),), generator=generator).tolist() for i in range(count)]
        reply = torch.randint(100, vocab, (reply_tokens,), generator=generator).tolist()
        client.sample(ModelInput.from_ints(list(range(10, 18))), 1, SamplingParams(max_tokens=2)).result()  # (warm)
        before, seconds = client.sampler_stats(), []
        for turn in range(turns):
            t0 = time.perf_counter()
            futures = [client.sample(ModelInput.from_ints(c), 1, SamplingParams(max_tokens=max_tokens, temperature=1.0,
                                                                                 seed=1000 * turn + i))
                       for i, c in enumerate(contexts)]
            sampled = [f.result().sequences[0].tokens for f in futures]
            seconds.append(round(time.perf_counter() - t0, 2))
            contexts = [c + s + reply for c, s in zip(contexts, sampled, strict=True)]
        after = client.sampler_stats()
        service.close()
        return {"prefix_cache_mb": cache_mb, "turn_s": seconds, "sample_s": round(sum(seconds), 2),
                "episodes": count, "context_tokens": sum(len(c) for c in contexts) // count,
                **{key: int(after[key] - before[key]) for key in ("prompt_tokens", "prefilled_tokens", "prefix_hits")}}

    off = run(0)
    print(json.dumps(off), flush=True)
    on = run("auto")
    print(json.dumps(on), flush=True)
    print(json.dumps({"ratio_on_over_off": round(on["sample_s"] / off["sample_s"], 2)}))


def tools(steps: int) -> None:
    results = {}
    for cache_mb in (0, "auto"):
        with tempfile.TemporaryDirectory() as run_dir:
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "grpo", "adapter=tools", f"steps={steps}", "batch_size=2",
                            "group_size=4", "eval_size=0", "report=false", f"backend.prefix_cache_mb={cache_mb}",
                            f"hydra.run.dir={run_dir}"], check=True, capture_output=True)
            wall = time.perf_counter() - t0
            rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
            rows = [r for r in rows if "time/sample" in r]
        results[cache_mb] = {
            "prefix_cache_mb": cache_mb, "wall_s": round(wall, 1),
            "sample_s": [round(r["time/sample"], 1) for r in rows],
            "turns": [r.get("episode/turns") for r in rows],
            "prompt_tokens": [r.get("sampler/prompt_tokens") for r in rows],
            "prefilled_tokens": [r.get("sampler/prefilled_tokens") for r in rows],
            "prefix_hit_rate": [round(r.get("sampler/prefix_hit_rate", 0.0), 3) for r in rows]}
        print(json.dumps(results[cache_mb]), flush=True)
    off, on = (sum(results[k]["sample_s"]) for k in (0, "auto"))
    print(json.dumps({"speedup": round(off / on, 2)}))


if __name__ == "__main__":
    what, *rest = sys.argv[1:] or ["tools"]
    if what == "guess_number":
        guess_number(*(int(x) for x in rest or (4, 4, 16)))
    elif what == "tools":
        tools(int(rest[0]) if rest else 2)
    elif what == "episodes" and rest:
        episodes(rest[0], *(int(x) for x in rest[1:] or (16, 4, 24, 32)))
    else:
        sys.exit("usage: prefix_cache_bench.py guess_number [GROUPS GROUP_SIZE MAX_TOKENS] | tools [STEPS]"
                 " | episodes MODEL [EPISODES TURNS MAX_TOKENS REPLY]")
