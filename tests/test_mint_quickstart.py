"""The minimal RL loop of the MinT docs, written as a MinT user writes it, on the packaged
SmolLM2 model: ``import grpo as mint`` must be a drop-in for ``import mint`` here."""

from __future__ import annotations

import math

import pytest


@pytest.mark.slow
def test_minimal_rl_loop_from_the_mint_docs_runs_as_written(tmp_path) -> None:
    import grpo as mint
    from grpo import types

    service_client = mint.ServiceClient(checkpoint_dir=tmp_path)
    training_client = service_client.create_lora_training_client(
        base_model="smollm2", rank=16, train_mlp=True, train_attn=True, train_unembed=True,
    )
    tokenizer = training_client.get_tokenizer()
    adam_params = types.AdamParams(learning_rate=2e-5)

    questions = [("What is 2 + 3?", "5"), ("What is 4 + 4?", "8")]
    losses, ratios = [], []
    for step in range(2):
        sampling_client = training_client.save_weights_and_get_sampling_client(name=f"rl-step-{step}")
        training_datums: list[types.Datum] = []
        for question, answer in questions:
            # transformers v5 returns a BatchEncoding here; the docs pass it straight on.
            prompt_tokens = tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], tokenize=True, add_generation_prompt=True)
            prompt = types.ModelInput.from_ints(prompt_tokens)
            result = sampling_client.sample(
                prompt=prompt, num_samples=8,
                sampling_params=types.SamplingParams(max_tokens=24, temperature=1.0,
                                                     stop_token_ids=[tokenizer.eos_token_id]),
            ).result()
            assert len(result.sequences) == 8
            rewards = [1.0 if answer in tokenizer.decode(s.tokens) else 0.0 for s in result.sequences]
            mean = sum(rewards) / len(rewards)
            for seq, reward in zip(result.sequences, rewards, strict=True):
                assert seq.stop_reason in ("stop", "length")
                if seq.stop_reason == "stop":
                    assert seq.tokens[-1] == tokenizer.eos_token_id
                else:
                    assert len(seq.tokens) == 24
                # The docs' per-token layout: prompt masked with weight 0, response weight 1.
                prompt_ids = prompt.to_ints()
                tokens = prompt_ids + seq.tokens
                n_prompt = len(prompt_ids) - 1
                advantage = reward - mean if mean not in (0.0, 1.0) else 0.5  # keep every datum live
                training_datums.append(types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tokens[1:],
                        "weights": [0.0] * n_prompt + [1.0] * len(seq.tokens),
                        "logprobs": [0.0] * n_prompt + seq.logprobs,
                        "advantages": [0.0] * n_prompt + [advantage] * len(seq.tokens),
                    },
                ))
        fb = training_client.forward_backward(training_datums, loss_fn="importance_sampling").result()
        opt = training_client.optim_step(adam_params).result()
        losses.append(fb.metrics["loss:sum"])
        assert math.isfinite(fb.metrics["loss:sum"]) and opt.metrics["grad_norm"] > 0
        # On-policy: the trainer's logprobs of sampled tokens equal the sampler's (ratio 1).
        for datum, out in zip(training_datums, fb.loss_fn_outputs, strict=True):
            w = datum.loss_fn_inputs["weights"].tolist()
            q = datum.loss_fn_inputs["logprobs"].tolist()
            lp = out["logprobs"].tolist()
            ratios.extend(math.exp(a - b) for a, b, wi in zip(lp, q, w, strict=True) if wi > 0)
    assert max(abs(r - 1.0) for r in ratios) < 1e-3
    path = training_client.save_weights_for_sampler("final").result().path
    assert path.startswith("tinker://") and path.endswith("/sampler_weights/final")
    assert (service_client.store.resolve(path) / "adapter_config.json").exists()
