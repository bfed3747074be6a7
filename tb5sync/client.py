"""Client side of a session with one server: push, pull and ls over N parallel streams.

Blocking calls (threads do the parallel work); an async caller wraps them with
``asyncio.to_thread``.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from . import protocol as P
from .errors import ConnectError, RemoteProtocolError, SourceNotFoundError, Tb5syncError, UsageError
from ._paths import follow_slash
from .entry import DIR, FILE, LINK, Entry, kind_of, path_from_wire, path_to_wire, source_name
from .options import Failure, SyncOptions, SyncStats
from .sender import Sender
from ._parts import close_parts
from .messages import PUSH_CLIENT_METHODS
from .rpc import Requester, open_session, serve
from .transport import IO_TIMEOUT, Channel, dial
from .urls import Remote, parse_url, token_of

if TYPE_CHECKING:
    from .receiver import ProgressFn
    from .state import TreeState

# The receiver and the state store (sqlite3) are imported where a pull or a local sync needs
# them: a push's client, whose start-up is part of every no-change re-run, never does.

__all__ = ["Remote", "parse_url", "push", "pull", "ls", "bench_link", "local_state"]  # Remote, parse_url: urls', re-exported


def _connect(r: Remote, token: bytes | None, timeout: float | None, tls_ca: str | os.PathLike[str] | None) -> Channel:
    return dial(r.host, r.port, token, tls=r.tls, tls_ca=tls_ca, io_timeout=timeout)


def _open_streams(
    r: Remote, token: bytes | None, msg: dict[str, Any], streams: int, opened: Callable[[], None] | None = None,
    timeout: float | None = IO_TIMEOUT, tls_ca: str | os.PathLike[str] | None = None,
) -> tuple[list[Channel], dict[str, Any]]:
    """Open the session on a first stream, then join ``streams - 1`` more; ``opened()`` is called in between."""
    ch0 = _connect(r, token, timeout, tls_ca)
    chans = [ch0]
    try:
        resp = open_session(ch0, {**msg, "streams": streams})
        _check_known(r, msg, resp)
        if opened is not None:
            opened()
        sid = resp.get("session")
        for i in range(1, streams):
            c = _connect(r, token, timeout, tls_ca)
            chans.append(c)
            open_session(c, {"op": "join", "session": sid, "index": i})
    except BaseException:
        for c in chans:
            c.close()
        raise
    return chans, resp


def _check_known(r: Remote, msg: dict[str, Any], resp: dict[str, Any]) -> None:
    """Refuse a server that does not list, in its OPEN reply, every rsync option this sync sets
    (an older tb5sync would ignore it: a --max-delete ignored deletes everything). Raised before
    any request is served, so such a server changes nothing.

    Raises
    ------
    UsageError
        Naming the options and the server.
    """
    opts = msg.get("options")
    if not isinstance(opts, dict):
        return
    missing = SyncOptions.from_wire(opts).unknown_to(resp.get("options"))
    if missing:
        raise UsageError(f"the server at {r.host}:{r.port} does not support {', '.join(missing)} (an older tb5sync): "
                         "upgrade it, or leave the option out")


def default_state_dir(root: str) -> str | None:
    """The state directory of the local tree ``root`` in the user's cache directory
    (``platformdirs.user_cache_dir("tb5sync")/trees/DEV-INO``, keyed by ``root``'s device and
    inode), or None when ``root`` does not exist."""
    import platformdirs

    try:
        st = os.stat(root)
    except OSError:
        return None
    return os.path.join(platformdirs.user_cache_dir("tb5sync"), "trees", f"{st.st_dev:x}-{st.st_ino:x}")


def local_state(dest: str, dst: str, src_kind: str, writable: bool = True, state_dir: str | None = None) -> tuple[TreeState, str]:
    """The destination's state for a sync into ``dst`` landing at ``dest``; returns ``(state, prefix)``.

    The state root is the destination directory the user named (or its parent when a single
    file lands on a file path). Its state lives in ``state_dir`` when given, else in the user's
    cache directory (:func:`default_state_dir`): a local or pulled destination receives no
    ``.tb5sync`` directory, as rsync leaves nothing of its own there. Losing it costs speed only.
    """
    from .state import TreeState

    root = dst if (dest != dst or src_kind == DIR) else os.path.dirname(dst) or "."
    if writable:
        try:
            os.makedirs(root, exist_ok=True)
        except OSError:
            writable = False
    where = state_dir if state_dir is not None else default_state_dir(root)
    state = TreeState(root, writable=writable and where is not None, state_dir=where)
    rel = os.path.relpath(dest, root)
    return state, "" if rel == "." else rel


def pull(
    src: Remote,
    dst: str,
    options: SyncOptions,
    *,
    token: bytes | str | None = None,
    progress: ProgressFn | None = None,
    keep_state: bool = True,
    timeout: float | None = IO_TIMEOUT,
    tls_ca: str | os.PathLike[str] | None = None,
    state_dir: str | None = None,
) -> SyncStats:
    """Copy ``src`` (on a server) to the local path ``dst``; the local receiver drives.

    ``keep_state=False`` keeps the destination's scan cache and chunk index in
    memory (an interrupted large file is not resumable); otherwise they live in
    ``state_dir``, by default in the user's cache directory (see :func:`local_state`).
    ``token`` (else the URL's, else ``$TB5SYNC_TOKEN``) authenticates; ``timeout`` is the
    I/O timeout in seconds (see :func:`tb5sync.transport.dial`); ``tls_ca`` a CA file for
    ``tb5s://`` servers.

    Raises
    ------
    ConnectError, AuthError, VersionMismatchError, BusyError
        Reaching or authenticating with the server failed.
    LinkTimeoutError
        The server or the link stalled for ``timeout`` seconds.
    RemoteNotFoundError, PathError
        The source does not exist or is outside the server's root.
    DestinationError, IntegrityError, SourceChangedError
        See :meth:`Receiver.run`.
    """
    from .links import RemoteLink
    from .receiver import Receiver, dest_base

    chans, resp = _open_streams(src, token_of(token, src), {"op": "pull", "path": path_to_wire(src.path), "options": options.to_wire()},
                                options.streams, timeout=timeout, tls_ca=tls_ca)
    requester = Requester(chans)
    state = None
    try:
        kind = resp.get("kind")
        if kind not in (DIR, FILE, LINK):
            raise UsageError("server did not say what the source is")
        dst_abs = os.path.abspath(dst)
        dest = dest_base(dst_abs, dst.endswith("/"), source_name(src.path), str(kind))
        fresh = not os.path.lexists(dest)
        state, prefix = local_state(dest, dst_abs, str(kind), writable=keep_state and not options.dry_run, state_dir=state_dir)
        stats = Receiver(dest, RemoteLink(requester), options, state, prefix, progress, fresh_base=fresh).run()
        return _on_server(stats, "source")
    finally:
        requester.close(bye=True)
        if state is not None:
            state.close()


class _PushHandler:
    """Serves the server-side receiver's requests from our sender, and takes its final report."""

    def __init__(self, sender: Sender, progress: ProgressFn | None, total: int) -> None:
        self.sender = sender
        self.result: dict[str, Any] | None = None
        self.progress = progress
        self.total = total
        self.done = 0
        self._lock = threading.Lock()
        for name in ("tree", "entries", "chunk_list", "file_digests", "sub_chunks"):
            setattr(self, name, getattr(sender, name))

    def _tick(self, meta: dict[str, Any]) -> None:
        if self.progress is None:
            return
        raw = sum(p[0] for p in meta.get("parts", [])) + sum(f[0] for f in meta.get("files", []) if f)
        with self._lock:
            self.done += raw
            self.progress(self.done, self.total)

    def read_ranges(self, **kw: Any) -> tuple[dict[str, Any], list[Any]]:
        meta, parts = self.sender.read_ranges(**kw)
        try:
            self._tick(meta)
        except BaseException:
            close_parts(parts)  # a progress callback that raised must not leak the file
            raise
        return meta, parts

    def read_files(self, **kw: Any) -> tuple[dict[str, Any], list[Any]]:
        meta, parts = self.sender.read_files(**kw)
        self._tick(meta)
        return meta, parts

    def finish(self, **result: Any) -> dict[str, Any]:
        self.result = result
        stats = result.get("stats")
        if self.progress is not None and isinstance(stats, dict):
            # Only sent bytes were counted as they went; chunks the server already had are
            # known now: the transfer is complete at the size of what was written.
            done = max(int(stats.get("bytes_transferred") or 0), self.done)
            with self._lock:
                self.progress(done, done)
        return {}


def push(
    src: str,
    dst: Remote,
    options: SyncOptions,
    *,
    token: bytes | str | None = None,
    progress: ProgressFn | None = None,
    name: str | None = None,
    timeout: float | None = IO_TIMEOUT,
    tls_ca: str | os.PathLike[str] | None = None,
) -> SyncStats:
    """Copy the local path ``src`` to ``dst`` on a server; the server's receiver drives.

    ``name`` overrides the name the source gets inside a directory destination
    (default: ``src``'s own name, or "contents of" for a trailing slash).
    ``token``, ``timeout`` and ``tls_ca`` as for :func:`pull`.

    Raises
    ------
    SourceNotFoundError
        ``src`` does not exist (a ``RemoteNotFoundError`` too, as it was raised before).
    ConnectError, AuthError, ReadOnlyError, PathError, DestinationError, ...
        As reported by the connection or the server.
    """
    src_abs = os.path.abspath(src)
    if not os.path.lexists(src_abs):
        raise SourceNotFoundError(f"local source does not exist: {src}")
    src_abs = follow_slash(src_abs, src)  # "link/" is the directory it points to (rsync, POSIX)
    kind = kind_of(src_abs)
    sender = Sender(src_abs, options, zero_copy=True)  # its replies go out through sockets only
    handler = _PushHandler(sender, progress, 0)
    if progress is not None:
        tree = sender.scanned()
        handler.total = sum(row[3] for row in tree.summary()) + (tree.entries[0].size if kind == FILE else 0)
    msg = {
        "op": "push",
        "path": path_to_wire(dst.path),
        "name": None if (n := source_name(src) if name is None else name) is None else path_to_wire(n),
        "src_kind": kind,
        "dst_slash": dst.slash,
        "options": options.to_wire(),
    }
    try:
        # The scan starts once the session is open (the server then scans the destination at
        # the same time) and runs while the other streams join: started before, it would slow
        # the handshake's round trips (each waits for the GIL).
        chans, _ = _open_streams(dst, token_of(token, dst), msg, options.streams, sender.prepare, timeout, tls_ca)
    except BaseException:
        sender.close()
        raise
    errors: list[BaseException] = []

    def run(ch: Channel) -> None:
        try:
            serve(ch, handler, PUSH_CLIENT_METHODS)
        except BaseException as exc:
            errors.append(exc)
        finally:
            ch.close()

    threads = [threading.Thread(target=run, args=(c,), name="tb5-push", daemon=True) for c in chans]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sender.close()
    res = handler.result
    if res is None:
        if errors and isinstance(errors[0], Tb5syncError):
            raise errors[0]
        raise ConnectError(f"server closed the session without a result{': ' + str(errors[0]) if errors else ''}")
    if "error" in res:
        err = res["error"]
        raise P.error_from_body(err if isinstance(err, dict) else {})
    stats = res.get("stats")
    if not isinstance(stats, dict):
        raise ConnectError("server sent no statistics")
    fields = {k: v for k, v in stats.items()
              if k in SyncStats.__dataclass_fields__ and k not in ("extra", "failures", "skipped", "itemized")}
    itemized = stats.get("itemized", [])
    if not (isinstance(itemized, list) and all(isinstance(x, str) for x in itemized)):
        raise RemoteProtocolError("the server's itemized changes are malformed")
    # rsync's sending side shows a transferred file as sent: "<f", where the receiver shows ">f"
    fields["itemized"] = tuple("<" + x[1:] if x.startswith(">") else x for x in itemized)
    skipped = stats.get("skipped", [])
    if not (isinstance(skipped, list) and all(isinstance(x, dict) and isinstance(x.get("path"), str) and isinstance(x.get("what"), str) for x in skipped)):
        raise RemoteProtocolError("the server's skipped entries are malformed")
    failures = stats.get("failures", [])
    if not isinstance(failures, list):
        raise RemoteProtocolError("the server's failures are not a list")
    try:
        fails = tuple(Failure.from_wire(f) for f in failures)
    except UsageError as exc:
        raise RemoteProtocolError(f"malformed failure from the server: {exc}") from exc
    changes = res.get("changes")
    extra: dict[str, Any] = {}
    if isinstance(changes, dict):
        try:
            extra["changes"] = {str(k): [path_from_wire(p) for p in v] for k, v in changes.items()}
        except (UsageError, TypeError) as exc:
            raise RemoteProtocolError("malformed changes from the server") from exc
    skips = tuple((x["path"], x["what"]) for x in skipped)
    return _on_server(SyncStats(**fields, failures=fails, skipped=skips, extra=extra), "destination")


def _on_server(stats: SyncStats, side: str) -> SyncStats:
    """``stats`` with its failures of ``side`` (the server's side of the session) marked ``server=True``."""
    if not any(f.side == side for f in stats.failures):
        return stats
    marked = tuple(dataclasses.replace(f, server=True) if f.side == side else f for f in stats.failures)
    return dataclasses.replace(stats, failures=marked)


def ls(
    url: Remote, *, token: bytes | str | None = None, timeout: float | None = IO_TIMEOUT,
    tls_ca: str | os.PathLike[str] | None = None,
) -> list[Entry]:
    """One directory level (or the single entry) at ``url``; the first entry (path ``""``) is the path itself.

    ``token``, ``timeout`` and ``tls_ca`` as for :func:`pull`.

    Raises
    ------
    ConnectError, AuthError, PathError, RemoteNotFoundError
    """
    ch = _connect(url, token_of(token, url), timeout, tls_ca)
    try:
        resp = open_session(ch, {"op": "ls", "path": path_to_wire(url.path)})
    finally:
        ch.close()
    return [Entry.from_wire(e) for e in resp.get("entries", [])]


def bench_link(host: str, port: int, *, token: bytes | str | None = None, seconds: float = 2.0) -> Iterator[str]:
    """Link test against a server: round-trip time, then raw TCP throughput per stream count.

    Yields one human-readable line per measurement. Raw throughput uses the
    server's ``source`` op: DATA frames of zeros, no disk and no hashing, so it
    shows what the link and the framing can carry.

    Raises
    ------
    ConnectError, AuthError
    """
    import statistics
    import time

    tok = token_of(token)
    ch = dial(host, port, tok)
    try:
        open_session(ch, {"op": "ping"})
        req = Requester([ch])
        rtts = []
        deadline = time.perf_counter() + min(seconds, 1.0)
        while time.perf_counter() < deadline or len(rtts) < 10:
            t = time.perf_counter()
            req.call("ping", {})
            rtts.append(time.perf_counter() - t)
        req.close(bye=True)
    finally:
        ch.close()
    yield f"rtt: median {statistics.median(rtts) * 1e6:.0f} us over {len(rtts)} round trips"
    for streams in (1, 2, 4, 8):
        # size the transfer from a short probe so each measurement lasts about `seconds`
        per = 256 * 1024 * 1024
        chans = []
        try:
            for _ in range(streams):
                c = dial(host, port, tok)
                chans.append(c)
            got = [0] * streams
            t0 = time.perf_counter()
            threads = []

            def drain(i: int, c: Channel) -> None:
                open_session(c, {"op": "source", "bytes": per})
                while True:
                    fr = c.recv_frame()
                    if fr is None or fr[0].type.name == "BYE":
                        return
                    got[i] += fr[0].length

            for i, c in enumerate(chans):
                t = threading.Thread(target=drain, args=(i, c), daemon=True)
                t.start()
                threads.append(t)
            for t in threads:
                t.join()
            dt = time.perf_counter() - t0
        finally:
            for c in chans:
                c.close()
        yield f"raw TCP, {streams} stream{'s' if streams > 1 else ''}: {sum(got) / dt / 1e9:.2f} GB/s ({_fmt(sum(got))} in {dt:.2f} s)"


def _fmt(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"
