"""conf/config.yaml's loop keys, ``--help`` and the table in docs/configuration.md, rendered from GRPOConfig;
conf/adapter/<name>.yaml, their ``--help`` section and docs/adapters.md's key tables, rendered from
each built-in adapter's class.

GRPOConfig (grpo/rl/config.py) is the one declaration of every loop key: its default and meaning.
An adapter's constructor is the one declaration of its keys: the signature holds the defaults, the
class docstring's ``Args:`` section their meanings, and ``loop_overrides`` the loop keys its group
sets. Which class ``adapter=<name>`` means is the one line a group file keeps by hand: its
``_target_`` (a new adapter starts as ``adapter:\n  _target_: pkg.Class``; --write fills in the rest).
This module renders the places a user reads them; tests/test_config_docs.py fails when a
file drifts from its source, and in a source checkout

    python -m grpo.rl.config_docs --write

rewrites them. Free of torch and Hydra, like the config itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import re
from pathlib import Path
from typing import Any

import yaml

from grpo.api.losses import LOSSES, TIS_CAP
from grpo.rl.config import GRPOConfig, WandbConfig

YAML_BEGIN = "# >>> loop keys: rendered from GRPOConfig in grpo/rl/config.py (python -m grpo.rl.config_docs --write)"
YAML_END = "# <<< loop keys"
TABLE_BEGIN = "<!-- config table: rendered from GRPOConfig in grpo/rl/config.py (python -m grpo.rl.config_docs --write) -->"
TABLE_END = "<!-- end of config table -->"
ADAPTER_TABLE_BEGIN = ("<!-- adapter keys: rendered from each adapter class (python -m grpo.rl.config_docs --write) -->")
ADAPTER_TABLE_END = "<!-- end of adapter keys -->"
COMMENT_COLUMN = 27


def config_dir() -> Path:
    """The Hydra config tree: shipped inside the installed package (grpo/conf), or the source
    checkout's top-level conf/. The installed copy is looked for first, so a stray conf/ next to
    site-packages can never shadow it."""
    here = Path(__file__).resolve().parent.parent  # grpo/
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"grpo's config tree (config.yaml) is neither in {here / 'conf'} nor {here.parent / 'conf'}")


# --------------------------------------------------------------------------- values


def yaml_value(value: Any) -> str:
    """A YAML scalar or flow list that OmegaConf reads back as ``value``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, str):
        plain = re.fullmatch(r"[A-Za-z_][A-Za-z0-9_./-]*", value) and value not in ("null", "true", "false")
        return value if plain else json.dumps(value)
    raise TypeError(f"no YAML rendering for {value!r}")


def _help(f: dataclasses.Field) -> str:
    return f.metadata["help"]


def loss_params() -> dict[str, str]:
    """Every loss_fn_config key with the losses that read it and their defaults."""
    users: dict[str, list[str]] = {}
    for name, spec in LOSSES.items():
        for key, default in spec.defaults.items():
            users.setdefault(key, []).append(f"{name} {default:g}")
    out = {key: "default: " + ", ".join(uses) for key, uses in users.items()}
    out[TIS_CAP] = ("every loss: truncated importance weight min(trainer/sampler ratio, C) on each token; "
                    "null: off (docs/scaling.md: Precision)")
    return out


def rows() -> list[tuple[str, str, str, str | None]]:
    """(key, default as YAML, meaning, section heading or None), nested keys flattened."""
    out: list[tuple[str, str, str, str | None]] = []
    for f in dataclasses.fields(GRPOConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        section = f.metadata.get("section")
        if f.name == "loss_fn_config":
            out.append((f.name, "", _help(f), section))
            out.extend((f"{f.name}.{key}", "null", uses, None) for key, uses in loss_params().items())
        elif f.name == "wandb":
            out.append((f.name, "", _help(f), section))
            out.extend((f"wandb.{w.name}", yaml_value(w.default if w.default is not dataclasses.MISSING
                                                       else w.default_factory()), _help(w), None)
                       for w in dataclasses.fields(WandbConfig))
        else:
            out.append((f.name, yaml_value(default), _help(f), section))
    return out


# --------------------------------------------------------------------------- adapters


def adapter_groups(conf: Path | None = None) -> dict[str, str]:
    """``adapter=<name>`` -> the class its group file names (``_target_``), for every group file
    under conf/adapter/ that names one; custom.yaml's ``???`` is a placeholder, written by hand."""
    out = {}
    for path in sorted(((conf or config_dir()) / "adapter").glob("*.yaml")):
        data = yaml.safe_load(path.read_text()) or {}
        target = (data.get("adapter") or {}).get("_target_") if "adapter" in data else data.get("_target_")
        if target and target != "???":
            out[path.stem] = str(target)
    return out


def adapter_class(target: str) -> type:
    module, _, name = target.rpartition(".")
    return getattr(importlib.import_module(module), name)


def adapter_meanings(cls: type) -> tuple[str, dict[str, str]]:
    """The class docstring split into its summary (before ``Args:``) and ``{argument: meaning}``
    from its Google-style ``Args:`` section (``    name: meaning``, continued on deeper lines)."""
    doc = inspect.getdoc(cls) if "__doc__" in vars(cls) and cls.__doc__ else ""
    summary, _, args = doc.partition("\nArgs:\n")
    meanings: dict[str, str] = {}
    current = None
    for line in args.splitlines():
        named = re.fullmatch(r" {4}(\w+): ?(.*)", line)
        if named:
            current = named[1]
            meanings[current] = named[2].strip()
        elif current and line.strip():
            meanings[current] += " " + line.strip()
    return summary.strip(), meanings


def adapter_rows(cls: type) -> list[tuple[str, str, str]]:
    """(argument, default as YAML, meaning) for each constructor argument, in signature order."""
    _, meanings = adapter_meanings(cls)
    out = []
    for name, param in inspect.signature(cls).parameters.items():
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        if not meanings.get(name):
            raise ValueError(f"{cls.__module__}.{cls.__qualname__}'s docstring has no 'Args:' line for {name!r}: "
                             "every adapter key says what it means")
        default = "???" if param.default is inspect.Parameter.empty else yaml_value(param.default)
        out.append((name, default, meanings[name]))
    return out


def adapter_loop_rows(cls: type) -> list[tuple[str, str, str]]:
    """(loop key, value as YAML, why) for each entry of the class's ``loop_overrides``: GRPOConfig
    keys only, and never the loop's own default (an override that changes nothing is noise)."""
    fields = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    out = []
    for key, (value, why) in getattr(cls, "loop_overrides", {}).items():
        if key not in fields:
            raise ValueError(f"{cls.__qualname__}.loop_overrides sets {key!r}, which is not a loop key (GRPOConfig)")
        field = fields[key]
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        if value == default:
            raise ValueError(f"{cls.__qualname__}.loop_overrides sets {key}={value!r}, the loop's own default")
        out.append((key, yaml_value(value), why))
    return out


def _comment(text: str, meaning: str) -> str:
    return f"{text.ljust(COMMENT_COLUMN - 1)} # {meaning}"


def render_adapter_yaml(target: str) -> str:
    """conf/adapter/<name>.yaml: the loop keys the adapter sets, then every constructor argument."""
    cls = adapter_class(target)
    summary, _ = adapter_meanings(cls)
    lines = ["# @package _global_",
             f"# Rendered from {target} (constructor, docstring, loop_overrides) by",
             "# python -m grpo.rl.config_docs --write; edit the class, not this file.",
             *[f"# {line}".rstrip() for line in summary.splitlines()]]
    lines += [_comment(f"{key}: {value}", why) for key, value, why in adapter_loop_rows(cls)]
    lines += ["adapter:", f"  _target_: {target}"]
    lines += [_comment(f"  {key}: {value}", meaning) for key, value, meaning in adapter_rows(cls)]
    return "\n".join(lines) + "\n"


def render_adapter_tables(groups: dict[str, str]) -> str:
    """docs/adapters.md: a table of every built-in adapter's keys, and the loop keys it sets."""
    lines = [ADAPTER_TABLE_BEGIN]
    for name, target in groups.items():
        cls = adapter_class(target)
        loop = adapter_loop_rows(cls)
        sets = ("; it sets " + ", ".join(f"`{k}={v}`" for k, v, _ in loop)) if loop else ""
        lines += ["", f"**`adapter={name}`** (`{target}`){sets}", "",
                  "| key | default | meaning |", "|---|---|---|"]
        lines += [f"| `adapter.{key}` | `{value}` | {meaning.replace('|', '/')} |"
                  for key, value, meaning in adapter_rows(cls)]
    lines += ["", ADAPTER_TABLE_END]
    return "\n".join(lines) + "\n"


def _help_adapter_lines(groups: dict[str, str]) -> list[str]:
    lines = []
    for name, target in groups.items():
        cls = adapter_class(target)
        loop = adapter_loop_rows(cls)
        sets = ("; sets " + " ".join(f"{k}={v}" for k, v, _ in loop)) if loop else ""
        lines.append(f"  -- adapter={name} ({target}){sets}")
        lines += [f"  {('adapter.' + key + '=' + value).ljust(40)} {meaning}" for key, value, meaning in adapter_rows(cls)]
    return lines


# --------------------------------------------------------------------------- the loop's renderings


def render_yaml_keys() -> str:
    lines = [YAML_BEGIN]
    for key, value, meaning, section in rows():
        if section:
            lines += ["", f"# {section}"]
        indent = "  " if "." in key else ""
        name = key.rsplit(".", 1)[-1]
        text = f"{indent}{name}:" + (f" {value}" if value else "")
        lines.append(f"{text.ljust(COMMENT_COLUMN - 1)} # {meaning}")
    lines.append(YAML_END)
    return "\n".join(lines) + "\n"


def render_markdown_table() -> str:
    lines = [TABLE_BEGIN, "", "| key | default | meaning |", "|---|---|---|"]
    for key, value, meaning, _ in rows():
        default = f"`{value}`" if value else ""
        lines.append(f"| `{key}` | {default} | {meaning.replace('|', '/')} |")
    lines += ["", TABLE_END]
    return "\n".join(lines) + "\n"


def render_help(groups: dict[str, str] | None = None) -> str:
    """conf/hydra/help/grpo.yaml: Hydra's --help page, with every loop key and every built-in
    adapter's key (``groups``: adapter_groups() of the config tree), each with its meaning."""
    groups = adapter_groups() if groups is None else groups
    keys = []
    for key, value, meaning, section in rows():
        if section:
            keys.append(f"  -- {section}")
        keys.append(f"  {(key + ('=' + value if value else '')).ljust(40)} {meaning}")
    template = "\n".join([
        "grpo: GRPO training for language models with LoRA.",
        "",
        "Usage",
        "  python -m grpo adapter=math                        train on the math adapter's task",
        "  python -m grpo adapter=code group_size=8 loss_fn=ppo kl_penalty_coef=0.01",
        "  python -m grpo -m learning_rate=1e-5,2e-5          a sweep: one run directory each",
        "  python -m grpo hydra.run.dir=outputs/my_run        rerun the same command to resume it",
        "  python -m grpo adapter=custom adapter._target_=my_pkg.MyAdapter +adapter.my_arg=3",
        "  python -m grpo adapter=math --cfg job              the resolved config (adapter.*, backend.* too)",
        "",
        "== Config groups (pick one: group=option) ==",
        "$APP_CONFIG_GROUPS",
        "",
        "== Loop keys (key=default, override any: key=value) ==",
        *keys,
        "",
        "== Adapter keys (adapter.key=default, override any: adapter.key=value) ==",
        *_help_adapter_lines(groups),
        "",
        "Hydra's own flags: python -m grpo --hydra-help",
    ])
    if any("$" in line for line in [*keys, *_help_adapter_lines(groups)]):
        # Hydra fills the page in with string.Template: a '$' in a meaning would be read as a field.
        raise ValueError("a help text holds '$': say it without one")
    body = "\n".join("    " + line if line else "" for line in template.splitlines())
    return ("# Rendered from GRPOConfig in grpo/rl/config.py and the adapter classes by\n"
            "# python -m grpo.rl.config_docs --write; do not edit.\n"
            "app_name: grpo\nheader: ''\nfooter: ''\ntemplate: |-\n" + body + "\n")


# --------------------------------------------------------------------------- files


def replace_region(text: str, begin: str, end: str, rendered: str) -> str:
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"markers {begin!r} ... {end!r} not found")
    stop = text.index("\n", stop) + 1
    return text[:start] + rendered + text[stop:]


def targets(root: Path) -> dict[Path, str]:
    """Each rendered file of a source checkout at ``root`` with the text it should hold."""
    conf = root / "conf"
    yaml_path, table_doc = conf / "config.yaml", root / "docs" / "configuration.md"
    adapter_doc = root / "docs" / "adapters.md"
    groups = adapter_groups(conf)
    return {
        yaml_path: replace_region(yaml_path.read_text(), YAML_BEGIN, YAML_END, render_yaml_keys()),
        conf / "hydra" / "help" / "grpo.yaml": render_help(groups),
        table_doc: replace_region(table_doc.read_text(), TABLE_BEGIN, TABLE_END, render_markdown_table()),
        **{conf / "adapter" / f"{name}.yaml": render_adapter_yaml(target) for name, target in groups.items()},
        adapter_doc: replace_region(adapter_doc.read_text(), ADAPTER_TABLE_BEGIN, ADAPTER_TABLE_END,
                                    render_adapter_tables(groups)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="rewrite the files (default: list the stale ones)")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2])
    args = parser.parse_args()
    wanted = targets(args.root)
    stale = [path for path, text in wanted.items() if not path.is_file() or path.read_text() != text]
    for path in stale:
        if args.write:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(wanted[path])
        print(("rewrote " if args.write else "stale: ") + str(path))
    if stale and not args.write:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
