"""Plan a sync: compare the source's manifest with the destination's (rsync's generator decisions).

No I/O here: the inputs are manifests, the output a :class:`Plan`.
"""

from __future__ import annotations

import unicodedata
from typing import Any
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tb5sync.tree.entry import DIR, FILE, LINK, Entry, show_path
from tb5sync.tree.excludes import NO_RULES, ExcludeRules

__all__ = ["Plan", "NONEMPTY", "plan_sync", "dry_run_changes", "itemize_lines", "name_fold", "same_time", "rsync_item_order"]

@dataclass
class Plan:
    """What a receiver must do to make the destination match the source.

    All paths are relative to the destination base. Lists keep source order
    (parents before children), except ``delete`` which is children first.
    ``refused`` lists ``(path, reason)`` for source entries that cannot be synced because
    the destination holds a non-empty directory where they go (rsync: "cannot delete
    non-empty directory"), or because the destination ignores case or Unicode normalization
    and an earlier sibling already takes the name (``A.txt`` / ``a.txt``, NFC / NFD: a
    collision, the reason names both); they are in no other list (nor is anything below a
    refused directory), and that directory is not deleted.
    ``deletes_skipped`` counts the deletions ``max_delete`` left out, ``kept_dirs`` the
    directories that then stay non-empty (rsync: "cannot delete non-empty directory");
    ``items`` (with ``itemize``) is ``(code, entry)`` per change, ``code`` rsync's 11-character
    ``YXcstpoguax`` string (see :func:`itemize_lines`), deletions first; ``itemized_refused``
    names the refused entries whose item stays (rsync prints a directory's ``cd+++++++++``
    before its ``mkdir`` fails below a file kept by ``--ignore-existing``).
    """

    mkdirs: list[Entry] = field(default_factory=list)
    files: list[Entry] = field(default_factory=list)
    links: list[Entry] = field(default_factory=list)
    meta: list[Entry] = field(default_factory=list)
    delete: list[Entry] = field(default_factory=list)
    dirs: list[Entry] = field(default_factory=list)
    unchanged: int = 0
    refused: list[tuple[str, str]] = field(default_factory=list)
    # -- rsync options, second half --
    deletes_skipped: int = 0
    kept_dirs: list[str] = field(default_factory=list)
    items: list[tuple[str, Entry]] = field(default_factory=list)
    itemized_refused: set[str] = field(default_factory=set)


def plan_sync(
    src: Iterable[Entry],
    dst: Iterable[Entry],
    *,
    delete: bool = False,
    excludes: ExcludeRules = NO_RULES,
    same_content: dict[str, bool] | None = None,
    fold: Callable[[str], str] | None = None,
    size_only: bool = False,
    update: bool = False,
    ignore_existing: bool = False,
    max_delete: int | None = None,
    itemize: bool = False,
    protected: set[str] | None = None,
    dry_run: bool = False,
) -> Plan:
    """Compare a source manifest with the destination's and plan the changes.

    Parameters
    ----------
    src, dst : iterables of Entry
        Manifests relative to the same base (``""`` is the base).
    delete : bool
        Plan removal of destination entries missing at the source (never of excluded ones).
    excludes : ExcludeRules
        Protects matching destination entries from deletion.
    same_content : dict, optional
        ``--checksum`` mode: for files present on both sides with equal size,
        whether their content digests are equal. Files absent from the dict fall
        back to the quick check.
    fold : callable, optional
        The destination's view of a path when it ignores case and/or Unicode normalization
        (:func:`name_fold`): source entries whose folded paths are equal collide (the first in
        source order is synced, each later one refused with a reason naming both), and a
        destination entry is matched by its folded path (``a.txt`` at the destination is the
        source's ``A.txt``: compared, not deleted).
    size_only, update, ignore_existing : bool
        rsync's ``--size-only`` (a file of the same size is unchanged; its mode and mtime are
        still set), ``-u`` (a regular file whose destination copy is newer is left alone) and
        ``--ignore-existing`` (an existing destination entry is left alone, but a directory
        where the source has one; the source's entries right below a non-directory left in
        place are refused: "Not a directory" (a directory there is itemized first, its contents
        skipped), and it gets the directory's mtime, as in rsync; in a dry run only a file
        right below it is refused, the rest itemized as new, as ``rsync -n`` does).
    max_delete : int or None
        At most this many deletions of entries missing at the source, in rsync's order (see
        :func:`_limit_deletes`); replacements of another type are not counted.
    itemize : bool
        Fill ``items`` (rsync ``-i``).
    protected : set of str, optional
        Destination directories directly holding an entry ``dst`` does not list because the
        exclude rules left it out (:attr:`tb5sync.tree.scan.Tree.protected`): they and their
        parents stay non-empty, so an extraneous one is kept (``kept_dirs``), not deleted.
    dry_run : bool
        The items are for a dry run (rsync ``-n`` does not try ``rmdir``: a kept directory inside
        another being cleared is itemized as deleted after its "cannot delete" line).

    Returns
    -------
    Plan
        Quick check (rsync's): a regular file is unchanged when size and mtime_ns are equal
        (to the ns: a file rewritten within the second of the last run is sent, where rsync, which
        compares whole seconds, would miss it); a directory's or symlink's mtime is compared in
        whole seconds (:func:`same_time`), as rsync does; in checksum mode, when size and content digest are equal.
        An entry whose type differs is deleted first, then recreated.
    """
    src = list(src)
    have = {e.path: e for e in dst}
    plan = Plan()
    src_paths: set[str] = set()
    if fold is not None:
        src, src_paths = _collisions(src, fold, plan.refused)
        have_folded = {fold(p): d for p, d in have.items()}
    left: list[str] = []  # destination non-directories left in place where the source has a directory
    items: list[tuple[str, Entry]] = []

    def item(code: str, e: Entry) -> None:
        if itemize:
            items.append((code, e))

    for e in src:
        src_paths.add(e.path)
        d = have.get(e.path)
        if d is None and fold is not None:
            d = have_folded.get(fold(e.path))
        if left and _below(e.path, left):
            # rsync's generator below a non-directory kept where the source has a directory: an
            # entry right below it fails (a file's stat, a link's symlink(), a directory's mkdir:
            # ENOTDIR; the directory is itemized first and its contents skipped silently). A dry
            # run stats only files there; a directory counts as created (rsync's dry_missing_dir),
            # so it and everything under it are itemized as new.
            direct = e.path.rpartition("/")[0] in left
            if dry_run and not (direct and e.kind == FILE):
                pass  # itemized below as a new entry (nothing exists there: d is None)
            else:
                if direct:
                    if e.kind == DIR:
                        item("cd+++++++++", e)
                        plan.itemized_refused.add(e.path)
                    plan.refused.append((e.path, "Not a directory: a destination entry kept by --ignore-existing is in the way"))
                continue
        if d is not None and (ignore_existing and not (e.kind == DIR and d.kind == DIR)
                              or update and e.kind == FILE and d.kind == FILE and d.mtime_ns > e.mtime_ns):
            plan.unchanged += 1  # left as it is (rsync: "exists" / "is newer")
            if e.kind == DIR:
                left.append(e.path)
                if d.kind in (FILE, LINK) and d.mtime_ns != e.mtime_ns:
                    # rsync's pass that sets directory times still gives the entry kept there the
                    # source directory's mtime (its mode stays): so does this plan
                    plan.meta.append(d._replace(mtime_ns=e.mtime_ns))
            continue
        if d is not None and d.kind != e.kind:
            if not (d.kind == DIR and e.kind == DIR):
                plan.delete.append(d)
            d = None
        if e.kind == DIR:
            plan.dirs.append(e)
            if d is None:
                plan.mkdirs.append(e)
                item("cd+++++++++", e)
            else:
                if d.mode != e.mode:
                    plan.meta.append(e)
                if d.mode != e.mode or not same_time(d.mtime_ns, e.mtime_ns):
                    item(_attrs(".d", d, e, size=False), e)
        elif e.kind == LINK:
            if d is None or d.target != e.target:
                if d is not None:
                    plan.delete.append(d)
                    item(_attrs("cLc", d, e, size=False, mode=False), e)
                else:
                    item("cL+++++++++", e)
                plan.links.append(e)
            else:
                if not same_time(d.mtime_ns, e.mtime_ns):
                    plan.meta.append(e)
                    item(_attrs(".L.", d, e, size=False, mode=False), e)
                plan.unchanged += 1
        else:
            if d is None:
                plan.files.append(e)
                item(">f+++++++++", e)
                continue
            if same_content is not None and e.path in same_content:
                changed = d.size != e.size or not same_content[e.path]
            elif size_only:
                changed = d.size != e.size
            else:
                changed = d.size != e.size or d.mtime_ns != e.mtime_ns
            if changed:
                plan.files.append(e)
                item(_attrs(">fc" if same_content is not None else ">f.", d, e), e)
            elif d.mode != e.mode or d.mtime_ns != e.mtime_ns:
                plan.meta.append(e)
                plan.unchanged += 1
                item(_attrs(".f.", d, e, size=False), e)
            else:
                plan.unchanged += 1
    if delete:
        folded = {fold(p) for p in src_paths} if fold is not None else set()
        for p, d in have.items():
            if p in src_paths or p == "" or (fold is not None and fold(p) in folded):
                continue
            if excludes and (excludes.match(p, d.kind == DIR) or excludes.excluded_by_parent(p)):
                continue
            if left and _below(p, left):
                continue  # inside a destination directory kept where the source has a non-directory
            plan.delete.append(d)
    extraneous = [d for d in plan.delete if d.path not in src_paths]
    if max_delete is not None:
        _limit_deletes(plan, have, src, max_delete)
    # children before parents; de-duplicate
    seen: set[str] = set()
    uniq = []
    for d in sorted(plan.delete, key=lambda x: x.path.count("/"), reverse=True):
        if d.path not in seen:
            seen.add(d.path)
            uniq.append(d)
    plan.delete = uniq
    _keep_nonempty_dirs(plan, have, src_paths, protected or set())
    _refuse_nonempty_replacements(plan, have, src_paths, protected or set())
    if itemize:
        refused = {p for p, _ in plan.refused}
        plan.items = _deletion_order(plan, extraneous, have, src, max_delete, protected or set(), dry_run)
        plan.items += [(c, e) for c, e in items if e.path not in refused or e.path in plan.itemized_refused]
    return plan


#: The code of a :attr:`Plan.items` entry for an extraneous directory left in place because it
#: stays non-empty (an excluded or otherwise kept entry inside, or ``--max-delete`` reached):
#: rsync's "cannot delete non-empty directory: PATH" line, in its place among the deletions.
NONEMPTY = "cannot delete non-empty directory:"


def _nonempty_after(plan: Plan, have: dict[str, Entry], protected: set[str]) -> set[str]:
    """Destination directories that stay non-empty once ``plan.delete`` is done: every parent of
    an entry of ``have`` not deleted, and each ``protected`` directory and its parents."""
    deleted = {d.path for d in plan.delete}
    stays: set[str] = set()
    for p in (*(p for p in have if p and p not in deleted), *(f"{d}/" for d in protected)):
        parent = p.rpartition("/")[0]
        while parent and parent not in stays:
            stays.add(parent)
            parent = parent.rpartition("/")[0]
    return stays


def _keep_nonempty_dirs(plan: Plan, have: dict[str, Entry], src_paths: set[str], protected: set[str]) -> None:
    """Take out of ``plan.delete`` each extraneous directory that would stay non-empty (an entry
    below it is kept: excluded, or left by ``--max-delete``) and list it in ``plan.kept_dirs``:
    it is not deleted, so it is neither counted nor itemized as a deletion."""
    dirs = {d.path for d in plan.delete if d.kind == DIR and d.path not in src_paths}
    if not dirs:
        return
    kept = dirs & _nonempty_after(plan, have, protected)
    if kept:
        plan.delete = [d for d in plan.delete if d.path not in kept]
        known = set(plan.kept_dirs)
        plan.kept_dirs += [p for p in sorted(kept) if p not in known]


def name_fold(case: bool, unicode: bool) -> Callable[[str], str] | None:
    """How a destination that ignores case (``case``) and/or Unicode normalization (``unicode``:
    NFC and NFD forms are one name, as on APFS and HFS+) sees a path; None when it sees bytes.

    Case is folded with ``str.casefold`` (Unicode's full case folding), normalization to NFD; a
    path that is not valid UTF-8 (surrogate escapes) folds only where its characters do.
    """
    if not case and not unicode:
        return None

    def fold(path: str) -> str:
        if unicode:
            path = unicodedata.normalize("NFD", path)
        return unicodedata.normalize("NFD", path.casefold()) if case else path

    return fold


def _collisions(src: Iterable[Entry], fold: Callable[[str], str], refused: list[tuple[str, str]]) -> tuple[list[Entry], set[str]]:
    """The source entries a folding destination can hold (the first of each folded path, in source
    order, nothing below a refused directory) and every source path; each collision is appended
    to ``refused`` as ``(path, reason)``."""
    first: dict[str, str] = {}
    dropped: list[str] = []  # refused directories (their descendants are left out silently)
    kept: list[Entry] = []
    paths: set[str] = set()
    for e in src:
        paths.add(e.path)
        if any(e.path.startswith(r + "/") for r in dropped):
            continue
        key = fold(e.path)
        other = first.setdefault(key, e.path)
        if other == e.path:
            kept.append(e)
            continue
        refused.append((e.path, f"collides with {show_path(other)}: the destination does not tell their names apart "
                                "(it ignores case or Unicode normalization); not synced"))
        if e.kind == DIR:
            dropped.append(e.path)
    return kept, paths


def _below(path: str, tops: list[str]) -> bool:
    """Whether ``path`` is strictly inside one of the directories ``tops``."""
    return any(path.startswith(t + "/") if t else path != "" for t in tops)


def _secs(mtime_ns: int) -> int:
    """Whole seconds of ``mtime_ns`` (floored, as ``st_mtim.tv_sec``)."""
    return mtime_ns // 1_000_000_000


def same_time(a_ns: int, b_ns: int) -> bool:
    """Whether two mtimes (ns) are the same to rsync: in the same whole second (its default
    ``--modify-window=0`` "matches just integer seconds", rsync(1)). Used for directories and
    symlinks (attributes alone: a difference in the fraction is not itemized, as in rsync);
    regular files are compared to the ns, so that a same-size rewrite within one second is sent."""
    return _secs(a_ns) == _secs(b_ns)


def _attrs(head: str, d: Entry, e: Entry, *, size: bool = True, mode: bool = True) -> str:
    """rsync's ``YXcstpoguax`` for an existing entry ``d`` becoming ``e``: ``head`` gives the first
    characters (``YX`` and, when given, ``c``), then ``s``, ``t`` and ``p`` where they differ (and are
    asked for); owner, group, atime, ACL and xattr columns stay ``.`` (not synced)."""
    code = head if len(head) == 3 else head + "."
    code += "s" if size and d.size != e.size else "."
    code += "t" if (d.mtime_ns != e.mtime_ns if e.kind == FILE else not same_time(d.mtime_ns, e.mtime_ns)) else "."
    code += "p" if mode and d.mode != e.mode else "."
    return code + "....."


def rsync_item_order(items: list[tuple[str, Entry]]) -> list[tuple[str, Entry]]:
    """``items`` (``Plan.items``) in the order rsync ``-i`` lists them where that order does not
    depend on timing: deletions first (in their order, :func:`_deletion_order`), then depth
    first from the base: each directory, its non-directories by name, then its subdirectories by
    name (rsync's file-list order); a hard link's ``hf`` lines last, as rsync prints them once
    the group's file is written: group by group in the file-list order of the path they are
    linked to (``target``), each group's lines in reverse file-list order (rsync 3.x, hlink.c's
    ``finish_hard_link`` walks the group from its last member back). (rsync prints a sent
    file's line when it is sent, so those lines and a changed directory's may come in another
    order between runs.)"""
    def flist(path: str, kind: str) -> tuple[tuple[int, bytes], ...]:
        parts = [c.encode("utf-8", "surrogateescape") for c in path.split("/")] if path else []
        if kind == DIR:
            return tuple((1, c) for c in parts)
        return (*((1, c) for c in parts[:-1]), (0, parts[-1] if parts else b""))  # "": a single file synced

    def key(item: tuple[str, Entry]) -> tuple[Any, ...]:
        code, e = item
        if code == "*deleting" or code == NONEMPTY:
            return (-1, ())  # stable: their own order
        return (1 if code.startswith("h") else 0, flist(e.path, e.kind))

    out = sorted(items, key=key)
    first_h = next((i for i, (c, _) in enumerate(out) if c.startswith("h")), len(out))
    links = sorted(out[first_h:], key=lambda it: flist(it[1].path, it[1].kind), reverse=True)
    links.sort(key=lambda it: flist(it[1].target or it[1].path, FILE))  # stable: members stay reversed
    return out[:first_h] + links


def _deletion_order(plan: Plan, extraneous: list[Entry], have: dict[str, Entry], src: list[Entry],
                    max_delete: int | None, protected: set[str], dry_run: bool = False) -> list[tuple[str, Entry]]:
    """The deletion items of ``plan`` (``("*deleting", entry)``, and ``(NONEMPTY, entry)`` for
    an extraneous directory left non-empty) in the order rsync ``--delete`` (during) prints them,
    as rsync 3.x here shows it: directory by directory, depth first from the base (each one's
    extraneous entries, then those inside an entry the source replaces by a non-directory, then
    its subdirectories by name); within one directory in reverse file-list order (files before
    directories, by name, reversed), a directory's contents before it.

    ``extraneous``: every entry missing at the source that ``--delete`` looked at (before
    ``--max-delete`` and the non-empty check). rsync (delete.c) says "cannot delete non-empty
    directory" for a directory whose contents could not all be deleted, once more when it then
    tries ``rmdir`` on one inside another directory being cleared (not once ``--max-delete``
    is reached: that check comes first; a dry run does not try it and says ``*deleting``), and
    nothing for an emptied directory the limit keeps. Each ``rmdir`` tried counts towards
    ``--max-delete``, as rsync counts it.
    """
    src_paths = {e.path for e in src}
    deleted = {d.path: d for d in plan.delete if d.path not in src_paths}
    nodes = {d.path: d for d in extraneous}
    for p in deleted:
        nodes.setdefault(p, deleted[p])
    full = _nonempty_after(plan, have, protected)
    kids: dict[str, list[str]] = {}
    for p in nodes:
        kids.setdefault(p.rpartition("/")[0], []).append(p)
    src_kids: dict[str, list[Entry]] = {}
    for e in src:
        if e.path:
            src_kids.setdefault(e.path.rpartition("/")[0], []).append(e)

    def flist(p: str, kind: str) -> tuple[bool, bytes]:
        return kind == DIR, p.rpartition("/")[2].encode("utf-8", "surrogateescape")

    order: list[tuple[str, Entry]] = []
    count = [0]

    def delete_in(dir_path: str, nested: bool) -> None:
        for p in sorted(kids.get(dir_path, ()), key=lambda q: flist(q, nodes[q].kind), reverse=True):
            node = nodes[p]
            if node.kind == DIR:
                delete_in(p, True)
            if p in deleted:
                order.append(("*deleting", node))
                count[0] += 1
            elif node.kind == DIR and p in full:
                order.append((NONEMPTY, node))  # its contents could not all go
                if nested and (max_delete is None or count[0] < max_delete):  # then its rmdir is tried
                    order.append(("*deleting" if dry_run else NONEMPTY, node))
                    count[0] += 1

    def visit(dir_path: str) -> None:
        delete_in(dir_path, False)
        entries = sorted(src_kids.get(dir_path, ()), key=lambda e: flist(e.path, e.kind))
        for e in entries:
            d = have.get(e.path)
            if e.kind != DIR and d is not None and d.kind == DIR:
                delete_in(e.path, True)  # making room: what is inside the directory a file replaces
        for e in entries:
            if e.kind == DIR:
                visit(e.path)

    visit("")
    seen = {e.path for _, e in order}
    order += [("*deleting", d) for p, d in deleted.items() if p not in seen]  # below a directory whose list was not fetched
    return order


def _limit_deletes(plan: Plan, have: dict[str, Entry], src: list[Entry], limit: int) -> None:
    """Keep at most ``limit`` of the planned deletions of entries missing at the source, chosen as
    rsync ``--max-delete`` chooses them, and count the rest in ``plan.deletes_skipped``.

    rsync's order (generator.c and delete.c, ``--delete-during``, incremental recursion): the
    base's extraneous entries first; then, directory by directory (depth first), each source
    entry of the directory in file-list order (its non-directories by name, then its
    directories by name): where it replaces a destination directory, that directory's contents
    ("making room"), and where it is a directory, its extraneous entries; only then the
    directories' own lists. Within one destination directory, entries go in reverse file-list
    order, a directory's contents before it. Once ``limit`` are deleted, each further entry is
    skipped and counted, but a directory left non-empty (contents skipped or protected) stays
    (``plan.kept_dirs``; one in the way of a replacement makes that replacement refused), and is
    counted only inside a directory being cleared (rsync's ``delete_dir_contents`` checks the
    limit before its ``rmdir``; ``delete_in_dir`` looks at the contents first). The replaced entries themselves are neither limited nor counted.
    """
    src_paths = {e.path for e in src}
    extraneous = {d.path: d for d in plan.delete if d.path not in src_paths}
    kids: dict[str, list[str]] = {}
    for p in have:
        if p:
            kids.setdefault(p.rpartition("/")[0], []).append(p)
    src_kids: dict[str, list[Entry]] = {}
    for e in src:
        if e.path:
            src_kids.setdefault(e.path.rpartition("/")[0], []).append(e)

    def name(p: str) -> bytes:
        return p.rpartition("/")[2].encode("utf-8", "surrogateescape")

    def flist(kind: str, p: str) -> tuple[bool, bytes]:  # rsync's file-list order within a directory
        return kind == DIR, name(p)

    order: list[tuple[str, bool]] = []  # (path, nested: inside a directory being cleared)

    def delete_in(dir_path: str, nested: bool) -> None:  # the extraneous entries of one destination directory
        here = [q for q in kids.get(dir_path, ()) if q in extraneous]
        for p in sorted(here, key=lambda q: flist(extraneous[q].kind, q), reverse=True):
            if extraneous[p].kind == DIR:
                delete_in(p, True)
            order.append((p, nested))

    done: set[str] = set()

    def walk(dir_path: str) -> None:  # one source directory's list
        done.add(dir_path)
        entries = sorted(src_kids.get(dir_path, ()), key=lambda e: flist(e.kind, e.path))
        for e in entries:
            d = have.get(e.path)
            if d is not None and d.kind == DIR:
                delete_in(e.path, e.kind != DIR)  # its extraneous entries, or (replaced) all of them
        for e in entries:
            if e.kind == DIR:
                walk(e.path)

    delete_in("", False)
    walk("")
    for e in sorted((e for e in src if e.kind == DIR and e.path not in done), key=lambda e: e.path):
        if e.path not in done:
            walk(e.path)  # a directory listed below an unchanged one (its parent's list was not fetched)
    deleted: set[str] = set()
    for p, nested in order:
        full = extraneous[p].kind == DIR and any(q not in deleted for q in kids.get(p, ()))
        if full and not nested:
            plan.kept_dirs.append(p)  # rsync: "cannot delete non-empty directory", not counted
        elif len(deleted) >= limit:
            plan.deletes_skipped += 1  # inside a directory being cleared, even a non-empty one counts
        elif full:
            plan.kept_dirs.append(p)
        else:
            deleted.add(p)
    plan.delete = [d for d in plan.delete if d.path in src_paths or d.path in deleted]


def _refuse_nonempty_replacements(plan: Plan, have: dict[str, Entry], src_paths: set[str], protected: set[str]) -> None:
    """Take out of ``plan`` each non-directory that would replace a directory which stays non-empty.

    A directory keeps its children that are not deleted (no ``--delete``, or protected by
    an exclude rule: ``protected``, which the destination's listing does not show); rsync then says "cannot delete non-empty directory" and "could not
    make way for new ..." and exits 23. The entry goes to ``plan.refused``; the directory
    stays as it is (its deletable children are still deleted, as rsync does).
    """
    replaced_dirs = [d.path for d in plan.delete if d.kind == DIR and d.path in src_paths]
    if not replaced_dirs:
        return
    kept_parents = _nonempty_after(plan, have, protected)  # every ancestor of an entry that stays (protected ones too)
    refused = {p for p in replaced_dirs if p in kept_parents}
    if not refused:
        return
    for p in sorted(refused):
        plan.refused.append((p, "cannot delete non-empty directory: could not make way for the new entry"))
    plan.delete = [d for d in plan.delete if d.path not in refused]
    plan.files = [e for e in plan.files if e.path not in refused]
    plan.links = [e for e in plan.links if e.path not in refused]


def dry_run_changes(plan: Plan, src: list[Entry], root_name: str = "") -> dict[str, list[str]]:
    """What a dry run would change, as rsync ``-n -v`` lists it: paths relative to the destination base.

    Returns
    -------
    dict
        ``{"transfer": [...], "delete": [...], "lines": [...]}``: directories, files and
        symlinks that would be created or updated (in source order; a directory whose only change
        is its mode or mtime is not listed), and entries that would be deleted (children first;
        an entry replaced by one of another kind is listed under both); ``lines`` (when the plan
        has ``items``) is what ``rsync -n -v`` prints: ``deleting PATH``, then each entry created,
        each file sent, each symlink changed and each directory whose mode or mtime changes
        (rsync's "significant" items: not a file's or a symlink's attributes alone), relative to
        the transfer root as :func:`itemize_lines` shows them, without the change codes.
    """
    transfer = sorted({e.path for e in (*plan.mkdirs, *plan.files, *plan.links) if e.path}, key=_source_order(src))
    out = {"transfer": transfer, "delete": [d.path for d in plan.delete]}
    if plan.items:
        shown = [(c, e) for c, e in plan.items if c[0] in "*c<>h" or e.kind == DIR]
        out["lines"] = [line if c == NONEMPTY else ("deleting " if c == "*deleting" else "") + line[12:]
                        for (c, _), line in zip(shown, itemize_lines(shown, root_name))]
    return out


def _source_order(src: list[Entry]) -> Callable[[str], int]:
    order = {e.path: i for i, e in enumerate(src)}
    return lambda p: order.get(p, len(order))


def itemize_lines(items: list[tuple[str, Entry]], root_name: str, push: bool = False) -> list[str]:
    """rsync ``--itemize-changes`` lines of ``items`` (``Plan.items``).

    Paths are shown as rsync shows them: relative to the transfer root (``root_name``, the
    source's name when it had no trailing slash, before each path; the base itself as
    ``root_name`` or ``.``), directories with a trailing ``/``, symlinks with ``-> target``;
    names that are not valid UTF-8 with ``\\xNN`` escapes; a hard link (``hf``, ``-H``) with ``=> PATH``
    it is linked to (the entry's ``target``). A deletion is ``*deleting`` padded to
    11 characters; an extraneous directory left non-empty (code :data:`NONEMPTY`) is rsync's
    "cannot delete non-empty directory: PATH". In a push, a transferred file's ``>`` is ``<`` (sent), as rsync prints it on
    the sending side.
    """
    from tb5sync.tree.entry import show_path

    out = []
    for code, e in items:
        path = f"{root_name}/{e.path}" if root_name and e.path else (e.path or root_name or ".")
        if code == NONEMPTY:  # rsync's own words, the directory without its slash
            out.append(f"{NONEMPTY} {show_path(path)}")
            continue
        if e.kind == DIR:
            path += "/"
        line = f"{code:<11} {show_path(path)}"
        if e.kind == LINK and code != "*deleting":
            line += f" -> {show_path(e.target or '')}"
        elif code.startswith("h") and e.target:  # -H: the path it is linked to, as rsync shows it
            line += " => " + show_path(f"{root_name}/{e.target}" if root_name else e.target)
        if push and code.startswith(">"):
            line = "<" + line[1:]
        out.append(line)
    return out
