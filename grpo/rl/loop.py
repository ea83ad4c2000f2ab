"""run_grpo: sample groups, score them, centre the advantages, train. Read it top to bottom.

Each step:
  1. snapshot the current weights into a sampling client
  2. sample ``group_size`` rollouts for ``batch_size`` prompts (all requests in flight at once)
  3. score them with the adapter (a failing reward is recorded and left out, never fatal)
  4. advantages = reward - group mean (optionally / std); flat groups carry no signal
  5. Datums: prompt tokens weight 0, response tokens carry the advantage
  6. forward_backward + optim_step, submitted back to back
  7. log metrics and rollouts; evaluate and checkpoint when due

Every stage returns what it made (ScoredGroup, advantages, TrainSample, reference logprobs,
Datum) and nothing writes into another stage's records, so one step's data flow can be read
from the signatures of collect_batch and learn.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo.api.losses import TIS_CAP
from grpo.api.protocols import SamplingClient, ServiceClient, TrainingClient
from grpo.record import checkpoint
from grpo.record.runlog import RunLog
from grpo.rl.adapter import RLAdapter
from grpo.rl.advantages import (
    TrainSample,
    build_datums,
    compute_advantages,
    is_flat,
    select_for_training,
    training_rewards,
)
from grpo.rl.config import GRPOConfig
from grpo.rl.episodes import episode_metrics, sample_rollouts
from grpo.rl.evaluation import evaluate, summary
from grpo.rl.rollouts import Failure, Group, ScoredGroup, sampling_seed, score_group
from grpo.rl.saturation import SolveHistory
from grpo.types import AdamParams, Datum, ModelInput, SamplingParams


class RewardFailureError(RuntimeError):
    pass


@dataclass(frozen=True)
class Run:
    """What stays fixed for a whole run; every step function takes it first."""

    adapter: RLAdapter
    cfg: GRPOConfig
    service_client: ServiceClient
    training_client: TrainingClient
    reference: SamplingClient | None  # the base model, for the KL penalty
    tokenizer: Any
    stop: list
    log: RunLog
    run_dir: Path


@dataclass(frozen=True)
class Batch:
    """One step's scored groups. Policy metrics come from ``first_wave``, an unbiased sample of
    the policy; ``groups`` adds the dynamic-sampling waves that replaced flat groups."""

    groups: list[ScoredGroup]
    first_wave: list[ScoredGroup]
    timing: dict[str, float]

    @property
    def failures(self) -> list[Failure]:
        return [f for g in self.groups for f in g.failures]


def run_grpo(adapter: RLAdapter, cfg: Any = None, *, service_client: ServiceClient | None = None,
             run_dir: str | Path | None = None, resolved_config: dict | None = None) -> str:
    """Train a LoRA adapter with GRPO on ``adapter``'s task; return the final weights' path.

    ``cfg`` may be a GRPOConfig, a dict / OmegaConf mapping, or any object with those attributes.
    Rerunning with the same ``run_dir`` resumes from its newest checkpoint. (``grpo.run_grpo`` is
    this function behind MinT's call shape: see grpo/mint_run.py.)
    """
    cfg = GRPOConfig.from_any(cfg)
    run_dir = Path(run_dir) if run_dir is not None else Path("outputs") / time.strftime("%Y-%m-%d_%H-%M-%S")
    log = RunLog(run_dir, cfg.to_dict(), cfg.steps, progress=cfg.progress, wandb_cfg=cfg.wandb)
    log.write_config(resolved_config or cfg.to_dict())
    train_items, eval_items = load_items(adapter, cfg)  # before the model: bad data fails in a blink
    run = open_run(adapter, cfg, service_client, run_dir, log)
    state, history = resume_or_start(run)
    stream = ItemStream(train_items, cfg.seed, state.cursor)
    evals: dict[int, dict[str, float]] = {}  # step -> held-out metrics, for the closing summary
    # True from submitting a step's update until the step is recorded in `state`: the weights
    # and the loop state may disagree then, so an interrupt must not checkpoint.
    updating = False
    try:
        for step in range(state.step, cfg.steps + 1):
            if eval_items and cfg.eval_due(step):
                evals[step] = run_evaluation(run, eval_items, step)
            if step == cfg.steps:
                break
            if not stream.live(history.retired):
                log.print(f"every training item is retired (retire_solved_after / retire_unsolved_after); "
                          f"stopping after step {step - 1}")
                break
            t_step = time.perf_counter()
            state_at_start = checkpoint.LoopState(step, stream.cursor, state.wandb_id, history.to_json())
            batch = collect_batch(run, stream, step, frozenset(history.retired))
            stop_if_rewards_fail(run, batch, step, state_at_start)
            updating = True
            advantages = compute_advantages(batch.groups, cfg.advantage_norm, cfg.overlong)
            metrics = learn(run, batch, advantages, step)
            history.record(batch.groups, adapter.is_correct, cfg.retire_solved_after, cfg.retire_unsolved_after)
            metrics.update(history.metrics(len(train_items)))
            metrics["time/step"] = time.perf_counter() - t_step
            log_step(run, batch, advantages, metrics, step)
            state = checkpoint.LoopState(step + 1, stream.cursor, state.wandb_id, history.to_json())
            updating = False
            if cfg.save_due(step) and step + 1 < cfg.steps:
                checkpoint.save(run.training_client, run_dir, log, state)
                refresh_report(run_dir, cfg)
        final = finish(run, state)
    except KeyboardInterrupt:
        # Ctrl-C mid-step: keep everything before this step, so a rerun repeats only the step.
        if not updating:
            path = checkpoint.save(run.training_client, run_dir, log, state)
            log.print(f"interrupted in step {state.step}; checkpoint saved at {path}. "
                      "Rerun the same command to resume.")
        else:
            log.print("interrupted during an optimizer update; rerun the same command to resume "
                      "from the last checkpoint.")
        raise
    finally:
        log.close()
    print_summary(log, evals, len(eval_items), final)
    return final


# --------------------------------------------------------------------------- setup and teardown


def resume_or_start(run: Run) -> tuple[checkpoint.LoopState, SolveHistory]:
    """The newest checkpoint's loop state (weights, optimizer and RNGs restored), or a fresh one."""
    state = checkpoint.resume(run.run_dir, run.training_client, run.log)
    if state is None:
        state = checkpoint.LoopState()
        random.seed(run.cfg.seed)
    else:
        run.log.print(f"resumed {run.run_dir} at step {state.step}")
    state = dataclasses.replace(state, wandb_id=run.log.start_wandb(state.wandb_id))
    return state, SolveHistory.from_json(state.solve_history)


def load_items(adapter: RLAdapter, cfg: GRPOConfig) -> tuple[list[Any], list[Any]]:
    train_items = list(adapter.build_dataset())
    if not train_items:
        raise ValueError(f"{type(adapter).__name__}.build_dataset() returned no items")
    return train_items, list(adapter.build_eval_dataset())[: cfg.eval_size]


def open_run(adapter: RLAdapter, cfg: GRPOConfig, service_client: ServiceClient | None, run_dir: Path,
             log: RunLog) -> Run:
    """Create the training client (and the reference sampler for the KL penalty)."""
    if service_client is None:
        from grpo.backends.local import ServiceClient as LocalServiceClient

        service_client = LocalServiceClient(checkpoint_dir=run_dir / "checkpoints")
    training_client = service_client.create_lora_training_client(
        base_model=cfg.base_model, rank=cfg.rank, seed=cfg.seed,
        train_mlp=cfg.train_mlp, train_attn=cfg.train_attn, train_unembed=cfg.train_unembed)
    tokenizer = training_client.get_tokenizer()
    reference = service_client.create_sampling_client(base_model=cfg.base_model) if cfg.kl_penalty_coef > 0 else None
    return Run(adapter, cfg, service_client, training_client, reference, tokenizer, adapter.stop_sequences(tokenizer),
               log, run_dir)


def finish(run: Run, state: checkpoint.LoopState) -> str:
    """Last checkpoint (resumable), the final sampler weights, the report; returns the weights' path."""
    checkpoint.save(run.training_client, run.run_dir, run.log, state)
    final = str(run.training_client.save_weights_for_sampler("final").result().path)
    run.log.log_checkpoint({"step": state.step, "name": "final", "path": final, "kind": "final"})
    refresh_report(run.run_dir, run.cfg)
    return final


def print_summary(log: RunLog, evals: dict[int, dict[str, float]], n_items: int, final: str) -> None:
    line = summary(evals, n_items)
    if line:
        log.print(line)
    log.print(f"final adapter: {final}")


def refresh_report(run_dir: Path, cfg: GRPOConfig) -> None:
    """Rewrite report.html from the run directory; a report never takes training down."""
    if not cfg.report:
        return
    try:
        from grpo.record.report import write_report

        write_report(run_dir, png=False)
    except Exception as err:
        print(f"[grpo] report not written: {type(err).__name__}: {err}")


# --------------------------------------------------------------------------- data


class ItemStream:
    """Training items in a fresh seeded shuffle every epoch; position ``cursor`` is all the
    state there is, so resuming needs only that number. Which items to pass over (the retired
    ones) is the caller's to say on each call: the stream holds no one else's record."""

    def __init__(self, items: Sequence[Any], seed: int, cursor: int = 0):
        self.items = list(items)
        self.seed = seed
        self.cursor = cursor
        self._orders: dict[int, list[int]] = {}

    def live(self, skip: AbstractSet[int]) -> int:
        """How many items are left to draw when ``skip`` are passed over."""
        return len(self.items) - len(skip)

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.items)))
            random.Random(self.seed * 7919 + epoch).shuffle(order)
            self._orders[epoch] = order
        return self._orders[epoch]

    def take(self, n: int, skip: AbstractSet[int] = frozenset()) -> list[tuple[int, Any]]:
        """The next ``n`` (index, item) pairs, passing over the indices in ``skip``."""
        out = []
        while len(out) < n and self.live(skip):
            epoch, offset = divmod(self.cursor, len(self.items))
            index = self._order(epoch)[offset]
            self.cursor += 1
            if index not in skip:
                out.append((index, self.items[index]))
        return out


# --------------------------------------------------------------------------- one step's parts


def run_evaluation(run: Run, eval_items: list[Any], step: int) -> dict[str, float]:
    cfg = run.cfg
    sampler = run.training_client.save_weights_and_get_sampling_client(f"eval_{step}")
    metrics = evaluate(sampler, run.adapter, eval_items, run.tokenizer, seed=cfg.seed, step=step,
                       max_tokens=cfg.eval_max_tokens or cfg.max_tokens, num_samples=cfg.eval_samples,
                       temperature=cfg.eval_temperature, stop=run.stop, record_failures=run.log.log_failures,
                       baseline_sampler=lambda: run.service_client.create_sampling_client(base_model=cfg.base_model))
    run.log.log_metrics(step, metrics)
    return metrics


def collect_batch(run: Run, stream: ItemStream, step: int, retired: AbstractSet[int]) -> Batch:
    """Sample and score ``batch_size`` groups of items not ``retired``; with dynamic sampling,
    replace flat groups with fresh prompts for up to ``dynamic_sampling_waves`` more waves."""
    cfg = run.cfg
    sampler = run.training_client.save_weights_and_get_sampling_client(f"step_{step}")
    groups: list[ScoredGroup] = []
    first_wave: list[ScoredGroup] = []
    timing = {"time/sample": 0.0, "time/score": 0.0}
    counters_before = sampler_counters(sampler)
    wanted = cfg.batch_size
    for wave in range(cfg.dynamic_sampling_waves + 1):
        entries = stream.take(wanted, retired)
        prompts = [run.adapter.make_prompt(item, run.tokenizer) for _, item in entries]
        t0 = time.perf_counter()
        rollouts = sample_rollouts(  # an AgentAdapter's rollouts are multi-turn episodes
            sampler, run.adapter, [item for _, item in entries], prompts, cfg.group_size,
            lambda i, wave=wave: SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature_at(step),
                                                top_p=cfg.top_p, top_k=cfg.top_k, stop=run.stop,
                                                seed=sampling_seed(cfg.seed, step, wave, i)),
            run.tokenizer)
        t1 = time.perf_counter()
        wave_groups = [score_group(run.adapter, Group(index, item, prompt, rs))
                       for (index, item), prompt, rs in zip(entries, prompts, rollouts, strict=True)]
        timing["time/sample"] += t1 - t0
        timing["time/score"] += time.perf_counter() - t1
        groups.extend(wave_groups)
        if wave == 0:
            first_wave = wave_groups
        wanted = sum(is_flat(training_rewards(g, cfg.overlong)) for g in wave_groups)
        if wanted == 0:
            break
    timing["dynamic/waves"] = float(wave + 1)
    timing.update(sampler_metrics(counters_before, sampler_counters(sampler)))
    return Batch(groups, first_wave, timing)


def sampler_counters(sampler: Any) -> dict[str, float] | None:
    """The local backend's sampler counters (its SamplingClient.sampler_stats); None on a service."""
    stats = getattr(sampler, "sampler_stats", None)
    return stats() if callable(stats) else None


def sampler_metrics(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float]:
    """What the local sampler did during a step: prompt tokens, those it prefilled, and the share
    of prompt tokens read from its prefix cache (multi-turn episodes: most of each later turn)."""
    if before is None or after is None:
        return {}
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    return {"sampler/prompt_tokens": prompt,
            "sampler/prefilled_tokens": after["prefilled_tokens"] - before["prefilled_tokens"],
            "sampler/prefix_hit_rate": (after["prefix_hit_tokens"] - before["prefix_hit_tokens"]) / prompt if prompt else 0.0,
            "sampler/prefix_evictions": after["prefix_evictions"] - before["prefix_evictions"]}


def stop_if_rewards_fail(run: Run, batch: Batch, step: int, state_at_start: checkpoint.LoopState) -> None:
    """Record the step's reward failures; above ``max_failure_rate``, checkpoint the state at the
    step's start and stop, so a rerun after fixing the reward repeats exactly this step."""
    run.log.log_failures({"step": step, "group": f.item_index, "sample": f.sample, "error": f.error,
                          "traceback": f.traceback} for f in batch.failures)
    n_rollouts = sum(len(g.rewards) for g in batch.groups)
    n_failed = sum(not math.isfinite(x) for g in batch.groups for x in g.rewards)
    if n_rollouts and n_failed / n_rollouts > run.cfg.max_failure_rate:
        path = checkpoint.save(run.training_client, run.run_dir, run.log, state_at_start)
        raise RewardFailureError(
            f"{n_failed} of {n_rollouts} rewards failed at step {step}, above max_failure_rate="
            f"{run.cfg.max_failure_rate}; tracebacks are in {run.run_dir / 'failures.jsonl'}. "
            f"Checkpoint saved at {path}: fix the reward and rerun the same command to resume.")


def learn(run: Run, batch: Batch, advantages: list[list[float]], step: int) -> dict[str, float]:
    """Chosen samples -> (reference logprobs) -> Datums -> one optimizer step, from the batch and
    its per-group advantages. Returns the step's metrics."""
    cfg = run.cfg
    t_train = time.perf_counter()
    samples = select_for_training(batch.groups, advantages, cfg.skip_flat_groups, cfg.overlong)
    ref_logprobs = reference_logprobs(run.reference, samples) if run.reference is not None and samples else None
    datums, kl_metrics = build_datums(samples, cfg.loss_fn, cfg.loss_agg, cfg.kl_penalty_coef, ref_logprobs)
    metrics = rollout_metrics(run, batch, samples)
    metrics.update(kl_metrics)
    metrics.update(train(run.training_client, datums, samples, cfg, step))
    metrics.update(batch.timing)
    metrics["time/train"] = time.perf_counter() - t_train
    metrics["tokens/trained"] = float(sum(d.model_input.length for d in datums))
    return metrics


def reference_logprobs(reference: SamplingClient, samples: list[TrainSample]) -> list[list[float]]:
    """Logprobs of each sample's tokens under the base model (adapter disabled), for the KL penalty."""
    futures = [reference.compute_logprobs(ModelInput.from_ints(s.prompt_tokens + s.rollout.tokens)) for s in samples]
    return [[float(x) for x in future.result()[len(s.prompt_tokens):]]
            for s, future in zip(samples, futures, strict=True)]


def train(training_client: TrainingClient, datums: list[Datum], samples: list[TrainSample], cfg: GRPOConfig,
          step: int) -> dict[str, float]:
    lr = cfg.lr_at(step)
    metrics: dict[str, float] = {"lr": lr, "temperature": cfg.temperature_at(step), "datums": float(len(datums))}
    if not datums:  # every group was flat: nothing to learn from this batch
        return metrics
    adam = AdamParams(learning_rate=lr, beta1=cfg.betas[0], beta2=cfg.betas[1], eps=cfg.eps,
                      weight_decay=cfg.weight_decay, grad_clip_norm=cfg.grad_clip_norm)
    # Submitted back to back: a remote service pipelines them; locally they queue in order.
    fb_future = training_client.forward_backward(datums, cfg.loss_fn, cfg.loss_fn_config or None)
    opt_future = training_client.optim_step(adam)
    fb, opt = fb_future.result(), opt_future.result()
    metrics["loss"] = fb.metrics.get("loss:sum", math.nan)
    metrics["grad_norm"] = (opt.metrics or {}).get("grad_norm", math.nan) if opt is not None else math.nan

    # How far the trainer's logprobs are from the sampler's on the same tokens: ~0 when on-policy.
    diffs = []
    for sample, out in zip(samples, fb.loss_fn_outputs, strict=True):
        train_lp = out["logprobs"].tolist()[len(sample.prompt_tokens) - 1:]
        diffs.extend(q - p for q, p, m in zip(sample.rollout.logprobs, train_lp, sample.rollout.model_mask,
                                              strict=True) if m)  # model-written tokens only
    if diffs:
        metrics.update(mismatch_metrics(diffs, (cfg.loss_fn_config or {}).get(TIS_CAP)))
    sampled_lp = [q for s in samples for q, m in zip(s.rollout.logprobs, s.rollout.model_mask, strict=True) if m]
    metrics["entropy"] = fb.metrics.get("entropy:mean", -sum(sampled_lp) / max(1, len(sampled_lp)))
    return metrics


# --------------------------------------------------------------------------- metrics and logs


def mismatch_metrics(diffs: list[float], tis_cap: float | None) -> dict[str, float]:
    """How far the sampler's logprobs ``q`` are from the trainer's ``p`` on the sampled tokens,
    from ``diffs = q - p``: ~0 on-policy in one precision, bf16 rounding when sampling in bf16.

    ``kl/sample_train`` is KL(sampler || trainer) by its plain estimator mean(q - p) (unbiased, may
    dip below 0); ``mismatch/kl_k3`` by mean(r - 1 - log r), r = exp(p - q) (never negative, lower
    variance); ``logprob/max_abs_diff`` the worst token; ``mismatch/tis_capped`` the share of tokens
    whose ratio the truncated importance weight caps (loss_fn_config.tis_cap, grpo/api/losses.py).
    """
    ratios = [math.exp(min(-d, 50.0)) for d in diffs]  # exp(p - q); a prompt-sized outlier cannot overflow
    metrics = {"kl/sample_train": sum(diffs) / len(diffs),
               "logprob/max_abs_diff": max(abs(d) for d in diffs),
               "mismatch/kl_k3": sum(r - 1 + d for r, d in zip(ratios, diffs, strict=True)) / len(diffs)}
    if tis_cap is not None:
        metrics["mismatch/tis_capped"] = sum(r > tis_cap for r in ratios) / len(ratios)
    return metrics



def rollout_metrics(run: Run, batch: Batch, samples: list[TrainSample]) -> dict[str, float]:
    """Reward, accuracy and group statistics of the first wave (the adapter's own rewards)."""
    first = batch.first_wave
    rollouts = [r for g in first for r in g.group.rollouts]
    rewards = [x for g in first for x in g.rewards if math.isfinite(x)]
    mean = sum(rewards) / len(rewards) if rewards else math.nan
    std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards)) if rewards else math.nan
    correct_by_group = [[run.adapter.is_correct(x, g.group.item) for x in g.rewards if math.isfinite(x)]
                        for g in first]
    all_rewards = [x for g in batch.groups for x in g.rewards]
    n_groups = max(1, len(first))
    metrics = {
        "reward/mean": mean,
        "reward/std": std,
        "accuracy": sum(sum(c) for c in correct_by_group) / len(rewards) if rewards else math.nan,
        "groups/all_correct": sum(bool(c) and all(c) for c in correct_by_group) / n_groups,
        "groups/all_wrong": sum(not any(c) for c in correct_by_group) / n_groups,
        "groups/mixed": sum(any(c) and not all(c) for c in correct_by_group) / n_groups,
        "groups/flat": sum(is_flat(training_rewards(g, run.cfg.overlong)) for g in first) / n_groups,
        "groups/trained": float(len({id(s.group) for s in samples})),
        "tokens/sampled": float(sum(r.num_model_tokens for g in batch.groups for r in g.group.rollouts)),
        "response/mean_length": sum(len(r.tokens) for r in rollouts) / max(1, len(rollouts)),
        "response/truncation_rate": sum(r.truncated for r in rollouts) / max(1, len(rollouts)),
        "failures/count": float(sum(not math.isfinite(x) for x in all_rewards)),
        "failures/rate": sum(not math.isfinite(x) for x in all_rewards) / max(1, len(all_rewards)),
    }
    sums: dict[str, list[float]] = {}
    for g in first:
        for x, sample_metrics in zip(g.rewards, g.metrics, strict=True):
            if math.isfinite(x):
                for key, value in sample_metrics.items():
                    sums.setdefault(key, []).append(value)
    metrics.update({f"adapter/{k}": sum(v) / len(v) for k, v in sums.items()})
    metrics.update(episode_metrics(rollouts))  # turns, tool calls, tool errors (AgentAdapter only)
    return metrics


def log_step(run: Run, batch: Batch, advantages: list[list[float]], metrics: dict[str, float], step: int) -> None:
    """metrics.jsonl, rollouts.jsonl, the console sample, and the adapter's own evaluate() hook."""
    metrics["throughput/tokens_per_s"] = (metrics["tokens/sampled"] + metrics["tokens/trained"]) / metrics["time/step"]
    run.log.log_metrics(step, metrics)
    rows = rollout_rows(batch, advantages, run.cfg, run.tokenizer, step)
    run.log.log_rollouts(rows)
    if run.cfg.show_sample_every and step % run.cfg.show_sample_every == 0 and rows:
        run.log.show_sample(step, rows[0])
    run.adapter.evaluate(step, [x for g in batch.first_wave for x in g.rewards if math.isfinite(x)],
                         int(metrics["datums"]))


def rollout_rows(batch: Batch, advantages: list[list[float]], cfg: GRPOConfig, tokenizer: Any,
                 step: int) -> list[dict[str, Any]]:
    """rollouts.jsonl lines: the adapter's reward and, beside it, the advantage training used."""
    rows: list[dict[str, Any]] = []
    for gi, (scored, group_adv) in enumerate(zip(batch.groups, advantages, strict=True)):
        prompt = tokenizer.decode(scored.group.prompt_tokens, skip_special_tokens=False)
        for si, (r, reward, advantage) in enumerate(zip(scored.group.rollouts, scored.rewards, group_adv, strict=True)):
            if 0 <= cfg.rollouts_per_step <= len(rows):
                return rows
            rows.append({"step": step, "group": gi, "sample": si, "prompt": prompt, "response": r.text,
                         "reward": reward if math.isfinite(reward) else None, "advantage": advantage,
                         "truncated": r.truncated, "num_tokens": len(r.tokens)})
            if r.episode is not None:  # the episode's trace: turns, tool calls, results, errors
                rows[-1].update(r.episode.to_json())
    return rows
