"""The logits a causal LM's forward computes from its decoder's last hidden states, for the trainer.

The trainer does not call the causal LM's forward: it runs the decoder, then unembeds a chunk of
positions at a time (trainer.unembed_counted), so that one chunk of logits exists at once. Most
causal LMs' logits are ``lm_head(hidden)``; some families change them after: Granite divides by
``config.logits_scaling``, Cohere multiplies by its ``logit_scale``, Gemma 2 and 3 soft-cap them
(``cap * tanh(logits / cap)``, ``config.final_logit_softcapping``). ``logit_head(model)`` is the
unembedding with that step, in the model's own order of operations (the cap, on a CPU with grpo's
kernels, by ``soft_cap_``: each value in float32, rounded once, as the sampler's decoding step and
the trainer's loss head cap theirs; PyTorch's three operators are three passes and, in bf16, three
roundings); ``check_logit_head(model)``
compares it with the model's own forward once, at load, and refuses a model whose forward does
something else still -- rather than train it on logprobs its sampler never drew from.
"""

from __future__ import annotations

import torch
from torch import nn

from grpo.backends.local.native_layers import takes_logits
from grpo.backends.local.trial import trial_run
from grpo.models import native_kernels


class ScaledLogits:
    """``lm_head(hidden)``, then the family's step: ``/ divide``, ``* multiply``, or a soft-cap."""

    def __init__(self, lm_head: nn.Module, divide: float | None = None, multiply: float | None = None,
                 softcap: float | None = None):
        self.lm_head, self.divide, self.multiply, self.softcap = lm_head, divide, multiply, softcap
        self.out_features = getattr(lm_head, "out_features", None)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.cap(self.uncapped(hidden))

    def uncapped(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits before the soft-cap (the trainer's loss head caps them itself: trainer.py)."""
        logits = self.lm_head(hidden)
        if self.divide is not None:
            logits = logits / self.divide
        if self.multiply is not None:
            logits = logits * self.multiply
        return logits

    def cap(self, logits: torch.Tensor, native: bool = True) -> torch.Tensor:
        """``softcap * tanh(logits / softcap)`` where the family caps (else ``logits``): in place by
        grpo's kernel where no gradient is asked of it (a CPU, float32 or bf16, kernels built, and
        ``native``), else by PyTorch's operators in the model's own order."""
        if self.softcap is None:
            return logits
        if native and not (torch.is_grad_enabled() and logits.requires_grad) and logits.is_contiguous() \
                and takes_logits(logits):
            return native_kernels.kernels().soft_cap_(logits, self.softcap)
        return torch.tanh(logits / self.softcap) * self.softcap


def logit_head(model: nn.Module) -> nn.Module | ScaledLogits:
    """What turns ``model``'s decoder output into its logits: its output embedding, wrapped where
    the family's forward scales or caps the logits after it."""
    lm_head = model.get_output_embeddings()
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    text = causal_lm.config.get_text_config(decoder=True)
    divide = getattr(text, "logits_scaling", None)  # Granite
    multiply = getattr(causal_lm, "logit_scale", None)  # Cohere
    softcap = getattr(text, "final_logit_softcapping", None)  # Gemma 2, Gemma 3
    if not isinstance(multiply, (int, float)):  # (a learned tensor elsewhere is not this)
        multiply = None
    if divide is None and multiply is None and softcap is None:
        return lm_head
    return ScaledLogits(lm_head, divide, multiply, softcap)


def check_logit_head(model: nn.Module, tokens: int = 6) -> None:
    """Raise where ``logit_head(model)`` over the decoder's output is not the model's own logits on
    a few tokens (a family that computes its logits some other way), naming the class."""
    parameter = next(model.parameters())
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0)).to(parameter.device)
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    with trial_run(model):
        want = model(input_ids=ids, use_cache=False).logits.float()
        hidden = getattr(model.get_decoder()(input_ids=ids, use_cache=False), "last_hidden_state", None)
        if hidden is None:
            raise ValueError(f"{type(causal_lm).__name__}.get_decoder() gives no decoder (no last_hidden_state): "
                             "grpo's trainer runs the decoder and unembeds its output; this architecture is not "
                             "supported for training here")
        # (the cap by PyTorch's operators, as the forward's: the kernel's rounds once, and in bf16 a
        # logit's rounding step is 1e-3 of the logits' scale -- what is checked is the steps taken)
        head = logit_head(model)
        got = head.cap(head.uncapped(hidden), native=False) if isinstance(head, ScaledLogits) else head(hidden)
        got = got.float()
    scale = want.abs().mean().item() + 1e-12
    worst = (got - want).abs().max().item()
    if got.shape != want.shape or worst > 1e-3 * scale:
        raise ValueError(f"{type(causal_lm).__name__}'s forward computes its logits otherwise than grpo's trainer does "
                         f"(its output embedding over the decoder's last hidden states, then Granite's, Cohere's or "
                         f"Gemma's scaling or soft-cap): {worst:.3g} apart on {tokens} tokens (logits' mean magnitude "
                         f"{scale:.3g}); this architecture is not supported for training here")
