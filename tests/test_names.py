"""grpo.api.names, the one rule for client-given names and tinker:// paths, and the store using it:
nothing resolves outside the store root, and killed saves' staging is reclaimed at start-up."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from grpo.api import names
from grpo.api.checkpoint_store import CheckpointStore, tinker_path

BAD_NAMES = ["", "  ", ".", "..", "../up", "/etc", "a/b", "a\\b", ".hidden", "x.tmp", "x.old", "x.meta.json",
             "tinker://r/weights/x", "a b", "é", "x" * 129, None, 3]
GOOD_NAMES = ["step_000010", "final", "for-sampling", "a.b-c_9", "x" * 128]


@pytest.mark.parametrize("value", BAD_NAMES)
def test_bad_names_are_refused_naming_the_field_and_the_rule(value) -> None:
    with pytest.raises(names.UnsafeName, match=r"^checkpoint_name=.* is invalid: a name is 1-128 characters"):
        names.check_name(value, "checkpoint_name")


@pytest.mark.parametrize("value", GOOD_NAMES)
def test_good_names_pass(value) -> None:
    assert names.check_name(value) == value


@pytest.mark.parametrize("path", ["tinker://../../etc/passwd", "tinker://run/weights/..", "tinker://run/weights/a/b",
                                  "tinker:///weights/x", "tinker://run/bogus/x", "tinker://run/weights/ x",
                                  "/etc/passwd", "tinker://run%2F../weights/x"])
def test_bad_tinker_paths_are_refused(path) -> None:
    with pytest.raises(names.UnsafeName, match=r"^path=.* is invalid: expected tinker://<training_run_id>/"):
        names.parse_path(path)


def test_parse_path_splits_a_good_one() -> None:
    assert names.parse_path("tinker://run-1/sampler_weights/final") == ("run-1", "sampler_weights", "final")


def test_a_run_directory_linked_out_of_the_store_is_never_followed(tmp_path) -> None:
    outside = tmp_path / "outside"
    (outside / "weights" / "x").mkdir(parents=True)
    (outside / "weights" / "x.meta.json").write_text('{"time": "2026-01-01T00:00:00+00:00"}')
    (outside / "run.json").write_text("{}")
    store = CheckpointStore(tmp_path / "store")
    store.root.mkdir()
    (store.root / "evil").symlink_to(outside)
    with pytest.raises(names.UnsafeName, match="resolves outside the checkpoint store"):
        store.resolve("tinker://evil/weights/x")
    with pytest.raises(ValueError, match="outside the checkpoint store"):
        store.save("evil", "training", "y", lambda folder: None)
    assert store.list_runs().training_runs == []  # not listed either
    assert sorted(p.name for p in (outside / "weights").iterdir()) == ["x", "x.meta.json"]


def test_killed_saves_staging_is_removed_when_the_store_opens(tmp_path) -> None:
    store = CheckpointStore(tmp_path / "store")
    run = store.create_run("tiny", lora_rank=2).training_run_id
    store.save(run, "training", "kept", lambda folder: (folder / "w").write_text("1"))
    weights = store.root / run / "weights"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    (weights / f"lost.{dead}.tmp").mkdir()  # a save killed mid-write
    (weights / f"lost.{dead}.tmp" / "big").write_bytes(b"0" * 1000)
    (weights / f"live.{os.getpid()}.tmp").mkdir()  # a save in flight in a live process: kept
    (weights / "kept.old").mkdir()  # replaced, old copy stranded
    (store.root / ".archives" / run).mkdir(parents=True)
    (store.root / ".archives" / run / f"kept-1.tar.ab12cd.{dead}.tmp").write_bytes(b"0" * 1000)  # a killed archive
    CheckpointStore(store.root)
    assert list((store.root / ".archives" / run).iterdir()) == []
    assert sorted(p.name for p in weights.iterdir()) == ["kept", "kept.meta.json", f"live.{os.getpid()}.tmp"]
    assert store.resolve(tinker_path(run, "training", "kept"))


def test_in_process_save_refuses_a_tinker_path_or_a_blank_name(tmp_path) -> None:
    from grpo.backends.local import ServiceClient

    client = ServiceClient(checkpoint_dir=tmp_path / "store").create_lora_training_client("tiny", rank=2)
    for bad in ("tinker://../../etc/passwd", "  ", ""):
        with pytest.raises(ValueError, match=r"^name=.* is invalid"):
            client.save_state(bad)
    assert not (tmp_path / "etc").exists() and not (tmp_path.parent / "etc").exists()
