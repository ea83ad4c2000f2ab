"""forward_backward_custom: backpropagate any differentiable function of the target logprobs.

The SDK's contract: ``loss_fn(data, logprobs) -> (loss, metrics)``, where ``logprobs`` holds one
tensor per datum, shaped like its ``target_tokens``. Computed in two passes, as the service does,
so the trainer's memory bounds (micro-batches, chunked unembedding) hold for custom losses too:

1. a forward pass gives the logprobs ``lp`` (no autograd through the model);
2. the user's function runs on leaf copies of them; autograd gives ``c = d loss / d lp``;
3. a second pass backpropagates the linear loss ``sum(c * lp)`` through the model. Its gradient
   with respect to the parameters is ``sum(c * d lp / d theta)``, which by the chain rule is the
   custom loss's gradient at these weights: exact, not an approximation.

The linear loss is the registered loss that declares itself ``-sum(w * A * lp)`` over positions
with ``w > 0`` under some config (``LossSpec.linear_config``; the built-in ``dro`` with
``beta = 0``); with ``w = 1`` where ``c != 0`` and ``A = -c`` it is ``sum(c * lp)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpo.api import losses
from grpo.types import Datum, ForwardBackwardOutput

# (datums, one logprob tensor per datum) -> (scalar loss tensor, metrics)
CustomLossFn = Callable[[list[Datum], list[torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]


def surrogate_loss() -> tuple[str, dict[str, float]]:
    """The loss and config whose value on linear_surrogate's datums is ``sum(c * lp)``."""
    return losses.linear_surrogate()


def forward_data(data: list[Datum]) -> list[Datum]:
    """The datums of the forward pass: each one's tokens and target_tokens, nothing else."""
    out = []
    for i, d in enumerate(data):
        if "target_tokens" not in d.loss_fn_inputs:
            raise ValueError(f"data[{i}] has no loss input 'target_tokens'; forward_backward_custom needs target_tokens")
        out.append(Datum(d.model_input, {"target_tokens": d.loss_fn_inputs["target_tokens"]}))
    return out


def loss_gradient(data: list[Datum], loss_fn: CustomLossFn, forward: ForwardBackwardOutput
                  ) -> tuple[float, dict[str, float], list[torch.Tensor]]:
    """Run the user's loss on leaf logprob tensors: its value, its metrics and ``d loss / d lp``
    per datum (flat)."""
    logprobs = []
    for datum, out in zip(data, forward.loss_fn_outputs, strict=True):
        shape = datum.loss_fn_inputs["target_tokens"].shape
        lp = out["logprobs"].to_torch().float()
        logprobs.append((lp.reshape(shape) if shape else lp).clone().requires_grad_(True))
    result = loss_fn(data, logprobs)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError(f"the custom loss function must return (loss, metrics), got {type(result).__name__}")
    loss, metrics = result
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
        raise TypeError("the custom loss function must return a torch tensor computed from the logprobs it was given")
    loss.sum().backward()
    coeffs = [torch.zeros(lp.numel()) if lp.grad is None else lp.grad.detach().reshape(-1).float() for lp in logprobs]
    return float(loss.detach().sum()), {str(k): float(v) for k, v in dict(metrics or {}).items()}, coeffs


def linear_surrogate(forward_datums: list[Datum], forward: ForwardBackwardOutput,
                     coeffs: list[torch.Tensor]) -> list[Datum]:
    """Datums on which surrogate_loss() is ``sum(c * lp)`` (see the module docstring)."""
    return [Datum(d.model_input, {"target_tokens": d.loss_fn_inputs["target_tokens"],
                                  "weights": (c != 0).float().numpy(), "advantages": (-c).numpy(),
                                  "logprobs": out["logprobs"].to_numpy().reshape(-1)})
            for d, c, out in zip(forward_datums, coeffs, forward.loss_fn_outputs, strict=True)]
