"""The AgentAdapter protocol: an RLAdapter whose rollouts are multi-turn episodes with tools.

An episode is: prompt ▸ model turn ▸ observation ▸ model turn ▸ ... ▸ end. A model turn ends at
a stop sequence (a tool call's closing tag, or end of turn). The adapter's environment
(``observe``) turns the turn's text into an observation (a tool result, a user reply) or ends
the episode by returning None; the observation is appended to the context *as tokens*, so the
trainer sees exactly the tokens the sampler saw, and observation tokens get weight 0.

A tool task needs the RLAdapter's methods plus ``tools()``::

    class Calculator(AgentAdapter):
        def build_dataset(self): return [{"q": "What is 37 * 48?", "a": 1776}, ...]
        def make_prompt(self, sample, tokenizer): return chat_prompt_tokens(tokenizer, [...])
        def tools(self): return {"calc": lambda expr: str(eval_arithmetic(expr))}
        def compute_reward(self, response, sample): return float(str(sample["a"]) in response)

The model calls a tool by writing ``<calc>37*48</calc>``; the environment runs it on a bounded
pool of threads (``tool_workers``, grpo/rl/tool_pool.py) with a time limit (``tool_timeout_s``)
and answers ``<result>1776</result>``. A tool that declares a ``sample`` parameter also gets the
dataset item. A tool that raises, hangs or returns something that is not text becomes an error
observation the model can read (or ends the episode, with ``tool_errors="end"``), is counted in
the trace, and never takes training down. ``compute_reward`` scores the final model turn;
``episode_reward`` adds the process terms (``tool_call_cost`` per tool call by default) and may
read the whole trace.

Limits (attributes, or constructor arguments of a subclass): ``max_turns`` model turns per
episode; the loop's ``max_tokens`` per model turn; ``max_context_tokens`` for prompt + episode
(a turn never samples past it, and an observation that does not fit ends the episode with
``end_reason="context"``); ``tool_timeout_s`` per environment call.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from grpo.checks import ConfigError, check, check_choice
from grpo.rl.adapter import RLAdapter

# Where an observation lands (render_observation): inline continues the model's text; chat and user
# close the model's message and add a tool / user message in the chat template.
OBSERVATION_STYLES = ("inline", "chat", "user")
TOOL_ERROR_POLICIES = ("observe", "end")


AgentConfigError = ConfigError  # the one error class of grpo.checks, under the name agents import


# --------------------------------------------------------------------------- what an episode was
# The trace an AgentAdapter is handed (episode_reward) and rollouts.jsonl records; grpo/rl/episodes.py
# builds it.


@dataclass(frozen=True)
class Turn:
    """One step of an episode's trace: a model turn or an observation."""

    role: str  # "model" | "observation"
    text: str
    num_tokens: int
    seconds: float  # model: the turn's batched sampling call; observation: the environment call
    stop_reason: str | None = None  # model turns: "stop" | "length"
    tool: str | None = None  # observation: the declared tool the model called (None: another environment reply)
    tool_input: str | None = None
    error: str | None = None  # observation: why the environment call failed, if it did

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True)
class Episode:
    """The trace of one episode, what ``episode_reward`` reads and rollouts.jsonl records."""

    turns: tuple[Turn, ...]
    end_reason: str
    prompt_tokens: int
    context_tokens: int  # prompt + every turn and observation at the end
    # environment calls still running past their time limit when the episode ended: threads held
    # by tools that never returned (the adapter's pool, shared by its episodes; at most tool_workers)
    tools_stuck: int = 0

    @property
    def model_turns(self) -> int:
        return sum(t.role == "model" for t in self.turns)

    @property
    def observations(self) -> int:
        """Every environment reply: tool results and anything else ``observe`` answered."""
        return sum(t.role == "observation" for t in self.turns)

    @property
    def tool_calls(self) -> int:
        """Observations that answered a call of a declared tool (``Turn.tool`` set)."""
        return sum(t.role == "observation" and t.tool is not None for t in self.turns)

    @property
    def tool_errors(self) -> int:
        """Tool calls that failed (raised, timed out, returned garbage, output cut)."""
        return sum(t.role == "observation" and t.tool is not None and t.error is not None for t in self.turns)

    @property
    def observation_errors(self) -> int:
        """Environment replies of any kind that failed (tool calls included)."""
        return sum(t.role == "observation" and t.error is not None for t in self.turns)

    @property
    def final_text(self) -> str:
        """The last model turn's text: the answer ``compute_reward`` scores."""
        return next((t.text for t in reversed(self.turns) if t.role == "model"), "")

    @property
    def transcript(self) -> str:
        return "".join(t.text for t in self.turns)

    def to_json(self) -> dict[str, Any]:
        return {"end_reason": self.end_reason, "prompt_tokens": self.prompt_tokens,
                "context_tokens": self.context_tokens, "turns": [t.to_json() for t in self.turns]}


class ToolError(Exception):
    """Raised by a tool (or the environment) to hand the model an error message as observation."""


class AgentAdapter(RLAdapter):
    """An RLAdapter whose rollouts are episodes: model turns interleaved with observations."""

    max_turns: int = 4  # model turns per episode; after the last one the episode ends
    max_context_tokens: int = 2048  # prompt + every turn and observation
    tool_timeout_s: float = 5.0  # wall clock per environment call (tool run); then an error observation
    tool_workers: int = 32  # threads that run environment calls; a hung tool holds one (grpo/rl/tool_pool.py)
    tool_call_cost: float = 0.0  # subtracted from the reward per tool call (episode_reward's default)
    max_observation_chars: int = 2000  # longer tool output is cut and counted as an error
    observation_style: str = "inline"  # inline: right after the model's text; chat: a tool message; user: a user message
    tool_errors: str = "observe"  # observe: the error is the observation; end: it ends the episode

    # ------------------------------------------------------------------ tools and environment

    def tools(self) -> Mapping[str, Callable[..., Any]]:
        """Tools by name. The model calls one by writing ``<name>input</name>``; the function gets
        the input text, and the dataset item as ``sample=`` when it declares a parameter of that
        name (a per-problem secret or database), and returns the result (text or a number)."""
        return {}

    def stop_strings(self) -> Sequence[str]:
        """Strings that end a model turn besides the tools' closing tags (which stop it already),
        so an environment without tools can answer there, e.g. ``["</guess>"]`` for ``observe``."""
        return ()

    def find_tool_call(self, text: str) -> tuple[str, str] | None:
        """The (tool name, input) the model's turn asks for, or None when it calls no tool (its
        final answer). Default: the last complete ``<name>...</name>`` of a known tool."""
        names = [re.escape(n) for n in self.tools()]
        if not names:
            return None
        calls = re.findall(rf"<({'|'.join(names)})>(.*?)</\1>", text, flags=re.S)
        return (calls[-1][0], calls[-1][1].strip()) if calls else None

    def observe(self, text: str, sample: Any, episode: Episode) -> str | None:
        """The environment: the observation that answers the model's turn ``text``, or None to end
        the episode. Runs in a worker thread under ``tool_timeout_s``; raising (ToolError or
        anything else) gives an error observation. Default: run the tool the turn calls."""
        call = self.find_tool_call(text)
        if call is None:
            return None
        name, argument = call
        return call_tool(self.tools()[name], argument, sample)

    def format_observation(self, result: str, error: bool) -> str:
        """The text the model reads for a tool result (or an error message)."""
        return f"<result>{'error: ' if error else ''}{result}</result>"

    def render_observation(self, text: str, tokenizer: Any) -> list[int]:
        """Tokens appended to the context for an observation. ``inline``: the text's tokens, right
        after the model's last token (inside its message when the turn stopped at a tool's closing
        tag). ``chat`` / ``user``: the end of the model's message, a ``tool`` / ``user`` message
        holding the text, and the next assistant header, in the chat template. The episode adjusts
        the join to how the turn ended (grpo/rl/episodes.py: an overhang, an end-of-message token)."""
        if self.observation_style in ("chat", "user"):
            return chat_observation_tokens(tokenizer, text, role="tool" if self.observation_style == "chat" else "user")
        return list(tokenizer.encode(text, add_special_tokens=False))

    def rebuild_context(self, prompt: list[int], episode: Episode, tokenizer: Any) -> list[int] | None:
        """The next turn's whole context, for environments that re-render the conversation (a
        template that drops earlier reasoning, a summarised history); ``episode`` ends with the
        new observation. None (the default): the observation's tokens are appended. A context
        that does not extend the current one splits the episode: each part trains as its own
        Datum over exactly the tokens the sampler saw, all with the episode's advantage."""
        return None

    def stop_sequences(self, tokenizer: Any) -> list[str | int]:
        """End of turn, each tool's closing tag (the environment answers there), and ``stop_strings()``."""
        tags = [f"</{name}>" for name in self.tools()]
        return [*super().stop_sequences(tokenizer), *tags, *(s for s in self.stop_strings() if s not in tags)]

    # ------------------------------------------------------------------ reward

    def episode_reward(self, episode: Episode, sample: Any) -> float:
        """Final outcome plus process terms: ``compute_reward`` of the last model turn minus
        ``tool_call_cost`` per call of a declared tool (other environment replies cost nothing).
        Override to read the whole trace (turns, errors)."""
        return float(self.compute_reward(episode.final_text, sample)) - self.tool_call_cost * episode.tool_calls

    # ------------------------------------------------------------------ checks

    def check_agent_config(self) -> None:
        """Raise AgentConfigError naming the attribute when a limit is out of range."""
        def need(ok: bool, key: str, valid: str) -> None:
            check(ok, f"adapter.{key}", getattr(self, key), valid)

        need(isinstance(self.max_turns, int) and self.max_turns >= 1, "max_turns", "must be an integer >= 1")
        need(isinstance(self.max_context_tokens, int) and self.max_context_tokens > 0, "max_context_tokens",
             "must be a positive integer")
        need(isinstance(self.tool_timeout_s, (int, float)) and self.tool_timeout_s > 0, "tool_timeout_s",
             "must be a positive number of seconds")
        need(isinstance(self.tool_workers, int) and not isinstance(self.tool_workers, bool) and self.tool_workers >= 1,
             "tool_workers", "must be an integer >= 1")
        need(self.tool_call_cost >= 0, "tool_call_cost", "must be >= 0")
        need(self.max_observation_chars > 0, "max_observation_chars", "must be a positive integer")
        check_choice("adapter.observation_style", self.observation_style, OBSERVATION_STYLES)
        check_choice("adapter.tool_errors", self.tool_errors, TOOL_ERROR_POLICIES)


def call_tool(fn: Callable[..., Any], argument: str, sample: Any) -> Any:
    """Call a tool with the model's input, adding ``sample=`` when its signature names a ``sample``
    parameter (introspected, so plain one-argument tools keep working unchanged)."""
    try:
        wants_sample = "sample" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C function without a signature: text only
        wants_sample = False
    return fn(argument, sample=sample) if wants_sample else fn(argument)


def chat_observation_tokens(tokenizer: Any, text: str, role: str = "tool") -> list[int]:
    """Tokens that end the assistant's message, add ``text`` as a ``role`` message and open the
    next assistant message, in the tokenizer's chat template. Found as the difference between two
    renderings of the same conversation, so any template works; a template that rejects the role
    falls back to ``user``."""
    marker = "\x00GRPO-OBSERVATION-MARKER\x00"
    base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}]
    for r in (role, "user"):
        try:
            full = tokenizer.apply_chat_template(base + [{"role": r, "content": text}], add_generation_prompt=True,
                                                 tokenize=False)
            break
        except Exception:
            continue
    else:
        raise AgentConfigError(f"observation_style={role!r} needs a tokenizer with a chat template; "
                               "use observation_style='inline' for a tokenizer without one")
    tail = full[full.index(marker) + len(marker):]
    return list(tokenizer.encode(tail, add_special_tokens=False))
