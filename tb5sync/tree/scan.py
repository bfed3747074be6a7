"""Scan a local tree into manifest entries, with per-directory listing digests.

No networking here. The one import site that picks the directory lister: the Cython
``_scan.listdir_stat`` or its pure-Python twin :func:`py_listdir_stat`
(``TB5SYNC_PUREPYTHON=1`` forces Python).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tb5sync._os.paths import STATE_DIR, Jail, is_temp_name  # state directory, files being written: never listed, never transferred
from tb5sync.tree.entry import DIR, FILE, LINK, Entry
from tb5sync.errors import RemoteNotFoundError
from tb5sync.tree.excludes import NO_RULES, ExcludeRules

__all__ = ["Extras", "scan", "scan_tree", "special_kind", "Tree", "listing_digest", "listdir_stat", "py_listdir_stat", "SCAN_IMPLEMENTATION",
           "PATH_MAX", "OVERFLOW", "max_path"]

log = logging.getLogger(__name__)

#: rsync's MAXPATHLEN on Linux (bytes with the NUL): the longest path below a transfer root a
#: source lists. A constant, so that both ends of a transfer agree whatever their own PATH_MAX
#: (macOS's is 1024; every path here is opened relative to a directory descriptor anyway).
PATH_MAX = 4096

#: The start of the reason given for an entry left out for its path's length (rsync's words). Such
#: an entry is a failure (exit 23) but, as in rsync, not an I/O error that stops deletions.
OVERFLOW = "filename overflows max-path len"


def max_path(root: str) -> int:
    """The longest path (bytes) below a source given as ``root`` (its name when given without a
    trailing slash: rsync's paths then start with ``root/``; else ``""``) that rsync sends."""
    return PATH_MAX - 1 - (len(root.encode("utf-8", "surrogateescape")) + 1 if root else 0)

_S_IFREG, _S_IFDIR, _S_IFLNK = stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK  # module globals: one lookup each, not two, in the loop
_tuple_new = tuple.__new__  # builds an Entry without NamedTuple's Python-level __new__ (the scan's hot loop)


def _entry_from_stat(rel: str, st: os.stat_result, full: str, dfd: int | None = None, name: str | None = None) -> Entry | None:
    m = st.st_mode
    if stat.S_ISREG(m):
        return Entry(rel, FILE, stat.S_IMODE(m), st.st_size, st.st_mtime_ns)
    if stat.S_ISDIR(m):
        return Entry(rel, DIR, stat.S_IMODE(m), 0, st.st_mtime_ns)
    if stat.S_ISLNK(m):
        target = os.readlink(full) if dfd is None else os.readlink(name or full, dir_fd=dfd)
        return Entry(rel, LINK, stat.S_IMODE(m), len(target.encode("utf-8", "surrogateescape")), st.st_mtime_ns, target)
    log.info("skipping %s: not a regular file, directory or symlink", full)
    return None


def _unlock_fd(fd: int, path: str, unlocked: dict[str, int]) -> bool:
    """Give the directory open as ``fd`` (at ``path``) ``u+rx`` if this process owns it and it
    lacks them; record its mode before in ``unlocked`` under ``path``. False when it was not changed."""
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or (st.st_mode & 0o500) == 0o500:
            return False
        os.fchmod(fd, stat.S_IMODE(st.st_mode) | 0o500)
    except OSError:
        return False
    unlocked.setdefault(path, stat.S_IMODE(st.st_mode))
    return True


def _unlock_at(dfd: int | None, name: str, path: str, unlocked: dict[str, int]) -> bool:
    """:func:`_unlock_fd` for a directory that cannot be opened (no ``u+r``): the entry ``name``
    of the directory ``dfd`` (None: ``name`` is a path) is checked to be a directory of this
    process's (not following a symlink) and changed relative to ``dfd``."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or (st.st_mode & 0o500) == 0o500:
            return False
        os.chmod(name, stat.S_IMODE(st.st_mode) | 0o500, dir_fd=dfd)  # a directory, checked just above
    except OSError:
        return False
    unlocked.setdefault(path, stat.S_IMODE(st.st_mode))
    return True


def _open_dir(name: str, dfd: int | None, path: str, unlocked: dict[str, int] | None) -> int:
    """Open the directory ``name`` of ``dfd`` (None: ``name`` is a path) with ``O_NOFOLLOW``;
    one that may not be read is given ``u+rx`` first when ``unlocked`` is given (see :func:`_unlock_at`).

    Raises
    ------
    OSError
        It cannot be opened (``ELOOP``/``ENOTDIR`` for a symlink or a file, ``PermissionError``, ...).
    """
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dfd)
    except PermissionError:
        if unlocked is None or not _unlock_at(dfd, name, path, unlocked):
            raise
        return os.open(name, _DIR_FLAGS, dir_fd=dfd)


def _cannot_list(full: str, rel: str, exc: OSError, errors: list[tuple[str, str]], children: dict[str, list[Entry]] | None) -> None:
    """Name the directory ``rel`` that could not be listed in ``errors``; its listing is empty (rsync's "opendir failed")."""
    log.info("cannot list %s: %s", full, exc.strerror or exc)  # reported through errors
    errors.append((rel, f"cannot list directory: {exc.strerror or exc} ({exc.errno})"))
    if children is not None:
        children[rel] = []


def special_kind(mode: int) -> str:
    """What a special file is, from its ``st_mode``: ``"fifo"``, ``"socket"``, ``"character
    device"``, ``"block device"`` (else ``"special file"``)."""
    fmt = stat.S_IFMT(mode)
    return {
        stat.S_IFIFO: "fifo",
        stat.S_IFSOCK: "socket",
        stat.S_IFCHR: "character device",
        stat.S_IFBLK: "block device",
    }.get(fmt, "special file")


@dataclass
class Extras:
    """What a source's scan does beyond listing (rsync ``-H``, ``-X``, ``-L``,
    ``--copy-unsafe-links``, ``--safe-links``); see :meth:`from_options`.

    Attributes
    ----------
    hard_links, xattrs : bool
        Fill :attr:`Tree.hardlinks` / :attr:`Tree.xattrs`.
    copy_links, copy_unsafe_links, safe_links : bool
        List what every symlink (``copy_links``) or every unsafe one points to instead of the
        link, or leave unsafe ones out (:func:`tb5sync._os.fsmeta.unsafe_symlink`). A link whose
        target cannot be reached (dangling, a loop of links: ``ELOOP``), or a directory met
        again below itself, is a failure named in :attr:`Tree.errors`; the rest is listed.
    prefix : str
        The source's name when named without a trailing slash (rsync's transfer root is then
        its parent: unsafe is judged from there), else ``""``.
    root : str or None
        A server's ROOT: a followed link that resolves outside it is a failure, never listed.
    """

    hard_links: bool = False
    xattrs: bool = False
    copy_links: bool = False
    copy_unsafe_links: bool = False
    safe_links: bool = False
    prefix: str = ""
    root: str | None = None
    inodes: dict[tuple[int, int], list[str]] = field(default_factory=dict)
    ancestors: list[tuple[int, int]] = field(default_factory=list)
    _jail: Jail | None = field(default=None, repr=False)

    def locate_in_root(self, full: str, failed: Callable[[str], None]) -> tuple[os.stat_result, int, str] | None:
        """Where the followed symlink at path ``full`` leads inside :attr:`root`, looked up
        race-free: ``(lstat of the target, a new descriptor of its directory, its name)``.

        The link is resolved inside ROOT (``realpath``; outside or into the state is refused),
        then the result is looked up through ROOT's jail (no symlink on any component, the
        last included), so a link or a parent directory swapped after the resolution makes the
        lookup fail instead of leaving ROOT. On a failure ``failed(reason)`` is called and None
        returned: dangling or a loop ("symlink has no referent"), outside ROOT, a temporary
        file, or swapped while scanning.
        """
        from tb5sync.errors import PathError

        root = self.root
        assert root is not None
        if self._jail is None:
            self._jail = Jail(root)
        jail = self._jail
        link = os.path.relpath(full, root)
        try:
            if link == ".." or link.startswith("../"):
                raise PathError(f"not below the served root: {full}")
            parts = jail.resolve(link, follow=True)
        except PathError:
            failed("symlink leads outside the served root (or into its state)")
            return None
        except OSError as exc:  # resolving a loop of links
            failed(f"symlink has no referent: {exc.strerror or exc} ({exc.errno})")
            return None
        if parts and is_temp_name(parts[-1]):
            return None
        try:
            at_fd, at_name = jail.locate(parts)
        except (PathError, OSError) as exc:
            if isinstance(exc, FileNotFoundError):
                failed(f"symlink has no referent: {exc.strerror or exc} ({exc.errno})")
            else:
                failed("symlink leads outside the served root (or changed while scanning)")
            return None
        try:
            st = os.stat(at_name, dir_fd=at_fd, follow_symlinks=False)
        except OSError as exc:
            os.close(at_fd)
            failed(f"symlink has no referent: {exc.strerror or exc} ({exc.errno})")
            return None
        if stat.S_ISLNK(st.st_mode):  # a link swapped in after the resolution: not followed
            os.close(at_fd)
            failed("symlink leads outside the served root (or changed while scanning)")
            return None
        return st, at_fd, at_name

    def close(self) -> None:
        """Close the jail :meth:`locate_in_root` opened (if any)."""
        if self._jail is not None:
            self._jail.close()
            self._jail = None

    @classmethod
    def from_options(cls, options: object, root: str | None = None) -> Extras | None:
        """The extras a :class:`~tb5sync.tree.options.SyncOptions` asks for; None when it asks for none."""
        kw = {k: bool(getattr(options, k, False)) for k in ("hard_links", "xattrs", "copy_links", "copy_unsafe_links", "safe_links")}
        if not any(kw.values()):
            return None
        return cls(**kw, prefix=str(getattr(options, "exclude_root", "")), root=root)

    @property
    def links(self) -> bool:
        """Whether symlinks are looked at (followed or left out)."""
        return self.copy_links or self.copy_unsafe_links or self.safe_links

    def xattrs_at(self, dfd: int | None, name: str, follow: bool, tree_xattrs: dict[str, list[tuple[bytes, bytes]]], rel: str) -> None:
        """Read the copied extended attributes of ``name`` in ``dfd`` into ``tree_xattrs[rel]`` (when any);
        one that cannot be opened or read is passed over (logged)."""
        from tb5sync._os.fsmeta import list_xattrs

        flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (0 if follow else os.O_NOFOLLOW)
        try:
            xfd = os.open(name, flags, dir_fd=dfd)
        except OSError as exc:
            log.info("cannot read the extended attributes of %s: %s", rel or ".", exc.strerror or exc)
            return
        try:
            xa = list_xattrs(xfd)
        except OSError as exc:
            log.info("cannot read the extended attributes of %s: %s", rel or ".", exc.strerror or exc)
            return
        finally:
            os.close(xfd)
        if xa:
            tree_xattrs[rel] = xa


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
    errors : list of (str, str)
        ``(path, reason)`` of each directory that could not be listed (its listing in
        :attr:`children` is empty): the scan went on without its contents.
    skipped : list of (str, str)
        ``(path, what)`` of each special file left out (``what``: ``"fifo"``, ``"socket"``,
        ``"character device"``, ``"block device"``), in scan order.
    unlocked : dict of str to int
        Absolute paths of the directories :func:`scan_tree` gave ``u+rx`` to list them
        (``unlock``), to their mode before.
    temps : list of str
        Paths of the temporary files (``.NAME.XXXXXXXX.tb5tmp``, files being written by a
        sync or left by an interrupted one) the scan passed over, relative to the base.
    hardlinks : dict of str to int
        With :attr:`Extras.hard_links`: each regular file sharing its inode with another listed
        one -> the number of its group (rsync ``-H``).
    xattrs : dict of str to list of (bytes, bytes)
        With :attr:`Extras.xattrs`: each file or directory (``""`` the base) having copied
        extended attributes -> ``(name, value)`` sorted (rsync ``-X``, :mod:`tb5sync._os.fsmeta`).
    protected : set of str
        :func:`scan_tree` only: each directory (relative to the base, ``""`` the base) directly
        holding an entry the exclude rules left out: a destination's ``--delete`` keeps such a
        directory, which stays non-empty (rsync: "cannot delete non-empty directory").
    """

    entries: list[Entry]
    children: dict[str, list[Entry]]
    errors: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    unlocked: dict[str, int] = field(default_factory=dict)
    temps: list[str] = field(default_factory=list)
    hardlinks: dict[str, int] = field(default_factory=dict)
    xattrs: dict[str, list[tuple[bytes, bytes]]] = field(default_factory=dict)
    protected: set[str] = field(default_factory=set)
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

    # surrogateescape: a name that is not valid UTF-8 is hashed as its bytes (never decoded)
    return blake3.blake3(msgpack.packb(children, unicode_errors="surrogateescape")).digest()


def scan_tree(
    base: str | os.PathLike[str],
    excludes: ExcludeRules = NO_RULES,
    *,
    missing_ok: bool = False,
    unlock: bool = False,
    extras: Extras | None = None,
    max_path: int = 0,
    at: tuple[int, str] | None = None,
) -> Tree:
    """Scan like :func:`scan` (recursively) and keep each directory's listing.

    ``max_path`` (a source's scan; bytes, 0 for no limit): an entry whose path below the base is
    longer is left out (with what is below it) and named in ``errors`` as rsync's sender names
    it ("filename overflows max-path len by N"), so the run goes on and exits 23; the sender
    passes :data:`PATH_MAX` - 1 less the bytes its transfer root adds (``src/`` without a slash).

    ``unlock`` (a destination's scan): a directory this process owns but may not list (no
    ``u+r``/``u+x``, a non-root user's) is given ``u+rx`` and listed, as rsync makes its way
    into a destination directory; ``Tree.unlocked`` maps its path to its mode before.
    ``extras`` (a source's scan): hard-link groups, extended attributes, symlinks followed or
    left out (see :class:`Extras`). ``at``: as :func:`scan`.

    Returns
    -------
    Tree
        ``entries`` exactly as :func:`scan` would return them; ``children`` for the base
        (when a directory) and every directory below it that was listed. A missing base
        with ``missing_ok`` gives an empty tree. A directory that cannot be listed
        (``PermissionError`` and other ``OSError`` s but a vanished one) is kept with an
        empty listing and named in ``errors``, as rsync goes on after "opendir failed".

    Raises
    ------
    RemoteNotFoundError
        As :func:`scan`.
    """
    children: dict[str, list[Entry]] = {}
    errors: list[tuple[str, str]] = []
    skipped: list[tuple[str, str]] = []
    unlocked: dict[str, int] | None = {} if unlock else None
    temps: list[str] = []
    tree = Tree([], children, errors=errors, skipped=skipped, temps=temps)
    try:
        tree.entries = _scan(base, excludes, missing_ok, True, children, temps, errors, skipped, unlocked, extras, tree, max_path, at)
    finally:
        if extras is not None:
            extras.close()
    tree.unlocked = unlocked or {}
    if extras is not None and extras.hard_links:
        groups = [paths for paths in extras.inodes.values() if len(paths) > 1]
        tree.hardlinks = {p: g for g, paths in enumerate(groups) for p in paths}
    return tree


def scan(
    base: str | os.PathLike[str],
    excludes: ExcludeRules = NO_RULES,
    *,
    missing_ok: bool = False,
    recursive: bool = True,
    at: tuple[int, str] | None = None,
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
    at : tuple of (int, str), optional
        ``(dir_fd, name)``: the base is the entry ``name`` of the open directory ``dir_fd``
        (``"."``: that directory itself), looked up relative to it and never through a symlink
        (a server's session base, opened through its ROOT's jail); ``base`` is then only
        the path shown in messages. None: ``base`` is looked up as a path.

    Returns
    -------
    list of Entry
        ``base`` itself first (path ``""``), then its contents in depth-first
        order, parents before children, names sorted. ``.tb5sync`` state
        directories, files being written (``.NAME.XXXXXXXX.tb5tmp``) and special
        files (sockets, FIFOs, devices; logged as a warning) are left out.

    Raises
    ------
    RemoteNotFoundError
        ``base`` does not exist (and not ``missing_ok``).
    PermissionError
        A directory cannot be listed.
    """
    return _scan(base, excludes, missing_ok, recursive, None, at=at)


def _scan(
    base: str | os.PathLike[str],
    excludes: ExcludeRules,
    missing_ok: bool,
    recursive: bool,
    children: dict[str, list[Entry]] | None,
    temps: list[str] | None = None,
    errors: list[tuple[str, str]] | None = None,
    skipped: list[tuple[str, str]] | None = None,
    unlocked: dict[str, int] | None = None,
    extras: Extras | None = None,
    tree: Tree | None = None,
    max_path: int = 0,
    at: tuple[int, str] | None = None,
) -> list[Entry]:
    base = os.fspath(base)
    # the base's own lookups: by path, or (a server's session base) relative to its directory's descriptor
    dfd, name = (None, base) if at is None else at
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        if missing_ok:
            return []
        raise RemoteNotFoundError(f"no such file or directory: {base}") from None
    top = _entry_from_stat("", st, base, dfd, name)
    if top is None:
        if skipped is not None:
            skipped.append(("", special_kind(st.st_mode)))
        return []
    out = [top]
    if extras is not None and tree is not None and extras.xattrs and top.kind != LINK:
        extras.xattrs_at(dfd, name, False, tree.xattrs, "")
    if extras is not None and extras.hard_links and top.kind == FILE:
        extras.inodes.setdefault((st.st_dev, st.st_ino), []).append("")
    if top.kind == DIR:
        try:
            fd = _open_dir(name, dfd, base, unlocked)
        except OSError as exc:
            if exc.errno in _NOT_A_DIR:
                log.warning("skipping %s: replaced while scanning", base)
                return out
            if isinstance(exc, FileNotFoundError) or errors is None:
                raise
            _cannot_list(base, "", exc, errors, children)
            return out
        try:
            if extras is not None and extras.links:
                fst = os.fstat(fd)
                extras.ancestors = [(fst.st_dev, fst.st_ino)]
            _walk(base, "", excludes, out, children, recursive, temps, fd, errors, skipped, unlocked, extras, tree, max_path)
        finally:
            os.close(fd)
    return out


def py_listdir_stat(path: str | os.PathLike[str] | int) -> list[tuple[str, int, int, int]]:
    """One directory's names with the ``lstat`` fields a manifest needs (pure-Python twin).

    Parameters
    ----------
    path : str, path or int
        A directory (a symlink to one is followed, as ``os.scandir`` does), or a
        descriptor of one (left open).

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
cy_listdir_stat: Callable[[str | int], list[tuple[str, int, int, int]]] | None
try:
    from tb5sync._scan import listdir_stat as cy_listdir_stat
except ImportError:
    cy_listdir_stat = None
listdir_stat: Callable[[str | int], list[tuple[str, int, int, int]]]
SCAN_IMPLEMENTATION: str
if cy_listdir_stat is not None and os.environ.get("TB5SYNC_PUREPYTHON") != "1":
    listdir_stat, SCAN_IMPLEMENTATION = cy_listdir_stat, "cython"
else:
    listdir_stat, SCAN_IMPLEMENTATION = py_listdir_stat, "python"

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
#: What opening a directory with O_NOFOLLOW fails with when a symlink or a file was swapped in.
_NOT_A_DIR = frozenset(e for e in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK, getattr(errno, "EFTYPE", None)) if e is not None)


def _list_fd(fd: int) -> list[tuple[str, int, int, int]]:
    """:func:`listdir_stat` of the directory open as ``fd``: the directory the scan opened, wherever it now is."""
    return listdir_stat(fd)


def _walk(
    full: str,
    rel: str,
    excludes: ExcludeRules,
    out: list[Entry],
    children: dict[str, list[Entry]] | None,
    recursive: bool,
    temps: list[str] | None,
    fd: int,
    errors: list[tuple[str, str]] | None = None,
    skipped: list[tuple[str, str]] | None = None,
    unlocked: dict[str, int] | None = None,
    extras: Extras | None = None,
    tree: Tree | None = None,
    max_path: int = 0,
) -> None:
    """Append ``full``'s contents to ``out`` in depth-first order (each subdirectory's right after it).

    The hot loop of every sync: one ``lstat`` per name (:func:`listdir_stat`), entries
    built without NamedTuple's Python-level constructor. Raises what listing ``full``
    itself raises (with ``errors`` given, only ``FileNotFoundError``: other errors are
    appended to it as ``(rel, reason)`` and the directory's listing is empty); names that
    vanish meanwhile are skipped. Temporary files (:func:`~tb5sync._os.paths.is_temp_name`)
    are left out, their paths appended to ``temps``. With ``unlocked`` (a destination's
    scan), a directory of this process's that it may not list is given ``u+rx`` first.

    ``fd`` is a descriptor of ``full`` (the caller's); every directory below is opened
    relative to its parent's descriptor with ``O_NOFOLLOW`` and listed through its own
    descriptor, so a directory swapped for a symlink during the scan is not followed (it is
    skipped, as a vanished one is): no name outside the tree is listed.
    """
    try:
        try:
            items = _list_fd(fd)
        except PermissionError:
            if unlocked is None or not _unlock_fd(fd, full, unlocked):
                raise
            items = _list_fd(fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if errors is None:
            raise
        _cannot_list(full, rel, exc, errors, children)
        return
    items.sort()  # by name: names are unique within a directory
    kids: list[Entry] = []
    if children is not None:
        children[rel] = kids
    prefix = f"{rel}/" if rel else ""
    rules = excludes if excludes else None  # its __bool__ (Python) once, not per entry
    new, E, out_append, kids_append = _tuple_new, Entry, out.append, kids.append  # locals in the hot loop
    dpre = full if full.endswith("/") else f"{full}/"
    for name, m, size, mtime_ns in items:
        if name == STATE_DIR:
            continue
        if name.endswith(".tb5tmp") and is_temp_name(name):
            if temps is not None:
                temps.append(prefix + name)
            continue
        r = prefix + name
        fmt = m & 0o170000  # stat.S_IFMT
        followed = False
        at: tuple[os.stat_result, int, str] | None = None  # a followed link's target: (stat, dir fd, name)
        if extras is not None and fmt == _S_IFLNK and extras.links:
            if rules is not None and rules.match(r, False):
                continue
            got = _follow(name, fd, dpre + name, r, extras, errors)
            if got is None:
                continue
            if got is not True:
                at = got
                m, size, mtime_ns = at[0].st_mode, at[0].st_size, at[0].st_mtime_ns
                fmt, followed = m & 0o170000, True
        try:
            if rules is not None and rules.match(r, fmt == _S_IFDIR):
                if tree is not None:
                    tree.protected.add(rel)
                continue
            if max_path and len(r) * 4 > max_path and (over := len(r.encode("utf-8", "surrogateescape")) - max_path) > 0:
                if errors is None:
                    raise OSError(errno.ENAMETOOLONG, f"{OVERFLOW} by {over}", dpre + name)
                errors.append((r, f"{OVERFLOW} by {over}"))
                continue
            if extras is not None and tree is not None:
                if extras.hard_links and fmt == _S_IFREG:
                    try:
                        ist = at[0] if at is not None else os.stat(name, dir_fd=fd, follow_symlinks=False)
                        if ist.st_nlink > 1:
                            extras.inodes.setdefault((ist.st_dev, ist.st_ino), []).append(r)
                    except OSError:
                        pass
                if extras.xattrs and fmt in (_S_IFREG, _S_IFDIR):
                    if at is None:
                        extras.xattrs_at(fd, name, False, tree.xattrs, r)
                    else:  # what the link leads to (through the jail on a server: not followed again)
                        extras.xattrs_at(at[1], at[2], at[1] == fd, tree.xattrs, r)
            if fmt == _S_IFREG:
                e: Entry = new(E, (r, FILE, m & 0o7777, size, mtime_ns, ""))
            elif fmt == _S_IFDIR:
                e = new(E, (r, DIR, m & 0o7777, 0, mtime_ns, ""))
            elif fmt == _S_IFLNK:
                try:
                    target = os.readlink(name, dir_fd=fd)
                except (FileNotFoundError, OSError) as exc:  # vanished or replaced while scanning
                    if not isinstance(exc, FileNotFoundError) and exc.errno != errno.EINVAL:
                        raise
                    continue
                e = Entry(r, LINK, m & 0o7777, len(target.encode("utf-8", "surrogateescape")), mtime_ns, target)
            else:
                log.info("skipping %s: not a regular file, directory or symlink", dpre + name)
                if skipped is not None:
                    skipped.append((r, special_kind(m)))
                continue
            out_append(e)
            kids_append(e)
            if recursive and fmt == _S_IFDIR:
                try:
                    if at is not None and at[1] != fd:
                        cfd = os.open(at[2], _DIR_FLAGS, dir_fd=at[1])
                    elif followed:
                        cfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0), dir_fd=fd)
                    else:
                        cfd = _open_dir(name, fd, dpre + name, unlocked)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    if exc.errno in _NOT_A_DIR:
                        log.warning("skipping %s: replaced while scanning", dpre + name)
                        continue
                    exc.filename = dpre + name  # the path, not the name relative to fd
                    if errors is None:
                        raise
                    _cannot_list(dpre + name, r, exc, errors, children)
                    continue
                try:
                    if extras is not None and extras.links:
                        cst = os.fstat(cfd)
                        extras.ancestors.append((cst.st_dev, cst.st_ino))
                    _walk(dpre + name, r, excludes, out, children, True, temps, cfd, errors, skipped, unlocked, extras, tree, max_path)
                except FileNotFoundError:
                    continue
                finally:
                    os.close(cfd)
                    if extras is not None and extras.links:
                        extras.ancestors.pop()
        finally:
            if at is not None and at[1] != fd:  # a descriptor _follow opened (inside a server's ROOT)
                os.close(at[1])


def _follow(name: str, dfd: int, full: str, rel: str, extras: Extras, errors: list[tuple[str, str]] | None) -> tuple[os.stat_result, int, str] | bool | None:
    """What the symlink ``name`` of ``dfd`` (``rel`` in the listing) becomes under ``extras``:
    True to list it as a link, None to leave it out, or ``(st, at_fd, at_name)``: the ``stat``
    of what it points to, and where that is for any later lookup (its hard-link identity, its
    extended attributes, opening it as a directory), relative to the descriptor ``at_fd``.

    Without a ROOT that is ``(stat, dfd, name)``: the link itself, followed by each lookup.
    On a server (``extras.root``) the link is resolved inside ROOT (:meth:`Jail.resolve`) and
    the result looked up through ROOT's jail, no symlink on the way (:meth:`Jail.locate`), so a
    link or a directory swapped after the check cannot lead a lookup out of ROOT: ``at_fd`` is
    then a new descriptor of the target's directory (the caller closes it; ``at_fd != dfd``)
    and ``at_name`` a name that is not followed.

    Left out with a failure in ``errors`` (rsync: "symlink has no referent", exit 23): a
    followed link that is dangling or part of a loop of links, one leading outside a server's
    ROOT, and one to a directory that holds it (it would be listed forever).
    """
    from tb5sync._os.fsmeta import unsafe_symlink

    try:
        target = os.readlink(name, dir_fd=dfd)
    except OSError:
        return None  # vanished or replaced while scanning
    top = None
    if extras.safe_links and not extras.copy_links and full.endswith(rel):  # the transfer's top, as the scan reached it
        top = full[: len(full) - len(rel)].rstrip("/") or "/"
        if extras.prefix:
            top = os.path.dirname(top)
    unsafe = unsafe_symlink(target, f"{extras.prefix}/{rel}" if extras.prefix else rel, full, top)
    if not (extras.copy_links or (extras.copy_unsafe_links and unsafe)):
        if extras.safe_links and unsafe:
            log.info("ignoring unsafe symlink %s -> %s", full, target)
            return None
        return True

    def failed(reason: str) -> None:
        if errors is not None:
            errors.append((rel, reason))

    try:
        st = os.stat(name, dir_fd=dfd)  # on a server only to name a dangling link or a loop: not used
    except OSError as exc:
        failed(f"symlink has no referent: {exc.strerror or exc} ({exc.errno})")
        return None
    if extras.root is None:
        at: tuple[os.stat_result, int, str] = (st, dfd, name)
    else:
        got = extras.locate_in_root(full, failed)
        if got is None:
            return None
        at = got
    st = at[0]
    if stat.S_ISDIR(st.st_mode) and (st.st_dev, st.st_ino) in extras.ancestors:
        failed("symlink loop: the directory it points to holds it")
        if at[1] != dfd:
            os.close(at[1])
        return None
    return at
