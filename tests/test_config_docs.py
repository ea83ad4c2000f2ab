"""The loop config is declared once (GRPOConfig); everything a user reads follows from it."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from grpo.rl import config_docs
from grpo.rl.config import GRPOConfig

ROOT = Path(__file__).resolve().parents[1]


def test_conf_help_and_the_docs_tables_are_rendered_from_the_dataclass_and_the_adapters():
    stale = [str(p.relative_to(ROOT)) for p, text in config_docs.targets(ROOT).items()
             if not p.is_file() or p.read_text() != text]
    assert not stale, (f"{stale} drifted from grpo/rl/config.py or an adapter class: "
                       "run python -m grpo.rl.config_docs --write")


def test_every_key_says_what_it_means_and_the_yaml_composes_to_the_defaults():
    for f in dataclasses.fields(GRPOConfig):
        assert len(f.metadata.get("help", "")) > 8, f"GRPOConfig.{f.name} needs a help text"
    with initialize_config_dir(config_dir=str(config_docs.config_dir()), version_base="1.3"):
        composed = compose(config_name="config")
    loop_keys = {k: v for k, v in composed.items() if k not in ("adapter", "backend")}
    assert GRPOConfig.from_any(loop_keys) == GRPOConfig()
    assert set(loop_keys) == {f.name for f in dataclasses.fields(GRPOConfig)}


BUILT_IN = {"math": "adapters.math_rl.MathAdapter", "chat": "adapters.chat_rl.ChatAdapter",
            "code": "adapters.code_rl.CodeAdapter", "tools": "adapters.tools_rl.ToolsAdapter"}


def test_every_adapter_group_composes_to_its_constructor_defaults():
    """`python -m grpo adapter=X` and `XAdapter()` in Python start from the same values: the
    composed adapter block is the signature's defaults, and the loop keys are GRPOConfig's
    defaults changed only where the class's loop_overrides says so (and why)."""
    import inspect

    assert config_docs.adapter_groups() == BUILT_IN  # every built-in group is rendered from its class
    for name, target in BUILT_IN.items():
        cls = config_docs.adapter_class(target)
        with initialize_config_dir(config_dir=str(config_docs.config_dir()), version_base="1.3"):
            composed = compose(config_name="config", overrides=[f"adapter={name}"])
        adapter = OmegaConf.to_container(composed.adapter)
        assert adapter.pop("_target_") == target
        defaults = {k: p.default for k, p in inspect.signature(cls).parameters.items()}
        assert adapter == defaults, f"adapter={name}: the group file drifted from {target}.__init__"
        loop = {k: v for k, v in composed.items() if k not in ("adapter", "backend")}
        expected = dataclasses.replace(GRPOConfig(), **{k: v for k, (v, _) in cls.loop_overrides.items()})
        assert GRPOConfig.from_any(loop) == expected, f"adapter={name}'s loop keys drifted from its loop_overrides"
        summary, meanings = config_docs.adapter_meanings(cls)
        assert summary and set(meanings) == set(defaults), f"{target}'s docstring Args: must name each argument"
        assert all(len(m) > 8 for m in meanings.values())
        assert all(len(why) > 8 for _, why in cls.loop_overrides.values())


def test_an_undocumented_or_no_op_adapter_key_is_refused():
    from grpo.rl.adapter import RLAdapter

    class Quiet(RLAdapter):
        """Says nothing about its argument.

        Args:
            other: documented, but not an argument
        """

        def __init__(self, size: int = 3):
            pass

    with pytest.raises(ValueError, match="no 'Args:' line for 'size'"):
        config_docs.adapter_rows(Quiet)

    class Idle(RLAdapter):
        loop_overrides = {"steps": (20, "the loop's own default: changes nothing")}

    with pytest.raises(ValueError, match="the loop's own default"):
        config_docs.adapter_loop_rows(Idle)


def test_every_setting_is_read_somewhere():
    """nanoGPT's discipline: a key nothing reads is a key that lies to its user."""
    code = "\n".join(p.read_text() for p in (ROOT / "grpo").rglob("*.py")
                     if p.name not in ("config.py", "config_docs.py"))
    # config.py's own schedule methods (lr_at, eval_due, ...) read keys too; its declarations and
    # validate() do not count as reading.
    own = (ROOT / "grpo" / "rl" / "config.py").read_text()
    code += own[own.index("# ------------------------------------------------------------------ construction"):]
    unread = [f.name for f in dataclasses.fields(GRPOConfig) if not re.search(rf"\.{f.name}\b", code)]
    assert not unread, f"GRPOConfig fields nothing reads: {unread}"


def test_help_lists_every_key_with_its_meaning():
    out = subprocess.run([sys.executable, "-m", "grpo", "--help"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, check=True).stdout
    assert "adapter: chat, code, custom, math" in out.replace("\n", " ") or "adapter:" in out
    for key, value, meaning, _ in config_docs.rows():
        assert f"{key}={value}" in out if value else key in out
        assert meaning[:30] in out
    for name, target in config_docs.adapter_groups().items():
        assert f"-- adapter={name} ({target})" in out
        for key, value, meaning in config_docs.adapter_rows(config_docs.adapter_class(target)):
            assert f"adapter.{key}={value}" in out and meaning[:30] in out


@pytest.mark.slow  # end to end, minutes on 2 cores: CI's slow stage runs it
def test_a_wheel_installed_outside_the_checkout_ships_the_config_tree(tmp_path):
    """`pip install .` (not editable) must carry conf/, every module and the kernels' C++: build the wheel, install
    it into a fresh venv, and compose the config from a directory far from the checkout."""
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT),
                    "-w", str(wheels)], check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("grpo-*.whl")
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True, timeout=120)
    python = env / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, timeout=300)
    # The dependencies (hydra, omegaconf, ...) come from this environment, after the wheel's copy.
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    clean_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run([str(python), "-c", "import grpo, adapters; print(grpo.__file__, adapters.__file__)"],
                           capture_output=True, text=True, cwd=elsewhere, env=clean_env, check=True).stdout
    assert where.count(str(site)) == 2, where
    job = subprocess.run([str(python), "-m", "grpo", "adapter=code", "--cfg", "job"], capture_output=True, text=True,
                         cwd=elsewhere, env=clean_env, timeout=120)
    assert job.returncode == 0, job.stderr[-2000:]
    assert "max_tokens: 256" in job.stdout and "_target_: adapters.code_rl.CodeAdapter" in job.stdout
    shipped = {p.relative_to(site).as_posix() for p in site.rglob("*") if p.suffix in (".py", ".yaml", ".cpp", ".h")}
    source = {p.relative_to(ROOT).as_posix() for pkg in ("grpo", "adapters") for p in (ROOT / pkg).rglob("*.py")}
    source |= {"grpo/" + p.relative_to(ROOT).as_posix() for p in (ROOT / "conf").rglob("*.yaml")}
    # the native kernels' C++, built on first use from the installed copy (native_kernels.py)
    source |= {p.relative_to(ROOT).as_posix() for p in (ROOT / "grpo" / "models" / "native").glob("*.[ch]*")}
    missing = sorted(source - shipped)
    assert not missing, f"the wheel lacks {missing}: list new packages in pyproject.toml's [tool.setuptools]"


@pytest.mark.parametrize("override,message", [
    ("temperature=0", "temperature=0 is invalid: must be > 0"),
    ("temperature_end=-1", "temperature_end=-1 is invalid"),
])
def test_greedy_training_fails_fast_naming_the_key(override, message):
    result = subprocess.run([sys.executable, "-m", "grpo", override, "base_model=tiny"], capture_output=True,
                            text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]


def test_temperature_anneals_linearly_to_temperature_end():
    cfg = GRPOConfig(steps=5, temperature=1.2, temperature_end=0.4)
    assert [round(cfg.temperature_at(s), 6) for s in range(5)] == [1.2, 1.0, 0.8, 0.6, 0.4]
    assert GRPOConfig(temperature=0.7).temperature_at(3) == 0.7
