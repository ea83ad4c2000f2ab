"""The MinT/Tinker docs' minimal loop, written against the real ``tinker`` SDK only.

Run by tests/test_serve.py with whichever SDK is installed in the interpreter running it (the
dev extra's 0.22, or 0.38 from a separate venv), against a grpo server named by
TINKER_BASE_URL / TINKER_API_KEY. It imports nothing from grpo: it is a Tinker user's script.
Prints one JSON object with what the test compares against the in-process backend.

    python tests/tinker_sdk_loop.py BASE_MODEL
"""

import json
import sys

import tinker
from tinker import types


def _client(value):
    """SDK >= 0.3x returns a future of the client from these calls; 0.22 the client itself."""
    return value.result() if hasattr(value, "result") else value


def main(base_model: str) -> None:
    service = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model=base_model, rank=4, seed=0)
    tokenizer = training.get_tokenizer()  # offline: get_info names the server's local tokenizer directory
    prompt = tokenizer.encode("The capital of France is")

    sampler = training.save_weights_and_get_sampling_client()
    sampled = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=2,
                             sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0)).result()
    seq = sampled.sequences[0]

    # One importance-sampling datum from the first sample: advantage +1 on the sampled tokens.
    tokens = prompt + list(seq.tokens)
    n_prompt = len(prompt) - 1
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[len(tokens) - 1]),
            "logprobs": types.TensorData(data=[0.0] * n_prompt + list(seq.logprobs), dtype="float32",
                                         shape=[len(tokens) - 1]),
            "advantages": types.TensorData(data=[0.0] * n_prompt + [1.0] * len(seq.tokens), dtype="float32",
                                           shape=[len(tokens) - 1]),
        },
    )
    fwdbwd = training.forward_backward([datum], "importance_sampling").result()
    optim = training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = training.save_weights_and_get_sampling_client()
    logprobs_after = after.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    saved = training.save_state("final").result()
    sampler_path = training.save_weights_for_sampler("final-sampler").result()

    # Resume from the saved state in a new training client: same weights, so same logprobs.
    resumed = _client(service.create_training_client_from_state(saved.path))
    forward = resumed.forward([datum], "cross_entropy").result()
    from_path = _client(service.create_sampling_client(model_path=sampler_path.path))
    logprobs_from_path = from_path.compute_logprobs(types.ModelInput.from_ints(tokens)).result()

    print(json.dumps({
        "sdk_version": tinker.__version__,
        "prompt": prompt,
        "samples": [list(s.tokens) for s in sampled.sequences],
        "sample_logprobs": [list(s.logprobs) for s in sampled.sequences],
        "loss": fwdbwd.metrics["loss:sum"],
        "train_logprobs": fwdbwd.loss_fn_outputs[0]["logprobs"].tolist(),
        "optim_metrics": optim.metrics,
        "logprobs_after": logprobs_after,
        "resumed_logprobs": forward.loss_fn_outputs[0]["logprobs"].tolist(),
        "logprobs_from_path": logprobs_from_path,
        "state_path": saved.path,
        "sampler_path": sampler_path.path,
    }))


if __name__ == "__main__":
    main(sys.argv[1])
