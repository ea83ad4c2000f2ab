"""run_grpo: sample groups, score them, centre the advantages, train. Read it top to bottom.

Each step:
  1. snapshot the current weights into a sampling client
  2. sample ``group_size`` responses for ``batch_size`` prompts (all requests in flight at once)
  3. score them with the adapter (a failing reward is recorded and left out, never fatal)
  4. advantages = reward - group mean (optionally / std); flat groups carry no signal
  5. Datums: prompt tokens weight 0, response tokens carry the advantage
  6. forward_backward + optim_step, submitted back to back
  7. log metrics and rollouts; evaluate and checkpoint when due
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grpo import checkpoint
from grpo.adapter import RLAdapter
from grpo.advantages import assign_advantages, build_datums, trainable_responses
from grpo.config import GRPOConfig
from grpo.evaluation import evaluate, summary
from grpo.mint_compat import RLConfig, run_rlconfig
from grpo.rollouts import Failure, Group, Response, sample_groups, sampling_seed, score_group
from grpo.runlog import RunLog
from grpo.types import AdamParams, ModelInput, SamplingParams

TIMING_PREFIXES = ("time/", "throughput/")


class RewardFailureError(RuntimeError):
    pass


def run_grpo(adapter: RLAdapter, cfg: Any = None, *, service_client: Any = None, run_dir: str | Path | None = None,
             resolved_config: dict | None = None) -> str:
    """Train a LoRA adapter with GRPO on ``adapter``'s task; return the final weights' path.

    ``cfg`` may be a GRPOConfig, a dict / OmegaConf mapping, or a MinT ``RLConfig``. Rerunning
    with the same ``run_dir`` resumes from its newest checkpoint.
    """
    if isinstance(cfg, RLConfig) and service_client is None:  # a MinT demo's call: its backend rule
        return run_rlconfig(adapter, cfg, run_dir=run_dir)
    cfg = GRPOConfig.from_any(cfg)
    run_dir = Path(run_dir) if run_dir is not None else Path("outputs") / time.strftime("%Y-%m-%d_%H-%M-%S")
    log = RunLog(run_dir, cfg.to_dict(), cfg.steps, progress=cfg.progress, wandb_cfg=cfg.wandb)
    log.write_config(resolved_config or cfg.to_dict())
    if service_client is None:
        from grpo.backends.local import ServiceClient

        service_client = ServiceClient(checkpoint_dir=run_dir / "checkpoints")

    # Data before the model: an adapter with no data should fail in a blink, not after a load.
    train_items = list(adapter.build_dataset())
    if not train_items:
        raise ValueError(f"{type(adapter).__name__}.build_dataset() returned no items")
    eval_items = list(adapter.build_eval_dataset())[: cfg.eval_size]

    training_client = service_client.create_lora_training_client(
        base_model=cfg.base_model, rank=cfg.rank, seed=cfg.seed,
        train_mlp=cfg.train_mlp, train_attn=cfg.train_attn, train_unembed=cfg.train_unembed)
    tokenizer = training_client.get_tokenizer()
    stop = adapter.stop_sequences(tokenizer)
    reference = service_client.create_sampling_client(base_model=cfg.base_model) if cfg.kl_penalty_coef > 0 else None

    state = checkpoint.resume(run_dir, training_client, log)
    if state is None:
        state = checkpoint.LoopState()
        random.seed(cfg.seed)
    else:
        log.print(f"resumed {run_dir} at step {state.step}")
    state.wandb_id = log.start_wandb(state.wandb_id)
    stream = ItemStream(train_items, cfg.seed, state.cursor)
    evals: dict[int, dict[str, float]] = {}  # step -> held-out metrics, for the closing summary
    # True from submitting a step's update until the step is recorded in `state`: the weights
    # and the loop state may disagree then, so an interrupt must not checkpoint.
    updating = False

    try:
        for step in range(state.step, cfg.steps + 1):
            if eval_items and cfg.eval_due(step):
                sampler = training_client.save_weights_and_get_sampling_client(f"eval_{step}")
                evals[step] = evaluate(
                    sampler, adapter, eval_items, tokenizer, seed=cfg.seed, step=step,
                    max_tokens=cfg.eval_max_tokens or cfg.max_tokens, num_samples=cfg.eval_samples,
                    temperature=cfg.eval_temperature, stop=stop, record_failures=log.log_failures,
                    baseline_sampler=lambda: service_client.create_sampling_client(base_model=cfg.base_model))
                log.log_metrics(step, evals[step])
            if step == cfg.steps:
                break

            t_step = time.perf_counter()
            cursor_at_start = stream.cursor
            sampler = training_client.save_weights_and_get_sampling_client(f"step_{step}")
            groups, first_wave, failures, timing = collect_groups(sampler, adapter, stream, tokenizer, stop, cfg, step)
            log.log_failures({"step": step, "group": f.item_index, "sample": f.sample, "error": f.error,
                              "traceback": f.traceback} for f in failures)
            n_responses = sum(len(g.responses) for g in groups)
            n_failed = sum(not r.scored for g in groups for r in g.responses)
            if n_responses and n_failed / n_responses > cfg.max_failure_rate:
                state.step, state.cursor = step, cursor_at_start
                path = checkpoint.save(training_client, run_dir, log, state)
                raise RewardFailureError(
                    f"{n_failed} of {n_responses} rewards failed at step {step}, above max_failure_rate="
                    f"{cfg.max_failure_rate}; tracebacks are in {run_dir / 'failures.jsonl'}. "
                    f"Checkpoint saved at {path}: fix the reward and rerun the same command to resume.")

            assign_advantages(groups, cfg.advantage_norm, cfg.overlong)
            pairs = trainable_responses(groups, cfg.skip_flat_groups, cfg.overlong)
            if reference is not None and pairs:
                attach_reference_logprobs(reference, pairs)
            datums, kl_metrics = build_datums(pairs, cfg.loss_fn, cfg.loss_agg, cfg.kl_penalty_coef)

            t_train = time.perf_counter()
            updating = True
            train_metrics = train(training_client, datums, pairs, cfg, step)
            timing["time/train"] = time.perf_counter() - t_train
            timing["time/step"] = time.perf_counter() - t_step

            metrics = rollout_metrics(adapter, first_wave, groups, pairs, failures)
            metrics.update(kl_metrics)
            metrics.update(train_metrics)
            metrics.update(timing)
            trained_tokens = sum(d.model_input.length for d in datums)
            metrics["throughput/tokens_per_s"] = (metrics["tokens/sampled"] + trained_tokens) / timing["time/step"]
            log.log_metrics(step, metrics)
            log.log_rollouts(rollout_rows(groups, tokenizer, step, cfg.rollouts_per_step))
            adapter.evaluate(step, [r.reward for g in first_wave for r in g.responses if r.scored], len(datums))

            state.step, state.cursor = step + 1, stream.cursor
            updating = False
            if cfg.save_due(step) and step + 1 < cfg.steps:
                checkpoint.save(training_client, run_dir, log, state)
                write_report(run_dir, cfg)

        checkpoint.save(training_client, run_dir, log, state)
        final = training_client.save_weights_for_sampler("final").result().path
        log.log_checkpoint({"step": state.step, "name": "final", "path": str(final), "kind": "final"})
        write_report(run_dir, cfg)
    except KeyboardInterrupt:
        # Ctrl-C mid-step: keep everything before this step, so a rerun repeats only the step.
        if not updating:
            path = checkpoint.save(training_client, run_dir, log, state)
            log.print(f"interrupted in step {state.step}; checkpoint saved at {path}. "
                      "Rerun the same command to resume.")
        else:
            log.print("interrupted during an optimizer update; rerun the same command to resume "
                      "from the last checkpoint.")
        raise
    finally:
        log.close()
    if summary(evals, len(eval_items)):
        log.print(summary(evals, len(eval_items)))
    log.print(f"final adapter: {final}")
    return str(final)


# --------------------------------------------------------------------------- data


class ItemStream:
    """Training items in a fresh seeded shuffle every epoch; position ``cursor`` is all the
    state there is, so resuming needs only that number."""

    def __init__(self, items: Sequence[Any], seed: int, cursor: int = 0):
        self.items = list(items)
        self.seed = seed
        self.cursor = cursor
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.items)))
            random.Random(self.seed * 7919 + epoch).shuffle(order)
            self._orders[epoch] = order
        return self._orders[epoch]

    def take(self, n: int) -> list[tuple[int, Any]]:
        out = []
        for _ in range(n):
            epoch, offset = divmod(self.cursor, len(self.items))
            index = self._order(epoch)[offset]
            out.append((index, self.items[index]))
            self.cursor += 1
        return out


# --------------------------------------------------------------------------- one step's parts


def collect_groups(sampler: Any, adapter: RLAdapter, stream: ItemStream, tokenizer: Any, stop: list,
                   cfg: GRPOConfig, step: int) -> tuple[list[Group], list[Group], list[Failure], dict[str, float]]:
    """Sample and score ``batch_size`` groups; with dynamic sampling, replace flat groups with
    fresh prompts for up to ``dynamic_sampling_waves`` more waves.

    Returns (all groups, the first wave's groups, failures, timings). Policy metrics come from
    the first wave, which is an unbiased sample of the policy's behaviour.
    """
    groups: list[Group] = []
    first_wave: list[Group] = []
    failures: list[Failure] = []
    timing = {"time/sample": 0.0, "time/score": 0.0}
    wanted = cfg.batch_size
    for wave in range(cfg.dynamic_sampling_waves + 1):
        entries = stream.take(wanted)
        prompts = [adapter.make_prompt(item, tokenizer) for _, item in entries]
        t0 = time.perf_counter()
        responses = sample_groups(
            sampler, prompts, cfg.group_size,
            lambda i, wave=wave: SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                                                top_p=cfg.top_p, top_k=cfg.top_k, stop=stop,
                                                seed=sampling_seed(cfg.seed, step, wave, i)),
            tokenizer)
        t1 = time.perf_counter()
        wave_groups = [Group(index, item, prompt, rs) for (index, item), prompt, rs in zip(entries, prompts, responses, strict=True)]
        for group in wave_groups:
            failures.extend(score_group(adapter, group))
        timing["time/sample"] += t1 - t0
        timing["time/score"] += time.perf_counter() - t1
        groups.extend(wave_groups)
        if wave == 0:
            first_wave = wave_groups
        wanted = sum(g.is_flat for g in wave_groups)
        if wanted == 0:
            break
    timing["dynamic/waves"] = float(wave + 1)
    return groups, first_wave, failures, timing


def attach_reference_logprobs(reference: Any, pairs: list[tuple[Group, Response]]) -> None:
    """Logprobs of each response under the base model (adapter disabled), for the KL penalty."""
    futures = [reference.compute_logprobs(ModelInput.from_ints(g.prompt_tokens + r.tokens)) for g, r in pairs]
    for (group, response), future in zip(pairs, futures, strict=True):
        response.ref_logprobs = [float(x) for x in future.result()[len(group.prompt_tokens):]]


def train(training_client: Any, datums: list, pairs: list[tuple[Group, Response]], cfg: GRPOConfig,
          step: int) -> dict[str, float]:
    lr = cfg.lr_at(step)
    metrics: dict[str, float] = {"lr": lr, "datums": float(len(datums))}
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
    for (group, response), out in zip(pairs, fb.loss_fn_outputs, strict=True):
        train_lp = out["logprobs"].tolist()[len(group.prompt_tokens) - 1:]
        diffs.extend(q - p for q, p in zip(response.logprobs, train_lp, strict=True))
    if diffs:
        metrics["kl/sample_train"] = sum(diffs) / len(diffs)
        metrics["logprob/max_abs_diff"] = max(abs(d) for d in diffs)
    sampled_lp = [q for _, r in pairs for q in r.logprobs]
    metrics["entropy"] = fb.metrics.get("entropy:mean", -sum(sampled_lp) / max(1, len(sampled_lp)))
    return metrics


# --------------------------------------------------------------------------- metrics and logs


def rollout_metrics(adapter: RLAdapter, first_wave: list[Group], groups: list[Group],
                    pairs: list[tuple[Group, Response]], failures: list[Failure]) -> dict[str, float]:
    responses = [r for g in first_wave for r in g.responses]
    scored = [r for r in responses if r.scored]
    rewards = [r.reward for r in scored]
    mean = sum(rewards) / len(rewards) if rewards else math.nan
    std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards)) if rewards else math.nan
    correct_by_group = [[adapter.is_correct(r.reward, g.item) for r in g.responses if r.scored] for g in first_wave]
    all_responses = [r for g in groups for r in g.responses]
    n_groups = max(1, len(first_wave))
    metrics = {
        "reward/mean": mean,
        "reward/std": std,
        "accuracy": sum(sum(c) for c in correct_by_group) / len(scored) if scored else math.nan,
        "groups/all_correct": sum(bool(c) and all(c) for c in correct_by_group) / n_groups,
        "groups/all_wrong": sum(not any(c) for c in correct_by_group) / n_groups,
        "groups/mixed": sum(any(c) and not all(c) for c in correct_by_group) / n_groups,
        "groups/flat": sum(g.is_flat for g in first_wave) / n_groups,
        "groups/trained": float(len({id(g) for g, _ in pairs})),
        "tokens/sampled": float(sum(len(r.tokens) for r in all_responses)),
        "response/mean_length": sum(len(r.tokens) for r in responses) / max(1, len(responses)),
        "response/truncation_rate": sum(r.truncated for r in responses) / max(1, len(responses)),
        "failures/count": float(sum(not r.scored for r in all_responses)),
        "failures/rate": sum(not r.scored for r in all_responses) / max(1, len(all_responses)),
    }
    sums: dict[str, list[float]] = {}
    for r in scored:
        for key, value in r.metrics.items():
            sums.setdefault(key, []).append(value)
    metrics.update({f"adapter/{k}": sum(v) / len(v) for k, v in sums.items()})
    return metrics


def rollout_rows(groups: list[Group], tokenizer: Any, step: int, limit: int) -> list[dict[str, Any]]:
    rows = []
    for gi, group in enumerate(groups):
        prompt = tokenizer.decode(group.prompt_tokens, skip_special_tokens=False)
        for si, r in enumerate(group.responses):
            if 0 <= limit <= len(rows):
                return rows
            rows.append({"step": step, "group": gi, "sample": si, "prompt": prompt, "response": r.text,
                         "reward": r.reward if r.scored else None, "advantage": r.advantage,
                         "truncated": r.truncated, "num_tokens": len(r.tokens)})
    return rows


def write_report(run_dir: Path, cfg: GRPOConfig) -> None:
    if not cfg.report:
        return
    try:
        from grpo.report import write_report as _write

        _write(run_dir, png=False)
    except Exception as err:  # a report must never take training down
        print(f"[grpo] report not written: {type(err).__name__}: {err}")
