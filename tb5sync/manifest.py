"""Scan a tree into manifest entries, match exclude patterns, and plan a sync.

No networking here. A manifest is a list of :class:`Entry`, one per regular
file, directory or symlink under a base path, with paths relative to the base
(``""`` is the base itself) in POSIX form, parents before children.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ._paths import STATE_DIR  # the per-root state directory: never listed, never transferred
from .errors import RemoteNotFoundError, UsageError

__all__ = [
    "Entry",
    "FILE",
    "DIR",
    "LINK",
    "STATE_DIR",
    "ExcludeRules",
    "scan",
    "scan_tree",
    "Tree",
    "listing_digest",
    "Plan",
    "plan_sync",
    "kind_of",
    "source_name",
    "listdir_stat",
    "py_listdir_stat",
    "SCAN_IMPLEMENTATION",
]

log = logging.getLogger(__name__)

FILE = "f"
DIR = "d"
LINK = "l"


class Entry(NamedTuple):
    """One manifest entry.

    Attributes
    ----------
    path : str
        POSIX path relative to the scan base; ``""`` is the base itself.
    kind : str
        ``"f"`` regular file, ``"d"`` directory, ``"l"`` symlink.
    mode : int
        Permission bits (``stat.S_IMODE``).
    size : int
        Bytes (0 for directories; the target's length for symlinks).
    mtime_ns : int
        Modification time, nanoseconds since the epoch.
    target : str
        Symlink target as stored (not resolved); ``""`` otherwise.
    """

    path: str
    kind: str
    mode: int
    size: int
    mtime_ns: int
    target: str = ""

    @classmethod
    def from_wire(cls, item: Sequence[object]) -> Entry:
        """Validate and build an entry from its msgpack array form.

        Raises
        ------
        UsageError
            Wrong arity or field types, or an unsafe path (absolute or with ``..``).
        """
        if not isinstance(item, (list, tuple)) or len(item) != 6:
            raise UsageError("manifest entry must be an array of 6 fields")
        path, kind, mode, size, mtime_ns, target = item
        if not (
            isinstance(path, str)
            and kind in (FILE, DIR, LINK)
            and isinstance(mode, int)
            and isinstance(size, int)
            and size >= 0
            and isinstance(mtime_ns, int)
            and isinstance(target, str)
        ):
            raise UsageError(f"malformed manifest entry {item!r:.200}")
        check_relpath(path)
        return cls(path, str(kind), mode & 0o7777, size, mtime_ns, target)


def check_relpath(path: str) -> str:
    """Return ``path`` if it is a safe relative POSIX path, else raise.

    Safe means: not absolute, no ``..`` or ``.`` component, no empty component, no NUL.
    ``""`` (the base itself) is safe.

    Raises
    ------
    UsageError
        Naming the path and what is wrong with it.
    """
    if path == "":
        return path
    if "\0" in path:
        raise UsageError(f"path contains NUL: {path!r}")
    if path.startswith("/"):
        raise UsageError(f"absolute path not allowed: {path!r}")
    # fast path (manifests of 10^5 entries): no empty component and no component starting with "."
    if "//" not in path and not path.endswith("/") and not path.startswith(".") and "/." not in path:
        return path
    for part in path.split("/"):
        if part in ("", ".", ".."):
            raise UsageError(f"path component {part!r} not allowed in {path!r}")
    return path


def kind_of(path: str) -> str:
    """``"l"``, ``"d"`` or ``"f"`` for the local ``path`` (symlinks not followed); anything else counts as ``"f"``."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return LINK
    return DIR if stat.S_ISDIR(st.st_mode) else FILE


def source_name(path: str) -> str | None:
    """The name a source lands under, or None for "the contents of" (rsync's trailing slash).

    ``"a/b"`` -> ``"b"``; ``"a/b/"``, ``""``, ``"."`` and ``".."`` -> None.
    """
    if path.endswith("/") or path == "":
        return None
    name = os.path.basename(path.rstrip("/"))
    return None if name in ("", ".", "..") else name


def _glob_to_regex(pat: str) -> str:
    out = []
    i = 0
    while i < len(pat):
        c = pat[i]
        if c == "*":
            if pat[i : i + 3] == "**/":
                out.append("(?:.*/)?")  # zero or more whole directories
                i += 3
                continue
            if pat[i : i + 2] == "**":
                out.append(".*")
                i += 2
                continue
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = pat.find("]", i + 1)
            if j == -1:
                out.append(re.escape(c))
            else:
                body = pat[i + 1 : j].replace("\\", "\\\\")
                if body.startswith("!"):
                    body = "^" + body[1:]
                out.append(f"[{body}]")
                i = j + 1
                continue
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


@dataclass(frozen=True)
class ExcludeRules:
    """rsync-style exclude patterns, matched against paths relative to the transfer root.

    Semantics (from rsync(1), "INCLUDE/EXCLUDE PATTERN RULES"):

    * a pattern ending in ``/`` matches directories only;
    * a pattern with no other ``/`` matches the final path component at any depth;
    * a pattern with a ``/`` matches the whole relative path, anchored at the
      transfer root if it starts with ``/``, otherwise at any directory boundary;
    * ``*`` matches within a component, ``**`` across components, ``?`` one char,
      ``[...]`` a character class.

    An excluded directory is not descended into.

    Raises
    ------
    UsageError
        An empty pattern.
    """

    patterns: tuple[str, ...] = ()
    _compiled: tuple[tuple[re.Pattern[str], bool, bool], ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        compiled = []
        for pat in self.patterns:
            if not pat or pat == "/":
                raise UsageError(f"empty exclude pattern {pat!r}")
            dir_only = pat.endswith("/")
            p = pat.rstrip("/")
            anchored = p.startswith("/")
            p = p.lstrip("/")
            whole = anchored or "/" in p
            rx = _glob_to_regex(p)
            if whole and not anchored:
                rx = f"(?:.*/)?{rx}"
            compiled.append((re.compile(rf"\A{rx}\Z", re.S), dir_only, whole))
        object.__setattr__(self, "_compiled", tuple(compiled))

    def __bool__(self) -> bool:
        return bool(self.patterns)

    def match(self, relpath: str, is_dir: bool) -> bool:
        """True if ``relpath`` (relative to the transfer root, ``""`` never matches) is excluded."""
        if not relpath:
            return False
        base = relpath.rsplit("/", 1)[-1]
        for rx, dir_only, whole in self._compiled:
            if dir_only and not is_dir:
                continue
            if rx.match(relpath if whole else base):
                return True
        return False

    def excluded_by_parent(self, relpath: str) -> bool:
        """True if ``relpath`` or any of its parent directories is excluded."""
        parts = relpath.split("/")
        for i in range(1, len(parts)):
            if self.match("/".join(parts[:i]), True):
                return True
        return False


_NO_RULES = ExcludeRules()

_tuple_new = tuple.__new__  # builds an Entry without NamedTuple's Python-level __new__ (the scan's hot loop)


def _entry_from_stat(rel: str, st: os.stat_result, full: str) -> Entry | None:
    m = st.st_mode
    if stat.S_ISREG(m):
        return Entry(rel, FILE, stat.S_IMODE(m), st.st_size, st.st_mtime_ns)
    if stat.S_ISDIR(m):
        return Entry(rel, DIR, stat.S_IMODE(m), 0, st.st_mtime_ns)
    if stat.S_ISLNK(m):
        target = os.readlink(full)
        return Entry(rel, LINK, stat.S_IMODE(m), len(target.encode("utf-8", "surrogateescape")), st.st_mtime_ns, target)
    log.warning("skipping %s: not a regular file, directory or symlink", full)
    return None


@dataclass
class Tree:
    """A scanned tree: the entries of :func:`scan`, grouped by directory, and per-directory digests.

    Attributes
    ----------
    entries : list of Entry
        As :func:`scan` returns them (base first, depth-first, parents before children).
    children : dict of str to list of Entry
        For every directory that was listed, its path -> its direct children in name
        order (excluded names and ``.tb5sync`` left out). Keys are in depth-first order,
        parents before children. Empty when the base is not a directory.
    """

    entries: list[Entry]
    children: dict[str, list[Entry]]
    _digests: dict[str, bytes] | None = field(default=None, repr=False, compare=False)
    _summary: list[tuple[str, bytes, int, int]] | None = field(default=None, repr=False, compare=False)

    def digests(self) -> dict[str, bytes]:
        """Each listed directory's path -> :func:`listing_digest` of its children (computed once)."""
        if self._digests is None:
            self._digests = {d: listing_digest(kids) for d, kids in self.children.items()}
        return self._digests

    def summary(self) -> list[tuple[str, bytes, int, int]]:
        """``(path, digest, files, bytes)`` per listed directory, in :attr:`children` order.

        ``files`` and ``bytes`` count the directory's direct children that are regular
        files and their sizes (bytes), so that the sums over all directories are the
        tree's totals (the base itself excepted when it is a file). Computed once.
        """
        if self._summary is None:
            dg = self.digests()
            out: list[tuple[str, bytes, int, int]] = []
            for d, kids in self.children.items():
                files = [e.size for e in kids if e.kind == FILE]
                out.append((d, dg[d], len(files), sum(files)))
            self._summary = out
        return self._summary


def listing_digest(children: Sequence[Entry]) -> bytes:
    """BLAKE3-256 of one directory's listing: equal digests mean equal listings.

    The listing is the msgpack array of the children's wire form
    (``[path, kind, mode, size, mtime_ns, target]``, paths relative to the scan base), in
    name order. Two sides whose bases correspond compute equal digests exactly when every
    child has the same name, type, mode bits, size, mtime (ns) and link target, which is
    everything the quick check and the metadata sync look at. An empty directory has the
    digest of an empty array.
    """
    import blake3
    import msgpack

    return blake3.blake3(msgpack.packb(children)).digest()


def scan_tree(
    base: str | os.PathLike[str],
    excludes: ExcludeRules = _NO_RULES,
    *,
    missing_ok: bool = False,
) -> Tree:
    """Scan like :func:`scan` (recursively) and keep each directory's listing.

    Returns
    -------
    Tree
        ``entries`` exactly as :func:`scan` would return them; ``children`` for the base
        (when a directory) and every directory below it that was listed. A missing base
        with ``missing_ok`` gives an empty tree.

    Raises
    ------
    RemoteNotFoundError, PermissionError
        As :func:`scan`.
    """
    children: dict[str, list[Entry]] = {}
    return Tree(_scan(base, excludes, missing_ok, True, children), children)


def scan(
    base: str | os.PathLike[str],
    excludes: ExcludeRules = _NO_RULES,
    *,
    missing_ok: bool = False,
    recursive: bool = True,
) -> list[Entry]:
    """List the tree at ``base`` without following symlinks.

    Parameters
    ----------
    base : path
        A directory, regular file or symlink on the local filesystem.
    excludes : ExcludeRules
        Patterns relative to ``base``; excluded directories are not descended into.
    missing_ok : bool
        Return ``[]`` instead of raising when ``base`` does not exist.
    recursive : bool
        False lists only ``base`` and its immediate children.

    Returns
    -------
    list of Entry
        ``base`` itself first (path ``""``), then its contents in depth-first
        order, parents before children, names sorted. ``.tb5sync`` state
        directories and special files (sockets, FIFOs, devices; logged as a
        warning) are left out.

    Raises
    ------
    RemoteNotFoundError
        ``base`` does not exist (and not ``missing_ok``).
    PermissionError
        A directory cannot be listed.
    """
    return _scan(base, excludes, missing_ok, recursive, None)


def _scan(
    base: str | os.PathLike[str],
    excludes: ExcludeRules,
    missing_ok: bool,
    recursive: bool,
    children: dict[str, list[Entry]] | None,
) -> list[Entry]:
    base = os.fspath(base)
    try:
        st = os.lstat(base)
    except FileNotFoundError:
        if missing_ok:
            return []
        raise RemoteNotFoundError(f"no such file or directory: {base}") from None
    top = _entry_from_stat("", st, base)
    if top is None:
        return []
    out = [top]
    if top.kind == DIR:
        _walk(base, "", excludes, out, children, recursive)
    return out


def py_listdir_stat(path: str | os.PathLike[str]) -> list[tuple[str, int, int, int]]:
    """One directory's names with the ``lstat`` fields a manifest needs (pure-Python twin).

    Parameters
    ----------
    path : str or path
        A directory (a symlink to one is followed, as ``os.scandir`` does).

    Returns
    -------
    list of (str, int, int, int)
        ``(name, st_mode, st_size, st_mtime_ns)`` per name, in the order the directory
        gives them (not sorted), ``.`` and ``..`` left out; names decoded as ``os.fsdecode``
        does; sizes in bytes, mtimes in ns since the epoch. A name that vanishes before it
        is stat-ed is left out. An empty directory gives ``[]``.

    Raises
    ------
    OSError
        ``path`` cannot be listed (``FileNotFoundError``, ``NotADirectoryError``,
        ``PermissionError``, ...), or a name cannot be stat-ed for another reason than
        having vanished.

    Notes
    -----
    The Cython twin ``tb5sync._scan.listdir_stat`` (``ext/_scan.pyx``) gives the same
    list; it reads the directory and calls ``fstatat`` on every name with the GIL
    released, about twice as fast as this one on a tree of small files.
    """
    out = []
    with os.scandir(path) as it:
        for de in it:
            try:
                st = de.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            out.append((de.name, st.st_mode, st.st_size, st.st_mtime_ns))
    return out


# The one import site that picks the directory lister (TB5SYNC_PUREPYTHON=1 forces Python).
cy_listdir_stat: Callable[[str], list[tuple[str, int, int, int]]] | None
try:
    from ._scan import listdir_stat as cy_listdir_stat
except ImportError:
    cy_listdir_stat = None
listdir_stat: Callable[[str], list[tuple[str, int, int, int]]]
SCAN_IMPLEMENTATION: str
if cy_listdir_stat is not None and os.environ.get("TB5SYNC_PUREPYTHON") != "1":
    listdir_stat, SCAN_IMPLEMENTATION = cy_listdir_stat, "cython"
else:
    listdir_stat, SCAN_IMPLEMENTATION = py_listdir_stat, "python"


def _walk(
    full: str, rel: str, excludes: ExcludeRules, out: list[Entry], children: dict[str, list[Entry]] | None, recursive: bool
) -> None:
    """Append ``full``'s contents to ``out`` in depth-first order (each subdirectory's right after it).

    The hot loop of every sync: one ``lstat`` per name (:func:`listdir_stat`), entries
    built without NamedTuple's Python-level constructor. Raises what listing ``full``
    itself raises; names that vanish meanwhile are skipped.
    """
    items = listdir_stat(full)
    items.sort()  # by name: names are unique within a directory
    kids: list[Entry] = []
    if children is not None:
        children[rel] = kids
    prefix = f"{rel}/" if rel else ""
    dpre = full if full.endswith("/") else f"{full}/"
    for name, m, size, mtime_ns in items:
        if name == STATE_DIR:
            continue
        r = prefix + name
        fmt = m & 0o170000  # stat.S_IFMT
        if excludes and excludes.match(r, fmt == stat.S_IFDIR):
            continue
        if fmt == stat.S_IFREG:
            e: Entry = _tuple_new(Entry, (r, FILE, m & 0o7777, size, mtime_ns, ""))
        elif fmt == stat.S_IFDIR:
            e = _tuple_new(Entry, (r, DIR, m & 0o7777, 0, mtime_ns, ""))
        elif fmt == stat.S_IFLNK:
            try:
                target = os.readlink(dpre + name)
            except FileNotFoundError:  # vanished while scanning
                continue
            e = Entry(r, LINK, m & 0o7777, len(target.encode("utf-8", "surrogateescape")), mtime_ns, target)
        else:
            log.warning("skipping %s: not a regular file, directory or symlink", dpre + name)
            continue
        out.append(e)
        kids.append(e)
        if recursive and fmt == stat.S_IFDIR:
            try:
                _walk(dpre + name, r, excludes, out, children, True)
            except FileNotFoundError:
                continue


@dataclass
class Plan:
    """What a receiver must do to make the destination match the source.

    All paths are relative to the destination base. Lists keep source order
    (parents before children), except ``delete`` which is children first.
    """

    mkdirs: list[Entry] = field(default_factory=list)
    files: list[Entry] = field(default_factory=list)
    links: list[Entry] = field(default_factory=list)
    meta: list[Entry] = field(default_factory=list)
    delete: list[Entry] = field(default_factory=list)
    dirs: list[Entry] = field(default_factory=list)
    unchanged: int = 0


def plan_sync(
    src: Iterable[Entry],
    dst: Iterable[Entry],
    *,
    delete: bool = False,
    excludes: ExcludeRules = _NO_RULES,
    same_content: dict[str, bool] | None = None,
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

    Returns
    -------
    Plan
        Quick check (rsync's): a regular file is unchanged when size and mtime_ns
        are equal; in checksum mode, when size and content digest are equal.
        An entry whose type differs is deleted first, then recreated.
    """
    have = {e.path: e for e in dst}
    plan = Plan()
    src_paths = set()
    for e in src:
        src_paths.add(e.path)
        d = have.get(e.path)
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
        for p, d in have.items():
            if p in src_paths or p == "":
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
    return plan
