"""A local Tinker-compatible HTTP server over grpo's in-process backend (``python -m grpo.serve``)."""
