"""The REST API: triggers, refit records, topology, health and metrics over the core.

Errors come back as `{"error": {"reason", "message", "field"}}` with the status from
`refitplane.coordinator.error_codes`, mapped in the handlers below and nowhere else.
Mutating calls (POST) need `Authorization: Bearer <token>` when a token is configured.
"""

# No `from __future__ import annotations` here: FastAPI resolves the endpoint signatures at
# runtime, and the dependencies below close over local objects.
import logging
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Path, Query, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from refitplane.coordinator.auth import TokenCheck
from refitplane.coordinator.core.service import MAX_LIST_LIMIT, Coordinator
from refitplane.coordinator.error_codes import http_status
from refitplane.coordinator.rest.limits import retry_after
from refitplane.coordinator.store.base import MAX_VERSION
from refitplane.errors import InvalidArgument, RefitError
from refitplane.protocol import Reason
from refitplane.protocol.models import Refit, Topology
from refitplane.version import __version__

log = logging.getLogger(__name__)

_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
JobPath = Annotated[
    str, Path(description="Job name", pattern=_NAME_PATTERN, min_length=1, max_length=128)
]
RefitIdPath = Annotated[str, Path(description="Refit id", min_length=1, max_length=128)]


class ErrorDetail(BaseModel):
    reason: str = Field(description="Machine-readable reason, e.g. NOT_FOUND, INVALID_LAYOUT")
    message: str
    field: str | None = Field(None, description="The request field at fault, if any")


class ErrorBody(BaseModel):
    error: ErrorDetail


class TriggerBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target_replicas: list[
        Annotated[str, Field(pattern=_NAME_PATTERN, min_length=1, max_length=128)]
    ] = Field(default_factory=list, max_length=4096, description="Empty: every replica")
    idempotency_key: str = Field(
        "", max_length=256, pattern=r"^[^\x00-\x1f]*$", description="Same key → same refit"
    )
    # Strict: JSON `true`, `"12"` and `13.0` are not versions (lax pydantic took them as 1,
    # 12 and 13).
    version: StrictInt = Field(0, ge=0, le=MAX_VERSION, description="0: the next version")


class RefitList(BaseModel):
    refits: list[Refit]


class Status(BaseModel):
    status: str


def _error(
    status: int,
    reason: str,
    message: str,
    field: str | None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = ErrorBody(error=ErrorDetail(reason=reason, message=message, field=field))
    if status == 401:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": text}
    for code, text in (
        (400, "Invalid argument (the field is named)"),
        (404, "Not found"),
        (409, "Conflict or failed precondition"),
        (429, "Busy: admission queue full (Retry-After says when to retry)"),
        (503, "State store unavailable"),
    )
}
_MUTATING_ERRORS: dict[int | str, dict[str, Any]] = {
    **_ERRORS,
    401: {"model": ErrorBody, "description": "Missing or invalid bearer token"},
    413: {"model": ErrorBody, "description": "Body larger than REFIT_HTTP_MAX_BODY_BYTES"},
    429: {"model": ErrorBody, "description": "Trigger rate limit or admission queue full"},
}


def create_app(core: Coordinator, tokens: TokenCheck) -> FastAPI:
    app = FastAPI(
        title="refit coordinator",
        version=__version__,
        description="Weight-refit control plane: trigger refits, watch them, read topology. "
        "Control metadata only: tensor bytes never pass through this service.",
    )
    bearer = HTTPBearer(auto_error=False, description="REFIT_AUTH_TOKEN")

    async def authorized(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)],
    ) -> None:
        tokens.check(f"Bearer {credentials.credentials}" if credentials else None)

    @app.exception_handler(RefitError)
    async def refit_error(_: Request, exc: RefitError) -> JSONResponse:
        return _error(int(http_status(exc)), exc.reason, exc.message, exc.field, retry_after(exc))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "path", "query")]
        field = ".".join(loc) or None
        message = str(first.get("msg", "invalid request"))
        return _error(
            400, InvalidArgument.reason, f"{field}: {message}" if field else message, field
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        reasons = {404: Reason.NOT_FOUND, 405: Reason.METHOD_NOT_ALLOWED}
        response = _error(
            exc.status_code, reasons.get(exc.status_code, "HTTP_ERROR"), str(exc.detail), None
        )
        if exc.status_code == 405:
            # Starlette lists only the first matching route's methods; a path served by
            # several routes (GET and POST /v1/jobs/{job}/refits) allows all of them.
            allowed = set()
            for route in app.router.routes:
                if isinstance(route, APIRoute) and route.matches(request.scope)[0] is Match.PARTIAL:
                    allowed |= route.methods
            response.headers["Allow"] = ", ".join(sorted(allowed))
        return response

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return _error(500, "INTERNAL", "internal error (details in the coordinator log)", None)

    @app.post(
        "/v1/jobs/{job}/refits",
        response_model=Refit,
        status_code=202,
        responses=_MUTATING_ERRORS,
        dependencies=[Depends(authorized)],
        summary="Trigger a refit",
        tags=["refits"],
    )
    async def trigger(job: JobPath, body: TriggerBody | None = None) -> Refit:
        body = body or TriggerBody.model_validate({})
        return await core.trigger(
            job,
            target_replicas=body.target_replicas,
            idempotency_key=body.idempotency_key,
            version=body.version,
        )

    @app.get(
        "/v1/refits/{refit_id}",
        response_model=Refit,
        responses=_ERRORS,
        summary="Get a refit",
        tags=["refits"],
    )
    async def get_refit(refit_id: RefitIdPath) -> Refit:
        return await core.get_refit(refit_id)

    @app.get(
        "/v1/jobs/{job}/refits",
        response_model=RefitList,
        responses=_ERRORS,
        summary="List a job's refits, newest first",
        tags=["refits"],
    )
    async def list_refits(
        job: JobPath, limit: Annotated[int, Query(ge=1, le=MAX_LIST_LIMIT)] = 50
    ) -> RefitList:
        return RefitList(refits=await core.list_refits(job, limit))

    @app.post(
        "/v1/refits/{refit_id}/cancel",
        response_model=Refit,
        responses=_MUTATING_ERRORS,
        dependencies=[Depends(authorized)],
        summary="Cancel a refit (until it is committed)",
        tags=["refits"],
    )
    async def cancel(refit_id: RefitIdPath) -> Refit:
        return await core.cancel(refit_id)

    @app.get(
        "/v1/jobs/{job}/topology",
        response_model=Topology,
        responses=_ERRORS,
        summary="A job's members, replicas, versions and group",
        tags=["jobs"],
    )
    async def topology(job: JobPath) -> Topology:
        return await core.topology(job)

    @app.get("/healthz", response_model=Status, tags=["operations"], summary="Liveness")
    async def healthz() -> Status:
        return Status(status="ok")

    @app.get(
        "/readyz",
        response_model=Status,
        responses={503: {"model": ErrorBody, "description": "State store unreachable"}},
        tags=["operations"],
        summary="Readiness: the state store is reachable",
    )
    async def readyz() -> Status:
        await core.ready()
        return Status(status="ready")

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            generate_latest(core.metrics.registry), media_type=CONTENT_TYPE_LATEST
        )

    return app
