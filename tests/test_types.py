"""The Tinker/MinT data types: coercion of loss inputs, parameter aliases, clear errors."""

from __future__ import annotations

import asyncio
import concurrent.futures

import numpy as np
import pytest
import torch

from grpo import types


def test_datum_accepts_lists_numpy_and_torch_per_key() -> None:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={
            "target_tokens": torch.tensor([6, 7, 8]),
            "weights": np.array([0.0, 1.0, 0.5]),
            "advantages": [0.25, -1, 2],
            "logprobs": types.TensorData(data=[-1.0, -2.0, -3.0], dtype="float32", shape=[3]),
        },
    )
    inputs = datum.loss_fn_inputs
    assert inputs["target_tokens"].dtype == "int64" and inputs["target_tokens"].tolist() == [6, 7, 8]
    assert inputs["weights"].dtype == "float32" and inputs["weights"].tolist() == [0.0, 1.0, 0.5]
    assert inputs["advantages"].to_torch().dtype == torch.float32
    assert inputs["advantages"].tolist() == [0.25, -1.0, 2.0]
    assert inputs["logprobs"].to_numpy().tolist() == [-1.0, -2.0, -3.0]
    # Tinker's docs give target_tokens as a ModelInput.
    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6]),
                        loss_fn_inputs={"target_tokens": types.ModelInput.from_ints([6, 7])})
    assert datum.loss_fn_inputs["target_tokens"].dtype == "int64"
    assert datum.loss_fn_inputs["target_tokens"].tolist() == [6, 7]


def test_datum_length_mismatch_names_key_and_counts() -> None:
    with pytest.raises(ValueError, match=r"'weights' has 2 entries but model_input has 3 tokens"):
        types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                    loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0]})


def test_datum_rejects_non_finite_and_non_numeric_inputs() -> None:
    with pytest.raises(ValueError, match=r"'advantages' holds a non-finite value \(nan\) at position 1"):
        types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                    loss_fn_inputs={"target_tokens": [2, 3], "advantages": [0.0, float("nan")]})
    with pytest.raises(TypeError, match=r"'weights' must be a list of numbers"):
        types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                    loss_fn_inputs={"target_tokens": [2, 3], "weights": ["a", "b"]})
    with pytest.raises(TypeError, match="model_input must be a ModelInput"):
        types.Datum(model_input=[1, 2], loss_fn_inputs={})


def test_model_input_from_chat_template_batch_encoding(tokenizer) -> None:
    # transformers v5 returns a BatchEncoding here; the MinT docs pass it to from_ints as is.
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    encoding = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = encoding["input_ids"] if hasattr(encoding, "keys") else encoding
    model_input = types.ModelInput.from_ints(encoding)
    assert model_input.to_ints() == list(ids)
    assert model_input.length == len(ids) > 5
    # A tokenizer(...) call with return_tensors gives a batch of one: that works too.
    batch = tokenizer("hello world", return_tensors="pt")
    assert types.ModelInput.from_ints(batch).to_ints() == batch["input_ids"][0].tolist()
    assert types.ModelInput.from_ints(np.array([3, 4])).to_ints() == [3, 4]


def test_model_input_from_ints_rejects_what_is_not_token_ids() -> None:
    with pytest.raises(TypeError, match="got a string; tokenize it first"):
        types.ModelInput.from_ints("hello")
    with pytest.raises(TypeError, match=r"mapping with keys \['text'\].*'input_ids'"):
        types.ModelInput.from_ints({"text": "hello"})
    with pytest.raises(TypeError, match="integer token ids, got 'a'"):
        types.ModelInput.from_ints([1, "a"])


def test_model_input_chunks_and_append() -> None:
    mi = types.ModelInput.from_ints([1, 2]).append_int(3).append(types.EncodedTextChunk(tokens=[4, 5]))
    assert mi.to_ints() == [1, 2, 3, 4, 5] and mi.length == 5 and len(mi.chunks) == 3
    assert types.ModelInput.empty().length == 0


def test_adam_params_accepts_betas_tuple_and_validates() -> None:
    adam = types.AdamParams(learning_rate=2e-5, betas=(0.8, 0.95))
    assert (adam.beta1, adam.beta2, adam.betas) == (0.8, 0.95, (0.8, 0.95))
    assert types.AdamParams(beta1=0.5).betas == (0.5, 0.999)
    with pytest.raises(ValueError, match=r"beta2 must be a finite number in \[0, 1\), got 1.5"):
        types.AdamParams(betas=(0.9, 1.5))
    with pytest.raises(ValueError, match=r"learning_rate must be a finite number in \[0, 10\]"):
        types.AdamParams(learning_rate=-1.0)


def test_sampling_params_stop_as_strings_ids_and_stop_token_ids() -> None:
    assert types.SamplingParams(stop="\n").stop_strings_and_ids() == (["\n"], [])
    assert types.SamplingParams(stop=7).stop_strings_and_ids() == ([], [7])
    assert types.SamplingParams(stop=["Q:", 2, np.int64(9)]).stop_strings_and_ids() == (["Q:"], [2, 9])
    assert types.SamplingParams(stop_token_ids=[2, 3], stop=["x"]).stop_strings_and_ids() == (["x"], [2, 3])
    with pytest.raises(TypeError, match="stop entries must be strings or token ids"):
        types.SamplingParams(stop=[1.5]).stop_strings_and_ids()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be a positive integer, got 0"),
        ({"max_tokens": -3}, "max_tokens must be a positive integer, got -3"),
        ({"temperature": -0.1}, r"temperature must be a finite number in \[0, 1000\]"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_k": 0}, "top_k must be -1"),
    ],
)
def test_sampling_params_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        types.SamplingParams(**kwargs)


def test_api_future_result_and_await() -> None:
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    fut = types.APIFuture(pool.submit(lambda: 41 + 1))
    assert fut.result() == 42 and fut.done()

    async def main() -> tuple[int, int]:
        a = await types.APIFuture(pool.submit(lambda: 7))
        b = await types.APIFuture.completed(8).result_async()
        return a, b

    assert asyncio.run(main()) == (7, 8)
    pool.shutdown()
