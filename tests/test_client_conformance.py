"""Both backends against grpo.api.protocols: signatures, then the same short run with the same numbers.

The remote backend runs against ``LocalService`` (tests/test_remote_backend.py): the SDK's
ServiceClient API, in the installed SDK's types, served by a local backend in this process, so
grpo's remote clients (convert, submit, settle, convert back) run for real without a network.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from backend_helpers import rl_datum

from grpo import types as g
from grpo.api import protocols as client_api
from grpo.backends.local import ServiceClient
from grpo.backends.local.clients import SamplingClient, TrainingClient
from grpo.backends.remote.clients import (
    RemoteSamplingClient,
    RemoteServiceClient,
    RemoteTrainingClient,
)

test_remote_backend = pytest.importorskip("test_remote_backend")  # needs the SDK (dev extra)

IMPLEMENTATIONS = {
    "local": {"ServiceClient": ServiceClient, "TrainingClient": TrainingClient, "SamplingClient": SamplingClient},
    "remote": {"ServiceClient": RemoteServiceClient, "TrainingClient": RemoteTrainingClient,
               "SamplingClient": RemoteSamplingClient},
}

PROMPT = [1, 504, 3458, 314, 253, 1345, 28]


@pytest.mark.parametrize("backend", sorted(IMPLEMENTATIONS))
@pytest.mark.parametrize("client", sorted(client_api.PROTOCOLS))
def test_backend_client_has_the_contracts_signatures(backend: str, client: str) -> None:
    problems = client_api.signature_mismatches(client_api.PROTOCOLS[client], IMPLEMENTATIONS[backend][client])
    assert not problems, problems


def test_signature_check_catches_a_drifted_client() -> None:
    class Drifted:
        def forward_backward(self, data, loss, loss_fn_config=None): ...  # renamed parameter

        async def optim_step(self, adam_params): ...  # async, and a required parameter

    problems = " ".join(client_api.signature_mismatches(client_api.TrainingClient, Drifted))
    assert "forward_backward does not take ['loss_fn']" in problems
    assert "optim_step requires ['adam_params']" in problems and "optim_step should not be async" in problems
    assert "save_state is missing" in problems


def run_steps(service) -> dict:
    """The same calls on any backend: two RL steps, save/resume with optimizer, sample, logprobs."""
    assert isinstance(service, client_api.ServiceClient)
    training = service.create_lora_training_client("tiny", rank=4, seed=7)
    assert isinstance(training, client_api.TrainingClient)
    rng = np.random.default_rng(0)
    data = [rl_datum(PROMPT, [int(t) for t in rng.integers(100, 2000, 5)], adv, [-1.0] * 5) for adv in (1.0, -0.5)]
    losses = []
    for _ in range(2):
        fb = training.forward_backward(data, "importance_sampling")
        step = training.optim_step(g.AdamParams(learning_rate=1e-2))
        assert isinstance(fb, client_api.Future) and isinstance(step, client_api.Future)
        losses.append(fb.result().metrics["loss:sum"])
        step.result()
    path = training.save_state("conformance", overwrite=True).result().path
    training.load_state_with_optimizer(path).result()
    asyncio.run(_await(training.forward_backward_async(data, "importance_sampling")))
    training.optim_step(adam_params=g.AdamParams(learning_rate=1e-2)).result()

    sampler = training.save_weights_and_get_sampling_client()
    assert isinstance(sampler, client_api.SamplingClient)
    response = sampler.sample(g.ModelInput.from_ints(PROMPT), 2, g.SamplingParams(max_tokens=4, seed=3)).result()
    logprobs = sampler.compute_logprobs(g.ModelInput.from_ints(PROMPT + response.sequences[0].tokens)).result()
    return {"losses": losses, "path": path, "tokens": [s.tokens for s in response.sequences],
            "sample_logprobs": response.sequences[0].logprobs, "logprobs": logprobs}


async def _await(call):
    return await (await call)


def test_same_run_gives_the_same_numbers_on_both_backends(tmp_path) -> None:
    local = run_steps(ServiceClient(checkpoint_dir=tmp_path / "a", device="cpu", dtype="float32"))
    served = test_remote_backend.LocalService(ServiceClient(checkpoint_dir=tmp_path / "b", device="cpu",
                                                            dtype="float32"))
    remote = run_steps(RemoteServiceClient(sdk="tinker", service_client=served, **test_remote_backend.FAST))
    assert local["path"].startswith("tinker://") and remote["path"].startswith("tinker://")
    np.testing.assert_allclose(remote["losses"], local["losses"], rtol=1e-5)
    assert local["losses"][1] != local["losses"][0]  # the step changed the weights
    assert remote["tokens"] == local["tokens"]
    np.testing.assert_allclose(remote["sample_logprobs"], local["sample_logprobs"], rtol=1e-5, atol=1e-6)
    assert local["logprobs"][0] is None and remote["logprobs"][0] is None
    np.testing.assert_allclose(remote["logprobs"][1:], local["logprobs"][1:], rtol=1e-5, atol=1e-6)
