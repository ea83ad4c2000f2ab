"""What a run hands to other tools: adapter_config.json names a base model id they resolve, and
base_model mistakes end in one ``grpo:`` line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo import models, types

TESTS = Path(__file__).parent
ROOT = TESTS.parent
TOY = ["adapter=custom", "adapter._target_=toy_adapter.ToyAdapter", "batch_size=2", "group_size=2", "max_tokens=4",
       "steps=1", "report=false"]


def grpo_cli(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(TESTS), "HF_HUB_OFFLINE": "1", **env}
    return subprocess.run([sys.executable, "-m", "grpo", *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("base_model, message", [
    ("/no/such/dir", "grpo: configuration error: base_model '/no/such/dir' looks like a path but /no/such/dir "
                     "does not exist"),
    # Checked with the rest of the configuration, before torch is imported (issue #33: it took seconds).
    ("nobody-here/no-such-model", "grpo: configuration error: base_model 'nobody-here/no-such-model' cannot be "
                                  "loaded: HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache"),
])
def test_a_base_model_that_is_not_there_is_one_line(tmp_path, base_model, message) -> None:
    done = grpo_cli(*TOY, f"base_model={base_model}", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(message), done.stderr
    assert "Traceback" not in done.stderr


def test_a_local_base_model_is_named_by_its_absolute_path(tmp_path, monkeypatch) -> None:
    from grpo.backends.local import ServiceClient

    base = tmp_path / "my-model"
    models.load_model("tiny", device="cpu").save_pretrained(base)
    models.load_tokenizer("tiny").save_pretrained(base)
    monkeypatch.chdir(tmp_path)  # given relative, written absolute: the adapter may be read from anywhere
    service = ServiceClient(checkpoint_dir=tmp_path / "ckpt")
    client = service.create_lora_training_client("my-model", rank=2)
    final = service.store.resolve(client.save_weights_for_sampler("final").result().path)
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve())
    # Loading it back finds the same base: one model in memory, not two.
    service.create_sampling_client(model_path=str(final))
    assert len(service._engines) == 1


def test_hf_cache_makes_the_packaged_id_resolve_offline(tmp_path) -> None:
    # Config and tokenizer only (no weights load): the layout is what huggingface_hub reads.
    from grpo.models import hf_cache

    snapshot = hf_cache.install(tmp_path / "hub")
    assert hf_cache.install(tmp_path / "hub") == snapshot  # idempotent
    source = models.cache_dir() / "smollm2-135m-instruct" / "model.safetensors"
    assert (snapshot / "model.safetensors").stat().st_size == source.stat().st_size
    script = ("from transformers import AutoConfig, AutoTokenizer\n"
              f"c = AutoConfig.from_pretrained({models.SMOLLM2_HUB_ID!r})\n"
              f"t = AutoTokenizer.from_pretrained({models.SMOLLM2_HUB_ID!r})\n"
              "print(c.model_type, c.num_hidden_layers, len(t))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["llama", "30", str(len(models.load_tokenizer("smollm2")))]


@pytest.mark.slow
def test_auto_peft_loads_a_final_adapter_of_the_packaged_model(tmp_path) -> None:
    """AutoPeftModelForCausalLM.from_pretrained(final) resolves the id the adapter names, in a
    process that sees only a Hugging Face cache holding the packaged model under that id
    (``python -m grpo.hf_cache``), and computes the logprobs grpo's sampler computes."""
    from grpo.backends.local import ServiceClient
    from grpo.models import hf_cache

    service = ServiceClient(checkpoint_dir=tmp_path / "ckpt", dtype="fp32")  # as the peft side below
    client = service.create_lora_training_client("smollm2", rank=4, seed=1)
    tokenizer = client.get_tokenizer()
    ids = tokenizer.encode("Q: What is 2 + 3?\nA: 5")
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})
    client.forward_backward([datum], "cross_entropy").result()
    client.optim_step(types.AdamParams(learning_rate=5e-3)).result()  # LoRA B leaves zero: a real adapter
    final = service.store.resolve(client.save_weights_for_sampler("final").result().path)
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == models.SMOLLM2_HUB_ID
    sampler = service.create_sampling_client(model_path=str(final))
    ours = sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result()[1:]
    base = service.create_sampling_client(base_model="smollm2").compute_logprobs(
        types.ModelInput.from_ints(ids)).result()[1:]
    assert max(abs(a - b) for a, b in zip(ours, base, strict=True)) > 1e-3  # the adapter matters

    hf_home = tmp_path / "hf-home"
    snapshot = hf_cache.install(hf_home / "hub")
    assert snapshot.parent.parent.name == "models--HuggingFaceTB--SmolLM2-135M-Instruct"
    script = (
        "import json, sys, torch\n"
        "from peft import AutoPeftModelForCausalLM\n"
        f"model = AutoPeftModelForCausalLM.from_pretrained({str(final)!r}, dtype=torch.float32)\n"
        f"ids = torch.tensor([{ids!r}])\n"
        "with torch.no_grad():\n"
        "    lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)\n"
        "print(json.dumps(lp.gather(-1, ids[0, 1:, None])[:, 0].tolist()))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    assert theirs == pytest.approx(ours, abs=1e-4)
    assert torch.tensor(theirs).isfinite().all()
