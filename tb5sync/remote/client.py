"""Client side of a session with one server: push, pull and ls over N parallel streams.

Blocking calls (threads do the parallel work); an async caller wraps them with
``asyncio.to_thread``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import tb5sync.wire.protocol as P
from tb5sync.errors import ConnectError, RemoteProtocolError, SourceNotFoundError, Tb5syncError, UsageError, closed_mid_transfer
from tb5sync._os.paths import follow_slash
from tb5sync.tree.entry import DIR, FILE, LINK, Entry, kind_of, path_from_wire, path_to_wire, source_name
from tb5sync.tree.options import Failure, SyncOptions, SyncStats
from tb5sync.roles.sender import Sender
from tb5sync.wire.parts import close_parts
from tb5sync.wire.messages import PUSH_CLIENT_METHODS, ResultPages
from tb5sync.wire.protocol import FrameType, decode_data
from tb5sync.wire.rpc import Requester, open_session, reply_of, serve
from tb5sync.wire.transport import IO_TIMEOUT, Channel, dial, host_port
from tb5sync.wire.urls import Remote, parse_url, token_of

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from tb5sync.roles.receiver import ProgressFn
    from tb5sync.tree.state import TreeState

#: Bytes per DATA frame of a ``sink`` session (raw TCP test, client to server).
_BENCH_BLOCK = 4 * 1024 * 1024

# The receiver and the state store (sqlite3) are imported where a pull or a local sync needs
# them: a push's client, whose start-up is part of every no-change re-run, never does.

__all__ = ["Remote", "parse_url", "push", "pull", "ls", "bench_link", "measure_rtt", "measure_tcp", "local_state"]  # Remote, parse_url: urls', re-exported


def _connect(r: Remote, token: bytes | None, timeout: float | None, tls_ca: str | os.PathLike[str] | None) -> Channel:
    return dial(r.host, r.port, token, tls=r.tls, tls_ca=tls_ca, io_timeout=timeout, family=r.family)


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
        Naming the options (their rsync flags) and the server.
    """
    opts = msg.get("options")
    if not isinstance(opts, dict):
        return
    missing = SyncOptions.from_wire(opts).unknown_to(resp.get("options"))
    if missing:
        raise UsageError(f"the server at {host_port(r.host, r.port)} does not support {', '.join(missing)}: upgrade tb5sync there "
                         "(an older version would ignore it), or leave the option out")


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
    from tb5sync.tree.state import TreeState

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
    max_entries: int | None = None,
    max_listing_bytes: int | None = None,
) -> SyncStats:
    """Copy ``src`` (on a server) to the local path ``dst``; the local receiver drives.

    The server's listing is bounded here as a server bounds a pushing client's: at most
    ``max_entries`` entries (directories and entries together) and ``max_listing_bytes`` bytes
    held (:class:`~tb5sync.roles.generator.ListingLimits`); None: the server's defaults
    (:data:`~tb5sync.wire.messages.MAX_ENTRIES`, :data:`~tb5sync.wire.messages.MAX_LISTING_BYTES`).

    ``keep_state=False`` keeps the destination's scan cache and chunk index in
    memory (an interrupted large file is not resumable); otherwise they live in
    ``state_dir``, by default in the user's cache directory (see :func:`local_state`).
    ``token`` (else the URL's, else ``$TB5SYNC_TOKEN``) authenticates; ``timeout`` is the
    I/O timeout in seconds (see :func:`tb5sync.wire.transport.dial`); ``tls_ca`` a CA file for
    ``tb5s://`` servers.

    Raises
    ------
    ConnectError, AuthError, VersionMismatchError, BusyError
        Reaching or authenticating with the server failed.
    LinkTimeoutError
        The server or the link stalled for ``timeout`` seconds.
    ConnectionClosedError
        The server closed the connection mid-transfer (exit 12).
    RemoteNotFoundError, PathError
        The source does not exist or is outside the server's root.
    DestinationError, IntegrityError, SourceChangedError
        See :meth:`Receiver.run`.
    PeerLimitError
        The server's listing goes past ``max_entries`` or ``max_listing_bytes`` (exit 12;
        nothing was written).
    """
    from tb5sync.remote.links import RemoteLink
    from tb5sync.roles.generator import ListingLimits
    from tb5sync.roles.receiver import Receiver, dest_base, follow_dest_link, prepare_dest_dir

    d = ListingLimits()
    limits = ListingLimits(d.entries if max_entries is None else max_entries,
                           d.nbytes if max_listing_bytes is None else max_listing_bytes,
                           f"the server at {host_port(src.host, src.port)}")

    chans, resp = _open_streams(src, token_of(token, src), {"op": "pull", "path": path_to_wire(src.path), "options": options.to_wire()},
                                options.streams, timeout=timeout, tls_ca=tls_ca)
    requester = Requester(chans)
    state = None
    try:
        kind = resp.get("kind")
        if kind not in (DIR, FILE, LINK):
            raise UsageError("server did not say what the source is")
        dst_abs = follow_dest_link(os.path.abspath(dst))  # its state too is the directory's
        dest = dest_base(dst_abs, dst.endswith("/"), source_name(src.path), str(kind))
        created = prepare_dest_dir(dst_abs, dst, dst.endswith("/"), str(kind), mkpath=options.mkpath, dry_run=options.dry_run)
        fresh = not os.path.lexists(dest)
        state, prefix = local_state(dest, dst_abs, str(kind), writable=keep_state and not options.dry_run, state_dir=state_dir)
        stats = Receiver(dest, RemoteLink(requester), options, state, prefix, progress, fresh_base=fresh, listing_limits=limits).run()
        return _on_server(dataclasses.replace(stats, created=created), "source")
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
        self.pages = ResultPages()
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

    def finish_part(self, section: object = None, key: object = None, items: object = None) -> dict[str, Any]:
        """One page of a long result (:func:`tb5sync.wire.messages.result_pages`), ahead of ``finish``."""
        with self._lock:
            self.pages.add(section, key, items)
        return {}

    def finish(self, **result: Any) -> dict[str, Any]:
        with self._lock:
            result = self.pages.merge(result)
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
        As reported by the connection or the server; ``ConnectionClosedError`` (exit 12) when the
        server closed the connection mid-transfer.
    """
    src_abs = os.path.abspath(src)
    if not os.path.lexists(src_abs):
        raise SourceNotFoundError(f"local source does not exist: {src}")
    src_abs = follow_slash(src_abs, src, follow=options.copy_links)  # "link/" is the directory it points to (rsync, POSIX)
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
        raise closed_mid_transfer("server", errors[0] if errors else None)
    if "error" in res:
        err = res["error"]
        raise P.error_from_body(err if isinstance(err, dict) else {})
    stats = res.get("stats")
    if not isinstance(stats, dict):
        raise ConnectError("server sent no statistics")
    fields = {k: v for k, v in stats.items()
              if k in SyncStats.__dataclass_fields__ and k not in ("extra", "failures", "skipped", "itemized", "warnings", "created")}
    itemized = stats.get("itemized", [])
    if not (isinstance(itemized, list) and all(isinstance(x, str) for x in itemized)):
        raise RemoteProtocolError("the server's itemized changes are malformed")
    # rsync's sending side shows a transferred file as sent: "<f", where the receiver shows ">f"
    fields["itemized"] = tuple("<" + x[1:] if x.startswith(">") else x for x in itemized)
    warnings = stats.get("warnings", [])  # absent from an older server's statistics
    if not (isinstance(warnings, list) and all(isinstance(x, str) for x in warnings)):
        raise RemoteProtocolError("the server's warnings are malformed")
    for w in warnings:  # the server's warning, shown here as a local run shows it
        log.warning("%s", w)
    fields["warnings"] = tuple(warnings)
    created = stats.get("created", [])  # absent from an older server's statistics
    if not (isinstance(created, list) and all(isinstance(x, str) for x in created)):
        raise RemoteProtocolError("the server's created-directory lines are malformed")
    fields["created"] = tuple(created)
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


def _rate(nbytes: int, seconds: float) -> float:
    """Bytes per second (0 for no time)."""
    return nbytes / seconds if seconds > 0 else 0.0


def measure_rtt(r: Remote, token: bytes | None, pings: int, timeout: float | None = IO_TIMEOUT,
                tls_ca: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """``pings`` round trips of the ``ping`` request: ``{"count", "median_us", "p99_us", "min_us"}`` (microseconds)."""
    ch = _connect(r, token, timeout, tls_ca)
    try:
        open_session(ch, {"op": "ping"})
        req = Requester([ch])
        try:
            rtts = []
            for _ in range(pings):
                t = time.perf_counter()
                req.call("ping", {})
                rtts.append((time.perf_counter() - t) * 1e6)
        finally:
            req.close(bye=True)
    finally:
        ch.close()
    import statistics  # here, not at the top: every CLI start imports this module (statistics costs ~3 ms)

    rtts.sort()
    p99 = rtts[min(len(rtts) - 1, max(0, -(-99 * len(rtts) // 100) - 1))]
    return {"count": len(rtts), "median_us": statistics.median(rtts), "p99_us": p99, "min_us": rtts[0]}


def measure_tcp(r: Remote, token: bytes | None, streams: int, nbytes: int, direction: str,
                timeout: float | None = IO_TIMEOUT, tls_ca: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Raw throughput over ``streams`` connections, ``nbytes`` in all: ``direction`` ``"down"``
    (server to client, ``source`` sessions) or ``"up"`` (``sink`` sessions).

    Returns ``{"streams", "direction", "bytes", "seconds", "bytes_per_s"}``; the time runs from
    the moment every stream is open to the last byte (down) or the server's receipt (up).
    """
    per = max(1, nbytes // streams)
    chans: list[Channel] = []
    errors: list[BaseException] = []
    got = [0] * streams
    start = threading.Barrier(streams + 1)
    zeros = memoryview(bytes(_BENCH_BLOCK))

    def down(i: int, c: Channel) -> None:
        while True:
            fr = c.recv_frame()
            if fr is None:
                raise closed_mid_transfer("server")
            if fr[0].type is FrameType.BYE:
                return
            if fr[0].type is not FrameType.DATA:
                reply_of(*fr)  # raises the server's error
                raise RemoteProtocolError(f"source stream: expected DATA, got {fr[0].type.name}")
            got[i] += len(decode_data(fr[1])[1])

    def up(i: int, c: Channel) -> None:
        left = per
        while left:
            n = min(left, _BENCH_BLOCK)
            c.send_data(0, {}, [zeros[:n]])
            left -= n
        body = open_session_reply(c)
        got[i] = int(body.get("bytes", 0))

    def run(i: int, c: Channel) -> None:
        try:
            start.wait()
            (down if direction == "down" else up)(i, c)
        except BaseException as exc:  # reported after the join
            errors.append(exc)

    if direction not in ("down", "up"):
        raise UsageError(f"direction must be 'down' or 'up', not {direction!r}")
    try:
        for _ in range(streams):
            c = _connect(r, token, timeout, tls_ca)
            chans.append(c)
            open_session(c, {"op": "source" if direction == "down" else "sink", "bytes": per})
        threads = [threading.Thread(target=run, args=(i, c), name="tb5-bench", daemon=True) for i, c in enumerate(chans)]
        for t in threads:
            t.start()
        start.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        dt = time.perf_counter() - t0
    finally:
        for c in chans:
            c.close()
    if errors:
        raise errors[0]
    total = sum(got)
    return {"streams": streams, "direction": direction, "bytes": total, "seconds": dt, "bytes_per_s": _rate(total, dt)}


def open_session_reply(ch: Channel) -> dict[str, Any]:
    """The next RESPONSE on ``ch`` (the ``sink`` session's final count), or the server's error."""
    fr = ch.recv_frame()
    if fr is None:
        raise closed_mid_transfer("server")
    header, payload = fr
    if header.type not in (FrameType.RESPONSE, FrameType.ERROR):
        raise RemoteProtocolError(f"expected RESPONSE, got {header.type.name}")
    body: dict[str, Any] = reply_of(header, payload)
    return body


def bench_link(host: str, port: int, *, token: bytes | str | None = None, seconds: float = 2.0) -> Iterator[str]:
    """Link test against a server: round-trip time, then raw TCP throughput from the server per
    stream count (1, 2, 4, 8). ``tb5sync bench`` (:mod:`tb5sync.api.bench`) measures more.

    Yields one human-readable line per measurement. ``seconds``: the round trips go on for at
    most that long (and at least 10); each throughput measurement moves 256 MiB per stream.

    Raises
    ------
    ConnectError, AuthError
    """
    r = Remote(host, port, "")
    tok = token_of(token)
    pings = 10
    t = time.perf_counter()
    rtt = measure_rtt(r, tok, pings)
    per_ping = (time.perf_counter() - t) / pings
    more = int(max(0.0, min(seconds, 1.0) - per_ping * pings) / max(per_ping, 1e-6))
    if more:
        rtt = measure_rtt(r, tok, pings + more)
    yield f"rtt: median {rtt['median_us']:.0f} us, p99 {rtt['p99_us']:.0f} us over {rtt['count']} round trips"
    for streams in (1, 2, 4, 8):
        res = measure_tcp(r, tok, streams, streams * 256 * 1024 * 1024, "down")
        yield (f"raw TCP, {streams} stream{'s' if streams > 1 else ''}: {res['bytes_per_s'] / 1e9:.2f} GB/s "
               f"({_fmt(res['bytes'])} in {res['seconds']:.2f} s)")


def _fmt(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"
