"""Running multi-turn episodes for an AgentAdapter, batched turn by turn.

Turn 1 of every episode of a wave goes out as one ``sample`` request per prompt with
``num_samples`` = the group size (the group shares its prompt's prefill, as single-turn
sampling does). Every later turn of every live episode is one request on that episode's whole
context; all requests of a turn are issued before any is awaited, so the local backend batches
them into one generation and a remote service runs them in parallel. Between turns, the
environment answers every episode that called it, all at once, on the adapter's bounded pool of
``tool_workers`` threads, each call under ``tool_timeout_s`` (grpo/rl/tool_pool.py): a hanging
tool costs its time limit and holds one worker until it returns, never the run.

Joining an observation to the turn before it. The trainer sees exactly the tokens the sampler
produced, and the sampler keeps the whole token that completes a stop string: SmolLM2 has a
single ``><`` token, so a turn closing ``</calc>`` may end on ``</calc><``. The text after the
turn's first stop string is its *overhang*. An ``inline`` observation whose text starts with the
overhang drops that prefix (``</calc><`` + ``result>2077</result>`` reads
``</calc><result>2077</result>``); any other overhang stays and the observation follows it. A
``chat``/``user`` observation leaves the overhang in the model's message; after a turn that ended
on its end-of-message token (EOS), it does not close the message a second time.

The context only ever grows by appending tokens (model tokens as sampled, observation tokens as
rendered), so turn k's context is a token prefix of turn k+1's and one Datum covers the whole
episode: observation tokens are marked 0 in ``Rollout.mask`` and carry weight 0, logprob 0 and
advantage 0 (grpo.rl.advantages.build_datum).

How an episode ends (``Episode.end_reason``):
  done        the environment returned None (the model answered without calling a tool)
  max_turns   ``max_turns`` model turns were sampled; what the last one wrote is the answer
  length      a model turn hit the loop's per-turn ``max_tokens`` (counts as truncated)
  context     the next turn or observation would pass ``max_context_tokens`` (counts as truncated)
  tool_error  an environment call failed and ``tool_errors="end"``
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from grpo.api.protocols import SamplingClient
from grpo.rl.adapter import RLAdapter
from grpo.rl.agent import AgentAdapter, Episode, Turn
from grpo.rl.rollouts import Rollout, sample_groups
from grpo.rl.tool_pool import pool_for
from grpo.types import ModelInput, SamplingParams

DEFAULT_TURN_TOKENS = 256  # a turn's max_tokens when the loop's SamplingParams leave it unset
END_REASONS = ("done", "max_turns", "length", "context", "tool_error")
TRUNCATING_ENDS = ("length", "context")  # the episode was cut, as a single-turn "length" stop


@dataclass
class _Live:
    """An episode while it runs. ``context`` is what the next turn is sampled after: the prompt and
    every token since, unless the environment rebuilt it (then a new segment starts there)."""

    prompt: list[int]
    sample_index: int
    context: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    end_reason: str | None = None
    segments: list[tuple[list[int], Rollout]] = field(default_factory=list)  # closed ones
    segment_context: list[int] = field(default_factory=list)  # the open segment's starting context
    segment_start: int = 0  # where the open segment begins in ``tokens``
    overhang: str = ""  # the last model turn's text after its first stop string (see the module doc)
    closed: bool = False  # the last model turn ended on a stop token id (its end-of-message token)

    def __post_init__(self) -> None:
        self.context = list(self.prompt)
        self.segment_context = list(self.prompt)

    def add(self, tokens: Sequence[int], logprobs: Sequence[float] | None, turn: Turn) -> None:
        self.context.extend(tokens)
        self.tokens.extend(tokens)
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(tokens))
        self.mask.extend([1 if logprobs is not None else 0] * len(tokens))
        self.turns.append(turn)

    def restart(self, context: list[int], turn: Turn) -> None:
        """The environment rebuilt the context so that it no longer extends the last one: close
        the open segment (its own Datum) and continue from ``context``."""
        self.segments.append(self._open_segment())
        self.context, self.segment_context, self.segment_start = list(context), list(context), len(self.tokens)
        self.turns.append(turn)

    def _open_segment(self) -> tuple[list[int], Rollout]:
        s = self.segment_start
        return self.segment_context, Rollout(tokens=self.tokens[s:], logprobs=self.logprobs[s:], stop_reason="stop",
                                             text="", mask=tuple(self.mask[s:]))

    def rollout(self, tools_stuck: int = 0) -> Rollout:
        episode = Episode(tuple(self.turns), self.end_reason or "done", len(self.prompt), len(self.context),
                          tools_stuck=tools_stuck)
        segments = tuple([*self.segments, self._open_segment()]) if self.segments else None
        return Rollout(tokens=list(self.tokens), logprobs=list(self.logprobs),
                       stop_reason="length" if episode.end_reason in TRUNCATING_ENDS else "stop",
                       text=episode.transcript, mask=tuple(self.mask), episode=episode, segments=segments)


# --------------------------------------------------------------------------- entry points


def sample_rollouts(sampling_client: SamplingClient, adapter: RLAdapter, items: Sequence[Any],
                    prompts: Sequence[list[int]], num_samples: int, params_for: Callable[[int], SamplingParams],
                    tokenizer: Any) -> list[list[Rollout]]:
    """``num_samples`` rollouts per prompt: episodes for an AgentAdapter, single completions
    (grpo.rl.rollouts.sample_groups) for any other adapter."""
    if isinstance(adapter, AgentAdapter):
        return run_episodes(sampling_client, adapter, items, prompts, num_samples, params_for, tokenizer)
    return sample_groups(sampling_client, prompts, num_samples, params_for, tokenizer)


def run_episodes(sampling_client: SamplingClient, adapter: AgentAdapter, items: Sequence[Any],
                 prompts: Sequence[list[int]], num_samples: int, params_for: Callable[[int], SamplingParams],
                 tokenizer: Any) -> list[list[Rollout]]:
    """Run ``num_samples`` episodes per prompt to their end; each turn batched over all episodes."""
    adapter.check_agent_config()
    groups = [[_Live(list(p), j) for j in range(num_samples)] for p in prompts]
    params = [params_for(i) for i in range(len(prompts))]
    for turn in range(adapter.max_turns):
        live = [(i, ep) for i, group in enumerate(groups) for ep in group if ep.end_reason is None]
        if not live:
            break
        sampled = _sample_turn(sampling_client, adapter, groups, live, params, turn, tokenizer)
        if turn + 1 == adapter.max_turns:  # the last turn's text is the answer, whatever it asks for
            for _, ep in sampled:
                if ep.end_reason is None:
                    ep.end_reason = "max_turns"
            break
        _observe(adapter, [(i, ep) for i, ep in sampled if ep.end_reason is None], items, tokenizer)
    stuck = pool_for(adapter).stuck()
    return [[ep.rollout(stuck) for ep in group] for group in groups]


# --------------------------------------------------------------------------- one model turn


def _turn_seed(seed: int | None, turn: int, sample_index: int) -> int | None:
    """Turn 1 uses the group's seed (one request for the group); later turns, one request per
    episode, derive theirs from it, the turn and the episode, so a rerun draws the same tokens."""
    if seed is None or turn == 0:
        return seed
    return (seed * 1_000_003 + turn * 10_007 + sample_index * 101 + 1) % (2**31 - 1)


def _sample_turn(client: SamplingClient, adapter: AgentAdapter, groups: list[list[_Live]],
                 live: list[tuple[int, _Live]], params: list[SamplingParams], turn: int,
                 tokenizer: Any) -> list[tuple[int, _Live]]:
    """Sample one turn of every live episode (requests all in flight before any is awaited);
    return the episodes that got a turn."""
    requests: list[tuple[list[tuple[int, _Live]], Any, int, SamplingParams]] = []
    for i in range(len(groups)):
        mine = [(gi, ep) for gi, ep in live if gi == i]
        if not mine:
            continue
        batches = [mine] if turn == 0 else [[x] for x in mine]  # turn 1: the group shares its prompt
        for batch in batches:
            ep = batch[0][1]
            room = adapter.max_context_tokens - len(ep.context)
            if room <= 0:
                for _, e in batch:
                    e.end_reason = "context"
                continue
            wanted = params[i].max_tokens or DEFAULT_TURN_TOKENS
            p = dataclasses.replace(params[i], max_tokens=min(wanted, room),
                                    seed=_turn_seed(params[i].seed, turn, ep.sample_index))
            future = client.sample(prompt=ModelInput.from_ints(ep.context), num_samples=len(batch), sampling_params=p)
            requests.append((batch, future, wanted, p))
    t0 = time.perf_counter()
    results = [(batch, future.result(), wanted, p) for batch, future, wanted, p in requests]
    seconds = time.perf_counter() - t0
    done: list[tuple[int, _Live]] = []
    for batch, response, wanted, p in results:
        stop_strings, stop_ids = p.stop_strings_and_ids()
        for (i, ep), seq in zip(batch, response.sequences, strict=True):
            tokens = list(seq.tokens)
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            ep.add(tokens, [float(x) for x in (seq.logprobs or [0.0] * len(tokens))],
                   Turn("model", text, len(tokens), seconds, stop_reason=seq.stop_reason))
            stopped = seq.stop_reason == "stop" and bool(tokens)
            ep.closed = stopped and tokens[-1] in stop_ids
            ep.overhang = _overhang(tokens, stop_strings, tokenizer) if stopped and not ep.closed else ""
            if seq.stop_reason == "length":
                ep.end_reason = "length" if len(tokens) >= wanted else "context"
            done.append((i, ep))
    return done


# --------------------------------------------------------------------------- the environment


def _overhang(tokens: list[int], stop_strings: list[str], tokenizer: Any) -> str:
    """The turn's text after the first stop string it contains: what the token that completed the
    stop string wrote beyond it (``<`` of SmolLM2's ``><``); "" when it ends exactly there."""
    text = tokenizer.decode(tokens, skip_special_tokens=False)
    ends = [text.index(s) + len(s) for s in stop_strings if s and s in text]
    return text[min(ends):] if ends else ""


def _observe(adapter: AgentAdapter, episodes: list[tuple[int, _Live]], items: Sequence[Any], tokenizer: Any) -> None:
    """Run the environment for every episode at once on the adapter's tool pool, each call under
    ``tool_timeout_s``, and append each observation (or end the episode)."""
    pool = pool_for(adapter)
    calls = []
    for i, ep in episodes:
        text = ep.turns[-1].text
        snapshot = _snapshot(ep)
        try:
            requested = adapter.find_tool_call(text)
        except Exception:  # noqa: BLE001 - a faulty parser is the observe call's to report, not a crash
            requested = None
        call = pool.submit(lambda text=text, item=items[i], snapshot=snapshot: adapter.observe(text, item, snapshot))
        calls.append((ep, call, requested))
    for ep, call, requested in calls:
        failed = pool.wait(call)
        name, argument = requested if requested else (None, None)
        result = ""
        if failed == "timeout":
            error, seconds = f"timed out after {adapter.tool_timeout_s:g} s", adapter.tool_timeout_s
        elif failed == "unavailable":
            error, seconds = (f"tool unavailable: all {pool.workers} tool workers are still running calls that "
                              f"timed out"), 0.0
        else:
            error, seconds = call.error, call.seconds
            if error is None:
                if call.value is None:  # the environment ends the episode
                    ep.end_reason = "done"
                    continue
                result, error = _as_text(call.value, adapter.max_observation_chars)
        if error is not None and adapter.tool_errors == "end":
            ep.turns.append(Turn("observation", "", 0, seconds, tool=name, tool_input=argument, error=error))
            ep.end_reason = "tool_error"
            continue
        # an error shows its message, except a cut output, which shows what was kept
        text, tokens = _render_after_turn(adapter, ep, adapter.format_observation(result or error or "",
                                                                                  error is not None and not result),
                                          tokenizer)
        turn = Turn("observation", text, len(tokens), seconds, tool=name, tool_input=argument, error=error)
        rebuilt = adapter.rebuild_context(ep.prompt, _snapshot(ep, turn), tokenizer)
        if rebuilt is not None and list(rebuilt[:len(ep.context)]) == ep.context:
            tokens, rebuilt = list(rebuilt[len(ep.context):]), None  # still a prefix: append the rest
            turn = dataclasses.replace(turn, num_tokens=len(tokens))
        if len(rebuilt if rebuilt is not None else ep.context + tokens) >= adapter.max_context_tokens:
            ep.turns.append(dataclasses.replace(turn, text="", num_tokens=0,
                                                error=error or "observation does not fit in max_context_tokens"))
            ep.end_reason = "context"
        elif rebuilt is not None:
            ep.restart(list(rebuilt), dataclasses.replace(turn, num_tokens=0))
        else:
            ep.add(tokens, None, turn)


def _render_after_turn(adapter: AgentAdapter, ep: _Live, text: str, tokenizer: Any) -> tuple[str, list[int]]:
    """The observation's text as it reads in the context, and its tokens, joined to how the model's
    turn ended (module doc): an inline text drops the overhang the model already wrote; a chat/user
    message does not close again a message the turn closed with its end-of-message token."""
    inline = adapter.observation_style == "inline"
    if inline and ep.overhang and text.startswith(ep.overhang):
        text = text[len(ep.overhang):]
    tokens = adapter.render_observation(text, tokenizer)
    if not inline and ep.closed and tokens and tokens[0] == ep.tokens[-1]:
        tokens = tokens[1:]
    return text, tokens


def _snapshot(ep: _Live, *more: Turn) -> Episode:
    return Episode((*ep.turns, *more), "running", len(ep.prompt), len(ep.context))


def _as_text(value: Any, limit: int) -> tuple[str, str | None]:
    """A tool's return value as observation text, with an error when it is not text or a number
    (garbage) or longer than ``limit`` characters (cut)."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return "", f"tool returned {type(value).__name__}, not text"
    if isinstance(value, float) and not math.isfinite(value):
        return "", f"tool returned {value}"
    text = value if isinstance(value, str) else f"{value:g}" if isinstance(value, float) else str(value)
    if len(text) > limit:
        return text[:limit], f"output cut at {limit} of {len(text)} characters"
    return text, None


# --------------------------------------------------------------------------- metrics


def episode_metrics(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """Per-step episode statistics (empty when no rollout is an episode): turns and tool calls per
    episode, the tool error rate, context length, time per model turn and per tool call, and how
    episodes ended."""
    episodes = [r.episode for r in rollouts if isinstance(r.episode, Episode)]
    if not episodes:
        return {}
    n = len(episodes)
    calls = sum(e.tool_calls for e in episodes)
    replies = sum(e.observations for e in episodes)
    model_turns = [t for e in episodes for t in e.turns if t.role == "model"]
    obs_turns = [t for e in episodes for t in e.turns if t.role == "observation"]
    call_seconds = {t.seconds for t in model_turns}
    metrics = {
        "episode/turns": sum(e.model_turns for e in episodes) / n,
        # calls of a declared tool; observations: every environment reply, tool results included
        "episode/tool_calls": calls / n,
        "episode/observations": replies / n,
        "episode/tool_error_rate": sum(e.tool_errors for e in episodes) / calls if calls else 0.0,
        "episode/observation_error_rate": sum(e.observation_errors for e in episodes) / replies if replies else 0.0,
        "episode/context_tokens": sum(e.context_tokens for e in episodes) / n,
        "episode/max_context_tokens": float(max(e.context_tokens for e in episodes)),
        "episode/observation_tokens": sum(t.num_tokens for t in obs_turns) / n,
        # environment calls still running past their time limit (threads held by hung tools)
        "episode/tools_stuck": float(max(e.tools_stuck for e in episodes)),
        # one batched sampling call per turn (its wall time is shared by the turns it sampled)
        "time/turn": sum(call_seconds) / max(1, len(call_seconds)),
        "time/tool_call": sum(t.seconds for t in obs_turns) / len(obs_turns) if obs_turns else 0.0,
    }
    for reason in END_REASONS:
        metrics[f"episode/end_{reason}"] = sum(e.end_reason == reason for e in episodes) / n
    return metrics
