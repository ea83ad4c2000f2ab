"""tinker_cookbook.supervised.train on the cookbook's own example_data/conversations.jsonl.

Only config values are ours (model, renderer, batch, steps, log path); the rest is the cookbook's.
(supervised/train.py's own ``__main__`` cannot start in cookbook 0.5.8: chz refuses its
unannotated lambda, so this calls ``train.main(Config)`` as the cookbook's recipes do.)

    python -m grpo.tinker_run tests/cookbook/sl_conversations.py LOG_PATH [MODEL] [STEPS]   # in-process
    TINKER_BASE_URL=http://127.0.0.1:8000 python tests/cookbook/sl_conversations.py LOG_PATH   # server
"""

import asyncio
import sys
from pathlib import Path

import tinker_cookbook
from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

log_path = sys.argv[1]
model = sys.argv[2] if len(sys.argv) > 2 else "HuggingFaceTB/SmolLM2-135M-Instruct"
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 6
renderer = "qwen3_instruct"  # SmolLM2's chat format is ChatML without think tokens

config = train.Config(
    log_path=log_path,
    model_name=model,
    recipe_name="cookbook_on_grpo",
    renderer_name=renderer,
    dataset_builder=FromConversationFileBuilder(
        file_path=str(Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"),
        common_config=ChatDatasetBuilderCommonConfig(
            model_name_for_tokenizer=model, renderer_name=renderer, max_length=256, batch_size=8),
    ),
    learning_rate=5e-4,
    lora_rank=8,
    max_steps=steps,
    save_every=0,
    eval_every=0,
)
asyncio.run(train.main(config))
