"""The control protocol between the supervisor, a zygote and a sandbox agent (stdlib only).

Every message is named here: ``Op`` lists them all, each with its typed frame below (TypedDicts: on
the wire a frame is the same JSON object it always was). Who sends what:

    supervisor -> zygote   ZygoteConfig (the first frame, no op), then SPAWN per sandbox
    zygote -> supervisor   WARM once, then SPAWNED or ERROR per spawn, EXITED per sandbox init reaped
    supervisor -> agent    EXEC, INJECT, KILL, SPARE, PRIME, PING, FREEZE, THAW
    agent -> supervisor    READY (or FAILED) once, then STARTED, EXIT, INJECTED, FROZEN, PONG

A step's end (the agent's EXIT) and a sandbox init's end (the zygote's EXITED) share one shape,
``ExitReport``. A filesystem diff is a list of ``DiffEntry`` (its wire form is compact: one-letter
keys, written and read here only). Fork view and scratch layer ids are made and parsed here too.

A frame is a 4-byte big-endian length and a JSON object; file descriptors ride with the frame's
bytes as SCM_RIGHTS (one sendmsg; the reader ties them to the frame those bytes belong to).
Everything a sandbox sends is untrusted: frames are size-capped and parsed as plain JSON only.
This module runs inside sandbox images under their own python (-I -S): stdlib only.
"""

from __future__ import annotations

import array
import dataclasses
import json
import os
import select
import socket
import struct
from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Any, Required, TypedDict, cast

MAX_FRAME_BYTES = 256 * 1024 * 1024
SANDBOX_FRAME_BYTES = 48 * 1024 * 1024  # what a sandbox may send in one frame (its read-back files)
HEADER = struct.Struct(">I")
_MAX_FDS = 8


class ProtocolError(Exception):
    pass


def _dumps(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def encode(obj: Mapping[str, Any], dumps: Callable[[Mapping[str, Any]], bytes] = _dumps) -> bytes:
    """A frame: its length, then ``obj`` as JSON (``dumps``: the supervisor's side passes a faster one)."""
    body = dumps(obj)
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return HEADER.pack(len(body)) + body


def send(sock: socket.socket, obj: Mapping[str, Any], fds: list[int] | tuple[int, ...] = ()) -> None:
    """Blocking send of one frame (used inside zygotes and agents)."""
    data = encode(obj)
    if fds:
        n = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        data = data[n:]
    if data:  # sendall(b"") still calls send(): EPIPE if the peer already read the frame and left
        sock.sendall(data)


class Reader:
    """Incremental frame parser. Passed fds are tied to the frame whose bytes they arrived with
    (the kernel ends a read right after a message that carries fds), so frames that arrive
    together never mix up their fds."""

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES, loads: Callable[[bytes], Any] = json.loads) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.loads = loads  # the supervisor's side parses with a faster one (runtime/channel.py)
        self.buf = bytearray()
        self.base = 0  # stream offset of buf[0]
        self.pending: list[tuple[int, list[int]]] = []  # (stream offset of the carrying byte, fds)
        self.last_fds: list[int] = []
        self.creds: tuple[int, int, int] | None = None  # (pid, uid, gid) of the latest sender, SO_PASSCRED

    def feed(self, data: bytes, ancdata: list[tuple[int, int, bytes]]) -> None:
        self.buf += data
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                a = array.array("i")
                a.frombytes(payload[: len(payload) - (len(payload) % a.itemsize)])
                self.pending.append((self.base + len(self.buf) - 1, list(a)))
            elif level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= 12:
                pid, uid, gid = struct.unpack_from("iII", payload)
                self.creds = (pid, uid, gid)

    def next(self) -> dict[str, Any] | None:
        if len(self.buf) < 4:
            return None
        (n,) = HEADER.unpack_from(self.buf)
        if n > self.max_frame_bytes:
            raise ProtocolError(f"peer announced a frame of {n} bytes")
        if len(self.buf) < 4 + n:
            return None
        body = bytes(self.buf[4 : 4 + n])
        start, end = self.base, self.base + 4 + n
        del self.buf[: 4 + n]
        self.base = end
        _close_all(self.last_fds)  # fds the caller did not take are not kept (a peer could pile them up)
        self.last_fds = [fd for off, fds in self.pending if start <= off < end for fd in fds]
        self.pending = [(off, fds) for off, fds in self.pending if off >= end]
        obj = self.loads(body)
        if not isinstance(obj, dict):
            raise ProtocolError("frame is not a JSON object")
        return obj

    def take_fds(self) -> list[int]:
        """The fds that came with the frame ``next()`` returned last."""
        fds, self.last_fds = self.last_fds, []
        return fds

    def close(self) -> None:
        """Close every received fd nobody took."""
        _close_all(self.last_fds)
        _close_all([fd for _, fds in self.pending for fd in fds])
        self.last_fds, self.pending = [], []


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def recv(sock: socket.socket, reader: Reader) -> dict[str, Any] | None:
    """Blocking receive of one frame; None at EOF."""
    while True:
        msg = reader.next()
        if msg is not None:
            return msg
        data, anc, _flags, _addr = sock.recvmsg(1 << 16, ANC_SPACE, RECV_FLAGS)
        if not data:
            return None
        reader.feed(data, anc)


ANC_SPACE = socket.CMSG_SPACE(_MAX_FDS * 4) + socket.CMSG_SPACE(12)
RECV_FLAGS = socket.MSG_CMSG_CLOEXEC  # received fds never cross an exec by accident


def wait(sock: socket.socket, wake_r: int) -> tuple[bool, bool]:
    """Block until ``sock`` is readable or a child exited (SIGCHLD wrote to ``wake_r``, the
    signal wakeup pipe). Returns (sock readable, children to reap); the wakeup pipe is drained."""
    while True:
        try:
            ready, _, _ = select.select([sock.fileno(), wake_r], [], [])
            break
        except InterruptedError:
            continue
    if wake_r in ready:
        try:
            while os.read(wake_r, 512):
                pass
        except BlockingIOError:
            pass
    return sock.fileno() in ready, wake_r in ready


# ----------------------------------------------------------------- messages


class Op(StrEnum):
    """What a frame is (its "op"). A StrEnum: on the wire each is its plain string."""

    SPAWN = "spawn"  # supervisor -> zygote: fork one sandbox (SpawnMsg)
    WARM = "warm"  # zygote -> supervisor: warmed up, ready to spawn (WarmMsg)
    SPAWNED = "spawned"  # zygote: a spawn's pid (SpawnedMsg)
    ERROR = "error"  # zygote: a spawn that failed (ErrorMsg)
    EXITED = "exited"  # zygote: a sandbox's init was reaped (ExitReport)
    EXEC = "exec"  # supervisor -> agent: run one step (ExecMsg)
    INJECT = "inject"  # supervisor -> agent: apply a filesystem diff (InjectMsg)
    KILL = "kill"  # supervisor -> agent: a step timed out, kill all but init (Bare)
    SPARE = "spare"  # supervisor -> agent: a step is near, fork a worker ahead (Bare)
    PRIME = "prime"  # supervisor -> agent: run the fork path once on nothing (Bare)
    PING = "ping"  # supervisor -> agent: answered PONG, in order (Bare)
    FREEZE = "freeze"  # supervisor -> agent: stop every other process; answered FROZEN (Bare)
    THAW = "thaw"  # supervisor -> agent: continue them; no answer (Bare)
    READY = "ready"  # agent: contained, with its upper layer's fd (ReadyMsg)
    FAILED = "failed"  # agent: containment failed (FailedMsg)
    STARTED = "started"  # agent: an inline step's program starts as init (StartedMsg)
    EXIT = "exit"  # agent: a step's worker ended, or the step was refused (ExitReport)
    INJECTED = "injected"  # agent: a diff applied, or why not (InjectedMsg)
    FROZEN = "frozen"  # agent: every other process is stopped (Bare)
    PONG = "pong"  # agent (Bare)


Message = dict[str, Any]  # a frame as read: check its op (``op_of``), then read it as its typed form


def op_of(msg: Mapping[str, Any]) -> str | None:
    """The op of a frame as read (untrusted: any value, or none)."""
    op = msg.get("op")
    return op if isinstance(op, str) else None


class Bare(TypedDict):
    op: Op


def bare(op: Op) -> Bare:
    """A frame that is its op alone (KILL, SPARE, PRIME, PING, FREEZE, THAW, FROZEN, PONG)."""
    return {"op": op}


class SpawnParams(TypedDict, total=False):
    """What a SPAWN asks for (the runtime's side: ``Runtime.restore``)."""

    layers: Required[list[str]]
    disk_bytes: Required[int]
    probe: bool  # read back what containment put in force, sent with READY
    nofile: int  # the rlimits (runtime.rlimit_params)
    fsize_bytes: int
    nproc: int
    data_bytes: int
    as_bytes: int
    nice: int
    userns: bool  # a user namespace is passed as the first fd after the socket
    netns: bool  # a network namespace is passed next (runtime/netns.py): joined, not made
    idmap: int  # its owner uid when the layers are idmapped onto it (0: not)
    idmapped: list[int]  # (the zygote's own: the fds of the idmapped lowers)


class SpawnMsg(SpawnParams, total=False):
    op: Required[Op]
    req: Required[int]  # the request's number, echoed in SPAWNED / ERROR


def spawn_msg(req: int, params: SpawnParams) -> SpawnMsg:
    return cast(SpawnMsg, {"op": Op.SPAWN, "req": req, **params})


class WarmMsg(TypedDict):
    op: Op
    python: str
    modules: dict[str, str]
    pid: int


class SpawnedMsg(TypedDict):
    op: Op
    req: int
    pid: int  # in the zygote's pid namespace


class ErrorMsg(TypedDict):
    op: Op
    req: int | None
    error: str


class ReadyMsg(TypedDict, total=False):
    op: Required[Op]
    probe: dict[str, Any]  # runtime/inside/probe.py's read-back, when asked for


class FailedMsg(TypedDict):
    op: Op
    error: str


class ExecMsg(TypedDict, total=False):
    op: Required[Op]
    env: Required[dict[str, str]]
    files: Required[dict[str, str]]
    read_files: Required[list[str]]
    binary: dict[str, list[Any]]  # path -> [base64, mode]: files as bytes, written after ``files``
    last: bool  # no step follows
    inline: bool  # the program becomes the sandbox's init
    spare: bool  # steps come fast: keep a spare worker
    code: str  # python source, or
    command: str  # a /bin/sh command


class StartedMsg(TypedDict):
    op: Op
    cpu_s: float  # the agent's own CPU before the program


class InjectMsg(TypedDict):
    op: Op
    entries: list[dict[str, Any]]  # DiffEntry.wire()
    whiteouts: list[str]
    opaque: list[str]


class InjectedMsg(TypedDict, total=False):
    op: Required[Op]
    error: str


class ExitReport(TypedDict, total=False):
    """How a process ended. EXIT: the agent's report of a step's worker (with its read-back files,
    or ``error``: the step was refused and nothing ran). EXITED: the zygote's report of a sandbox's
    init (with its ``pid``): nothing of the sandbox runs any more."""

    op: Required[Op]
    status: Required[int]  # a wait status
    cpu_s: float
    maxrss_bytes: int
    files: dict[str, str | None]
    alone: bool  # nothing of the step outlived it (EXIT)
    error: str  # EXIT: why the step did not run
    pid: int  # EXITED: the init's pid in the zygote's namespace


def exit_report(op: Op, status: int, cpu_s: float = 0.0, maxrss_bytes: int = 0, *,
                files: dict[str, str | None] | None = None, alone: bool | None = None, error: str | None = None,
                pid: int | None = None) -> ExitReport:
    """An EXIT or EXITED frame (the fields given; see ``ExitReport``)."""
    report: ExitReport = {"op": op, "status": status, "cpu_s": cpu_s, "maxrss_bytes": maxrss_bytes}
    if pid is not None:
        report["pid"] = pid
    if error is not None:
        report["error"] = error
    if files is not None:
        report["files"] = files
    if alone is not None:
        report["alone"] = alone
    return report


def init_ended(report: Mapping[str, Any]) -> bool:
    """The report is of the sandbox's init (EXITED): nothing of the sandbox runs any more."""
    return op_of(report) == Op.EXITED


@dataclasses.dataclass(frozen=True)
class ZygoteConfig:
    """The zygote's settings, the first frame it reads (and what it hands itself across a re-exec)."""

    rootless: bool
    staging: str  # its staging directory (mounts.prepare_zygote_view)
    skel: str  # the skeleton directory
    layer_root: str
    warm_layers: list[str]
    host_binds: list[str]
    host_masks: list[str]
    sys_path: list[str]
    imports: list[str]  # the warm recipe
    env: dict[str, str]
    seccomp: str  # the BPF program, base64
    runtime_dir: str  # this package's files (bound into the view for a re-exec)
    reexec: str | None = None  # the snapshot's own interpreter, inside its root, to re-execute as
    user_budgets: dict[str, int] = dataclasses.field(default_factory=dict)
    drop_sys_path: list[str] = dataclasses.field(default_factory=list)

    def wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def parse(cls, obj: Mapping[str, Any]) -> ZygoteConfig:
        return cls(**obj)


# ----------------------------------------------------------------- filesystem diffs


class Kind(StrEnum):
    """What a diff entry makes."""

    DIR = "d"
    FILE = "f"
    SYMLINK = "l"
    HARDLINK = "h"  # a hard link to an earlier entry's path


@dataclasses.dataclass(slots=True)
class DiffEntry:
    """One entry of a filesystem diff (an overlay upper directory, in walk order). A file's content
    is either in the memfd passed with the diff (``offset``, ``size``: a live diff) or named by its
    sha256 (``sha``, ``size``, and ``generation``, the record holding it inline, or None: a blob)."""

    path: str
    kind: Kind
    mode: int = 0  # DIR, FILE
    mtime: float = 0.0  # DIR, FILE
    link: str = ""  # SYMLINK: its target; HARDLINK: the earlier path it links to
    size: int = 0  # FILE
    offset: int = 0  # FILE in a live diff
    sha: str = ""  # FILE in a record
    generation: int | None = None  # FILE in a record

    def wire(self) -> dict[str, Any]:
        """The compact form sent to agents and kept in sandbox records."""
        if self.kind in (Kind.SYMLINK, Kind.HARDLINK):
            return {"p": self.path, "t": self.kind, "l": self.link}
        out: dict[str, Any] = {"p": self.path, "t": self.kind, "m": self.mode, "mt": self.mtime}
        if self.kind == Kind.FILE:
            if self.sha:
                out["sha"], out["n"] = self.sha, self.size
                if self.generation is not None:
                    out["g"] = self.generation
            else:
                out["o"], out["n"] = self.offset, self.size
        return out

    @classmethod
    def parse(cls, d: Mapping[str, Any]) -> DiffEntry:
        kind = Kind(d["t"])
        if kind in (Kind.SYMLINK, Kind.HARDLINK):
            return cls(d["p"], kind, link=d["l"])
        return cls(d["p"], kind, d["m"], d["mt"], size=d.get("n", 0), offset=d.get("o", 0), sha=d.get("sha", ""),
                   generation=d.get("g"))


@dataclasses.dataclass
class Diff:
    """A filesystem diff an agent applies (INJECT): entries in walk order, deleted paths, opaque
    directories (emptied first), and ``fd``, a memfd holding the files' contents (its holder closes
    it). ``frame``: its INJECT encoded once, sent to every child of a fork."""

    entries: list[DiffEntry]
    whiteouts: list[str]
    opaque: list[str]
    fd: int = -1
    frame: bytes | None = None

    def message(self) -> InjectMsg:
        return inject_msg(self.entries, self.whiteouts, self.opaque)


def inject_msg(entries: list[DiffEntry], whiteouts: list[str], opaque: list[str]) -> InjectMsg:
    return {"op": Op.INJECT, "entries": [e.wire() for e in entries], "whiteouts": whiteouts, "opaque": opaque}


def inject_entries(msg: Mapping[str, Any]) -> list[DiffEntry]:
    return [DiffEntry.parse(e) for e in msg.get("entries") or []]


# ----------------------------------------------------------------- fork ids

SCRATCH_PREFIX = "scratch-"
_FORK_SEP = "+"


def scratch_layer_id(owner: str, token: str) -> str:
    """The id of a fork's scratch layer (a large parent diff copied once): ``scratch-<owner>-<token>``
    (``owner``: the runtime that made it, so a later runtime can sweep what a dead one left)."""
    return f"{SCRATCH_PREFIX}{owner}-{token}"


def fork_view_id(parent_view_id: str, scratch: str) -> str:
    """The view id of a fork whose children stack ``scratch`` over their parent's view."""
    return f"{parent_view_id}{_FORK_SEP}{scratch}"


def split_fork_view_id(view_id: str) -> tuple[str, list[str]]:
    """(the base snapshot id, the scratch layers over it in the order they were stacked) of a view id."""
    base, *scratches = view_id.split(_FORK_SEP)
    return base, scratches


def is_view_of_scratch(view_id: str, scratch: str) -> bool:
    """``view_id`` is the view of a fork made over the scratch layer ``scratch``."""
    return view_id.endswith(_FORK_SEP + scratch)
