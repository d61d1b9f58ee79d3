"""``rollbox serve``: the CloudEvent service on one box, embedded runtime included.

Every flag has an environment variable (``--port`` / ``PORT``, as Knative sets it), cast strictly.
SIGTERM (or SIGINT): readiness fails and new events get 503 at once, so do the admitted ones still
waiting their turn (``--max-running``: not started, nothing applied), the running ones finish within
the grace period, the listener closes, the runtime destroys what is left, exit status 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import gc
import importlib
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvloop
from prometheus_client import CollectorRegistry
from rollbox.functions.config.options import (
    ConfigError,
    Option,
    add_options,
    amount,
    choice,
    integer,
    level,
    names,
    path,
    port,
    resolve_options,
    seconds,
    seconds_or_never,
    text,
    uid_range,
)
from rollbox.functions.config.stores import (
    StoreConfig,
    check_store_url,
    in_use_of,
    open_local,
    open_remote,
    state_objects,
)
from rollbox.functions.durable.capacity import LiveCap
from rollbox.functions.recording.prices import Prices
from rollbox.functions.service import logs
from rollbox.functions.service.admission import ServiceConfig
from rollbox.functions.service.logs import lifecycle, logger
from rollbox.runtime import tasks
from rollbox.runtime.errors import RollboxError, SnapshotNotFound, StoreUnavailable
from rollbox.runtime.runtime import RuntimeConfig
from rollbox.snapshots.calls import StoreCalls
from rollbox.snapshots.resolver import StoreResolver

if TYPE_CHECKING:
    from rollbox.functions.durable.runtime import DurableRuntime
    from rollbox.functions.recording.recorder import Recorder
    from rollbox.functions.recording.steps import StepLog
    from rollbox.functions.service.app import Service
    from rollbox.runtime.runtime import Runtime
    from rollbox.snapshots.store_s3 import S3Store

# What answers events, loaded only by ``serve`` (in a thread, while the prewarmed zygotes start):
# contract models, functions-framework, pyarrow, uvicorn — most of a cold replica's first second.
SERVICE_MODULES = (
    "uvicorn", "rollbox.functions.service.app", "rollbox.functions.durable.runtime",
    "rollbox.functions.recording.recorder",
    "rollbox.functions.recording.steps", "rollbox.functions.handlers.episodes", "rollbox.functions.handlers.sandbox",
    "rollbox.functions.handlers.snapshot", "rollbox.functions.handlers.run_code",
)

__all__ = ["ConfigError", "ServeConfig", "add_parser", "resolve", "serve"]



_D = ServiceConfig()
OPTIONS: tuple[Option, ...] = (
    Option("host", "--host", "HOST", text, "127.0.0.1", "address to listen on"),
    Option("port", "--port", "PORT", port, 8080, "port to listen on (0: any free port, logged)"),
    Option(
        "max_live",
        "--max-live",
        "ROLLBOX_MAX_LIVE",
        integer(1),
        _D.max_live,
        "cap on live sandboxes; creates beyond it get 429",
    ),
    Option(
        "max_queued",
        "--max-queued",
        "ROLLBOX_MAX_QUEUED",
        integer(1),
        _D.max_queued,
        "cap on requests admitted and not yet answered; more get 429",
    ),
    Option("compile_slots", "--compile-slots", "ROLLBOX_COMPILE_SLOTS", integer(0), _D.compile_slots,
           "language compiles run at once (/run_code and run events); the others wait their turn, which does not "
           "count in their compile timeout, and a wait past it is a 504 (/run_code) or 429 with Retry-After; "
           "0: two per CPU the sandboxes get"),
    Option("max_running", "--max-running", "ROLLBOX_MAX_RUNNING", integer(0), _D.max_running,
           "cap on admitted requests running at once; the others wait their turn in order (not started: on "
           "SIGTERM they get 503 with Retry-After at once, to be retried elsewhere); one that has run "
           "--turn-s leaves its place to the next; 0: 8 per CPU the sandboxes get"),
    Option("turn_s", "--turn-s", "ROLLBOX_TURN_S", seconds_or_never, _D.turn_s,
           "a started request counts against --max-running this long at most, then the next one waiting starts "
           "too (a program that sleeps or runs long does not hold the queue); 0: until it ends"),
    Option(
        "max_body_bytes",
        "--max-body-bytes",
        "ROLLBOX_MAX_BODY_BYTES",
        integer(1024),
        _D.max_body_bytes,
        "largest request body; larger get 413",
    ),
    Option(
        "idempotency_entries",
        "--idempotency-entries",
        "ROLLBOX_IDEMPOTENCY_ENTRIES",
        integer(1),
        _D.idempotency_entries,
        "replies kept for duplicate events (same source and id)",
    ),
    Option(
        "idempotency_ttl_s",
        "--idempotency-ttl-s",
        "ROLLBOX_IDEMPOTENCY_TTL_S",
        seconds,
        _D.idempotency_ttl_s,
        "how long a reply is kept for duplicates",
    ),
    Option(
        "idempotency_max_bytes",
        "--idempotency-max-bytes",
        "ROLLBOX_IDEMPOTENCY_MAX_BYTES",
        integer(1024),
        _D.idempotency_max_bytes,
        "memory for kept replies (their outputs); the oldest go first",
    ),
    Option(
        "retry_after_s",
        "--retry-after-s",
        "ROLLBOX_RETRY_AFTER_S",
        seconds,
        _D.retry_after_s,
        "Retry-After sent with 429 and 503",
    ),
    Option(
        "grace_s",
        "--grace-s",
        "ROLLBOX_GRACE_S",
        seconds,
        30.0,
        "on SIGTERM, how long in-flight events may take to finish",
    ),
    Option(
        "drain_linger_s",
        "--drain-linger-s",
        "ROLLBOX_DRAIN_LINGER_S",
        seconds_or_never,
        2.0,
        "on SIGTERM, after the drain: how long the listener may stay open while requests still come (each "
        "answered 503 shutting_down with Retry-After), as a load balancer sends them until its health check "
        "sees /readyz answer 503; it closes once none came for 0.5 s (at once when none was coming; 0: never lingers)",
    ),
    Option(
        "keep_alive_s",
        "--keep-alive-s",
        "ROLLBOX_KEEP_ALIVE_S",
        seconds,
        75.0,
        "how long an idle keep-alive connection stays open (keep it above the clients' idle timeout)",
    ),
    Option(
        "request_timeout_s",
        "--request-timeout-s",
        "ROLLBOX_REQUEST_TIMEOUT_S",
        seconds,
        _D.request_timeout_s,
        "how long a request's headers may take to arrive, and the body may stop arriving: longer is a 408 "
        "and the connection is closed",
    ),
    Option("request_deadline_s", "--request-deadline-s", "ROLLBOX_REQUEST_DEADLINE_S", seconds_or_never,
           _D.request_deadline_s,
           "every event is answered within this, plus the exec time it asks for (timeout_s): past it, 429 "
           "overloaded with Retry-After while its work goes on, and a retry of the same event gets what it "
           "ended with (0: no deadline)"),
    Option(
        "durability",
        "--durability",
        "ROLLBOX_DURABILITY",
        choice("step", "off"),
        "step",
        "step: every acknowledged step of a sandbox is committed to the store first, so any replica "
        "serves any step and a restart loses nothing; off: sandboxes live in this process only",
    ),
    Option(
        "hibernate_after_s",
        "--hibernate-after-s",
        "ROLLBOX_HIBERNATE_AFTER_S",
        seconds_or_never,
        30.0,
        "with durability: a live sandbox idle this long is ended; its state stays in the store (0: never)",
    ),
    Option(
        "sweep_interval_s",
        "--sweep-interval-s",
        "ROLLBOX_SWEEP_INTERVAL_S",
        seconds,
        60.0,
        "with durability: how often expired and destroyed sandboxes' state is cleaned from the store",
    ),
    Option(
        "record",
        "--record",
        "ROLLBOX_RECORD",
        choice("on", "off"),
        "on",
        "on: every step is a trajectory row and every sandbox life a usage record, spooled before the "
        "reply and flushed to the store as Parquet (trajectories/, usage/)",
    ),
    Option(
        "flush_records",
        "--flush-records",
        "ROLLBOX_FLUSH_RECORDS",
        integer(1),
        5000,
        "with recording: write the spool to the store every this many rows",
    ),
    Option(
        "flush_interval_s",
        "--flush-interval-s",
        "ROLLBOX_FLUSH_INTERVAL_S",
        seconds,
        10.0,
        "with recording: ... and at least this often (and on drain)",
    ),
    Option("price_vcpu_s", "--price-vcpu-s", "ROLLBOX_PRICE_VCPU_S", amount, Prices.vcpu_s,
           "dollars per vCPU-second of a sandbox's cpu limit (usage records, metrics, rollbox report)"),
    Option("price_gib_s", "--price-gib-s", "ROLLBOX_PRICE_GIB_S", amount, Prices.gib_s,
           "dollars per GiB-second of a sandbox's memory limit"),
    Option("cpu_reserved_cores", "--cpu-reserved-cores", "ROLLBOX_CPU_RESERVED_CORES", amount,
           RuntimeConfig.model_fields["cpu_reserved_cores"].default,
           "CPU kept from the sandboxes for this server and its zygotes: all sandboxes together are capped at "
           "the host's cores less this (cgroups v1 and v2; without cgroups, sandboxes run at nice 10 instead)"),
    Option("uid_range", "--uid-range", "ROLLBOX_UID_RANGE", uid_range, RuntimeConfig.model_fields["uid_range"].default,
           "as root: host uids START:COUNT, each owning the user namespace of one live sandbox (and running "
           "its processes where the layers take idmapped mounts), so the kernel's per-user budgets (processes, "
           "inotify, message queues, signals; then pipe buffers too) are per sandbox; none: every sandbox "
           "shares uid 1000's"),
    Option("rootless_budget_share", "--rootless-budget-share", "ROLLBOX_ROOTLESS_BUDGET_SHARE", integer(1),
           RuntimeConfig.model_fields["rootless_budget_share"].default,
           "rootless: each sandbox may take at most 1/N of the caller's inotify instances and watches, "
           "fanotify groups and marks, message queue bytes and pending signals (all sandboxes run as the "
           "caller, so these budgets are shared); 1: no caps"),
    Option("prewarm", "--prewarm", "ROLLBOX_PREWARM", names, ("python",),
           "snapshots whose warm process and one ready sandbox start with the server, before any event "
           "asks for them (comma-separated; empty: none); one missing from the store is logged and skipped"),
    Option("language_builds", "--language-builds", "ROLLBOX_LANGUAGE_BUILDS", choice("on", "off"), "on",
           "on: a request (/run_code, a run event's language) for a language whose snapshot the local store "
           "lacks builds it from its template (Debian's packages, downloaded then), once per store, and waits "
           "for it (GET /languages shows the steps); off: 503 naming the build command"),
    Option("log_level", "--log-level", "ROLLBOX_LOG_LEVEL", level, "info", "debug, info, warning or error"),
    Option(
        "home",
        "--home",
        "ROLLBOX_HOME",
        path,
        None,
        "state directory and local snapshot store (unset: /var/lib/rollbox as root, else ~/.local/share/rollbox)",
    ),
    Option(
        "store",
        "--store",
        "ROLLBOX_STORE",
        check_store_url,
        None,
        "snapshot store: a directory or s3://bucket/prefix (unset: the local store in --home)",
    ),
    Option(
        "cache_dir",
        "--cache-dir",
        "ROLLBOX_CACHE_DIR",
        path,
        None,
        "with an S3 store: the local cache of its snapshots (unset: --home)",
    ),
    Option(
        "cache_max_bytes",
        "--cache-max-bytes",
        "ROLLBOX_CACHE_MAX_BYTES",
        integer(1),
        None,
        "cap on the layers pulled into the cache, least recently used evicted first (unset: no cap)",
    ),
    Option("s3_endpoint_url", "--s3-endpoint-url", "AWS_ENDPOINT_URL", text, None, "S3 endpoint URL"),
    Option("s3_region", "--s3-region", "AWS_REGION", text, None, "S3 region"),
    Option("aws_profile", "--aws-profile", "AWS_PROFILE", text, None, "AWS credentials profile for an S3 store"),
    Option(
        "s3_max_attempts",
        "--s3-max-attempts",
        "ROLLBOX_S3_MAX_ATTEMPTS",
        integer(1),
        3,
        "attempts per S3 request (exponential backoff between them) before a store error",
    ),
)


@dataclass(frozen=True)
class ServeConfig:
    host: str
    port: int
    grace_s: float
    keep_alive_s: float
    log_level: str
    service: ServiceConfig
    drain_linger_s: float = 2.0
    durability: str = "step"
    hibernate_after_s: float = 30.0
    sweep_interval_s: float = 60.0
    record: str = "on"
    flush_records: int = 5000
    flush_interval_s: float = 10.0
    price_vcpu_s: float = Prices.vcpu_s
    price_gib_s: float = Prices.gib_s
    cpu_reserved_cores: float = RuntimeConfig.model_fields["cpu_reserved_cores"].default
    uid_range: str = RuntimeConfig.model_fields["uid_range"].default
    rootless_budget_share: int = RuntimeConfig.model_fields["rootless_budget_share"].default
    prewarm: tuple[str, ...] = ()
    language_builds: str = "on"
    store: StoreConfig = field(default_factory=StoreConfig)


def resolve(args: argparse.Namespace, environ: Mapping[str, str]) -> ServeConfig:
    """Flag, else environment variable, else default; each cast strictly. Raises ``ConfigError``."""
    values = resolve_options(OPTIONS, args, environ)
    svc = ServiceConfig(**{k: values.pop(k) for k in list(values) if k in ServiceConfig.__dataclass_fields__})
    store = StoreConfig(**{k: values.pop(k) for k in list(values) if k in StoreConfig.__dataclass_fields__})
    return ServeConfig(service=svc, store=store, **values)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the CloudEvent functions over HTTP",
        description="Serve rollbox's CloudEvent functions over HTTP with the embedded runtime. Every flag "
        "has an environment variable; a flag wins over its variable.",
    )
    add_options(p, OPTIONS)
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    try:
        cfg = resolve(args, os.environ)
    except ConfigError as exc:
        print(f"rollbox serve: {exc}", file=sys.stderr)
        return 2
    logs.configure(cfg.log_level)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        rc = runner.run(serve(cfg))
        # Everything that matters is closed ("stopped" was logged): what is left is joining threads
        # (the loop's executor, here; the pools', at exit). None should take long; if one does, the
        # stacks go to stderr (the log) and the process ends anyway: a drain is bounded to the end.
        faulthandler.dump_traceback_later(EXIT_STALL_S, exit=True)
        t0 = time.monotonic()
    lifecycle.info("exiting", extra={"fields": {"rc": rc, "joined_s": round(time.monotonic() - t0, 3)}})
    return rc


def _uvicorn_server(config: Any) -> Any:
    """uvicorn, minus its signal handling: ``serve`` owns SIGTERM/SIGINT and drains first."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return Server(config)


def _load_service_and_remote(store: StoreConfig) -> S3Store | None:
    """The slow part of a start, off the event loop: the service's modules, and the S3 client."""
    remote = open_remote(store)
    for name in SERVICE_MODULES:
        importlib.import_module(name)
    return remote


@dataclass
class _Replica:
    """What ``serve`` builds, each part given its collaborators when it is made."""

    rt: Runtime
    service: Service
    snapshots: Any  # handlers.snapshot.Snapshots: the store URL for the start log
    durable: DurableRuntime | None = None
    recorder: Recorder | None = None
    remote: S3Store | None = None
    pushing: threading.Event | None = None  # set to stop pushing the home's language snapshots (on exit)


async def serve(cfg: ServeConfig) -> int:
    """Listen, start the runtime (prewarmed zygotes first), build the service, serve until SIGTERM
    or SIGINT, drain. Returns the exit status."""
    from rollbox.runtime.runtime import default_home

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if not stop.is_set():  # when the loop got to it: a late one here means the loop was busy
            lifecycle.info("stopping", extra={"fields": {"signal": sig.name}})
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        sock = _listen(cfg.host, cfg.port)
    except OSError as exc:
        logger.error(f"cannot listen on {cfg.host}:{cfg.port}: {exc.strerror}")
        _unhandle_signals(loop)
        return 1
    try:
        resolver = open_local(cfg.store)  # with S3: its cache alone until the remote is attached
    except (RollboxError, OSError) as exc:
        sock.close()
        logger.error(f"cannot open the snapshot store: {exc}")
        _unhandle_signals(loop)
        return 1
    home = cfg.store.home or default_home()
    rt = _runtime(cfg, resolver, home)
    try:
        await rt.start()
    except BaseException:
        sock.close()
        _unhandle_signals(loop)
        raise
    # A replica scaled from zero: its zygotes start first (their own processes, on the other cores),
    # from the snapshots its local store holds (baked into the image), while this process loads the
    # rest — the S3 client, the service — in a thread. A name the local store lacks waits for S3.
    remote_attached = asyncio.Event()
    warming = [asyncio.create_task(_prewarm(rt, name, remote_attached)) for name in cfg.prewarm]
    replica: _Replica | None = None
    rc = 0
    try:
        replica = await _build(cfg, rt, resolver, home, remote_attached)
        rc = 1 if replica is None else await _serve(cfg, replica, sock, stop, home)
    finally:
        sock.close()
        if replica is not None and replica.pushing is not None:
            replica.pushing.set()  # (no further language is started; one being pushed finishes or dies with us)
        for t in warming:
            t.cancel()
        await asyncio.gather(*warming, return_exceptions=True)
        if replica is not None and replica.recorder is not None:
            with contextlib.suppress(Exception):
                await replica.recorder.close()
        if replica is not None and replica.durable is not None:
            await replica.durable.close()
        try:
            await rt.close()
        except Exception:
            logger.exception("runtime close failed")
            rc = 1
        _unhandle_signals(loop)
    lifecycle.info("stopped", extra={"fields": {"rc": rc}})
    return rc


def _listen(host: str, port: int) -> socket.socket:
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on such sockets, and without it every
    # keep-alive reply waits ~40 ms for a delayed ACK (headers and body are separate writes).
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _unhandle_signals(loop: asyncio.AbstractEventLoop) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)


def _runtime(cfg: ServeConfig, resolver: StoreResolver, home: Path) -> Runtime:
    from rollbox.runtime.runtime import Runtime

    durable_on = cfg.durability == "step"
    rt = Runtime(RuntimeConfig(max_live=cfg.service.max_live, state_dir=home, layer_root=Path(resolver.layer_root),
                               cpu_reserved_cores=cfg.cpu_reserved_cores, uid_range=cfg.uid_range,
                               rootless_budget_share=cfg.rootless_budget_share,
                               # durable fork children take their parent's files inside them (a diff
                               # in a stacked scratch layer would not be in their durable state)
                               fork_inject_max_bytes=(1 << 30) if durable_on else 8 * 1024 * 1024),
                 resolver=resolver)
    # (the cache and the runtime need each other: the cache asks which layers the runtime uses)
    resolver.cache.in_use = in_use_of(rt.layers_in_use)
    return rt


async def _build(cfg: ServeConfig, rt: Runtime, resolver: StoreResolver, home: Path,
                 remote_attached: asyncio.Event) -> _Replica | None:
    """The S3 store (attached to the runtime's cache once loaded), and the service in front of the
    runtime: the durable layer, the recorder, the routes, all given their collaborators as they are
    made. None (logged) when the store cannot be used."""
    try:
        remote = await asyncio.to_thread(_load_service_and_remote, cfg.store)
    except (RollboxError, OSError) as exc:
        logger.error(f"cannot open the snapshot store: {exc}")
        return None
    # attached late on purpose: the runtime and its zygotes started on the local cache meanwhile
    resolver.cache.remote = remote
    rt.forget_names()  # names resolved from the local store alone are asked of S3 again
    remote_attached.set()
    from rollbox.functions.durable.runtime import DurableRuntime
    from rollbox.functions.handlers import episodes, sandbox, snapshot
    from rollbox.functions.handlers.routing import InProcess
    from rollbox.functions.recording.recorder import Recorder
    from rollbox.functions.recording.steps import StepLog
    from rollbox.functions.service.app import Service

    store_ok = True
    if remote is not None:  # say at once what is wrong with it, not per request later
        try:
            await resolver.calls.run(remote.check, doing="checking the store at start", deadline_s=10.0)
        except StoreUnavailable as exc:  # an outage: start, but not ready until it answers
            store_ok = False
            logger.warning(f"the snapshot store cannot be reached; not ready until it can: {exc.message}")
        except RollboxError as exc:
            logger.error(f"the snapshot store is not usable: {exc}")
            return None
    objects = state_objects(resolver.cache)
    registry = CollectorRegistry()  # the service's /metrics: every part registers in it
    cap = LiveCap(cfg.service.max_live)  # one cap, asked by admission and the durable layer
    replica_name = f"{socket.gethostname()}-{os.getpid()}"
    recorder: Recorder | None = None
    steps: StepLog | None = None
    if cfg.record == "on":
        recorder = Recorder(home / "spool", objects, replica_name, flush_records=cfg.flush_records,
                            flush_interval_s=cfg.flush_interval_s,
                            prices=Prices(vcpu_s=cfg.price_vcpu_s, gib_s=cfg.price_gib_s), registry=registry)
        await recorder.start()
        steps = StepLog(recorder, env_version=rt.env_version, labels=rt.labels)
        # (Runtime takes its life-ended callback as an attribute: it has no constructor parameter for it)
        rt.on_life_ended = steps.life_ended
    durable: DurableRuntime | None = None
    if cfg.durability == "step":
        durable = DurableRuntime(rt, objects, hibernate_after_s=cfg.hibernate_after_s,
                                 sweep_interval_s=cfg.sweep_interval_s, tombstone_ttl_s=cfg.service.idempotency_ttl_s,
                                 replica=replica_name, registry=registry, cap=cap, journal=steps)
        await durable.start()
    snapshots = snapshot.Snapshots(rt, resolver.cache, durable)
    routes = (*sandbox.ROUTES, *snapshot.routes(snapshots), *(episodes.ROUTES if steps is not None else ()))
    service = Service(durable or InProcess(rt), cfg.service, routes=routes, steps=steps,
                      pools=lambda: list(rt.pools.values()), cap=cap, registry=registry,
                      # clean-up that failed, by what (each logged once): this runtime's, leftovers of dead ones
                      cleanup_failures=lambda: {**rt.cleanup_failures, "leftover": rt.sweeper.failed})
    service.store_ok = store_ok
    from rollbox.functions.handlers.run_code import runner_for
    from rollbox.snapshots.language_builds import LanguageBuilds

    runner = runner_for(service.runtime)  # languages: their snapshots' state (GET /languages), built on first use
    # with S3: a language is built once for every replica (pushed there, used from there; docs/languages.md)
    runner.builds = LanguageBuilds(resolver.cache.local, remote=remote, claims=objects if remote is not None else None)
    runner.build_on_first_use = cfg.language_builds == "on"
    pushing: threading.Event | None = None
    if remote is not None:  # the language snapshots this home holds (a baked image's), for the other replicas
        pushing = threading.Event()
        threading.Thread(target=_push_languages, args=(runner.builds, pushing), name="rollbox-language-push",
                         daemon=True).start()
    return _Replica(rt=rt, service=service, snapshots=snapshots, durable=durable, recorder=recorder, remote=remote,
                    pushing=pushing)


def _push_languages(builds: Any, stop: threading.Event) -> None:
    """``LanguageBuilds.push_built`` on its own thread: the server listens meanwhile; each language's
    outcome is logged, and nothing it meets stops the server."""
    try:
        builds.push_built(stop)
    except Exception:
        logger.exception("pushing the language snapshots built here failed")


async def _serve(cfg: ServeConfig, replica: _Replica, sock: socket.socket, stop: asyncio.Event, home: Path) -> int:
    """Serve on ``sock`` until ``stop``, then drain: in-flight events finish (or get 503 after the
    grace period), live sandboxes hibernate, spooled rows are flushed, the listener closes."""
    import uvicorn
    from rollbox.functions.service.http_protocol import http_protocol

    service = replica.service
    server = _uvicorn_server(
        uvicorn.Config(
            service.asgi_app(),
            lifespan="off",
            ws="none",  # no WebSocket route: its protocol's modules (websockets, wsproto) are not loaded at start
            http=http_protocol(cfg.service.request_timeout_s,
                               lambda status: service.metrics.requests.labels("invalid", str(status)).inc()),
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=max(1, math.ceil(cfg.grace_s)),
            # longer than clients' and proxies' idle timeouts (httpx: 5 s, like uvicorn's default):
            # equal timeouts race, and a request sent as the server closes the connection is lost
            timeout_keep_alive=max(1, math.ceil(cfg.keep_alive_s)),
            limit_concurrency=None,
            backlog=4096,
        )
    )
    watch = asyncio.create_task(_watch_store(replica.remote, service)) if replica.remote is not None else None
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        if serving.done():
            serving.result()
            return 1
        _settle_gc()
        service.ready = True
        lifecycle.info("listening", extra={"fields": {
            "host": cfg.host, "port": sock.getsockname()[1], "pid": os.getpid(), "isolation": _isolation(replica.rt),
            "store": replica.snapshots.store_url, "home": str(home), "durability": cfg.durability}})
        await stop.wait()
        loop = asyncio.get_running_loop()
        t0, linger_until = loop.time(), time.monotonic() + cfg.drain_linger_s
        await _drain(cfg, replica)
        await _linger(service, linger_until)
        server.config.timeout_graceful_shutdown = max(1, math.ceil(cfg.grace_s - (loop.time() - t0)))
        server.should_exit = True
        await serving
    finally:
        if watch is not None:  # (not left to asyncio.run's end, which waits for ever on a lost cancel)
            with contextlib.suppress(Exception):
                await tasks.stop([watch])
    return 0


async def _linger(service: Service, until: float) -> None:
    """Keep the listener open after the drain while requests still come: until none came for
    LINGER_QUIET_S, or ``until`` (time.monotonic). A load balancer sends a replica requests until its
    next health check finds /readyz answering 503 (HAProxy's every 0.5 s in the local fleet); a replica
    whose drain took less (nothing running, nothing live) had closed its port by then, and those requests
    met a refused connection: the balancer's own 503, without Retry-After. Lingering, each gets the
    replica's 503 shutting_down with Retry-After. A replica nobody was sending to closes at once."""
    t0 = time.monotonic()
    while True:
        now = time.monotonic()
        quiet, left = now - service.last_request_at, until - now
        if quiet >= LINGER_QUIET_S or left <= 0:
            break
        await asyncio.sleep(min(LINGER_QUIET_S - quiet, left))
    if (lingered := time.monotonic() - t0) > 0.001:
        lifecycle.info("lingered", extra={"fields": {"s": round(lingered, 3)}})


async def _drain(cfg: ServeConfig, replica: _Replica) -> None:
    service = replica.service
    handed_back = service.admission.start_draining()  # the waiting ones: 503 + Retry-After, now
    lifecycle.info("draining", extra={"fields": {"running": service.admission.running, "handed_back": handed_back,
                                                 "grace_s": cfg.grace_s}})
    if not await service.admission.wait_idle(cfg.grace_s):
        lifecycle.warning("grace period over; cancelling in-flight events",
                          extra={"fields": {"inflight": service.admission.inflight}})
        service.abort()  # each gets a 503 event, not a dropped connection
        await service.admission.wait_idle(5.0)
    if replica.durable is not None:  # every acknowledged step is in the store: ending live copies loses nothing
        n = await replica.durable.hibernate_all("drain")
        lifecycle.info("hibernated", extra={"fields": {"sandboxes": n}})
    if replica.recorder is not None:  # every spooled row to the store before exit (kept in the spool if it fails)
        rows = await replica.recorder.close()
        replica.recorder = None
        lifecycle.info("flushed", extra={"fields": {"rows": rows}})


async def _prewarm(rt: Any, snapshot: str, remote_attached: asyncio.Event) -> None:
    t0 = asyncio.get_running_loop().time()
    try:
        try:
            await rt.prewarm(snapshot, count=1)
        except SnapshotNotFound:  # not in the local store: S3 may hold it, once attached
            if remote_attached.is_set():
                raise
            await remote_attached.wait()
            await rt.prewarm(snapshot, count=1)
    except Exception as exc:  # a missing snapshot, a store outage, a zygote that failed: served on demand
        why = exc.message if isinstance(exc, RollboxError) else f"{type(exc).__name__}: {exc}"
        lifecycle.warning(f"not prewarmed: {why}", extra={"fields": {"snapshot": snapshot}})
    else:
        took = asyncio.get_running_loop().time() - t0
        lifecycle.info("prewarmed", extra={"fields": {"snapshot": snapshot, "s": round(took, 3)}})


async def _watch_store(store: S3Store, service: Service, every_s: float = 5.0) -> None:
    """Keep ``service.store_ok`` current (``/readyz`` reports it): a replica that cannot commit steps
    should get none from the load balancer. Logs each change once."""
    calls = StoreCalls(1, every_s, name="rollbox-store-check")  # one thread: a hung check does not pile up
    while True:
        await asyncio.sleep(every_s)
        try:
            await calls.run(store.check, doing="checking the store")
            ok, why = True, ""
        except RollboxError as exc:
            ok, why = False, exc.message
        if ok != service.store_ok:
            (lifecycle.info if ok else lifecycle.warning)(
                "store reachable again" if ok else f"store unusable: {why}", extra={"fields": {"store": store.url}})
        service.store_ok = ok


LINGER_QUIET_S = 0.5  # after the drain, the listener closes once no request came for this long (_linger)
EXIT_STALL_S = 10.0  # after "stopped", joining what is left of the threads; longer is a stall

GC_THRESHOLD0 = 20_000  # container allocations (net) between young collections; CPython's default is 700


def _settle_gc() -> None:
    """Started: what the start made (the modules, the service, pydantic's and boto's tables: ~100k
    objects) lives as long as the process, so it leaves the collector's view (``gc.freeze``) and no
    full collection walks it again; and young collections run every ``GC_THRESHOLD0`` allocations, not
    700: a request's own objects are mostly gone by then. Both cut the collector's share of the event
    loop's CPU per request (~5 % of it, measured with perf); cycles are still collected."""
    gc.freeze()
    _, t1, t2 = gc.get_threshold()
    gc.set_threshold(GC_THRESHOLD0, t1, t2)


def _isolation(rt: Any) -> dict[str, str] | None:
    report = getattr(rt, "isolation_report", None)
    try:
        return dict(report()) if callable(report) else None
    except Exception:
        return None
