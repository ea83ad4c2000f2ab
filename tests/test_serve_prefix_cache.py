"""grpo.serve's sampler keeps its prefix cache across requests: a Tinker client sampling turn after
turn on one sampling session (each turn's prompt = the last one + what was sampled + a reply)
prefills only the new tokens, the session's stats route shows the hits, and ``--prefix-cache-mb 0``
turns it off. A real server with the tiny model, spoken to as the SDK does (asample, futures)."""

from __future__ import annotations

import pytest
from serve_helpers import served_tiny_model, wait

pytest.importorskip("fastapi")

PROMPT = list(range(5, 45))
REPLY = [101, 102, 103, 104, 105, 106]


def sample(env, tokens: list[int]) -> dict:
    status, body = env["srv"].call("POST", "/api/v1/asample", {
        "sampling_session_id": env["sampler"], "num_samples": 1, "prompt": {"chunks": [{"tokens": tokens}]},
        "sampling_params": {"temperature": 0.0, "max_tokens": 6}})
    assert status == 200, body
    result = wait(env["srv"], body["request_id"])
    assert result.get("type") == "sample", result
    return result["sequences"][0]


def stats(env) -> dict:
    status, body = env["srv"].call("GET", f"/api/v1/samplers/{env['sampler']}/stats")
    assert status == 200, body
    return body


def play(env, turns: int = 3) -> tuple[list[dict], list[dict]]:
    """Turns of one conversation; the sampler's stats after each."""
    context, sequences, after = list(PROMPT), [], []
    for _ in range(turns):
        seq = sample(env, context)
        sequences.append(seq)
        after.append(stats(env))
        context = context + seq["tokens"] + REPLY
    return sequences, after


def test_turn_after_turn_on_one_session_hits_the_cache(tmp_path):
    with served_tiny_model(tmp_path) as env:
        sequences, after = play(env)
        assert after[0]["prefix_hits"] == 0 and after[0]["prefilled_tokens"] == len(PROMPT)
        for turn in (1, 2):
            hits = after[turn]["prefix_hit_tokens"] - after[turn - 1]["prefix_hit_tokens"]
            prefilled = after[turn]["prefilled_tokens"] - after[turn - 1]["prefilled_tokens"]
            # everything but the last sampled token (never fed back) and the reply was cached
            assert after[turn]["prefix_hits"] == turn and prefilled == 1 + len(REPLY)
            assert hits == len(PROMPT) + sum(len(s["tokens"]) + len(REPLY) for s in sequences[:turn]) - len(REPLY) - 1
        assert after[-1]["prefix_cache_bytes"] > 0
    with served_tiny_model(tmp_path / "off", ("--prefix-cache-mb", "0")) as env:
        uncached, off = play(env)
        assert off[-1]["prefix_hits"] == 0 and off[-1]["prefix_cache_bytes"] == 0
        assert off[-1]["prefilled_tokens"] == off[-1]["prompt_tokens"]
    # the same turns either way, the same numbers to fp32 rounding
    for a, b in zip(sequences, uncached, strict=True):
        assert a["tokens"] == b["tokens"]
        assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True)) <= 1e-5
