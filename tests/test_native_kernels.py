"""grpo's native kernels are built once per machine, for its instruction sets, and found again.

The loader (grpo/models/native_kernels.py): its switch, the build folder's name, the
compiler flags for the CPU's vector width, ninja where the environment is not activated, and a
broken build in the cache built again rather than loaded for ever.
"""

from __future__ import annotations

import os

import pytest
import torch

from grpo.models import dtype_probe, native_kernels


def test_the_switch_takes_on_or_off(monkeypatch) -> None:
    monkeypatch.setenv(native_kernels.ENV_SWITCH, "sometimes")
    with pytest.raises(ValueError, match="GRPO_NATIVE_KERNELS='sometimes' is invalid; valid: on, off"):
        native_kernels.enabled()
    monkeypatch.setenv(native_kernels.ENV_SWITCH, "off")
    assert native_kernels.kernels() is None


def test_a_build_is_never_loaded_on_other_instruction_sets(monkeypatch) -> None:
    """A cache under a home directory shared by a cluster's nodes: each CPU kind builds its own."""
    here = native_kernels.build_directory()
    monkeypatch.setattr(dtype_probe, "instruction_sets", lambda: "AVX2 flags 00000000")
    assert native_kernels.build_directory() != here
    assert here.parent == native_kernels.build_directory().parent


def test_a_change_to_any_source_or_header_is_another_build(monkeypatch, tmp_path) -> None:
    """The kernels are several files (grpo/models/native/): an edit to a header that only some of
    them include must still name a new build folder, or a stale library would be loaded."""
    sources = tmp_path / "native"
    sources.mkdir()
    for path in native_kernels.SOURCE_DIR.iterdir():
        (sources / path.name).write_bytes(path.read_bytes())
    names = {path.name for path in native_kernels._source_files()}
    assert {"ops.h", "common.h", "simd.h", "register.cpp"} <= names
    monkeypatch.setattr(native_kernels, "SOURCE_DIR", sources)
    here = native_kernels.build_directory()
    assert {path.name for path in native_kernels._source_files()} == names
    (sources / "simd.h").write_text((sources / "simd.h").read_text() + "\n// an edit\n")
    edited = native_kernels.build_directory()
    assert edited != here
    (sources / "extra.cpp").write_text("// a new file\n")
    assert native_kernels.build_directory() not in (here, edited)


def test_ninja_is_found_where_the_environment_is_not_activated(monkeypatch) -> None:
    """cpp_extension runs ``ninja`` from PATH; the ninja package's copy is in the environment's bin
    folder, which ``.venv/bin/python -m grpo`` does not put on PATH."""
    import ninja

    monkeypatch.setattr(native_kernels.shutil, "which", lambda name: None)
    monkeypatch.setenv("PATH", "/nowhere")
    with native_kernels._ninja_on_path():
        assert os.environ["PATH"].split(os.pathsep)[0] == ninja.BIN_DIR
        assert os.path.exists(os.path.join(ninja.BIN_DIR, "ninja"))
    assert os.environ["PATH"] == "/nowhere"


@pytest.mark.slow
def test_a_build_that_does_not_load_is_built_again(tmp_path, native_ops) -> None:
    """A library left broken in the cache (a build killed while linking, a truncated copy) is
    built again from scratch, not loaded for ever with the eager step as the result. Two fresh
    processes on a fresh cache: two builds."""
    import subprocess
    import sys

    code = ("from grpo.models import native_kernels as n; "
            "print(n.kernels() is not None); print(n.build_directory())")
    env = {**os.environ, "GRPO_CACHE": str(tmp_path), native_kernels.ENV_SWITCH: "on"}

    def run() -> tuple[list[str], str]:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout.split(), done.stderr

    (loaded, folder), err = run()
    assert loaded == "True" and "built the native kernels" in err
    library = next(p for p in os.scandir(folder) if p.name.endswith(".so"))
    with open(library.path, "wb") as handle:
        handle.write(b"half a library")
    (loaded, _), err = run()
    assert loaded == "True"
    assert "did not load" in err and "building them again" in err and "built the native kernels" in err
    (loaded, _), err = run()  # and the rebuilt one is simply loaded
    assert loaded == "True" and err.strip() == ""


def test_the_kernels_are_compiled_for_the_vector_width_aten_is_capped_to(monkeypatch) -> None:
    """A run emulating an avx2-only CPU (ATEN_CPU_CAPABILITY=avx2) gets avx2 code, not this CPU's."""
    monkeypatch.setattr(native_kernels.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert native_kernels._arch_flags() == ["-march=haswell", "-mtune=native"]
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert native_kernels._arch_flags() == ["-march=native"]
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert native_kernels._arch_flags() == []
