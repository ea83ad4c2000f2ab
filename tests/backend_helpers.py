"""Helpers shared by the local-backend tests: references computed outside the code under test.

Not a test module (no ``test_`` prefix); imported by the backend's tests (sampling, decoding,
checkpoints, the native layers, the model families).
"""

from __future__ import annotations

import pytest
import torch

from grpo import types


def perturb_adapter(client, seed: int, scale: float = 0.05) -> None:
    """Give the LoRA B matrices random values (peft starts them at zero, where LoRA is a no-op
    and every logprob comparison would pass for a model that ignores the adapter)."""
    gen = torch.Generator().manual_seed(seed)
    state = client.engine.adapter_state(client.adapter)
    for name, tensor in state.items():
        if "lora_B" in name:
            state[name] = torch.randn(tensor.shape, generator=gen, dtype=torch.float32) * scale
    with client.engine.lock:
        client.engine.load_adapter_state(client.adapter, state)
        client.engine.versions[client.adapter] += 1


def plain_logprobs(client, tokens: list[int], targets: list[int]) -> torch.Tensor:
    """log_softmax of one plain forward pass of the adapted model, gathered at ``targets``."""
    with client.engine.use(client.adapter), torch.no_grad():
        model = client.engine.causal_lm()
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(targets)[:, None])[:, 0]


def plain_entropy(client, tokens: list[int]) -> torch.Tensor:
    with client.engine.use(client.adapter), torch.no_grad():
        logits = client.engine.causal_lm()(input_ids=torch.tensor([tokens])).logits[0].float()
        logp = torch.log_softmax(logits, -1)
        return -(logp.exp() * logp).sum(-1)


def adapter_tensors(client, attr: str = "data") -> dict[str, torch.Tensor]:
    """The adapter's weights (or grads) keyed without the adapter name, so clients compare."""
    out = {}
    for name, p in client.engine.adapter_parameters(client.adapter).items():
        value = p.detach() if attr == "data" else p.grad
        out[name.replace(f".{client.adapter}.", ".")] = None if value is None else value.clone()
    return out


def next_token_datum(tokens: list[int], **inputs) -> types.Datum:
    """A datum over tokens[:-1] predicting tokens[1:], with extra per-target inputs."""
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], **inputs})


def rl_datum(prompt: list[int], response: list[int], advantage: float, sampler_logprobs: list[float],
             weight: float = 1.0) -> types.Datum:
    """The datum the GRPO loop builds: prompt targets weighted 0, response targets weighted 1."""
    n_prompt = len(prompt) - 1
    return next_token_datum(
        prompt + response,
        weights=[0.0] * n_prompt + [weight] * len(response),
        logprobs=[0.0] * n_prompt + list(sampler_logprobs),
        advantages=[0.0] * n_prompt + [advantage] * len(response),
    )


# Three prompts of different lengths (7, 3 and 19 tokens) for comparing two ways of decoding.
DECODE_PROMPTS = [[1, 504, 3458, 314, 253, 1345, 28], [1, 9906, 30], [1, *range(42, 60)]]


def sample_each(client, temperature: float, seed: int = 0, prompts=DECODE_PROMPTS) -> list[tuple[list[int], list[float]]]:
    """Three samples of 12 tokens for each prompt (request i seeded ``seed + i``) from ``client``'s
    current weights, all in flight together: each sequence's tokens and logprobs."""
    sampler = client.save_weights_and_get_sampling_client()
    futures = [sampler.sample(types.ModelInput.from_ints(p), 3,
                              types.SamplingParams(max_tokens=12, temperature=temperature, seed=seed + i))
               for i, p in enumerate(prompts)]
    return [(list(s.tokens), list(s.logprobs)) for f in futures for s in f.result().sequences]


def assert_greedy_alike(got: list[tuple], want: list[tuple], bound: float, min_compared: float = 0.5) -> None:
    """Greedy samples of two computations of one model that round differently (``(tokens,
    logprobs, ...)`` each): token for token the same, each logprob within ``bound``, up to where a
    pair parts -- and there only at a near-tie: each path took the top of its distribution, so the
    two tokens' logprobs are within ``bound`` of each other. (A random model's next-token
    distribution is nearly flat: two bf16 roundings of it can order its top two either way.) At
    least ``min_compared`` of the tokens are compared, so a near-tie early on cannot hide the rest."""
    compared = total = 0
    for got_row, want_row in zip(got, want, strict=True):
        (tokens, logprobs, *rest), (want_tokens, want_logprobs, *want_rest) = got_row, want_row
        total += len(want_tokens)
        steps = zip(tokens, logprobs, want_tokens, want_logprobs, strict=False)  # (rows apart: else below)
        for token, logprob, want_token, want_logprob in steps:
            assert abs(logprob - want_logprob) < bound, (token, want_token, logprob, want_logprob)
            if token != want_token:
                break
            compared += 1
        else:
            assert (tokens, rest) == (want_tokens, want_rest)
    assert compared >= min_compared * total, f"only {compared} of {total} tokens compared before near-ties"


def assert_drew_alike(got, want) -> None:
    """Every request of ``got`` drew the tokens and stop reasons of its twin in ``want`` (lists of
    ``sampler.GenerationRequest``s after ``generate``), its logprobs within float32 rounding of theirs
    (the batches and their padding differ)."""
    for a, b in zip(got, want, strict=True):
        for x, y in zip(a.sequences, b.sequences, strict=True):
            assert (x.tokens, x.stop_reason) == (y.tokens, y.stop_reason)
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)


def assert_logprobs_of_a_plain_forward(model, requests_done) -> None:
    """Every sampled token's logprob (``sampler.GenerationRequest``s after ``generate``) equals the
    model's own forward pass over the whole sequence."""
    for req in requests_done:
        for seq in req.sequences:
            ids = torch.tensor([req.prompt + seq.tokens])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, len(req.prompt) - 1:-1].float()
            plain = torch.log_softmax(logits, -1).gather(-1, ids[0, len(req.prompt):, None])[:, 0]
            assert seq.logprobs == pytest.approx(plain.tolist(), abs=1e-5)


# one unit in the last place at 1.0, for comparisons in units of a dtype's rounding
ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7}


# How far a native kernel may be from the eager operators it replaces: float32, sums in another order
# and 1 / sqrt for rsqrt move the last few bits; bf16, one rounding step lands the other way now and then
ROUNDING_ULPS = {torch.float32: 8, torch.bfloat16: 1}


def assert_within_ulps(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, ulps: float) -> None:
    worst = worst_relative_error(got, want)
    assert worst <= ulps * ULP[dtype], f"{worst:.3g} > {ulps} ulps of {dtype}"


def rotary_rows(lengths: torch.Tensor, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's cos and sin ``[rows, dim]`` (rotate_half's layout) at its position ``lengths[r]``."""
    angle = lengths[:, None].float() * torch.linspace(0.1, 1.0, dim // 2)[None]
    angle = torch.cat([angle, angle], -1)
    return angle.cos().to(dtype), angle.sin().to(dtype)


def greedy_rows(model, tokenizer) -> list[tuple[list[int], list[float], str]]:
    """``sampler.generate`` on ``model`` itself: DECODE_PROMPTS, two greedy rows each of up to 16
    tokens, a seventh of the vocabulary ending a row (so rows finish at different steps): each row's
    tokens, logprobs and stop reason."""
    from grpo.backends.local import sampler

    stop = sorted(range(0, len(tokenizer), 7))
    requests = [sampler.GenerationRequest(p, 2, types.SamplingParams(max_tokens=16, temperature=0.0, seed=5 + i,
                                                                     stop=stop))
                for i, p in enumerate(DECODE_PROMPTS)]
    with torch.inference_mode():
        sampler.generate(model, requests, tokenizer, torch.device("cpu"))
    return [(list(s.tokens), list(s.logprobs), s.stop_reason) for r in requests for s in r.sequences]


def worst_relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference relative to the reference's scale (its mean magnitude at least)."""
    got, want = got.float(), want.float()
    scale = want.abs().clamp_min(want.abs().mean())
    return ((got - want).abs() / scale).max().item()


# The decoder families the sampler's lean and native decoding steps take (lean_decode.py), as
# transformers' (config, causal LM) classes: Mistral is Llama with every layer windowed (here
# MistralConfig's default 4,096 tokens, Mistral-7B-v0.1's: longer than any test's rows), Qwen2 is
# Llama with biases on q/k/v, Qwen3 normalises each head of q and k (and here has heads wider than
# hidden / heads, as Qwen3-0.6B's 128 of 1024 / 16).
def _families() -> dict[str, tuple[type, type, dict]]:
    from transformers import (
        GraniteConfig,
        GraniteForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Olmo2Config,
        Olmo2ForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        SmolLM3Config,
        SmolLM3ForCausalLM,
    )

    return {"mistral": (MistralConfig, MistralForCausalLM, {}), "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
            "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32}),
            # q/k/v and gate/up one Linear each; Phi-4-mini rotates 3/4 of each head's dims
            "phi3": (Phi3Config, Phi3ForCausalLM, {"sliding_window": None}),
            # (its LongRoPE: factors past 16 positions, which the tests' rows cross, as Phi-4-mini's past 4,096)
            "phi4_mini": (Phi3Config, Phi3ForCausalLM, {
                "sliding_window": None, "partial_rotary_factor": 0.75, "original_max_position_embeddings": 16,
                "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 6,
                                    "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0], "factor": 128.0,
                                    "original_max_position_embeddings": 16}}),
            # norms after each sublayer, q and k normalised whole, rotation in float32
            "olmo2": (Olmo2Config, Olmo2ForCausalLM, {}),
            # the embedding, each sublayer's output, the scores and the logits scaled
            "granite": (GraniteConfig, GraniteForCausalLM, dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                                                                attention_multiplier=0.015625, logits_scaling=8.0)),
            # its second layer rotates nothing (SmolLM3-3B's every fourth)
            "smollm3": (SmolLM3Config, SmolLM3ForCausalLM, {"no_rope_layers": [1, 0]})}


def save_tiny_model(directory, family: str, seed: int = 0) -> str:
    """A tiny random ``family`` model (``_families``: "mistral", "qwen2", "qwen3", "phi3", ...) of the tiny Llama's sizes and the SmolLM2
    tokenizer, saved in ``directory`` for ``create_lora_training_client(directory)``. Every norm's
    weight and every bias is drawn away from its initial value (ones, zeros), so that a step that
    skipped one would compute something else."""
    from grpo import models

    config_class, model_class, extra = _families()[family]
    tokenizer = models.load_tokenizer("tiny")
    config = config_class(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                          **models.TINY_CONFIG, **extra)
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                parameter.normal_(0.0, 0.1)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def reference_function(module, name: str):
    """transformers' own function ``name`` of ``module``, whether or not an engine loaded in this
    process has fitted it (delta_rule.fit_prefill wraps it for the whole process)."""
    function = getattr(module, name)
    return function.__wrapped__ if getattr(function, "fitted_by_grpo", False) else function


def tiny_qwen3_5(dtype: torch.dtype = torch.float32):
    """A random Qwen3.5 hybrid (three gated-delta-rule layers, one attention; 4 value heads over 2 key
    heads) on the tiny model's tokenizer, in ``dtype``, and that tokenizer."""
    import transformers

    from grpo import models

    tokenizer = models.load_tokenizer("tiny")
    config = transformers.Qwen3_5TextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                            linear_value_head_dim=16,
                                            layer_types=["linear_attention", "linear_attention", "linear_attention",
                                                         "full_attention"])
    torch.manual_seed(0)
    return transformers.Qwen3_5ForCausalLM(config).eval().to(dtype), tokenizer
