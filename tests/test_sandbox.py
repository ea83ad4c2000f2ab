"""The sandbox: per-test statuses, limits, the bounded pool, and hostile programs contained.

Hostile programs run with the in-interpreter guard OFF, so what contains them is the OS layer
(namespaces, uid drop, rlimits, kills). Each one tries its attack and defines ``solve()`` to return
42 only if the attack worked, so reward 0 is itself evidence of containment.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from adapters import sandbox as sandbox_module
from adapters.sandbox import Job, Sandbox, SandboxError, SandboxLimits, processes_of_uid

ROOT = Path(__file__).resolve().parents[1]
IS_ROOT = os.geteuid() == 0
SOLVE_TEST = ["assert solve() == 42"]
LIMITS = SandboxLimits(timeout_s=4.0, test_timeout_s=2.5, cpu_s=4, memory_mb=256, processes=8,
                       output_bytes=32 * 1024)
TOKEN = uuid.uuid4().hex[:12]
SECRET = f"s3cret-{TOKEN}"
ESCAPE_PATHS = [f"/tmp/grpo-escape-{TOKEN}", f"/var/tmp/grpo-escape-{TOKEN}", f"/dev/shm/grpo-escape-{TOKEN}",
                str(ROOT / f"grpo-escape-{TOKEN}"), f"/root/grpo-escape-{TOKEN}", f"/grpo-escape-{TOKEN}"]


def hostile_programs(port: int) -> dict[str, str]:
    pid = os.getpid()
    return {
        "infinite_loop": "def solve():\n    while True:\n        pass\n",
        "fork_bomb": textwrap.dedent("""
            import os
            while True:
                try:
                    os.fork()
                except OSError:
                    pass
            """),
        "memory_bomb": "blocks = []\nwhile True:\n    blocks.append(bytearray(32 << 20))\n",
        "write_outside": textwrap.dedent(f"""
            written = []
            for path in {ESCAPE_PATHS!r}:
                try:
                    with open(path, "w") as f:
                        f.write("escaped")
                    written.append(path)
                except OSError:
                    pass
            print("WROTE", written)
            # /tmp, /var/tmp and /dev/shm are private tmpfs inside the sandbox: writes there succeed
            # but never reach the host (the test checks the host). Anything else counts as escaped.
            def solve():
                return 42 if any(not p.startswith(("/tmp/", "/var/tmp/", "/dev/shm/")) for p in written) else 0
            """),
        "read_secrets": textwrap.dedent(f"""
            import os
            found = [k for k, v in os.environ.items() if "{TOKEN}" in v]
            for entry in os.listdir("/proc"):
                try:
                    with open("/proc/" + entry + "/environ", "rb") as f:
                        if b"{TOKEN}" in f.read():
                            found.append(entry)
                except OSError:
                    pass
            print("FOUND", found, {{k: v for k, v in os.environ.items()}})
            def solve():
                return 42 if found else 0
            """),
        "open_socket": textwrap.dedent(f"""
            import socket
            connected = False
            try:
                s = socket.create_connection(("127.0.0.1", {port}), timeout=1)
                s.sendall(b"leak")
                connected = True
            except OSError as err:
                print("socket:", err)
            def solve():
                return 42 if connected else 0
            """),
        "print_gigabyte": "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(chunk)\n"
                          "def solve():\n    return 42\n",
        "kill_parent": textwrap.dedent(f"""
            import os, signal, time
            sent = []
            for target in (os.getppid(), {pid}, 1):
                try:
                    os.kill(target, signal.SIGKILL)
                    sent.append(target)
                except OSError:
                    pass
            try:
                os.kill(-1, signal.SIGKILL)  # everything it may signal: nothing but itself, here
            except OSError:
                pass
            time.sleep(0.2)
            def gone(pid):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    return True
                except PermissionError:
                    pass
                return False
            killed = [t for t in sent if gone(t)]  # a namespace's init ignores the signal
            def solve():
                return 42 if killed else 0
            """),
        "deep_recursion": "import sys\nsys.setrecursionlimit(10 ** 7)\n"
                          "def solve(n=0):\n    return solve(n + 1)\n",
        "os_exit": "import os\nos._exit(0)\ndef solve():\n    return 42\n",
        "close_stdout": "import os\nfor fd in range(1024):\n    try:\n        os.close(fd)\n    except OSError:\n"
                        "        pass\ndef solve():\n    return 42\n",
    }


@pytest.fixture(scope="module")
def hostile():
    """Every hostile program, all at once on a 3-slot pool (guard off)."""
    os.environ["GRPO_SANDBOX_TEST_SECRET"] = SECRET
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.setblocking(False)
    programs = hostile_programs(listener.getsockname()[1])
    # The job directories this run makes, recorded as the sandbox makes them (the real mkdtemp
    # underneath): a snapshot of /tmp would also count the directories of sandboxes that other
    # test workers run at the same time, and did.
    made: list[str] = []
    real_mkdtemp = sandbox_module.tempfile.mkdtemp

    def recording_mkdtemp(*args, **kwargs):
        path = real_mkdtemp(*args, **kwargs)
        if os.path.basename(path).startswith("grpo-sandbox-"):
            made.append(path)
        return path

    sandbox = Sandbox(LIMITS, workers=3, guard=False)
    # likewise the uids its runs took from the pool that every sandbox on the machine shares
    uids: set[int] = set()
    if sandbox._slots is not None:
        real_acquire = sandbox._slots.acquire

        @contextlib.contextmanager
        def recording_acquire():
            with real_acquire() as uid:
                uids.add(uid)
                yield uid

        sandbox._slots.acquire = recording_acquire
    start = time.monotonic()
    sandbox_module.tempfile.mkdtemp = recording_mkdtemp
    try:
        results = dict(zip(programs, sandbox.run_many([Job(p, SOLVE_TEST) for p in programs.values()]), strict=True))
    finally:
        sandbox_module.tempfile.mkdtemp = real_mkdtemp
    total = time.monotonic() - start
    try:
        conn, _ = listener.accept()
        conn.close()
        accepted = True
    except BlockingIOError:
        accepted = False
    listener.close()
    del os.environ["GRPO_SANDBOX_TEST_SECRET"]
    assert len(made) >= len(programs)  # every job made its directory through it
    yield {"results": results, "total": total, "accepted": accepted, "sandbox": sandbox,
           "new_jobdirs": {d for d in made if os.path.exists(d)}, "uids": uids}
    sandbox.close()


HOSTILE_NAMES = list(hostile_programs(0))


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_hostile_program_is_contained(hostile, name):
    result = hostile["results"][name]
    assert result.statuses[0] != "pass" and result.fraction == 0.0, (name, result)
    # bounded: the deadline plus kill/teardown, never the program's own schedule
    assert result.wall_s < LIMITS.timeout_s + 2.0, (name, result.wall_s)
    assert SECRET not in result.output
    assert len(result.output.encode()) <= LIMITS.output_bytes


def test_hostile_run_leaves_nothing_behind(hostile):
    assert hostile["total"] < 20
    assert not hostile["accepted"], "a sandboxed program reached a socket on 127.0.0.1"
    for path in ESCAPE_PATHS:
        assert not os.path.exists(path), f"{path} was written from inside the sandbox"
    assert not hostile["new_jobdirs"], hostile["new_jobdirs"]
    if IS_ROOT:
        assert hostile["uids"]
        for uid in sorted(hostile["uids"]):
            # Each uid looked at while holding its pool lock: a sandbox of another test worker
            # may run as it now (and did, failing this check), never while we hold it.
            with hostile["sandbox"]._slots.holding(uid):
                assert not processes_of_uid(uid), f"processes of sandbox uid {uid} survived"


def test_hostile_specific_outcomes(hostile):
    r = hostile["results"]
    assert r["infinite_loop"].statuses == ["timeout"]
    assert r["fork_bomb"].statuses == ["timeout"]  # loading never finished; the fork calls failed
    # all at once beside a fork bomb, on a loaded machine the memory bomb may reach its deadline before its
    # limit (a clean-clone CI run on 2026-11-27, 3 test workers on 2 cores); the limit itself is tested alone below
    assert r["memory_bomb"].statuses == ["timeout"] or (
        r["memory_bomb"].statuses == ["crash"] and "MemoryError" in r["memory_bomb"].details[0])
    assert r["print_gigabyte"].killed == "output_limit"
    assert len(r["print_gigabyte"].output) == LIMITS.output_bytes
    assert r["os_exit"].statuses == ["crash"] and r["os_exit"].exit_code == 0
    assert r["close_stdout"].statuses == ["crash"]
    assert r["deep_recursion"].statuses in (["crash"], ["timeout"])  # stack overflow or 10^7 heap frames
    assert r["write_outside"].statuses == ["fail"]  # ran to the end, nothing escaped
    assert r["read_secrets"].statuses == ["fail"] and "FOUND []" in r["read_secrets"].output
    assert r["open_socket"].statuses == ["fail"] and "unreachable" in r["open_socket"].output
    assert r["kill_parent"].statuses == ["fail"]


def test_the_memory_limit_stops_a_program_with_memory_error():
    """The memory bomb alone, with deadlines no load reaches: the limit, not the clock, ends it."""
    sb = Sandbox(SandboxLimits(timeout_s=60.0, test_timeout_s=30.0, cpu_s=30, memory_mb=256), workers=1, guard=False)
    try:
        result = sb.run(hostile_programs(0)["memory_bomb"], SOLVE_TEST)
    finally:
        sb.close()
    assert result.statuses == ["crash"] and "MemoryError" in result.details[0], result
    assert result.wall_s < 30.0


# ---------------------------------------------------------------------- ordinary behaviour


@pytest.fixture(scope="module")
def sandbox():
    sb = Sandbox(SandboxLimits(timeout_s=4.0, test_timeout_s=1.0), workers=2)
    yield sb
    sb.close()


def test_statuses_per_test_and_fraction(sandbox):
    program = "def add(a, b):\n    return a + b\nprint('loaded')\n"
    tests = ["assert add(1, 2) == 3", "assert add(1, 1) == 3", "assert add(1) == 3", "while True:\n    pass",
             "assert add(2, 2) == 4"]
    result = sandbox.run(program, tests)
    assert result.statuses == ["pass", "fail", "crash", "timeout", "pass"]
    assert "TypeError" in result.details[2]
    assert result.passed == 2 and result.fraction == pytest.approx(2 / 5) and not result.all_passed
    assert result.output == "loaded\n"
    assert result.isolation == ("root" if IS_ROOT else result.isolation)


def test_program_error_crashes_every_test_and_setup_runs(sandbox):
    broken = sandbox.run("def f(:\n", ["assert True", "assert 1"])
    assert broken.statuses == ["crash", "crash"] and "SyntaxError" in broken.details[0]
    exited = sandbox.run("import sys\nsys.exit(0)", ["assert 1"])
    assert exited.statuses == ["crash"] and "SystemExit" in exited.details[0]
    with_setup = sandbox.run("def f():\n    return 2", ["assert g() == 2"], setup="g = f")
    assert with_setup.all_passed and with_setup.fraction == 1.0


def test_environment_is_scrubbed_and_program_runs_unprivileged(sandbox, monkeypatch):
    monkeypatch.setenv("GRPO_SANDBOX_TEST_SECRET", SECRET)
    result = sandbox.run("import os, json\nprint(json.dumps([dict(os.environ), os.getuid(), os.getcwd()]))",
                         ["assert 1"])
    env, uid, cwd = json.loads(result.output)
    assert SECRET not in result.output and set(env) <= {"PATH", "LANG", "HOME", "PYTHONDONTWRITEBYTECODE"}
    assert cwd == "/tmp/work"
    if IS_ROOT:
        assert uid >= sandbox.uid_base  # dropped from root to a per-slot uid


def test_guard_refuses_sockets_and_subprocesses(sandbox):
    result = sandbox.run("", ["import socket\nsocket.socket()", "import os\nos.system('true')",
                              "import os\nos.kill(os.getpid(), 0)"])
    assert result.statuses == ["crash"] * 3
    assert all("PermissionError" in d for d in result.details), result.details


def test_pool_is_bounded_and_parallel(sandbox):
    program = "import time\nstart = time.time()\ntime.sleep(0.6)\nprint(start, time.time())"
    results = sandbox.run_many([Job(program, ["assert 1"])] * 5)
    spans = [tuple(map(float, r.output.split())) for r in results]
    assert all(r.all_passed for r in results)
    overlap = max(sum(s <= t < e for s, e in spans) for t, _ in spans)
    assert overlap == 2  # never more than `workers` at once, and they do run side by side


def test_bad_settings_raise_clear_errors():
    with pytest.raises(SandboxError, match="memory_mb=-1"):
        SandboxLimits(memory_mb=-1)
    with pytest.raises(SandboxError, match="memory_mb=16 is too small"):
        SandboxLimits(memory_mb=16)
    with pytest.raises(SandboxError, match="isolation='vm'"):
        Sandbox(isolation="vm")
    with pytest.raises(SandboxError, match="workers=0"):
        Sandbox(workers=0)
    if IS_ROOT:
        with pytest.raises(SandboxError, match="plain"):
            Sandbox(isolation="plain")


# ---------------------------------------------------------------------- the non-root paths

_NONROOT_SCRIPT = """
import json, os, sys, time
from adapters.sandbox import Job, Sandbox, SandboxLimits
programs = json.loads(sys.argv[1])
limits = SandboxLimits(timeout_s=3.0, test_timeout_s=2.0, cpu_s=3, memory_mb=256, processes=8)
out = {"uid": os.getuid()}
for isolation, guard in (("auto", False), ("plain", True)):
    sb = Sandbox(limits, workers=2, isolation=isolation, guard=guard)
    # plain mode shares the trainer's filesystem view: writes to world-writable dirs are not contained
    chosen = {n: p for n, p in programs.items() if sb.isolation != "plain" or n != "write_outside"}
    rs = sb.run_many([Job(p, ["assert solve() == 42"]) for p in chosen.values()])
    out[isolation] = {"mode": sb.isolation,
                      "results": {n: [r.statuses, r.wall_s] for n, r in zip(chosen, rs)}}
    sb.close()
out["alive"] = True
print(json.dumps(out))
"""


@pytest.mark.skipif(not IS_ROOT or shutil.which("setpriv") is None, reason="needs root to become another user")
def test_non_root_paths_contain_hostile_programs():
    """The same sandbox started by an unprivileged trainer (uid 65534): user-namespace isolation,
    and the 'plain' fallback (rlimits + guard) where namespaces are unavailable."""
    python = next(p for p in ("/usr/bin/python3", sys.executable) if os.access(p, os.X_OK))
    chosen = ("infinite_loop", "fork_bomb", "write_outside", "kill_parent", "memory_bomb")
    programs = {k: v for k, v in hostile_programs(9).items() if k in chosen}
    proc = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c", _NONROOT_SCRIPT,
         json.dumps(programs)],
        cwd="/tmp", env={"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["uid"] == 65534 and out["alive"]
    assert out["plain"]["mode"] == "plain"
    assert out["auto"]["mode"] in ("userns", "plain")
    for isolation in ("auto", "plain"):
        for name, (statuses, wall) in out[isolation]["results"].items():
            assert statuses[0] != "pass", (isolation, name, statuses)
            assert wall < 3.0 + 2.0, (isolation, name, wall)
    for path in ESCAPE_PATHS:
        assert not os.path.exists(path), path
    survivors = subprocess.run(["pgrep", "-u", "65534"], capture_output=True, text=True).stdout.split()
    assert not survivors, f"processes of the unprivileged trainer's sandbox survived: {survivors}"


FORK_COUNTER = """
import os, time
n = 0
for _ in range(40):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(3)
        os._exit(0)
    n += 1
print(n)
"""


@pytest.mark.skipif(not IS_ROOT, reason="exact count holds for the per-slot uid of root mode")
def test_process_limit_binds_even_though_trainer_is_root():
    sb = Sandbox(SandboxLimits(timeout_s=4.0, test_timeout_s=3.0, processes=5), workers=1, guard=False)
    result = sb.run(FORK_COUNTER, ["assert 1"])
    assert int(result.output) == 5 - 1  # the harness itself is the 5th process of the slot uid
    assert result.wall_s < 2.0  # the sleeping children die with the namespace, not at the deadline
    sb.close()


def test_disk_writes_are_capped_per_file_and_in_total():
    sb = Sandbox(SandboxLimits(file_size_mb=2, tmpfs_mb=8), workers=1, guard=False)
    fill = ("i = 0\ntry:\n    while True:\n        with open('f%d' % i, 'wb') as f:\n"
            "            f.write(b'x' * (1 << 20))\n        i += 1\nexcept OSError as e:\n    print(i, e.errno)\n")
    result = sb.run(fill, ["assert 1"])
    if result.isolation != "plain":
        count, errno_ = map(int, result.output.split())
        assert count < 8 and errno_ == 28  # ENOSPC: the private tmpfs is full
    big = sb.run("open('big', 'wb').write(b'x' * (3 << 20))", ["assert 1"])
    assert big.statuses == ["crash"] and "File too large" in big.details[0]  # RLIMIT_FSIZE
    sb.close()
