"""save_state / load_state / save_weights_for_sampler on the tiny model: exact round trips."""

from __future__ import annotations

import pytest
import torch
from backend_helpers import adapter_tensors, perturb_adapter, rl_datum

from grpo import models, types
from grpo.backends.local import ServiceClient

PROMPT = [1, 504, 3458, 314, 253, 1345, 28]
RESPONSE = [216, 1023, 30, 4589, 17, 2]
DATA = [
    rl_datum(PROMPT, RESPONSE, advantage=1.0, sampler_logprobs=[-4.0] * len(RESPONSE)),
    rl_datum(PROMPT[:3], RESPONSE[:4], advantage=-0.5, sampler_logprobs=[-6.0] * 4),
]
ADAM = types.AdamParams(learning_rate=1e-2, betas=(0.8, 0.95), weight_decay=0.01)


@pytest.fixture(scope="module")
def svc(tmp_path_factory) -> ServiceClient:
    return ServiceClient(checkpoint_dir=tmp_path_factory.mktemp("ckpt"), device="cpu", dtype="float32")


def step(client) -> None:
    client.forward_backward(DATA, "importance_sampling")
    client.optim_step(ADAM).result()


def logprobs(client) -> list[torch.Tensor]:
    out = client.forward(DATA, "importance_sampling").result()
    return [o["logprobs"].to_torch() for o in out.loss_fn_outputs]


def test_save_state_then_load_state_reproduces_logprobs_exactly(svc) -> None:
    client = svc.create_lora_training_client("tiny", seed=1, rank=4)
    step(client)
    step(client)
    path = client.save_state("two_steps").result().path
    assert path == f"tinker://{client.training_run_id}/weights/two_steps"
    assert svc.store.resolve(path).parent.parent.parent == svc.checkpoint_dir
    restored = svc.create_lora_training_client("tiny", seed=2, rank=4)
    assert not all(torch.equal(a, b) for a, b in zip(logprobs(client), logprobs(restored), strict=True))
    restored.load_state(path).result()
    assert all(torch.equal(a, b) for a, b in zip(logprobs(client), logprobs(restored), strict=True))
    want, got = adapter_tensors(client), adapter_tensors(restored)
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_resume_with_optimizer_is_bit_identical_to_an_uninterrupted_run(svc, tmp_path) -> None:
    straight = svc.create_lora_training_client("tiny", seed=3, rank=4)
    perturb_adapter(straight, 4)
    step(straight)
    step(straight)
    path = straight.save_state(str(tmp_path / "mid")).result().path
    step(straight)

    # A new service (a new engine, as after a restart) resumes from the state.
    fresh_service = ServiceClient(checkpoint_dir=tmp_path / "other", device="cpu", dtype="float32")
    resumed = fresh_service.create_training_client_from_state_with_optimizer(path)
    step(resumed)
    want, got = adapter_tensors(straight), adapter_tensors(resumed)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name

    # Without the optimizer state the same step lands elsewhere: the comparison above has teeth.
    weights_only = fresh_service.create_lora_training_client("tiny", seed=3, rank=4)
    weights_only.load_state(path).result()
    step(weights_only)
    other = adapter_tensors(weights_only)
    assert not all(torch.equal(want[k], other[k]) for k in want)


def test_state_saved_before_any_step_resumes_with_a_fresh_optimizer(svc) -> None:
    client = svc.create_lora_training_client("tiny", seed=4, rank=4)
    perturb_adapter(client, 5)
    path = client.save_state("at_start").result().path
    step(client)
    resumed = svc.create_lora_training_client("tiny", seed=9, rank=4)
    resumed.load_state_with_optimizer(path).result()
    step(resumed)
    want, got = adapter_tensors(client), adapter_tensors(resumed)
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_sampler_weights_load_with_peft_and_give_the_same_logprobs(svc) -> None:
    from peft import PeftModel

    client = svc.create_lora_training_client("tiny", seed=5, rank=4)
    perturb_adapter(client, 6)
    step(client)
    path = client.save_weights_for_sampler("for_peft").result().path
    want = logprobs(client)

    model = PeftModel.from_pretrained(models.load_model("tiny", device="cpu"), str(svc.store.resolve(path)))
    model.eval()
    for datum, lp in zip(DATA, want, strict=True):
        tokens = datum.model_input.to_ints()
        targets = datum.loss_fn_inputs["target_tokens"].tolist()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
        got = torch.log_softmax(logits, -1).gather(-1, torch.tensor(targets)[:, None])[:, 0]
        assert torch.allclose(got, lp, atol=1e-5), (got - lp).abs().max()

    # The local sampler loads the same directory and agrees too.
    sampling_client = svc.create_sampling_client(model_path=path)
    seq = DATA[0].model_input.to_ints() + [DATA[0].loss_fn_inputs["target_tokens"].tolist()[-1]]
    got = sampling_client.compute_logprobs(types.ModelInput.from_ints(seq)).result()
    assert torch.allclose(torch.tensor(got[1:]), want[0], atol=1e-5)


def test_load_errors_name_the_problem(svc, tmp_path) -> None:
    client = svc.create_lora_training_client("tiny", seed=6, rank=4)
    path = client.save_weights_for_sampler(str(tmp_path / "sampler_only")).result().path
    other_rank = svc.create_lora_training_client("tiny", seed=6, rank=2)
    with pytest.raises(ValueError, match="has LoRA rank 4, this client has rank 2"):
        other_rank.load_state(path).result()
    with pytest.raises(FileNotFoundError, match="holds no optimizer state"):
        client.load_state_with_optimizer(path).result()
    with pytest.raises(FileNotFoundError, match="is not a grpo training state"):
        client.load_state(str(tmp_path)).result()
    # The failed loads left the client's weights alone.
    assert logprobs(client)


def test_second_adapter_does_not_leak_into_saved_state(svc) -> None:
    # Two clients on one engine; each saved adapter holds only its own LoRA tensors.
    a = svc.create_lora_training_client("tiny", seed=7, rank=4, train_mlp=False, train_unembed=False)
    b = svc.create_lora_training_client("tiny", seed=7, rank=4)
    path = a.save_state("only_a").result().path
    from safetensors.torch import load_file

    keys = set(load_file(svc.store.resolve(path) / "adapter_model.safetensors"))
    assert keys and all("self_attn" in k for k in keys)
    assert len(keys) == len(adapter_tensors(a)) < len(adapter_tensors(b))
