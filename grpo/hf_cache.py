"""``python -m grpo.hf_cache``: the packaged SmolLM2 into the Hugging Face cache under its hub id.

The command users type (and earlier docs gave) stays short; the code lives in
grpo/models/hf_cache.py, beside the model loading it reuses.
"""

from grpo.models.hf_cache import install, main

__all__ = ["install", "main"]

if __name__ == "__main__":
    main()
