"""scripts/profile_step.py and the floors scripts/bench.py reports against (scripts/hardware_floors.py)
run and add up, so the profile and the goals table in docs/benchmark.md cannot silently rot."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import hardware_floors  # noqa: E402


def test_floors_follow_their_formulas():
    machine = hardware_floors.Machine(peak_gflops=100.0, bandwidth_gbs=20.0, dtype="fp32")
    size = hardware_floors.ModelSize(decoder_matmul_params=1_000_000, head_params=500_000, weight_bytes=6_000_000)
    few = hardware_floors.decode_step_floor_s(size, machine, rows=1)
    assert few["stream_s"] == pytest.approx(6e6 / 20e9)  # the weights once
    assert few["compute_s"] == pytest.approx(2 * 1.5e6 / 100e9)
    assert few["floor_s"] == few["stream_s"]  # one row: bound by the weight stream
    many = hardware_floors.decode_step_floor_s(size, machine, rows=64)
    assert many["floor_s"] == many["compute_s"] == pytest.approx(2 * 1.5e6 * 64 / 100e9)
    # forward + input backward through the decoder for every processed token, the head for the counted
    assert hardware_floors.train_flops(size, processed_tokens=10, counted_tokens=4) == 4 * 1e6 * 10 + 4 * 5e5 * 4
    step = hardware_floors.step_floor_s(size, machine, decode_steps=2, rows_decoded=128, prompt_tokens=30,
                                        processed_tokens=100, counted_tokens=60)
    assert step["sample_s"] == pytest.approx(2 * many["floor_s"] + 2 * 1e6 * 30 / 100e9)
    assert step["step_s"] == pytest.approx(step["sample_s"] + step["train_s"])


def test_the_models_size_counts_its_own_linears_not_loras():
    """The floors are the model's weights: a LoRA adapter's A and B are overhead above them."""
    from peft import LoraConfig, get_peft_model

    from grpo import models

    model = models.load_model("tiny", device="cpu", dtype="fp32")
    plain = hardware_floors.ModelSize.of(model)
    config = model.config
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    per_layer = hidden * (2 * q + 2 * kv) + 3 * hidden * inter  # q, o, k, v; gate, up, down
    assert plain.decoder_matmul_params == layers * per_layer
    assert plain.head_params == config.vocab_size * hidden
    assert plain.weight_bytes == 4 * (plain.decoder_matmul_params + plain.head_params)
    assert len(plain.linear_shapes) == 7 * layers + 1 and plain.linear_shapes[-1] == (config.vocab_size, hidden)
    # the sampler's products: q/k/v stacked, o, gate/up stacked, down (fused_projections.py), the unembedding
    assert plain.sampler_shapes == ((q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)) * layers \
        + ((config.vocab_size, hidden),)
    # a bf16 sampler beside an fp32 trainer streams half the bytes a decoding step
    assert hardware_floors.ModelSize.of(model, "bf16").weight_bytes == plain.weight_bytes // 2
    adapted = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    assert hardware_floors.ModelSize.of(adapted.get_base_model()) == plain
    # as the bench's worker hands it to its parent
    assert hardware_floors.ModelSize.from_dict(json.loads(json.dumps(asdict(plain)))) == plain


def test_the_kernels_alone_multiply_the_steps_own_shapes(monkeypatch):
    """Timed once per rep each: a decoding step's Linears at its rows through the sampler's kernel,
    and a training pass's forward and input-gradient products through torch.mm."""
    import torch

    size = hardware_floors.ModelSize(decoder_matmul_params=2 * 8 * 16, head_params=32 * 8, weight_bytes=0,
                                     linear_shapes=((16, 8), (8, 16), (32, 8)))
    products = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: products.append((tuple(a.shape), tuple(b.shape))) or real_mm(a, b))
    out = hardware_floors.kernels_alone(size, "fp32", rows=2.6, processed_tokens=5, counted_tokens=3, reps=1)
    assert out["decode_linears_s"] > 0 and out["train_matmuls_s"] > 0
    pass_products = [((5, 8), (8, 16)), ((5, 16), (16, 8)),  # forward and input gradient of (16, 8)
                     ((5, 16), (16, 8)), ((5, 8), (8, 16)),  # of (8, 16)
                     ((3, 8), (8, 32)), ((3, 32), (32, 8))]  # the unembedding's, counted tokens only
    assert products == pass_products * 2  # reps + 1 passes


def test_the_peak_is_the_fastest_dense_kernels_and_names_it(monkeypatch):
    """One kernel's rate is not the machine's (a float32 torch.mm ran at 0.45x oneDNN's on an AMD
    EPYC Zen 5): each kernel is timed, the faster one is the peak, and the training pass of the
    kernels alone runs through every kernel too."""
    import time

    import torch

    from grpo.models import cpu_linear

    def slowed(x, w):
        time.sleep(0.002)
        return torch.mm(x, w.t())

    def real(x, w):
        return torch.nn.functional.linear(x, w)

    for slow, fast in (("torch", "onednn"), ("onednn", "torch")):
        monkeypatch.setattr(cpu_linear, "dense_products", lambda dtype, slow=slow, fast=fast: {slow: slowed, fast: real})
        machine = hardware_floors.measure(64, 128, "fp32", seconds=0.3)
        assert machine.kernel == fast
        assert machine.peak_gflops > 2 * 1024 * 64 * 128 / 0.002 / 1e9  # above what the slowed kernel can reach
    calls = []
    monkeypatch.setattr(cpu_linear, "dense_products",
                        lambda dtype: {"a": lambda x, w: calls.append("a") or real(x, w),
                                 "b": lambda x, w: calls.append("b") or real(x, w)})
    size = hardware_floors.ModelSize(decoder_matmul_params=8 * 16, head_params=32 * 8, weight_bytes=0,
                                     linear_shapes=((16, 8), (32, 8)))
    hardware_floors.kernels_alone(size, "fp32", rows=2, processed_tokens=5, counted_tokens=3, reps=1)
    assert calls.count("a") == calls.count("b") == 2 * 2 * 2  # (reps + 1) passes x 2 Linears x 2 products


def test_the_kernels_alone_decode_in_the_samplers_precision(monkeypatch):
    """A bf16 sampler beside an fp32 trainer: the decoding step's Linears multiply bf16 weights,
    the training pass's products stay fp32."""
    import torch

    from grpo.models import cpu_linear

    size = hardware_floors.ModelSize(decoder_matmul_params=8 * 16, head_params=32 * 8, weight_bytes=0,
                                     linear_shapes=((16, 8), (32, 8)))
    decoded, trained = [], []
    monkeypatch.setattr(cpu_linear, "can_pack", lambda w, layout="onednn": False)  # through F.linear, whatever this CPU packs
    real_linear, real_mm = torch.nn.functional.linear, torch.mm
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w: decoded.append((x.dtype, w.dtype)) or real_linear(x, w))
    monkeypatch.setattr(torch, "mm", lambda a, b: trained.append((a.dtype, b.dtype)) or real_mm(a, b))
    hardware_floors.kernels_alone(size, "fp32", rows=2, processed_tokens=5, counted_tokens=3, reps=1,
                                  sample_dtype="bf16")
    assert set(decoded) == {(torch.bfloat16, torch.bfloat16)} and len(decoded) == 2 * 2
    assert set(trained) == {(torch.float32, torch.float32)} and len(trained) == 2 * 2 * 2


def test_profile_of_a_step_names_every_section():
    proc = subprocess.run([sys.executable, "scripts/profile_step.py", "--model", "tiny", "--prompts", "2", "--group", "2",
                           "--max-tokens", "4", "--ops", "5"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    step = float(re.search(r"# step ([0-9.]+) s", out).group(1))
    # the sections' table: from its header to the first blank line (the operator tables follow)
    sections = out[out.index("| section | seconds |"):].split("\n\n")[0]
    rows = dict(re.findall(r"^\| ([^|]+?) \| ([0-9.]+) \| [0-9]+% \| [0-9]* \|$", sections, flags=re.M))
    for section in ("sampling: prefill", "sampling: decoding forward (the model)", "training: decoder forward",
                    "training: decoder backward", "training: optimizer"):
        assert float(rows[section]) > 0, section
    # the sections and the rest account for the step, none counted twice
    assert sum(float(v) for v in rows.values()) == pytest.approx(step, rel=0.05, abs=0.05)
    assert "| operator in the decoding forward |" in out
    assert "| operator in forward_backward |" in out
    training_ops = out[out.index("| operator in forward_backward |"):]
    assert re.search(r"^\| \S+ \| [0-9.]+ \| [0-9]+% \| [1-9][0-9]* \|$", training_ops, flags=re.M)  # with its calls
