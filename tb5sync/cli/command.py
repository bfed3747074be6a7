"""The ``tb5sync`` command: serve, sync, ls, bench, store, http-cache. Thin over the library.

Exit status 0 on success; otherwise the error class's ``exit_code`` with a
one-line reason on stderr (2 usage, 3 path/permission, 5 auth, 10 connect,
11 destination, 12 protocol, 13 integrity, 14 remote, 23 not found or partial
transfer, 24 source files vanished, 30 I/O timeout, 20 interrupted by SIGINT, SIGTERM or SIGHUP,
as rsync's). A partial transfer
(rsync's 23/24) first names each entry that was not synced on its own line
(``tb5sync: source 'a/b': Permission denied (13)``), and ``--json`` then still prints
the statistics, their ``failures`` included.
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

from tb5sync._os.terminal import say

__all__ = ["main", "run", "build_parser"]

log = logging.getLogger("tb5sync")


class _EscapedFormatter(logging.Formatter):
    """Log lines through :func:`tb5sync._os.terminal.escaped` (they quote names and peers' messages)."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # the message; a traceback stays as it is
        from tb5sync._os.terminal import escaped

        return escaped(super().formatMessage(record))


def _read_token(path: str | None, env: bool = True) -> bytes | None:
    """The token in ``path``; without a path, ``$TB5SYNC_TOKEN`` when ``env`` (else None: the
    client then takes the URL's token, then the environment's)."""
    from tb5sync.errors import UsageError

    if path is None:
        tok = os.environ.get("TB5SYNC_TOKEN") if env else None
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
    """``HOST:PORT``, ``[V6ADDR]:PORT``, a bare IPv6 address (``fe80::1%bridge0``) or an interface
    name (``bridge0:8873``: that interface's address, :func:`tb5sync._os.netif.bind_host`) -> ``(host, port)``."""
    from tb5sync.errors import UsageError
    from tb5sync.wire.messages import DEFAULT_PORT
    from tb5sync._os.netif import bind_host

    if text.count(":") > 1 and not text.startswith("["):  # a bare IPv6 address, with or without a zone
        return bind_host(text), DEFAULT_PORT
    host, sep, port = text.rpartition(":")
    if not sep:
        return bind_host(text), DEFAULT_PORT
    host = host.strip("[]") or "127.0.0.1"
    try:
        p = int(port)
    except ValueError:
        raise UsageError(f"bad port in --bind {text!r}") from None
    if not 0 <= p <= 65535:
        raise UsageError(f"port out of range in --bind {text!r}")
    return bind_host(host), p


class _VersionAction(argparse.Action):
    """``--version``: the version, then which chunker runs (the Cython one, or the pure-Python twin)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None) -> None:
        from tb5sync import __version__
        from tb5sync.engine.chunking import implementation_note

        print(f"tb5sync {__version__}")
        print(implementation_note())
        parser.exit()


#: The commands, in the order of ``tb5sync --help``.
COMMANDS = ("serve", "http-cache", "sync", "ls", "bench", "store")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser (exposed for documentation and tests).

    ``command`` (one of :data:`COMMANDS`): only that command's options are added; the others
    are there by name and help alone (enough for ``tb5sync --help`` and for an unknown
    command's error), which spares a CLI start building ~180 options it does not use
    (argparse looks up a translation of each help text: ~8 ms). None: every command whole.
    """

    def full(name: str) -> bool:
        return command is None or command == name

    def threads(q: argparse.ArgumentParser, default: Any) -> None:
        q.add_argument("--hash-threads", type=int, default=default, metavar="N",
                       help="BLAKE3 hashing threads (default: $TB5SYNC_HASH_THREADS, else one per CPU)")
        q.add_argument("--chunk-threads", type=int, default=default, metavar="N",
                       help="threads cutting one large file into chunks side by side (default: "
                            "$TB5SYNC_CHUNK_THREADS, else 1 below 8 CPUs, else min(4, CPUs/4))")

    def timeout_opts(q: argparse.ArgumentParser) -> None:
        q.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                       help="I/O timeout: a stalled server or a dead link ends the command after this long (default 60; 0: none)")
        q.add_argument("--tls-ca", metavar="PEM", help="CA certificates to check a tb5s:// server against (default: the system's)")
        from tb5sync.cli.store import add_family_options

        add_family_options(q)

    p = argparse.ArgumentParser(prog="tb5sync", description="Move files between machines at link speed.")
    p.add_argument("--version", action=_VersionAction, nargs=0, help="show the version and the chunker in use, and exit")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    threads(p, 0)
    # The same options are accepted after the command too (there they override).
    common = argparse.ArgumentParser(add_help=False)
    threads(common, argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve a directory tree", parents=[common])
    if full("serve"):
        from tb5sync.wire.messages import ENTRY_COST, MAX_ENTRIES, MAX_LISTING_BYTES, STRING_COST

        s.add_argument("root", help="directory to serve; nothing outside it is read or written")
        s.add_argument("--bind", default="127.0.0.1:8873", help="HOST:PORT to listen on (default 127.0.0.1:8873; port 0 picks one); HOST may be an interface name "
                            "(bridge0:8873: one of its addresses, IPv4 first) or [fe80::1%%bridge0]; [::]:PORT listens on "
                            "both families")
        s.add_argument("--token-file", help="file holding the shared token (default: $TB5SYNC_TOKEN; none = no auth)")
        s.add_argument("--allow", action="append", default=[], metavar="CIDR|IFACE", help="client networks allowed, or an interface name for its subnets (repeatable; default: any address that can reach --bind)")
        s.add_argument("--read-only", action="store_true", help="refuse all writes")
        s.add_argument("--state-dir", metavar="DIR", help="scan cache, chunk index and partial files (default: ROOT/.tb5sync)")
        s.add_argument("--store", metavar="DIR", nargs="?", const="",
                       help="also serve this artifact store (tb5sync store push/pull); without DIR, ROOT/.tb5sync/store")
        s.add_argument("--no-auth", action="store_true",
                       help="serve without a token on an address that is not loopback (refused otherwise)")
        s.add_argument("--tls-cert", metavar="PEM", help="serve over TLS with this certificate chain (clients use tb5s:// URLs)")
        s.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
        s.add_argument("--max-connections", type=int, default=256, metavar="N",
                       help="connections at once, every stream counted; more are refused as busy (default 256)")
        s.add_argument("--max-sessions", type=int, default=64, metavar="N",
                       help="sessions (syncs, ls, fs clients) at once; more are refused as busy (default 64)")
        s.add_argument("--max-entries", type=int, default=MAX_ENTRIES, metavar="N",
                       help=f"entries of one pushing client's listing held (directories and entries together); "
                            f"a listing past it ends that session (default {MAX_ENTRIES})")
        s.add_argument("--max-listing-bytes", type=int, default=MAX_LISTING_BYTES, metavar="BYTES",
                       help=f"bytes of one pushing client's listing held ({ENTRY_COST} per entry plus {STRING_COST} per byte "
                            f"of its path, link target and xattrs: what the server holds); a listing past it ends that session (default {MAX_LISTING_BYTES})")
        s.add_argument("--max-session-bytes", metavar="SIZE",
                       help="bytes one session (a push, an fs or store client) may write, e.g. 50G; a file past it "
                            "is refused before any of it is written (default: no limit)")
        s.add_argument("--min-free-space", metavar="SIZE",
                       help="free space a write must leave on ROOT's file system, e.g. 10G; a write past it is refused (default: not checked)")
        s.add_argument("--fs-workers", type=int, default=0, metavar="N",
                       help="answer tb5:// (fs) sessions in N worker processes, one client's connections in one "
                            "(over TLS, and where a socket cannot be passed to another process, in the server's process; default 0: in process)")
        s.add_argument("--max-pending-per-address", type=int, default=16, metavar="N",
                       help="connections from one address (IPv6: one /64) not authenticated yet; more are refused as busy (default 16)")
        s.add_argument("--handshake-timeout", type=float, default=10.0, metavar="SECONDS",
                       help="time a new connection has to authenticate and say what it wants (default 10)")
        s.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                       help="I/O timeout: a started frame that makes no progress this long ends its session (default 60; 0: none)")
        s.add_argument("--idle-timeout", type=float, default=3600.0, metavar="SECONDS",
                       help="a session whose peer sends nothing this long is ended (default 3600; 0: none)")
        s.add_argument("--keepalive", type=float, default=15.0, metavar="SECONDS",
                       help="TCP keepalive idle time; a dead peer is found in about twice this (default 15; 0: off)")
        s.add_argument("--auth-limit", type=int, default=10, metavar="N",
                       help="failed authentications per client address per --auth-window before it is refused (default 10; 0: no limit)")
        s.add_argument("--auth-window", type=float, default=60.0, metavar="SECONDS", help="window of --auth-limit (default 60)")
        s.add_argument("--http-cache", metavar="HOST:PORT",
                       help="also serve a ccache/Bazel HTTP remote cache on HOST:PORT, backed by the store "
                            "(--store DIR, else ROOT/.tb5sync/store)")
        _http_cache_options(s)

        s.add_argument("--upstream", metavar="URL",
                       help="with --store: a shared store (s3://bucket/prefix, any fsspec URL, or a directory) the local "
                            "store caches: missing refs are read through, pushes written through")
        s.add_argument("--peer", action="append", default=[], metavar="tb5://HOST[:PORT]",
                       help="another node's store a read-through also fetches from, in parallel (repeatable)")
        s.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE", dest="storage_options",
                       help="an fsspec storage option for --upstream (repeatable)")

    h = sub.add_parser("http-cache", help="serve a ccache/Bazel HTTP remote cache backed by an artifact store",
                       parents=[common])
    if full("http-cache"):
        h.add_argument("store", help="store directory (created when missing)")
        h.add_argument("--bind", default="127.0.0.1:8080", help="HOST:PORT to listen on (default 127.0.0.1:8080; port 0 picks one); HOST may be an interface name (bridge0:8080)")
        h.add_argument("--allow", action="append", default=[], metavar="CIDR|IFACE", help="client networks allowed, or an interface name for its subnets (repeatable)")
        h.add_argument("--read-only", action="store_true", help="serve hits, refuse PUT and DELETE (403)")
        h.add_argument("--tls-cert", metavar="PEM", help="serve --grpc over TLS with this certificate chain (Bazel: grpcs://)")
        h.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
        _http_cache_options(h)

    y = sub.add_parser("sync", help="make DST match SRC (rsync -a semantics)", parents=[common], add_help=False)
    if full("sync"):
        y.set_defaults(sync_parser=y)
        y.add_argument("--help", action="help", help="show this help message and exit (-h alone too, as rsync)")
        y.add_argument("src", nargs="?", help="local path or tb5://[TOKEN@]HOST[:PORT]/PATH (port 8873 by default; tb5s:// for TLS); a trailing / means the contents of SRC, not SRC itself")
        y.add_argument("dst", nargs="?", help="local path or tb5://HOST[:PORT]/PATH (PATH relative to the server's ROOT)")
        y.add_argument("-n", "--dry-run", action="store_true", help="show what would change, change nothing")
        y.add_argument("--delete", action="store_true", help="delete destination files missing at the source")
        y.add_argument("--exclude", action="append", default=[], metavar="PAT", help="rsync-style exclude pattern (repeatable)")
        y.add_argument("-c", "--checksum", action="store_true", help="compare content digests, not size and mtime")
        y.add_argument("--progress", action="store_true", help="show a progress bar on stderr")
        y.add_argument("--stats", action="store_true", help="print transfer statistics")
        y.add_argument("--json", action="store_true", help="print statistics as one JSON object")
        y.add_argument("--streams", type=int, default=None, metavar="N", help="TCP streams per session (default 4)")
        y.add_argument("--compress", choices=("auto", "lz4", "none"), default="auto",
                       help="lz4 per chunk: auto (default) compresses only chunks a sample shows to shrink well, lz4 always "
                            "(also --compress alone, as rsync's), none never")
        y.add_argument("-z", dest="compress", action="store_const", const="lz4", help="rsync's -z: --compress lz4")
        y.add_argument("--fsync", action="store_true",
                       help="flush each file to disk before renaming it into place, and its directory after, before reporting success (survives a power cut; slower)")
        y.add_argument("--token-file", help="file holding the shared token (default: the URL's TOKEN@, else $TB5SYNC_TOKEN)")
        # ---- rsync -H -S -X -L --copy-unsafe-links --safe-links --link-dest
        from tb5sync.tree.options import LINK_OPTIONS

        for name, (flags, what) in LINK_OPTIONS.items():
            y.add_argument(*flags.split("/"), dest=name, action="store_true", help=what)
        y.add_argument("--link-dest", action="append", default=[], metavar="DIR", dest="link_dest",
                       help="hard-link files unchanged from DIR (relative: to the destination directory; repeatable)")
        timeout_opts(y)
        y.add_argument("--state-dir", metavar="DIR",
                       help="scan cache, chunk index and partial files of a local or pulled destination "
                            "(default: in the user's cache directory, keyed by the destination's device and inode)")
        # -- rsync options, second half --
        y.add_argument("--delete-excluded", action="store_true", help="also delete excluded files at the destination (implies --delete)")
        y.add_argument("--max-delete", type=int, default=None, metavar="N",
                       help="delete at most N entries (0: none), then skip the rest and exit 25, as rsync")
        y.add_argument("-i", "--itemize-changes", action="store_true",
                       help="print one rsync-style line per change (YXcstpoguax, e.g. '>f+++++++++ path', '*deleting   path')")
        y.add_argument("-u", "--update", action="store_true", help="skip files that are newer at the destination")
        y.add_argument("--ignore-existing", action="store_true", help="skip updating entries that exist at the destination")
        y.add_argument("--size-only", action="store_true", help="skip files that match in size, whatever their mtime")
        y.add_argument("--bwlimit", default=None, metavar="RATE",
                       help="limit the sending side to RATE (KiB/s, or with a suffix: 512b, 100K, 4M, 1.5G; 0: unlimited)")

        from tb5sync.wire.messages import ENTRY_COST, MAX_ENTRIES, MAX_LISTING_BYTES, STRING_COST

        y.add_argument("--max-entries", type=int, default=None, metavar="N",
                       help=f"a pull holds at most N entries of the server's listing (directories and entries together); "
                            f"past it the sync stops with exit 12, nothing written (default {MAX_ENTRIES}, as serve's)")
        y.add_argument("--max-listing-bytes", type=int, default=None, metavar="BYTES",
                       help=f"a pull holds at most BYTES of the server's listing ({ENTRY_COST} per entry plus {STRING_COST} per byte "
                            f"of its path, link target and xattrs); past it exit 12 (default {MAX_LISTING_BYTES}, as serve's)")
        y.add_argument("--mkpath", action="store_true",
                       help="create the destination's missing parent directories (without it a missing parent fails "
                            "the sync, exit 11, as rsync 3)")
        _rsync_aliases(y)
        y.error = lambda message: _sync_usage_error(y, message)  # type: ignore[method-assign]

    l_ = sub.add_parser("ls", help="list a remote directory")
    if full("ls"):
        l_.add_argument("url", help="tb5://HOST[:PORT]/PATH")
        l_.add_argument("--token-file", help="file holding the shared token (default: the URL's TOKEN@, else $TB5SYNC_TOKEN)")
        timeout_opts(l_)

    b = sub.add_parser("bench", parents=[common],
                       help="what bounds a transfer with a server: RTT, raw TCP (1-8 streams, both ways), "
                            "disks at both ends, CPU, a real push and pull; then a verdict (link, disk or cpu)")
    if full("bench"):
        b.add_argument("host", metavar="URL", help="tb5://[TOKEN@]HOST[:PORT] of a running, writable tb5sync serve "
                                                   "(HOST[:PORT] alone also works)")
        b.add_argument("--size", default="256M", metavar="SIZE",
                       help="bytes of the disk tests' files and of the pushed and pulled file (default 256M; e.g. 64M, 2G)")
        b.add_argument("--tcp-size", default="1G", metavar="SIZE", help="bytes per raw TCP measurement (default 1G)")
        b.add_argument("--pings", type=int, default=1000, metavar="N", help="round trips of the RTT test (default 1000)")
        b.add_argument("--dir", default=".", metavar="DIR",
                       help="where this node's disk test and the sync test's local files go, removed after (default .)")
        b.add_argument("--streams", type=int, default=4, metavar="N", help="TCP streams of the push and pull (default 4)")
        b.add_argument("--json", action="store_true", help="print the figures and the verdict as one JSON object")
        b.add_argument("--seconds", type=float, default=None, help=argparse.SUPPRESS)  # old option: --tcp-size now
        b.add_argument("--token-file", help="file holding the shared token (default: the URL's TOKEN@, else $TB5SYNC_TOKEN)")
        timeout_opts(b)

    from tb5sync.cli.store import add_store_parser

    add_store_parser(sub, common, full=full("store"))
    return p


#: rsync options ``sync`` accepts as no-ops: flag(s) -> why nothing is to be done.
RSYNC_IMPLIED: dict[str, str] = {
    "-a/--archive": "accepted: tb5sync always works as rsync -a (-rlptgoD, with -g/-o/-D as below)",
    "-r/--recursive": "accepted: implied (directories are always copied recursively)",
    "-l/--links": "accepted: implied (symlinks are copied as symlinks; -L copies what they point to)",
    "-p/--perms": "accepted: implied (permissions are always copied)",
    "-t/--times": "accepted: implied (modification times are always copied)",
    "-g/--group": "accepted, but owner and group are not copied: entries belong to the user running the receiver",
    "-o/--owner": "accepted, but owner and group are not copied: entries belong to the user running the receiver",
    "-D": "accepted, but devices, FIFOs and sockets are not copied: each is reported as a skipped non-regular file",
    "--devices": "as -D",
    "--specials": "as -D",
    "--partial": "accepted: implied (an interrupted file's verified part is always kept, in the state directory, "
                 "and resumed by the next run)",
}


def _rsync_aliases(y: argparse.ArgumentParser) -> None:
    """The rsync flags ``sync`` accepts besides its own (``-a`` and its parts, ``-v``, ``-h``, ``-P``, ``--delete-*``)."""
    for flags, what in RSYNC_IMPLIED.items():
        y.add_argument(*flags.split("/"), action="store_true", dest="rsync_implied", help=what)
    y.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                   help="list the changed names as rsync -v does (deletions as 'deleting PATH'); more log output too, "
                        "as the global -v")
    y.add_argument("-h", "--human-readable", action="store_true", dest="human_readable",
                   help="accepted: --stats always prints sizes with units (KiB, MiB...); -h alone shows this help, as rsync")
    y.add_argument("-P", action="store_true", dest="progress", help="rsync's --partial --progress: the progress bar "
                   "(partial files are always kept)")
    for flag in ("--delete-before", "--delete-during", "--del", "--delete-delay", "--delete-after"):
        y.add_argument(flag, action="store_true", dest="delete",
                       help="as --delete: tb5sync always deletes before it writes files (as rsync --delete-before)")


def _sync_usage_error(y: argparse.ArgumentParser, message: str) -> NoReturn:
    """``sync``'s argument errors: one line, an unknown letter in a group of rsync flags (``-aA``) named."""
    import re

    m = re.search(r"ignored explicit argument '(.)", message)
    if m:
        message = _unsupported_sync_options([f"-{m.group(1)}"])
    y.exit(2, f"tb5sync: error: {message}\n")


def _unsupported_sync_options(extras: list[str]) -> str:
    """The one-line message for arguments ``sync`` does not know (``extras`` as argparse left them)."""
    opts = [x for x in extras if x.startswith("-") and x != "-"]
    if not opts:
        return f"unexpected argument {extras[0]!r} (tb5sync sync takes SRC and DST only)"
    name = opts[0].split("=", 1)[0] if opts[0].startswith("--") else opts[0][:2]  # -f'- *.bin': -f
    return (f"rsync option {name} is not supported by tb5sync sync "
            "(see tb5sync sync --help for the options it takes)")


def _spaced_options(argv: Sequence[str], positional: Sequence[str]) -> list[str]:
    """The arguments of ``argv`` that look like options but that argparse took as operands
    (``positional``: SRC, DST and what it left over): argparse takes an unknown ``-x`` or
    ``--opt=VALUE`` holding a space (``--filter='- *.bin'``) for an operand, where rsync reports
    an unknown option. Stops at ``--`` (operands only after it). Returns them in order."""
    found = []
    for x in argv:
        if x == "--":
            break
        if x.startswith("-") and len(x) > 1 and " " in x and x in positional:
            found.append(x)
    return found


def _http_cache_options(q: argparse.ArgumentParser) -> None:
    q.add_argument("--http-basic-file", metavar="FILE", help="file holding USER:PASSWORD for HTTP basic auth of the cache")
    q.add_argument("--http-token-file", metavar="FILE", help="file holding a bearer token the cache accepts")
    q.add_argument("--no-ac-validation", action="store_true",
                   help="store /ac/ entries as opaque bytes (ccache's bazel layout), as bazel-remote's --disable_http_ac_validation")
    q.add_argument("--http-concurrency", type=int, default=64, metavar="N", help="requests served at once (default 64)")
    q.add_argument("--bazel-instance", action="append", default=[], metavar="NAME", dest="bazel_instances",
                   help="a first path segment that is a Bazel instance name (--remote_cache=http://HOST/NAME): "
                        "/NAME/ac/ and /NAME/cas/ follow Bazel's rules (repeatable); other first segments are opaque client keys")
    q.add_argument("--client-header-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="(http cache) a request head must arrive within this, from the accept or its first byte; "
                        "else 408 and closed (nginx's client_header_timeout; default 60; 0: none)")
    q.add_argument("--keepalive-timeout", type=float, default=75.0, metavar="SECONDS",
                   help="(http cache) an idle connection is closed after this (nginx's keepalive_timeout; default 75; 0: none)")
    q.add_argument("--client-body-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="(http cache) the window of --client-body-min-rate: an upload that brings less in one window is "
                        "cut, 408 (nginx's client_body_timeout, as a rate; default 60)")
    q.add_argument("--client-body-min-rate", default="1K", metavar="BYTES",
                   help="(http cache) bytes per second an upload must average over each --client-body-timeout window "
                        "(default 1K; 0: any byte within the window)")
    q.add_argument("--http-max-connections-per-address", type=int, default=512, metavar="N",
                   help="(http cache) open connections, idle ones included, of one client address; past it 503 and "
                        "closed (default 512; 0: no cap)")
    q.add_argument("--limit-conn", type=int, default=128, metavar="N",
                   help="(http cache) requests in progress of one client address; past it 503 (nginx's limit_conn; "
                        "default 128; 0: no cap)")
    q.add_argument("--grpc", metavar="HOST:PORT", default=None,
                   help="also serve the Remote Execution API's cache services (Bazel's --remote_cache=grpc://HOST:PORT) "
                        "over the same store, tokens and limits; TLS with --tls-cert/--tls-key (needs the grpc extra)")
    q.add_argument("--max-entry-size", metavar="SIZE", default=None,
                   help="largest cache entry accepted (e.g. 512M; default: the store's quota bounds it): a larger PUT is "
                        "refused before it is stored, 413 when its Content-Length says so, else 507")


def _http_cache(a: argparse.Namespace, store: Any, bind: str) -> Any:
    from tb5sync.cache.httpcache import HttpCache
    from tb5sync.cli.store import parse_size

    from tb5sync.wire.urls import host_port

    host, port = _parse_bind(bind)
    basic = _read_token(a.http_basic_file).decode() if a.http_basic_file else None
    bearer = _read_token(a.http_token_file).decode() if a.http_token_file else None
    cache = HttpCache(store, host, port, read_only=a.read_only, allow=a.allow, basic=basic, bearer=bearer,
                      ac_validation=not a.no_ac_validation, concurrency=a.http_concurrency,
                      bazel_instances=a.bazel_instances,
                      max_entry_size=parse_size(a.max_entry_size) if a.max_entry_size is not None else None,
                      client_header_timeout=a.client_header_timeout, keepalive_timeout=a.keepalive_timeout,
                      client_body_timeout=a.client_body_timeout, client_body_min_rate=parse_size(a.client_body_min_rate),
                      max_connections_per_address=a.http_max_connections_per_address, limit_conn=a.limit_conn)
    cache.start()
    print(f"tb5sync: http cache of {cache.store.path} on {host_port(host, cache.port)}", file=sys.stderr, flush=True)
    if a.grpc:
        from tb5sync.cache.grpccache import GrpcCache

        ghost, gport = _parse_bind(a.grpc)
        try:
            face = GrpcCache(cache, ghost, gport, tls_cert=a.tls_cert, tls_key=a.tls_key).start()
        except BaseException:
            cache.stop()
            raise
        cache.grpc = face  # stopped with it (_stop_cache)
        print(f"tb5sync: grpc cache of {cache.store.path} on {host_port(ghost, face.port)}{' (TLS)' if face.tls else ''}",
              file=sys.stderr, flush=True)
    return cache


def _stop_cache(cache: Any) -> None:
    face = getattr(cache, "grpc", None)
    if face is not None:
        face.stop()
    cache.stop()


def _cmd_http_cache(a: argparse.Namespace) -> int:
    cache = _http_cache(a, a.store, a.bind)

    try:
        cache.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        _stop_cache(cache)
    return 0


def _cmd_serve(a: argparse.Namespace) -> int:
    from tb5sync.daemon.server import Server
    from tb5sync.wire.urls import host_port
    from tb5sync.cli.store import parse_size, parse_storage_options

    host, port = _parse_bind(a.bind)
    store = os.path.join(a.root, ".tb5sync", "store") if a.store == "" or (a.store is None and a.http_cache) else a.store
    srv = Server(
        a.root, host=host, port=port, token=_read_token(a.token_file), allow=a.allow, read_only=a.read_only,
        no_auth=a.no_auth, tls_cert=a.tls_cert, tls_key=a.tls_key,
        max_connections=a.max_connections, max_sessions=a.max_sessions,
        max_entries=a.max_entries, max_listing_bytes=a.max_listing_bytes,
        max_session_bytes=parse_size(a.max_session_bytes) if a.max_session_bytes is not None else None,
        min_free_space=parse_size(a.min_free_space) if a.min_free_space is not None else 0,
        max_unauthenticated_per_address=a.max_pending_per_address, handshake_timeout=a.handshake_timeout,
        io_timeout=a.timeout or None, idle_timeout=a.idle_timeout or None, keepalive=a.keepalive or None,
        auth_limit=a.auth_limit, auth_window=a.auth_window, state_dir=a.state_dir,
        store=store,
        upstream=a.upstream, peers=a.peer, storage_options=parse_storage_options(a.storage_options) or None,
        fs_workers=a.fs_workers,
    )
    srv.bind()
    cache_store: Any = None
    if a.http_cache:  # the store checked as the server's store sessions check it (no symlink, ours)
        from tb5sync.store import Store

        cache_store = Store(srv.store_dir(create=not a.read_only), read_only=a.read_only)
    cache = _http_cache(a, cache_store, a.http_cache) if a.http_cache else None
    try:
        print(f"tb5sync: serving {srv.root} on {host_port(host, srv.port)}{' (TLS)' if srv.tls else ''}", file=sys.stderr, flush=True)
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()
        if cache is not None:
            _stop_cache(cache)
        if cache_store is not None:
            cache_store.close()
    return 0


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _verbose_names(itemized: Sequence[str]) -> list[str]:
    """What rsync ``-v`` lists of a run whose ``-i`` lines are ``itemized``: each entry created, file
    sent, symlink or hard link changed and directory touched (``deleting PATH`` for deletions), without
    the change codes; a file whose attributes alone changed is not listed (rsync's "significant" items,
    as :func:`tb5sync.tree.plan.dry_run_changes` lists them for ``-n``)."""
    from tb5sync.tree.plan import NONEMPTY

    out = []
    for line in itemized:
        code, path = line[:11], line[12:]
        if line.startswith(NONEMPTY):
            out.append(line)  # rsync prints it at any verbosity
        elif code.rstrip() == "*deleting":
            out.append(f"deleting {path}")
        elif code[0] in "c<>h" or code[1] == "d":
            out.append(path)
    return out




def _cmd_sync(a: argparse.Namespace) -> int:
    from tb5sync.tree.options import LINK_OPTIONS
    from tb5sync.api.sync import sync

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

    from tb5sync.errors import PartialTransferError

    partial: PartialTransferError | None = None
    names = bool(a.verbose) and not a.itemize_changes and not a.dry_run and not a.json  # rsync -v's list
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
            state_dir=a.state_dir,
            fsync=a.fsync,
            **{k: getattr(a, k) for k in (*LINK_OPTIONS, "link_dest")},
            token=_read_token(a.token_file, env=False),
            timeout=a.timeout or None,
            tls_ca=a.tls_ca,
            delete_excluded=a.delete_excluded,
            max_delete=None if a.max_delete is None else max(0, a.max_delete),  # rsync: a negative N is 0
            itemize_changes=a.itemize_changes or names,
            update=a.update,
            ignore_existing=a.ignore_existing,
            size_only=a.size_only,
            bwlimit=a.bwlimit,
            mkpath=a.mkpath,  # the CLI: rsync's rule unless --mkpath (the API's default, None, makes parents)
            ip_version=a.ip_version,
            max_entries=a.max_entries,
            max_listing_bytes=a.max_listing_bytes,
        )
    except PartialTransferError as exc:
        partial, stats = exc, exc.stats
    finally:
        if bar is not None:
            bar.close()
    from tb5sync.tree.entry import show_path

    for path, what in stats.skipped:  # rsync without -D: 'skipping non-regular file "p"'
        say(f"tb5sync: skipping non-regular file {show_path(path) or '.'!r} ({what})", sys.stderr)
    for f in stats.failures:  # one line per entry not synced, as rsync names them
        say(f"tb5sync: {f.line()}", sys.stderr)
    if stats.deletes_skipped:  # rsync's words
        print(f"tb5sync: Deletions stopped due to --max-delete limit ({stats.deletes_skipped} skipped)", file=sys.stderr)
    changes = stats.extra.get("changes") if a.dry_run and not a.itemize_changes else None
    if changes is not None:  # names that are not valid UTF-8 printed with \xNN escapes
        changes = {k: v if k == "lines" else [show_path(p) for p in v] for k, v in changes.items()}
    if a.json:
        out = stats.as_dict()
        if changes is not None:
            out["changes"] = changes
        print(json.dumps(out))
    else:
        if a.itemize_changes or names or changes is not None:  # rsync -v / -i / -n -v: "created directory DST" first
            for line in stats.created:
                say(line)
        for line in (_verbose_names(stats.itemized) if names else stats.itemized):  # -i: rsync's lines, dry run or not
            say(line)
        if changes is not None:  # -n: the change list, as rsync -n -v lists it
            if "lines" in changes:
                for line in changes["lines"]:
                    say(line)
            else:  # an older server's push: the paths only
                for path in changes.get("delete", []):
                    say(f"deleting {path}")
                for path in changes.get("transfer", []):
                    say(path)
    if a.stats and not a.json:
        secs = stats.seconds or 1e-9
        prefix = "would transfer" if a.dry_run else "transferred"
        deleted = "would delete" if a.dry_run else "deleted"
        print(f"files: {stats.files_total} total, {stats.files_transferred} {prefix}, {stats.files_deleted} {deleted}")
        print(f"bytes: {_fmt_bytes(stats.bytes_total)} total, {_fmt_bytes(stats.bytes_transferred)} {prefix}")
        print(f"wire: {_fmt_bytes(stats.wire_bytes)}; chunks sent {stats.chunks_sent} "
              f"({_fmt_bytes(stats.bytes_matched)} of them matched in the basis), reused {stats.chunks_reused}")
        print(f"time: {stats.seconds:.3f} s, {stats.bytes_transferred / secs / 1e9:.2f} GB/s")
    if partial is not None:
        what = {24: "some files vanished before they could be transferred",
                25: "the --max-delete limit stopped deletions"}.get(
            partial.exit_code, "some files/attrs were not transferred (see previous errors)")  # rsync's words
        print(f"tb5sync: error: {what} (code {partial.exit_code})", file=sys.stderr)
        return partial.exit_code
    return 0


def _cmd_ls(a: argparse.Namespace) -> int:
    from tb5sync.remote.client import ls, parse_url
    from tb5sync.tree.entry import show_path
    from tb5sync.errors import UsageError

    from tb5sync.wire.urls import with_family

    r = parse_url(a.url)
    if r is None:
        raise UsageError(f"ls needs a tb5:// URL, not {a.url!r}")
    r = with_family(r, a.ip_version)
    entries = ls(r, token=_read_token(a.token_file, env=False), timeout=a.timeout or None, tls_ca=a.tls_ca)
    import stat as _stat

    for e in entries[1:] if entries and entries[0].kind == "d" else entries:
        kind = {"d": _stat.S_IFDIR, "l": _stat.S_IFLNK}.get(e.kind, _stat.S_IFREG)
        when = time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(e.mtime_ns / 1e9))
        name = show_path(e.path or os.path.basename(r.path.rstrip("/")))
        tail = f" -> {show_path(e.target)}" if e.kind == "l" else ""
        say(f"{_stat.filemode(kind | e.mode)} {e.size:>14,} {when} {name}{tail}")
    return 0


def _cmd_bench(a: argparse.Namespace) -> int:
    from tb5sync.api.bench import format_report, run_bench
    from tb5sync.cli.store import parse_size
    from tb5sync.wire.urls import Remote, parse_url, with_family

    r = parse_url(a.host) if "://" in a.host else None
    if r is None:  # the older HOST[:PORT] form
        host, port = _parse_bind(a.host)
        r = Remote(host.strip("[]"), port, "")
    r = with_family(r, a.ip_version)

    def say(line: str) -> None:
        if not a.json:
            print(f"  ... {line}", file=sys.stderr, flush=True)

    res = run_bench(r, token=_read_token(a.token_file, env=False), size=parse_size(a.size), tcp_bytes=parse_size(a.tcp_size),
                    pings=a.pings, directory=a.dir, streams=a.streams, timeout=a.timeout or None, tls_ca=a.tls_ca,
                    progress=say)
    if a.json:
        print(json.dumps(res))
    else:
        for line in format_report(res):
            print(line)
    return 0


def _command_of(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names (one of :data:`COMMANDS`), or None when it names none or
    cannot be told without parsing (then the whole parser is built, as for ``--help``).

    Skips the global options before it (``-v``, ``--hash-threads N``, ``--chunk-threads N``,
    ``--opt=value``); an abbreviated option taking a value makes its value look like the
    command, which is then not one of :data:`COMMANDS`: None, and argparse decides.
    """
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return argv[i + 1] if i + 1 < len(argv) and argv[i + 1] in COMMANDS else None
        if arg.startswith("-"):
            i += 2 if arg in ("--hash-threads", "--chunk-threads") else 1
            continue
        return arg if arg in COMMANDS else None
    return None


#: The options of ``tb5sync`` itself (before the command); ``_TAKES_VALUE`` take one.
_GLOBAL = ("-v", "--verbose", "--version", "-h", "--help", "--hash-threads", "--chunk-threads")
_TAKES_VALUE = ("--hash-threads", "--chunk-threads")


def _misplaced_before_command(argv: Sequence[str]) -> str | None:
    """The one-line error for an option of a command given before it (``tb5sync --store DIR store
    ls``: argparse would take ``DIR`` for the command), naming where it goes; None otherwise."""
    first: str | None = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return None
        if arg.startswith("-") and len(arg) > 1:
            name = arg.split("=", 1)[0]
            full = [g for g in _GLOBAL if g == name or (name.startswith("--") and len(name) > 2 and g.startswith(name))]
            if full or (len(arg) > 1 and set(arg[1:]) == {"v"}):  # -vv
                i += 2 if full and full[0] in _TAKES_VALUE and "=" not in arg else 1
                continue
            first = first or name
        elif arg in COMMANDS:
            if first is None:
                return None
            return f"{first} is not an option of tb5sync itself: put it after the command (tb5sync {arg} {first} ...)"
        i += 1
    return None


def _negative_values_joined(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``argv`` with ``--opt -N`` written ``--opt=-N`` for each option taking a value: argparse reads
    ``-N`` as an option once a parser has options that look like negative numbers (``-4``, ``-6``),
    while rsync takes ``--max-delete -1`` (as 0)."""
    import re

    acts: dict[str, argparse.Action] = {}
    todo = [parser]
    while todo:
        q = todo.pop()
        acts.update(q._option_string_actions)
        todo += [c for a in q._actions if isinstance(a, argparse._SubParsersAction) for c in a.choices.values()]
    out: list[str] = []
    i = 0
    while i < len(argv):
        act = acts.get(argv[i])
        if (act is not None and act.nargs is None and i + 1 < len(argv)
                and re.fullmatch(r"-(\d+\.?\d*|\.\d+)", argv[i + 1]) and argv[i].startswith("--")):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (also used as the console script)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    misplaced = _misplaced_before_command(argv)
    if misplaced:
        sys.stderr.write(f"tb5sync: error: {misplaced}\n")
        return 2
    parser = build_parser(_command_of(argv))
    argv = _negative_values_joined(parser, argv)
    if "sync" in argv:  # rsync's bare --compress (no value): lz4
        argv = [("--compress=lz4" if x == "--compress" and (i + 1 == len(argv) or argv[i + 1] not in ("auto", "lz4", "none"))
                 else x) for i, x in enumerate(argv)]
    if "store" in argv and _command_of(argv) == "store":  # store -m d put ...: where -m goes, in one line
        from tb5sync.cli.store import misplaced_before_subcommand

        where = misplaced_before_subcommand(parser, argv[argv.index("store") + 1:])
        if where:
            parser.exit(2, f"tb5sync: error: {where}\n")
    a, extras = parser.parse_known_args(argv)
    if a.command == "sync":
        extras = _spaced_options(argv, [x for x in (a.src, a.dst) if x is not None] + extras) + extras
        if extras:  # an rsync option tb5sync does not take: one line naming it, not the usage
            parser.exit(2, f"tb5sync: error: {_unsupported_sync_options(extras)}\n")
        if a.src is None or a.dst is None:
            if a.human_readable and a.src is None:  # rsync -h alone: the help
                a.sync_parser.print_help()
                return 0
            parser.exit(2, "tb5sync: error: tb5sync sync needs SRC and DST\n")
    elif extras:
        if a.command == "store":  # an option of the subcommand given before it: say where it goes
            from tb5sync.cli.store import misplaced_store_option

            where = misplaced_store_option(parser, extras, a.store_command)
            if where:
                parser.exit(2, f"tb5sync: error: {where}\n")
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    level = logging.WARNING - 10 * min(a.verbose, 2)
    logging.basicConfig(level=level, format="tb5sync: %(message)s", stream=sys.stderr)
    for h in logging.getLogger().handlers:  # log lines quote peers' names and messages: escaped as every line
        h.setFormatter(_EscapedFormatter("tb5sync: %(message)s"))
    from tb5sync.errors import Tb5syncError

    def _cmd_store(a: argparse.Namespace) -> int:
        from tb5sync.cli.store import run_store

        return run_store(a, _read_token)

    handlers = {"serve": _cmd_serve, "sync": _cmd_sync, "ls": _cmd_ls, "bench": _cmd_bench, "store": _cmd_store,
                "http-cache": _cmd_http_cache}
    # a daemon stops on SIGINT or SIGTERM (exit 0) and ignores no signal it was started with;
    # SIGHUP is left to the daemon's caller (nohup), as before
    restore = _interrupt_on_signals(("SIGINT", "SIGTERM") if a.command in ("serve", "http-cache") else _SIGNALS)
    try:
        from tb5sync.engine.hashing import check_environment

        check_environment()  # a bad $TB5SYNC_HASH_THREADS is reported now, not at the first large file
        if a.hash_threads:
            from tb5sync.engine.hashing import set_hash_threads

            set_hash_threads(a.hash_threads)
        if a.chunk_threads:
            from tb5sync.engine.hashing import set_chunk_threads

            set_chunk_threads(a.chunk_threads)
        return handlers[a.command](a)
    except Tb5syncError as exc:
        say(f"tb5sync: error: {exc}", sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # SIGINT, SIGTERM or SIGHUP: what was being written was removed on the way out
        if a.command in ("serve", "http-cache"):  # a daemon asked to stop (even before it served): status 0
            return 0
        print(f"tb5sync: error: {INTERRUPTED}", file=sys.stderr)
        return 20
    except BrokenPipeError:  # output piped into e.g. `head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except OSError as exc:
        say(f"tb5sync: error: {exc.strerror or exc}{': ' + str(exc.filename) if exc.filename else ''}", sys.stderr)
        return 11
    finally:
        for signum, handler in restore.items():
            signal.signal(signum, handler)


#: rsync's words for a run ended by a signal (exit code 20, as rsync's).
INTERRUPTED = "received SIGINT, SIGTERM, or SIGHUP (code 20)"


#: The signals that end a command (rsync's SIGINT, SIGTERM and SIGHUP).
_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")


def _interrupt_on_signals(names: tuple[str, ...] = _SIGNALS) -> dict[int, Any]:
    """Make each signal of ``names`` (signal names such as ``"SIGTERM"``) end the command as
    Ctrl-C does (a ``KeyboardInterrupt`` in the main thread: temporary files are removed and
    connections closed on the way out, then exit 20 with rsync's message, 0 for a daemon);
    returns the previous handlers, for :func:`main` to put back.

    SIGINT is installed too, as rsync installs its handler regardless: a shell script's
    background job (``tb5sync sync ... &``) starts with SIGINT ignored, and Python then
    installs no handler of its own, so ``kill -INT`` did nothing. Nothing when not called
    from the main thread (a caller embedding :func:`main`) or where a signal does not exist
    (SIGHUP on Windows)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old = {}
    for name in names:
        signum = getattr(signal, name, None)
        if signum is not None:
            old[signum] = signal.signal(signum, interrupt)
    return old


def run() -> NoReturn:
    """The console script (and ``python -m tb5sync.cli.command``): :func:`main`, then exit at once.

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
