"""tinker_cookbook.weights: download a checkpoint, then turn it into a PEFT adapter.

    python -m grpo.tinker_run tests/cookbook/download.py TINKER_PATH OUT_DIR [MODEL]

Prints one JSON line: the files downloaded and those of the PEFT adapter.
"""

import json
import sys
from pathlib import Path

from tinker_cookbook import weights

tinker_path, out = sys.argv[1], Path(sys.argv[2])
model = sys.argv[3] if len(sys.argv) > 3 else "HuggingFaceTB/SmolLM2-135M-Instruct"

weights.download(tinker_path=tinker_path, output_dir=str(out / "downloaded"))
weights.build_lora_adapter(base_model=model, adapter_path=str(out / "downloaded"), output_path=str(out / "peft"))
print(json.dumps({"downloaded": sorted(p.name for p in (out / "downloaded").iterdir()),
                  "peft": sorted(p.name for p in (out / "peft").iterdir())}))
