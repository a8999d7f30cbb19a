"""Errors in OpenAI's JSON shape: `{"error": {"message", "type", "param", "code"}}` with the HTTP status that
OpenAI-compatible clients act on (400 bad request, 401 key, 404 model, 413 too large, 429/503 busy)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ApiError(Exception):
    status: int
    message: str  # one sentence naming the problem and what to do
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __str__(self) -> str:
        return self.message


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def bad_key() -> ApiError:
    return ApiError(
        401, "The API key is missing or wrong; send it as 'Authorization: Bearer KEY'.", code="invalid_api_key"
    )


def unknown_model(name: str, served: Sequence[str]) -> ApiError:
    listed = ", ".join(repr(n) for n in served[:20]) + (" and more" if len(served) > 20 else "")
    return ApiError(
        404,
        f"The model {name!r} is not here; this server serves {listed} (see GET /v1/models).",
        param="model",
        code="model_not_found",
    )


def too_large(message: str, param: str | None = None) -> ApiError:
    return ApiError(413, message, param=param, code="context_length_exceeded")


def busy(retry_after_s: int, max_queue: int) -> ApiError:
    return ApiError(
        429,
        f"The server is busy ({max_queue} requests already waiting); retry after {retry_after_s} s.",
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(retry_after_s)},
    )


CLIENT_CLOSED = 499  # nginx's "client closed request": recorded, never sent (nobody is there to read it)


def client_gone() -> ApiError:
    return ApiError(CLIENT_CLOSED, "The client closed the connection before the reply.", code="client_closed")


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, type="server_error", code="unavailable", headers={"Retry-After": "5"})


def server_error(message: str) -> ApiError:
    return ApiError(500, message, type="server_error", code="internal_error")
