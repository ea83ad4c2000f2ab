"""The trusted half of a sandbox run: executed *inside* the sandbox as ``python -I -S harness.py``.

It is never imported by the package. ``adapters.sandbox`` copies this file into each run's fresh
working directory next to ``job.json`` (so it works even when the package's own directory is
unreadable to the sandbox uid) and runs it with stdlib only: no site-packages, no environment.

Order matters: the job is read and deleted and the resource limits are lowered *before* a single
line of the untrusted program runs. Results go out on a private pipe (not stdout, which the program
owns and may close or flood), one JSON line per test, tagged with the run's nonce.
Kept compatible with any Python >= 3.8 because the interpreter may be the system one.
"""

import json
import os
import resource
import signal
import sys

# Events the in-interpreter guard refuses (defence in depth: the OS-level limits hold without it).
_BLOCKED_PREFIXES = ("socket.", "subprocess.", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                     "os.forkpty", "os.kill", "os.killpg", "os.system", "ctypes.", "pty.")
_BLOCKED_IMPORTS = {"socket", "_socket", "ctypes", "_ctypes", "subprocess", "multiprocessing", "pty"}


class _TestTimeout(BaseException):
    """Raised by the per-test alarm; a BaseException so ``except Exception`` in the program
    cannot swallow it."""


def _guard(event, args):
    if event.startswith(_BLOCKED_PREFIXES):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "import" and args and str(args[0]).split(".")[0] in _BLOCKED_IMPORTS:
        raise PermissionError(f"sandbox: import of {args[0]} is not allowed")


def _set_limits(limits):
    pairs = [
        (resource.RLIMIT_CPU, limits["cpu_s"], limits["cpu_s"] + 1),  # soft: SIGXCPU, hard: SIGKILL
        (resource.RLIMIT_AS, limits["memory_bytes"], limits["memory_bytes"]),
        (resource.RLIMIT_FSIZE, limits["file_size_bytes"], limits["file_size_bytes"]),
        (resource.RLIMIT_NOFILE, limits["open_files"], limits["open_files"]),
        (resource.RLIMIT_NPROC, limits["processes"], limits["processes"]),
        (resource.RLIMIT_CORE, 0, 0),
    ]
    for which, soft, hard in pairs:
        # Only ever lower: an unprivileged process may not raise a hard limit.
        cur_soft, cur_hard = resource.getrlimit(which)
        if cur_hard != resource.RLIM_INFINITY:
            hard = min(hard, cur_hard)
        resource.setrlimit(which, (min(soft, hard), hard))


def main():
    with open("job.json") as f:
        job = json.load(f)
    os.unlink("job.json")  # the program must not read the nonce or the tests
    results = os.fdopen(job["result_fd"], "w", buffering=1)
    nonce = job["nonce"]

    def report(index, status, detail=""):
        results.write(json.dumps({"nonce": nonce, "test": index, "status": status,
                                  "detail": detail[:500]}) + "\n")

    _set_limits(job["limits"])
    if job["guard"]:
        sys.addaudithook(_guard)

    def on_alarm(signum, frame):
        raise _TestTimeout()

    signal.signal(signal.SIGALRM, on_alarm)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    tests = job["tests"]
    try:
        signal.setitimer(signal.ITIMER_REAL, job["test_timeout_s"])
        exec(compile(job["program"], "<program>", "exec"), namespace)
        if job["setup"]:
            exec(compile(job["setup"], "<setup>", "exec"), namespace)
        signal.setitimer(signal.ITIMER_REAL, 0)
    except _TestTimeout:
        for i in range(len(tests)):
            report(i, "timeout", "program did not finish loading")
        return
    except BaseException as err:  # noqa: BLE001 - SystemExit, MemoryError, ... all mean 'crash'
        signal.setitimer(signal.ITIMER_REAL, 0)
        for i in range(len(tests)):
            report(i, "crash", f"{type(err).__name__}: {err}")
        return
    for i, test in enumerate(tests):
        try:
            signal.setitimer(signal.ITIMER_REAL, job["test_timeout_s"])
            exec(compile(test, f"<test {i}>", "exec"), namespace)
            signal.setitimer(signal.ITIMER_REAL, 0)
            report(i, "pass")
        except _TestTimeout:
            report(i, "timeout", f"test ran past {job['test_timeout_s']:.1f}s")
        except AssertionError as err:
            signal.setitimer(signal.ITIMER_REAL, 0)
            report(i, "fail", f"AssertionError: {err}")
        except BaseException as err:  # noqa: BLE001
            signal.setitimer(signal.ITIMER_REAL, 0)
            report(i, "crash", f"{type(err).__name__}: {err}")


if __name__ == "__main__":
    main()
