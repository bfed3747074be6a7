"""Plan a sync: compare the source's manifest with the destination's (rsync's generator decisions).

No I/O here: the inputs are manifests, the output a :class:`Plan`.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .entry import DIR, LINK, Entry, show_path
from .excludes import NO_RULES, ExcludeRules

__all__ = ["Plan", "plan_sync", "dry_run_changes", "name_fold"]

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
    """

    mkdirs: list[Entry] = field(default_factory=list)
    files: list[Entry] = field(default_factory=list)
    links: list[Entry] = field(default_factory=list)
    meta: list[Entry] = field(default_factory=list)
    delete: list[Entry] = field(default_factory=list)
    dirs: list[Entry] = field(default_factory=list)
    unchanged: int = 0
    refused: list[tuple[str, str]] = field(default_factory=list)


def plan_sync(
    src: Iterable[Entry],
    dst: Iterable[Entry],
    *,
    delete: bool = False,
    excludes: ExcludeRules = NO_RULES,
    same_content: dict[str, bool] | None = None,
    fold: Callable[[str], str] | None = None,
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

    Returns
    -------
    Plan
        Quick check (rsync's): a regular file is unchanged when size and mtime_ns
        are equal; in checksum mode, when size and content digest are equal.
        An entry whose type differs is deleted first, then recreated.
    """
    have = {e.path: e for e in dst}
    plan = Plan()
    src_paths: set[str] = set()
    if fold is not None:
        src, src_paths = _collisions(src, fold, plan.refused)
        have_folded = {fold(p): d for p, d in have.items()}
    for e in src:
        src_paths.add(e.path)
        d = have.get(e.path)
        if d is None and fold is not None:
            d = have_folded.get(fold(e.path))
        if d is not None and d.kind != e.kind:
            if not (d.kind == DIR and e.kind == DIR):
                plan.delete.append(d)
            d = None
        if e.kind == DIR:
            plan.dirs.append(e)
            if d is None:
                plan.mkdirs.append(e)
            elif d.mode != e.mode:
                plan.meta.append(e)
        elif e.kind == LINK:
            if d is None or d.target != e.target:
                if d is not None:
                    plan.delete.append(d)
                plan.links.append(e)
            else:
                if d.mtime_ns != e.mtime_ns:
                    plan.meta.append(e)
                plan.unchanged += 1
        else:
            if d is None:
                plan.files.append(e)
                continue
            if same_content is not None and e.path in same_content:
                changed = d.size != e.size or not same_content[e.path]
            else:
                changed = d.size != e.size or d.mtime_ns != e.mtime_ns
            if changed:
                plan.files.append(e)
            elif d.mode != e.mode or d.mtime_ns != e.mtime_ns:
                plan.meta.append(e)
                plan.unchanged += 1
            else:
                plan.unchanged += 1
    if delete:
        folded = {fold(p) for p in src_paths} if fold is not None else set()
        for p, d in have.items():
            if p in src_paths or p == "" or (fold is not None and fold(p) in folded):
                continue
            if excludes and (excludes.match(p, d.kind == DIR) or excludes.excluded_by_parent(p)):
                continue
            plan.delete.append(d)
    # children before parents; de-duplicate
    seen: set[str] = set()
    uniq = []
    for d in sorted(plan.delete, key=lambda x: x.path.count("/"), reverse=True):
        if d.path not in seen:
            seen.add(d.path)
            uniq.append(d)
    plan.delete = uniq
    _refuse_nonempty_replacements(plan, have, src_paths)
    return plan


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


def _refuse_nonempty_replacements(plan: Plan, have: dict[str, Entry], src_paths: set[str]) -> None:
    """Take out of ``plan`` each non-directory that would replace a directory which stays non-empty.

    A directory keeps its children that are not deleted (no ``--delete``, or protected by
    an exclude rule); rsync then says "cannot delete non-empty directory" and "could not
    make way for new ..." and exits 23. The entry goes to ``plan.refused``; the directory
    stays as it is (its deletable children are still deleted, as rsync does).
    """
    replaced_dirs = [d.path for d in plan.delete if d.kind == DIR and d.path in src_paths]
    if not replaced_dirs:
        return
    deleted = {d.path for d in plan.delete}
    kept_parents: set[str] = set()  # every ancestor of a destination entry that stays
    for p in have:
        if p and p not in deleted:
            parent = p.rpartition("/")[0]
            while parent and parent not in kept_parents:
                kept_parents.add(parent)
                parent = parent.rpartition("/")[0]
    refused = {p for p in replaced_dirs if p in kept_parents}
    if not refused:
        return
    for p in sorted(refused):
        plan.refused.append((p, "cannot delete non-empty directory: could not make way for the new entry"))
    plan.delete = [d for d in plan.delete if d.path not in refused]
    plan.files = [e for e in plan.files if e.path not in refused]
    plan.links = [e for e in plan.links if e.path not in refused]


def dry_run_changes(plan: Plan, src: list[Entry]) -> dict[str, list[str]]:
    """What a dry run would change, as rsync ``-n -v`` lists it: paths relative to the destination base.

    Returns
    -------
    dict
        ``{"transfer": [...], "delete": [...]}``: directories, files and symlinks that would be
        created or updated (in source order; a directory whose only change is its mode or mtime
        is not listed), and entries that would be deleted (children first; an entry replaced by
        one of another kind is listed under both).
    """
    transfer = sorted({e.path for e in (*plan.mkdirs, *plan.files, *plan.links) if e.path}, key=_source_order(src))
    return {"transfer": transfer, "delete": [d.path for d in plan.delete]}


def _source_order(src: list[Entry]) -> Callable[[str], int]:
    order = {e.path: i for i, e in enumerate(src)}
    return lambda p: order.get(p, len(order))
