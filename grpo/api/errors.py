"""The Tinker SDK's error classes, so that a program's ``except tinker.NotFoundError`` (or the
cookbook's ``except (tinker.TinkerError, ValueError)``) means the same in-process.

The hierarchy is the SDK's (tests/test_sdk_parity.py checks the names). grpo's in-process calls
keep raising Python's own errors for a user's mistakes; where the SDK would answer with an HTTP
status (the RestClient's lookups), grpo raises the SDK's class, which is also the Python error it
raised before: NotFoundError is a FileNotFoundError, BadRequestError a ValueError. Constructors take
the message first; the SDK's request/response/body arguments are accepted for programs that build
these themselves (tests, retries), and kept as attributes.
"""

from __future__ import annotations

from typing import Any


class TinkerError(Exception):
    pass


class APIError(TinkerError):
    def __init__(self, message: str = "", request: Any = None, *, body: object | None = None) -> None:
        super().__init__(message)
        self.message, self.request, self.body = message, request, body


class APIConnectionError(APIError):
    def __init__(self, request: Any = None, message: str = "Connection error.") -> None:
        super().__init__(message, request, body=None)


class APITimeoutError(APIConnectionError):
    def __init__(self, request: Any = None) -> None:
        super().__init__(request, "Request timed out.")


class APIResponseValidationError(APIError):
    def __init__(self, response: Any = None, body: object | None = None, message: str | None = None) -> None:
        super().__init__(message or "Data returned by API invalid for expected schema.", None, body=body)
        self.response = response


class APIStatusError(APIError):
    status_code = 0

    def __init__(self, message: str = "", response: Any = None, body: object | None = None) -> None:
        super().__init__(message, None, body=body)
        self.response = response


class BadRequestError(APIStatusError, ValueError):
    status_code = 400


class AuthenticationError(APIStatusError):
    status_code = 401


class BillingError(APIStatusError):
    status_code = 402


class PermissionDeniedError(APIStatusError):
    status_code = 403


class NotFoundError(APIStatusError, FileNotFoundError):
    status_code = 404


class ConflictError(APIStatusError):
    status_code = 409


class UnprocessableEntityError(APIStatusError, ValueError):
    status_code = 422


class RateLimitError(APIStatusError):
    status_code = 429


class InternalServerError(APIStatusError):
    status_code = 500


class RequestFailedError(TinkerError):
    def __init__(self, message: str = "", request_id: str = "", category: Any = "unknown") -> None:
        super().__init__(message)
        self.message, self.request_id, self.category = message, request_id, category


ERRORS = (TinkerError, APIError, APIConnectionError, APITimeoutError, APIResponseValidationError, APIStatusError,
          BadRequestError, AuthenticationError, BillingError, PermissionDeniedError, NotFoundError, ConflictError,
          UnprocessableEntityError, RateLimitError, InternalServerError, RequestFailedError)


def as_sdk_error(err: BaseException) -> BaseException:
    """A lookup's FileNotFoundError / ValueError as the SDK's NotFoundError / BadRequestError (which
    are those too), so ``except tinker.TinkerError`` catches what the service would have answered."""
    if isinstance(err, TinkerError):
        return err
    if isinstance(err, FileNotFoundError):
        return NotFoundError(str(err))
    if isinstance(err, ValueError):
        return BadRequestError(str(err))
    return err
