"""scripts/bench.py's micro-benchmark peers are plain transformers + peft, untouched by grpo."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import bench  # noqa: E402

from grpo.backends.local import ServiceClient  # noqa: E402
from grpo.models.cpu_linear import OneDNNLinear  # noqa: E402
from grpo.models.lora_linear import MARK  # noqa: E402


def test_the_peers_model_is_plain_and_grpos_own_model_keeps_its_kernels(tmp_path):
    tc = ServiceClient(checkpoint_dir=tmp_path, device="cpu", train_dtype="fp32", sample_dtype="fp32") \
        .create_lora_training_client("tiny", rank=4, seed=0, train_unembed=False)
    args = argparse.Namespace(model="tiny", rank=4)
    plain = bench.plain_peft_model(args, "cpu", "float32")

    from peft.tuners.lora import Linear as LoraLinear

    lora = [m for m in plain.modules() if isinstance(m, LoraLinear)]
    assert lora and all(m.r["default"] == 4 and m.scaling["default"] == 2.0 for m in lora)  # alpha 2 x rank, as grpo's
    assert not any(getattr(m, MARK, False) for m in lora)  # peft's own LoRA forward
    assert not any(type(m) is OneDNNLinear for m in plain.modules())  # PyTorch's own Linear kernels
    assert all(type(m.base_layer) is nn.Linear for m in lora)
    assert any(type(m) is OneDNNLinear for m in tc.engine.model.modules())  # grpo's model untouched
    assert not any(a is b for a in plain.parameters() for b in tc.engine.model.parameters())  # a copy of its own
    ids = torch.tensor([[1, 504, 3458, 314]])
    with torch.no_grad():  # the same base weights: B starts at zero, so both compute the base model
        assert torch.allclose(plain(input_ids=ids).logits, tc.engine.peft_model(input_ids=ids).logits, atol=1e-4)
