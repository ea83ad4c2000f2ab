"""What of the Tinker SDK's public surface grpo does not implement in-process, and why.

tests/tinker_manifest.json (written by scripts/tinker_manifest.py from the SDK itself) lists the
SDK's top-level names, client methods with their parameters, and the fields of the types users
build or read. tests/test_sdk_parity.py holds grpo to it: every entry is implemented under the
same name with the same parameter names, or it is listed here with the reason and what to do
instead. ``counts()`` gives the numbers docs/tinker-api.md shows.
"""

from __future__ import annotations

import json
from pathlib import Path

_NO_SESSIONS = "sessions, projects and accounts belong to the hosted service; a local run has none"
_TELEMETRY_URL = "no web console exists for local runs: the run directory (metrics.jsonl, report) is the record"

# Top-level names (``tinker.X``) not offered as ``grpo.X``.
UNSUPPORTED_TOP_LEVEL: dict[str, str] = {
    **{name: "local calls raise Python's own errors (ValueError, TypeError, FileNotFoundError) naming the "
             "problem; there is no HTTP status to wrap"
       for name in ("APIConnectionError", "APIError", "APIResponseValidationError", "APIStatusError",
                    "APITimeoutError", "AuthenticationError", "BadRequestError", "BillingError", "ConflictError",
                    "InternalServerError", "NotFoundError", "PermissionDeniedError", "RateLimitError",
                    "RequestFailedError", "TinkerError", "UnprocessableEntityError")},
    "AdminClient": "administration of the hosted service's organisations; nothing to administer locally",
    "auth": "API keys and tokens: the local backend needs no authentication",
    "Timeout": "HTTP request options; local calls make no HTTP requests",
    "RequestOptions": "HTTP request options; local calls make no HTTP requests",
    "ExperimentalWarning": "raised by the SDK's experimental server-side features, which grpo does not have",
    "LossHandle": "server-compiled custom losses (create_custom_loss); pass a Python function to "
                  "forward_backward_custom instead",
    "PerDatumLossFn": "server-compiled custom losses (create_custom_loss); pass a Python function to "
                      "forward_backward_custom instead",
    "DimuonOptimizerConfig": "only Adam(W) is implemented locally; use AdamParams",
    "DimuonParams": "only Adam(W) is implemented locally; use AdamParams",
    "DmelChunk": "audio (dMel) input chunks are not supported; only encoded text",
    "PromptProvenanceSpan": "provenance spans of the service's sampler are not tracked locally",
    "SampledProvenanceSpan": "provenance spans of the service's sampler are not tracked locally",
    "SampleRequest": "a wire request type of the HTTP API; call SamplingClient.sample",
    "OptimStepRequest": "a wire request type of the HTTP API; call TrainingClient.optim_step",
}

# Client methods ("Client.method") grpo's in-process clients do not have.
UNSUPPORTED_METHODS: dict[str, str] = {
    "ServiceClient.get_console_url": _TELEMETRY_URL,
    "ServiceClient.create_custom_loss": "compiles a loss graph to run on the service; pass a Python function "
                                        "to TrainingClient.forward_backward_custom instead",
    "TrainingClient.get_console_url": _TELEMETRY_URL,
    "SamplingClient.create": "the SDK's internal constructor; use ServiceClient.create_sampling_client",
    "SamplingClient.get_sampler_handle": "hands a sampler to another process through the service; locally save "
                                         "the weights and call create_sampling_client(model_path) there",
    "SamplingClient.from_sampler_handle": "hands a sampler to another process through the service; locally save "
                                          "the weights and call create_sampling_client(model_path) there",
    "SamplingClient.on_queue_state_change": "the SDK's callback for the service's request queue; there is no "
                                            "queue locally",
    "RestClient.assign_session_project": _NO_SESSIONS,
    "RestClient.assign_session_project_async": _NO_SESSIONS,
    "RestClient.export_session_trace": _NO_SESSIONS,
    "RestClient.export_session_trace_async": _NO_SESSIONS,
    "RestClient.get_session": _NO_SESSIONS,
    "RestClient.get_session_async": _NO_SESSIONS,
    "RestClient.list_sessions": _NO_SESSIONS,
    "RestClient.list_sessions_async": _NO_SESSIONS,
    "RestClient.search_sessions": _NO_SESSIONS,
    "RestClient.whoami": _NO_SESSIONS,
    "RestClient.get_audit_log": "the service's audit log of account actions; locally the run directory's "
                                "checkpoints.jsonl records what was saved",
    "RestClient.get_audit_log_async": "the service's audit log of account actions; locally the run directory's "
                                      "checkpoints.jsonl records what was saved",
    "RestClient.get_billing_usage": "billing has no local meaning",
    "RestClient.get_billing_usage_async": "billing has no local meaning",
    "RestClient.get_current_checkpoint_storage_usage": "per-project storage quotas belong to the service; "
                                                       "Checkpoint.size_bytes gives each checkpoint's size",
    "RestClient.get_current_checkpoint_storage_usage_async": "per-project storage quotas belong to the service; "
                                                             "Checkpoint.size_bytes gives each checkpoint's size",
    "RestClient.get_sampler": "sampler sessions belong to the service; a SamplingClient is a local object",
    "RestClient.get_sampler_async": "sampler sessions belong to the service; a SamplingClient is a local object",
}

# Parameters accepted under the SDK's name but whose non-default values are refused with an error
# naming them ("Client.method.param").
UNSUPPORTED_PARAMS: dict[str, str] = {
    "SamplingClient.sample.topk_prompt_logprobs": "top-k logprobs are not computed locally",
    "SamplingClient.sample.topk_sample_logprobs": "top-k logprobs are not computed locally",
    "SamplingClient.sample.target_prompt_logprobs": "target logprobs of alternative tokens are not computed locally",
    "SamplingClient.sample.prompt_alt_tokens_k": "alternative prompt tokens are not computed locally",
    "TrainingClient.save_weights_external.age_encryption_recipients": "files stay on this machine, unencrypted",
    "TrainingClient.save_weights_and_get_sampling_client.kind": "only 'snapshot' samplers; 'inflight' weights "
                                                                "shared with training are not implemented",
    "ServiceClient.create_lora_training_client.optimizer": "only Adam(W); any other optimizer config is refused",
}

# Fields of SDK types that grpo's types do not carry ("Type.field").
UNSUPPORTED_FIELDS: dict[str, str] = {
    "Datum.loss_fn_input_spans": "spans over multimodal inputs; local inputs are text tokens only",
    "Datum.model_input_spans": "spans over multimodal inputs; local inputs are text tokens only",
    "SampleResponse.prompt_alt_tokens": "alternative prompt tokens are not computed locally",
    "SampleResponse.prompt_cache_hit_tokens": "the local sampler reports no prompt-cache statistics",
    "SampleResponse.target_prompt_logprobs": "target logprobs of alternative tokens are not computed locally",
    "SampleResponse.topk_prompt_logprobs": "top-k logprobs are not computed locally",
    "SampleResponse.topk_prompt_logprobs_np": "top-k logprobs are not computed locally",
    "SampledSequence.topk_logprobs": "top-k logprobs are not computed locally",
    "SampledSequence.topk_logprobs_np": "top-k logprobs are not computed locally",
    "TensorData.sparse_col_indices": "sparse tensors are not used by any local loss",
    "TensorData.sparse_crow_indices": "sparse tensors are not used by any local loss",
}

MANIFEST = Path(__file__).resolve().parents[2] / "tests" / "tinker_manifest.json"


def counts(manifest: dict | None = None) -> dict[str, tuple[int, int]]:
    """(implemented, total) per section of the manifest, for the README."""
    m = manifest if manifest is not None else json.loads(MANIFEST.read_text())
    out = {"top-level names": (len(m["top_level"]) - len(UNSUPPORTED_TOP_LEVEL), len(m["top_level"]))}
    for client, methods in m["clients"].items():
        missing = sum(1 for name in methods if f"{client}.{name}" in UNSUPPORTED_METHODS)
        out[f"{client} methods"] = (len(methods) - missing, len(methods))
    fields = [f"{t}.{f}" for t, fs in m["types"].items() for f in fs]
    out["type fields"] = (len(fields) - sum(1 for f in fields if f in UNSUPPORTED_FIELDS), len(fields))
    return out
