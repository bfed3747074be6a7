"""Hard links on the receiving side: rsync's ``--link-dest DIR`` and ``-H`` (``--hard-links``).

``--link-dest``: a file the plan would write (missing or changed at the destination) that a
previous snapshot holds identical (regular file, same size, mtime and mode: rsync ``-a``'s
rule) is hard-linked from the snapshot instead of fetched. ``-H``: paths the sender lists as one
inode (:attr:`tb5sync.tree.scan.Tree.hardlinks`, the entries pages' ``hl``) become one inode at the
destination: the group's first path (in listing order) is written as any file, every other path
is then linked to it. Both go through :meth:`Destination.link_from` (temporary name, rename).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Sequence

from tb5sync._os.paths import STATE_DIR, Jail
from tb5sync.roles.destination import Destination
from tb5sync.tree.entry import DIR, FILE, LINK, Entry
from tb5sync.errors import PathError, Tb5syncError
from tb5sync.tree.options import SyncOptions
from tb5sync.tree.plan import _attrs as attrs_code

__all__ = ["LinkDest", "link_groups", "itemize_groups"]

log = logging.getLogger(__name__)


class LinkDest:
    """The ``--link-dest`` directories of one run, opened as jails.

    Parameters
    ----------
    destination : Destination
        Where the files land; its base and the source's name place the directories.
    options : SyncOptions
        ``link_dest`` (relative ones are relative to the destination directory, rsync's rule:
        the base itself, or its parent when the source was named without a trailing slash)
        and ``exclude_root``.
    root : str or None
        The served ROOT on a server (every directory must be inside it: ``PathError``
        otherwise; each is opened from ROOT's descriptor, no symlink on the way); None locally
        and on a pull's client (any directory).

    A directory that does not exist is left out with a warning, as rsync does.

    Raises
    ------
    PathError
        A directory outside ``root``, or through a symlink leading out of it.
    """

    def __init__(self, destination: Destination, options: SyncOptions, root: str | None = None) -> None:
        self.destination = destination
        base = destination.base
        named = bool(options.exclude_root)
        transfer_dir = os.path.dirname(base) if named else base
        self.prefix = os.path.basename(base) if named else ""
        self.jails: list[Jail] = []
        #: rsync's "--link-dest arg does not exist: DIR" of each directory left out (a server's reach its client)
        self.warnings: list[str] = []
        try:
            for d in options.link_dest:
                full = os.path.normpath(os.path.join(transfer_dir, d))
                try:
                    if root is not None:
                        rel = os.path.relpath(full, root)
                        if rel == ".." or rel.startswith("../"):
                            raise PathError(d, "--link-dest directory is outside the server's root")
                        # computed by path, then opened from ROOT's descriptor with no symlink on the
                        # way: a parent swapped for a symlink meanwhile is refused, never followed
                        with Jail(root) as rj:
                            parts = rj.resolve("" if rel == "." else rel)
                            self.jails.append(Jail(os.path.join(root, *parts), fd=rj.open_dir(parts)))
                    else:
                        self.jails.append(Jail(os.path.realpath(full)))
                except (FileNotFoundError, NotADirectoryError):
                    self.warnings.append(f"--link-dest arg does not exist: {d}")
                    log.warning("%s", self.warnings[-1])
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close the directories' descriptors."""
        for j in self.jails:
            j.close()
        self.jails = []

    def _where(self, e: Entry) -> str | None:
        """Where ``e`` is looked up in each directory (the source's name before its path when it
        was named without a slash); None for a path naming tb5sync's state directory, which is
        never looked up (on a server, ROOT/.tb5sync)."""
        rel = "/".join(p for p in (self.prefix, e.path) if p)
        return None if STATE_DIR in rel.split("/") else rel

    def link(self, e: Entry) -> bool:
        """Hard-link the file ``e`` from the first directory holding it identical; False when none does
        (or no link can be made there: it is then fetched as usual).

        Raises
        ------
        OSError
            The link or the rename at the destination failed.
        """
        rel = self._where(e) if e.kind == FILE else None
        if rel is None:
            return False
        head, _, name = rel.rpartition("/")
        for j in self.jails:
            try:
                dfd = j.dir_fd(head)
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except (OSError, PathError):
                continue
            if (stat.S_ISREG(st.st_mode) and st.st_size == e.size and st.st_mtime_ns == e.mtime_ns
                    and stat.S_IMODE(st.st_mode) == e.mode):
                if self.destination.link_from(e.path, dfd, name):
                    return True
        return False

    def _alt(self, e: Entry) -> tuple[int, Entry] | None:
        """rsync's best match for the new entry ``e`` (a file, directory or symlink) among the directories (``try_dests_reg`` /
        ``try_dests_non`` in generator.c): ``(level, entry there)``, level 1 for the first of the same
        type, 2 for the first a file's quick check (size and mtime) passes, 3 for the first with every
        attribute equal (linked as it is); None when no directory holds one of that type."""
        rel = self._where(e)
        if rel is None:
            return None
        head, _, name = rel.rpartition("/")
        best: tuple[int, Entry] | None = None
        for j in self.jails:
            try:
                if e.kind == DIR:
                    st = os.stat(j.dir_fd(rel))
                else:
                    st = os.stat(name, dir_fd=j.dir_fd(head), follow_symlinks=False)
            except (OSError, PathError):
                continue
            if stat.S_IFMT(st.st_mode) != {DIR: stat.S_IFDIR, LINK: stat.S_IFLNK}.get(e.kind, stat.S_IFREG):
                continue
            there = e._replace(size=st.st_size if e.kind == FILE else e.size, mtime_ns=st.st_mtime_ns,
                               mode=stat.S_IMODE(st.st_mode) if e.kind != LINK else e.mode,
                               target=os.readlink(name, dir_fd=j.dir_fd(head)) if e.kind == LINK else e.target)
            level = 1
            if e.kind == FILE and there.size == e.size and there.mtime_ns == e.mtime_ns:
                level = 2
            if (there.mtime_ns == e.mtime_ns and there.mode == e.mode and there.target == e.target
                    and (e.kind != FILE or level == 2)):
                return 3, there
            if best is None or level > best[0]:
                best = (level, there)
        return best

    def itemize(self, items: Sequence[tuple[str, Entry]]) -> list[tuple[str, Entry]]:
        """The plan's ``-i`` items as rsync shows them with ``--link-dest``: a new file or directory
        that a directory holds with every attribute equal is not listed (linked, or made as it is);
        one held with other attributes is shown against that copy (``cf...p.....`` for a file whose
        quick check passes, ``>f.s.......`` for one sent, ``cd..t......`` for a directory), as
        rsync 3.x prints it; anything else is unchanged."""
        out: list[tuple[str, Entry]] = []
        for code, e in items:
            alt = self._alt(e) if code in ("cd+++++++++", ">f+++++++++", "cL+++++++++") else None
            if alt is not None:
                level, there = alt
                if level == 3:
                    continue
                if e.kind == LINK:  # another target, or the same one with another mtime
                    code = attrs_code("cLc" if there.target != e.target else "cL.", there, e, size=False, mode=False)
                else:
                    code = attrs_code("cd." if e.kind == DIR else ("cf." if level == 2 else ">f."), there, e,
                                      size=e.kind == FILE)
            out.append((code, e))
        return out

    def take(self, files: Sequence[Entry]) -> list[Entry]:
        """Link what can be linked of ``files``; returns the rest (to be fetched). A link that fails
        is the entry's destination failure (the run goes on)."""
        rest: list[Entry] = []
        for e in files:
            try:
                if not self.link(e):
                    rest.append(e)
            except OSError as exc:
                if isinstance(exc, Tb5syncError) and not isinstance(exc, PathError):
                    raise
                self.destination.fail(e.path, "destination", exc)
        return rest


def link_groups(groups: dict[str, int], files: Sequence[Entry]) -> dict[str, str]:
    """``-H``: each path of a hard-link group but the group's first -> that first path.

    ``groups`` maps a source path to its group number (the sender's, see the ``hardlinks``
    field of the entries page); ``files`` is the source's listing in order, whose first path
    of each group is the one written (the leader).
    """
    leader: dict[int, str] = {}
    out: dict[str, str] = {}
    for e in files:
        g = groups.get(e.path)
        if g is None or e.kind != FILE:
            continue
        first = leader.setdefault(g, e.path)
        if first != e.path:
            out[e.path] = first
    return out


def _rsync_order(path: str) -> tuple[tuple[int, bytes], ...]:
    """The sort key of a file's ``path`` in rsync's file list: in each directory its files (by
    name, bytewise) before its subdirectories (``f_name_cmp`` in rsync's flist.c)."""
    parts = path.split("/")
    return (*((1, os.fsencode(p)) for p in parts[:-1]), (0, os.fsencode(parts[-1])))


def itemize_groups(items: Sequence[tuple[str, Entry]], groups: dict[str, int]) -> list[tuple[str, Entry]]:
    """``-H -i``: ``items`` as rsync shows a hard-link group's new paths: the group's last path in
    rsync's file-list order (:func:`_rsync_order`) as any file (``>f+++++++++ b/g``), each other
    one as linked to it (``hf+++++++++ h.tmp => b/g``: the code ``hf+++++++++``, the entry's
    ``target`` the path it is linked to, shown by :func:`tb5sync.tree.plan.itemize_lines`).

    ``groups`` maps a source path to its group number (as for :func:`link_groups`). rsync
    (3.x, hlink.c) writes that last path and links the others to it; here the first is written
    and the others linked to it: the result, one inode, is the same.
    """
    members: dict[int, list[str]] = {}
    for p, g in groups.items():
        members.setdefault(g, []).append(p)
    leader = {g: max(ps, key=_rsync_order) for g, ps in members.items()}
    out: list[tuple[str, Entry]] = []
    for code, e in items:
        g = groups.get(e.path)
        if g is not None and e.kind == FILE and code == ">f+++++++++" and leader[g] != e.path:
            out.append(("hf+++++++++", e._replace(target=leader[g])))
        else:
            out.append((code, e))
    return out
