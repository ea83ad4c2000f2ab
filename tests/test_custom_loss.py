"""forward_backward_custom on the tiny model: the docs' three loss shapes against autograd.

The reference computes each datum's target logprobs with a plain forward pass *with* autograd,
applies the same loss function and calls backward; the adapter's gradient after
forward_backward_custom must equal that one, and the reported loss its value.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F
from backend_helpers import adapter_tensors, next_token_datum, perturb_adapter

from grpo import types
from grpo.backends.local import ServiceClient

PROMPT = [1, 504, 3458, 314, 253, 1345, 28]
CHOSEN = [216, 1023, 30, 4589, 17, 2]
REJECTED = [744, 98, 12, 2]


@pytest.fixture(scope="module")
def svc(tmp_path_factory) -> ServiceClient:
    return ServiceClient(checkpoint_dir=tmp_path_factory.mktemp("ckpt"), device="cpu", dtype="float32")


def new_client(svc: ServiceClient, seed: int):
    client = svc.create_lora_training_client("tiny", seed=seed, rank=4)
    perturb_adapter(client, seed + 100)  # LoRA B = 0 would make A's gradient vanish
    return client


def clear_grads(client) -> None:
    with client.engine.lock:
        for p in client.engine.adapter_parameters(client.adapter).values():
            p.grad = None


def reference(client, data: list[types.Datum], loss_fn) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss value and adapter gradient by plain autograd through the model."""
    clear_grads(client)
    with client.engine.use(client.adapter):
        model = client.engine.causal_lm()
        logprobs = []
        for d in data:
            logits = model(input_ids=torch.tensor([d.model_input.to_ints()])).logits[0].float()
            targets = torch.tensor(d.loss_fn_inputs["target_tokens"].tolist())
            # in float64: the reference must be more exact than what it checks. A variance's gradient
            # reads the last bits of the unembedding's softmax: float32's log_softmax then exp (the
            # trainer's PyTorch path) is 4e-7 off on lm_head's LoRA B here, the native one 6e-9.
            logprobs.append(torch.log_softmax(logits.double(), -1).gather(-1, targets[:, None])[:, 0].float())
        loss, _ = loss_fn(data, logprobs)
        loss.backward()
    grads = adapter_tensors(client, "grad")
    clear_grads(client)
    return float(loss), grads


def assert_same_gradient(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    scale = max(float(w.abs().max()) for w in want.values())
    assert scale > 1e-6  # the loss does reach the adapter
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=1e-4, atol=1e-5 * scale), name


def weighted(prompt: list[int], response: list[int], **extra) -> types.Datum:
    n_prompt = len(prompt) - 1
    return next_token_datum(prompt + response, weights=[0.0] * n_prompt + [1.0] * len(response), **extra)


def sum_of_squares(data, logprobs):
    loss = sum((lp ** 2).sum() for lp in logprobs)
    return loss, {"squares": float(loss)}


def variance_across_sequences(data, logprobs):
    means = torch.stack([(lp * d.loss_fn_inputs["weights"].to_torch()).sum() / d.loss_fn_inputs["weights"].to_torch().sum()
                         for d, lp in zip(data, logprobs, strict=True)])
    return means.var(), {"mean_logprob": float(means.mean().detach())}


def dpo(data, logprobs, beta: float = 0.1):
    """Bradley-Terry / DPO on (chosen, rejected) pairs, with reference logprobs as a loss input."""
    scores = [((lp - d.loss_fn_inputs["ref_logprobs"].to_torch()) * d.loss_fn_inputs["weights"].to_torch()).sum()
              for d, lp in zip(data, logprobs, strict=True)]
    margins = torch.stack([scores[i] - scores[i + 1] for i in range(0, len(scores), 2)])
    loss = -F.logsigmoid(beta * margins).mean()
    return loss, {"accuracy": float((margins > 0).float().mean())}


def test_sum_of_squared_logprobs_matches_autograd(svc) -> None:
    client = new_client(svc, 1)
    data = [next_token_datum(PROMPT + CHOSEN), next_token_datum(PROMPT[:4] + REJECTED)]
    want_loss, want = reference(client, data, sum_of_squares)
    out = client.forward_backward_custom(data, sum_of_squares).result()
    assert_same_gradient(adapter_tensors(client, "grad"), want)
    assert out.metrics["loss:sum"] == pytest.approx(want_loss, rel=1e-5)
    assert out.metrics["squares"] == pytest.approx(want_loss, rel=1e-5)
    assert [len(o["logprobs"]) for o in out.loss_fn_outputs] == [len(d.loss_fn_inputs["target_tokens"]) for d in data]


def test_variance_across_sequences_matches_autograd(svc) -> None:
    client = new_client(svc, 2)
    data = [weighted(PROMPT, CHOSEN), weighted(PROMPT, REJECTED), weighted(PROMPT[:3], CHOSEN[:3])]
    want_loss, want = reference(client, data, variance_across_sequences)
    out = client.forward_backward_custom(data, variance_across_sequences).result()
    assert_same_gradient(adapter_tensors(client, "grad"), want)
    assert out.metrics["loss:sum"] == pytest.approx(want_loss, rel=1e-4)


def test_dpo_on_pairs_matches_autograd_and_async_twin_agrees(svc) -> None:
    client = new_client(svc, 3)
    gen = torch.Generator().manual_seed(0)

    def pair_datum(response):
        n = len(PROMPT) - 1 + len(response)
        return weighted(PROMPT, response, ref_logprobs=(-torch.rand(n, generator=gen) * 5).tolist())

    data = [pair_datum(CHOSEN), pair_datum(REJECTED), pair_datum(CHOSEN[:4]), pair_datum(REJECTED[:2])]
    want_loss, want = reference(client, data, dpo)
    out = client.forward_backward_custom(data, dpo).result()
    assert_same_gradient(adapter_tensors(client, "grad"), want)
    assert out.metrics["loss:sum"] == pytest.approx(want_loss, rel=1e-5)
    assert 0.0 <= out.metrics["accuracy"] <= 1.0

    clear_grads(client)

    async def run():
        return await (await client.forward_backward_custom_async(data, dpo))

    again = asyncio.run(run())
    assert again.metrics["loss:sum"] == pytest.approx(want_loss, rel=1e-5)
    assert_same_gradient(adapter_tensors(client, "grad"), want)


def test_custom_loss_accumulates_with_builtin_losses_and_trains(svc) -> None:
    # Gradients add up across calls until optim_step, as for forward_backward.
    client = new_client(svc, 4)
    data = [weighted(PROMPT, CHOSEN)]
    client.forward_backward(data, "cross_entropy").result()
    ce = adapter_tensors(client, "grad")

    def neg_ll(data, logprobs):  # the cross_entropy loss, written as a custom loss
        return -sum((lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs, strict=True)), {}

    client.forward_backward_custom(data, neg_ll).result()
    both = adapter_tensors(client, "grad")
    assert_same_gradient(both, {k: 2 * v for k, v in ce.items()})
    before = client.forward(data, "cross_entropy").result().metrics["loss:sum"]
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = client.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert after < before


def test_custom_loss_errors_name_the_problem(svc) -> None:
    client = new_client(svc, 5)
    data = [next_token_datum(PROMPT + CHOSEN)]
    with pytest.raises(TypeError, match=r"must return \(loss, metrics\)"):
        client.forward_backward_custom(data, lambda d, lp: lp[0].sum()).result()
    with pytest.raises(TypeError, match="computed from the logprobs"):
        client.forward_backward_custom(data, lambda d, lp: (torch.tensor(1.0), {})).result()
    with pytest.raises(ValueError, match="needs target_tokens"):
        client.forward_backward_custom([types.Datum(types.ModelInput.from_ints([1, 2]))], sum_of_squares)
    with pytest.raises(ValueError, match="loss_type_input"):
        client.forward_backward_custom(data, sum_of_squares, loss_type_input="logits")
    # A failed custom call leaves later calls working (the worker is not wedged).
    assert client.forward(data, "cross_entropy").result().metrics["loss:sum"] > 0
