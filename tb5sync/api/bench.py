"""``tb5sync bench URL``: what bounds a transfer between this node and a server (link, disk or CPU).

Does in one command what people do by hand with ping, iperf3 and fio, against a running
``tb5sync serve`` and through its own protocol (authenticated like any session, within the
server's session limits):

1. **RTT**: ``pings`` small request/response round trips on a ``ping`` session; median and p99,
   microseconds.
2. **Raw TCP**: for 1, 2, 4 and 8 streams, ``tcp_bytes`` in all (split over the streams) from the
   server (``source`` sessions: DATA frames of zeros) and to it (``sink`` sessions: the server
   drops them); no disk, no hashing: what the link and the framing carry, as iperf3 would show.
3. **Disk**: a temporary file of ``size`` bytes written (with ``fsync``), read back cold and removed,
   here in ``directory`` and on the server in its state directory (``disk`` session;
   :mod:`tb5sync._os.diskbench` says how the read is made cold on each platform).
4. **CPU**: this node chunking and hashing ``size`` bytes (at most 256 MiB) in memory, as the
   sync engine does for a new file (FastCDC + BLAKE3 on the hash pool), bytes per second.
5. **Sync**: a generated file of ``size`` incompressible bytes pushed to the server (under ROOT as
   ``.tb5sync-bench-<random>``) and pulled back into a new local directory through the sync
   engine, then removed on both sides.

The **verdict**: for each direction the ceilings are the link (raw TCP at the sync's stream count,
that direction), the disks (reading at the sender, writing at the receiver: the slower) and the CPU
(this node's chunk-and-hash rate; the server's is taken to be alike); the lowest ceiling of the
slower direction bounds a transfer between these two nodes. A sync that ran below half of every
ceiling is bound by none of them (``engine``: the engine's own overhead or the other end's CPU),
and a sync test under 256 MiB gives ``inconclusive`` (too short to tell, the verdict would change
from run to run). Each figure is in the result, so the verdict can be checked.

A read-only server cannot take the disk test or the push: :func:`run_bench` refuses at once with
:class:`~tb5sync.errors.ReadOnlyError` before measuring anything.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from tb5sync._os.diskbench import disk_rates
from tb5sync.remote.client import measure_rtt, measure_tcp, pull, push
from tb5sync.tree.entry import path_to_wire
from tb5sync.errors import DestinationError, ReadOnlyError, RemoteNotFoundError, RemoteProtocolError, UsageError
from tb5sync.tree.options import SyncOptions
from tb5sync.wire.protocol import FrameType
from tb5sync.wire.rpc import call_direct, open_session
from tb5sync.wire.transport import IO_TIMEOUT, Channel, dial, host_port
from tb5sync.wire.urls import Remote, token_of

__all__ = ["run_bench", "format_report", "verdict", "STREAM_COUNTS", "BOUNDS", "VERDICT_MIN_BYTES", "ENGINE_FRACTION"]

#: Stream counts of the raw TCP test.
STREAM_COUNTS = (1, 2, 4, 8)
#: What a verdict may name: a ceiling; ``engine`` when the sync ran well below every ceiling;
#: ``inconclusive`` when the test file was too small for the figures to mean much.
BOUNDS = ("link", "disk", "cpu", "engine", "inconclusive")
#: Smallest sync test (bytes) a verdict is given for: below it the sync lasts a few ms and the
#: slower direction, and so the verdict, changes from run to run.
VERDICT_MIN_BYTES = 256 * 1024 * 1024
#: A sync below this fraction of its lowest ceiling is bound by none of them (``engine``).
ENGINE_FRACTION = 0.5
_BLOCK = 4 * 1024 * 1024
_CPU_MAX = 256 * 1024 * 1024


def _dial(r: Remote, token: bytes | None, timeout: float | None, tls_ca: str | None) -> Channel:
    return dial(r.host, r.port, token, tls=r.tls, tls_ca=tls_ca, io_timeout=timeout, family=r.family)


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds if seconds > 0 else 0.0


def server_disk(r: Remote, token: bytes | None, size: int, timeout: float | None = IO_TIMEOUT,
                tls_ca: str | None = None) -> dict[str, Any]:
    """The server's disk test (``disk`` session) on ``size`` bytes; the fields of :func:`tb5sync._os.diskbench.disk_rates`."""
    ch = _dial(r, token, timeout, tls_ca)
    try:
        body = open_session(ch, {"op": "disk", "bytes": size})
    finally:
        ch.close()
    for key in ("bytes", "write_seconds", "read_seconds"):
        if not isinstance(body.get(key), (int, float)) or isinstance(body.get(key), bool):
            raise RemoteProtocolError(f"disk test reply: {key} missing or not a number")
    return {"bytes": int(body["bytes"]), "write_seconds": float(body["write_seconds"]),
            "read_seconds": float(body["read_seconds"]), "cold": bool(body.get("cold")),
            "method": str(body.get("method", "?"))}


def _disk_summary(d: dict[str, Any], where: str) -> dict[str, Any]:
    return {**d, "where": where, "write_bytes_per_s": _rate(d["bytes"], d["write_seconds"]),
            "read_bytes_per_s": _rate(d["bytes"], d["read_seconds"])}


def cpu_rate(size: int) -> dict[str, Any]:
    """This node chunking (FastCDC) and hashing (BLAKE3, the hash pool) ``min(size, 256 MiB)``
    incompressible bytes in memory: ``{"bytes", "seconds", "bytes_per_s", "chunker"}``."""
    from tb5sync.engine.chunking import IMPLEMENTATION
    from tb5sync.engine.hashing import chunk_buffer

    n = min(size, _CPU_MAX)
    buf = os.urandom(n)
    t = time.perf_counter()
    chunk_buffer(buf)
    dt = time.perf_counter() - t
    return {"bytes": n, "seconds": dt, "bytes_per_s": _rate(n, dt), "chunker": IMPLEMENTATION}


def sync_round_trip(r: Remote, token: bytes | None, directory: str, size: int, streams: int,
                    timeout: float | None = IO_TIMEOUT, tls_ca: str | None = None) -> dict[str, Any]:
    """Push a new file of ``size`` random bytes to the server and pull it back (module docstring).

    Returns ``{"push": {...}, "pull": {...}}`` with ``bytes``, ``seconds``, ``bytes_per_s`` and
    ``wire_bytes`` each; the file is removed on both sides afterwards (a failure to remove
    it on the server is reported in ``"cleanup"``).

    Raises
    ------
    DestinationError
        ``directory`` has less than twice ``size`` plus 256 MiB free.
    """
    from tb5sync._os.diskbench import FREE_MARGIN

    st = os.statvfs(directory)
    if st.f_bavail * st.f_frsize < 2 * size + FREE_MARGIN:  # the file and its pulled copy
        raise DestinationError(f"sync test in {directory}: {(st.f_bavail * st.f_frsize) >> 20} MiB free, the test needs "
                               f"{(2 * size + FREE_MARGIN) >> 20} MiB (the file, its pulled copy and a margin); "
                               "choose a smaller size")
    work = tempfile.mkdtemp(prefix=".tb5sync-bench-", dir=directory)
    name = f".tb5sync-bench-{secrets.token_hex(8)}"
    remote_path = (r.path.rstrip("/") + "/" + name) if r.path.strip("/") else name
    target = Remote(r.host, r.port, remote_path, r.token, r.tls, r.family)
    opts = SyncOptions(streams=streams)
    out: dict[str, Any] = {}
    pushed = False
    try:
        src = os.path.join(work, "source")
        # a random block repeated would dedupe to one chunk; os.urandom throughout is honest
        with open(src, "wb") as f:
            left = size
            while left:
                n = min(left, _BLOCK)
                f.write(os.urandom(n))
                left -= n
        t = time.perf_counter()
        try:
            stats = push(src, target, opts, token=token, name=None, timeout=timeout, tls_ca=tls_ca)
        finally:
            pushed = True
        dt = time.perf_counter() - t
        out["push"] = {"bytes": size, "seconds": dt, "bytes_per_s": _rate(size, dt), "wire_bytes": stats.wire_bytes}
        t = time.perf_counter()
        stats = pull(target, os.path.join(work, "pulled"), opts, token=token, keep_state=False, timeout=timeout, tls_ca=tls_ca)
        dt = time.perf_counter() - t
        out["pull"] = {"bytes": size, "seconds": dt, "bytes_per_s": _rate(size, dt), "wire_bytes": stats.wire_bytes}
        if os.path.getsize(os.path.join(work, "pulled")) != size:
            raise RemoteProtocolError("bench: the pulled file has the wrong size")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if pushed:
            try:
                _remote_rm(r, token, remote_path, timeout, tls_ca)
            except Exception as exc:  # reported, not raised: the figures stand
                out["cleanup"] = f"could not remove {remote_path} on the server: {exc}"
    return out


def _remote_rm(r: Remote, token: bytes | None, path: str, timeout: float | None, tls_ca: str | None) -> None:
    ch = _dial(r, token, timeout, tls_ca)
    try:
        open_session(ch, {"op": "fs"})
        call_direct(ch, "rm", {"paths": [path_to_wire(path)]})
        ch.send_control(FrameType.BYE, 0, {})
    finally:
        ch.close()


def _read_only(r: Remote, token: bytes | None, timeout: float | None, tls_ca: str | None) -> bool:
    """Whether the server is read-only; with a path in ``r``, also that it is a directory there
    (:class:`UsageError` if not: the sync test creates no directory on the server)."""
    ch = _dial(r, token, timeout, tls_ca)
    try:
        body = open_session(ch, {"op": "fs"})
        path = r.path.strip("/")
        if path:
            try:
                kind = call_direct(ch, "info", {"path": path_to_wire(path)}).get("info", {}).get("type")
            except RemoteNotFoundError:
                kind = None
            if kind != "directory":
                raise UsageError(f"bench: {path!r} is {'not a directory' if kind else 'not there'} on the server; "
                                 "the sync test's file goes into an existing directory (and none is created): "
                                 "create it there, or give the URL without a path")
        ch.send_control(FrameType.BYE, 0, {})
    finally:
        ch.close()
    return bool(body.get("read_only"))


def verdict(res: dict[str, Any], streams: int) -> dict[str, Any]:
    """What bounds a transfer, from :func:`run_bench`'s figures (module docstring).

    Returns ``{"bound": "link" | "disk" | "cpu" | "engine" | "inconclusive", "direction": "push" |
    "pull", "ceilings": {direction: {resource: bytes_per_s}}, "achieved": {direction: bytes_per_s},
    "why": str}``: the lowest ceiling of the slower direction, unless the sync ran below
    :data:`ENGINE_FRACTION` of it (``engine``) or ``res["size"]`` is under :data:`VERDICT_MIN_BYTES`
    (``inconclusive``).
    """
    def tcp(direction: str) -> float:
        rows = [t for t in res["tcp"] if t["direction"] == direction]
        exact = [t["bytes_per_s"] for t in rows if t["streams"] == streams]
        return exact[0] if exact else max(t["bytes_per_s"] for t in rows)

    here, there, cpu = res["disk"]["client"], res["disk"]["server"], res["cpu"]["bytes_per_s"]
    ceilings = {
        "push": {"link": tcp("up"), "disk": min(here["read_bytes_per_s"], there["write_bytes_per_s"]), "cpu": cpu},
        "pull": {"link": tcp("down"), "disk": min(there["read_bytes_per_s"], here["write_bytes_per_s"]), "cpu": cpu},
    }
    achieved = {d: res["sync"][d]["bytes_per_s"] for d in ("push", "pull")}
    direction = min(achieved, key=achieved.__getitem__)
    lowest = min(ceilings[direction], key=ceilings[direction].__getitem__)
    c = ceilings[direction]
    figures = (f"{direction} ran at {achieved[direction] / 1e6:,.0f} MB/s; ceilings: link {c['link'] / 1e6:,.0f}, "
               f"disk {c['disk'] / 1e6:,.0f}, cpu {c['cpu'] / 1e6:,.0f} MB/s")
    size = res.get("size")
    if isinstance(size, int) and size < VERDICT_MIN_BYTES:
        bound = "inconclusive"
        why = (f"a {size / 2**20:,.0f} MiB sync test is too short to tell (at least {VERDICT_MIN_BYTES >> 20} MiB: "
               f"--size {VERDICT_MIN_BYTES >> 20}M); {figures}")
    elif achieved[direction] < ENGINE_FRACTION * c[lowest]:
        bound = "engine"
        why = (f"{figures}: below every ceiling measured, so none of them bounds it: the engine's own "
               f"overhead or the other end's CPU does")
    else:
        bound = lowest
        why = f"{figures}: the {bound} is the lowest"
    return {"bound": bound, "direction": direction, "ceilings": ceilings, "achieved": achieved, "why": why}


def run_bench(
    url: Remote,
    *,
    token: bytes | str | None = None,
    size: int = 256 * 1024 * 1024,
    tcp_bytes: int = 1024 * 1024 * 1024,
    pings: int = 1000,
    directory: str | os.PathLike[str] = ".",
    streams: int = 4,
    timeout: float | None = IO_TIMEOUT,
    tls_ca: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure the link, both disks, this CPU and a real push and pull against the server at ``url``.

    Parameters
    ----------
    url : Remote
        The server (``tb5://[TOKEN@]HOST[:PORT]``; a path in it is an existing directory on the server
        where the sync test's file goes: none is created).
    token : bytes or str, optional
        As for :func:`tb5sync.remote.client.pull` (else the URL's, else ``$TB5SYNC_TOKEN``).
    size : int
        Bytes of the disk tests' files, of the synced file and (at most 256 MiB) of the CPU test.
    tcp_bytes : int
        Bytes moved by each raw TCP measurement (each stream count, each direction).
    pings : int
        Round trips of the RTT test, >= 10.
    directory : str or path
        Where this node's disk test and the sync test's local files go (removed after).
    streams : int
        TCP streams of the sync test (1..64); the link ceiling is the raw TCP figure at this count.
    progress : callable, optional
        Called with a short line as each step starts.

    Returns
    -------
    dict
        JSON-able: ``server``, ``rtt``, ``tcp`` (list), ``disk`` (``client``, ``server``), ``cpu``,
        ``sync`` (``push``, ``pull``), ``verdict`` (:func:`verdict`); rates in bytes per second.

    Raises
    ------
    UsageError
        A bad argument, or the URL's path is not a directory on the server.
    ReadOnlyError
        The server is read-only (checked first: the disk test and the push write there).
    ConnectError, AuthError, BusyError, LinkTimeoutError, DestinationError
        Reaching the server, its token, its limits, or a disk test failed.
    """
    from tb5sync._os.diskbench import MIN_SIZE

    if isinstance(size, bool) or not isinstance(size, int) or size < MIN_SIZE:
        raise UsageError(f"bench size must be at least {MIN_SIZE} bytes, got {size!r}")
    if isinstance(tcp_bytes, bool) or not isinstance(tcp_bytes, int) or tcp_bytes < max(STREAM_COUNTS):
        raise UsageError(f"bench tcp bytes must be at least {max(STREAM_COUNTS)}, got {tcp_bytes!r}")
    if isinstance(pings, bool) or not isinstance(pings, int) or pings < 10:
        raise UsageError(f"bench pings must be at least 10, got {pings!r}")
    SyncOptions(streams=streams)  # checks the stream count
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise UsageError(f"bench directory {directory!r} does not exist")
    tok = token_of(token, url)
    say = progress or (lambda _line: None)
    shown = f"{'tb5s' if url.tls else 'tb5'}://{host_port(url.host, url.port)}"
    if _read_only(url, tok, timeout, tls_ca):
        raise ReadOnlyError(f"{shown} is read-only: tb5sync bench writes a temporary file there (disk test, push); "
                            "run it against a writable server")
    res: dict[str, Any] = {"server": shown, "size": size, "tcp_bytes": tcp_bytes, "streams": streams}
    say(f"rtt: {pings} round trips")
    res["rtt"] = measure_rtt(url, tok, pings, timeout, tls_ca)
    res["tcp"] = []
    for direction in ("down", "up"):
        for n in STREAM_COUNTS:
            say(f"raw TCP {direction}, {n} stream{'s' if n > 1 else ''}")
            res["tcp"].append(measure_tcp(url, tok, n, tcp_bytes, direction, timeout, tls_ca))
    say(f"disk here ({directory})")
    here = _disk_summary(disk_rates(directory, size), os.path.abspath(directory))
    say("disk on the server (its state directory)")
    there = _disk_summary(server_disk(url, tok, size, timeout, tls_ca), "server state directory")
    res["disk"] = {"client": here, "server": there}
    say("cpu: chunk and hash")
    res["cpu"] = cpu_rate(size)
    say("sync: push, then pull")
    res["sync"] = sync_round_trip(url, tok, directory, size, streams, timeout, tls_ca)
    res["verdict"] = verdict(res, streams)
    return res


def _mbs(v: float) -> str:
    return f"{v / 1e6:,.0f} MB/s"


def format_report(res: dict[str, Any]) -> list[str]:
    """Human-readable lines of a :func:`run_bench` result."""
    r = res["rtt"]
    lines = [f"server {res['server']}",
             f"rtt          median {r['median_us']:,.0f} us, p99 {r['p99_us']:,.0f} us, min {r['min_us']:,.0f} us ({r['count']} round trips)"]
    for direction, label in (("down", "raw TCP down (server -> here)"), ("up", "raw TCP up (here -> server)")):
        rows = [t for t in res["tcp"] if t["direction"] == direction]
        lines.append(f"{label}: " + ", ".join(f"{t['streams']} stream{'s' if t['streams'] > 1 else ''} {_mbs(t['bytes_per_s'])}" for t in rows))
    for key, label in (("client", "disk here  "), ("server", "disk server")):
        d = res["disk"][key]
        cold = "cold read" if d["cold"] else "read may be cached (no way to drop the cache here)"
        lines.append(f"{label}  write {_mbs(d['write_bytes_per_s'])} (fsync'd), read {_mbs(d['read_bytes_per_s'])} "
                     f"({cold}), {d['bytes'] >> 20} MiB in {d['where']}")
    c = res["cpu"]
    lines.append(f"cpu          chunk + hash {_mbs(c['bytes_per_s'])} ({c['bytes'] >> 20} MiB, {c['chunker']} chunker)")
    s = res["sync"]
    lines.append(f"sync         push {_mbs(s['push']['bytes_per_s'])}, pull {_mbs(s['pull']['bytes_per_s'])} "
                 f"({res['size'] >> 20} MiB file, {res['streams']} streams)")
    if "cleanup" in s:
        lines.append(f"warning      {s['cleanup']}")
    v = res["verdict"]
    head = {"inconclusive": "inconclusive", "engine": "below every ceiling"}.get(v["bound"], f"{v['bound']} bound")
    lines.append(f"verdict      {head} ({v['why']})")
    return lines
