"""Peak memory of the chat judge for one default training step, reading only the positions it
needs (now) against full-vocabulary logits at every position (before).

    python scripts/judge_memory.py [judge_model]      # default smollm2; prints one line per mode

Each mode runs in its own fresh process (peak RSS never goes down within one): load the judge,
warm its prefix cache, note RSS, then judge a default chat step (8 prompts x a group of 4: 96
comparisons in batches of 32, responses ~64 tokens) and note the peak.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def one_mode(model: str, lean: bool) -> dict[str, float]:
    from adapters.chat_prompts import builtin_prompts
    from adapters.judge import PairwiseJudge

    judge = PairwiseJudge(model, device="cpu", batch_size=32)
    judge.read_only_needed_positions = lean
    judge.prob_a(["Say hi."], ["Hi."], ["Hello."])  # model loaded, prefix cached
    before = rss_mb()
    words = "the quick brown fox jumps over a lazy dog while birds sing".split()
    for k, prompt in enumerate(builtin_prompts()[:8]):
        group = [" ".join(words[(k + i + j) % len(words)] for j in range(48)) + "." for i in range(4)]
        judge.win_rates(prompt, group)
    return {"rss_after_load_mb": before, "peak_rss_mb": peak_mb(), "peak_increase_mb": peak_mb() - before}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print(json.dumps(one_mode(sys.argv[2], sys.argv[3] == "lean")))
        return
    model = sys.argv[1] if len(sys.argv) > 1 else "smollm2"
    for mode in ("full", "lean"):
        out = subprocess.run([sys.executable, __file__, "--child", model, mode], capture_output=True, text=True,
                             check=True).stdout.strip().splitlines()[-1]
        found = json.loads(out)
        label = {"full": "full logits at every position (before)", "lean": "only the read positions (now)"}[mode]
        print(f"{label:42s} peak RSS {found['peak_rss_mb']:7.0f} MB, "
              f"+{found['peak_increase_mb']:.0f} MB over the loaded judge ({found['rss_after_load_mb']:.0f} MB)")


if __name__ == "__main__":
    main()
