"""Run untrusted, model-written Python against tests, contained. Stdlib only.

Each run is a separate process tree:

    unshare --net --mount --pid --fork --kill-child --mount-proc   (a fresh namespace for each run)
      sh: remount every inherited mount read-only, mount small private tmpfs on /tmp, /var/tmp,
          /dev/shm, /run/lock, make /tmp/work (the run's directory) and, as root, hand it to the
          run's uid
        setpriv --reuid=UID ...   (root only: drop to an unprivileged uid, no capabilities)
          python -I -S harness.py  (lowers rlimits, optional audit-hook guard, runs program + tests)

and the parent enforces a wall-clock deadline and an output cap, then kills the whole tree (its
process group, the pid namespace through --kill-child and, as root, every process of the run's
uid). ``docs/sandbox.md`` lists each threat and what contains it.

Isolation modes (``Sandbox(isolation=...)``), picked automatically by ``auto``:
  root    running as root: the namespaces above plus a per-slot unprivileged uid, so RLIMIT_NPROC,
          signal permissions and file permissions bind the program.
  userns  not root, unprivileged user namespaces allowed: the same namespaces inside a user
          namespace (the program keeps our uid, but sees a read-only filesystem, no network and
          no process outside its own pid namespace).
  plain   neither: a new session in a temp directory with rlimits and the audit-hook guard only.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATUSES = ("pass", "fail", "timeout", "crash")
ISOLATIONS = ("auto", "root", "userns", "plain")
HARNESS = Path(__file__).with_name("sandbox_harness.py")
# Where the program may write inside its namespace; each is a fresh, size-capped tmpfs.
PRIVATE_TMPFS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"

# Runs as root (or as namespace root) inside the new mount namespace, with cwd = the host-side job
# directory. Relative paths keep working after /tmp is overmounted because cwd still points there.
_SETUP_SCRIPT = r"""
set -eu
uid="$1"; tmpfs_mb="$2"; shift 2
# kernel filesystems (/proc, /sys, cgroups, ptys) are root-only for writing and skipped for speed
awk '$3 !~ /^(proc|sysfs|cgroup2?|devpts|mqueue)$/ && $2 !~ /^\/(proc|sys)\// {print $2}' \
  /proc/self/mounts | sort -u | while read -r m; do
  mount -o remount,bind,ro "$m" 2>/dev/null || true
done
for d in @TMPFS@; do
  if [ -d "$d" ]; then mount -t tmpfs -o "size=${tmpfs_mb}m,mode=1777,nosuid,nodev" tmpfs "$d"; fi
done
mkdir /tmp/work
cp ./harness.py ./job.json /tmp/work/
if [ -n "$uid" ]; then chown -R "$uid:$uid" /tmp/work; fi
chmod 700 /tmp/work
cd /tmp/work
unset PWD OLDPWD
if [ -n "$uid" ]; then
  setpriv --reuid="$uid" --regid="$uid" --clear-groups --no-new-privs --inh-caps=-all \
    --bounding-set=-all -- "$@"
else
  "$@"
fi
""".replace("@TMPFS@", " ".join(PRIVATE_TMPFS))

_NAMESPACES = ["--net", "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child",
               "--mount-proc"]


class SandboxError(ValueError):
    """A sandbox that cannot be built as asked (bad limits, unavailable isolation)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits. ``timeout_s`` is wall clock for the whole run; ``test_timeout_s`` bounds
    each test (and loading the program) inside it, so one looping test costs only that test."""

    timeout_s: float = 10.0
    test_timeout_s: float = 3.0
    cpu_s: int = 10
    memory_mb: int = 512
    processes: int = 8
    file_size_mb: int = 4
    open_files: int = 64
    output_bytes: int = 64 * 1024
    tmpfs_mb: int = 16

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise SandboxError(f"sandbox limit {name}={value!r} must be a positive number")
        if self.memory_mb < 64:
            raise SandboxError(f"sandbox limit memory_mb={self.memory_mb} is too small for a Python "
                               "interpreter; use at least 64")

    def for_harness(self) -> dict[str, int]:
        return {"cpu_s": int(self.cpu_s), "memory_bytes": int(self.memory_mb) << 20,
                "file_size_bytes": int(self.file_size_mb) << 20, "open_files": int(self.open_files),
                "processes": int(self.processes)}


@dataclass
class RunResult:
    """Outcome of one program: a status per test, the program's (capped) output, and why the
    run ended when the sandbox ended it (``"timeout"`` or ``"output_limit"``)."""

    statuses: list[str]
    details: list[str]
    output: str = ""
    exit_code: int | None = None
    killed: str | None = None
    wall_s: float = 0.0
    isolation: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def passed(self) -> int:
        return sum(s == "pass" for s in self.statuses)

    @property
    def fraction(self) -> float:
        return self.passed / len(self.statuses) if self.statuses else 0.0

    @property
    def all_passed(self) -> bool:
        return bool(self.statuses) and self.passed == len(self.statuses)


@dataclass(frozen=True)
class Job:
    program: str
    tests: Sequence[str]
    setup: str = ""


class Sandbox:
    """A bounded pool of sandboxed runs. ``run`` is thread-safe and blocks while all ``workers``
    slots are busy; ``run_many`` runs a batch on the pool and keeps the order.

    ``guard`` adds an in-interpreter audit hook refusing sockets, subprocesses, signals and ctypes
    (defence in depth; every limit in docs/sandbox.md holds without it).
    """

    def __init__(self, limits: SandboxLimits | None = None, *, workers: int = 2, isolation: str = "auto",
                 guard: bool = True, python: str | None = None, uid_base: int = 64000):
        if isolation not in ISOLATIONS:
            raise SandboxError(f"sandbox isolation={isolation!r} is not one of {ISOLATIONS}")
        if not isinstance(workers, int) or workers < 1:
            raise SandboxError(f"sandbox workers={workers!r} must be a positive integer")
        self.limits = limits or SandboxLimits()
        self.workers = workers
        self.guard = bool(guard)
        self.is_root = os.geteuid() == 0
        self.isolation = _resolve_isolation(isolation, self.is_root)
        self.python = python or _pick_interpreter(self.isolation == "root")
        self.uid_base = uid_base
        self._slots = _UidSlots(uid_base, workers) if self.isolation == "root" else None
        self._free = threading.BoundedSemaphore(workers)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox")

    def run(self, program: str, tests: Sequence[str], setup: str = "") -> RunResult:
        """Run ``program`` then ``setup`` then each test snippet in one namespace; a test passes
        when it runs without raising."""
        with self._free, self._uid() as uid:
            return self._run_once(Job(program, list(tests), setup), uid)

    def run_many(self, jobs: Sequence[Job]) -> list[RunResult]:
        return list(self._pool.map(lambda j: self.run(j.program, j.tests, j.setup), jobs))

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # ------------------------------------------------------------------ one run

    @contextlib.contextmanager
    def _uid(self) -> Iterator[int | None]:
        if self._slots is None:
            yield None
            return
        with self._slots.acquire() as uid:
            yield uid

    def _run_once(self, job: Job, uid: int | None) -> RunResult:
        limits = self.limits
        nonce = secrets.token_hex(16)
        result_r, result_w = os.pipe()
        out_r, out_w = os.pipe()
        jobdir = Path(tempfile.mkdtemp(prefix="grpo-sandbox-"))
        start = time.monotonic()
        proc = None
        try:
            shutil.copyfile(HARNESS, jobdir / "harness.py")
            (jobdir / "job.json").write_text(json.dumps({
                "program": job.program, "tests": list(job.tests), "setup": job.setup, "nonce": nonce,
                "result_fd": result_w, "limits": limits.for_harness(), "guard": self.guard,
                "test_timeout_s": float(limits.test_timeout_s)}))
            if self.isolation == "plain":
                os.chmod(jobdir, 0o700)
            proc = subprocess.Popen(
                self._command(uid), cwd=jobdir, env=_scrubbed_env(), stdin=subprocess.DEVNULL,
                stdout=out_w, stderr=out_w, pass_fds=(result_w,), start_new_session=True)
            os.close(out_w)
            os.close(result_w)
            out_w = result_w = -1
            output, results, killed = _collect(proc, out_r, result_r, start + limits.timeout_s,
                                               limits.output_bytes)
        finally:
            for fd in (result_w, out_w):
                if fd >= 0:
                    os.close(fd)
            if proc is not None:
                _kill_tree(proc, uid)
            os.close(out_r)
            os.close(result_r)
            shutil.rmtree(jobdir, ignore_errors=True)
        return _interpret(job, nonce, output, results, killed, proc.returncode if proc else None,
                          time.monotonic() - start, self.isolation)

    def _command(self, uid: int | None) -> list[str]:
        python = [self.python, "-I", "-S", "harness.py"]
        if self.isolation == "plain":
            return python
        script = ["/bin/sh", "-c", _SETUP_SCRIPT, "sandbox", "" if uid is None else str(uid),
                  str(int(self.limits.tmpfs_mb))]
        userns = ["--user", "--map-root-user"] if self.isolation == "userns" else []
        return ["unshare", *userns, *_NAMESPACES, "--", *script, *python]


# ---------------------------------------------------------------------- reading and killing


def _collect(proc: subprocess.Popen, out_fd: int, result_fd: int, deadline: float,
             output_cap: int) -> tuple[bytes, bytes, str | None]:
    """Read output and results until both pipes close, the deadline passes or output passes the
    cap. Never buffers more than the cap (+ one read) of output, nor 1 MB of results."""
    output, results = bytearray(), bytearray()
    result_cap = 1 << 20
    sel = selectors.DefaultSelector()
    sel.register(out_fd, selectors.EVENT_READ, "out")
    sel.register(result_fd, selectors.EVENT_READ, "res")
    open_fds = 2
    try:
        while open_fds:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return bytes(output), bytes(results), "timeout"
            for key, _ in sel.select(timeout=min(remaining, 0.5)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fd)
                    open_fds -= 1
                    continue
                if key.data == "out":
                    output += chunk
                    if len(output) > output_cap:
                        return bytes(output[:output_cap]), bytes(results), "output_limit"
                else:
                    results += chunk
                    if len(results) > result_cap:
                        return bytes(output), bytes(results[:result_cap]), "output_limit"
        # Pipes closed: the harness is done or dead; give it the rest of the deadline to exit.
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return bytes(output), bytes(results), "timeout"
        return bytes(output), bytes(results), None
    finally:
        sel.close()


def _kill_tree(proc: subprocess.Popen, uid: int | None) -> None:
    """Kill everything the run started. The process group first; the pid namespace dies with its
    init (``--kill-child``); as root, also every process of the run's uid, which catches a child
    that left the group with setsid."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    proc.wait()
    if uid is not None and processes_of_uid(uid):
        kill_uid(uid)


def kill_uid(uid: int) -> None:
    """SIGKILL every process owned by ``uid``: ``kill -9 -1`` run *as* that uid signals exactly
    the processes it may signal, i.e. its own, in every pid namespace below ours."""
    for _ in range(3):  # a forking process may add one between rounds; it cannot outrun three
        subprocess.run(["kill", "-9", "-1"], user=uid, group=uid, extra_groups=[],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_scrubbed_env(),
                       check=False)
        if not processes_of_uid(uid):
            return


def processes_of_uid(uid: int) -> list[int]:
    """Pids whose real uid is ``uid`` (read from /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid:
                            pids.append(int(entry))
                        break
        except OSError:
            continue
    return pids


def _interpret(job: Job, nonce: str, output: bytes, results: bytes, killed: str | None,
               exit_code: int | None, wall_s: float, isolation: str) -> RunResult:
    """Per-test statuses from the results channel. Only lines carrying this run's nonce count; a
    test with no line timed out when the sandbox hit the deadline and crashed otherwise."""
    n = len(job.tests)
    statuses: list[str | None] = [None] * n
    details = [""] * n
    for line in results.decode("utf-8", "replace").splitlines():
        try:
            row = json.loads(line)
            index, status = int(row["test"]), str(row["status"])
        except (ValueError, KeyError, TypeError):
            continue
        if row.get("nonce") == nonce and 0 <= index < n and status in STATUSES and statuses[index] is None:
            statuses[index], details[index] = status, str(row.get("detail", ""))
    missing = "timeout" if killed == "timeout" else "crash"
    reason = {"timeout": "killed at the wall-clock deadline", "output_limit": "output limit exceeded"}.get(
        killed or "", f"no result (exit code {exit_code})")
    for i in range(n):
        if statuses[i] is None:
            statuses[i], details[i] = missing, reason
    return RunResult(statuses=[s for s in statuses if s is not None], details=details,
                     output=output.decode("utf-8", "replace"), exit_code=exit_code, killed=killed,
                     wall_s=wall_s, isolation=isolation)


# ---------------------------------------------------------------------- setup helpers


def _scrubbed_env() -> dict[str, str]:
    """Nothing from the trainer's environment (API keys, tokens) reaches the program."""
    return {"PATH": SAFE_PATH, "LANG": "C.UTF-8", "HOME": "/tmp/work", "PYTHONDONTWRITEBYTECODE": "1"}


_probe_cache: dict[str, bool] = {}


def _namespaces_work(userns: bool) -> bool:
    key = "userns" if userns else "root"
    if key not in _probe_cache:
        cmd = ["unshare", *(["--user", "--map-root-user"] if userns else []), *_NAMESPACES, "--",
               "/bin/sh", "-c", "mount -t tmpfs tmpfs /tmp"]
        try:
            ok = shutil.which("unshare") is not None and shutil.which("setpriv" if not userns else "sh") is not None \
                and subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   env=_scrubbed_env(), timeout=10).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        _probe_cache[key] = ok
    return _probe_cache[key]


def _resolve_isolation(requested: str, is_root: bool) -> str:
    if requested == "plain" and is_root:
        raise SandboxError("sandbox isolation='plain' as root would leave the program unlimited "
                           "(RLIMIT_NPROC does not bind root and it could kill any process); "
                           "use isolation='root' or 'auto'")
    if requested == "root" and not is_root:
        raise SandboxError("sandbox isolation='root' needs to run as root; use 'auto', 'userns' or 'plain'")
    if requested == "auto":
        requested = "root" if is_root else ("userns" if _namespaces_work(userns=True) else "plain")
    if requested in ("root", "userns") and not _namespaces_work(userns=requested == "userns"):
        raise SandboxError(f"sandbox isolation={requested!r} is unavailable here: `unshare` with "
                           "network/mount/pid namespaces failed (util-linux missing or namespaces "
                           "forbidden)" + ("" if is_root else "; use isolation='plain'"))
    return requested


def _world_reachable(path: str) -> bool:
    """Whether a process of another uid can execute ``path`` (every parent searchable)."""
    p = Path(path)
    try:
        if not p.stat().st_mode & stat.S_IXOTH:
            return False
        return all(parent.stat().st_mode & stat.S_IXOTH for parent in p.parents)
    except OSError:
        return False


def _pick_interpreter(other_uid: bool) -> str:
    """Our own interpreter, unless the sandbox uid could not reach it (pyenv under /root), in
    which case the system python3. The harness needs only the stdlib of any Python >= 3.8."""
    own = os.path.realpath(sys.executable)
    if not other_uid or _world_reachable(own):
        return own
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3") or ""):
        if candidate and _world_reachable(os.path.realpath(candidate)):
            return os.path.realpath(candidate)
    raise SandboxError(f"no Python interpreter reachable by an unprivileged uid (ours is {own}); "
                       "pass Sandbox(python=...) with a world-executable interpreter")


class _UidSlots:
    """Unprivileged uids, one per concurrent run, locked across processes with flock so two
    trainers on one machine never share a uid (``kill_uid`` would hit the other's runs)."""

    def __init__(self, base: int, count: int):
        self.base, self.count = base, count
        self.lock_dir = Path(tempfile.gettempdir()) / "grpo-sandbox-uids"
        self.lock_dir.mkdir(mode=0o700, exist_ok=True)
        self._lock = threading.Lock()
        self._held: set[int] = set()

    @contextlib.contextmanager
    def acquire(self) -> Iterator[int]:
        fd, uid = self._take()
        try:
            yield uid
        finally:
            with self._lock:
                self._held.discard(uid)
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    @contextlib.contextmanager
    def holding(self, uid: int) -> Iterator[None]:
        """``uid``'s lock, waited for: meanwhile no sandbox on this machine runs as it."""
        fd = self._lock_file(uid, wait=True)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _lock_file(self, uid: int, wait: bool) -> int | None:
        """An open descriptor of ``uid``'s lock file, locked; None if not waiting and it is taken."""
        fd = os.open(self.lock_dir / str(uid), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    def _take(self) -> tuple[int, int]:
        while True:
            for uid in range(self.base, self.base + 64 * max(self.count, 1)):
                with self._lock:
                    if uid in self._held:
                        continue
                    fd = self._lock_file(uid, wait=False)
                    if fd is None:
                        continue
                    self._held.add(uid)
                    # A previous holder that died mid-run may have left processes behind.
                    if processes_of_uid(uid):
                        kill_uid(uid)
                    return fd, uid
            time.sleep(0.05)
