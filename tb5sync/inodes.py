"""Hard links on the receiving side: rsync's ``--link-dest DIR`` and ``-H`` (``--hard-links``).

``--link-dest``: a file the plan would write (missing or changed at the destination) that a
previous snapshot holds identical (regular file, same size, mtime and mode: rsync ``-a``'s
rule) is hard-linked from the snapshot instead of fetched. ``-H``: paths the sender lists as one
inode (:attr:`tb5sync.scan.Tree.hardlinks`, the entries pages' ``hl``) become one inode at the
destination: the group's first path (in listing order) is written as any file, every other path
is then linked to it. Both go through :meth:`Destination.link_from` (temporary name, rename).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Sequence

from ._paths import Jail
from .destination import Destination
from .entry import FILE, Entry
from .errors import PathError, Tb5syncError
from .options import SyncOptions

__all__ = ["LinkDest", "link_groups"]

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
                    log.warning("--link-dest arg does not exist: %s", d)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close the directories' descriptors."""
        for j in self.jails:
            j.close()
        self.jails = []

    def link(self, e: Entry) -> bool:
        """Hard-link the file ``e`` from the first directory holding it identical; False when none does
        (or no link can be made there: it is then fetched as usual).

        Raises
        ------
        OSError
            The link or the rename at the destination failed.
        """
        if e.kind != FILE:
            return False
        rel = "/".join(p for p in (self.prefix, e.path) if p)
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
