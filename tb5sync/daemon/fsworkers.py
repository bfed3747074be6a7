"""fs sessions served by worker processes (``serve --fs-workers N``): past one interpreter's GIL.

One process answers a tb5:// request in ~15 us of GIL held (py-spy ``--gil``, 4 KiB ``cat`` with
many in flight, ``benches/bench_fs.py``), so one server process cannot pass ~60,000 small
requests a second whatever its cores. With ``--fs-workers N`` the server starts N worker
processes; a connection that has passed everything the server checks before a session (``--allow``,
the token, the lockouts, ``--max-connections``, ``--max-sessions``, the handshake deadline) and
asks for an ``fs`` session is handed, its socket passed with ``SCM_RIGHTS`` over a
``socketpair(AF_UNIX, SOCK_STREAM)`` (8-byte session ids each way; a stream pair because macOS has
no ``SOCK_SEQPACKET`` Unix sockets), to a worker, which answers the session
(:func:`~tb5sync.daemon.services.serve_fs`: the same :class:`~tb5sync.daemon.fsops.FsOps`, its
path jail, read-only and write quota) until it ends, then tells the server. The server's
connection thread waits meanwhile, so the session still counts against the server's caps.

Which worker: the OPEN's ``group`` (a random id the client sends on every connection of one
filesystem instance) picks it (CRC-32 modulo N), so the connections of one client share one
worker's :class:`~tb5sync.daemon.fsops.Puts` and :class:`~tb5sync.daemon.fsops.Pages` (pieces of
one file on several connections, ``more`` after ``ls``), as they share the server's in one
process; an OPEN without ``group`` (an older client), over TLS (its state cannot be passed) or
with bytes read ahead past it is served in the server's process as before.

Stopping: the server closes its end of each pair; a worker then closes every connection it serves
(each session ends as a broken connection would end it: a put not closed leaves no file at its
final path, nor its temporary file) and exits; the server waits for it (then kills it). SIGTERM
to a worker (a service manager stopping the group) does the same. A worker that dies ends its
sessions as a broken connection; later sessions are served in the server's process. Workers
ignore SIGINT (the server stops them).

Portable path: needs ``socket.send_fds`` (Linux, macOS and the BSDs; checked when the server
starts); elsewhere, and with ``TB5SYNC_FS_WORKERS_PORTABLE=1``, every fs session
is served in the server's process (logged once).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import zlib
from typing import Any

from tb5sync._os import paths
from tb5sync._os.io import portable
from tb5sync._os.paths import Jail, claim_temp, is_temp_name, release_temp
from tb5sync.daemon.fsops import discard_temp
from tb5sync.errors import Tb5syncError
from tb5sync.wire.transport import Channel

__all__ = ["FsWorkers", "available", "PORTABLE_ENV"]

log = logging.getLogger(__name__)

#: Set to anything but 0: serve every fs session in the server's process (the portable path).
PORTABLE_ENV = "TB5SYNC_FS_WORKERS_PORTABLE"

#: The server's hand to a worker: a session id, the connection's descriptor on its first byte.
_MSG = struct.Struct("!Q")
#: A worker's note to the server: kind and payload length, then the payload: :data:`_DONE` (the
#: session id, :data:`_MSG`: that session ended), :data:`_CLAIM` / :data:`_RELEASE` (a temporary
#: file of a write that holds no descriptor between requests, its directory's components and its
#: name joined by NUL: the server claims it too, so its own stale-file sweep leaves it alone, and
#: removes it if the worker dies before releasing it).
_NOTE = struct.Struct("!BI")
_DONE, _CLAIM, _RELEASE = 0, 1, 2


def _note(kind: int, payload: bytes) -> bytes:
    return _NOTE.pack(kind, len(payload)) + payload


def _claim_path(where: Any, name: str) -> bytes:
    return "\0".join([*where, name]).encode("utf-8", "surrogateescape")


def _pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)


def _recv_hand(sock: socket.socket) -> tuple[int, list[int]] | None:
    """One hand from the server: (session id, descriptors passed with it); None at end of stream."""
    got = b""
    fds: list[int] = []
    while len(got) < _MSG.size:
        msg, more, _, _ = socket.recv_fds(sock, _MSG.size - len(got), 2)
        fds.extend(more)
        if not msg:
            for fd in fds:
                os.close(fd)
            return None
        got += msg
    return _MSG.unpack(got)[0], fds


def available() -> str | None:
    """None when fs sessions can be handed to worker processes here, else why not (one line)."""
    if portable(PORTABLE_ENV):
        return f"${PORTABLE_ENV} is set"
    if not hasattr(socket, "send_fds") or not hasattr(socket, "AF_UNIX"):
        return "this platform cannot pass a socket to another process (no send_fds)"
    try:
        a, b = _pair()
    except OSError as exc:
        return f"no Unix socket pairs: {exc}"
    a.close()
    b.close()
    return None


class _Worker:
    def __init__(self, index: int, config: dict[str, Any]) -> None:
        self.index = index
        self.root = config["root"]
        #: temporary files the worker claimed and has not released: (directory components, name)
        self.claims: set[tuple[tuple[str, ...], str]] = set()
        parent, child = _pair()
        self.sock = parent
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "from tb5sync.daemon.fsworkers import worker_main; worker_main()",
                 str(child.fileno()), json.dumps(config)],
                pass_fds=[child.fileno()], env=env, stdin=subprocess.DEVNULL)
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        self.lock = threading.Lock()
        self.waiting: dict[int, threading.Event] = {}
        self.dead = False
        self.closing = False
        self.reader = threading.Thread(target=self._read, name=f"tb5-fsworker-{index}", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        """The worker's ``done`` notes, until it closes its end (exits or dies)."""
        buf = b""
        try:
            while True:
                msg = self.sock.recv(4096)
                if not msg:
                    break
                buf += msg
                while len(buf) >= _NOTE.size:
                    kind, n = _NOTE.unpack_from(buf)
                    if len(buf) < _NOTE.size + n:
                        break
                    payload, buf = buf[_NOTE.size:_NOTE.size + n], buf[_NOTE.size + n:]
                    self._note(kind, payload)
        except (OSError, ValueError, struct.error) as exc:
            if not self.closing:
                log.warning("fs worker %d: %s", self.index, exc)
        with self.lock:
            self.dead = True
            left = list(self.waiting.values())
            self.waiting.clear()
        for ev in left:
            ev.set()
        self._remove_claimed()

    def _note(self, kind: int, payload: bytes) -> None:
        if kind == _DONE:
            (done,) = _MSG.unpack(payload)
            with self.lock:
                ev = self.waiting.pop(done, None)
            if ev is not None:
                ev.set()
            return
        *where, name = payload.decode("utf-8", "surrogateescape").split("\0")
        key = (tuple(where), name)
        if kind == _CLAIM:
            claim_temp(name)
            with self.lock:
                self.claims.add(key)
        elif kind == _RELEASE:
            with self.lock:
                self.claims.discard(key)
            release_temp(name)

    def _remove_claimed(self) -> None:
        """The worker is gone: its writes still claimed end as a broken connection ends them, their
        temporary files removed (through a jail of the root: never anything outside it)."""
        with self.lock:
            left, self.claims = self.claims, set()
        if not left:
            return
        try:
            jail = Jail(self.root)
        except (OSError, Tb5syncError) as exc:
            log.warning("fs worker %d: cannot remove its temporary files: %s", self.index, exc)
            return
        with jail:
            for where, name in left:
                if is_temp_name(name):
                    discard_temp(jail, where, name)
                else:
                    release_temp(name)


class FsWorkers:
    """``n`` worker processes answering fs sessions (see the module docstring).

    ``config``: what a worker needs to answer as the server would: ``root``, ``state_dir``
    (None: ROOT/.tb5sync), ``writable`` (its tree state), ``read_only``, ``max_session_bytes``,
    ``min_free_space`` (a session's :class:`~tb5sync.tree.quota.WriteQuota`), ``io_timeout``,
    ``idle_timeout`` (seconds or None). Thread-safe.

    Raises
    ------
    OSError
        A worker process could not be started (the ones started are stopped).
    """

    def __init__(self, n: int, config: dict[str, Any]) -> None:
        self._ids = iter(range(1, 1 << 62))
        self._lock = threading.Lock()
        #: connections handed to a worker so far
        self.handed = 0
        self.workers: list[_Worker] = []
        try:
            for i in range(n):
                self.workers.append(_Worker(i, config))
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers still running."""
        return [w.proc.pid for w in self.workers if w.proc.poll() is None]

    def serve(self, ch: Channel, group: str) -> bool:
        """Hand ``ch`` (its OPEN just read, nothing read past it) to the worker of ``group`` and wait
        until its session ends. False when it could not be handed (that worker is gone): the
        caller serves it. Once handed, ``ch`` is closed here (this process's descriptor only)."""
        w = self.workers[zlib.crc32(group.encode("utf-8", "surrogatepass")) % len(self.workers)]
        with self._lock:
            sid = next(self._ids)
            self.handed += 1
        ev = threading.Event()
        with w.lock:
            if w.dead:
                return False
            w.waiting[sid] = ev
        try:
            socket.send_fds(w.sock, [_MSG.pack(sid)], [ch.sock.fileno()])
        except OSError as exc:
            with w.lock:
                w.waiting.pop(sid, None)
            log.warning("fs worker %d: cannot hand it a connection: %s", w.index, exc)
            return False
        ch.closed = True  # the worker owns the connection now: close our descriptor, no shutdown
        ch.sock.close()
        ev.wait()
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Stop every worker: each closes its connections and exits (killed after ``timeout`` s)."""
        for w in self.workers:
            w.closing = True
            try:
                w.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            w.sock.close()
        for w in self.workers:
            try:
                w.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("fs worker %d did not stop within %.0f s; killing it", w.index, timeout)
                w.proc.kill()
                w.proc.wait()
            w.reader.join(5)


def _serve_one(ch: Channel, config: dict[str, Any], state: Any, pages: Any, puts: Any) -> None:
    from tb5sync.daemon.services import serve_fs
    from tb5sync.tree.quota import WriteQuota

    quota = WriteQuota(config["root"], config["max_session_bytes"], config["min_free_space"])
    try:
        serve_fs(ch, config["root"], state, config["read_only"], pages, quota if quota.active else None, puts)
    except (Tb5syncError, OSError) as exc:
        log.info("fs session ended: %s", exc)
        if not isinstance(exc, OSError) or isinstance(exc, Tb5syncError):
            ch.send_error(0, exc)
    except Exception as exc:  # a bug must not take the worker down
        log.exception("internal error in an fs session")
        ch.send_error(0, exc)


def worker_main() -> None:
    """A worker process: ``argv[1]`` its end of the socket pair, ``argv[2]`` the JSON config."""
    import tb5sync.wire.protocol as P
    from tb5sync.daemon.fsops import Pages, Puts
    from tb5sync.tree.state import TreeState

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server stops us
    logging.basicConfig(level=logging.WARNING, format="tb5sync fs worker: %(message)s")
    sock = socket.socket(fileno=int(sys.argv[1]))

    def stop(signum: int, frame: Any) -> None:
        # SIGTERM (a service manager stopping the whole group): stop as when the server stops us,
        # closing every session so that no write leaves its temporary file
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    signal.signal(signal.SIGTERM, stop)
    config = json.loads(sys.argv[2])
    state = TreeState(config["root"], writable=config["writable"], state_dir=config["state_dir"])
    pages, puts = Pages(), Puts()
    lock = threading.Lock()
    conns: dict[int, Channel] = {}
    threads: list[threading.Thread] = []
    send_lock = threading.Lock()

    def send(note: bytes) -> None:
        try:
            with send_lock:
                sock.sendall(note)
        except OSError:
            pass

    def done(sid: int) -> None:
        send(_note(_DONE, _MSG.pack(sid)))

    def forward_claim(claimed: bool, name: str, where: Any) -> None:
        send(_note(_CLAIM if claimed else _RELEASE, _claim_path(where, name)))

    paths.claim_listener = forward_claim

    def run(sid: int, ch: Channel) -> None:
        try:
            _serve_one(ch, config, state, pages, puts)
        finally:
            ch.close()
            with lock:
                conns.pop(sid, None)
            done(sid)

    try:
        while True:
            try:
                hand = _recv_hand(sock)
            except OSError:
                break
            if hand is None:
                break
            sid, fds = hand
            if len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                done(sid)
                continue
            ch = Channel(socket.socket(fileno=fds[0]))
            ch.hide_root = config["root"]
            ch.max_payload = P.MAX_PAYLOAD
            ch.max_decoded = P.SERVER_MAX_DECODED
            ch.set_io_timeout(config["io_timeout"])
            ch.idle_timeout = config["idle_timeout"]
            with lock:
                conns[sid] = ch
            t = threading.Thread(target=run, args=(sid, ch), name=f"tb5-fs-{sid}", daemon=True)
            threads = [x for x in threads if x.is_alive()]
            threads.append(t)
            t.start()
    finally:
        with lock:
            left = list(conns.values())
        for ch in left:  # each session ends as a broken connection ends it
            ch.close()
        for t in threads:
            t.join(5)
        state.close()
        sock.close()
