"""What a program meets of tinker.types and the client constructors in-process: non-text chunks
are values it can build, refused in one line (naming the datum and the chunk) by the call that
meets them; ``RestClient()`` and ``ServiceClient(...)`` take the SDK's arguments; a training
client's model id is the run id in its checkpoints' tinker:// paths."""

from __future__ import annotations

import pytest

import grpo
from grpo import types
from grpo.api.rest_client import RestClient

IMAGE = types.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=3)


def _datum(model_input: types.ModelInput) -> types.Datum:
    n = model_input.length
    return types.Datum(model_input=model_input, loss_fn_inputs={
        "target_tokens": types.TensorData(data=[1] * n, dtype="int64", shape=[n]),
        "weights": types.TensorData(data=[1.0] * n, dtype="float32", shape=[n])})


def test_non_text_chunks_are_values_with_the_sdk_lengths() -> None:
    mixed = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1, 2]), IMAGE])
    assert mixed.length == 5 and isinstance(IMAGE, types.ModelInputChunk)
    pointer = types.ImageAssetPointerChunk(format="jpeg", location="s3://bucket/cat.jpg")
    with pytest.raises(ValueError, match="image_asset_pointer chunk has no expected_tokens"):
        _ = pointer.length
    with pytest.raises(ValueError, match="chunk 1 is a 'image' chunk"):
        mixed.to_ints()


def test_the_call_that_meets_an_image_chunk_refuses_it_in_one_line(service) -> None:
    training = service.create_lora_training_client(base_model="tiny", rank=2)
    text = _datum(types.ModelInput.from_ints([1, 2, 3]))
    image = _datum(types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1, 2]), IMAGE]))
    with pytest.raises(ValueError) as err:
        training.forward_backward([text, image], "cross_entropy").result()
    assert str(err.value).startswith("data[1]: chunk 1 is a 'image' chunk (ImageChunk)")
    assert "\n" not in str(err.value)
    sampler = training.save_weights_and_get_sampling_client()
    with pytest.raises(ValueError, match="^prompt: chunk 0 is a 'image' chunk"):
        sampler.sample(types.ModelInput(chunks=[IMAGE]), num_samples=1).result()
    # the client trains on after the refusal
    assert training.forward_backward([text], "cross_entropy").result().metrics["loss:sum"] > 0


def test_model_id_is_the_run_id_in_its_paths_and_every_call_takes_it(service) -> None:
    training = service.create_lora_training_client(base_model="tiny", rank=2)
    path = training.save_state("one").result().path
    assert path == f"tinker://{training.model_id}/weights/one"
    rest = service.create_rest_client()
    assert [c.tinker_path for c in rest.list_checkpoints(training.model_id).result().checkpoints] == [path]
    assert rest.get_training_run(training.model_id).result().base_model == "tiny"
    resumed = service.create_training_client_from_state(path)
    assert resumed.save_state("two").result().path == f"tinker://{resumed.model_id}/weights/two"


def test_constructors_take_the_sdk_arguments(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path))
    monkeypatch.delenv("GRPO_CHECKPOINT_DIR", raising=False)
    service = grpo.ServiceClient({"owner": "me"}, None, base_url="http://unused", api_key="tml-x")
    assert service.checkpoint_dir == tmp_path / "checkpoints"
    # RestClient() reads the store a default ServiceClient writes to
    assert RestClient(base_url=None, api_key=None).store.root == tmp_path / "checkpoints"
    assert RestClient().list_training_runs().result().training_runs == []
    with pytest.raises(TypeError, match="CheckpointStore or None"):
        RestClient("http://somewhere")
    # a program that names no directory (the cookbook's) is placed by the variable
    monkeypatch.setenv("GRPO_CHECKPOINT_DIR", str(tmp_path / "elsewhere"))
    assert grpo.ServiceClient().checkpoint_dir == RestClient().store.root == tmp_path / "elsewhere"


def test_chunks_and_inputs_copy_the_lists_they_are_given() -> None:
    """As the SDK's models do: the cookbook builds a chunk from a list it then clears."""
    tokens = [1, 2, 3]
    chunk = types.EncodedTextChunk(tokens=tokens)
    chunks = [chunk]
    model_input = types.ModelInput(chunks=chunks)
    tokens.clear()
    chunks.clear()
    assert model_input.to_ints() == [1, 2, 3] and model_input.length == 3


def test_encrypted_export_without_pyrage_fails_in_one_line(service) -> None:
    try:
        import pyrage  # noqa: F401
        pytest.skip("pyrage is installed here; the encrypted export runs in test_cookbook_*.py's download")
    except ImportError:
        pass
    training = service.create_lora_training_client(base_model="tiny", rank=2)
    with pytest.raises(ValueError, match=r"needs the 'pyrage' package \(pip install pyrage\)"):
        training.save_weights_external("x", age_encryption_recipients=["age1qqq"]).result()
    with pytest.raises(ValueError, match="must be a list of age public keys"):
        training.save_weights_external("x", age_encryption_recipients="age1qqq")


PROGRAM = """
import sys, tinker
training = tinker.ServiceClient().create_lora_training_client(base_model=sys.argv[1], rank=2)
chunks = [tinker.types.EncodedTextChunk(tokens=[1, 2]), tinker.types.ImageChunk(data=b"", format="png", expected_tokens=2)]
datum = tinker.Datum(model_input=tinker.ModelInput(chunks=chunks), loss_fn_inputs={
    "target_tokens": tinker.TensorData(data=[1] * 4, dtype="int64", shape=[4])})
training.forward_backward([datum], "cross_entropy").result()
"""


@pytest.mark.slow  # a subprocess per case that loads a model: CI's slow stage runs it
@pytest.mark.parametrize(("model", "expected"), [
    ("no-such/model", "ModelNotFoundError: base_model 'no-such/model' cannot be loaded"),
    ("tiny", "ValueError: data[0]: chunk 1 is a 'image' chunk (ImageChunk)"),
])
def test_tinker_run_reports_a_user_error_in_one_line(tmp_path, model: str, expected: str) -> None:
    """A program run by ``python -m grpo.tinker_run`` that grpo refuses (a model it cannot load,
    an image for a text model) ends with grpo's one-line message, not a traceback."""
    import os
    import subprocess
    import sys

    (tmp_path / "program.py").write_text(PROGRAM)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GRPO_CHECKPOINT_DIR": str(tmp_path / "ckpt")}
    env.pop("GRPO_TRACEBACK", None)
    done = subprocess.run([sys.executable, "-m", "grpo.tinker_run", str(tmp_path / "program.py"), model],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 1
    assert done.stderr.startswith(expected) and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert len(done.stderr.strip().splitlines()) == 2  # the message, and how to see the traceback


def test_a_missing_run_is_the_sdks_not_found_error_and_still_a_file_not_found(service) -> None:
    """The cookbook catches ``(tinker.TinkerError, ValueError)`` around run lookups; the SDK's
    classes exist and grpo's lookups raise them, without breaking ``except FileNotFoundError``."""
    rest = service.create_rest_client()
    with pytest.raises(grpo.NotFoundError) as err:
        rest.get_training_run("run-nope").result()
    assert isinstance(err.value, grpo.TinkerError) and isinstance(err.value, FileNotFoundError)
    assert err.value.status_code == 404 and "run-nope" in str(err.value)
    with pytest.raises(grpo.BadRequestError):
        rest.get_training_run_by_tinker_path("not-a-tinker-path").result()
    assert issubclass(grpo.APITimeoutError, grpo.APIConnectionError) and grpo.RequestFailedError("x").category


ALIAS_PROGRAM = """
import json, sys
import grpo
assert grpo.as_tinker() is grpo
import tinker
from tinker import types
from tinker.types.tensor_data import TensorData
from tinker.lib.public_interfaces import APIFuture
from tinker.lib.public_interfaces.rest_client import RestClient
out = {"same": [tinker is grpo, types is grpo.types, TensorData is grpo.types.TensorData,
                APIFuture is grpo.APIFuture, RestClient is grpo.RestClient, tinker.types.ImageChunk is grpo.types.ImageChunk]}
try:
    import tinker.proto.tinker_public_pb2  # noqa: F401
except ModuleNotFoundError as err:
    out["internal"] = str(err)
print(json.dumps(out))
"""


def test_as_tinker_routes_the_sdk_modules_programs_import() -> None:
    """In a subprocess: the dev venv holds the real SDK, which the rest of this session uses."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", ALIAS_PROGRAM], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["same"] == [True] * 6
    assert "grpo stands in for the tinker SDK's public API" in out["internal"]


def test_the_remote_backend_sends_image_chunks_as_the_sdks_own() -> None:
    """What grpo's local models cannot run, a service can: the remote backend hands it over."""
    sdk_types = pytest.importorskip("tinker").types
    from grpo.backends.remote import convert

    mixed = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1, 2]), IMAGE])
    out = convert.model_input(sdk_types, mixed)
    assert isinstance(out.chunks[1], sdk_types.ImageChunk) and out.chunks[1].data == IMAGE.data
    assert out.length == mixed.length == 5
