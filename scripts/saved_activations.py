"""How many bytes autograd keeps for backward in one training step, grpo against plain peft.

    python scripts/saved_activations.py [--dtype bfloat16|float32] [--model smollm2]

The benchmark's batch (8 addition prompts x 4 responses of 32 tokens, LoRA rank 16 on every
decoder Linear) goes through a forward and backward four ways: grpo's trainer with and without
prompt sharing, a plain peft forward, and a plain peft forward under bf16 autocast (what TRL runs
with ``bf16=True``). A saved-tensor hook totals the distinct storages autograd saves that are not
parameters. Those activations are what a training step's peak memory is made of besides the
weights, on any device, so this measures on a CPU what sets peak GPU memory. grpo's unembedding
is excluded from its total (it holds one chunk of positions at a time, see trainer.py); the plain
rows are given with and without their full-vocabulary logits.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import make_problems  # noqa: E402

from grpo.backends.local import ServiceClient, trainer  # noqa: E402
from grpo.rl.advantages import build_datum  # noqa: E402
from grpo.rl.rollouts import Rollout  # noqa: E402


class SavedBytes:
    """A saved_tensors_hooks pack hook that totals distinct non-parameter storages by dtype."""

    def __init__(self, parameter_storages: set[int]):
        self.parameter_storages = parameter_storages
        self.seen: dict[int, int] = {}
        self.by_dtype: collections.Counter = collections.Counter()
        self.counting = True

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        ptr = tensor.untyped_storage().data_ptr()
        if self.counting and ptr not in self.parameter_storages and ptr not in self.seen:
            self.seen[ptr] = tensor.untyped_storage().nbytes()
            self.by_dtype[str(tensor.dtype).removeprefix("torch.")] += self.seen[ptr]
        return tensor

    def line(self, name: str) -> str:
        parts = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in sorted(self.by_dtype.items()) if v >= 2**20)
        return f"  {name:46s} {sum(self.seen.values()) / 2**20:8.0f} MiB   ({parts})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--model", default="smollm2")
    args = p.parse_args()

    service = ServiceClient(device="cpu", dtype=args.dtype)
    client = service.create_lora_training_client(args.model, rank=16, seed=0, train_unembed=False)
    engine, tokenizer = client.engine, client.get_tokenizer()
    prompts = [tokenizer.apply_chat_template(q.messages, add_generation_prompt=True, tokenize=True, return_dict=False)
               for q in make_problems(8)]
    gen = torch.Generator().manual_seed(0)
    datums = []
    for prompt in prompts:
        for k in range(4):
            tokens = torch.randint(100, 20000, (32,), generator=gen).tolist()
            response = Rollout(tokens=tokens, logprobs=[-2.0] * 32, stop_reason="length", text="")
            datums.append(build_datum(prompt, response, [0.1 * (k - 1.5)] * 32))
    prepared = trainer.prepare(datums, "ppo", engine.vocab_size, engine.check_tokens)
    parameter_storages = {q.untyped_storage().data_ptr() for q in engine.peft_model.parameters()}

    def clear() -> None:
        for q in engine.adapter_parameters(client.adapter).values():
            q.grad = None

    def grpo(share: bool) -> SavedBytes:
        meter = SavedBytes(parameter_storages)
        real_head = trainer.unembed_counted

        def decoder_only(*a, **k):
            meter.counting = False
            try:
                return real_head(*a, **k)
            finally:
                meter.counting = True

        trainer.unembed_counted = decoder_only
        try:
            with engine.use(client.adapter), torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda t: t):
                trainer.run(engine.causal_lm(), prepared, "ppo", None, engine.device, 4096, True, share_prefixes=share)
        finally:
            trainer.unembed_counted = real_head
        clear()
        return meter

    def plain(autocast: bool, logits: bool) -> SavedBytes:
        meter = SavedBytes(parameter_storages)
        ids = torch.tensor([d.model_input.to_ints() for d in datums])
        with engine.use(client.adapter), torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if logits:
                out = torch.log_softmax(engine.peft_model(input_ids=ids).logits.float(), -1)[..., 0].sum()
            else:
                out = engine.causal_lm().get_decoder()(input_ids=ids).last_hidden_state.float().sum()
        out.backward()
        clear()
        return meter

    print(f"saved for backward, {args.model} {args.dtype}, 8 prompts x 4 responses of 32 tokens, LoRA r16:")
    print(grpo(True).line("grpo trainer, prompt shared per group"))
    print(grpo(False).line("grpo trainer, every datum in full"))
    print(plain(False, False).line("plain peft, decoder"))
    print(plain(False, True).line("plain peft, decoder + full logits"))
    if args.dtype == "bfloat16":
        print(plain(True, False).line("plain peft under bf16 autocast (TRL), decoder"))
        print(plain(True, True).line("... decoder + full logits"))


if __name__ == "__main__":
    main()
