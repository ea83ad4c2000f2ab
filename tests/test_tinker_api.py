"""`import grpo as tinker` on the tiny model: the SDK calls beyond the core loop.

Server capabilities, clients that are their own futures, tinker:// checkpoints through every
loader, the RestClient over the store (listing, TTL, publish, delete, both download calls),
SDK keyword arguments, close / with.
"""

from __future__ import annotations

import asyncio
import tarfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch
from backend_helpers import adapter_tensors, perturb_adapter, rl_datum

import grpo as tinker

PROMPT = [1, 504, 3458, 314, 253, 1345, 28]
RESPONSE = [216, 1023, 30, 4589, 17, 2]
DATA = [rl_datum(PROMPT, RESPONSE, advantage=1.0, sampler_logprobs=[-4.0] * len(RESPONSE))]


@pytest.fixture(scope="module")
def svc(tmp_path_factory) -> tinker.ServiceClient:
    return tinker.ServiceClient(checkpoint_dir=tmp_path_factory.mktemp("ckpt"), device="cpu", dtype="float32")


def trained(svc, seed: int):
    client = svc.create_lora_training_client(base_model="tiny", rank=4, seed=seed, user_metadata={"t": "1"})
    perturb_adapter(client, seed)
    client.forward_backward(DATA, "importance_sampling")
    client.optim_step(adam_params=tinker.AdamParams(learning_rate=1e-2)).result()
    return client


def logprobs(client) -> torch.Tensor:
    return client.forward(DATA, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()


def read_url(url: str) -> bytes:
    assert url.startswith("file://")
    with urllib.request.urlopen(url) as f:
        return f.read()


def test_top_level_types_and_capabilities(svc) -> None:
    datum = tinker.Datum(model_input=tinker.ModelInput.from_ints([1, 2, 3]),
                         loss_fn_inputs={"target_tokens": tinker.TensorData(data=[2, 3, 4], dtype="int64", shape=[3])})
    assert datum.loss_fn_inputs["target_tokens"].tolist() == [2, 3, 4]
    caps = svc.get_server_capabilities()
    assert {"tiny", "smollm2"} <= {m.model_name for m in caps.supported_models}
    assert asyncio.run(svc.get_server_capabilities_async()) == caps


def test_creation_calls_are_clients_and_futures_of_them(svc) -> None:
    client = svc.create_lora_training_client("tiny", rank=4, seed=0)
    assert client.result() is client and client.done()
    assert asyncio.run(_await(client)) is client
    made = asyncio.run(svc.create_lora_training_client_async("tiny", rank=4, seed=0))
    assert isinstance(made, tinker.TrainingClient) and made is not client
    sampler = svc.create_sampling_client(base_model="tiny")
    assert sampler.result() is sampler and sampler.get_base_model() == "tiny"
    assert asyncio.run(sampler.get_base_model_async()) == "tiny"
    info = client.get_info()
    assert info.model_id == client.training_run_id and info.lora_rank == 4
    assert asyncio.run(client.get_info_async()) == info


async def _await(x):
    return await x


def test_tinker_paths_load_everywhere_and_resume_with_optimizer(svc) -> None:
    client = trained(svc, 1)
    state = client.save_state("mid", ttl_seconds=3600, user_metadata={"step": "1"}).result().path
    sampler_path = client.save_weights_for_sampler("mid").result().path
    assert state == f"tinker://{client.training_run_id}/weights/mid"
    assert sampler_path == f"tinker://{client.training_run_id}/sampler_weights/mid"
    with pytest.raises(FileExistsError, match="overwrite=True"):
        client.save_state("mid").result()
    assert client.save_state("mid", overwrite=True).result().path == state

    # load_state: weights only; create_training_client_from_state: the same, in a new client
    other = svc.create_lora_training_client("tiny", rank=4, seed=9)
    other.load_state(state).result()
    assert torch.equal(logprobs(other), logprobs(client))
    fresh = svc.create_training_client_from_state(state)
    assert torch.equal(logprobs(fresh), logprobs(client)) and fresh.optimizer is None

    # with the optimizer, the next step lands exactly where the original's does
    resumed = svc.create_training_client_from_state_with_optimizer(state)
    for c in (client, resumed):
        c.forward_backward(DATA, "importance_sampling")
        c.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    want, got = adapter_tensors(client), adapter_tensors(resumed)
    assert all(torch.equal(want[k], got[k]) for k in want)

    # the sampler weights sample from tinker:// too
    sampling = svc.create_sampling_client(model_path=sampler_path)
    tokens = DATA[0].model_input.to_ints()
    lp = sampling.compute_logprobs(tinker.ModelInput.from_ints(tokens), prompt_logprobs_last_n=3).result()
    assert lp[:-3] == [None] * (len(tokens) - 3) and all(x is not None for x in lp[-3:])


def test_rest_client_lists_expires_publishes_deletes(svc) -> None:
    rest = svc.create_rest_client()
    client = trained(svc, 2)
    run = client.training_run_id
    keep = client.save_state("keep", user_metadata={"k": "v"}).result().path
    short = client.save_weights_for_sampler("short", ttl_seconds=1).result().path

    listed = rest.list_checkpoints(run).result().checkpoints
    assert [c.tinker_path for c in listed] == [short, keep]
    by_path = {c.tinker_path: c for c in listed}
    assert by_path[keep].checkpoint_type == "training" and by_path[keep].user_metadata == {"k": "v"}
    assert by_path[short].checkpoint_type == "sampler" and by_path[short].expires_at is not None
    assert by_path[keep].size_bytes > 0 and by_path[keep].expires_at is None
    assert {c.tinker_path for c in rest.list_user_checkpoints(limit=100).result().checkpoints} >= {keep, short}

    training_run = rest.get_training_run(run).result()
    assert (training_run.base_model, training_run.lora_rank, training_run.user_metadata) == ("tiny", 4, {"t": "1"})
    assert rest.get_training_run_by_tinker_path(keep).result() == training_run
    assert run in {r.training_run_id for r in rest.list_training_runs(limit=1000).result().training_runs}
    info = rest.get_weights_info_by_tinker_path(keep).result()
    assert (info.base_model, info.is_lora, info.lora_rank) == ("tiny", True, 4)

    rest.publish_checkpoint_from_tinker_path(keep).result()
    assert rest.list_checkpoints(run).result().checkpoints[-1].public is True
    asyncio.run(rest.unpublish_checkpoint_from_tinker_path_async(keep))
    assert rest.list_checkpoints(run).result().checkpoints[-1].public is False

    time.sleep(1.1)  # the sampler weights' TTL passes: gone from listings and from every loader
    assert [c.tinker_path for c in rest.list_checkpoints(run).result().checkpoints] == [keep]
    with pytest.raises(FileNotFoundError, match="expired"):
        svc.create_sampling_client(model_path=short)

    rest.set_checkpoint_ttl_from_tinker_path(keep, 1).result()
    rest.set_checkpoint_ttl_from_tinker_path(keep, None).result()  # None removes the expiry again
    time.sleep(1.1)
    assert rest.list_checkpoints(run).result().checkpoints[0].expires_at is None

    rest.delete_checkpoint_from_tinker_path(keep).result()
    assert rest.list_checkpoints(run).result().checkpoints == []
    with pytest.raises(FileNotFoundError):
        rest.delete_checkpoint(run, "weights/keep").result()
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        client.load_state(keep).result()


def test_downloads_through_both_sdk_generations(svc, tmp_path) -> None:
    rest = svc.create_rest_client()
    client = trained(svc, 3)
    path = client.save_weights_for_sampler("final").result().path
    folder = svc.store.resolve(path)
    want = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(want)

    # earlier SDKs (tinker_cookbook.weights.download): one archive; `tar` opens it
    archive = rest.get_checkpoint_archive_url_from_tinker_path(path).result()
    local = Path(urllib.parse.urlparse(archive.url).path)
    with tarfile.open(local) as tar:
        tar.extractall(tmp_path / "x", filter="data")
    assert {p.name: p.read_bytes() for p in (tmp_path / "x").iterdir()} == want

    # 0.38: one URL per file
    urls = asyncio.run(rest.get_external_weights_urls_async(path)).urls
    assert {name: read_url(url) for name, url in urls.items()} == want

    # save_weights_external is such a checkpoint of its own type
    external = client.save_weights_external("export").result().path
    assert "/external_weights/" in external
    assert set(rest.get_external_weights_urls(external).result().urls) == set(want)

    # copy_weights: a new run holding the same files
    copy = svc.copy_weights(path).result()
    assert copy != path and copy.endswith("/sampler_weights/final")
    assert {p.name: p.read_bytes() for p in svc.store.resolve(copy).iterdir()} == want


def test_close_and_with(tmp_path) -> None:
    with tinker.ServiceClient(checkpoint_dir=tmp_path, device="cpu", dtype="float32") as service:
        client = service.create_lora_training_client("tiny", rank=2)
        assert client.forward(DATA, "cross_entropy").result().metrics["loss:sum"] > 0
    with pytest.raises(RuntimeError):  # its worker is shut down, as the SDK rejects a closed session
        client.forward(DATA, "cross_entropy").result()
    with pytest.raises(ValueError, match="close status"):
        tinker.ServiceClient(checkpoint_dir=tmp_path).close("done")
