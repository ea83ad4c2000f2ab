"""scripts/bench.py's micro-benchmark peers are plain transformers + peft, untouched by grpo, and
its goals table reads each goal against what the matmul kernels alone allow."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
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


def step_event(**timings: float) -> dict[str, float]:
    """A grpo worker's step event: 10 decoding steps of 20 rows, 1000 tokens processed, 500 counted."""
    return {"seconds": 4.0, "sample_s": 2.0, "train_s": 2.0, "decode_steps": 10, "rows_decoded": 200,
            "prompt_tokens": 100, "processed_tokens": 1000, "tokens": 500, **timings}


def test_the_goals_table_shows_what_the_kernels_alone_allow(capsys):
    """Numbers chosen so every ratio is exact: each goal row carries grpo's value, the kernels-alone
    value beside it, and met/unmet from grpo's value alone."""
    import hardware_floors

    size = hardware_floors.ModelSize(decoder_matmul_params=1_000_000, head_params=500_000, weight_bytes=10_000_000,
                                     linear_shapes=((1000, 1000), (500, 1000)))
    floors = {"machine": {"peak_gflops": 100.0, "bandwidth_gbs": 10.0, "dtype": "bf16"},
              "model": {**size.__dict__, "linear_shapes": [list(s) for s in size.linear_shapes]},
              "kernels_alone": {"decode_linears_s": 0.002, "train_matmuls_s": 0.5}}
    event = step_event(decode_forward_s=0.05, train_compute_s=1.0)
    out = bench.against_hardware([event], floors, step_ratio=0.2)
    # train FLOPs 4 x 1e6 x 1000 + 4 x 5e5 x 500 = 5e9: 5 GFLOP/s in grpo's second, 10 with the matmuls alone
    assert out["decode_ms"] == 5.0 and out["decode_stream_floor_ms"] == 1.0 and out["decode_linears_ms"] == 2.0
    assert out["train_gflops"] == 5.0 and out["train_matmuls_gflops"] == 10.0
    table = capsys.readouterr().out
    assert "| what | measured | the matmul kernels alone | goal | met |" in table
    assert "| step, grpo / TRL (time, bf16) | 0.20 | - | <= 0.25 | yes |" in table
    assert "20.0 rows, compute floor 0.6 ms) | 5.00x | 2.00x (2.0 ms) | <= 1.5x | no |" in table
    assert "(5 / 100 bf16 GFLOP/s) | 5% | 10% (10 GFLOP/s) | >= 50% | no |" in table


def test_the_goals_table_without_the_kernels_alone_keeps_its_rows(capsys):
    """A result written before the kernels were timed alone (no ``kernels_alone``) still reads."""
    floors = {"machine": {"peak_gflops": 100.0, "bandwidth_gbs": 10.0, "dtype": "fp32"},
              "model": {"decoder_matmul_params": 1_000_000, "head_params": 500_000, "weight_bytes": 10_000_000}}
    event = step_event(decode_forward_s=0.014, train_compute_s=0.08)
    out = bench.against_hardware([event], floors, step_ratio=None)
    assert "decode_linears_ms" not in out and "train_matmuls_gflops" not in out
    table = capsys.readouterr().out
    assert "| 1.40x | - | <= 1.5x | yes |" in table and "| 62% | - | >= 50% | yes |" in table


def test_a_bf16_sampler_beside_an_fp32_trainer_is_held_to_its_own_floor(capsys):
    """The decoding row names the sampler's precision, whose bytes the floor streams."""
    floors = {"machine": {"peak_gflops": 100.0, "bandwidth_gbs": 10.0, "dtype": "fp32"}, "sample_dtype": "bf16",
              "model": {"decoder_matmul_params": 1_000_000, "head_params": 500_000, "weight_bytes": 3_000_000}}
    event = step_event(decode_forward_s=0.006, train_compute_s=0.08)
    bench.against_hardware([event], floors, step_ratio=None)
    assert "| decoding step / weight-stream floor (bf16: 0.6 ms / 0.3 ms; 20.0 rows" in capsys.readouterr().out


def test_a_bench_run_reports_every_goal_with_the_kernels_alone(tmp_path):
    """The whole bench on the tiny model, grpo alone: its worker measures the floors and the kernels
    alone after its steps, and the table and the JSON carry them."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "scripts/bench.py", "--model", "tiny", "--no-trl", "--no-micro", "--steps", "1",
                           "--warmup", "1", "--prompts", "2", "--group", "2", "--max-tokens", "4", "--precision", "fp32",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| what | measured | the matmul kernels alone | goal | met |" in proc.stdout
    result = json.loads(out.read_text())["against_hardware"]
    assert result["decode_linears_ms"] > 0 and result["train_matmuls_gflops"] > 0
    assert result["decode_ms"] > 0 and result["decode_stream_floor_ms"] > 0


def test_a_bench_run_with_a_kl_penalty_computes_the_references_logprobs(tmp_path):
    """``--beta``: grpo's steps take the base model's logprobs of every sample (TRL's beta beside it)."""
    proc = subprocess.run([sys.executable, "scripts/bench.py", "--model", "tiny", "--no-trl", "--no-micro", "--steps", "1",
                           "--warmup", "0", "--prompts", "2", "--group", "2", "--max-tokens", "4", "--precision", "fp32",
                           "--beta", "0.05"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "KL penalty to the base model (beta 0.05)" in proc.stdout
    step = re.search(r"step  0 grpo .*incl. reference ([0-9.]+)s", proc.stdout)
    assert step is not None, proc.stdout


def test_the_prompt_logprobs_bench_agrees_with_its_plain_peer():
    """scripts/prompt_logprobs_bench.py: grpo's batched, shared reference logprobs and a plain forward
    per sequence, timed side by side, compute the same numbers (fp32)."""
    proc = subprocess.run([sys.executable, "scripts/prompt_logprobs_bench.py", "--model", "tiny", "--precision", "fp32",
                           "--groups", "3", "--group", "2", "--prompt-tokens", "12", "--answer-tokens", "5", "--reps", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| grpo: compute_logprobs, called together |" in proc.stdout
    apart = float(re.search(r"logprobs apart: max ([0-9.e+-]+)", proc.stdout).group(1))
    assert apart < 1e-4, proc.stdout
