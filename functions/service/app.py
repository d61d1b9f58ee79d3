"""The CloudEvent service: one HTTP function that turns request events into reply events.

Served by functions-framework (its ASGI flavour, HTTP signature: its ``cloud_event`` signature
drops return values, and a reply must travel in the response). Per request:

    read body (capped, 408 if it stops arriving) -> decode the CloudEvent -> route by type
    -> validate data -> idempotency (source, id) -> disk room to record it (else 507) -> admission
    -> handler (one runtime call) -> its row on disk (else 507: never a 200 whose row is lost) -> reply

A reply that may differ on a retry (409 busy, 429, 5xx, 507) is not kept for redeliveries. A client
that goes away before its request is read is counted as status 499 and logged, not as an error.

Also ``GET /healthz`` (the process is up), ``/readyz`` (it takes work) and ``/metrics``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import re
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import functions_framework.aio
from cloudevents.http import CloudEvent
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ValidationError
from rollbox.functions.contract.events import ReplyError, content_mode, decode, encode, error_event, reply_event
from rollbox.functions.contract.models import (
    REPLY_CARRIES,
    SANDBOX_CREATED,
    SANDBOX_DESTROY,
    SANDBOX_DESTROYED,
    SANDBOX_ID_PATTERN,
    ErrorCode,
    ErrorData,
)
from rollbox.functions.durable.capacity import LiveCap
from rollbox.functions.handlers import run_code as run_code_handler
from rollbox.functions.handlers import sandbox
from rollbox.functions.handlers.routing import EventRef, Route, SandboxRuntime
from rollbox.functions.recording.steps import StepLog, current_step
from rollbox.functions.service.admission import (
    RUNNING_PER_CPU,
    Admission,
    InsufficientStorage,
    Rejected,
    ServiceConfig,
    disk_full,
)
from rollbox.functions.service.deadline import budget_s, within
from rollbox.functions.service.idempotency import Conflict, IdempotencyCache
from rollbox.functions.service.logs import logger
from rollbox.functions.service.metrics import Metrics
from rollbox.runtime import errors as rterr
from rollbox.runtime.pool import Pool
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

__all__ = ["ERROR_TABLE", "Service", "ServiceConfig", "handle"]

MiB = 1024 * 1024
_SANDBOX_ID = re.compile(SANDBOX_ID_PATTERN)
CLIENT_GONE = 499  # the status label of a request whose client left before it was read (nginx's)


class _ClientGone(rterr.RollboxError):
    """The client closed the connection before its request body was read: nobody gets a reply."""

    def __init__(self) -> None:
        super().__init__("the client closed the connection before its request was read")


@dataclass(frozen=True)
class _Reply:
    status: int
    event: CloudEvent
    retry_after_s: float | None = None
    cacheable: bool = True
    code: str | None = None


def _approx_bytes(value: Any) -> int:
    """Roughly what a reply's data holds in memory: its strings, plus a little per item."""
    if isinstance(value, str | bytes):
        return len(value) + 50
    if isinstance(value, dict):
        return sum(_approx_bytes(k) + _approx_bytes(v) for k, v in value.items()) + 64
    if isinstance(value, list | tuple):
        return sum(_approx_bytes(v) for v in value) + 56
    return 24


def _error(err: ReplyError, *, cacheable: bool = True) -> _Reply:
    return _Reply(err.status, error_event(err), err.retry_after_s, cacheable, err.code)


def _validation_message(request_type: str, exc: ValidationError) -> tuple[str, list[dict[str, Any]]]:
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    parts = []
    for e in errors[:5]:
        loc = ".".join(str(x) for x in e["loc"]) or "(data)"
        parts.append(f"{loc}: {e['msg']}")
    more = f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""
    details = [{"loc": [str(x) for x in e["loc"]], "msg": e["msg"], "type": e["type"]} for e in errors[:20]]
    return f"invalid data for {request_type}: " + "; ".join(parts) + more, details


@dataclass(frozen=True)
class _Maps:
    """How one runtime exception is answered: its code (which carries the status), a prefix for its
    message, Retry-After."""

    code: ErrorCode
    prefix: str = ""
    retry_after_s: float | None = None

    @property
    def status(self) -> int:
        return self.code.status


# Every exception's reply, in one place: the runtime's, the service's own refusals (admission, drain,
# an idempotency conflict, a full disk) raised as the runtime's classes. The first matching class wins
# (subclasses first); a class not here is a 500 ``internal``; a store error caused by a full disk is
# ``InsufficientStorage``. README's errors table and the client's exception classes follow this table;
# Retry-After is the exception's own when it carries one, else the row's.
ERROR_TABLE: tuple[tuple[type[rterr.RollboxError], _Maps], ...] = (
    (rterr.InvalidRequest, _Maps(ErrorCode.INVALID_DATA)),
    (Conflict, _Maps(ErrorCode.IDEMPOTENCY_CONFLICT)),
    (rterr.SandboxGone, _Maps(ErrorCode.SANDBOX_GONE)),
    (rterr.SandboxBusy, _Maps(ErrorCode.SANDBOX_BUSY, retry_after_s=1.0)),
    (rterr.SandboxNotFound, _Maps(ErrorCode.SANDBOX_NOT_FOUND)),
    (rterr.SnapshotNotFound, _Maps(ErrorCode.SNAPSHOT_NOT_FOUND)),
    (rterr.SandboxDied, _Maps(ErrorCode.SANDBOX_DIED)),
    (rterr.Unsupported, _Maps(ErrorCode.UNSUPPORTED)),
    (rterr.StoreUnavailable, _Maps(ErrorCode.STORE_UNAVAILABLE,
                                   "the snapshot store is unavailable; retry later: ", 5.0)),
    (rterr.IntegrityError, _Maps(ErrorCode.STORE_CORRUPT,
                                 "the snapshot store returned corrupt data, which was not used: ")),
    (rterr.StoreError, _Maps(ErrorCode.STORE_ERROR, "snapshot store error: ")),
    (rterr.Overloaded, _Maps(ErrorCode.OVERLOADED, retry_after_s=1.0)),
    (InsufficientStorage, _Maps(ErrorCode.INSUFFICIENT_STORAGE,
                                "the server's disk is full; retry later or on another replica: ", 5.0)),
    (rterr.ShuttingDown, _Maps(ErrorCode.SHUTTING_DOWN, "the server is shutting down; retry elsewhere: ", 1.0)),
)


def _internal() -> ReplyError:
    """Anything unexpected: a 500 that leaks nothing (the log has the traceback and the event id)."""
    return ReplyError(ErrorCode.INTERNAL, "internal error; the server log has the details")


def _runtime_error(exc: rterr.RollboxError) -> ReplyError:
    """An exception as its error reply (``ERROR_TABLE``); one not in the table is ``_internal()``."""
    if isinstance(exc, ReplyError):  # answered as it says
        return exc
    if isinstance(exc, rterr.StoreError) and disk_full(exc):  # the local store's disk, not the store's refusal
        exc = InsufficientStorage(exc.message, sandbox_id=exc.sandbox_id)
    m = next((maps for cls, maps in ERROR_TABLE if isinstance(exc, cls)), None)
    if m is None:
        return _internal()
    details: dict[str, Any] = {}
    if exc.sandbox_id is not None:
        details["sandbox_id"] = exc.sandbox_id
    if isinstance(exc, rterr.StoreError):
        details = _store_details(exc)
    elif isinstance(exc, rterr.SnapshotNotFound | rterr.Unsupported) and exc.snapshot_id is not None:
        details["snapshot_id"] = exc.snapshot_id
    if isinstance(exc, rterr.SandboxGone):
        details["reason"] = exc.reason
    own = exc.retry_after_s if isinstance(exc, rterr.Overloaded | rterr.ShuttingDown | InsufficientStorage) else None
    retry = own if own is not None else m.retry_after_s
    return ReplyError(m.code, m.prefix + exc.message, sandbox_id=exc.sandbox_id, retry_after_s=retry,
                      details=details)


def _store_details(exc: rterr.StoreError) -> dict[str, Any]:
    return {k: v for k, v in (("snapshot_id", exc.snapshot_id), ("layer_id", exc.layer_id)) if v is not None}


def _kept_for_redeliveries(status: int) -> bool:
    """Whether a reply is the event's answer for good: not one a retry may change (another replica was
    first, overload, an incomplete request, a server or store fault, a full disk)."""
    return status < 500 and status not in (408, 409, 429)


class Service:
    def __init__(
        self,
        runtime: SandboxRuntime,
        config: ServiceConfig | None = None,
        routes: Iterable[Route] = sandbox.ROUTES,
        steps: StepLog | None = None,
        pools: Callable[[], Iterable[Pool]] | None = None,
        cap: LiveCap | None = None,
        registry: CollectorRegistry | None = None,
        cleanup_failures: Callable[[], Mapping[str, int]] | None = None,
    ):
        """``pools``: the runtime's warm pools, whose failures /metrics reports (``rt.pools.values()``;
        the durable layer in front of a ``Runtime`` does not show them). ``cap``: the replica's live
        cap, the one the durable layer asks too (default: ``config.max_live``'s). ``registry``: the
        replica's metrics registry (shared with the durable layer and the recorder).
        ``cleanup_failures``: the runtime's failed clean-ups by kind, for /metrics."""
        self.runtime = runtime
        if config is not None and config.compile_slots:  # (0: the runner's own default)
            run_code_handler.runner_for(runtime, compile_slots=config.compile_slots)
        self.steps = steps  # trajectories and usage: every final reply is recorded before it is sent
        self.config = cfg = config or ServiceConfig()
        self.routes: dict[str, Route] = {}
        for r in routes:
            if r.spec.request_type in self.routes:
                raise ValueError(f"two routes for {r.spec.request_type!r}")
            self.routes[r.spec.request_type] = r
        self.admission = Admission(
            cap=cap or LiveCap(cfg.max_live),
            max_queued=cfg.max_queued,
            max_running=cfg.max_running or RUNNING_PER_CPU * run_code_handler.sandbox_cpus(runtime),
            turn_s=cfg.turn_s,
            retry_after_s=cfg.retry_after_s,
            running=runtime.running_count,
        )
        self.metrics = Metrics(
            live_count=runtime.live_count,
            pool_sizes=runtime.pool_sizes,
            inflight=lambda: self.admission.inflight,
            waiting=lambda: self.admission.waiting,
            pools=pools,
            cleanup_failures=cleanup_failures,
            registry=registry,
        )
        self.cache: IdempotencyCache[_Reply] = IdempotencyCache(
            cfg.idempotency_entries,
            cfg.idempotency_ttl_s,
            cacheable=lambda r: r.cacheable,
            max_bytes=cfg.idempotency_max_bytes,
            size_of=lambda r: _approx_bytes(r.event.data),
        )
        self.ready = False
        self.last_request_at = 0.0  # time.monotonic() of the last request but health checks and /metrics
        self.store_ok = True  # kept current by rollbox serve when the store is remote
        self.aborting = False
        self._working: set[asyncio.Task[Any]] = set()
        self._labels: OrderedDict[str, tuple[str | None, str | None]] = OrderedDict()

    # -- the ASGI app ------------------------------------------------------------------------------

    def asgi_app(self) -> Starlette:
        """functions-framework's ASGI app around ``handle``, bound to this service."""
        app: Starlette = functions_framework.aio.create_asgi_app_from_module(  # type: ignore[no-untyped-call]
            "handle", __file__, "http", sys.modules[__name__], None
        )
        app.state.rollbox_service = self
        return app

    async def handle(self, request: Request) -> Response:
        path, method = request.url.path, request.method
        if method in ("GET", "HEAD") and path in ("/healthz", "/readyz", "/metrics"):
            if path == "/healthz":
                return JSONResponse({"status": "ok"})
            if path == "/readyz":
                full = self._disk_full()
                ok = self.ready and not self.admission.draining and self.store_ok and full is None
                status = "ready" if ok else ("draining" if self.admission.draining else
                                             "starting" if not self.ready else
                                             "store unavailable" if not self.store_ok else "disk full")
                body = {"status": status, "inflight": self.admission.inflight,
                        "waiting": self.admission.waiting, "store_ok": self.store_ok,
                        "disk_ok": full is None}
                return JSONResponse(body, status_code=200 if ok else 503)
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)
        self.last_request_at = time.monotonic()
        if path in ("/run_code", "/v1/ping", "/languages"):  # SandboxFusion's API (functions/service/run_code.py)
            from rollbox.functions.service import run_code
            return await run_code.handle(self, request)
        if path != "/" or method != "POST":
            # read what the client sent (bounded) before answering, so closing cannot reset the reply
            try:
                await self._read_body(request)
            except ReplyError as late:
                if late.status == 408:
                    return self._respond(request, _error(late), {})
            except _ClientGone:
                return Response(status_code=CLIENT_GONE)  # nobody reads it
        if path != "/":
            err = ReplyError(ErrorCode.NOT_FOUND, f"no endpoint at {path[:100]!r}: POST CloudEvents to '/'")
            return self._respond(request, _error(err), {})
        if method != "POST":
            err = ReplyError(ErrorCode.METHOD_NOT_ALLOWED, f"{method} is not allowed: POST CloudEvents to '/'")
            return self._respond(request, _error(err), {}, allow="POST")
        return await self._handle_event(request)

    # -- one event ---------------------------------------------------------------------------------

    async def _handle_event(self, request: Request) -> Response:
        t0 = time.perf_counter()
        fields: dict[str, Any] = {}
        replayed = False
        carry: dict[str, str] = {}
        try:
            body = await self._read_body(request)  # first, even to refuse: see handle()
            event = decode(request.headers, body, request.headers.raw)
            for theirs, ours in REPLY_CARRIES:  # partition key, RequestReply correlation: onto the reply
                value = event.get(theirs)
                if isinstance(value, str) and 0 < len(value) <= 256:
                    carry[ours] = value
            try:
                self.admission.check_draining(ends_sandbox=event["type"] == SANDBOX_DESTROY)
            except Rejected as rej:
                self.metrics.rejects.labels(rej.reason).inc()
                raise _runtime_error(rej.error) from None
            etype, source, eid = event["type"], event["source"], event["id"]
            fields.update(event_id=eid, source=source, type=etype)
            route = self.routes.get(etype)
            if route is None:
                known = ", ".join(sorted(self.routes))
                raise ReplyError(ErrorCode.UNKNOWN_TYPE, f"unknown event type {etype[:200]!r}; known: {known}")
            data = self._validate(route, event.data)
            self._label_fields(data, fields)
            fingerprint = hashlib.sha256(
                json.dumps([etype, event.data], sort_keys=True, separators=(",", ":")).encode()
            ).hexdigest()
            budget = budget_s(self.config.request_deadline_s, data)
            in_time, answer = await within(self.cache.run(
                (source, eid), fingerprint,
                lambda: self._execute(route, data, fields, EventRef(source, eid, fingerprint), event.get("time"))
            ), budget)
            if not in_time or answer is None:  # its work goes on; a retry of this event gets what it ends with
                self.metrics.rejects.labels("deadline").inc()
                raise rterr.Overloaded(f"no reply within {budget:g} s (--request-deadline-s, plus the exec's "
                                       "timeout_s); it may still finish: retry the same event (same source and id) "
                                       "to get its reply", retry_after_s=self.config.retry_after_s,
                                       sandbox_id=getattr(data, "sandbox_id", None))
            reply, replayed = answer
        except ReplyError as err:
            reply = _error(err)
        except _ClientGone:  # nothing to answer, and not the server's fault
            self.metrics.requests.labels("invalid", str(CLIENT_GONE)).inc()
            logger.info("client left before its request was read", extra={"fields": {"status": CLIENT_GONE}})
            return Response(status_code=CLIENT_GONE)
        except rterr.RollboxError as exc:  # an idempotency conflict found by the cache
            reply = _error(_runtime_error(exc))
        except Exception:  # a bug here still answers with an error event, never a bare 500 page
            logger.exception("event handling failed", extra={"fields": fields})
            reply = _error(_internal())
        if replayed:
            self.metrics.replays.inc()
        fields.setdefault("sandbox_id", reply.event.get("subject"))
        self._remember_labels(reply, fields)
        seconds = time.perf_counter() - t0
        etype_label = fields.get("type") if fields.get("type") in self.routes else "invalid"
        self.metrics.requests.labels(etype_label, str(reply.status)).inc()
        self.metrics.request_seconds.labels(etype_label).observe(seconds)
        fields.update(status=reply.status, code=reply.code, ms=round(seconds * 1000, 3), replayed=replayed or None)
        logger.log(40 if reply.status >= 500 else 20, "event", extra={"fields": fields})
        return self._respond(request, reply, fields, carry=carry)

    def _respond(self, request: Request, reply: _Reply, fields: dict[str, Any], *,
                 carry: dict[str, str] | None = None, **extra: str) -> Response:
        event = reply.event
        if carry:  # this request's own (a replayed reply was made for the first delivery)
            event = CloudEvent({**event.get_attributes(), **carry}, event.get_data())
        headers, body = encode(event, content_mode(request.headers))
        if reply.retry_after_s is not None:
            headers["retry-after"] = str(max(1, math.ceil(reply.retry_after_s)))
        if reply.status in (408, 503):  # 408: what is left of the request is not read
            headers["connection"] = "close"
        headers.update(extra)
        return Response(body, status_code=reply.status, headers=headers)

    async def _read_body(self, request: Request) -> bytes:
        """The body, at most ``max_body_bytes`` (else 413); 408 if no more of it comes for
        ``request_timeout_s``; ``_ClientGone`` if the client closes the connection first."""
        cap = self.config.max_body_bytes
        idle_s = self.config.request_timeout_s
        declared = request.headers.get("content-length", "")
        too_large = declared.isdigit() and int(declared) > cap
        chunks: list[bytes] = []
        size = 0
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(idle_s) as deadline:
                async for chunk in request.stream():
                    deadline.reschedule(loop.time() + idle_s)
                    size += len(chunk)
                    if size > cap:
                        too_large = True
                    if too_large:
                        if size > max(64 * MiB, 4 * cap):  # stop reading; the connection is closed after the reply
                            break
                        continue
                    chunks.append(chunk)
        except TimeoutError:
            of = f" of the {declared} declared" if declared.isdigit() else ""
            raise ReplyError(ErrorCode.REQUEST_TIMEOUT,
                             f"the request body stopped arriving: nothing more for {idle_s:g} s after {size} "
                             f"bytes{of} (--request-timeout-s); send the whole body at once",
                             details={"request_timeout_s": idle_s, "received_bytes": size}) from None
        except ClientDisconnect:
            raise _ClientGone from None
        if too_large:
            raise ReplyError(
                ErrorCode.PAYLOAD_TOO_LARGE,
                f"request body larger than the {cap}-byte cap (max body bytes); send files "
                "in smaller pieces or raise ROLLBOX_MAX_BODY_BYTES",
                details={"max_body_bytes": cap},
            )
        return b"".join(chunks)

    def _validate(self, route: Route, data: Any) -> BaseModel:
        rtype = route.spec.request_type
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ReplyError(
                ErrorCode.INVALID_DATA,
                f"data of {rtype} must be a JSON object, got {type(data).__name__}",
            )
        try:
            return route.spec.data.model_validate(data)
        except ValidationError as exc:
            message, details = _validation_message(rtype, exc)
            sid = data.get("sandbox_id")
            raise ReplyError(
                ErrorCode.INVALID_DATA,
                message,
                details={"errors": details},
                # never unvalidated text: it becomes the reply's ce-subject header
                sandbox_id=sid if isinstance(sid, str) and len(sid) <= 128 and _SANDBOX_ID.fullmatch(sid) else None,
            ) from None

    def _disk_full(self) -> str | None:
        """Why steps cannot be recorded now (the spool's disk is full), else None."""
        return self.steps.recorder.disk_full if self.steps is not None else None

    async def _execute(self, route: Route, data: BaseModel, fields: dict[str, Any], event: EventRef,
                       time_attr: Any = None) -> _Reply:
        if self.steps is None:
            return await self._call(route, data, fields, event)
        full = self._disk_full()
        if full is not None:  # its row could not be kept: refused before it runs
            self.metrics.rejects.labels("disk_full").inc()
            return _error(_runtime_error(InsufficientStorage(f"the step cannot be recorded ({full})",
                                                             retry_after_s=self.config.retry_after_s)),
                          cacheable=False)
        ctx = self.steps.begin(route.spec.request_type, event.source, event.id, time_attr, data)
        try:
            reply = await self._call(route, data, fields, event)
            # a final answer is a step (retryable ones are not: nothing happened, the retry is the step)
            if reply.status == 200 or reply.cacheable or reply.code == ErrorCode.INTERNAL:
                payload = ctx.result if reply.status == 200 else ErrorData.model_validate(reply.event.data)
                try:
                    await self.steps.finish(ctx, reply.status, payload)
                except Exception as exc:  # the row is not on disk: never answered as if it were
                    self.metrics.record_failures.inc()
                    if disk_full(exc):
                        why = exc.strerror if isinstance(exc, OSError) else str(exc)
                        logger.warning(f"the step's row could not be written: {why}", extra={"fields": fields})
                        reply = _error(_runtime_error(InsufficientStorage(
                            f"the step's record could not be written ({why}); retry the same event",
                            retry_after_s=self.config.retry_after_s)), cacheable=False)
                    else:
                        logger.exception("recording the step failed", extra={"fields": fields})
                        reply = _error(_internal(), cacheable=False)
            return reply
        finally:
            self.steps.end(ctx)

    async def _call(self, route: Route, data: BaseModel, fields: dict[str, Any], event: EventRef) -> _Reply:
        task = asyncio.current_task()
        try:
            async with self.admission.admit(creates_sandbox=route.creates_sandbox,
                                            ends_sandbox=route.spec.request_type == SANDBOX_DESTROY):
                if task is not None:
                    self._working.add(task)
                try:
                    result = await route.handler(self.runtime, data, event)
                finally:
                    if task is not None:
                        self._working.discard(task)
        except asyncio.CancelledError:
            if not self.aborting or task is None:
                raise
            task.uncancel()
            stopped = rterr.ShuttingDown("this event did not finish within the grace period",
                                         retry_after_s=self.config.retry_after_s)
            return _error(_runtime_error(stopped), cacheable=False)
        except Rejected as rej:
            self.metrics.rejects.labels(rej.reason).inc()
            return _error(_runtime_error(rej.error), cacheable=False)
        except rterr.RollboxError as exc:
            err = _runtime_error(exc)
            if err.status == 429:
                self.metrics.rejects.labels("runtime").inc()
            if err.status == 507:
                logger.warning(f"disk full: {exc.message}", extra={"fields": {**fields, "sandbox_id": exc.sandbox_id}})
            elif err.status >= 500:
                logger.error("runtime error", exc_info=True, extra={"fields": {**fields, "sandbox_id": exc.sandbox_id}})
            return _error(err, cacheable=_kept_for_redeliveries(err.status))
        except Exception:
            logger.exception("handler failed", extra={"fields": fields})
            return _error(_internal(), cacheable=False)
        self.metrics.record_reply(route.spec.request_type, result)
        if (ctx := current_step.get()) is not None:
            ctx.result = result
        subject = getattr(result, "sandbox_id", None)
        return _Reply(200, reply_event(route.spec.reply_type, result, subject))

    def abort(self) -> int:
        """Grace period over: stop the runtime calls still running; their events get a 503 reply (not
        kept for replay, so a retry runs elsewhere). Returns how many were stopped."""
        self.aborting = True
        for task in self._working:
            task.cancel()
        return len(self._working)

    # -- log correlation: experiment / episode of a sandbox ------------------------------------------

    def _label_fields(self, data: BaseModel, fields: dict[str, Any]) -> None:
        meta = getattr(data, "metadata", None)
        sid = getattr(data, "sandbox_id", None)
        if isinstance(meta, dict):
            fields.update(experiment=meta.get("experiment"), episode=meta.get("episode"))
        elif isinstance(sid, str):
            fields["sandbox_id"] = sid
            exp, ep = self._labels.get(sid, (None, None))
            fields.update(experiment=exp, episode=ep)

    def _remember_labels(self, reply: _Reply, fields: dict[str, Any]) -> None:
        sid = reply.event.get("subject")
        if not sid or reply.status != 200:
            return
        if reply.event["type"] == SANDBOX_CREATED:
            self._labels[sid] = (fields.get("experiment"), fields.get("episode"))
            if len(self._labels) > 65536:
                self._labels.popitem(last=False)
        elif reply.event["type"] == SANDBOX_DESTROYED:
            self._labels.pop(sid, None)


@functions_framework.aio.http
async def handle(request: Request) -> Response:
    """The function functions-framework serves; the service it belongs to rides on the app state."""
    service: Service = request.app.state.rollbox_service
    return await service.handle(request)
