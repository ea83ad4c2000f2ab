"""Import every module of the installed tinker_cookbook; print one JSON line per failure.

    python -m grpo.tinker_run tests/cookbook/import_all.py     # in-process: `import tinker` is grpo
"""

import importlib
import json
import pkgutil

import tinker_cookbook

names = sorted(m.name for m in pkgutil.walk_packages(tinker_cookbook.__path__, "tinker_cookbook."))
failed = 0
for name in names:
    try:
        importlib.import_module(name)
    except BaseException as err:  # noqa: BLE001  (a module's import may raise anything, SystemExit included)
        failed += 1
        print(json.dumps({"module": name, "error": type(err).__name__, "message": str(err).splitlines()[0][:300],
                          "missing": getattr(err, "name", None)}))
print(json.dumps({"modules": len(names), "failed": failed}))
