"""Every error leaves the HTTP ingress in OpenAI's shape with the right status (400 bad input or
malformed JSON, 401 wrong or missing key, 404 unknown model, 503 overloaded or engine dead);
unexpected errors are logged here and answered with a plain 500, never a traceback."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.cluster.openai_serving import APIError
from pagedserve.config import describe_validation_error

logger = logging.getLogger(__name__)
MAX_REPORTED_PROBLEMS = 5  # validation problems named in one 400


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)


async def _api_error(request: Request, error: APIError) -> JSONResponse:
    return error_response(error)


async def _invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
    return error_response(_validation_error(error.errors()))


async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    kind = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(error.status_code, "BadRequestError")
    return error_response(APIError(error.status_code, str(error.detail), kind))


async def _unexpected_error(request: Request, error: Exception) -> JSONResponse:
    logger.exception("unhandled error serving %s", request.url.path)
    return error_response(APIError(500, "internal server error", "InternalServerError"))


def error_response(error: APIError) -> JSONResponse:
    headers = {"Retry-After": str(error.retry_after_s)} if error.retry_after_s is not None else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _validation_error(items: list[dict[str, Any]]) -> APIError:
    """FastAPI's report on a request body, as the 400 OpenAI would send."""
    first = items[0]
    if first["type"] == "json_invalid":
        reason = first.get("ctx", {}).get("error", "JSON decode error")
        return APIError(400, f"the request body is not valid JSON: {reason} (at character {first['loc'][-1]})")
    located = [{**item, "loc": tuple(item["loc"])[1:] if item["loc"][:1] == ("body",) else item["loc"]} for item in items]
    if not located[0]["loc"] and first["type"] in ("missing", "model_attributes_type", "model_type", "dict_type"):
        return APIError(400, "the request body must be a JSON object")
    param = ".".join(str(part) for part in located[0]["loc"]) or None
    # A body can hold a million wrong items: name the first few, or the 400 outgrows the request.
    message = describe_validation_error(located[:MAX_REPORTED_PROBLEMS], "field")
    if len(located) > MAX_REPORTED_PROBLEMS:
        message += f"; and {len(located) - MAX_REPORTED_PROBLEMS} more problems"
    return APIError(400, message, param=param)
