"""Garbage collection, repacking, verification and quota eviction of an artifact store.

gc (one at a time per store: ``flock`` on ``STORE/gc.lock``; writers never wait for it):

1. Mark, outside any transaction: every chunk reachable from the refs of the moment
   (manifest chunks and file chunks). In a format v2 store a chunk kept as a recipe marks its
   pieces through the recipe (in the sweep's transaction, from the ``recipes`` rows of that moment).
2. Sweep (the pack files on disk listed first), in one ``BEGIN IMMEDIATE`` transaction: mark what refs created since step 1 reach and
   every chunk held by a live lease (a writer that found it indexed, or wrote it, records it in the
   same transaction, so a writer either sees the chunk gone and writes it again, or holds it
   before the sweep looks); mark the pieces of every marked recipe (a v2 writer holds the pieces
   it found indexed under its lease, and indexes a recipe in the same transaction as its last new
   pieces, so a recipe never names a piece that the sweep could miss); delete the index rows of
   unmarked chunks, recipes and pieces, and the rows of packs left without any frame. Only after the commit are those pack files deleted.
3. Orphans: pack files on disk that no pack row and no live lease names (a writer killed between
   putting its pack in place and indexing it), and temporary files of processes that are gone.
4. Repack: packs whose live bytes are below ``repack_below`` of their size (and small packs, when
   there are several) have their live chunks copied, each re-checked, into new packs; the index
   rows move to the new pack in one transaction, then the old pack is deleted. A reader that
   looked a chunk up before the move and finds the old pack gone looks it up again.

A crash at any step leaves either the old state or the new one, plus at most files that the
next gc removes: nothing a ref reaches is deleted before its replacement is indexed.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from tb5sync.errors import IntegrityError
from tb5sync.engine.hashing import chunk_digest
from tb5sync.store.packs import FRAME_HEADER, iter_frames
from tb5sync.store.pieces import PIECE_PARAMS_V1, blob_to_recipe, parse_recipe_record, recipe_shape_error, record_digest
from tb5sync.store.writer import LEASE_TTL, PackWriter

if TYPE_CHECKING:
    from tb5sync.store.index import StoreCore as Store

__all__ = ["gc", "verify", "reindex", "enforce_quota", "gc_lock", "QUOTA_LOW_WATER"]

#: Over its quota, a store is evicted down to this fraction of it (the low-water mark), so the
#: entries that follow fit without an eviction each.
QUOTA_LOW_WATER = 0.9

log = logging.getLogger(__name__)


@contextlib.contextmanager
def gc_lock(store: Store) -> Iterator[None]:
    """Hold the store's gc lock (``flock(LOCK_EX)`` on ``STORE/gc.lock``; released when the process dies)."""
    fd = os.open(os.path.join(store.path, "gc.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _reach(store: Store, manifest: bytes, mchunks: bytes, cache: dict[bytes, set[bytes]],
           parallel: bool = True) -> set[bytes]:
    from tb5sync.engine.hashing import blob_to_refs

    got = cache.get(manifest)
    if got is None:
        refs = blob_to_refs(mchunks)
        items = store.read_manifest(manifest, refs, f"manifest {manifest.hex()}", parallel)
        got = {d for d, _ in refs}
        for it in items:
            got.update(d for d, _ in it.chunks)
        cache[manifest] = got
    return got


def _expand(rows: Iterable[Any], marked: set[bytes]) -> int:
    """Add to ``marked`` the pieces of every recipe in ``rows`` (``(digest, pieces blob)``) whose
    chunk is marked, and its recipe record; returns how many recipes were marked. A recipe's pieces
    are frames, never recipes themselves (:mod:`tb5sync.store.pieces`), so one pass is enough."""
    n = 0
    for d, blob in rows:
        if bytes(d) in marked:
            b = bytes(blob)
            marked.update(b[k : k + 32] for k in range(0, len(b), 36))
            marked.add(record_digest(bytes(d), b))  # and its record frame (pieces.recipe_record)
            n += 1
    return n


def _blob_chunks(rows: Iterable[Any]) -> set[bytes]:
    """Every chunk digest the keyed blobs of ``rows`` (``(chunks blob,)`` rows) reference."""
    out: set[bytes] = set()
    for (chunks,) in rows:
        b = bytes(chunks)
        out.update(b[k : k + 32] for k in range(0, len(b), 36))
    return out


def gc(store: Store, repack_below: float = 0.5) -> dict[str, Any]:
    """Collect what no ref and no live writer needs; repack sparse packs. See the module docstring.

    Parameters
    ----------
    repack_below : float
        A pack whose live bytes are less than this fraction of its data is repacked
        (0 never, 1.0 any pack holding dead bytes).

    Returns
    -------
    dict
        ``chunks_deleted`` (pack frames: whole chunks and, format v2, pieces), ``pieces_deleted`` (of
        those, the pieces of deleted recipes), ``recipes_deleted`` (format v2), ``packs_deleted``, ``packs_repacked``, ``bytes_freed`` (bytes), ``orphans``,
        ``blocked_by``: the live writer leases that kept chunks no ref reaches, ``{"lease", "owner"
        (host:pid), "since", "expires" (s since the epoch, unless the writer touches it again), "chunks"}``.

    Raises
    ------
    IntegrityError
        A ref's manifest cannot be read (nothing is deleted then: a damaged store is not swept).
    """
    with gc_lock(store):
        cache: dict[bytes, set[bytes]] = {}
        marked: set[bytes] = set()
        for manifest, mchunks in store._q("SELECT manifest, mchunks FROM refs"):
            marked |= _reach(store, bytes(manifest), bytes(mchunks), cache)
        marked |= _blob_chunks(store._q("SELECT chunks FROM blobs"))
        dead_packs: list[str] = []
        # Listed before the sweep: a pack on disk now either is indexed, or is named by a lease
        # (written before its rename, so visible to the transaction below), or is an orphan.
        on_disk = store.packs.list()
        with store._tx(durable=True) as db:
            # the dead leases go first: what they held is free now
            live = set(store.live_leases(db))
            for (lid,) in list(db.execute("SELECT id FROM leases")):
                if lid not in live:
                    for t in ("lease_chunks", "lease_packs"):
                        db.execute(f"DELETE FROM {t} WHERE lease=?", (lid,))
                    db.execute("DELETE FROM leases WHERE id=?", (lid,))
            for manifest, mchunks in list(db.execute("SELECT manifest, mchunks FROM refs")):
                # refs made since the mark: read in this thread, which holds the index lock
                marked |= _reach(store, bytes(manifest), bytes(mchunks), cache, parallel=False)
            marked |= _blob_chunks(db.execute("SELECT chunks FROM blobs"))
            _expand(db.execute("SELECT digest, pieces FROM recipes"), marked)
            # what only a live writer's lease keeps (reported: who held back what gc would have taken)
            held: dict[str, int] = {}
            for lid, d in db.execute("SELECT lease, digest FROM lease_chunks"):
                if bytes(d) not in marked:
                    held[lid] = held.get(lid, 0) + 1
            marked.update(bytes(d) for (d,) in db.execute("SELECT digest FROM lease_chunks"))
            _expand(db.execute("SELECT digest, pieces FROM recipes"), marked)  # recipes a live writer holds
            blocked_by = []
            for lid, host, pid, started, touched in db.execute("SELECT id, host, pid, started, touched FROM leases"):
                if held.get(lid):
                    blocked_by.append({"lease": lid, "owner": f"{host}:{pid}", "since": started,
                                       "expires": touched + LEASE_TTL, "chunks": held[lid]})
            dead = [bytes(d) for (d,) in db.execute("SELECT digest FROM chunks") if bytes(d) not in marked]
            db.executemany("DELETE FROM chunks WHERE digest=?", [(d,) for d in dead])
            dead_recipes: list[bytes] = []
            dead_pieces: set[bytes] = set()
            for d, blob in db.execute("SELECT digest, pieces FROM recipes"):
                if bytes(d) not in marked:
                    dead_recipes.append(bytes(d))
                    bb = bytes(blob)
                    dead_pieces.update(bb[k : k + 32] for k in range(0, len(bb), 36))
            db.executemany("DELETE FROM recipes WHERE digest=?", [(d,) for d in dead_recipes])
            pieces_deleted = sum(1 for d in dead if d in dead_pieces)
            for (pack,) in list(db.execute("SELECT id FROM packs WHERE id NOT IN (SELECT DISTINCT pack FROM chunks)")):
                db.execute("DELETE FROM packs WHERE id=?", (pack,))
                dead_packs.append(pack)
            known = {p for (p,) in db.execute("SELECT id FROM packs")}
            known.update(p for (p,) in db.execute("SELECT pack FROM lease_packs"))
            alive_pids = {int(pid) for (pid,) in db.execute("SELECT pid FROM leases WHERE host=?", (store.host,))}
        freed = 0
        for pack in dead_packs:
            freed += on_disk.get(pack, (0, 0.0))[0]
            store.packs.delete(pack)
        orphans = 0
        for pack, (size, mtime) in on_disk.items():
            if pack not in known and pack not in dead_packs:
                store.packs.delete(pack)
                freed += size
                orphans += 1
        for name in os.listdir(store.tmp_dir):
            pid = name.split("-", 1)[0]
            if pid.isdigit() and int(pid) not in alive_pids and (int(pid) != os.getpid()):
                from tb5sync.store.writer import _pid_alive

                if not _pid_alive(int(pid)):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(store.tmp_dir, name))
        # repack
        rows = store._q("SELECT p.id, p.size, COALESCE(SUM(c.length + ?), 0), COUNT(c.digest) FROM packs p "
                        "LEFT JOIN chunks c ON c.pack = p.id GROUP BY p.id", (FRAME_HEADER,))
        sparse = [r for r in rows if r[1] > 8 and r[2] < repack_below * (r[1] - 8)]
        small = [r for r in rows if r[1] < store.pack_target // 4 and r not in sparse]
        victims = [r[0] for r in sparse] + ([r[0] for r in small] if len(small) >= 4 else [])
        repacked = 0
        if victims:
            lease = store.lease()
            writer = PackWriter(store, lease)
            try:
                moved: list[tuple[str, bytes]] = []
                for pack in victims:
                    for digest, _off, _len in store._q("SELECT digest, offset, length FROM chunks WHERE pack=?", (pack,)):
                        try:
                            data = store.read_chunk(bytes(digest))
                        except IntegrityError as exc:
                            log.warning("gc: not moving a damaged chunk: %s", exc)
                            continue
                        writer.add_frame(bytes(digest), data)  # a frame as it is (v2: a piece, never re-cut)
                        moved.append((pack, bytes(digest)))
                writer.flush()
                where = {d: (p, off) for d, p, off, _ in writer.placed}
                gone = []
                with store._tx(durable=True) as db:
                    for old, d in moved:
                        new, off = where[d]
                        db.execute("UPDATE chunks SET pack=?, offset=? WHERE digest=? AND pack=?", (new, off, d, old))
                    for pack in victims:
                        if db.execute("SELECT 1 FROM chunks WHERE pack=? LIMIT 1", (pack,)).fetchone() is None:
                            db.execute("DELETE FROM packs WHERE id=?", (pack,))
                            gone.append(pack)
                    for p in {p for _, p, _, _ in writer.placed}:
                        if db.execute("SELECT 1 FROM chunks WHERE pack=? LIMIT 1", (p,)).fetchone() is None:
                            db.execute("DELETE FROM packs WHERE id=?", (p,))
                            gone.append(p)
                for pack in gone:
                    freed += on_disk.get(pack, (0, 0.0))[0]
                    store.packs.delete(pack)
                    repacked += 1
            finally:
                writer.abort()
                lease.release()
        return {"chunks_deleted": len(dead), "pieces_deleted": pieces_deleted, "recipes_deleted": len(dead_recipes),
                "packs_deleted": len(dead_packs), "packs_repacked": repacked,
                "bytes_freed": freed, "orphans": orphans, "blocked_by": blocked_by}


def verify(store: Store) -> dict[str, Any]:
    """Re-hash every chunk of every pack; check the index against the packs; report per ref.

    Holds the gc lock (a concurrent gc would make packs vanish under the check).

    Returns
    -------
    dict
        ``{"ok": bool, "chunks": indexed chunks checked (``stats()["chunks"]`` when nothing changed meanwhile),
        "frames": pack frames read (more than ``chunks`` when a pack holds a frame gc unindexed or a
        chunk twice), "packs": packs read, "bytes": n read, "damaged_chunks": [hex...],
        "missing_chunks": [hex...], "bad_packs": {pack: reason}, "refs": {name: {"ok", "missing", "damaged"}}}``.
        A ref is whole when its manifest and every chunk it reaches are present and intact (format
        v2: a chunk kept as a recipe, when every piece it names is; ``damaged_chunks`` then names
        the damaged pieces, ``missing_chunks`` also pieces a recipe names that are not indexed).
    """
    with gc_lock(store):
        return _verify(store)


#: Rows read at a time when verify walks the index (packs, recipes), and digests per ``IN`` query.
VERIFY_WINDOW = 500


def _indexed(store: Store, digests: Sequence[bytes]) -> set[bytes]:
    """Which of ``digests`` have a frame in the index (one query per :data:`VERIFY_WINDOW`)."""
    out: set[bytes] = set()
    for k in range(0, len(digests), VERIFY_WINDOW):
        part = digests[k : k + VERIFY_WINDOW]
        out.update(bytes(d) for (d,) in store._q(
            f"SELECT digest FROM chunks WHERE digest IN ({','.join('?' * len(part))})", part))
    return out


def _verify(store: Store) -> dict[str, Any]:
    """:func:`verify`'s walk, in memory bounded by a pack, a window of the index and what is wrong:
    packs one at a time with their own index rows, recipes and each ref's chunks in windows of
    :data:`VERIFY_WINDOW`; only the damaged and missing digests are kept for the whole run."""
    damaged: set[bytes] = set()
    missing: set[bytes] = set()  # indexed but not found intact where the index says, or named and not indexed
    bad_packs: dict[str, str] = {}
    frames = nbytes = checked = npacks = 0
    # the refs as they are before the walk: every chunk and recipe they reach was indexed before it
    # (a ref is committed after its chunks), so the walk and the recipe scan below see them all
    ref_infos = store.refs()
    last = ""
    while True:
        page = [p for (p,) in store._q("SELECT id FROM packs WHERE id > ? ORDER BY id LIMIT ?", (last, VERIFY_WINDOW))]
        if not page:
            break
        last = page[-1]
        for pack in page:
            npacks += 1
            rows = {bytes(d): (off, n) for d, off, n in
                    store._q("SELECT digest, offset, length FROM chunks WHERE pack=?", (pack,))}
            seen: set[bytes] = set()
            try:
                data = _read_pack(store, pack)
            except (OSError, IntegrityError) as exc:
                bad_packs[pack] = str(exc)
                missing.update(rows)
                continue
            nbytes += len(data)
            try:
                for digest, off, n in iter_frames(data, f"pack {pack}"):
                    frames += 1
                    ok = chunk_digest(memoryview(data)[off : off + n]) == digest
                    loc = rows.get(digest)
                    if loc is not None and loc[0] == off and digest not in seen:
                        seen.add(digest)
                        checked += 1
                        if not ok:
                            damaged.add(digest)
            except IntegrityError as exc:
                bad_packs[pack] = str(exc)
            missing.update(d for d in rows if d not in seen)
            del data
    # frames indexed in a pack the index does not list
    missing.update(bytes(d) for (d,) in store._q("SELECT digest FROM chunks WHERE pack NOT IN (SELECT id FROM packs)"))
    lastd = b""
    while True:  # a recipe naming a piece that is not indexed
        page = [(bytes(d), bytes(b)) for d, b in store._q(
            "SELECT digest, pieces FROM recipes WHERE digest > ? ORDER BY digest LIMIT ?", (lastd, VERIFY_WINDOW))]
        if not page:
            break
        lastd = page[-1][0]
        named = list(dict.fromkeys(b[k : k + 32] for _, b in page for k in range(0, len(b), 36)))
        have = _indexed(store, named)
        missing.update(p for p in named if p not in have)
    refs: dict[str, dict[str, Any]] = {}
    for info in ref_infos:
        entry: dict[str, Any] = {"ok": True, "missing": 0, "damaged": 0}
        try:
            need = list(_reach(store, info.manifest, b"".join(d + n.to_bytes(4, "little") for d, n in info.mchunks), {}))
        except IntegrityError as exc:
            entry.update(ok=False, error=str(exc))
            refs[info.name] = entry
            continue
        for k in range(0, len(need), VERIFY_WINDOW):
            part = need[k : k + VERIFY_WINDOW]
            framed = _indexed(store, part)
            rest = [d for d in part if d not in framed]
            recipes = {bytes(d): bytes(b) for d, b in store._q(
                f"SELECT digest, pieces FROM recipes WHERE digest IN ({','.join('?' * len(rest))})", rest)} if rest else {}
            for d in part:
                b = recipes.get(d)
                if b is None:  # a frame (or nothing: missing)
                    if d in damaged:
                        entry["damaged"] += 1
                    elif d in missing or d not in framed:
                        entry["missing"] += 1
                    continue
                # a recipe's pieces: one not indexed is in ``missing`` already (the recipe scan)
                parts = [b[j : j + 32] for j in range(0, len(b), 36)]
                if any(p in damaged for p in parts):
                    entry["damaged"] += 1
                elif any(p in missing for p in parts):
                    entry["missing"] += 1
        entry["ok"] = not (entry["missing"] or entry["damaged"])
        refs[info.name] = entry
    ok = not damaged and not missing and not bad_packs and all(r["ok"] for r in refs.values())
    return {"ok": ok, "chunks": checked, "frames": frames, "packs": npacks, "bytes": nbytes,
            "damaged_chunks": sorted(d.hex() for d in damaged), "missing_chunks": sorted(d.hex() for d in missing),
            "bad_packs": bad_packs, "refs": refs}


def reindex(store: Store) -> dict[str, int]:
    """Rebuild the chunk index from the packs themselves (each frame names its digest and length).

    Every frame is re-hashed; intact chunks missing from the index are added (with their pack;
    in a pack cut short, the frames before the cut),
    rows pointing at packs that are gone are dropped. In a format v2 store the recipes are rebuilt
    from their records (:func:`tb5sync.store.pieces.recipe_record`, one frame per recipe): a
    recipe missing from the index is added once every piece it names is indexed and the chunk
    rebuilt from them hashes to its digest (a record of a chunk gc had dropped whose pieces are
    gone, or file data that only looks like a record, adds nothing). Refs are not in the packs:
    they stay as they are. Holds the gc lock. On an object store (pack storage with ``put_index``)
    a pack that had no (readable) index object gets one, ``created`` being the pack's modification
    time.

    Returns
    -------
    dict
        ``packs``, ``chunks_added``, ``recipes_added``, ``rows_dropped``, ``damaged`` (frames whose
        bytes do not match), ``index_objects_written``.
    """
    added = dropped = damaged = written = recipes_added = 0
    # chunk digest -> recipe blobs, from the records found: file data may look like a record of
    # the same chunk, so each is tried in turn until one rebuilds it
    records: dict[bytes, list[bytes]] = {}
    put_index = getattr(store.packs, "put_index", None)
    with gc_lock(store):
        known = {p for (p,) in store._q("SELECT id FROM packs")}
        on_disk = store.packs.list()
        for pack, (size, _) in sorted(on_disk.items()):
            frames: list[tuple[bytes, int, int]] = []
            try:
                data = store.packs.get_range(pack, 0, size)
                frames.extend(iter_frames(data, f"pack {pack}"))  # the frames before a truncated one are kept
            except (OSError, IntegrityError) as exc:
                if not frames:
                    log.warning("reindex: skipping %s: %s", pack, exc)
                    continue
                log.warning("reindex: %s: %d whole frames before it kept", exc, len(frames))
                damaged += 1
            rows = []
            for digest, off, n in frames:
                if chunk_digest(memoryview(data)[off : off + n]) == digest:
                    rows.append((digest, pack, off, n))
                    rec = parse_recipe_record(memoryview(data)[off : off + n]) if store.version >= 2 else None
                    if rec is not None:
                        blobs = records.setdefault(rec[0], [])
                        if rec[1] not in blobs:
                            blobs.append(rec[1])
                else:
                    damaged += 1
            created = on_disk[pack][1] or time.time()
            if put_index is not None and pack not in known:
                put_index(pack, size, created, [[d, o, n] for d, _, o, n in rows])
                written += 1
            with store._tx(durable=True) as db:
                db.execute("INSERT OR IGNORE INTO packs VALUES (?,?,?)", (pack, size, created))
                for r in rows:
                    added += db.execute("INSERT OR IGNORE INTO chunks VALUES (?,?,?,?)", r).rowcount
        with store._tx(durable=True) as db:
            for (pack,) in list(db.execute("SELECT DISTINCT pack FROM chunks")):
                if pack not in on_disk:
                    dropped += db.execute("DELETE FROM chunks WHERE pack=?", (pack,)).rowcount
                    db.execute("DELETE FROM packs WHERE id=?", (pack,))
        have = {bytes(d) for (d,) in store._q("SELECT digest FROM recipes")}
        for d, blobs in records.items():
            if d in have:
                continue
            for blob in blobs:
                pieces = blob_to_recipe(blob)
                why = recipe_shape_error(pieces, store.piece_params or PIECE_PARAMS_V1)
                try:
                    if why is not None:
                        raise IntegrityError(why)
                    store.assemble(d, pieces)  # every piece indexed and intact, and they make chunk d
                except IntegrityError as exc:
                    log.info("reindex: recipe record of chunk %s not used: %s", d.hex(), exc)
                    continue
                break
            else:
                continue
            with store._tx(durable=True) as db:
                recipes_added += db.execute("INSERT OR IGNORE INTO recipes VALUES (?,?,?)",
                                            (d, sum(k for _, k in pieces), blob)).rowcount
    return {"packs": len(on_disk), "chunks_added": added, "recipes_added": recipes_added, "rows_dropped": dropped,
            "damaged": damaged, "index_objects_written": written}


def _read_pack(store: Store, pack: str) -> bytes:
    rows = store._q("SELECT size FROM packs WHERE id=?", (pack,))
    return store.packs.get_range(pack, 0, rows[0][0] if rows else 0)


def enforce_quota(store: Store, keep: str | None = None, keep_blobs: Iterable[str] = (),
                  low_water: float = QUOTA_LOW_WATER) -> list[str]:
    """Once the packs exceed ``store.quota``, evict unpinned refs and keyed blobs, least recently
    used first, until the live data fits ``low_water`` of the quota (the low-water mark).

    The live size of a set of refs and blobs is the bytes of the distinct chunks they reach, framed
    as in a pack (counted incrementally: a chunk stops counting when the last unit reaching it goes).
    Pinned refs, ``keep`` (the ref whose put triggered this) and the blobs ``keep_blobs`` (those
    just written) are never evicted, nor any unit used at or after the earliest of them (a run
    that starts late never takes an entry acknowledged after its trigger; that entry's own run
    does what is needed): an entry never evicts itself, and evicts only the least recently used
    units it needs to. Refs and blobs are removed first, then :func:`gc` with
    ``repack_below=1.0`` deletes and repacks, so a ref or blob left in the store never points at a
    missing chunk. A quota that pinned refs (and the kept units) alone exceed is logged and left
    exceeded; entries that can never fit are refused before they are stored
    (:func:`tb5sync.store.index.check_entry_fits`).

    Parameters
    ----------
    low_water : float
        Fraction of the quota to evict down to (0 < low_water <= 1).

    Returns
    -------
    list of str
        The evicted ref names, and the evicted blob keys as ``"blob:" + key``.
    """
    quota = store.quota
    if quota is None:
        return []
    stored = store.stats()["stored_bytes"]
    if stored <= quota:
        return []
    sizes = {bytes(d): n + FRAME_HEADER for d, n in store._q("SELECT digest, length FROM chunks")}
    recipe_rows = store._q("SELECT digest, pieces FROM recipes")
    cache: dict[bytes, set[bytes]] = {}
    # units: (last_used, kind, name, pinned, chunks reached)
    units: list[tuple[float, str, str, bool, set[bytes]]] = []
    blob_seen: dict[str, float] = {}
    for info in store.refs():
        try:
            reach = _reach(store, info.manifest, b"".join(d + n.to_bytes(4, "little") for d, n in info.mchunks), cache)
        except IntegrityError:
            reach = set()
        if recipe_rows:  # format v2: what a ref reaches is its chunks' pieces too
            reach = set(reach)
            _expand(recipe_rows, reach)
        units.append((info.last_used, "ref", info.name, info.pinned or info.name == keep, reach))
    kept = set(keep_blobs)
    for key, chunks, last_used in store._q("SELECT key, chunks, last_used FROM blobs"):
        breach = _blob_chunks([(chunks,)])
        if recipe_rows:
            _expand(recipe_rows, breach)
        units.append((last_used, "blob", key, key in kept, breach))
        blob_seen[key] = last_used
    holders: dict[bytes, int] = {}
    for u in units:
        for d in u[4]:
            holders[d] = holders.get(d, 0) + 1
    live = sum(sizes.get(d, 0) for d in holders) + 8
    evicted: list[str] = []
    blobs_out: list[str] = []
    target = int(quota * min(1.0, max(0.0, low_water)))
    # What triggered this run is kept, and so is everything used at or after it: an eviction that
    # runs late (after later writes were acknowledged) never takes an entry newer than its trigger.
    triggers = [u[0] for u in units if (u[1] == "ref" and u[2] == keep) or (u[1] == "blob" and u[2] in kept)]
    newer_than = min(triggers) if triggers else None
    for last_used, kind, name, pinned, reach in sorted(units, key=lambda u: u[0]):
        if live <= target or (newer_than is not None and last_used >= newer_than):
            break
        if pinned:
            continue
        for d in reach:
            holders[d] -= 1
            if not holders[d]:
                live -= sizes.get(d, 0)
        if kind == "ref":
            evicted.append(name)
        else:
            blobs_out.append(name)
    for name in evicted:
        with contextlib.suppress(Exception):
            store.rm(name)
    if evicted or blobs_out:  # named where the user sees it (the CLI's stderr, a server's log), as restic's forget does
        log.warning("store %s: over the quota of %d bytes: evicted %s, least recently used first%s", store.path, quota,
                    ", ".join(f"ref {n}" for n in evicted) or "no ref",
                    f" (and {len(blobs_out)} keyed blobs)" if blobs_out else "")
    for k in range(0, len(blobs_out), 500):
        part = blobs_out[k : k + 500]
        with store._tx() as db:
            # a blob used or rewritten since it was looked at stays (its last_used moved)
            db.executemany("DELETE FROM blobs WHERE key=? AND last_used=?", [(b, blob_seen[b]) for b in part])
    if evicted or blobs_out or stored > quota:
        store.gc(repack_below=1.0)
    if live > quota:
        log.warning("store %s: pinned refs (and the newest) take %d bytes, more than the quota of %d",
                    store.path, live, quota)
    return evicted + ["blob:" + b for b in blobs_out]
