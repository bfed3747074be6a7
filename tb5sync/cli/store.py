"""``tb5sync store ...``: the artifact store's commands (see :mod:`tb5sync.store`).

``tb5sync store [--store DIR] put REF DIR|FILE``, ``get REF DEST``, ``cat REF PATH``, ``ls [PREFIX]``,
``rm REF... [--force]``, ``diff REF1 REF2``, ``pin REF``, ``unpin REF``, ``verify``, ``gc``, ``stats``, ``reindex``,
``quota [SIZE|none]``, ``push REF tb5://HOST[:PORT]``, ``pull REF tb5://HOST[:PORT]``,
``pull REF --from SRC [--from SRC...]`` (every source at once, disjoint chunk sets: :mod:`tb5sync.remote.fanout`).
The store is ``--store DIR`` or ``--store URL`` (``s3://bucket/prefix``, any fsspec URL: an
:class:`~tb5sync.store.objstore.ObjectStore`; s3fs reads credentials and endpoint from the AWS_*
variables, or ``--storage-option KEY=VALUE``), else ``$TB5SYNC_STORE``, else ``tb5sync/store`` in the user's data
directory. ``--json`` prints data as JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Any

from tb5sync._os.terminal import say

__all__ = ["add_store_parser", "run_store", "parse_size"]

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``"500M"``, ``"2G"``, ``"1.5T"``, ``"1000"`` -> bytes (binary units, an optional ``iB``/``B``).

    Raises
    ------
    UsageError
        Not a size.
    """
    from tb5sync.errors import UsageError

    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", text)
    if not m:
        raise UsageError(f"bad size {text!r} (expected e.g. 500M, 20G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def add_store_parser(sub: Any, common: argparse.ArgumentParser, *, full: bool = True) -> None:
    """Add the ``store`` command and its subcommands to ``sub`` (the CLI's subparsers);
    with ``full`` False, the command by name and help alone (another command is being run)."""
    s = sub.add_parser("store", help="the artifact store: put, get, push and pull named snapshots", parents=[common])
    if not full:
        return
    _store_options(s, after=False)
    s.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS, help="more log output (-vv for debug)")
    # The same options are taken after the subcommand too (store ls --store DIR), as the global
    # -v/--hash-threads/--chunk-threads: there they override (--storage-option adds).
    after = argparse.ArgumentParser(add_help=False, parents=[common])
    after.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS, help="more log output (-vv for debug)")
    _store_options(after, after=True)
    ss = s.add_subparsers(dest="store_command", required=True)

    def cmd(name: str, help_: str, json_: bool = False) -> argparse.ArgumentParser:
        q = ss.add_parser(name, help=help_, description=help_[0].upper() + help_[1:] + ".", parents=[after])
        if json_:
            q.add_argument("--json", action="store_true", help="print the result as JSON")
        return q

    q = cmd("put", "store a directory or file as REF (the same content again: nothing to do)", True)
    q.add_argument("ref")
    q.add_argument("src")
    q.add_argument("-m", "--description", help="a description kept with the ref")
    q.add_argument("--force", action="store_true", help="replace REF if it exists")
    q.add_argument("--exclude", action="append", default=[], metavar="PAT", help="rsync-style exclude pattern (repeatable)")
    q = cmd("get", "materialise REF at DEST (atomically, rsync -a metadata)")
    q.add_argument("ref")
    q.add_argument("dest")
    q.add_argument("--force", action="store_true", help="replace DEST if it exists")
    q.add_argument("--hardlink", action="store_true", help="hard-link files with equal content, mode and mtime")
    q = cmd("cat", "write a file of REF to stdout")
    q.add_argument("ref")
    q.add_argument("path", nargs="?", default="")
    q.add_argument("--offset", type=int, default=0, help="first byte")
    q.add_argument("--length", type=int, default=None, help="bytes to write (default: to the end)")
    q = cmd("ls", "list refs (name prefix match)", True)
    q.add_argument("prefix", nargs="?", default="")
    q.add_argument("--url", metavar="tb5://HOST[:PORT]", help="list a server's store instead")
    q.add_argument("--token-file")
    add_family_options(q)
    q = cmd("rm", "remove refs (their chunks go at the next gc); a pinned ref only with --force")
    q.add_argument("refs", nargs="+", metavar="REF")
    q.add_argument("--force", action="store_true", help="remove pinned refs too")
    q = cmd("diff", "paths that differ between two refs (+ added, - removed, M content, m metadata)", True)
    q.add_argument("ref1")
    q.add_argument("ref2")
    for name, what in (("pin", "protect REF from quota eviction, gc and rm (rm --force still removes it)"),
                       ("unpin", "let REF be evicted and removed again")):
        q = cmd(name, what)
        q.add_argument("refs", nargs="+", metavar="REF")
    cmd("verify", "re-hash every chunk; report damage per ref (exit 13 on damage)", True)
    q = cmd("gc", "delete unreferenced chunks, repack sparse packs", True)
    q.add_argument("--repack-below", type=float, default=0.5, metavar="F",
                   help="repack packs whose live bytes are below this fraction (default 0.5)")
    q.add_argument("--grace", type=float, default=None, metavar="SECONDS",
                   help="object store only: spare packs indexed less than this long ago (default 3600)")
    cmd("stats", "logical and stored bytes, dedup ratio, packs", True)
    cmd("reindex", "rebuild the chunk index from the packs (after a lost or damaged index)", True)
    cmd("upgrade", "move a format v1 store to format v2 (new chunks kept as 16 KiB pieces; old ones stay readable)", True)
    q = cmd("quota", "show or set the size quota (LRU eviction of unpinned refs)")
    q.add_argument("size", nargs="?", help="e.g. 200G, or none")
    for name, what in (("push", "send REF to a server's store"), ("pull", "fetch REF from a server's store")):
        q = cmd(name, what, True)
        q.add_argument("ref")
        q.add_argument("url", help="tb5://HOST[:PORT]", nargs="?" if name == "pull" else None)
        if name == "pull":
            q.add_argument("--from", dest="sources", action="append", default=[], metavar="SRC",
                           help="a source to fetch from at the same time as the others (repeatable): tb5://HOST[:PORT], "
                                "s3://bucket/prefix or a store directory; chunks are split between them")
        q.add_argument("--as", dest="as_name", metavar="NAME", help="name the ref gets on the other side")
        q.add_argument("--force", action="store_true", help="replace the ref on the other side if it exists")
        q.add_argument("--streams", type=int, default=4, metavar="N", help="TCP streams (default 4)")
        q.add_argument("--token-file")
        add_family_options(q)


def _store_options(q: argparse.ArgumentParser, *, after: bool) -> None:
    """``store``'s own options: ``--store``, ``--storage-option``, ``--timeout``; ``after``: as a
    subcommand takes them (no defaults: given there, they override those before it)."""
    none = argparse.SUPPRESS if after else None
    q.add_argument("--store", metavar="DIR|URL", default=none,
                   help="store directory or object store URL, e.g. s3://bucket/prefix "
                        "(default: $TB5SYNC_STORE, else the user's data directory)")
    q.add_argument("--storage-option", action="append", default=argparse.SUPPRESS if after else [], metavar="KEY=VALUE",
                   dest="storage_options_after" if after else "storage_options",
                   help="an fsspec storage option for an object store URL (repeatable; e.g. "
                        "endpoint_url=http://127.0.0.1:8333, key=..., secret=...)")
    q.add_argument("--timeout", type=float, default=none, metavar="SECONDS",
                   help="object store: give up on a request with no answer after about SECONDS + 3 "
                        "(3 attempts, each waiting at most SECONDS/6 to connect and per reply; default 60); "
                        "accepted and ignored on a local store (as rclone's --timeout)")


def add_family_options(q: argparse.ArgumentParser) -> None:
    """rsync's ``-4``/``--ipv4`` and ``-6``/``--ipv6`` (``ip_version``: 4, 6 or None; the last given wins)."""
    q.add_argument("-4", "--ipv4", dest="ip_version", action="store_const", const=4, default=None,
                   help="reach the server over IPv4 only")
    q.add_argument("-6", "--ipv6", dest="ip_version", action="store_const", const=6, default=None,
                   help="reach the server over IPv6 only")


#: The options of ``store`` itself (given before the subcommand or after it).
STORE_OPTIONS = ("--store", "--storage-option", "--timeout")


def _store_parsers(parser: argparse.ArgumentParser) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``store`` command's parser and its subcommands' parsers (by name), from the whole parser."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # the command's parsers
    store = sub.choices["store"]
    ssub = next(a for a in store._actions if isinstance(a, argparse._SubParsersAction))
    return store, dict(ssub.choices)


def _where_it_goes(name: str, command: str | None, subs: dict[str, argparse.ArgumentParser]) -> str | None:
    """Where the store subcommands' option ``name`` goes, given before (or outside) ``command``."""
    takers = [n for n, q in subs.items() if name in q._option_string_actions]
    if command in takers:
        return f"{name} is an option of tb5sync store {command}: put it after {command} (tb5sync store {command} ... {name})"
    if takers:
        return f"{name} is an option of tb5sync store {'/'.join(takers)}, not of store {command}" if command else \
            f"{name} is an option of tb5sync store {'/'.join(takers)}: put it after the subcommand"
    return None


def misplaced_store_option(parser: argparse.ArgumentParser, extras: list[str], command: str) -> str | None:
    """The one-line error for ``extras`` (what argparse left of a ``store`` command line) when one
    is an option of a ``store`` subcommand given before it (``store --json ls``): where it goes,
    or which subcommands take it when ``command`` (the one given) does not; None when none is."""
    _, subs = _store_parsers(parser)
    for x in extras:
        name = x.split("=", 1)[0]
        if not name.startswith("-"):
            continue
        where = _where_it_goes(name, command, subs)
        if where:
            return where
    return None


def _known(x: str, acts: dict[str, argparse.Action]) -> tuple[argparse.Action | None, bool]:
    """The action of option argument ``x`` among ``acts`` (a parser's option strings; a unique
    prefix of a long one too, as argparse takes it) and whether ``x`` carries its value."""
    if x.startswith("--"):
        name = x.split("=", 1)[0]
        hits = [name] if name in acts else [o for o in acts if o.startswith("--") and o.startswith(name)]
        act = acts[hits[0]] if len({id(acts[o]) for o in hits}) == 1 else None
        return act, "=" in x
    act = acts.get(x[:2])
    return act, len(x) > 2


def misplaced_before_subcommand(parser: argparse.ArgumentParser, args: list[str]) -> str | None:
    """The one-line error for an option of a ``store`` subcommand in the wrong place, flag or
    valued: between ``store`` and the subcommand (``store -m d put ...``, ``store --url URL ls``,
    ``store -6 push ...``: argparse would take its value, or ``-6``, for the subcommand and print
    its usage), or after a subcommand that does not take it (``store get -6 r d``). ``args`` is
    what follows ``store`` on the command line; returns None when nothing is misplaced.

    Known options are skipped with their values (``store``'s own before the subcommand, the
    subcommand's after it); the subcommand named is the first argument after the misplaced option
    (and its value, when it takes one there) that names one. Stops at ``--``.
    """
    store, subs = _store_parsers(parser)
    acts = store._option_string_actions
    command: str | None = None
    i = 0
    while i < len(args):
        x = args[i]
        if x == "--":
            return None
        if command is None and x in subs:
            command, acts = x, subs[x]._option_string_actions
            i += 1
            continue
        if not (x.startswith("-") and len(x) > 1):
            if command is None:
                return None  # not a subcommand: argparse says so
            i += 1
            continue
        act, attached = _known(x, acts)
        if act is not None:
            i += 2 if act.nargs != 0 and not attached else 1
            continue
        for cand in dict.fromkeys((x.split("=", 1)[0], x[:2])):
            takers = [q for q in subs.values() if cand in q._option_string_actions]
            if takers:
                if command is None:
                    valued = takers[0]._option_string_actions[cand].nargs != 0 and cand == x
                    command = next((y for y in args[i + (2 if valued else 1):] if y in subs), None)
                return _where_it_goes(cand, command, subs)
        if command is None:
            return None
        i += 1
    return None


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _count(n: int, noun: str) -> str:
    """``1 file``, ``2 files``."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _remote(url: str, ip_version: int | None = None) -> Any:
    from tb5sync.errors import UsageError
    from tb5sync.wire.urls import parse_url, redact_url, with_family

    r = parse_url(url)
    if r is None:
        raise UsageError(f"expected a tb5://HOST[:PORT] URL, not {url!r}")
    if r.path.strip("/"):
        raise UsageError(f"{redact_url(url)}: a server has one store, reached without a path: give "
                         f"tb5://HOST[:PORT] (the ref name says where in the store)")
    return with_family(r, ip_version)


def parse_storage_options(pairs: list[str]) -> dict[str, Any]:
    """``["KEY=VALUE", ...]`` as fsspec storage options; ``endpoint_url`` and ``region_name`` go into
    ``client_kwargs`` (where s3fs takes them); ``true``/``false`` and integers are converted.

    Raises
    ------
    UsageError
        A pair without ``=``.
    """
    from tb5sync.errors import UsageError

    out: dict[str, Any] = {}
    for p in pairs:
        k, eq, v = p.partition("=")
        if not eq or not k:
            raise UsageError(f"--storage-option {p!r}: expected KEY=VALUE")
        val: Any = v
        if v.lower() in ("true", "false"):
            val = v.lower() == "true"
        elif re.fullmatch(r"-?[0-9]+", v):
            val = int(v)
        if k in ("endpoint_url", "region_name"):
            out.setdefault("client_kwargs", {})[k] = val
        else:
            out[k] = val
    return out


def run_store(a: argparse.Namespace, read_token: Any) -> int:
    """Run one ``tb5sync store`` subcommand; returns the exit status."""
    from tb5sync.errors import UsageError
    from tb5sync.store.objstore import open_store
    from tb5sync.store.store import check_ref_name

    c = a.store_command
    opts = parse_storage_options(a.storage_options + getattr(a, "storage_options_after", []))
    out = sys.stdout
    if c == "ls" and a.url:
        from tb5sync.remote.storeclient import remote_refs

        _print_refs(remote_refs(_remote(a.url, a.ip_version), a.prefix, token=read_token(a.token_file)), a.json)
        return 0
    is_url = a.store is not None and "://" in a.store and not a.store.startswith("file://")
    if a.timeout is not None and not is_url:  # as rclone's --timeout on a local remote: nothing to time out
        import logging

        logging.getLogger(__name__).info("store --timeout %g ignored: a local store makes no network requests", a.timeout)
    with open_store(a.store, opts or None, **({"timeout": a.timeout} if a.timeout is not None and is_url else {})) as st:
        if c == "put":
            t0 = time.perf_counter()
            before = st.stats()
            prev = st._ref_row(check_ref_name(a.ref))
            info = st.put(a.ref, a.src, a.description, replace=a.force, exclude=a.exclude)
            dt = time.perf_counter() - t0
            after = st.stats()
            unchanged = prev is not None and info == prev
            res = {**info.as_dict(), "seconds": dt, "new_bytes": after["unique_bytes"] - before["unique_bytes"],
                   "unchanged": unchanged}
            if a.json:
                print(json.dumps(res))
            elif unchanged:
                say(f"{info.name}: same content already; nothing to do")
            else:
                say(f"{info.name}: {_count(info.files, 'file')}, {_fmt(info.size)}, "
                      f"{_fmt(max(0, res['new_bytes']))} new, {dt:.2f} s ({info.size / max(dt, 1e-9) / 1e9:.2f} GB/s)")
        elif c == "get":
            st.get(a.ref, a.dest, replace=a.force, hardlink=a.hardlink)
        elif c == "cat":
            data = st.cat(a.ref, a.path, a.offset, a.length)
            out.buffer.write(data)
            out.buffer.flush()
        elif c == "ls":
            _print_refs(st.refs(a.prefix), a.json)
        elif c == "rm":
            if not a.force:  # every ref checked first: a pinned one among them removes none
                from tb5sync.store.store import pinned_error

                for r in a.refs:
                    if st.ref(r).pinned:
                        raise pinned_error(r, st.label)
            for r in a.refs:
                st.rm(r, force=a.force)
        elif c == "diff":
            d = st.diff(a.ref1, a.ref2)
            if a.json:
                print(json.dumps([{"status": k, "path": p} for k, p in d]))
            else:
                for k, p in d:
                    say(f"{k} {p}")
        elif c in ("pin", "unpin"):
            for r in a.refs:
                st.pin(r, c == "pin")
        elif c == "verify":
            rep = st.verify()
            if a.json:
                print(json.dumps(rep))
            else:
                for name, r in rep["refs"].items():
                    state = "ok" if r["ok"] else f"DAMAGED ({r['missing']} missing, {r['damaged']} damaged chunks)"
                    say(f"{name}: {state}")
                for p, why in rep["bad_packs"].items():
                    say(f"pack {p}: {why}")
                say(f"checked {rep['chunks']} indexed chunks ({rep['frames']} frames in {rep['packs']} packs, "
                      f"{_fmt(rep['bytes'])}): {'ok' if rep['ok'] else 'DAMAGE FOUND'}")
            if not rep["ok"]:
                return 13
        elif c == "gc":
            if a.grace is not None and not hasattr(st, "url"):
                raise UsageError("store gc --grace applies only to an object store (--store URL)")
            res = st.gc(a.repack_below, **({"grace": a.grace} if a.grace is not None else {}))
            if a.json:
                print(json.dumps(res))
            else:
                say(f"deleted {res['chunks_deleted']} chunks, {res['packs_deleted']} packs, repacked "
                      f"{res['packs_repacked']}, removed {res['orphans']} orphans; freed {_fmt(res['bytes_freed'])}")
                for b in res.get("blocked_by") or []:
                    since = _when(b["since"]) if b.get("since") else "?"
                    what = f"kept {b['chunks']} chunks no ref reaches" if "chunks" in b else "stopped the sweep"
                    say(f"writer lease {b['lease']} held by {b.get('owner') or '?'} since {since} (expires "
                          f"{_when(b['expires'])} unless renewed) {what}; run gc again once it is gone",
                          file=sys.stderr)
        elif c == "reindex":
            res = st.reindex()
            print(json.dumps(res) if a.json else
                  f"{res['packs']} packs: {res['chunks_added']} chunks indexed again, {res['recipes_added']} recipes "
                  f"rebuilt, {res['rows_dropped']} rows of missing packs dropped, {res['damaged']} damaged frames")
        elif c == "upgrade":
            res = st.upgrade()
            recs = f"; {res['records_written']} recipe records written" if res.get("records_written") else ""
            print(json.dumps(res) if a.json else
                  (f"store format {res['from']} -> {res['to']}" if res["from"] != res["to"] else
                   f"store format {res['to']} already") + recs)
        elif c == "stats":
            from tb5sync.store.blobs import counters

            s = st.stats()
            s["http_cache"] = counters(st)
            if a.json:
                print(json.dumps(s))
            else:
                report = (f"refs: {s['refs']} ({s['files']} files)\nlogical: {_fmt(s['logical_bytes'])}\n"
                      f"unique: {_fmt(s['unique_bytes'])} in {s['chunks']} indexed chunks\n"
                      f"stored: {_fmt(s['stored_bytes'])} in {s['packs']} packs\ndedup ratio: {s['dedup_ratio']:.2f}"
                      + (f"\nformat: {s['format']}" + (f" ({s['recipes']} chunks kept as recipes of pieces)"
                                                       if s.get("recipes") else ""))
                      + (f"\nquota: {_fmt(s['quota'])}" if s["quota"] is not None else "")
                      + (f"\nkeyed blobs: {s['blobs']} ({_fmt(s['blob_bytes'])})" if s["blobs"] else "")
                      + "".join(f"\nhttp cache {n}: {v:g}" for n, v in s["http_cache"].items()))
                for line in report.split("\n"):  # the store's own lines; say() escapes what each holds
                    say(line)
        elif c == "quota":
            if a.size is not None:
                st.set_quota(None if a.size.lower() == "none" else parse_size(a.size))
                st.enforce_quota()
            print("none" if st.quota is None else _fmt(st.quota))
        elif c == "pull" and a.sources:
            from tb5sync.remote.fanout import pull_fanout

            srcs: list[Any] = list(a.sources) + ([a.url] if a.url else [])
            if a.ip_version is not None:  # -4/-6: the tb5:// sources over that family only
                from tb5sync.remote.fanout import PeerSource
                from tb5sync.wire.urls import with_family

                peers = [PeerSource(x, read_token(a.token_file)) if x.startswith("tb5://") else x for x in srcs]
                for x in peers:
                    if isinstance(x, PeerSource):
                        x.remote = with_family(x.remote, a.ip_version)
                srcs = peers
            res = pull_fanout(st, a.ref, srcs, as_name=a.as_name, replace=a.force, storage_options=opts or None,
                              token=read_token(a.token_file))
            if a.json:
                print(json.dumps(res))
            elif res.get("unchanged"):
                say(f"{res['ref']}: this store has this ref with the same content already; nothing to do")
            else:
                per = ", ".join(f"{k} {_fmt(v['bytes'])}" for k, v in res["sources"].items())
                say(f"{res['ref']}: {res['chunks_fetched']} of {res['chunks']} chunks fetched, "
                      f"{_fmt(res['bytes_fetched'])} in {res['seconds']:.2f} s ({per})")
        elif c in ("push", "pull"):
            from tb5sync.remote.storeclient import pull_ref, push_ref

            if not a.url:
                raise UsageError(f"store {c}: give tb5://HOST[:PORT]" + (" or --from SRC" if c == "pull" else ""))

            fn = push_ref if c == "push" else pull_ref
            res = fn(st, a.ref, _remote(a.url, a.ip_version), token=read_token(a.token_file), streams=a.streams,
                     as_name=a.as_name, replace=a.force)
            if a.json:
                print(json.dumps(res))
            else:
                moved = res.get("bytes_sent", res.get("bytes_fetched", 0))
                n = res.get("chunks_sent", res.get("chunks_fetched", 0))
                if res.get("unchanged"):
                    where = "the server" if c == "push" else "this store"
                    say(f"{res['ref']}: {where} has this ref with the same content already; nothing to do")
                else:
                    npieces = res.get("pieces_sent", res.get("pieces_fetched", 0))
                    some = f" (some as {npieces} pieces)" if npieces else ""
                    say(f"{res['ref']}: {n} of {res['chunks']} chunks {'sent' if c == 'push' else 'fetched'}{some}, "
                          f"{_fmt(moved)} in {res['seconds']:.2f} s")
    return 0


def _print_refs(refs: list[Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps([r.as_dict() for r in refs]))
        return
    for r in refs:
        pin = "P" if r.pinned else "-"
        desc = f"  {r.description}" if r.description else ""
        say(f"{pin} {r.size:>15,} {_when(r.created)} {r.name}{desc}")
