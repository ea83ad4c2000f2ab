"""Model families beyond the Llama shape, through the local backend: what the sampler draws, the
logprobs the sampling client computes and the ones the trainer computes agree on the same tokens.

Each family here once disagreed (sampled logprobs against the trainer's, tiny random models,
fp32): Gemma 2's eager attention read a boolean decode mask as an additive one (0.23 apart),
GPT-OSS's too, and its sinks were dropped by packed attention (0.13); Phi-4-mini's q, k and v,
sliced from one fused projection, were read as contiguous by the packed-attention kernel (0.35);
Mixtral's window was dropped by the routed training attention (0.20); Granite's and Cohere's
logits are scaled after the unembedding, which the trainer skipped (0.34, 0.41). StableLM's and
Falcon's decoders did not pack sequences (the first keeps the attention interface's arguments
from its layers, the second attends by its own code): training failed; they trained padded, and
StableLM packs since 2026-12-01 (its attention finds the thread's running pass).
A multimodal Gemma 3 checkpoint (4B and up) failed to load: its sizes are in a nested config.
"""

from __future__ import annotations

import pytest
import torch
from backend_helpers import perturb_adapter
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from grpo import models
from grpo.backends.local import ServiceClient
from grpo.backends.local.logit_head import ScaledLogits, check_logit_head, logit_head
from grpo.types import Datum, ModelInput, SamplingParams

SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
# 16 tokens: a prefix the trainer shares among a group's rows; the 10 sampled after it run past
# every window of 4
PROMPT = [1, 504, 3458, 314, 253, 1345, 28, 9906, 42, 43, 44, 45, 46, 47, 48, 49]

FAMILIES = {  # name: (config class, causal LM class, config arguments)
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, sliding_window=4)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                                                          sliding_window=4)),
    "phi4_mini": ("Phi3Config", "Phi3ForCausalLM", dict(partial_rotary_factor=0.75, sliding_window=None)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(sliding_window=4, num_local_experts=4,
                                                            num_experts_per_tok=2)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                                                            attention_multiplier=0.015625, logits_scaling=8.0)),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}),
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(num_kv_heads=2, new_decoder_architecture=True)),
    # Gemma 3 from 4B on is a multimodal checkpoint, which AutoModelForCausalLM loads whole: its
    # sizes sit in a nested text config (the memory budget read them from the top level: loading raised)
    "gemma3_multimodal": ("Gemma3Config", "Gemma3ForConditionalGeneration", {}),
    # Gemma 3's text decoders (270M, 1B) sample through grpo's step for them (gemma_decode.py) where
    # their window holds a row, and through their own forward where it does not
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=16, sliding_window=64)),
    "gemma3_windowed": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=16, sliding_window=4)),
    # a hybrid: Qwen3.5's gated-delta-rule layers keep a recurrent state no slot holds (sampling
    # raised; recurrent_sampler.py samples it), and a prefix cannot be fanned out to a group
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(layer_types=["linear_attention", "full_attention"])),
}


def _answer_weights(length: int) -> torch.Tensor:
    """The loss counts the answer only, as GRPO's datums do: the group's prompt is a prefix the
    trainer runs once for its rows (trainer.plan_sharing)."""
    return torch.cat([torch.zeros(len(PROMPT) - 1), torch.ones(length - len(PROMPT))])


def _save(directory, family: str) -> str:
    import transformers

    config_name, model_name, extra = FAMILIES[family]
    tokenizer = models.load_tokenizer("tiny")
    tokens = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    if family == "gemma3_multimodal":
        config = transformers.Gemma3Config(
            text_config=dict(vocab_size=len(tokenizer), head_dim=16, sliding_window=4, **SIZES),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               image_size=32, patch_size=8),
            mm_tokens_per_image=4, boi_token_index=5, eoi_token_index=6, image_token_index=7, **tokens)
    else:
        sizes = SIZES if family != "falcon" else dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
        config = getattr(transformers, config_name)(vocab_size=len(tokenizer), **tokens, **sizes, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config)
    if family == "gemma2":  # logits past Gemma 2's soft-cap of 30, where leaving it out would show
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(40.0)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_sampler_the_sampling_client_and_the_trainer_agree_on_the_logprobs(tmp_path, family) -> None:
    service = ServiceClient(checkpoint_dir=tmp_path / "checkpoints", device="cpu", dtype="fp32")
    tc = service.create_lora_training_client(_save(tmp_path / family, family), rank=4, seed=0)
    perturb_adapter(tc, seed=3)  # (peft starts LoRA as a no-op, which every path would agree on)
    sampler = tc.save_weights_and_get_sampling_client("weights")
    result = sampler.sample(ModelInput.from_ints(PROMPT), num_samples=3,
                            sampling_params=SamplingParams(max_tokens=10, temperature=1.0, seed=1)).result()
    # the prompt logprobs of every sequence, of one cut two tokens short, and of two prompts that
    # begin otherwise, asked for together: the sequences' shared beginning run once for them
    # (trainer.run_decoder_shared), the two others right-padded to each other in one decoder call
    sequences = [PROMPT + list(sequence.tokens) for sequence in result.sequences]
    others = [[(3 + 5 * i) % 300 for i in range(26)], [(7 + 11 * i) % 300 for i in range(24)]]
    futures = [sampler.compute_logprobs(ModelInput.from_ints(tokens))
               for tokens in [*sequences, sequences[0][:-2], *others]]
    *computed_all, short, other_long, other_short = [future.result() for future in futures]
    assert short[1:] == pytest.approx(computed_all[0][1:-2], abs=1e-5)
    alone = [sampler.compute_logprobs(ModelInput.from_ints(tokens)).result() for tokens in others]
    assert other_long[1:] == pytest.approx(alone[0][1:], abs=1e-5)
    assert other_short[1:] == pytest.approx(alone[1][1:], abs=1e-5)
    data, sampled = [], []
    for sequence, tokens, computed in zip(result.sequences, sequences, computed_all, strict=True):
        assert computed[len(PROMPT):] == pytest.approx(sequence.logprobs, abs=1e-5)
        data.append(Datum(model_input=ModelInput.from_ints(tokens[:-1]),
                          loss_fn_inputs={"target_tokens": torch.tensor(tokens[1:]),
                                          "weights": _answer_weights(len(tokens))}))
        sampled.append(sequence.logprobs)
    assert len({tuple(s.tokens) for s in result.sequences}) > 1
    out = tc.forward(data, "cross_entropy").result()
    for output, logprobs in zip(out.loss_fn_outputs, sampled, strict=True):
        trained = output["logprobs"].to_torch()[len(PROMPT) - 1:]
        assert trained.tolist() == pytest.approx(logprobs, abs=1e-5)


def test_a_multimodal_checkpoints_adapter_covers_its_decoder_not_its_vision_tower(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from grpo.backends.local.engine import LoraSpec, lora_target_modules

    model = AutoModelForCausalLM.from_pretrained(_save(tmp_path / "gemma3", "gemma3_multimodal"))
    assert any(".vision_tower." in name for name, _ in model.named_modules())
    targets = lora_target_modules(model, LoraSpec(rank=4))
    assert len(targets) == 2 * 7 + 1 and all(".language_model." in t or t == "lm_head" for t in targets)


def test_an_adapter_the_bf16_copy_does_not_take_samples_through_the_trainers_model(tmp_path, capsys) -> None:
    """peft puts LoRA on Qwen3-Next's fused expert weights (3D parameters), which the bf16
    sampler's side paths cannot compute (sampling raised): that adapter samples through the
    trainer's model, said once, and its logprobs are the trainer's."""
    import transformers

    tokenizer = models.load_tokenizer("tiny")
    config = transformers.Qwen3NextConfig(vocab_size=len(tokenizer), layer_types=["linear_attention", "full_attention"],
                                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                          shared_expert_intermediate_size=32, **SIZES)
    torch.manual_seed(0)
    transformers.Qwen3NextForCausalLM(config).save_pretrained(tmp_path / "qwen3_next")
    tokenizer.save_pretrained(tmp_path / "qwen3_next")
    service = ServiceClient(checkpoint_dir=tmp_path / "checkpoints", device="cpu", train_dtype="fp32",
                            sample_dtype="bf16")
    tc = service.create_lora_training_client(str(tmp_path / "qwen3_next"), rank=4, seed=0)
    perturb_adapter(tc, seed=3)
    sampler = tc.save_weights_and_get_sampling_client("weights")
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=1)
    for _ in range(2):
        sequence = sampler.sample(ModelInput.from_ints(PROMPT), num_samples=1, sampling_params=params).result().sequences[0]
    assert capsys.readouterr().err.count("sampler copy does not take") == 1
    tokens = PROMPT + list(sequence.tokens)
    out = tc.forward([Datum(model_input=ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": torch.tensor(tokens[1:]),
                                            "weights": _answer_weights(len(tokens))})], "cross_entropy").result()
    trained = out.loss_fn_outputs[0]["logprobs"].to_torch()[len(PROMPT) - 1:]
    assert trained.tolist() == pytest.approx(sequence.logprobs, abs=1e-5)


def test_a_decoder_that_does_not_pack_is_found_by_one_try(tmp_path, capsys) -> None:
    """Falcon attends by code of its own: it trains padded, said once. StableLM's layers do not pass
    the decoder's keyword arguments on to their attention: it finds the pass as the thread's
    running one, and packs (it trained padded before); so does GPT-OSS, its sinks included."""
    from transformers import AutoModelForCausalLM

    from grpo.backends.local import packed_attention

    assert packed_attention.packs_as_alone(LlamaForCausalLM(LlamaConfig(vocab_size=50, **SIZES)))
    falcon = AutoModelForCausalLM.from_pretrained(_save(tmp_path / "falcon", "falcon"))
    assert not packed_attention.packs_as_alone(falcon)
    assert not packed_attention.supports(falcon)
    assert "decoder does not pack sequences in one row (tried once): training on padded" in capsys.readouterr().err
    stablelm = AutoModelForCausalLM.from_pretrained(_save(tmp_path / "stablelm", "stablelm"))
    assert packed_attention.packs_as_alone(stablelm) and packed_attention.supports(stablelm)
    # GPT-OSS's attention sinks are the packed attention's too (it trained padded before 2026-12-01)
    gpt_oss = AutoModelForCausalLM.from_pretrained(_save(tmp_path / "gpt_oss", "gpt_oss"))
    assert packed_attention.supports(gpt_oss)
    assert "does not pack" not in capsys.readouterr().err


def test_the_logit_head_takes_each_familys_step_after_the_unembedding() -> None:
    from transformers import CohereConfig, CohereForCausalLM, Gemma2Config, Gemma2ForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=50, **SIZES))
    assert logit_head(llama) is llama.lm_head
    cohere = logit_head(CohereForCausalLM(CohereConfig(vocab_size=50, logit_scale=0.0625, **SIZES)))
    assert isinstance(cohere, ScaledLogits) and cohere.multiply == 0.0625 and cohere.out_features == 50
    gemma = logit_head(Gemma2ForCausalLM(Gemma2Config(vocab_size=50, head_dim=16, final_logit_softcapping=30.0,
                                                      **SIZES)))
    assert gemma.softcap == 30.0 and gemma.divide is None


def test_gemmas_capped_logits_go_through_the_kernel_where_no_gradient_is_asked(native_ops) -> None:
    """Without a gradient (the sampler's logits, prompt logprobs) the cap is grpo's kernel's, as the
    loss head's; with one, PyTorch's operators, which autograd differentiates."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    gemma = logit_head(Gemma2ForCausalLM(Gemma2Config(vocab_size=50, head_dim=16, final_logit_softcapping=3.0,
                                                      **SIZES)))
    hidden = torch.randn(4, SIZES["hidden_size"], generator=torch.Generator().manual_seed(0)) * 30
    raw = gemma.uncapped(hidden).detach()
    assert raw.abs().max() > 3.0  # (past the cap)
    with torch.no_grad():
        assert torch.equal(gemma(hidden), native_ops.soft_cap_(raw.clone(), 3.0))
    with_grad = gemma(hidden)
    assert with_grad.requires_grad
    torch.testing.assert_close(with_grad.detach(), torch.tanh(raw / 3.0) * 3.0)


def test_the_load_checks_leave_every_modules_mode_as_it_was() -> None:
    from grpo.backends.local import packed_attention

    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, attention_dropout=0.5, **SIZES))
    model.train()
    model.model.layers[0].eval()  # a mix of modes, as a caller may leave it
    before = [m.training for m in model.modules()]
    check_logit_head(model)  # (with dropout on, the two passes would differ: run in eval mode)
    assert packed_attention.packs_as_alone(model)
    assert [m.training for m in model.modules()] == before


def test_a_model_whose_logits_are_computed_otherwise_is_refused_at_load() -> None:
    class DoubledLogits(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    model = DoubledLogits(LlamaConfig(vocab_size=50, **SIZES))
    with pytest.raises(ValueError, match=r"DoubledLogits's forward computes its logits otherwise than grpo's trainer"):
        check_logit_head(model)
    check_logit_head(LlamaForCausalLM(LlamaConfig(vocab_size=50, **SIZES)))  # (its own: accepted)
    assert isinstance(model.lm_head, nn.Linear)
