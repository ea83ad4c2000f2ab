"""Failing fast when the service cannot be reached, and retrying what is only transient.

At start-up one plain HTTP request tells a refused connection or a silent endpoint apart
within seconds, instead of the SDK's own retry loop (minutes) hiding the cause. During a run,
errors that say "try again" (connection dropped, timeout, 429, 5xx) are retried with
exponential backoff by resubmitting the same request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from grpo.types import APIFuture

T = TypeVar("T")


class RemoteConnectionError(ConnectionError):
    """The service endpoint refused or dropped the connection."""


class RemoteTimeoutError(TimeoutError):
    """The service endpoint did not answer in time."""


class RemoteStepError(RuntimeError):
    """A training step failed part-way and cannot be replayed safely."""


class RemoteRequestError(ValueError):
    """The service refused a request (a 4xx, or an error result) for a reason retrying cannot fix."""


# Words in a service's refusal -> the grpo config key that sets that value.
CONFIG_KEYS = (("lora_rank", "rank"), ("rank", "rank"), ("base_model", "base_model"),
               ("learning_rate", "learning_rate"), ("max_tokens", "max_tokens"), ("num_samples", "group_size"),
               ("loss_fn", "loss_fn"), ("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
               ("ttl_seconds", "backend.checkpoint_ttl_seconds"))


def refusal_reason(err: BaseException) -> str:
    """The service's own words: FastAPI-style ``detail`` (field path + message), else the body's
    ``error``/``message``/``detail`` text, else the exception's message."""
    body = getattr(err, "body", None)
    if isinstance(body, dict):
        detail = body.get("detail", body.get("error", body.get("message")))
        if isinstance(detail, list):
            parts = []
            for item in detail:
                if isinstance(item, dict):
                    loc = [str(x) for x in item.get("loc", []) if x != "body"]
                    parts.append(f"{'.'.join(loc)}: {item.get('msg', '')}" if loc else str(item.get("msg", "")))
            if parts:
                return "; ".join(parts)
        if detail:
            return str(detail)
    return str(err)


def config_key_for(reason: str) -> str | None:
    import re

    for word, key in CONFIG_KEYS:
        if re.search(rf"(?<![a-z_]){word}(?![a-z_])", reason, flags=re.IGNORECASE):
            return key
    return None


def _refusal_in(err: BaseException) -> BaseException | None:
    """``err`` if it is a 4xx refusal (or the SDK's RequestFailedError), else the refusal it was
    raised from: SDK 0.25 raises a plain ValueError("Error retrieving result ...") from the
    BadRequestError a future's 400 came as (SkyRL's "LoRA rank 16 must be between 1 and 8")."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        status = getattr(err, "status_code", None)
        if isinstance(status, int) and 400 <= status < 500 and status not in (408, 429):
            return err
        if type(err).__name__ == "RequestFailedError":
            return err
        err = err.__cause__
    return None


def as_request_error(err: BaseException, what: str, endpoint: str) -> BaseException:
    """A 4xx refusal (or the SDK's RequestFailedError), itself or the error it caused, as one
    RemoteRequestError line naming the reason and, where one fits, the config key to change; an
    SDK assertion that the server does not fit it (compat.mid_run_misfit) as one line naming the SDK
    that does; anything else unchanged."""
    refusal = _refusal_in(err)
    if refusal is None:
        from grpo.backends.remote.compat import mid_run_misfit

        misfit = mid_run_misfit(err, endpoint)
        return err if misfit is None else RemoteRequestError(f"{what}: {misfit}")
    status = getattr(refusal, "status_code", None)
    reason = refusal_reason(refusal)
    key = config_key_for(reason)
    code = f" ({status})" if isinstance(status, int) else ""
    return RemoteRequestError(f"{endpoint} refused {what}{code}: {reason}"
                              + (f"; check the config key `{key}`" if key else ""))


def check_reachable(base_url: str, url_var: str, timeout_s: float) -> None:
    """One HTTP request to ``base_url``: any HTTP answer (even 404) proves it is reachable."""
    import httpx

    hint = f"check {url_var} (or backend.base_url) and that the service is up and reachable"
    try:
        with httpx.Client(timeout=httpx.Timeout(timeout_s)) as client:
            client.get(base_url + "/api/v1/healthz")
    except httpx.TimeoutException as err:
        raise RemoteTimeoutError(
            f"the service at {base_url} did not answer within {timeout_s:g} s ({type(err).__name__}); {hint}"
        ) from err
    except (httpx.TransportError, OSError) as err:
        raise RemoteConnectionError(f"cannot connect to the service at {base_url}: {err or type(err).__name__}; {hint}") from err


def is_transient(err: BaseException) -> bool:
    """Errors worth retrying: the request may succeed if sent again."""
    if isinstance(err, (RemoteTimeoutError, RemoteStepError)):
        return False  # our own verdicts, already final
    if isinstance(err, (ConnectionError, TimeoutError)):
        return True
    status = getattr(err, "status_code", None)
    if isinstance(status, int):
        return status == 408 or status == 429 or status >= 500
    # The SDK's APIConnectionError / APITimeoutError carry no status code.
    return any(c.__name__ in ("APIConnectionError", "APITimeoutError") for c in type(err).__mro__)


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 3
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    call_timeout_s: float | None = 900.0  # how long one request may take before we give up

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.backoff_s < 0 or self.backoff_max_s < 0:
            raise ValueError("backend.max_retries, backoff_s and backoff_max_s must be >= 0")
        if self.call_timeout_s is not None and self.call_timeout_s <= 0:
            raise ValueError(f"backend.call_timeout_s must be > 0 or null, got {self.call_timeout_s}")

    def delay(self, attempt: int) -> float:
        return min(self.backoff_max_s, self.backoff_s * 2 ** attempt)


def wait(sdk_future: Any, timeout_s: float | None, what: str, endpoint: str) -> Any:
    """The SDK future's value; a wait past ``timeout_s`` is final (the request may still run)."""
    import concurrent.futures

    try:
        return sdk_future.result(timeout_s)
    except concurrent.futures.TimeoutError as err:
        if sdk_future_done(sdk_future):
            raise  # the request itself timed out: the SDK's error, transient
        raise RemoteTimeoutError(
            f"{what} got no answer from {endpoint} within {timeout_s:g} s (backend.call_timeout_s)") from err


def sdk_future_done(sdk_future: Any) -> bool:
    done = getattr(sdk_future, "done", None)
    if callable(done):
        return bool(done())
    inner = getattr(sdk_future, "future", None)
    return bool(callable(inner) and inner().done())


def failed_future(err: BaseException) -> Any:
    import concurrent.futures

    fut: concurrent.futures.Future = concurrent.futures.Future()
    fut.set_exception(err)
    return fut


def submit_guarded(submit: Callable[[], Any]) -> Any:
    """Call ``submit``; an exception raised while submitting becomes a failed future, so it is
    retried or reported in the same place as one raised by the service."""
    try:
        return submit()
    except Exception as err:
        return failed_future(err)


class LazyFuture(APIFuture, Generic[T]):
    """An APIFuture whose value is worked out (waited for, retried, converted) by ``resolve``
    in the thread that first asks for it; the request itself is already in flight."""

    def __init__(self, resolve: Callable[[float | None], T], done: Callable[[], bool]):
        self._resolve = resolve
        self._is_done = done
        self._lock = threading.Lock()
        self._outcome: tuple[bool, Any] | None = None

    def result(self, timeout: float | None = None) -> T:
        with self._lock:
            if self._outcome is None:
                try:
                    self._outcome = (True, self._resolve(timeout))
                except BaseException as err:  # re-raised to every caller of result()
                    self._outcome = (False, err)
        ok, value = self._outcome
        if ok:
            return value
        raise value

    async def result_async(self, timeout: float | None = None) -> T:
        import asyncio

        return await asyncio.get_running_loop().run_in_executor(None, self.result, timeout)

    def done(self) -> bool:
        return self._outcome is not None or self._is_done()


def retrying(submit: Callable[[], Any], convert: Callable[[Any], T], policy: RetryPolicy, what: str,
             endpoint: str, log: Callable[[str], None]) -> LazyFuture[T]:
    """Submit now; on a transient failure resubmit the same request with backoff."""
    state = {"future": submit_guarded(submit)}

    def resolve(timeout: float | None) -> T:
        for attempt in range(policy.max_retries + 1):
            try:
                return convert(wait(state["future"], timeout or policy.call_timeout_s, what, endpoint))
            except Exception as err:
                if not is_transient(err) or attempt == policy.max_retries:
                    refusal = as_request_error(err, what, endpoint)
                    if refusal is not err:
                        raise refusal from err
                    raise
                delay = policy.delay(attempt)
                log(f"{what}: {type(err).__name__}: {err}; retry {attempt + 1}/{policy.max_retries} in {delay:g} s")
                time.sleep(delay)
                state["future"] = submit_guarded(submit)
        raise AssertionError("unreachable")

    return LazyFuture(resolve, lambda: sdk_future_done(state["future"]))
