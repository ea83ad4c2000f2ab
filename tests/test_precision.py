"""Sampling and training precision: what ``auto`` picks (measured, with faked timings: this machine's
decide nothing here), bad input, and a bf16 sampler beside an fp32 trainer (its own bf16 copy of the
base weights, LoRA unmerged, refreshed as training moves)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from backend_helpers import perturb_adapter

from grpo import models, types
from grpo.backends.local import ServiceClient
from grpo.models import dtype_probe, kernel_probe, precision
from grpo.models.cpu_linear import packing_works

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
PROMPT = [1, 504, 3457, 28, 216, 17, 1183, 19, 30, 40, 41]
SMOL = dtype_probe.Shapes(hidden=576, intermediate=1536, q_out=576, kv_out=192, vocab=49152, layers=30)


class FakeTimer:
    """Seconds per step {role: (fp32, bf16)} as a machine would measure them; counts its calls."""

    def __init__(self, sample: tuple[float, float], train: tuple[float, float]):
        self.result, self.calls = {"sample": sample, "train": train}, 0

    def __call__(self, shapes: dtype_probe.Shapes) -> dict[str, tuple[float, float]]:
        self.calls += 1
        return self.result


@pytest.fixture
def probe(monkeypatch, tmp_path):
    """The probe on (conftest turns it off), caching in a tmp file, timed by the FakeTimer given."""
    monkeypatch.setenv(dtype_probe.ENV_SWITCH, "on")
    monkeypatch.setattr(dtype_probe, "_memo", {})
    monkeypatch.setattr(dtype_probe, "cache_file", lambda: tmp_path / "precision.json")
    monkeypatch.setattr(dtype_probe, "machine_busy", lambda: None)  # however loaded this machine is now
    # an fp32 model's training kernel is probed too (kernel_probe.py): a tie, so oneDNN, untimed
    monkeypatch.setattr(kernel_probe, "_memo", {})
    monkeypatch.setattr(kernel_probe, "measure", lambda shapes: (1.0, 1.0))
    # ... and the sampler's packed layout in its precision: a tie, so oneDNN's, untimed
    monkeypatch.setattr(kernel_probe, "measure_layouts", lambda shapes: (1.0, 1.0))
    monkeypatch.setattr(kernel_probe, "measure_bf16_layouts", lambda shapes: (1.0, 1.0))

    def use(timer: FakeTimer) -> FakeTimer:
        monkeypatch.setattr(dtype_probe, "measure", timer)
        return timer

    return use


def layouts_weighed() -> bool:
    """Whether a sampler's packed layout is chosen by measurement here (kernel_probe.decoding_layout)."""
    from grpo.models import cpu_linear

    return cpu_linear.wanted() and cpu_linear.onednn_works() and cpu_linear.stream_available()


def test_auto_is_bf16_on_cuda_and_fp32_on_a_cpu_that_was_not_measured(monkeypatch) -> None:
    def no_timing(shapes):
        raise AssertionError("auto timed the model")

    monkeypatch.setattr(dtype_probe, "measure", no_timing)
    assert precision.auto_dtype(CUDA, "sample_dtype", SMOL) is torch.bfloat16  # no probe on CUDA
    assert precision.resolve("train_dtype", "auto", CPU, SMOL) is torch.float32  # GRPO_PRECISION_PROBE=off
    monkeypatch.setenv(dtype_probe.ENV_SWITCH, "on")
    assert precision.resolve("train_dtype", None, CPU, shapes=None) is torch.float32  # shapes unknown


def test_auto_picks_for_each_role_what_measured_faster_by_the_margin(probe) -> None:
    probe(FakeTimer(sample=(0.020, 0.010), train=(3.0, 6.0)))  # bf16 2x faster decoding, 2x slower training
    assert precision.resolve("sample_dtype", "auto", CPU, SMOL) is torch.bfloat16
    assert precision.resolve("train_dtype", "auto", CPU, SMOL) is torch.float32
    # 20% faster is within what the probe misses (only Linears timed): fp32; 25% is the margin
    assert dtype_probe.Timing(1.2, 1.0).choice == "fp32" and dtype_probe.Timing(1.25, 1.0).choice == "bf16"


def test_auto_trains_in_bf16_only_beside_a_bf16_sampler(probe, capsys) -> None:
    """An fp32 sampler beside a bf16 trainer keeps its own fp32 copy with LoRA unmerged: slower than
    the folded fp32 sampler the probe timed, so auto does not pair them."""
    probe(FakeTimer(sample=(0.020, 0.030), train=(3.0, 1.5)))  # bf16 samples slower, trains 2x faster
    assert precision.resolve("train_dtype", "auto", CPU, SMOL) is torch.float32
    assert precision.resolve("sample_dtype", "auto", CPU, SMOL) is torch.float32
    assert "train_dtype fp32 (per training pass: fp32 3000.0 ms, bf16 1500.0 ms, bf16 2.00x faster; fp32 kept " \
           "beside the fp32 sampler)" in capsys.readouterr().err
    assert dtype_probe.choose({"sample": dtype_probe.Timing(2.0, 1.0), "train": dtype_probe.Timing(2.0, 1.0)}) == \
        {"sample": "bf16", "train": "bf16"}


def test_where_bf16_trains_faster_sampling_stays_bf16_unless_fp32_samples_faster_by_the_margin(probe, capsys) -> None:
    """An AMX CPU: bf16 trains 1.4x faster, and the fp32 sampler packed in the streaming layout
    comes within the margin of bf16 (31 against 27 ms a decoding step, where oneDNN's fp32 layout
    took 43): auto stays bf16 for both roles rather than give up bf16 training for an fp32 sampler
    that is no faster."""
    probe(FakeTimer(sample=(0.031, 0.027), train=(0.36, 0.26)))
    assert precision.resolve("sample_dtype", "auto", CPU, SMOL) is torch.bfloat16
    assert precision.resolve("train_dtype", "auto", CPU, SMOL) is torch.bfloat16
    assert "sample_dtype bf16 (per decoding step: fp32 31.0 ms, bf16 27.0 ms, bf16 1.15x faster; bf16 beside the " \
           "bf16 trainer)" in capsys.readouterr().err
    timing = dtype_probe.Timing
    # fp32 samples a little faster (within the margin): still the bf16 pair
    assert dtype_probe.choose({"sample": timing(0.026, 0.027), "train": timing(0.36, 0.26)}) == \
        {"sample": "bf16", "train": "bf16"}
    # fp32 samples faster by the margin: the fp32 pair (bf16 training would need the slower fp32 copy)
    assert dtype_probe.choose({"sample": timing(0.020, 0.027), "train": timing(0.36, 0.26)}) == \
        {"sample": "fp32", "train": "fp32"}


@pytest.mark.parametrize("bf16_slower", [1.02, 1.4, 20.0])
def test_auto_is_never_slower_than_fp32(probe, bf16_slower) -> None:
    """A CPU where bf16 measures slower in both roles (emulated bf16, AMX sampling): auto is fp32
    throughout, through the whole ServiceClient path."""
    probe(FakeTimer(sample=(0.02, 0.02 * bf16_slower), train=(1.0, bf16_slower)))
    engine = ServiceClient(device="cpu").create_lora_training_client("tiny", seed=0, rank=2).engine
    assert engine.dtype is torch.float32 and engine.sample_dtype is torch.float32
    assert engine._sampler_copy is None


def test_auto_measures_once_per_machine_and_says_so_once(probe, tmp_path, capsys) -> None:
    timer = probe(FakeTimer(sample=(0.030, 0.015), train=(2.0, 1.0)))  # bf16 2x faster in both
    engine = ServiceClient(device="cpu").create_lora_training_client("tiny", seed=0, rank=2).engine
    assert engine.dtype is torch.bfloat16 and engine.sample_dtype is torch.bfloat16
    line, *layout_lines = capsys.readouterr().err.splitlines()
    # (the bf16 sampler's layout is asked for too, where there is a choice: kernel_probe.py)
    assert [x.split(" on ")[0] for x in layout_lines] == ["grpo: bf16 decoding layout"] * layouts_weighed()
    assert line.startswith(f"grpo: auto precision on {dtype_probe.cpu_name()} ({dtype_probe.instruction_sets()} | "
                           f"torch {torch.__version__}")
    assert "sample_dtype bf16 (per decoding step: fp32 30.0 ms, bf16 15.0 ms, bf16 2.00x faster)" in line
    assert "train_dtype bf16 (per training pass: fp32 2000.0 ms, bf16 1000.0 ms, bf16 2.00x faster)" in line
    ServiceClient(device="cpu").create_lora_training_client("tiny", seed=0, rank=2)  # same process
    dtype_probe._memo.clear()  # as a new process: the cache file answers
    shapes = dtype_probe.Shapes.from_config(models.load_config("tiny"))
    assert dtype_probe.timings(shapes)["sample"] == dtype_probe.Timing(0.030, 0.015)
    assert timer.calls == 1 and capsys.readouterr().err == ""
    stored = [key for key in json.loads((tmp_path / "precision.json").read_text())
              if not key.startswith(kernel_probe.DECODING_LAYOUT["bf16"].key_prefix)]
    assert stored == [dtype_probe.machine_key(shapes)]


def test_a_cache_entry_from_other_instruction_sets_is_not_used(probe, monkeypatch, tmp_path) -> None:
    """Clouds name different CPUs alike, and a home directory may be shared across a cluster's
    nodes: an answer measured with AMX must not be read on a node without it, nor where oneDNN or
    MKL are capped to fewer instruction sets."""
    timer = probe(FakeTimer(sample=(0.030, 0.015), train=(2.0, 1.0)))
    shapes = dtype_probe.Shapes.from_config(models.load_config("tiny"))
    real_cpuinfo = dtype_probe._cpuinfo
    keys = []
    for flags, caps in (("avx2 avx512f amx_bf16 amx_tile", {}), ("avx2 avx512f", {}),
                        ("avx2 avx512f", {"ONEDNN_MAX_CPU_ISA": "AVX2"}),
                        ("avx2 avx512f", {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"})):
        monkeypatch.setattr(dtype_probe, "_cpuinfo", lambda field, flags=flags: flags if field == "flags"
                            else real_cpuinfo(field))
        for name in ("ATEN_CPU_CAPABILITY", *dtype_probe.ISA_CAPS):  # (a whole run may be capped)
            monkeypatch.delenv(name, raising=False)
        for name, value in caps.items():
            monkeypatch.setenv(name, value)
        dtype_probe._memo.clear()  # as a new process on that node
        dtype_probe.timings(shapes)
        keys.append(dtype_probe.machine_key(shapes))
    assert timer.calls == 4 and len(set(keys)) == 4
    assert sorted(json.loads((tmp_path / "precision.json").read_text())) == sorted(keys)
    assert "flags " in keys[0] and "ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2" in keys[3]
    # and a number recorded under caps says so beside the flags (bench.py's machine line)
    assert dtype_probe.cpu_description().endswith(
        "avx2 avx512f (kernels capped: ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2)")
    dtype_probe._memo.clear()  # the same node again: its entry answers
    dtype_probe.timings(shapes)
    assert timer.calls == 4


def test_a_new_build_of_the_native_kernels_is_measured_again(monkeypatch):
    """The streaming layout's numbers are its kernels' numbers: another build of them (a changed
    source, another torch) keys its measurements apart, so an upgrade never answers from the old
    kernels' timings."""
    from grpo.models import cpu_linear, native_kernels

    if not (cpu_linear.wanted() and cpu_linear.onednn_works() and cpu_linear.stream_available()):
        pytest.skip("no streaming layout here: its kernels are not part of the key")
    shapes = dtype_probe.Shapes(hidden=64, intermediate=128, q_out=64, kv_out=32, vocab=300, layers=2)
    built = native_kernels.build_directory()
    ours = dtype_probe.machine_key(shapes)
    assert f"+stream {built.name.rsplit('_', 1)[-1][:8]} |" in ours  # the build the kernels load from
    monkeypatch.setattr(native_kernels, "build_digest", lambda: "0123456789abcdef")
    other = dtype_probe.machine_key(shapes)
    assert other != ours and "+stream 01234567 |" in other


def test_a_busy_machine_is_not_measured_and_auto_is_fp32_until_a_quiet_run(probe, monkeypatch, tmp_path, capsys):
    """Timing on an oversubscribed machine measures the other processes, and would be cached."""
    timer = probe(FakeTimer(sample=(0.030, 0.015), train=(2.0, 1.0)))
    monkeypatch.setattr(dtype_probe, "machine_busy", lambda: "load 6.4 on 2 cores")
    assert precision.resolve("sample_dtype", "auto", CPU, SMOL) is torch.float32
    assert precision.resolve("train_dtype", "auto", CPU, SMOL) is torch.float32
    (line,) = capsys.readouterr().err.splitlines()  # said once per run
    assert line == ("grpo: auto precision not measured, the machine is busy (load 6.4 on 2 cores): "
                    "fp32 for this run, measured by a later one")
    assert timer.calls == 0 and not (tmp_path / "precision.json").exists()
    monkeypatch.setattr(dtype_probe, "machine_busy", lambda: None)
    dtype_probe._memo.clear()  # a later run, on a quiet machine
    assert precision.resolve("sample_dtype", "auto", CPU, SMOL) is torch.bfloat16 and timer.calls == 1


STAT = """cpu  900 0 300 5000 100 0 0 0 0 0
cpu0 {u0} 0 {s0} {i0} {w0} 1 2 {st0} 7 0
cpu1 {u1} 0 {s1} {i1} 0 0 0 0 0 0
intr 12345 0 0
"""


def test_cpu_times_count_all_but_idle_and_iowait_of_the_cores_asked(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(STAT.format(u0=100, s0=50, i0=800, w0=40, st0=9, u1=10, s1=5, i1=900))
    # cpu0: busy 100 + 50 + 1 + 2 + 9 (steal: the host ran someone else) = 162, of 1002 ticks;
    # guest (7) is already in user and not counted twice
    assert dtype_probe._cpu_times([0], stat) == (162, 1002)
    assert dtype_probe._cpu_times([0, 1], stat) == (162 + 15, 1002 + 915)
    assert dtype_probe._cpu_times([0, 5], stat) is None  # a core the kernel does not list: unknown
    assert dtype_probe._cpu_times([0], tmp_path / "absent") is None


def test_a_high_load_average_is_busy_only_while_the_cores_are_in_use(monkeypatch):
    """A load average remembers the last minute: one left by a job that just ended must not keep
    a run from measuring a machine that is idle now; one from a job still running must."""
    import os

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(os, "getloadavg", lambda: (cores - 0.5, 0.0, 0.0))
    monkeypatch.setattr(dtype_probe, "cores_in_use", lambda cpus: pytest.fail("a low load is not looked into"))
    assert dtype_probe.machine_busy() is None
    monkeypatch.setattr(os, "getloadavg", lambda: (cores + 1.4, 0.0, 0.0))
    monkeypatch.setattr(dtype_probe, "cores_in_use", lambda cpus: 0.03)  # make test has just ended
    assert dtype_probe.machine_busy() is None
    monkeypatch.setattr(dtype_probe, "cores_in_use", lambda cpus: 0.97)  # it is still running
    assert dtype_probe.machine_busy() == f"load {cores + 1.4:.1f} on {cores} cores, 97% of them in use now"
    monkeypatch.setattr(dtype_probe, "cores_in_use", lambda cpus: None)  # no /proc/stat: the load decides
    assert dtype_probe.machine_busy() == f"load {cores + 1.4:.1f} on {cores} cores"


def test_cores_kept_busy_by_other_processes_are_seen_in_use():
    """Real processes spinning on every core this process may use: the share measured is theirs."""
    import os
    import subprocess
    import sys
    import time

    cpus = sorted(os.sched_getaffinity(0))
    if dtype_probe.cores_in_use(cpus, window_s=0.05) is None:
        pytest.skip("no /proc/stat here")
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in cpus]
    try:
        time.sleep(0.3)  # (interpreters started and spinning)
        assert dtype_probe.cores_in_use(cpus, window_s=0.5) >= dtype_probe.BUSY_NOW
    finally:
        for p in burners:
            p.kill()
            p.wait()


def test_a_second_process_waits_for_the_first_measurement_and_uses_it(probe, tmp_path) -> None:
    """Jobs of a sweep starting together must not time each other: one measures, the others wait."""
    import fcntl
    import threading

    timer = probe(FakeTimer(sample=(1.0, 1.0), train=(1.0, 1.0)))
    shapes, cache = SMOL, tmp_path / "precision.json"
    with open(tmp_path / "precision.json.lock", "a") as other:  # another process is measuring
        fcntl.flock(other, fcntl.LOCK_EX)
        done = []
        waiter = threading.Thread(target=lambda: done.append(dtype_probe.timings(shapes)))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive() and not done
        entry = {"fp32_s": 0.02, "bf16_s": 0.01}  # what the other process measured
        cache.write_text(json.dumps({dtype_probe.machine_key(shapes): {"sample": entry, "train": entry}}))
    waiter.join(10)
    assert done == [{"sample": dtype_probe.Timing(0.02, 0.01), "train": dtype_probe.Timing(0.02, 0.01)}]
    assert timer.calls == 0


def test_explicit_dtypes_are_not_timed(probe) -> None:
    timer = probe(FakeTimer(sample=(1.0, 1.0), train=(1.0, 1.0)))
    engine = ServiceClient(device="cpu", dtype="fp32").create_lora_training_client("tiny", rank=2).engine
    assert engine.dtype is torch.float32 and timer.calls == 0


def test_forced_bf16_where_it_measured_slower_runs_after_one_line_saying_how_much(probe) -> None:
    probe(FakeTimer(sample=(0.020, 0.028), train=(1.0, 0.5)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert precision.resolve("sample_dtype", "bf16", CPU, SMOL) is torch.bfloat16
    (warning,) = caught
    message = str(warning.message)
    assert message.startswith(f"sample_dtype=bf16 measured 1.40x slower than fp32 on this CPU ({dtype_probe.cpu_name()})")
    assert "28.0 ms vs 20.0 ms" in message and "\n" not in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning where bf16 measured faster
        assert precision.resolve("train_dtype", "bfloat16", CPU, SMOL) is torch.bfloat16


def test_unknown_dtype_fails_in_one_line_naming_the_key_and_the_valid_values(monkeypatch) -> None:
    with pytest.raises(ValueError, match=r"^sample_dtype='fp8' is invalid; valid: auto, fp32, bf16") as err:
        ServiceClient(device="cpu", sample_dtype="fp8")  # before any model loads
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"^train_dtype='half' is invalid; valid: auto, fp32, bf16"):
        precision.resolve("train_dtype", "half", CPU)
    monkeypatch.setenv(dtype_probe.ENV_SWITCH, "maybe")
    with pytest.raises(ValueError, match=r"^GRPO_PRECISION_PROBE='maybe' is invalid; valid: on, off$"):
        precision.resolve("train_dtype", "auto", CPU, SMOL)


def test_the_server_takes_the_backend_configs_two_keys() -> None:
    from grpo.serve.__main__ import parse_args

    args = parse_args([])
    assert (args.train_dtype, args.sample_dtype, args.dtype) == (None, None, None)  # auto, as in-process
    args = parse_args(["--sample-dtype", "bf16", "--dtype", "fp32"])
    svc = ServiceClient(dtype=args.dtype, train_dtype=args.train_dtype, sample_dtype=args.sample_dtype)
    assert (svc.train_dtype, svc.sample_dtype) == ("fp32", "bf16")


def test_the_server_refuses_an_unknown_dtype_in_one_line(capsys) -> None:
    from grpo.serve.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--train-dtype", "fp8"])
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "error: --train-dtype='fp8' is invalid; valid: auto, fp32, bf16, float32, bfloat16")


def test_shapes_come_from_the_model_config() -> None:
    config = models.load_config("smollm2")
    assert dtype_probe.Shapes.from_config(config) == SMOL
    assert dtype_probe.Shapes.from_config(object()) is None  # no shapes named: auto stays fp32


def test_the_real_probe_returns_a_choice_per_role_and_caches_it(tmp_path, monkeypatch) -> None:
    """This machine's timing decides nothing here: only that measuring works and is reused."""
    monkeypatch.setattr(dtype_probe, "_memo", {})
    monkeypatch.setattr(dtype_probe, "machine_busy", lambda: None)
    shapes = dtype_probe.Shapes.from_config(models.load_config("tiny"))
    first = dtype_probe.timings(shapes, timer=lambda s: dtype_probe.measure(s, budget_s=0.2), cache=tmp_path / "p.json")
    assert set(first) == {"sample", "train"}
    assert all(t.fp32_s > 0 and t.bf16_s > 0 and t.choice in ("fp32", "bf16") for t in first.values())
    dtype_probe._memo.clear()

    def no_timing(shapes):
        raise AssertionError("measured again")

    assert dtype_probe.timings(shapes, timer=no_timing, cache=tmp_path / "p.json") == first


def test_the_probe_command_measures_and_prints_the_line_auto_would(capsys) -> None:
    """``python -m grpo.models.dtype_probe``: the real probe's result (which carries its per-layout and
    per-kernel variants beside the two roles) printed as one line, and nothing cached."""
    cache = dtype_probe.cache_file()
    before = cache.read_bytes() if cache.exists() else None
    dtype_probe.main(["tiny"])
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("auto precision on ") and "sample_dtype " in line and "train_dtype " in line
    assert (cache.read_bytes() if cache.exists() else None) == before


@pytest.mark.parametrize(("onednn_s", "torch_s", "stream_s", "bf16_stream_s", "bf16_dot_s"),
                         [(4.0, 2.0, 0.5, 0.25, 0.125), (2.0, 4.0, 2.0, 3.0, 4.0)])
def test_each_precision_is_timed_through_its_faster_kernel_and_packed_layout(monkeypatch, onednn_s, torch_s,
                                                                              stream_s, bf16_stream_s,
                                                                              bf16_dot_s) -> None:
    """A float32 model trains through whichever kernel measured faster, and a sampler packs in
    whichever layout measured faster in its precision (kernel_probe.py), so the probe's times are
    those: ``auto`` weighs bf16 against fp32 as each would run. bf16 streams in two kernels where
    the dot product is built ("stream_dot"), and in one where it is not. The ops advance a fake
    clock by their cost: the probe's arithmetic, not this CPU's speed."""
    import types as pytypes

    from grpo.models import cpu_linear

    clock = [0.0]
    cost = {(torch.float32, "onednn"): onednn_s, (torch.float32, "torch"): torch_s, (torch.bfloat16, "onednn"): 3.0}
    decode_cost = {(torch.float32, "onednn"): 1.0, (torch.float32, "stream"): stream_s, (torch.bfloat16, "onednn"): 1.0,
                   (torch.bfloat16, "stream"): bf16_stream_s, (torch.bfloat16, "stream_dot"): bf16_dot_s}

    def ops(seconds: float):
        def op() -> None:
            clock[0] += seconds
        return [op, op], [1.0, 5.0]  # one op counted once a pass, one five times

    monkeypatch.setattr(dtype_probe, "time", pytypes.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(dtype_probe, "_decode_ops", lambda shapes, dtype, layout="onednn": ops(decode_cost[dtype, layout]))
    monkeypatch.setattr(dtype_probe, "_train_ops", lambda shapes, dtype, kernel="onednn": ops(cost[dtype, kernel]))
    monkeypatch.setattr(cpu_linear, "wanted", lambda: True)
    monkeypatch.setattr(cpu_linear, "onednn_works", lambda: True)
    monkeypatch.setattr(cpu_linear, "stream_available", lambda: True)
    monkeypatch.setattr(cpu_linear, "stream_dot_available", lambda: True)
    shapes = dtype_probe.Shapes.from_config(models.load_config("tiny"))
    result = dtype_probe.measure(shapes, budget_s=0.1)
    assert result["train"] == (6 * min(onednn_s, torch_s), 6 * 3.0)
    assert result["sample"] == (6 * min(1.0, stream_s), 6 * min(1.0, bf16_stream_s, bf16_dot_s))
    # each kernel's and layout's time kept too: the kernel probe answers from them (tests/test_kernel_probe.py)
    assert result[dtype_probe.BY_KERNEL] == {"onednn": 6 * onednn_s, "torch": 6 * torch_s}
    assert result[dtype_probe.BY_LAYOUT["fp32"]] == {"onednn": 6.0, "stream": 6 * stream_s}
    assert result[dtype_probe.BY_LAYOUT["bf16"]] == {"onednn": 6.0, "stream": 6 * bf16_stream_s,
                                                     "stream_dot": 6 * bf16_dot_s}
    monkeypatch.setattr(cpu_linear, "stream_dot_available", lambda: False)  # built without avx512_bf16
    result = dtype_probe.measure(shapes, budget_s=0.1)
    assert result["sample"] == (6 * min(1.0, stream_s), 6 * min(1.0, bf16_stream_s))
    assert result[dtype_probe.BY_LAYOUT["bf16"]] == {"onednn": 6.0, "stream": 6 * bf16_stream_s}
    monkeypatch.setattr(cpu_linear, "wanted", lambda: False)  # GRPO_CPU_LINEAR=torch: one kernel, nothing to pick
    monkeypatch.setattr(cpu_linear, "stream_available", lambda: False)  # grpo's kernels not built: one layout
    result = dtype_probe.measure(shapes, budget_s=0.1)
    assert result["train"] == (6 * onednn_s, 6 * 3.0) and dtype_probe.BY_KERNEL not in result
    assert result["sample"] == (6.0, 6.0) and not result.keys() & set(dtype_probe.BY_LAYOUT.values())


@pytest.mark.skipif(not packing_works(torch.bfloat16), reason="this CPU/torch build packs no bf16 weights")
def test_the_probe_decodes_through_every_layer_as_the_sampler_builds_it(monkeypatch) -> None:
    """bf16: the copy's stacked siblings and LoRA side paths (sampler_precision.py), fp32: folded
    packed Linears, over the model's own number of layers (so the cache holds what a step's does)."""
    from grpo.models import fused_projections, lora_linear

    calls = {"stacked": 0, "side": 0}
    output, side = fused_projections.FusedProjections.output, lora_linear.LoraSidePath.forward
    monkeypatch.setattr(fused_projections.FusedProjections, "output",
                        lambda self, x, i: calls.__setitem__("stacked", calls["stacked"] + 1) or output(self, x, i))
    monkeypatch.setattr(lora_linear.LoraSidePath, "forward",
                        lambda self, x: calls.__setitem__("side", calls["side"] + 1) or side(self, x))
    shapes = dtype_probe.Shapes.from_config(models.load_config("tiny"))
    (step, head), counts = dtype_probe._decode_ops(shapes, torch.bfloat16)
    step(), head()
    assert counts[0] == 1  # every layer timed, none scaled up
    assert calls == {"stacked": 5 * shapes.layers, "side": 2 * shapes.layers + 1}  # q k v gate up; o down; lm_head
    (step, head), _ = dtype_probe._decode_ops(shapes, torch.float32)
    step(), head()
    assert calls == {"stacked": 5 * shapes.layers, "side": 2 * shapes.layers + 1}  # LoRA folded in: plain Linears


def _logprob_gap(sampler_lp: list[float], trainer_lp: list[float]) -> float:
    return max(abs(a - b) for a, b in zip(sampler_lp, trainer_lp, strict=True))


@pytest.fixture(scope="module")
def mixed():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bf16 where it measured slower warns; tested above
        svc = ServiceClient(device="cpu", train_dtype="fp32", sample_dtype="bf16")
        return svc.create_lora_training_client("tiny", seed=3, rank=4)


def test_bf16_sampler_beside_an_fp32_trainer_keeps_lora_and_adam_in_fp32(mixed) -> None:
    engine = mixed.engine
    assert engine.dtype is torch.float32 and engine.sample_dtype is torch.bfloat16
    assert {p.dtype for p in engine.model.parameters()} == {torch.float32}
    copy = engine._sampler_copy
    assert {p.dtype for p in copy.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in engine.adapter_parameters(mixed.adapter).values()} == {torch.float32}


def _trainer_logprobs(client, tokens: list[int]) -> list[float]:
    datum = types.Datum(types.ModelInput.from_ints(tokens[:-1]),
                        {"target_tokens": types.TensorData.from_torch(torch.tensor(tokens[1:]))})
    out = client.forward([datum], "cross_entropy").result()
    return out.loss_fn_outputs[0]["logprobs"].tolist()


def test_bf16_sampler_tracks_the_fp32_trainer_through_training(mixed) -> None:
    """The sampler's logprobs stay within bf16 rounding of the trainer's before and after a step
    that moves the policy by far more than that rounding: the copy is refreshed with the new LoRA
    weights and the (small) LoRA delta is not rounded away against the bf16 base weights."""
    client = mixed
    params = types.SamplingParams(max_tokens=8, seed=0, temperature=1.0)
    before = client.save_weights_and_get_sampling_client()
    seqs = before.sample(types.ModelInput.from_ints(PROMPT), 4, params).result().sequences
    gaps, old_lp = [], []
    for s in seqs:
        trainer = _trainer_logprobs(client, PROMPT + s.tokens)[len(PROMPT) - 1:]
        gaps.append(_logprob_gap(s.logprobs, trainer))
        old_lp.append(trainer)
    bf16_gap = max(gaps)
    assert 0 < bf16_gap < 0.02  # bf16 is not fp32, but close (0.0014 here)

    # Train on the sampled tokens: raise their likelihood
    data = [types.Datum(types.ModelInput.from_ints((PROMPT + s.tokens)[:-1]),
                        {"target_tokens": types.TensorData.from_torch(torch.tensor((PROMPT + s.tokens)[1:])),
                         "weights": types.TensorData.from_torch(
                             torch.tensor([0.0] * (len(PROMPT) - 1) + [1.0] * len(s.tokens)))}) for s in seqs]
    for _ in range(3):
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=3e-3)).result()
    after = client.save_weights_and_get_sampling_client()
    moved, gaps_after = [], []
    for s, old in zip(seqs, old_lp, strict=True):
        full = PROMPT + s.tokens
        trainer = _trainer_logprobs(client, full)[len(PROMPT) - 1:]
        sampler = after.compute_logprobs(types.ModelInput.from_ints(full)).result()[len(PROMPT):]
        moved.append(max(a - b for a, b in zip(trainer, old, strict=True)))
        gaps_after.append(_logprob_gap(sampler, trainer))
    assert min(moved) > 20 * bf16_gap  # the policy moved well beyond bf16 noise ...
    assert max(gaps_after) < 0.02  # ... and the bf16 sampler moved with it
    # The sampling client made before the steps still samples its own weights
    again = before.sample(types.ModelInput.from_ints(PROMPT), 4, params).result().sequences
    assert [s.tokens for s in again] == [s.tokens for s in seqs]
    assert [s.logprobs for s in again] == [s.logprobs for s in seqs]


def test_a_resumed_run_keeps_the_precision_auto_first_resolved_to(tmp_path, capsys) -> None:
    """The run directory records what auto resolved to; a resume takes it instead of deciding
    again (the machine may have been too busy to measure the first time, or measures otherwise
    now), an explicit setting still wins, and a record that cannot be read is refused by name."""
    from grpo.backends import create_service_client

    record = tmp_path / "precision.json"
    service = create_service_client({"name": "local", "train_dtype": "auto", "sample_dtype": "auto"}, tmp_path)
    assert service.precision_record == record
    service.create_lora_training_client("tiny", rank=4, seed=0)
    key = models.public_id("tiny")
    assert json.loads(record.read_text()) == {key: {"train_dtype": "fp32", "sample_dtype": "fp32"}}

    # the run began sampling in bf16 (measured faster then); auto here would now say fp32
    record.write_text(json.dumps({key: {"train_dtype": "fp32", "sample_dtype": "bf16"}}))
    capsys.readouterr()
    resumed = create_service_client({"name": "local", "train_dtype": "auto", "sample_dtype": "auto"}, tmp_path)
    engine = resumed.create_lora_training_client("tiny", rank=4, seed=0).engine
    assert (engine.dtype, engine.sample_dtype) == (torch.float32, torch.bfloat16)
    assert f"sample_dtype bf16: auto as this run first resolved it ({record})" in capsys.readouterr().out

    explicit = create_service_client({"name": "local", "sample_dtype": "fp32"}, tmp_path)
    assert explicit.create_lora_training_client("tiny", rank=4, seed=0).engine.sample_dtype == torch.float32
    assert json.loads(record.read_text())[key]["sample_dtype"] == "fp32"  # what the run last ran in

    record.write_text('{"cut off')
    with pytest.raises(ValueError, match=f"precision record {record} cannot be read.*delete it"):
        create_service_client({"name": "local"}, tmp_path)


def _bf16_layouts():
    from grpo.models import cpu_linear

    # (oneDNN's bf16 products are the model's own: a thousandth; the streaming layout sums in another
    # order and rounds LoRA's side path once: its bf16 results differ by bf16's rounding, a few
    # thousandths here)
    return [pytest.param("onednn", 1e-3, marks=pytest.mark.skipif(
                not packing_works(torch.bfloat16), reason="this CPU/torch build packs no bf16 weights")),
            pytest.param("stream", 1e-2, marks=pytest.mark.skipif(
                not cpu_linear.stream_available(), reason="grpo's native kernels are not built here")),
            pytest.param("stream_dot", 1e-2, marks=pytest.mark.skipif(
                not cpu_linear.stream_dot_available(), reason="grpo's kernels are not built with avx512_bf16 here"))]


@pytest.mark.parametrize(("layout", "tolerance"), _bf16_layouts())
def test_bf16_sampling_on_a_cpu_runs_its_own_packed_copy_equal_to_the_bf16_model(monkeypatch, layout,
                                                                                  tolerance) -> None:
    """bf16 sampling beside a bf16 trainer samples through the packed copy (sibling projections
    stacked, sampler_precision.py), in either packed layout, whose logprobs are the bf16 model's
    own: its parameters are bf16 and its buffers keep their dtype (rotary frequencies rounded to
    bf16 put the copy's positions off by up to 1.4 nats of logprob on SmolLM2)."""
    monkeypatch.setattr(kernel_probe, "decoding_layout", lambda shapes, dtype=None: layout)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bf16 where it measured slower warns; tested above
        client = ServiceClient(device="cpu", train_dtype="bf16", sample_dtype="bf16").create_lora_training_client(
            "tiny", seed=3, rank=4)
    engine = client.engine
    copy = engine._sampler_copy
    assert engine.sample_layout == layout
    assert copy is not None and {p.dtype for p in copy.model.parameters()} == {torch.bfloat16}
    assert {n: b.dtype for n, b in copy.model.named_buffers()} == \
        {n: b.dtype for n, b in engine.causal_lm().named_buffers()}
    assert any(b.dtype == torch.float32 for b in copy.model.buffers())  # the check above has something to check
    perturb_adapter(client, seed=1)  # LoRA B is zero at first: give the side paths something to add
    sampler = client.save_weights_and_get_sampling_client()
    seq = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=8, seed=0)
                         ).result().sequences[0]
    full = PROMPT + seq.tokens
    got = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()[1:]
    with torch.no_grad(), engine.use(client.adapter, None) as model:
        logits = model(input_ids=torch.tensor([full])).logits[0, :-1].float()
    want = logits.log_softmax(-1).gather(-1, torch.tensor(full[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(got), want, atol=tolerance, rtol=0)
