"""The generator: list the source where it differs, plan the sync, apply the plan's non-data parts.

rsync's split, on the receiving side: the generator decides what must change and makes the
tree's shape (deletions, directories, symlinks, modes and mtimes); the receiver
(:mod:`tb5sync.roles.receiver`) moves file data. The listing is fetched from the sender through the
*link* only where it can differ: a directory whose listing digest
(:func:`tb5sync.tree.scan.listing_digest`) is the same on both sides is neither fetched nor planned. The decisions themselves are :func:`tb5sync.tree.plan.plan_sync`'s
(no I/O there).
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future, wait
from typing import Any, NamedTuple

import tb5sync.engine.chunking as chunking
from tb5sync.roles.destination import Destination
from tb5sync.tree.entry import DIR, FILE, LINK, Entry
from tb5sync.errors import DestinationError, PathError, PeerLimitError, RemoteProtocolError, SourceChangedError, Tb5syncError, UsageError
from tb5sync.engine.hashing import chunk_fd, file_digest
from tb5sync.wire.messages import ENTRY_COST, MAX_ENTRIES, STRING_COST, MAX_LISTING_BYTES, EntriesPage, FileDigests, TreePage  # the caps live with the wire vocabulary; kept importable from here
from tb5sync.tree.options import SyncOptions, SyncStats
from tb5sync.tree.plan import NONEMPTY, Plan, dry_run_changes, itemize_lines, name_fold, plan_sync
from tb5sync.tree.scan import OVERFLOW, Tree

__all__ = ["Generator", "Planned", "ListingLimits", "MAX_ENTRIES", "MAX_LISTING_BYTES", "ENTRY_COST", "STRING_COST"]

log = logging.getLogger(__name__)



class ListingLimits(NamedTuple):
    """Caps on the source listing a receiver holds (a server's, against a pushing peer).

    Attributes
    ----------
    entries : int or None
        Most entries: directory summaries plus listed entries. None: no cap.
    nbytes : int or None
        Most bytes, counted as :data:`ENTRY_COST` per entry plus :data:`STRING_COST` per byte
        of its path, link target and extended attributes (what the server really holds,
        measured). None: no cap.

    peer : str or None
        None on a server (the listing is its pushing client's). On a pulling client, the server
        that sends the listing (``"the server at HOST:PORT"``): the caps are then ``tb5sync
        sync``'s options of the same names, with the server's defaults.

    A listing past either (or whose first page announces more directories than ``entries``)
    ends the run with :class:`~tb5sync.errors.UsageError` naming the cap (on a client
    :class:`~tb5sync.errors.PeerLimitError`, exit 12), before anything is written.
    """

    entries: int | None = MAX_ENTRIES
    nbytes: int | None = MAX_LISTING_BYTES
    peer: str | None = None

    def refuse(self, what: str, option: str) -> Tb5syncError:
        """The error for a listing past a cap: ``what`` it went past, ``option`` the one raising it."""
        if self.peer is None:
            return UsageError(f"the source's {what} this server holds for one session ({option})")
        return PeerLimitError(f"from {self.peer}: the source's {what} this client holds (raise it with sync {option})")


class Planned(NamedTuple):
    """A plan and what it was made from.

    Attributes
    ----------
    plan : Plan
    src : list of Entry
        The part of the source's listing that was planned (see :meth:`Generator._changed_parts`).
    files_total, bytes_total : int
        Regular files at the source and their bytes, all of them (planned or not).
    temps : tuple of str
        Temporary files (``.NAME.XXXXXXXX.tb5tmp``) the destination's scan passed over,
        relative to the base: candidates for :meth:`Destination.remove_stale`.
    """

    plan: Plan
    src: list[Entry]
    files_total: int
    bytes_total: int
    temps: tuple[str, ...] = ()


def _pretended(plan: Plan) -> int:
    """The directories a dry run itemizes as deleted though they stay (``plan.kept_dirs`` inside
    another being cleared: rsync ``-n`` does not try their ``rmdir`` and says ``*deleting``, and its
    ``--stats`` counts them among the deleted files, as this does)."""
    kept = set(plan.kept_dirs)
    return sum(1 for c, e in plan.items if c == "*deleting" and e.path in kept) if kept else 0


class Generator:
    """Compare the sender's source with the destination, plan, and shape the destination tree.

    Parameters
    ----------
    link : tb5sync.remote.links.Link
        Way to the sender.
    destination : Destination
        Where the source lands (paths, state, counters).
    options : SyncOptions
        ``checksum``, ``delete`` and the exclude rules are read here.
    params : chunking.ChunkParams
        Chunking of the destination (``--checksum`` digests when there is no state).
    limits : ListingLimits or None
        Caps on the source listing held (a server's, against its peer); None: none.
    """

    def __init__(self, link: Any, destination: Destination, options: SyncOptions, params: chunking.ChunkParams,
                 limits: ListingLimits | None = None) -> None:
        self.link = link
        self.limits = limits
        self._held = [0, 0]  # entries, bytes of the source listing held so far (counted against limits)
        self.destination = destination
        self.options = options
        self.params = params
        #: -H: source path -> hard-link group; -X: source path -> extended attributes (as listed)
        self.src_hardlinks: dict[str, int] = {}
        self.src_xattrs: dict[str, list[tuple[bytes, bytes]]] = {}
        #: rsync's words for what the plan left undone that is not a failure (a server's reach its client)
        self.warnings: list[str] = []

    # ---- listing and plan -------------------------------------------------------------
    def make_plan(self, dst_scan: Future[Tree]) -> Planned:
        """Fetch the source's summary and listing where it differs, compare, and plan.

        Sets the destination's ``total_bytes`` (the bytes of the files the plan writes).

        Parameters
        ----------
        dst_scan : Future of Tree
            The destination's scan (started before, so that it overlaps the sender's scan);
            waited for before this returns or raises.

        Raises
        ------
        RemoteNotFoundError
            The source does not exist.
        DestinationError
            The destination cannot be read.
        RemoteProtocolError, UsageError
            A malformed or unsafe listing from the sender.
        """
        rules = self.options.rules
        try:
            root, src_dirs, src_failed = self._fetch_summary()
            try:
                dst_tree = dst_scan.result()
            except PermissionError as exc:
                raise DestinationError(f"cannot read destination {self.destination.base}: {exc.strerror}") from exc
            dst_errors = dst_tree.errors
            for d, mode in dst_tree.unlocked.items():  # listed after u+rx; relock gives the mode back
                self.destination.unlocked.setdefault(d, (mode, mode | 0o500))
            if rules.excludes_source(root.kind == DIR):  # rsync copies nothing, deletes nothing
                src, dst, src_dirs, src_failed, dst_errors = [], [], [], [], []
                root = root._replace(kind=DIR, size=0)  # counted as nothing
            else:
                src, dst = self._changed_parts(root, src_dirs, dst_tree)
        finally:
            wait([dst_scan])  # the scan never outlives the run
        same = self._compare_digests(src, dst) if self.options.checksum else None
        for path, reason in src_failed:
            self.destination.fail(path, "source", reason)
        # rsync's rule: after an I/O error on the sending side (a directory it could not list)
        # nothing is deleted, since what is missing from the listing may only be unreadable.
        delete = self.options.delete
        if delete:  # a destination directory that cannot be listed (nor unlocked): rsync's opendir failure
            for path, reason in dst_errors:
                self.destination.fail(path, "destination", reason)
        if delete and (any(not why.startswith(OVERFLOW) for _, why in src_failed) or dst_errors):
            self.warnings.append("IO error encountered -- skipping file deletion")
            log.warning("%s", self.warnings[-1])
            delete = False
        fold = name_fold(*self.destination.folding(write=not self.options.dry_run))  # APFS: A.txt is a.txt
        o = self.options
        plan = plan_sync(src, dst, delete=delete, excludes=o.dest_rules, same_content=same, fold=fold, size_only=o.size_only,
                         update=o.update, ignore_existing=o.ignore_existing, max_delete=o.max_delete,
                         itemize=o.itemize or o.dry_run,  # a dry run's list is made from the items
                         protected=dst_tree.protected if delete else None, dry_run=o.dry_run)
        if plan.delete and self.destination.specials:  # a name the source's special file holds (rsync --no-D)
            held = {p for p, _ in self.destination.specials}
            plan.delete = [d for d in plan.delete if not _held(d.path, held)]
        for path, reason in plan.refused:
            self.destination.fail(path, "destination", reason)
        files_total = sum(d[2] for d in src_dirs) + (root.kind == FILE)
        bytes_total = sum(d[3] for d in src_dirs) + (root.size if root.kind == FILE else 0)
        self.destination.total_bytes = sum(e.size for e in plan.files)
        return Planned(plan, src, files_total, bytes_total, tuple(dst_tree.temps))

    def dry_run(self, planned: Planned, t0: float) -> SyncStats:
        """The statistics of a dry run of ``planned`` (nothing is changed), begun at ``t0`` (``time.perf_counter``).

        ``extra`` holds the plan (``"plan"``) and the changes rsync ``-n -v`` would list
        (``"changes"``, see :func:`tb5sync.tree.plan.dry_run_changes`).
        """
        plan, src = planned.plan, planned.src
        return SyncStats(
            files_total=planned.files_total,
            bytes_total=planned.bytes_total,
            files_transferred=len(plan.files),
            bytes_transferred=self.destination.total_bytes,
            wire_bytes=self.link.wire_bytes,
            files_deleted=sum(1 for d in plan.delete if d.path not in {e.path for e in src}) + _pretended(plan),
            seconds=time.perf_counter() - t0,
            failures=tuple(self.destination.failures),
            skipped=tuple(self.destination.specials),
            deletes_skipped=plan.deletes_skipped,
            itemized=tuple(itemize_lines(plan.items, self.options.exclude_root)) if self.options.itemize else (),
            extra={"plan": plan, "changes": dry_run_changes(plan, src, self.options.exclude_root)},
        )

    def itemized(self, planned: Planned) -> tuple[str, ...]:
        """The ``--itemize-changes`` lines of a run of ``planned`` that is over: the plan's items
        but those of entries that failed (named in the failures instead; rsync's ``cd+++++++++``
        of a directory whose ``mkdir`` failed stays: ``plan.itemized_refused``)."""
        if not planned.plan.items:
            return ()
        failed = {f.path for f in self.destination.failures} - planned.plan.itemized_refused | set(self.destination.changed)
        items = [(c, e) for c, e in planned.plan.items if e.path not in failed]
        return tuple(itemize_lines(items, self.options.exclude_root))

    def _fetch_summary(self) -> tuple[Entry, list[tuple[str, bytes, int, int]], list[tuple[str, str]]]:
        """The source's root entry, its directory summaries ``(path, digest, files, bytes)`` (all
        pages) and the ``(path, reason)`` of the source directories that could not be listed.

        Raises
        ------
        RemoteNotFoundError
            The source does not exist.
        RemoteProtocolError
            A malformed page.
        UsageError
            The listing goes past :attr:`limits` (its announced total, or the pages sent).
        """
        dirs: list[tuple[str, bytes, int, int]] = []
        failed: list[tuple[str, str]] = []
        root: Entry | None = None
        while True:
            page = TreePage.from_wire(self.link.submit("tree", start=len(dirs)).result())
            lim = self.limits
            if lim is not None and lim.entries is not None and page.total > lim.entries:
                raise lim.refuse(f"{page.total} directories announced, more than the {lim.entries} entries", "--max-entries")
            self._hold(len(page.dirs), sum(len(d[0]) + len(d[1]) for d in page.dirs))
            if root is None:
                root = page.root
                failed = page.failed
                self.destination.specials += page.skipped
                if page.root_xattrs:
                    self.src_xattrs[""] = page.root_xattrs
            dirs += page.dirs
            if len(dirs) >= page.total or not page.dirs:
                return root, dirs, failed

    def _hold(self, entries: int, nbytes: int) -> None:
        """Count ``entries`` more listed entries with ``nbytes`` of strings against :attr:`limits`.

        Raises
        ------
        UsageError
            Past a cap (named with its ``tb5sync serve`` option).
        """
        held = self._held
        held[0] += entries
        held[1] += nbytes * STRING_COST + entries * ENTRY_COST
        lim = self.limits
        if lim is None:
            return
        if lim.entries is not None and held[0] > lim.entries:
            raise lim.refuse(f"listing has more than the {lim.entries} entries", "--max-entries")
        if lim.nbytes is not None and held[1] > lim.nbytes:
            raise lim.refuse(f"listing is larger than the {lim.nbytes} bytes", "--max-listing-bytes")

    def _fetch_entries(self, dirs: list[str]) -> dict[str, list[Entry]]:
        """The source's children of each directory in ``dirs``: directory path -> entries in name order.

        Directories are asked for in batches (all batches in flight at once), each batch
        page by page.

        Raises
        ------
        RemoteProtocolError
            An entry that is not a child of the directory it was listed under.
        UsageError
            An unsafe path (see :meth:`Entry.from_wire`).
        """
        batches: list[list[str]] = []
        cur: list[str] = []
        size = 0
        for d in dirs:
            cur.append(d)
            size += len(d) + 8
            if len(cur) >= 4096 or size >= 1024 * 1024:
                batches.append(cur)
                cur, size = [], 0
        if cur:
            batches.append(cur)
        futs = [self.link.submit("entries", dirs=b, skip=0) for b in batches]
        out: dict[str, list[Entry]] = {}
        for batch, fut in zip(batches, futs):
            got: list[Entry] = []
            while True:
                page = EntriesPage.from_wire(fut.result())
                self._hold(len(page.entries), sum(len(e.path) + len(e.target) for e in page.entries)
                           + sum(len(n) + len(v) for xa in page.xattrs.values() for n, v in xa))
                for i, g in page.hardlinks.items():
                    self.src_hardlinks[page.entries[i].path] = g
                for i, xa in page.xattrs.items():
                    self.src_xattrs[page.entries[i].path] = xa
                got += page.entries
                if not page.more:
                    break
                fut = self.link.submit("entries", dirs=batch, skip=len(got))
            # split the concatenation by parent directory; the sender keeps the order asked for
            it = iter(batch)
            d = next(it)
            listing: list[Entry] = []
            out[d] = listing
            for e in got:
                parent = e.path.rpartition("/")[0]
                while parent != d:
                    d = next(it, None)  # type: ignore[arg-type]
                    if d is None:
                        raise RemoteProtocolError(f"entry {e.path!r:.200} is not in the directories asked for")
                    listing = out[d] = []
                listing.append(e)
            for d in it:
                out[d] = []
        return out

    def _changed_parts(
        self, root: Entry, src_dirs: list[tuple[str, bytes, int, int]], dst_tree: Tree
    ) -> tuple[list[Entry], list[Entry]]:
        """The parts of both manifests that can differ: what :func:`plan_sync` must look at.

        A directory whose listing digest is the same on both sides has identical children
        (names, types, modes, sizes, mtimes, link targets): nothing in it changes, so its
        children are neither fetched nor planned (unless the destination holds a special file
        there: those are listed as files of size -1, which no source entry matches). Left in are the roots, every other
        directory's children, and the entries of those other directories themselves (so
        that they are created, or get their mode and mtime back after their contents
        change). With ``--checksum``, ``-H`` or ``-X`` nothing is skipped (contents, inodes,
        attributes are compared).

        Returns
        -------
        (src, dst) : lists of Entry
            Parents before children; ``src`` the source's part (fetched where it differs),
            ``dst`` the destination's.

        Raises
        ------
        RemoteProtocolError
            The source's listing names an entry twice, or under a parent that is not one of
            its directories (a file below a symlink or a file).
        """
        o = self.options  # -H and -X: links and attributes are not in the listing digests
        dst_dg = dst_tree.digests() if not (o.checksum or o.hard_links or o.xattrs) else {}
        # the destination's special files (FIFOs, sockets, devices) are in no listing digest:
        # their directories are compared, and they are entries that never match (replaced, or
        # deleted with --delete, as rsync --no-D does)
        specials = [Entry(p, FILE, 0, -1, 0, "") for p, _ in dst_tree.skipped if p]
        dirty = {e.path.rpartition("/")[0] for e in specials}
        same = {p for p, dg, _, _ in src_dirs if dst_dg.get(p) == dg and p not in dirty}
        rules = o.rules
        need = [p for p, _, _, _ in src_dirs if p not in same and not (p and (rules.match(p, True) or rules.excluded_by_parent(p)))]
        fetched = self._fetch_entries(need) if need else {}
        by_parent: dict[str, dict[str, Entry]] = {}

        def own_entry(d: str) -> Entry:
            # d's entry from its parent's listing, which is the same on both sides
            parent = d.rpartition("/")[0]
            idx = by_parent.get(parent)
            if idx is None:
                idx = by_parent[parent] = {e.path: e for e in dst_tree.children[parent]}
            e = idx.get(d)
            if e is None or e.kind != DIR:
                raise RemoteProtocolError(f"directory {d!r:.200} is not in its parent's listing")
            return e

        src = [root]
        for d in need:
            if d and d.rpartition("/")[0] in same:
                src.append(own_entry(d))
            src += fetched[d]
        src = self._admitted(src)
        _check_parents(src, same)
        dst = dst_tree.entries[:1]
        for d, kids in dst_tree.children.items():
            if d in same:
                continue
            if d and d.rpartition("/")[0] in same:
                dst.append(own_entry(d))
            dst += kids
        return src, dst + specials

    def _admitted(self, src: list[Entry]) -> list[Entry]:
        """``src`` without what this side's options keep out, whatever the sender did (rsync 3.4+
        checks on the receiving side): entries the exclude rules match (or below an excluded
        directory), and with ``--safe-links`` or ``--copy-unsafe-links`` every unsafe symlink
        (:func:`tb5sync._os.fsmeta.unsafe_symlink`, the rule the sender's scan applies; an unsafe
        link that arrives was not copied as its referent, so it is left out). The root stays.
        """
        from tb5sync._os.fsmeta import unsafe_symlink

        o = self.options
        rules = o.rules
        links = o.safe_links or o.copy_unsafe_links
        if not rules and not links:
            return src
        top = o.exclude_root
        out: list[Entry] = []
        for e in src:
            if e.path:
                if rules and (rules.match(e.path, e.kind == DIR) or rules.excluded_by_parent(e.path)):
                    log.info("ignoring %s: excluded, but the sender listed it", e.path)
                    continue
                if links and e.kind == LINK and unsafe_symlink(e.target, f"{top}/{e.path}" if top else e.path):
                    log.info("ignoring unsafe symlink %s -> %s", e.path, e.target)
                    continue
            out.append(e)
        return out

    def _compare_digests(self, src: list[Entry], dst: list[Entry]) -> dict[str, bool]:
        """``--checksum``: for each regular file on both sides with the same size, whether the contents are equal.

        The sender's file digests are asked for 1024 paths at a time, while this side
        computes its own (:meth:`_local_digest`); a file that cannot be read here differs.

        Raises
        ------
        RemoteProtocolError
            A ``file_digests`` reply of the wrong length.
        """
        have = {e.path: e for e in dst if e.kind == FILE}
        both = [e.path for e in src if e.kind == FILE and e.path in have and have[e.path].size == e.size]
        out: dict[str, bool] = {}
        for i in range(0, len(both), 1024):
            batch = both[i : i + 1024]
            fut = self.link.submit("file_digests", paths=batch)
            mine = [self._local_digest(p) for p in batch]
            theirs = FileDigests.from_wire(fut.result(), len(batch)).digests
            for p, a, b in zip(batch, mine, theirs):
                out[p] = a is not None and a == b
        return out

    def _local_digest(self, rel: str) -> bytes | None:
        """The file digest of the destination's ``rel``, read and hashed anew (and recorded in the scan cache if any); None if it cannot be opened."""
        try:
            fd = self.destination.open_read(rel)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if self.destination.state is None:
                return file_digest(d for d, _ in chunk_fd(fd, st.st_size, self.params, where=rel))
            return self.destination.state.chunks_of(fd, self.destination.spath(rel), st, fresh=True)[0]
        except SourceChangedError:
            return None  # it shrank while read: it differs, and is written anew
        finally:
            os.close(fd)

    # ---- applying the plan's non-data parts -------------------------------------------
    def prepare(self, plan: Plan, src: list[Entry]) -> None:
        """Apply what must come before the files are written: deletions, then new directories.

        Deletions go first, deepest first, each counted in ``files_deleted`` unless the
        entry is replaced by one of another type. An entry is never deleted before its
        replacement can be made: one replaced by a directory is removed right before the
        ``mkdir``; one replaced by a file or symlink is not removed here at all (the new one
        is renamed over it, and an empty directory in its way is removed only then, see
        :meth:`Destination._rename_over`). The destination's parent is created (mode
        0755) when missing, as rsync does; new directories get mode 0700 until
        :meth:`finish` gives them theirs.

        An entry that cannot be deleted or a directory that cannot be made is named in the
        destination's failures (nothing is written below such a directory) and the run goes on.

        Raises
        ------
        DestinationError
            The destination's base (or its parent) cannot be made, or the disk is full.
        """
        dest = self.destination
        src_kind = {e.path: e.kind for e in src}
        for d in plan.delete:
            kind = src_kind.get(d.path)
            if kind is not None and kind != DIR:
                if d.kind != DIR and dest.state is not None:
                    dest.state.forget([dest.spath(d.path)])
                continue  # replaced by a rename over it
            if dest.skipped(d.path):
                continue
            try:
                if dest.writable(d.path, lambda d=d: self._remove(d)) and kind is None:
                    dest.stats["files_deleted"] += 1
            except OSError as exc:
                if isinstance(exc, Tb5syncError) and not isinstance(exc, PathError):
                    raise
                dest.fail(d.path, "destination", exc)
                if kind is not None:  # the directory that should replace it cannot be made
                    dest.failed_dirs.add(d.path)
        try:
            if dest.parts(""):
                dest.make_base_parent()  # rsync creates the destination directory
            if plan.mkdirs and plan.mkdirs[0].path == "":
                dest.mkdir("", 0o700)
        except OSError as exc:
            if isinstance(exc, Tb5syncError):
                raise
            raise DestinationError(f"cannot make destination {exc.filename or dest.base}: {exc.strerror}") from exc
        for e in plan.mkdirs:
            if e.path == "" or e.path in dest.failed_dirs or dest.skipped(e.path):
                continue
            try:
                dest.writable(e.path, lambda e=e: dest.mkdir(e.path, 0o700))
            except OSError as exc:
                if isinstance(exc, Tb5syncError) and not isinstance(exc, PathError):
                    raise
                dest.fail(e.path, "destination", exc)
                dest.failed_dirs.add(e.path)

    def itemize_xattrs(self, items: list[tuple[str, Entry]], src: Sequence[Entry]) -> list[tuple[str, Entry]]:
        """``-X -i``: ``items`` with rsync's ``x`` column (the 11th) set for each existing file or
        directory whose copied extended attributes differ from the source's, read before anything
        is changed; one changed in nothing else gets its own line (``.f........x f``,
        ``.d........x ./``), in source order. A new entry (``+++``) or one that cannot be read is
        left as it is."""
        from tb5sync._os.fsmeta import copied_name

        dest = self.destination
        item_of = {e.path: (c, e) for c, e in items if c != "*deleting" and c != NONEMPTY}
        out = [(c, e) for c, e in items if c == "*deleting" or c == NONEMPTY]
        for e in src:
            code, e = item_of.get(e.path, (None, e))  # the item's own entry: an hf line keeps its target
            if e.kind != LINK and (code is None or "+" not in code):
                want = sorted((n, v) for n, v in self.src_xattrs.get(e.path, []) if copied_name(n))
                try:
                    have = dest.get_xattrs(e.path, e.kind == DIR)
                except (OSError, PathError):
                    have = want
                if have != want:
                    code = (code or "." + ("d" if e.kind == DIR else "f") + ".........")[:10] + "x"
            if code is not None:
                out.append((code, e))
        return out

    def apply_xattrs(self, src: Sequence[Entry]) -> None:
        """``-X``: give every file and directory of ``src`` the source's extended attributes (set
        those that differ, remove the others; rsync's rule). One that cannot be set is the
        entry's destination failure."""
        dest = self.destination
        for e in src:
            if e.kind == LINK or dest.skipped(e.path) or e.path in dest.failed_dirs:
                continue
            try:
                dest.set_xattrs(e.path, e.kind == DIR, self.src_xattrs.get(e.path, []))
            except FileNotFoundError:
                continue  # not written (a failure named already)
            except OSError as exc:
                if isinstance(exc, Tb5syncError) and not isinstance(exc, PathError):
                    raise
                dest.fail(e.path, "destination", exc)

    def finish(self, plan: Plan, src: Sequence[Entry] = ()) -> None:
        """Apply what must come after the files are written: symlinks, then modes and mtimes.

        Symlinks are made under a temporary name and renamed into place; unchanged files get
        their mode and mtime, unchanged symlinks their mtime; then every directory of the plan
        gets its mode and mtime, deepest first (writing into a directory changes its mtime).

        A symlink, mode or mtime that cannot be set is named in the destination's failures
        and the run goes on (nothing is attempted below a directory that could not be made).
        """
        dest = self.destination
        for e in plan.links:
            if dest.skipped(e.path):
                continue
            try:
                dest.writable(e.path, lambda e=e: dest.make_link(e.path, e.target, e.mtime_ns))
            except OSError as exc:
                if isinstance(exc, Tb5syncError) and not isinstance(exc, PathError):
                    raise
                dest.fail(e.path, "destination", exc)
        for e in plan.meta:
            if dest.skipped(e.path):
                continue
            try:
                if e.kind == FILE:
                    dest.chmod(e.path, e.mode)
                    dest.utime(e.path, e.mtime_ns)
                elif e.kind == LINK:
                    dest.utime(e.path, e.mtime_ns)
            except OSError as exc:
                if isinstance(exc, Tb5syncError) and not isinstance(exc, PathError):
                    raise
                dest.fail(e.path, "destination", exc)
        if self.options.xattrs:
            self.apply_xattrs(src)
        for e in sorted(plan.dirs, key=lambda x: x.path.count("/") if x.path else -1, reverse=True):
            if e.path in dest.failed_dirs or dest.skipped(e.path):
                continue
            try:
                dest.chmod(e.path, e.mode)
                dest.utime(e.path, e.mtime_ns)  # to the ns (rsync leaves one within the same second as it is)
            except OSError as exc:
                if isinstance(exc, Tb5syncError) and not isinstance(exc, PathError):
                    raise
                dest.fail(e.path, "destination", exc)

    def settle_dirs(self, plan: Plan) -> None:
        """On the way out of a run that stopped early (a signal, a lost link, a quota or disk
        error): give every directory of the plan its mode now (those :meth:`prepare` created,
        the destination's base too, and the existing ones whose mode changes), deepest first,
        instead of leaving new ones at the 0700 they were made with (rsync creates a directory
        with its final permissions and sets an existing one's as its generator passes it, so its
        interrupted run leaves them so). Mtimes are left: rsync sets a directory's at the end of
        its run too. Best effort: an error is logged, never raised (the run's own error is the
        one reported); nothing is done below a failed directory.
        """
        dest = self.destination
        for e in sorted(plan.dirs, key=lambda x: x.path.count("/") if x.path else -1, reverse=True):
            if e.path in dest.failed_dirs or dest.skipped(e.path):
                continue
            try:
                dest.chmod(e.path, e.mode)
            except FileNotFoundError:
                continue  # not made yet
            except Exception as exc:  # noqa: BLE001 - the run's own error is the one to report
                log.info("cannot give %s its mode on the way out: %s", e.path or ".", exc)

    def _remove(self, d: Entry) -> bool:
        """Remove one destination entry (never following symlinks); True if it was removed.

        Directories are removed with ``rmdir`` only: their deletable children come
        earlier in the plan. A directory still holding excluded (protected) entries
        is kept (False).

        Raises
        ------
        OSError
            The entry could not be removed for another reason (e.g. ``EACCES``).
        """
        try:
            self.destination.remove(d.path, d.kind == DIR)
        except FileNotFoundError:
            return False
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return False
            raise
        if self.destination.state is not None:
            self.destination.state.forget([self.destination.spath(d.path)])
        return True


def _held(path: str, names: set[str]) -> bool:
    """True when ``path`` or one of its parents is in ``names``."""
    while path:
        if path in names:
            return True
        path = path.rpartition("/")[0]
    return False


def _check_parents(src: list[Entry], same: set[str]) -> None:
    """Refuse a listing in which an entry's parent is not a directory of the listing.

    Every entry but the root must have a parent that is a directory entry of ``src``, or a
    directory whose listing is the same on both sides (``same``: a directory of the
    destination, not fetched). A sender that lists ``d`` as a symlink and ``d/x`` as a file
    would otherwise have the receiver write through ``d``.

    Raises
    ------
    RemoteProtocolError
        An entry is listed twice, or its parent is missing or not a directory; the message
        names the entry.
    """
    kinds: dict[str, str] = {}
    for e in src:
        if e.path in kinds:
            raise RemoteProtocolError(f"entry {e.path!r:.200} is listed twice")
        kinds[e.path] = e.kind
        if not e.path:
            continue
        parent = e.path.rpartition("/")[0]
        kind = kinds.get(parent)
        if kind != DIR and not (kind is None and parent in same):
            what = "missing from the listing" if kind is None else f"not a directory (kind {kind!r})"
            raise RemoteProtocolError(f"entry {e.path!r:.200}: its parent {parent!r:.200} is {what}")
