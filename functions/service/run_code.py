"""SandboxFusion's HTTP API on ``rollbox serve``: ``POST /run_code`` (and ``GET /v1/ping``).

A trainer that calls SandboxFusion (verl's code reward: ``reward.sandbox_fusion.url``) points it at
``http://HOST:PORT/run_code``. The request and reply are SandboxFusion's (``RunCodeRequest``,
``RunCodeResponse`` in ``functions/handlers/run_code.py``); the program runs through the same runner
as the ``run`` event's ``language``. How each outcome is answered:

    the program ran (whatever it did)            200, status Success / Failed (SandboxFusion's rules)
    a sandbox fault (it died, setup failed)      200, status SandboxError, message says what
    body not JSON, wrong field types             422, FastAPI's {"detail": [{type, loc, msg}]} as SandboxFusion
    unknown language / no toolchain / bad file   422, {"detail": "<message naming it>"}
    the language's snapshot is not built         built on first use (--language-builds on): the request
                                                 waits 3/4 of compile_timeout + run_timeout for it, then
                                                 504 + Retry-After "building <lang>, step k/n" (verl retries
                                                 a 504); a failed build, or builds off: 503 naming the
                                                 build command
    full (admission caps, the runtime's cap)     504 with Retry-After: the one status verl retries
    draining                                     503

``GET /languages`` lists every language with its snapshot's state here (ready, building with its step,
failed with why, missing; unsupported ones with why).

Each answered program is a step of the trajectories (event type ``dev.rollbox.sandbox.run``, source
``/run_code``) and its sandbox life a row of the usage ledger, under the experiment named by the
``X-Rollbox-Experiment`` header (else the default one) and the episode of ``X-Rollbox-Episode``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from rollbox.functions.contract.events import ReplyError
from rollbox.functions.contract.models import SANDBOX_RUN, ErrorCode, ErrorData, RunData
from rollbox.functions.handlers.run_code import (
    RunCodeRequest,
    RunCodeResponse,
    RunStatus,
    runner_for,
    sandboxfusion_response,
)
from rollbox.functions.service.admission import Rejected
from rollbox.functions.service.logs import logger
from rollbox.runtime import errors as rterr
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

if TYPE_CHECKING:
    from rollbox.functions.service.app import Service

__all__ = ["EXPERIMENT_HEADER", "handle"]

EXPERIMENT_HEADER = "x-rollbox-experiment"
EPISODE_HEADER = "x-rollbox-episode"
SOURCE = "/run_code"


def _detail(status: int, detail: Any, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


def _pydantic_detail(exc: ValidationError) -> list[dict[str, Any]]:
    return [{"type": e["type"], "loc": ["body", *e["loc"]], "msg": e["msg"]}
            for e in exc.errors(include_url=False, include_input=False)[:20]]


def _labels(request: Request) -> dict[str, str]:
    meta = {}
    for header, key in ((EXPERIMENT_HEADER, "experiment"), (EPISODE_HEADER, "episode")):
        value = request.headers.get(header, "").strip()
        if value:
            meta[key] = value[:1024]
    return meta


async def handle(service: Service, request: Request) -> Response:
    t0 = time.perf_counter()
    status, resp = await _answer(service, request)
    service.metrics.requests.labels("run_code", str(status)).inc()
    service.metrics.request_seconds.labels("run_code").observe(time.perf_counter() - t0)
    return resp


async def _answer(service: Service, request: Request) -> tuple[int, Response]:
    from rollbox.functions.service.app import _ClientGone

    if request.url.path == "/v1/ping":
        return 200, JSONResponse("pong")
    if request.url.path == "/languages":
        if request.method not in ("GET", "HEAD"):
            return 405, _detail(405, "Method Not Allowed", {"allow": "GET"})
        return 200, JSONResponse(await _languages(service))
    if request.method != "POST":
        return 405, _detail(405, "Method Not Allowed", {"allow": "POST"})
    try:
        body = await service._read_body(request)
    except ReplyError as err:
        return err.status, _detail(err.status, err.message)
    except (_ClientGone, ClientDisconnect):  # nobody reads an answer
        return 499, Response(status_code=499)
    try:
        raw = json.loads(body)
    except ValueError as exc:
        return 422, _detail(422, [{"type": "json_invalid", "loc": ["body", 0], "msg": f"JSON decode error: {exc}"}])
    try:
        req = RunCodeRequest.model_validate(raw)
    except ValidationError as exc:
        return 422, _detail(422, _pydantic_detail(exc))
    if service.admission.draining:
        return 503, _detail(503, "the server is shutting down; retry elsewhere", {"retry-after": "1"})
    meta = _labels(request)
    try:
        program = req.program(meta)
    except rterr.InvalidRequest as exc:
        return 422, _detail(422, exc.message)
    runner = runner_for(service.runtime)
    steps = service.steps
    ctx = None
    if steps is not None:
        full = service._disk_full()
        if full is not None:
            return 507, _detail(507, f"the run cannot be recorded ({full}); retry later or on another replica")
        ctx = steps.begin(SANDBOX_RUN, SOURCE, uuid.uuid4().hex, None, _as_run_data(req, meta))
    resp: Response | None = None
    recorded: tuple[int, Any] | None = None  # the trajectory row: its status and payload
    try:
        try:
            async with service.admission.admit(creates_sandbox=True, ends_sandbox=False):
                result = await runner.run(program)
        except Rejected as rej:
            service.metrics.rejects.labels(rej.reason).inc()
            raise rej.error from None
        resp = _json(sandboxfusion_response(result, os.environ.get("MY_POD_NAME")))
        recorded = (200, result.last())
    except (rterr.Overloaded, rterr.ShuttingDown, rterr.StoreUnavailable) as exc:  # nothing ran: no row (the
        code = 504 if isinstance(exc, rterr.Overloaded) else 503                   # retry is the step)
        own = exc.retry_after_s if isinstance(exc, rterr.Overloaded | rterr.ShuttingDown) else None
        retry = own or service.config.retry_after_s
        resp = _detail(code, exc.message, {"retry-after": str(max(1, round(retry)))})
    except rterr.InvalidRequest as exc:  # UnsupportedLanguage too: it names the language
        resp = _detail(422, exc.message)
        recorded = (422, ErrorData(code=ErrorCode.INVALID_DATA, message=exc.message))
    except rterr.SnapshotNotFound as exc:
        resp = _detail(503, exc.message)
        recorded = (503, ErrorData(code=ErrorCode.SNAPSHOT_NOT_FOUND, message=exc.message))
    except rterr.RollboxError as exc:  # the sandbox's fault, not the program's: SandboxFusion's SandboxError
        logger.warning(f"run_code: sandbox error: {exc.message}", extra={"fields": {"language": req.language}})
        resp = _json(RunCodeResponse(status=RunStatus.SandboxError, message=exc.message))
        recorded = (500, ErrorData(code=ErrorCode.SANDBOX_DIED, message=exc.message))
    except Exception:
        logger.exception("run_code failed", extra={"fields": {"language": req.language}})
        resp = _detail(500, "internal error; the server log has the details")
        recorded = (500, ErrorData(code=ErrorCode.INTERNAL, message="internal error"))
    finally:
        if steps is not None and ctx is not None:
            try:
                if recorded is not None:
                    await steps.finish(ctx, *recorded)
            except Exception:
                service.metrics.record_failures.inc()
                logger.exception("recording the run failed")
            finally:
                steps.end(ctx)
    return resp.status_code, resp


async def _languages(service: Service) -> list[dict[str, Any]]:
    """GET /languages: each language's snapshot and its state here (ready / building, step k of n /
    failed / missing; unsupported ones with why), and whether a missing one is built on first use."""
    from rollbox.snapshots import languages

    runner = runner_for(service.runtime)
    builds = runner.builds
    states = {p.language: p.as_json() for p in await asyncio.to_thread(builds.statuses)} if builds else {}
    out: list[dict[str, Any]] = []
    for name, row in languages.LANGUAGES.items():
        if row.snapshot is None:
            out.append({"language": name, "snapshot": None, "state": "unsupported", "error": row.unsupported})
            continue
        entry = states.get(name) or {"language": name, "snapshot": row.snapshot, "state": "unknown"}
        out.append({**entry, "template": f"snapshots/templates/{row.template}",
                    "built_on_first_use": runner.build_on_first_use})
    return out


def _json(reply: RunCodeResponse) -> JSONResponse:
    body = reply.model_dump(mode="json")
    for step in ("compile_result", "run_result"):  # rollbox's one extra key, only when it says something
        if body[step] is not None and body[step]["cached"] is None:
            del body[step]["cached"]
    return JSONResponse(body)


def _as_run_data(req: RunCodeRequest, meta: dict[str, str]) -> RunData:
    """The request as the `run` event it amounts to, for its trajectory row (command, stdin, timeout)."""
    from rollbox.snapshots import languages

    try:
        # the JVM flags of the limit asked for (none asked: the run had the snapshot's, not written here)
        memory = req.memory_limit_MB * 2**20 if req.memory_limit_MB > 0 else None
        plan = languages.plan(req.language, req.code, memory_max_bytes=memory)
        command = f"{plan.compile} && {plan.run}" if plan.compile else plan.run
        files = {k: v for k, v in plan.files.items()}
        snapshot = plan.snapshot
    except rterr.InvalidRequest:
        command, files, snapshot = f"# {req.language}", {}, "python"
    timeout = min(max(req.run_timeout, 0.001), 24 * 3600)
    try:
        return RunData(command=command, stdin=req.stdin, files=files, timeout_s=timeout, snapshot=snapshot,
                       metadata={**meta, "language": req.language[:200]})
    except ValidationError:
        return RunData(command=command[:10000], timeout_s=timeout, metadata=meta)
