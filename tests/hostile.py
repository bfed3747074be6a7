"""A hand-made hostile tb5sync server for the client's own checks (issue 21).

Built from the product's own frames (``tb5sync.wire.protocol``, ``transport``, ``rpc``): it
listens on 127.0.0.1 port 0, runs the server side of the handshake, answers OPEN and then serves
requests with a *handler* the test chooses -- by default a real :class:`Sender` over a tree of
the test's, made with whatever options the server likes (it ignores the client's), with any
method overridden to send what an honest server never would. Nothing of the client is mocked.

Use as a context manager; leaving it stops the accept loop and closes every connection.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import threading
from collections.abc import Callable
from typing import Any

import tb5sync.wire.protocol as P
from tb5sync.roles.sender import Sender
from tb5sync.tree.options import SyncOptions, known_options
from tb5sync.wire.messages import SENDER_METHODS
from tb5sync.wire.rpc import serve
from tb5sync.wire.transport import Channel, server_handshake

#: ``opened(msg) -> (reply, handler)``: what the server answers to an OPEN and who serves the rest
Opener = Callable[[dict[str, Any]], "tuple[dict[str, Any], Any]"]


def lying_sender(base: str, options: SyncOptions = SyncOptions(), **overrides: Callable[..., Any]) -> Opener:
    """An opener serving ``base`` with a real Sender made with ``options`` (not the client's),
    its methods replaced by ``overrides`` (``entries=lambda sender, dirs, skip=0: {...}``)."""

    def opened(msg: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        sender = Sender(base, options)
        sender.prepare()
        for name, fn in overrides.items():
            setattr(sender, name, (lambda f: lambda *a, **kw: f(sender, *a, **kw))(fn))
        return {"kind": sender.kind, "options": known_options()}, sender

    return opened


class HostileServer:
    """A server on 127.0.0.1:``port`` answering pull (and join) OPENs with ``opener``; other ops
    get ``other(ch, msg)`` when given (it writes what it likes), else an ERROR."""

    def __init__(self, opener: Opener, other: Callable[[Channel, dict[str, Any]], None] | None = None) -> None:
        self.opener = opener
        self.other = other
        self.lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(16)
        self.port = self.lsock.getsockname()[1]
        self._sessions: dict[str, Any] = {}
        self._chans: list[Channel] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._accept = threading.Thread(target=self._loop, name="hostile-accept", daemon=True)

    def url(self, path: str = "") -> str:
        return f"tb5://127.0.0.1:{self.port}/{path}"

    def __enter__(self) -> HostileServer:
        self._accept.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self.lsock.shutdown(socket.SHUT_RDWR)
        self.lsock.close()
        with self._lock:
            chans = list(self._chans)
        for ch in chans:
            ch.close()
        self._accept.join(5)
        for t in self._threads:
            t.join(5)
        assert not self._accept.is_alive() and not any(t.is_alive() for t in self._threads), "the hostile server hung"

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.lsock.accept()
            except OSError:
                return
            t = threading.Thread(target=self._conn, args=(conn,), name="hostile-conn", daemon=True)
            self._threads.append(t)
            t.start()

    def _conn(self, conn: socket.socket) -> None:
        ch = Channel(conn, io_timeout=10)
        with self._lock:
            self._chans.append(ch)
        try:
            server_handshake(ch, None)
            ch.max_payload = P.MAX_PAYLOAD
            got = ch.recv_frame()
            if got is None:
                return
            msg = P.decode_control(got[1])
            if msg.get("op") == "join":
                handler = self._sessions[msg["session"]]
                ch.send_control(P.FrameType.RESPONSE, 0, {})
            elif msg.get("op") == "pull":
                reply, handler = self.opener(msg)
                sid = secrets.token_hex(8)
                self._sessions[sid] = handler
                ch.send_control(P.FrameType.RESPONSE, 0, {"session": sid, **reply})
            elif self.other is not None:
                self.other(ch, msg)
                return
            else:
                ch.send_control(P.FrameType.ERROR, 0, {"kind": "usage", "message": "not here"})
                return
            serve(ch, handler, SENDER_METHODS)
        except Exception:  # the client hung up, or refused what it got: the server's end
            pass
        finally:
            ch.close()


# ---- a hostile store server ------------------------------------------------------------------


class LyingStore:
    """Answers a store session's requests (``refs``, ``ref``, ``have``, ``chunks``) with one ref
    ``name`` whose manifest is the raw bytes ``manifest`` (msgpack the test crafted, cut into
    chunks of ``cut`` bytes), plus the file chunks ``blobs``; ``mchunks`` overrides the manifest's
    announced chunk list (a ref claiming a huge manifest)."""

    def __init__(self, name: str, manifest: bytes, blobs: list[bytes] = (), cut: int = 1 << 20,  # type: ignore[assignment]
                 mchunks: list[tuple[bytes, int]] | None = None) -> None:
        from tb5sync.engine.hashing import chunk_digest, file_digest, refs_to_blob

        self.data: dict[bytes, bytes] = {}
        parts = [manifest[i : i + cut] for i in range(0, len(manifest), cut)] or [b""]
        refs = []
        for p in parts:
            d = chunk_digest(p)
            self.data[d] = p
            refs.append((d, len(p)))
        for b in blobs:
            self.data[chunk_digest(b)] = b
        if mchunks is not None:
            refs = mchunks
        self.asked: list[bytes] = []
        self.ref_wire = [name, file_digest(d for d, _ in refs), refs_to_blob(refs), 1.0e9, 0, 0, None, False]
        self.name = name

    def refs(self, prefix: str = "") -> dict[str, Any]:
        return {"refs": [self.ref_wire] if self.name.startswith(prefix) else []}

    def ref(self, name: str) -> dict[str, Any]:
        if name != self.name:
            from tb5sync.errors import RefNotFoundError

            raise RefNotFoundError(f"no ref {name!r}")
        return {"ref": self.ref_wire}

    def have(self, digests: list[bytes], lease: str | None = None) -> dict[str, Any]:
        return {"have": [d in self.data for d in digests]}

    def chunks(self, digests: list[bytes]) -> tuple[dict[str, Any], list[Any]]:
        self.asked += digests
        parts = [self.data[d] for d in digests]
        return {"lengths": [len(p) for p in parts]}, parts


def store_server(ops: Any) -> HostileServer:
    """A hostile server whose store sessions are answered by ``ops`` (a :class:`LyingStore`)."""
    from tb5sync.wire.messages import STORE_METHODS

    def other(ch: Channel, msg: dict[str, Any]) -> None:
        if msg.get("op") != "store":
            ch.send_control(P.FrameType.ERROR, 0, {"kind": "usage", "message": "not here"})
            return
        ch.send_control(P.FrameType.RESPONSE, 0, {"read_only": True})
        try:
            serve(ch, ops, STORE_METHODS)
        except Exception:
            pass

    return HostileServer(lambda msg: ({}, None), other=other)


def raw_manifest(entries: list[list[Any]]) -> bytes:
    """Manifest bytes (format v1) holding ``entries`` as given: unsorted, duplicated, unsafe."""
    import msgpack

    return msgpack.packb({"v": 1, "entries": entries}, use_bin_type=True)


def file_entry(path: bytes, data: bytes, mode: int = 0o644) -> list[Any]:
    """A manifest entry of a one-chunk file holding ``data``."""
    from tb5sync.engine.hashing import chunk_digest, file_digest, refs_to_blob

    d = chunk_digest(data)
    return [path, "f", mode, len(data), 1_000_000_000_000_000_000, None, file_digest([d]), refs_to_blob([(d, len(data))])]


def dir_entry(path: bytes) -> list[Any]:
    return [path, "d", 0o755, 0, 1_000_000_000_000_000_000, None, None, b""]


def link_entry(path: bytes, target: bytes) -> list[Any]:
    return [path, "l", 0o777, len(target), 1_000_000_000_000_000_000, target, None, b""]


# ---- a hostile fs server (tb5:// through fsspec) ----------------------------------------------


class LyingFs:
    """A real :class:`~tb5sync.daemon.fsops.FsOps` over ``root`` (read-only) whose ``ls``/``find``
    replies also list each name of ``extra`` (as given: ``..``, absolute, control characters),
    every one served (``info``, ``cat``) as the real file ``as_file`` so a client that trusts the
    listing would write it where the name leads."""

    def __init__(self, root: str, extra: list[str], as_file: str) -> None:
        from tb5sync.daemon.fsops import FsOps
        from tb5sync.tree.state import TreeState

        self.ops = FsOps(root, TreeState(root, writable=False), read_only=True)
        self.extra, self.as_file = extra, as_file

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ops, name)

    def _map(self, path: str) -> str:
        return self.as_file if path in self.extra else path

    def _fake(self, name: str) -> dict[str, Any]:
        info = dict(self.ops.info(self.as_file)["info"])
        info["name"] = name
        return info

    def info(self, path: str) -> dict[str, Any]:
        return {"info": self._fake(path)} if path in self.extra else self.ops.info(path)

    def cat(self, path: str, start: int | None = None, end: int | None = None, expect: dict[str, Any] | None = None) -> Any:
        return self.ops.cat(self._map(path), start, end, expect)

    def cat_many(self, items: list[Any]) -> Any:
        return self.ops.cat_many([[self._map(i[0]), *i[1:]] for i in items])

    def ls(self, path: str) -> dict[str, Any]:
        got = self.ops.ls(path)
        return {"entries": got["entries"] + [self._fake(n) for n in self.extra], "more": None}

    def find(self, path: str, maxdepth: int | None = None, withdirs: bool = False) -> dict[str, Any]:
        got = self.ops.find(path, maxdepth, withdirs)
        return {"entries": got["entries"] + [self._fake(n) for n in self.extra], "more": None}


def fs_server(ops: Any) -> HostileServer:
    """A hostile server whose fs sessions are answered by ``ops`` (a :class:`LyingFs`)."""
    from tb5sync.daemon.fsops import args_from_wire
    from tb5sync.wire.messages import FS_DATA_METHODS, FS_METHODS

    def other(ch: Channel, msg: dict[str, Any]) -> None:
        if msg.get("op") != "fs":
            ch.send_control(P.FrameType.ERROR, 0, {"kind": "usage", "message": "not here"})
            return
        ch.send_control(P.FrameType.RESPONSE, 0, {"read_only": True, "pieces": True})
        try:
            serve(ch, ops, FS_METHODS, args_from_wire, data_methods=FS_DATA_METHODS)
        except Exception:
            pass

    return HostileServer(lambda msg: ({}, None), other=other)
