"""A tour of the Tinker SDK's API, run in this process with ``import grpo as tinker``.

Everything below is written with the SDK's names only (nothing grpo-specific but the import and
the checkpoint directory), so the same calls run against the Tinker service with ``import tinker``:
server capabilities, sampling, a few cross_entropy SFT steps, each built-in RL loss, a custom loss,
saving / listing / TTL / downloading checkpoints, and resuming with the optimizer state.

    python scripts/tinker_tour.py                      # the packaged SmolLM2-135M, ~1 min on CPU
    python scripts/tinker_tour.py --base-model tiny    # the random tiny test model, seconds

Exits non-zero (an AssertionError naming the check) if any step does not do what the SDK says.
"""

from __future__ import annotations

import argparse
import asyncio
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

import grpo as tinker
from grpo import types


def datum(prompt: list[int], completion: list[int], **per_completion_token: list[float]) -> types.Datum:
    """Next-token datum over prompt + completion; prompt positions get weight 0."""
    tokens = prompt + completion
    n_prompt = len(prompt) - 1
    inputs = {"target_tokens": tokens[1:], "weights": [0.0] * n_prompt + [1.0] * len(completion)}
    for key, values in per_completion_token.items():
        inputs[key] = [0.0] * n_prompt + list(values)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


async def tour(base_model: str, checkpoint_dir: Path, max_tokens: int) -> None:
    service = tinker.ServiceClient(checkpoint_dir=checkpoint_dir)

    # --- server capabilities
    capabilities = await service.get_server_capabilities_async()
    names = [m.model_name for m in capabilities.supported_models]
    print("supported models:", ", ".join(names))
    assert "smollm2" in names

    # --- a LoRA training client and its tokenizer
    training = await service.create_lora_training_client_async(base_model=base_model, rank=8, seed=0)
    tokenizer = training.get_tokenizer()
    prompt = tokenizer.encode("Q: What is 2+3?\nA:")
    answer = tokenizer.encode(" 5") + [tokenizer.eos_token_id]

    # --- supervised fine-tuning: a few cross_entropy steps (both futures submitted before waiting)
    sft = [datum(prompt, answer)]
    losses = []
    for _ in range(4):
        fwd_bwd = await training.forward_backward_async(sft, "cross_entropy")
        optim = await training.optim_step_async(types.AdamParams(learning_rate=5e-3))
        losses.append((await fwd_bwd).metrics["loss:sum"])
        await optim
    print("SFT loss per step:", " ".join(f"{x:.3f}" for x in losses))
    assert losses[-1] < losses[0], losses

    # --- sampling from the current weights
    sampler = training.save_weights_and_get_sampling_client()
    print("sampler base model:", sampler.get_base_model())
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1, stop=["\n"])
    response = await sampler.sample_async(prompt=types.ModelInput.from_ints(prompt), num_samples=4,
                                          sampling_params=params)
    completions = [s.tokens for s in response.sequences]
    for s in response.sequences:
        print(f"  sample ({s.stop_reason}): {tokenizer.decode(s.tokens)!r}")
    assert all(len(s.tokens) == len(s.logprobs) for s in response.sequences)

    # --- each built-in RL loss on the samples, rewarded for saying 5 (advantages centred)
    rewards = [1.0 if "5" in tokenizer.decode(c) else 0.0 for c in completions]
    mean = sum(rewards) / len(rewards)
    rl = [datum(prompt, c, logprobs=s.logprobs, advantages=[r - mean + 0.1] * len(c))
          for c, s, r in zip(completions, response.sequences, rewards, strict=True) if c]
    for loss_fn, config in (("importance_sampling", None), ("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
                            ("cispo", None), ("dro", {"beta": 0.05})):
        out = training.forward_backward(rl, loss_fn, config).result()
        training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        print(f"{loss_fn} loss:sum {out.metrics['loss:sum']:.4f}")

    # --- a custom loss: the docs' variance of per-sequence mean logprobs
    def variance_loss(data, logprobs):
        import torch

        means = torch.stack([(lp * d.loss_fn_inputs["weights"].to_torch()).sum() / d.loss_fn_inputs["weights"].to_torch().sum()
                             for d, lp in zip(data, logprobs, strict=True)])
        return means.var(), {"mean_logprob": float(means.mean().detach())}

    custom = training.forward_backward_custom(rl + sft, variance_loss).result()
    training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    print(f"custom loss {custom.metrics['loss:sum']:.5f}, mean logprob {custom.metrics['mean_logprob']:.3f}")

    # --- checkpoints: save, list, TTL, publish, download
    state_path = training.save_state("tour-state", ttl_seconds=3600).result().path
    sampler_path = training.save_weights_for_sampler("tour-sampler").result().path
    run_id = types.ParsedCheckpointTinkerPath.from_tinker_path(state_path).training_run_id
    print("saved", state_path, "and", sampler_path)
    rest = service.create_rest_client()
    listed = rest.list_checkpoints(run_id).result().checkpoints
    for c in listed:
        print(f"  {c.checkpoint_type:8s} {c.tinker_path} {c.size_bytes} bytes, expires {c.expires_at}")
    assert {c.tinker_path for c in listed} == {state_path, sampler_path}
    rest.set_checkpoint_ttl_from_tinker_path(sampler_path, 7 * 24 * 3600).result()
    rest.publish_checkpoint_from_tinker_path(sampler_path).result()
    mine = {c.tinker_path: c for c in rest.list_user_checkpoints().result().checkpoints}
    assert mine[sampler_path].public and mine[sampler_path].expires_at is not None
    info = rest.get_weights_info_by_tinker_path(sampler_path).result()
    print(f"weights info: base {info.base_model}, LoRA rank {info.lora_rank}")

    archive = rest.get_checkpoint_archive_url_from_tinker_path(sampler_path).result()
    with tempfile.TemporaryDirectory() as tmp:
        urllib.request.urlretrieve(archive.url, Path(tmp) / "checkpoint.tar")
        with tarfile.open(Path(tmp) / "checkpoint.tar") as tar:
            names = sorted(tar.getnames())
    urls = (await rest.get_external_weights_urls_async(sampler_path)).urls
    print("archive holds", names, "; per-file URLs for", sorted(urls))
    assert "adapter_model.safetensors" in names and set(urls) == set(names)
    assert urllib.parse.urlparse(urls["adapter_config.json"]).scheme == "file"

    # --- resume with the optimizer state: the next step lands where the original's does
    resumed = service.create_training_client_from_state_with_optimizer(state_path).result()
    after = []
    for client in (training, resumed):
        client.forward_backward(sft, "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        after.append(client.forward(sft, "cross_entropy").result().metrics["loss:sum"])
    print(f"after one more step: original {after[0]:.6f}, resumed {after[1]:.6f}")
    assert abs(after[0] - after[1]) <= 1e-5 * max(1.0, abs(after[0])), after

    rest.delete_checkpoint_from_tinker_path(state_path).result()
    service.close("success").result()
    print("tour complete")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-model", default="smollm2")
    parser.add_argument("--checkpoint-dir", default=None, help="default: a temporary directory")
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(tour(args.base_model, Path(args.checkpoint_dir or tmp), args.max_tokens))


if __name__ == "__main__":
    main()
