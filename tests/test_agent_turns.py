"""How episodes join observations to turns, count tool calls, hand tools the sample and bound hung
tools (issue #38), on SmolLM2's real tokenizer and chat template.

The model is the one thing scripted here: ``ScriptedSampler`` replays chosen text token by token
and stops where the local sampler does (a stop token id, or the first token whose decoded tail
holds a stop string, kept whole: grpo/backends/local/sampler.py), so a turn ends on SmolLM2's
``><`` token exactly as a sampled one would. Everything after the sampler is the real code path.
"""

from __future__ import annotations

import threading
import time

import pytest

from adapters.tools_rl import CALC_EXAMPLES, ToolsAdapter, calculate
from grpo import types
from grpo.rl.adapter import chat_prompt_tokens
from grpo.rl.agent import AgentAdapter
from grpo.rl.episodes import episode_metrics, run_episodes
from grpo.rl.tool_pool import ToolPool

TAIL = 16  # tokens of the tail the local sampler decodes to look for a stop string


class _Done:
    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


class ScriptedSampler:
    """A SamplingClient whose model writes ``turns[k]`` on an episode's k-th turn."""

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer, self.turns = tokenizer, turns
        self.prompts: list[list[int]] = []
        self.sampled: list[list[int]] = []

    def sample(self, prompt, num_samples, sampling_params, include_prompt_logprobs=False):
        context = prompt.to_ints()
        # the earlier turns of this episode: distinct contexts it extends (a group's twins share them)
        turn = len({len(p) for p in self.prompts if len(p) < len(context) and context[:len(p)] == p})
        self.prompts.append(context)
        strings, ids = sampling_params.stop_strings_and_ids()
        script = self.tokenizer.encode(self.turns[turn], add_special_tokens=False)
        out, reason = [], "length"
        for token in script[:sampling_params.max_tokens]:
            out.append(token)
            tail = self.tokenizer.decode(out[-TAIL:], skip_special_tokens=False)
            if token in ids or any(s in tail for s in strings):
                reason = "stop"
                break
        self.sampled.append(out)
        seqs = [types.SampledSequence(tokens=list(out), logprobs=[-0.5] * len(out), stop_reason=reason)
                for _ in range(num_samples)]
        return _Done(types.SampleResponse(sequences=seqs))


class Calc(AgentAdapter):
    """A calculator task with the AgentAdapter's default observation, ``<result>..</result>``."""

    max_turns = 3

    def __init__(self, observation_style="inline", replies=None, tool_call_cost=0.0):
        self.observation_style, self.replies, self.tool_call_cost = observation_style, replies, tool_call_cost

    def build_dataset(self):
        return [{"question": "What is 2000 + 77?", "answer": "2077"}]

    def make_prompt(self, sample, tokenizer):
        return chat_prompt_tokens(tokenizer, [{"role": "user", "content": sample["question"]}])

    def tools(self):
        return {"calc": calculate}

    def observe(self, text, sample, episode):
        if self.find_tool_call(text) is None and self.replies:  # answers like a user, not a tool
            return self.replies.pop(0)
        return super().observe(text, sample, episode)

    def compute_reward(self, response, sample):
        return float(sample["answer"] in response)


def group_of(adapter, tokenizer, turns, num_samples=1, max_tokens=32):
    """The episodes of the adapter's first item, its model writing ``turns``."""
    sampler = ScriptedSampler(tokenizer, turns)
    items = adapter.build_dataset()[:1]
    prompts = [adapter.make_prompt(x, tokenizer) for x in items]
    params = lambda i: types.SamplingParams(max_tokens=max_tokens, stop=adapter.stop_sequences(tokenizer))  # noqa: E731
    (group,) = run_episodes(sampler, adapter, items, prompts, num_samples, params, tokenizer)
    return prompts[0], group, sampler


def episode_of(adapter, tokenizer, turns):
    prompt, group, sampler = group_of(adapter, tokenizer, turns)
    return prompt, group[0], sampler


def context_text(tokenizer, prompt, rollout) -> str:
    """What the model reads after the prompt at the episode's end."""
    return tokenizer.decode(prompt + rollout.tokens, skip_special_tokens=False)[len(tokenizer.decode(prompt)):]


def model_tokens(rollout):
    return [t for t, m in zip(rollout.tokens, rollout.mask, strict=True) if m]


# --------------------------------------------------------------------------- item 1: the overhang


def test_a_turn_ending_on_the_gt_lt_token_is_followed_by_the_rest_of_the_result_tag(tokenizer):
    gt_lt = tokenizer.convert_tokens_to_ids("><")
    prompt, rollout, sampler = episode_of(Calc(), tokenizer, ["Let me see. <calc>2000+77</calc><result>",
                                                              " The answer is 2077.<|im_end|>"])
    first = sampler.sampled[0]
    assert first[-1] == gt_lt and tokenizer.decode(first).endswith("</calc><")  # the sampler kept the whole token
    ep = rollout.episode
    assert [t.role for t in ep.turns] == ["model", "observation", "model"] and ep.end_reason == "done"
    assert ep.turns[1].text == "result>2077</result>"  # "<" is the model's, already in the context
    assert context_text(tokenizer, prompt, rollout) == (
        "Let me see. <calc>2000+77</calc><result>2077</result> The answer is 2077.<|im_end|>")
    # the trainer sees exactly the sampler's tokens on model turns
    assert model_tokens(rollout) == sampler.sampled[0] + sampler.sampled[1]
    assert ep.tool_calls == 1 and ep.tool_errors == 0


@pytest.mark.parametrize(("written", "reads"), [
    ("<calc>2+3</calc> so", "<calc>2+3</calc><result>5</result>"),  # stops on ">" itself: no overhang
    ("<calc>2+3</calc>.", "<calc>2+3</calc>.<result>5</result>"),   # ">." overhang is no prefix: kept
])
def test_other_turn_ends_render_the_whole_observation(tokenizer, written, reads):
    prompt, rollout, _ = episode_of(Calc(), tokenizer, [written, " Done.<|im_end|>"])
    assert context_text(tokenizer, prompt, rollout).startswith(reads + " Done.")
    assert rollout.episode.turns[1].text == "<result>5</result>"


def test_the_tools_adapter_examples_read_as_its_episodes_do_without_the_gt_lt_token(tokenizer):
    gt_lt = tokenizer.convert_tokens_to_ids("><")
    assert len(CALC_EXAMPLES) == 2  # one is not enough for SmolLM2 to call the tool (issue #38)
    adapter = ToolsAdapter(num_train=4, num_eval=2)
    item = {"question": "What is 37 * 48?", "answer": "1776"}
    prompt = adapter.make_prompt(item, tokenizer)
    text = tokenizer.decode(prompt)
    for question, answer in CALC_EXAMPLES:
        assert question in text and answer in text
        assert gt_lt not in tokenizer.encode(answer, add_special_tokens=False)
    assert gt_lt not in prompt
    # an episode that follows the examples reads like them, token for token
    adapter.build_dataset = lambda: [item]
    prompt, rollout, sampler = episode_of(adapter, tokenizer, ["<calc>37*48</calc> <result>",
                                                               " The answer is 1776.<|im_end|>"])
    assert tokenizer.decode(sampler.sampled[0]) == "<calc>37*48</calc>"
    reads = "<calc>37*48</calc> <result>1776</result> The answer is 1776.<|im_end|>"
    assert context_text(tokenizer, prompt, rollout) == reads
    assert rollout.tokens == tokenizer.encode(reads, add_special_tokens=False)  # as the examples tokenize
    assert adapter.episode_reward(rollout.episode, item) == pytest.approx(1 - 0.02)


# --------------------------------------------------------------------------- item 2: chat and user


def template_text(tokenizer, question, *messages) -> str:
    """The chat template's own rendering of the conversation after the first user message."""
    head = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)
    full = tokenizer.apply_chat_template([{"role": "user", "content": question}, *messages], tokenize=False)
    return full[len(head):]


@pytest.mark.parametrize("style", ["chat", "user"])
def test_a_chat_observation_after_an_eos_turn_closes_the_message_once(tokenizer, style):
    adapter = Calc(observation_style=style, replies=["Too small. Guess again."])  # wrapped: <result>..</result>
    prompt, rollout, _ = episode_of(adapter, tokenizer, ["I guess 2000.<|im_end|>", "Then 2077.<|im_end|>"])
    role = "tool" if style == "chat" else "user"
    expected = template_text(tokenizer, "What is 2000 + 77?", {"role": "assistant", "content": "I guess 2000."},
                             {"role": role, "content": "<result>Too small. Guess again.</result>"},
                             {"role": "assistant", "content": "Then 2077."})
    assert context_text(tokenizer, prompt, rollout) + "\n" == expected  # the template ends the message with "\n"
    assert "<|im_end|><|im_end|>" not in context_text(tokenizer, prompt, rollout)
    ep = rollout.episode
    assert ep.observations == 1 and ep.tool_calls == 0 and ep.end_reason == "done"


def test_a_chat_observation_after_a_tool_tag_closes_the_models_message(tokenizer):
    prompt, rollout, _ = episode_of(Calc(observation_style="chat"), tokenizer,
                                    ["<calc>2+3</calc> so", "It is 5.<|im_end|>"])
    assert context_text(tokenizer, prompt, rollout) == (
        "<calc>2+3</calc><|im_end|>\n<|im_start|>tool\n<result>5</result><|im_end|>\n<|im_start|>assistant\n"
        "It is 5.<|im_end|>")
    # with a chat observation the overhang stays in the model's message (documented)
    prompt, rollout, _ = episode_of(Calc(observation_style="chat"), tokenizer,
                                    ["<calc>2+3</calc><result>", "It is 5.<|im_end|>"])
    assert context_text(tokenizer, prompt, rollout).startswith("<calc>2+3</calc><<|im_end|>\n<|im_start|>tool\n")


# --------------------------------------------------------------------------- item 3: counting


def test_tool_calls_count_declared_tools_and_observations_count_every_reply(tokenizer):
    adapter = Calc(replies=["<result>no tool called: use <calc></result>"], tool_call_cost=0.1)
    _, rollout, _ = episode_of(adapter, tokenizer, ["I think 2000.<|im_end|>", "<calc>2000+77</calc> ok",
                                                    "2077.<|im_end|>"])
    ep = rollout.episode
    assert [t.tool for t in ep.turns if t.role == "observation"] == [None, "calc"]
    assert ep.observations == 2 and ep.tool_calls == 1 and ep.model_turns == 3
    assert adapter.episode_reward(ep, adapter.build_dataset()[0]) == pytest.approx(1 - 0.1)  # one call paid
    metrics = episode_metrics([rollout])
    assert metrics["episode/tool_calls"] == 1 and metrics["episode/observations"] == 2
    assert metrics["episode/tool_error_rate"] == 0 and metrics["episode/tools_stuck"] == 0


# --------------------------------------------------------------------------- item 4: sample, stop strings


class Secret(AgentAdapter):
    """Guess the item's secret word; ``check`` needs the sample, and ``</guess>`` is no tool."""

    max_turns = 3

    def build_dataset(self):
        return [{"secret": "lapis"}]

    def make_prompt(self, sample, tokenizer):
        return chat_prompt_tokens(tokenizer, [{"role": "user", "content": "Guess the word."}])

    def tools(self):
        return {"check": self.check, "shout": str.upper}

    def check(self, word, *, sample):
        return "yes" if word == sample["secret"] else "no"

    def stop_strings(self):
        return ["</guess>"]

    def observe(self, text, sample, episode):
        if "</guess>" in text:
            return "right" if f"<guess>{sample['secret']}</guess>" in text else "wrong"
        return super().observe(text, sample, episode)

    def compute_reward(self, response, sample):
        return float(sample["secret"] in response)


def test_a_tool_declaring_sample_gets_the_item_and_stop_strings_need_no_tool(tokenizer):
    adapter = Secret()
    assert adapter.stop_sequences(tokenizer) == [tokenizer.eos_token_id, "</check>", "</shout>", "</guess>"]
    item = adapter.build_dataset()[0]
    assert adapter.observe("<check>lapis</check>", item, None) == "yes"
    assert adapter.observe("<shout>hey</shout>", item, None) == "HEY"  # a builtin: text only
    _, rollout, sampler = episode_of(adapter, tokenizer, ["<check>apple</check> hmm", "<guess>lapis</guess> ok",
                                                          "lapis<|im_end|>"])
    assert tokenizer.decode(sampler.sampled[1]) == "<guess>lapis</guess>"  # the turn stopped at the string
    ep = rollout.episode
    assert [t.text for t in ep.turns if t.role == "observation"] == ["<result>no</result>", "<result>right</result>"]
    assert ep.tool_calls == 1 and ep.observations == 2


# --------------------------------------------------------------------------- item 5: hung tools


RELEASE = threading.Event()


class Hangs(Calc):
    tool_timeout_s = 0.2
    tool_workers = 2

    def tools(self):
        return {"calc": lambda expression: RELEASE.wait(60) and "released"}  # time.sleep(60), releasable


def test_a_tool_that_never_returns_holds_at_most_tool_workers_threads(tokenizer):
    adapter = Hangs()
    before = threading.active_count()
    t0 = time.perf_counter()
    try:
        rollouts = []
        for _ in range(3):  # three batches of 4 episodes, each calling the hung tool twice
            rollouts += group_of(adapter, tokenizer, ["<calc>1+1</calc>"] * 3, num_samples=4)[1]
            assert threading.active_count() - before <= adapter.tool_workers
        elapsed = time.perf_counter() - t0
        errors = [t.error for r in rollouts for t in r.episode.turns if t.role == "observation"]
        assert len(errors) == 3 * 4 * 2 and all(errors)
        assert errors.count("timed out after 0.2 s") == 2  # the first two calls took the two workers
        assert all(e.startswith("tool unavailable: all 2 tool workers") for e in errors if "timed out" not in e)
        assert elapsed < 10  # never a hang: every later call was answered at once
        metrics = episode_metrics(rollouts)
        assert metrics["episode/tools_stuck"] == 2 and metrics["episode/tool_error_rate"] == 1
    finally:
        RELEASE.set()
    deadline = time.perf_counter() + 5
    while threading.active_count() > before and time.perf_counter() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before  # released, the workers end
    _, rollout, _ = episode_of(adapter, tokenizer, ["<calc>1+1</calc>", "ok<|im_end|>"])
    assert rollout.episode.turns[1].error is None and rollout.episode.turns[1].text == "<result>released</result>"


def test_the_pool_runs_more_calls_than_workers_each_under_its_own_limit():
    pool = ToolPool(workers=2, timeout_s=1.0)
    calls = [pool.submit(lambda i=i: time.sleep(0.05) or i) for i in range(10)]
    assert [pool.wait(c) for c in calls] == [None] * 10 and [c.value for c in calls] == list(range(10))
    assert pool.threads() <= 2 and pool.stuck() == 0


# --------------------------------------------------------------------------- bad input


class Faulty(Calc):
    max_turns = 4
    max_context_tokens = 120

    def tools(self):
        return {"calc": calculate, "junk": lambda x: {"not": "text"}, "flood": lambda x: "9 " * 1500}

    def observe(self, text, sample, episode):
        if "boom" in text:
            raise RuntimeError("environment crashed")
        return super().observe(text, sample, episode)


@pytest.mark.parametrize("style", ["inline", "chat", "user"])
def test_bad_tool_output_and_a_raising_observe_stay_in_the_trace(tokenizer, style):
    adapter = Faulty(observation_style=style)
    _, rollout, _ = episode_of(adapter, tokenizer, ["<junk>x</junk>", "boom<|im_end|>", "<flood>x</flood>",
                                                    "never sampled"])
    ep = rollout.episode
    obs = [t for t in ep.turns if t.role == "observation"]
    assert obs[0].error == "tool returned dict, not text" and obs[0].tool == "junk"
    assert obs[1].error == "RuntimeError: environment crashed" and obs[1].tool is None
    # 3000 characters are cut to max_observation_chars and still pass the context: the episode ends there
    assert obs[2].tool == "flood" and "cut at 2000" in obs[2].error and ep.end_reason == "context"
    assert rollout.truncated
    assert ep.tool_calls == 2 and ep.tool_errors == 2 and ep.observations == 3 and ep.observation_errors == 3
    metrics = episode_metrics([rollout])
    assert metrics["episode/tool_error_rate"] == 1 and metrics["episode/observation_error_rate"] == 1
    assert metrics["episode/end_context"] == 1
