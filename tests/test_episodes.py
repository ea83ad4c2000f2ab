"""Multi-turn episodes (grpo.rl.agent, grpo.rl.episodes) on the tiny model: the tokens the sampler saw
become the Datum, observation and prompt tokens carry weight 0, the trainer's logprobs of the
model-written tokens equal the sampler's, limits end episodes, and faulty tools never stop training."""

from __future__ import annotations

import math
import time

import pytest
import torch
from backend_helpers import perturb_adapter
from toy_agent import ToyAgent

from grpo import types
from grpo.backends.local import ServiceClient
from grpo.models import cpu_linear, kernel_probe
from grpo.record.runlog import read_jsonl
from grpo.rl.advantages import build_datum
from grpo.rl.agent import Episode
from grpo.rl.episodes import episode_metrics, run_episodes, sample_rollouts
from grpo.rl.loop import run_grpo

BASE = {"base_model": "tiny", "batch_size": 2, "group_size": 2, "max_tokens": 16, "report": False,
        "progress": False, "learning_rate": 1e-3, "eval_samples": 2}
# How far the sampler's logprob of a model token may lie from the trainer's, on-policy, per precision
# of the base weights: fp32 rounding, and bf16's 8-bit mantissa (1e-3 to 2e-3 measured on the tiny model,
# AMD EPYC Zen 4 avx512_bf16 and Intel Xeon AMX).
ON_POLICY_GAP = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def fp32_run(adapter, cfg, run_dir):
    """run_grpo in fp32 whatever ``auto`` picks here: these runs check on-policy exactness."""
    service = ServiceClient(checkpoint_dir=run_dir / "checkpoints", dtype="fp32")
    return run_grpo(adapter, cfg, service_client=service, run_dir=run_dir)


class RecordingSampler:
    """Records the prompt of every sample() call, and what it answered, in order."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[list[int], object]] = []
        self.issued_before_awaited: list[int] = []  # per await: how many requests were issued then

    def sample(self, prompt, num_samples, sampling_params, include_prompt_logprobs=False):
        future = self.inner.sample(prompt=prompt, num_samples=num_samples, sampling_params=sampling_params)
        record = [prompt.to_ints(), None]
        self.calls.append(record)
        result, calls = future.result, self.calls

        def recorded(*a, **k):
            self.issued_before_awaited.append(len(calls))
            record[1] = result(*a, **k)
            return record[1]

        future.result = recorded
        return future

    def compute_logprobs(self, prompt):
        return self.inner.compute_logprobs(prompt)


@pytest.fixture(params=("onednn", "stream"))  # (an fp32 sampler's: "stream_dot" is bf16's)
def perturbed(request, fp32_service, monkeypatch):
    """A training client whose LoRA is not the identity, and a recording sampler of its weights,
    packed in each layout an fp32 sampler may run in (the engine's is measured per machine:
    kernel_probe.py; here set)."""
    if request.param == "stream":
        if not (cpu_linear.onednn_works() and cpu_linear.stream_available()):
            pytest.skip("grpo's native kernels or oneDNN are not here: no streaming layout")
        monkeypatch.setattr(kernel_probe, "decoding_layout", lambda shapes, dtype=None: "stream")
    client = fp32_service.create_lora_training_client("tiny", rank=4, seed=0)
    assert client.engine.fp32_layout == request.param or not cpu_linear.onednn_works()
    perturb_adapter(client, seed=1)
    return client, RecordingSampler(client.save_weights_and_get_sampling_client("s"))


def run(sampler, adapter, tokenizer, n_items=2, num_samples=2, max_tokens=16, temperature=1.0):
    items = adapter.build_dataset()[:n_items]
    prompts = [adapter.make_prompt(x, tokenizer) for x in items]
    params = lambda i: types.SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=100 + i,  # noqa: E731
                                            stop=adapter.stop_sequences(tokenizer))
    return items, prompts, run_episodes(sampler, adapter, items, prompts, num_samples, params, tokenizer)


def test_datum_is_the_token_sequence_the_sampler_saw_with_observations_weighted_zero(perturbed, tokenizer):
    client, sampler = perturbed
    adapter = ToyAgent(max_turns=3)
    items, prompts, groups = run(sampler, adapter, tokenizer)
    for prompt, group in zip(prompts, groups, strict=True):
        for rollout in group:
            ep: Episode = rollout.episode
            # the toy environment answers every turn, but no declared tool was called
            assert ep.model_turns == 3 and ep.observations == 2 and ep.tool_calls == 0 and ep.end_reason == "max_turns"
            assert [t.role for t in ep.turns] == ["model", "observation"] * 2 + ["model"]
            # every later turn was sampled from exactly prompt + the episode so far
            context = prompt + rollout.tokens
            seen = [c for c in sampler.calls if context[:len(c[0])] == c[0] and len(c[0]) > len(prompt)]
            assert len(seen) == 2
            for call_prompt, _ in seen:
                assert call_prompt == context[:len(call_prompt)]
            # the datum's tokens are the prompt and the episode, in order
            datum = build_datum(prompt, rollout, [0.5] * len(rollout.tokens))
            inputs = datum.loss_fn_inputs
            assert datum.model_input.to_ints() + [inputs["target_tokens"].tolist()[-1]] == context
            # masks: prompt targets 0, observation targets 0, model targets 1
            weights = inputs["weights"].tolist()
            n_prompt = len(prompt) - 1
            assert weights[:n_prompt] == [0.0] * n_prompt
            assert weights[n_prompt:] == [float(m) for m in rollout.mask]
            obs = [t for t in ep.turns if t.role == "observation"]
            assert sum(1 - m for m in rollout.mask) == sum(t.num_tokens for t in obs) > 0
            assert sum(rollout.mask) == sum(t.num_tokens for t in ep.turns if t.role == "model")
            for key in ("advantages", "logprobs"):
                values = inputs[key].tolist()
                assert all(v == 0 for v, w in zip(values, weights, strict=True) if w == 0)
            assert all(a == 0.5 for a, w in zip(inputs["advantages"].tolist(), weights, strict=True) if w)
            # observation tokens are exactly what the adapter rendered for the observation text
            tokens_of_obs = [tok for tok, m in zip(rollout.tokens, rollout.mask, strict=True) if not m]
            rendered = [tok for t in obs for tok in adapter.render_observation(t.text, tokenizer)]
            assert tokens_of_obs == rendered


def test_trainer_logprobs_of_model_tokens_equal_the_samplers_on_3_turn_episodes(perturbed, tokenizer):
    client, sampler = perturbed
    _, prompts, groups = run(sampler, ToyAgent(max_turns=3), tokenizer)
    datums, rollouts = [], []
    for prompt, group in zip(prompts, groups, strict=True):
        for rollout in group:
            assert rollout.episode.model_turns == 3
            datums.append(build_datum(prompt, rollout, [1.0] * len(rollout.tokens)))
            rollouts.append((prompt, rollout))
    out = client.forward(datums, "cross_entropy").result()
    worst, n = 0.0, 0
    for (prompt, rollout), o in zip(rollouts, out.loss_fn_outputs, strict=True):
        trained = o["logprobs"].tolist()[len(prompt) - 1:]
        for q, p, m in zip(rollout.logprobs, trained, rollout.mask, strict=True):
            if m:
                worst, n = max(worst, abs(q - p)), n + 1
            else:
                assert q == 0.0  # observation tokens carry no sampler logprob
    assert n >= 4 * 3 and worst < 1e-4, (n, worst)


def test_turns_are_batched_across_episodes(perturbed, tokenizer):
    _, sampler = perturbed
    run(sampler, ToyAgent(max_turns=3), tokenizer, n_items=3, num_samples=2)
    # turn 1: one request per prompt (its group shares it); turns 2 and 3: one per episode
    assert len(sampler.calls) == 3 + 6 + 6
    # every request of a turn was issued before the first of them was awaited
    assert sampler.issued_before_awaited[0] == 3 and sampler.issued_before_awaited[3] == 9
    assert sampler.issued_before_awaited[9] == 15


def test_max_turns_ends_the_episode_after_that_many_model_turns(perturbed, tokenizer):
    _, sampler = perturbed
    for max_turns in (1, 2):
        _, _, groups = run(sampler, ToyAgent(max_turns=max_turns), tokenizer)
        for r in (r for g in groups for r in g):
            assert r.episode.model_turns == max_turns and r.episode.end_reason == "max_turns"
            assert r.episode.turns[-1].role == "model" and not r.truncated


def test_the_environment_ending_the_episode_ends_it(perturbed, tokenizer):
    _, sampler = perturbed
    _, _, groups = run(sampler, ToyAgent(max_turns=3, behaviour={0: "end"}), tokenizer)
    for r in groups[0]:
        assert r.episode.model_turns == 1 and r.episode.end_reason == "done" and r.mask == (1,) * len(r.tokens)
    assert all(r.episode.model_turns == 3 for r in groups[1])


def test_context_cap_ends_episodes_and_counts_as_truncated(perturbed, tokenizer):
    _, sampler = perturbed
    prompt_len = len(ToyAgent().make_prompt(ToyAgent().items[0], tokenizer))
    # room for 5 tokens: the first turn is cut there
    _, prompts, groups = run(sampler, ToyAgent(max_context_tokens=prompt_len + 5), tokenizer, n_items=1,
                             max_tokens=16, temperature=1.0)
    for r in groups[0]:
        assert r.episode.context_tokens <= prompt_len + 5
        if r.episode.end_reason == "context":
            assert r.truncated and len(r.tokens) <= 5
    # a cap the first turn fits in but no observation after it does
    room = prompt_len + 20
    _, _, groups = run(sampler, ToyAgent(max_context_tokens=room, max_turns=3), tokenizer, n_items=1)
    ends = [r.episode.end_reason for r in groups[0]]
    assert set(ends) <= {"context"} and ends
    for r in groups[0]:
        assert len(prompts[0]) + len(r.tokens) <= room and r.truncated


def test_raising_hanging_and_garbage_tools_become_counted_error_observations(perturbed, tokenizer):
    _, sampler = perturbed
    adapter = ToyAgent(num_items=4, max_turns=2, behaviour={0: "raise", 1: "hang", 2: "garbage"})
    t0 = time.perf_counter()
    _, _, groups = run(sampler, adapter, tokenizer, n_items=4)
    elapsed = time.perf_counter() - t0
    assert elapsed < 20  # the hanging tool cost its 0.5 s limit, not forever
    errors = [[t.error for t in r.episode.turns if t.role == "observation"] for g in groups for r in g]
    assert all(len(e) == 1 for e in errors)
    assert all("RuntimeError: tool crashed on item 0" in e[0] for e in errors[0:2])
    assert all(e[0] == "timed out after 0.5 s" for e in errors[2:4])
    assert all(e[0] == "tool returned object, not text" for e in errors[4:6])
    assert all(e[0] is None for e in errors[6:8])
    # the model reads the error and goes on to its next turn
    for r in groups[0]:
        obs = r.episode.turns[1]
        assert obs.text == "<result>error: RuntimeError: tool crashed on item 0</result>" and r.episode.model_turns == 2
    metrics = episode_metrics([r for g in groups for r in g])
    assert metrics["episode/observation_error_rate"] == pytest.approx(6 / 8)
    assert metrics["episode/observations"] == 1.0 and metrics["episode/turns"] == 2.0
    # observe answers without a declared tool: environment replies, not tool calls
    assert metrics["episode/tool_calls"] == 0.0 and metrics["episode/tool_error_rate"] == 0.0


def test_tool_errors_end_sets_the_episode_end(perturbed, tokenizer):
    _, sampler = perturbed
    _, _, groups = run(sampler, ToyAgent(max_turns=3, behaviour={0: "raise"}, tool_errors="end"), tokenizer)
    for r in groups[0]:
        assert r.episode.end_reason == "tool_error" and r.episode.model_turns == 1
        assert r.episode.observation_errors == 1 and r.episode.tool_errors == 0  # observe raised, no tool was called
        assert all(r.mask)  # the error was recorded, not appended
    assert all(r.episode.end_reason == "max_turns" for r in groups[1])


def test_chat_observations_are_rendered_in_the_chat_template(tokenizer):
    adapter = ToyAgent(observation_style="chat")
    text = tokenizer.decode(adapter.render_observation("<result>7</result>", tokenizer))
    assert text == "<|im_end|>\n<|im_start|>tool\n<result>7</result><|im_end|>\n<|im_start|>assistant\n"


def test_single_turn_adapters_still_sample_single_completions(service, tokenizer):
    from toy_adapter import ToyAdapter

    sampler = service.create_sampling_client(base_model="tiny")
    adapter = ToyAdapter()
    prompts = [adapter.make_prompt(x, tokenizer) for x in adapter.items[:2]]
    groups = sample_rollouts(sampler, adapter, adapter.items[:2], prompts, 2,
                             lambda i: types.SamplingParams(max_tokens=4, seed=i), tokenizer)
    assert all(r.mask is None and r.episode is None and r.model_mask == [1] * len(r.tokens)
               for g in groups for r in g)


def test_bad_limits_name_the_attribute():
    with pytest.raises(ValueError, match=r"adapter.max_turns=0 is invalid"):
        ToyAgent(max_turns=0).check_agent_config()
    with pytest.raises(ValueError, match=r"adapter.observation_style=.xml. is invalid: valid values: inline, chat, user"):
        ToyAgent(observation_style="xml").check_agent_config()
    with pytest.raises(ValueError, match=r"valid values: inline, chat, user"):
        ToyAgent(observation_style="xml").check_agent_config()
    agent = ToyAgent()
    agent.tool_workers = 0
    with pytest.raises(ValueError, match=r"adapter.tool_workers=0 is invalid: must be an integer >= 1"):
        agent.check_agent_config()


def test_run_grpo_trains_on_episodes_with_faulty_tools_and_logs_traces(tmp_path):
    adapter = ToyAgent(num_items=6, max_turns=3, behaviour={1: "raise", 3: "hang"})
    fp32_run(adapter, {**BASE, "steps": 2, "batch_size": 3}, tmp_path)
    steps = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in steps] == [0, 1]
    for row in steps:
        assert row["datums"] > 0 and math.isfinite(row["loss"]) and row["grad_norm"] > 0
        # on-policy over multi-turn datums: the trainer agrees with the sampler on model tokens
        assert abs(row["kl/sample_train"]) < 1e-4 and row["logprob/max_abs_diff"] < 1e-4
        assert 1 <= row["episode/turns"] <= 3 and row["episode/context_tokens"] > 0
        assert {"episode/tool_calls", "episode/observations", "episode/tool_error_rate", "time/turn",
                "episode/end_max_turns", "episode/tools_stuck"} <= set(row)
        # tokens/sampled counts what the model wrote, not observations
        assert row["tokens/sampled"] < 3 * 2 * 3 * 16
    assert any(r["episode/observation_error_rate"] > 0 for r in steps)
    rollouts = read_jsonl(tmp_path / "rollouts.jsonl")
    assert rollouts and all("turns" in r and "end_reason" in r for r in rollouts)
    errors = [t["error"] for r in rollouts for t in r["turns"] if t.get("error")]
    assert any("RuntimeError" in e for e in errors) or any("timed out" in e for e in errors)
    assert all(t["role"] in ("model", "observation") for r in rollouts for t in r["turns"])


def test_the_readme_tool_task_example_runs(tmp_path):
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "docs" / "agentic.md").read_text()
    block = readme.split("<!-- agent-example -->", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    setup, call = block.rsplit("\nrun_grpo(", 1)
    namespace: dict = {}
    exec(compile(setup, "docs/agentic.md", "exec"), namespace)
    adapter = namespace["Dictionary"]()
    assert len(setup.strip().splitlines()) <= 40  # "a new tool task is ~30 lines"
    assert adapter.observe("<define>apple</define>", {}, None) == "a red fruit"
    with pytest.raises(namespace["ToolError"], match="no entry for 'pear'"):
        adapter.observe("I will look it up: <define>pear</define>", {}, None)
    assert "</define>" in adapter.stop_sequences(type("Tok", (), {"eos_token_id": 2})())
    # the page's run (its config, on the tiny model for two steps)
    import ast

    cfg = ast.literal_eval(call.split(",", 1)[1].rsplit(")", 1)[0].strip())
    assert call.startswith("Dictionary()") and cfg["group_size"] == 4
    run_grpo(adapter, {**cfg, "steps": 2, "base_model": "tiny", "batch_size": 2, "report": False,
                       "progress": False}, run_dir=tmp_path)
    rows = read_jsonl(tmp_path / "rollouts.jsonl")
    assert len(rows) == 2 * 2 * 4 and all("turns" in r for r in rows)


def test_kl_penalty_on_episodes_reads_model_tokens_only(tmp_path):
    run_grpo(ToyAgent(num_items=4, max_turns=3), {**BASE, "steps": 1, "kl_penalty_coef": 0.1}, run_dir=tmp_path)
    (row,) = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "reward/mean" in r]
    # LoRA starts as the identity, so policy = reference on every model token; observation tokens
    # (sampler logprob 0, reference logprob < 0) would pull this far from 0 if they were counted
    assert abs(row["kl/reference"]) < 1e-4 and row["episode/observation_tokens"] > 0


class Summarising(ToyAgent):
    """An environment that re-renders the conversation: the prompt, a note of how many turns went
    by, and the newest observation only. Turn k's context is then no prefix of turn k+1's."""

    def rebuild_context(self, prompt, episode, tokenizer):
        note = tokenizer.encode(f"[{episode.model_turns} turns summarised]", add_special_tokens=False)
        return prompt + note + self.render_observation(episode.turns[-1].text, tokenizer)


def test_an_environment_that_breaks_the_prefix_splits_the_episode_into_datums(perturbed, tokenizer):
    from grpo.rl.advantages import select_for_training
    from grpo.rl.rollouts import Group, ScoredGroup

    client, sampler = perturbed
    _, prompts, groups = run(sampler, Summarising(max_turns=3), tokenizer)
    rollout = groups[0][0]
    assert rollout.episode.model_turns == 3 and len(rollout.segments) == 3
    # each part is exactly one sampler call: its context, then the tokens sampled after it
    answered = {tuple(call[0]): call[1] for call in sampler.calls}
    for context, part in rollout.segments:
        assert tuple(context) in answered and part.mask == (1,) * len(part.tokens)
        assert any(list(s.tokens) == part.tokens for s in answered[tuple(context)].sequences)
    assert [t for _, p in rollout.segments for t in p.tokens] == rollout.tokens
    # training: one Datum per part, each with the episode's advantage; trainer = sampler logprobs
    scored = ScoredGroup(Group(0, {}, prompts[0], groups[0]), [1.0, 0.0], [{}, {}], [])
    samples = select_for_training([scored], [[0.5, -0.5]], True, "keep")
    assert len(samples) == 6 and [s.advantage for s in samples] == [0.5] * 3 + [-0.5] * 3
    datums = [build_datum(s.prompt_tokens, s.rollout, [s.advantage] * len(s.rollout.tokens)) for s in samples]
    out = client.forward(datums, "cross_entropy").result()
    for s, o in zip(samples, out.loss_fn_outputs, strict=True):
        trained = o["logprobs"].tolist()[len(s.prompt_tokens) - 1:]
        assert max(abs(q - p) for q, p in zip(s.rollout.logprobs, trained, strict=True)) < 1e-4


def test_run_grpo_trains_split_episodes_on_policy(tmp_path):
    fp32_run(Summarising(num_items=4, max_turns=2), {**BASE, "steps": 1}, tmp_path)
    (row,) = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "reward/mean" in r]
    assert row["datums"] == 2 * 2 * 2  # two parts per episode
    assert abs(row["kl/sample_train"]) < 1e-4 and row["logprob/max_abs_diff"] < 1e-4


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "auto"])
def test_multi_turn_runs_are_on_policy_within_their_precisions_bound(tmp_path, dtype):
    """Whatever precision trains and samples (bf16 emulated on a CPU without it; ``auto`` is what
    this machine resolved), the trainer's logprobs of model tokens lie within that precision's
    rounding of the sampler's: a token shifted by one place would be off by far more."""
    service = ServiceClient(checkpoint_dir=tmp_path / "checkpoints", dtype=dtype)
    run_grpo(ToyAgent(num_items=2, max_turns=3), {**BASE, "steps": 1}, service_client=service, run_dir=tmp_path)
    engine = service.create_lora_training_client("tiny", rank=2).engine  # the run's engine: one per base model
    assert engine.sample_dtype == engine.dtype
    (row,) = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "reward/mean" in r]
    assert row["episode/turns"] == 3
    assert row["logprob/max_abs_diff"] < ON_POLICY_GAP[engine.dtype], (engine.dtype, row["logprob/max_abs_diff"])
