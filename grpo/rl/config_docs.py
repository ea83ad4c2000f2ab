"""conf/config.yaml's loop keys, ``--help`` and the table in docs/configuration.md, rendered from GRPOConfig.

GRPOConfig (grpo/rl/config.py) is the one declaration of every loop key: its default and meaning.
This module renders the three places a user reads them; tests/test_config_docs.py fails when a
file drifts from the dataclass, and in a source checkout

    python -m grpo.rl.config_docs --write

rewrites them. Free of torch and Hydra, like the config itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from grpo.api.losses import LOSSES, TIS_CAP
from grpo.rl.config import GRPOConfig, WandbConfig

YAML_BEGIN = "# >>> loop keys: rendered from GRPOConfig in grpo/rl/config.py (python -m grpo.rl.config_docs --write)"
YAML_END = "# <<< loop keys"
TABLE_BEGIN = "<!-- config table: rendered from GRPOConfig in grpo/rl/config.py (python -m grpo.rl.config_docs --write) -->"
TABLE_END = "<!-- end of config table -->"
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


# --------------------------------------------------------------------------- the three renderings


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


def render_help() -> str:
    """conf/hydra/help/grpo.yaml: Hydra's --help page, with every loop key and its meaning."""
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
        "Hydra's own flags: python -m grpo --hydra-help",
    ])
    body = "\n".join("    " + line if line else "" for line in template.splitlines())
    return ("# Rendered from GRPOConfig in grpo/rl/config.py by python -m grpo.rl.config_docs --write; do not edit.\n"
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
    return {
        yaml_path: replace_region(yaml_path.read_text(), YAML_BEGIN, YAML_END, render_yaml_keys()),
        conf / "hydra" / "help" / "grpo.yaml": render_help(),
        table_doc: replace_region(table_doc.read_text(), TABLE_BEGIN, TABLE_END, render_markdown_table()),
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
