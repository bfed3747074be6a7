"""The ``tb5sync`` command: serve, sync, ls, bench. Thin over the library.

Exit status 0 on success; otherwise the error class's ``exit_code`` with a
one-line reason on stderr (2 usage, 3 path/permission, 5 auth, 10 connect,
11 destination, 12 protocol, 13 integrity, 14 remote, 23 not found,
24 source changed, 130 interrupted).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

__all__ = ["main", "run", "build_parser"]

log = logging.getLogger("tb5sync")


def _read_token(path: str | None) -> bytes | None:
    from .errors import UsageError

    if path is None:
        tok = os.environ.get("TB5SYNC_TOKEN")
        return tok.encode() if tok else None
    try:
        with open(path, "rb") as f:
            tok = f.read().strip()
    except OSError as exc:
        raise UsageError(f"cannot read token file {path}: {exc.strerror}") from exc
    if not tok:
        raise UsageError(f"token file {path} is empty")
    return tok


def _parse_bind(text: str) -> tuple[str, int]:
    from .errors import UsageError
    from .messages import DEFAULT_PORT

    host, sep, port = text.rpartition(":")
    if not sep:
        return text, DEFAULT_PORT
    host = host.strip("[]") or "127.0.0.1"
    try:
        p = int(port)
    except ValueError:
        raise UsageError(f"bad port in --bind {text!r}") from None
    if not 0 <= p <= 65535:
        raise UsageError(f"port out of range in --bind {text!r}")
    return host, p


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for documentation and tests)."""
    from . import __version__

    def threads(q: argparse.ArgumentParser, default: Any) -> None:
        q.add_argument("--hash-threads", type=int, default=default, metavar="N",
                       help="BLAKE3 hashing threads (default: $TB5SYNC_HASH_THREADS, else one per CPU)")
        q.add_argument("--chunk-threads", type=int, default=default, metavar="N",
                       help="threads cutting one large file into chunks side by side (default: "
                            "$TB5SYNC_CHUNK_THREADS, else 1 below 8 CPUs, else min(4, CPUs/4))")

    p = argparse.ArgumentParser(prog="tb5sync", description="Move files between machines at link speed.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    threads(p, 0)
    # The same options are accepted after the command too (there they override).
    common = argparse.ArgumentParser(add_help=False)
    threads(common, argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve a directory tree", parents=[common])
    s.add_argument("root", help="directory to serve; nothing outside it is read or written")
    s.add_argument("--bind", default="127.0.0.1:8873", help="HOST:PORT to listen on (default 127.0.0.1:8873; port 0 picks one)")
    s.add_argument("--token-file", help="file holding the shared token (default: $TB5SYNC_TOKEN; none = no auth)")
    s.add_argument("--allow", action="append", default=[], metavar="CIDR", help="client networks allowed (repeatable; default: any address that can reach --bind)")
    s.add_argument("--read-only", action="store_true", help="refuse all writes")
    s.add_argument("--store", metavar="DIR", nargs="?", const="",
                   help="also serve this artifact store (tb5sync store push/pull); without DIR, ROOT/.tb5sync/store")
    s.add_argument("--upstream", metavar="URL",
                   help="with --store: a shared store (s3://bucket/prefix, any fsspec URL, or a directory) the local "
                        "store caches: missing refs are read through, pushes written through")
    s.add_argument("--peer", action="append", default=[], metavar="tb5://HOST[:PORT]",
                   help="another node's store a read-through also fetches from, in parallel (repeatable)")
    s.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE", dest="storage_options",
                   help="an fsspec storage option for --upstream (repeatable)")

    y = sub.add_parser("sync", help="make DST match SRC (rsync -a semantics)", parents=[common])
    y.add_argument("src", help="local path or tb5://HOST[:PORT]/PATH (port 8873 by default); a trailing / means the contents of SRC, not SRC itself")
    y.add_argument("dst", help="local path or tb5://HOST[:PORT]/PATH (PATH relative to the server's ROOT)")
    y.add_argument("-n", "--dry-run", action="store_true", help="show what would change, change nothing")
    y.add_argument("--delete", action="store_true", help="delete destination files missing at the source")
    y.add_argument("--exclude", action="append", default=[], metavar="PAT", help="rsync-style exclude pattern (repeatable)")
    y.add_argument("-c", "--checksum", action="store_true", help="compare content digests, not size and mtime")
    y.add_argument("--progress", action="store_true", help="show a progress bar on stderr")
    y.add_argument("--stats", action="store_true", help="print transfer statistics")
    y.add_argument("--json", action="store_true", help="print statistics as one JSON object")
    y.add_argument("--streams", type=int, default=None, metavar="N", help="TCP streams per session (default 4)")
    y.add_argument("--compress", choices=("auto", "lz4", "none"), default="auto",
                   help="lz4 per chunk: auto (default) compresses only chunks a sample shows to shrink well, lz4 always, none never")
    y.add_argument("--fsync", action="store_true",
                   help="flush each file to disk before renaming it into place, and its directory after, before reporting success (survives a power cut; slower)")
    y.add_argument("--token-file", help="file holding the shared token (default: $TB5SYNC_TOKEN)")

    l_ = sub.add_parser("ls", help="list a remote directory")
    l_.add_argument("url", help="tb5://HOST[:PORT]/PATH")
    l_.add_argument("--token-file")

    b = sub.add_parser("bench", help="link test: RTT and raw TCP throughput against a server", parents=[common])
    b.add_argument("host", help="HOST[:PORT] of a tb5sync server")
    b.add_argument("--seconds", type=float, default=2.0, help="seconds per throughput measurement")
    b.add_argument("--token-file")

    from .storecli import add_store_parser

    add_store_parser(sub, common)
    return p


def _cmd_serve(a: argparse.Namespace) -> int:
    from .server import Server
    from .storecli import parse_storage_options

    host, port = _parse_bind(a.bind)
    srv = Server(a.root, host=host, port=port, token=_read_token(a.token_file), allow=a.allow, read_only=a.read_only,
                 store=os.path.join(a.root, ".tb5sync", "store") if a.store == "" else a.store,
                 upstream=a.upstream, peers=a.peer, storage_options=parse_storage_options(a.storage_options) or None)
    srv.bind()
    print(f"tb5sync: serving {srv.root} on {host}:{srv.port}", file=sys.stderr, flush=True)

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()
    return 0


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _cmd_sync(a: argparse.Namespace) -> int:
    from .sync import sync

    bar = None
    progress = None
    if a.progress:
        from tqdm import tqdm

        bar = tqdm(total=0, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr, dynamic_ncols=True)

        def progress(done: int, total: int) -> None:
            assert bar is not None
            if bar.total != total:
                bar.total = total
            bar.update(done - bar.n)

    try:
        stats = sync(
            a.src,
            a.dst,
            delete=a.delete,
            exclude=a.exclude,
            checksum=a.checksum,
            dry_run=a.dry_run,
            streams=a.streams,
            compress=a.compress,
            progress=progress,
            token=_read_token(a.token_file),
            fsync=a.fsync,
        )
    finally:
        if bar is not None:
            bar.close()
    changes = stats.extra.get("changes") if a.dry_run else None
    if a.json:
        out = stats.as_dict()
        if changes is not None:
            out["changes"] = changes
        print(json.dumps(out))
    elif a.stats or a.dry_run:
        if changes is not None:  # as rsync -n -v lists them
            for path in changes.get("delete", []):
                print(f"deleting {path}")
            for path in changes.get("transfer", []):
                print(path)
        secs = stats.seconds or 1e-9
        prefix = "would transfer" if a.dry_run else "transferred"
        deleted = "would delete" if a.dry_run else "deleted"
        print(f"files: {stats.files_total} total, {stats.files_transferred} {prefix}, {stats.files_deleted} {deleted}")
        print(f"bytes: {_fmt_bytes(stats.bytes_total)} total, {_fmt_bytes(stats.bytes_transferred)} {prefix}")
        print(f"wire: {_fmt_bytes(stats.wire_bytes)}; chunks sent {stats.chunks_sent} "
              f"({_fmt_bytes(stats.bytes_matched)} of them matched in the basis), reused {stats.chunks_reused}")
        print(f"time: {stats.seconds:.3f} s, {stats.bytes_transferred / secs / 1e9:.2f} GB/s")
    return 0


def _cmd_ls(a: argparse.Namespace) -> int:
    from .client import ls, parse_url
    from .errors import UsageError

    r = parse_url(a.url)
    if r is None:
        raise UsageError(f"ls needs a tb5:// URL, not {a.url!r}")
    entries = ls(r, token=_read_token(a.token_file))
    import stat as _stat

    for e in entries[1:] if entries and entries[0].kind == "d" else entries:
        kind = {"d": _stat.S_IFDIR, "l": _stat.S_IFLNK}.get(e.kind, _stat.S_IFREG)
        when = time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(e.mtime_ns / 1e9))
        name = e.path or os.path.basename(r.path.rstrip("/"))
        tail = f" -> {e.target}" if e.kind == "l" else ""
        print(f"{_stat.filemode(kind | e.mode)} {e.size:>14,} {when} {name}{tail}")
    return 0


def _cmd_bench(a: argparse.Namespace) -> int:
    from .client import bench_link

    host, port = _parse_bind(a.host)
    for line in bench_link(host, port, token=_read_token(a.token_file), seconds=a.seconds):
        print(line, flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (also used as the console script)."""
    parser = build_parser()
    a = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(a.verbose, 2)
    logging.basicConfig(level=level, format="tb5sync: %(message)s", stream=sys.stderr)
    from .errors import Tb5syncError

    def _cmd_store(a: argparse.Namespace) -> int:
        from .storecli import run_store

        return run_store(a, _read_token)

    handlers = {"serve": _cmd_serve, "sync": _cmd_sync, "ls": _cmd_ls, "bench": _cmd_bench, "store": _cmd_store}
    try:
        if a.hash_threads:
            from .hashing import set_hash_threads

            set_hash_threads(a.hash_threads)
        if a.chunk_threads:
            from .hashing import set_chunk_threads

            set_chunk_threads(a.chunk_threads)
        return handlers[a.command](a)
    except Tb5syncError as exc:
        print(f"tb5sync: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("tb5sync: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into e.g. `head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except OSError as exc:
        print(f"tb5sync: error: {exc.strerror or exc}{': ' + str(exc.filename) if exc.filename else ''}", file=sys.stderr)
        return 11


def run() -> NoReturn:
    """The console script (and ``python -m tb5sync.cli``): :func:`main`, then exit at once.

    Once the command has finished (its files, sockets and state databases closed by the
    library, its output written), the interpreter's teardown (module dictionaries, the
    objects of a 10^4-entry manifest, idle pool threads) took 15-20 ms here: about a tenth
    of a no-change re-run of 20,000 files. So the output is flushed and logging shut down,
    then the process ends with ``os._exit``, skipping ``atexit`` handlers. ``main`` itself
    returns normally, for callers that embed the command (and the tests).
    """
    code = main()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:  # output piped into e.g. `head`
        code = 141
    except OSError:
        code = code or 1
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    run()
