"""grpo.api.checkpoint_store on a temporary directory: paths, listings, TTLs, publish, delete, downloads."""

from __future__ import annotations

import datetime
import subprocess
import tarfile
import time

import pytest

from grpo import types
from grpo.api.checkpoint_store import CheckpointStore, tinker_path


def writer(files: dict[str, bytes]):
    def write(folder):
        for rel, data in files.items():
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).write_bytes(data)
    return write


@pytest.fixture
def store(tmp_path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "store")


def test_saved_checkpoint_resolves_to_its_files_and_lists_with_sdk_fields(store) -> None:
    run = store.create_run("tiny", lora_rank=4, train_mlp=False, user_metadata={"who": "test"})
    ckpt = store.save(run.training_run_id, "training", "step_1", writer({"a.bin": b"12345", "sub/b.txt": b"xy"}),
                      user_metadata={"step": "1"})
    assert ckpt.tinker_path == f"tinker://{run.training_run_id}/weights/step_1"
    assert ckpt.checkpoint_id == "weights/step_1" and ckpt.checkpoint_type == "training"
    assert ckpt.size_bytes == 7 and ckpt.public is False and ckpt.expires_at is None
    assert ckpt.user_metadata == {"step": "1"}
    folder = store.resolve(ckpt.tinker_path)
    assert (folder / "a.bin").read_bytes() == b"12345"
    assert store.resolve(str(folder)) == folder  # a plain directory passes through

    sampler = store.save(run.training_run_id, "sampler", "final", writer({"w": b"1"}))
    listed = store.list_checkpoints(run.training_run_id).checkpoints
    assert [c.tinker_path for c in listed] == [sampler.tinker_path, ckpt.tinker_path]  # newest first
    got = store.get_run(run.training_run_id)
    assert (got.base_model, got.lora_rank, got.is_lora, got.model_owner) == ("tiny", 4, True, "local")
    assert got.last_checkpoint == ckpt and got.last_sampler_checkpoint == sampler
    assert got.user_metadata == {"who": "test"}
    info = store.weights_info(sampler.tinker_path)
    assert (info.base_model, info.lora_rank, info.train_mlp, info.train_attn) == ("tiny", 4, False, True)
    parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(sampler.tinker_path)
    assert (parsed.training_run_id, parsed.checkpoint_type) == (run.training_run_id, "sampler")


def test_user_checkpoints_span_runs_and_page(store) -> None:
    paths = []
    for i in range(3):
        run = store.create_run("tiny", lora_rank=2)
        paths.append(store.save(run.training_run_id, "sampler", f"s{i}", writer({"f": b"x"})).tinker_path)
    page = store.list_user_checkpoints(limit=2, offset=1)
    assert [c.tinker_path for c in page.checkpoints] == [paths[1], paths[0]]
    assert (page.cursor.offset, page.cursor.limit, page.cursor.total_count) == (1, 2, 3)
    runs = store.list_runs(limit=10)
    assert runs.cursor.total_count == 3 and len(runs.training_runs) == 3


def test_ttl_expires_and_removes_a_checkpoint_and_none_clears_it(store) -> None:
    run = store.create_run("tiny", lora_rank=2)
    short = store.save(run.training_run_id, "training", "short", writer({"f": b"x"}), ttl_seconds=1)
    kept = store.save(run.training_run_id, "training", "kept", writer({"f": b"x"}), ttl_seconds=1)
    assert short.expires_at is not None
    assert abs((short.expires_at - short.time).total_seconds() - 1) < 1e-3
    assert store.set_ttl(kept.tinker_path, None).expires_at is None
    later = store.set_ttl(kept.tinker_path, 3600).expires_at
    assert later - datetime.datetime.now(datetime.UTC) > datetime.timedelta(seconds=3590)
    store.set_ttl(kept.tinker_path, None)
    time.sleep(1.1)
    assert [c.tinker_path for c in store.list_checkpoints(run.training_run_id).checkpoints] == [kept.tinker_path]
    assert not (store.root / run.training_run_id / "weights" / "short").exists()
    with pytest.raises(FileNotFoundError, match="never saved, deleted, or expired"):
        store.resolve(short.tinker_path)
    with pytest.raises(ValueError, match="ttl_seconds must be a positive number"):
        store.set_ttl(kept.tinker_path, -5)


def test_expiry_is_swept_for_what_is_read_and_a_listing_reads_each_run_once(store, monkeypatch) -> None:
    """Listing or resolving one run purges that run's expired checkpoints, not the whole store's:
    purging everything for every run listed made one page of ``list_runs`` read the store once per
    run (90 s for 1,475 runs of a real cache). Whole-store listings still purge everything."""
    runs = [store.create_run("tiny", lora_rank=2).training_run_id for _ in range(5)]
    expiring = {run: store.save(run, "sampler", "s", writer({"f": b"x"}), ttl_seconds=1).tinker_path for run in runs}
    time.sleep(1.1)
    first, second, *rest = runs
    assert store.list_checkpoints(first).checkpoints == []
    assert not store._dir(expiring[first]).exists() and store._dir(expiring[second]).exists()  # not second's
    with pytest.raises(FileNotFoundError, match="expired"):
        store.resolve(expiring[second])
    assert not store._dir(expiring[second]).exists() and all(store._dir(expiring[r]).exists() for r in rest)

    reads = []
    real = store._checkpoint_paths
    monkeypatch.setattr(store, "_checkpoint_paths", lambda run_id: reads.append(run_id) or real(run_id))
    page = store.list_runs(limit=2)
    assert page.cursor.total_count == 5 and not any(store._dir(expiring[r]).exists() for r in rest)
    # one read of every run for its activity, then the page's two runs listed in full (a sweep and a listing each)
    assert sorted(set(reads)) == sorted(runs) and len(reads) == len(runs) + 2 * 2
    reads.clear()
    store.list_user_checkpoints()
    assert len(reads) == len(runs)  # one read of every run; full records for the page alone


def test_publish_delete_and_overwrite(store) -> None:
    run = store.create_run("tiny", lora_rank=2)
    path = store.save(run.training_run_id, "sampler", "s", writer({"f": b"old"})).tinker_path
    assert store.set_public(path, True).public is True
    assert store.get_checkpoint(path).public is True
    assert store.set_public(path, False).public is False
    store.save(run.training_run_id, "sampler", "s", writer({"f": b"new!"}))
    assert (store.resolve(path) / "f").read_bytes() == b"new!"
    with pytest.raises(FileExistsError, match="overwrite=True"):
        store.save(run.training_run_id, "sampler", "s", writer({"f": b"x"}), overwrite=False)
    store.delete(path)
    assert store.list_checkpoints(run.training_run_id).checkpoints == []
    with pytest.raises(FileNotFoundError):
        store.delete(path)


def test_archive_opens_with_tar_and_file_paths_list_every_file(store, tmp_path) -> None:
    run = store.create_run("tiny", lora_rank=2)
    files = {"adapter_config.json": b"{}", "adapter_model.safetensors": b"\0" * 100, "nested/x.txt": b"hi"}
    path = store.save(run.training_run_id, "sampler", "final", writer(files)).tinker_path
    assert {k: v.read_bytes() for k, v in store.file_paths(path).items()} == files
    archive = store.archive(path)
    out = tmp_path / "extracted"
    out.mkdir()
    subprocess.run(["tar", "-xf", str(archive), "-C", str(out)], check=True)
    assert {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()} == files
    with tarfile.open(archive) as tar:
        assert sorted(tar.getnames()) == sorted(files)


def test_bad_paths_and_names_say_what_is_valid(store) -> None:
    run = store.create_run("tiny", lora_rank=2)
    with pytest.raises(ValueError, match="invalid tinker path"):
        store.get_checkpoint("tinker://x/bogus/y")
    with pytest.raises(ValueError, match=r"name='../up' is invalid: a name is"):
        store.save(run.training_run_id, "training", "../up", writer({}))
    with pytest.raises(FileNotFoundError, match="no training run 'run-missing'"):
        store.list_checkpoints("run-missing")
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        store.resolve(tinker_path(run.training_run_id, "training", "never"))


# ------------------------------------------------------------------ what is on disk (issue #37 E)

def test_a_symlink_inside_a_checkpoint_is_never_followed(store, tmp_path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("not the store's")
    run = store.create_run("tiny", lora_rank=2)
    path = store.save(run.training_run_id, "sampler", "s", writer({"adapter_config.json": b"{}"})).tinker_path
    folder = store.resolve(path)
    (folder / "leak.txt").symlink_to(secret)
    (folder / "leakdir").symlink_to(tmp_path, target_is_directory=True)
    assert set(store.file_paths(path, check=False)) == {"adapter_config.json"}
    assert store.get_checkpoint(path).size_bytes == 2
    with pytest.raises(ValueError, match="symlink"):
        store.resolve(path)  # a loader never reads through it
    with pytest.raises(ValueError, match="symlink"):
        store.archive(path)
    store.delete(path)  # what cannot be read can still be removed, and only the checkpoint goes
    assert not folder.exists() and secret.read_text() == "not the store's"


def test_a_planted_checkpoint_is_skipped_and_every_listing_still_answers(store, tmp_path, caplog) -> None:
    outside = tmp_path / "outside"
    (outside / "ckpt").mkdir(parents=True)
    (outside / "ckpt" / "adapter_config.json").write_text("{}")
    run = store.create_run("tiny", lora_rank=2)
    good = store.save(run.training_run_id, "training", "good", writer({"f": b"1"})).tinker_path
    weights = store.root / run.training_run_id / "weights"
    (weights / "planted").symlink_to(outside / "ckpt", target_is_directory=True)
    (weights / "planted.meta.json").write_text('{"time": "2020-01-01T00:00:00+00:00"}')
    (weights / "garbled.meta.json").write_text("{not json")
    (weights / "garbled").mkdir()
    (weights / "listed.meta.json").write_text("[]")  # JSON, but no record: no field can be read from it
    (weights / "listed").mkdir()
    other = store.create_run("tiny", lora_rank=2)
    (store.root / other.training_run_id / "run.json").write_text("{broken")  # a run record that does not parse
    import logging
    with caplog.at_level(logging.WARNING, logger="grpo.api.checkpoint_store"):
        for _ in range(2):
            assert [c.tinker_path for c in store.list_checkpoints(run.training_run_id).checkpoints] == [good]
            assert [c.tinker_path for c in store.list_user_checkpoints().checkpoints] == [good]
            assert [r.training_run_id for r in store.list_runs().training_runs] == [run.training_run_id]
            store.purge_expired()
    skipped = [r.getMessage() for r in caplog.records]
    assert len(skipped) == 4 and all(str(store.root) not in m for m in skipped), skipped  # once each
    assert all(any(name in m for m in skipped) for name in ("planted", "garbled", "listed"))
    assert (outside / "ckpt" / "adapter_config.json").exists()
