"""The public rsync-like API: :func:`sync` for local -> local, push and pull."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from typing import TYPE_CHECKING

from tb5sync.errors import ArgumentTypeError, SourceNotFoundError, UsageError, partial_error
from tb5sync.tree.excludes import exclude_option
from tb5sync.tree.options import MIN_BWLIMIT, SyncOptions, SyncStats

if TYPE_CHECKING:
    from tb5sync.roles.receiver import ProgressFn

# The engine (client, sender, receiver, sockets, sqlite) is imported on the first call, not with
# the package: `import tb5sync` and `tb5sync --help` stay fast.

__all__ = ["sync", "SyncStats", "SyncOptions", "DEFAULT_STREAMS"]

#: Streams per remote session when the caller does not say (see benches/ for the measurement).
DEFAULT_STREAMS = 4


def sync(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    delete: bool = False,
    exclude: Sequence[str] = (),
    checksum: bool = False,
    dry_run: bool = False,
    streams: int | None = None,
    compress: str = "auto",
    progress: ProgressFn | None = None,
    token: bytes | str | None = None,
    state_dir: str | os.PathLike[str] | None = None,
    fsync: bool = False,
    timeout: float | None = 60.0,
    tls_ca: str | os.PathLike[str] | None = None,
    # ---- rsync -H -S -X -L --copy-unsafe-links --safe-links --link-dest
    hard_links: bool = False,
    sparse: bool = False,
    xattrs: bool = False,
    copy_links: bool = False,
    copy_unsafe_links: bool = False,
    safe_links: bool = False,
    link_dest: Sequence[str | os.PathLike[str]] = (),
    # -- rsync options, second half --
    delete_excluded: bool = False,
    max_delete: int | None = None,
    itemize_changes: bool = False,
    update: bool = False,
    ignore_existing: bool = False,
    size_only: bool = False,
    bwlimit: int | float | str | None = None,
    mkpath: bool | None = None,
    ip_version: int | None = None,
    max_entries: int | None = None,
    max_listing_bytes: int | None = None,
) -> SyncStats:
    """Make ``dst`` match ``src``, with ``rsync -a`` semantics.

    Parameters
    ----------
    src, dst : str or path
        Local paths or ``tb5://[TOKEN@]HOST[:PORT]/PATH`` URLs (``tb5s://`` for TLS; at most one remote). A
        trailing slash on ``src`` means "the contents of src"; without it,
        ``src`` itself is created inside ``dst``.
    delete : bool
        Remove destination entries missing at the source (never excluded ones).
    exclude : sequence of str
        rsync-style exclude patterns, read as rsync reads ``--exclude``: ``"- PAT"`` is ``PAT``,
        ``"!"`` clears the ones before it, ``"+ PAT"`` (an include rule) is refused.
    checksum : bool
        Compare content digests instead of size and mtime.
    dry_run : bool
        Report what would change, change nothing.
    streams : int or None
        TCP streams per session (1..64); None picks :data:`DEFAULT_STREAMS`.
    compress : {"auto", "lz4", "none"}
        Per-chunk lz4 policy.
    progress : callable(bytes_done, bytes_total), optional
        Called as data is committed (push: as data is sent).
    token : bytes or str, optional
        Shared secret; defaults to the URL's, then to the environment variable ``TB5SYNC_TOKEN``.
    state_dir : str or path, optional
        Where a local or pulled destination's scan cache, chunk index and partial large files
        live. By default in the user's cache directory (``platformdirs``), keyed by the
        destination directory's device and inode: the destination itself receives nothing
        but the synced entries. A push keeps the server's (its ROOT/.tb5sync or ``--state-dir``).
    fsync : bool
        Make every commit durable before the run reports success (rsync ``--fsync``; see
        :class:`SyncOptions`).
    timeout : float or None
        I/O timeout, seconds (rsync's ``--timeout``): a frame that makes no progress this long,
        or a link found dead by keepalive (in about half of it), ends the sync with
        :class:`~tb5sync.errors.LinkTimeoutError`. None: wait forever.
    tls_ca : str or path, optional
        CA certificates to check a ``tb5s://`` server against (default: the system's).
    hard_links : bool
        rsync ``-H``: paths sharing an inode at the source share one at the destination.
    sparse : bool
        rsync ``-S``: blocks of zeros (4 KiB, aligned) are left as holes in written files.
    xattrs : bool
        rsync ``-X``: extended attributes of files and directories are copied.
    copy_links : bool
        rsync ``-L``: a symlink is synced as what it points to (a loop or a dangling link is a
        source failure naming it, exit 23; the rest is synced).
    copy_unsafe_links, safe_links : bool
        rsync's: an *unsafe* symlink (absolute, or leading out of the transferred tree) is
        synced as what it points to, or left out.
    link_dest : sequence of str or path
        rsync ``--link-dest``: a file missing or changed at the destination that is identical
        (size, mtime, mode) in one of these directories is hard-linked from it. A relative
        directory is relative to the destination directory; on a push it is on the server and
        must lie inside its ROOT.
    delete_excluded : bool
        Also delete excluded entries at the destination (rsync ``--delete-excluded``; implies
        ``delete``).
    max_delete : int or None
        Delete at most this many entries (rsync ``--max-delete=N``; 0: none); the rest are
        skipped and :class:`~tb5sync.errors.DeleteLimitError` (exit 25) is raised at the end,
        everything else synced. None: no limit.
    itemize_changes : bool
        Fill ``SyncStats.itemized`` with rsync ``-i`` lines (``">f+++++++++ path"``...).
    update : bool
        Leave regular files whose destination copy is newer alone (rsync ``-u``).
    ignore_existing : bool
        Leave every existing destination entry alone but directories (rsync ``--ignore-existing``).
    size_only : bool
        Files of the same size are unchanged whatever their mtime (rsync ``--size-only``; their
        mode and mtime are still set).
    bwlimit : int, float, str or None
        The rate the sender puts on the wire, all streams together, in rsync's units: a number is
        KiB/s, a str may carry a suffix (``"512b"``, ``"100K"``, ``"4M"``, ``"1.5G"``; ``"4MB"`` =
        4,000,000 B/s); 0 or None: unlimited.
    mkpath : bool or None
        None (the default): missing parent directories of the destination are created, as this
        API always did (code calling it would otherwise break at run time; the CLI follows rsync
        instead), and where the parent exists all is as rsync's. True: rsync ``--mkpath`` (the
        missing directories made first, "created N directories for DST"). False: rsync 3's rule
        (the CLI's without ``--mkpath``): a missing parent raises
        :class:`~tb5sync.errors.MissingParentError` before anything is written.
    ip_version : {4, 6} or None
        Reach the server over IPv4 or IPv6 only (rsync ``-4``/``-6``); a host without an address
        of that family is a :class:`~tb5sync.errors.ConnectError` saying so. None: either.
    max_entries, max_listing_bytes : int or None
        A pull's bounds on the server's listing: entries (directories and entries together) and
        bytes held (704 per entry plus 3 per byte of its path, link target and xattrs), as a
        server bounds a pushing client's (``serve --max-entries/--max-listing-bytes``); None: the
        server's defaults (3,000,000 entries, 2 GiB). Past one: :class:`~tb5sync.errors.PeerLimitError`
        (exit 12), nothing written. Not used by a push or a local sync.

    Returns
    -------
    SyncStats

    Raises
    ------
    TypeError
        An argument of the wrong type (e.g. ``exclude="*.log"``: a str is not a list of
        patterns); the message names the argument. (Also a ``UsageError``.)
    UsageError
        Bad arguments (both sides remote, bad URL, bad option values).
    SourceNotFoundError
        The local source does not exist (also a ``RemoteNotFoundError``, the class raised
        for any missing source before).
    RemoteNotFoundError
        The remote source does not exist.
    DeleteLimitError
        (A ``PartialTransferError``, exit code 25.) ``max_delete`` stopped deletions;
        ``stats.deletes_skipped`` says how many were left.
    ConnectError, AuthError, VersionMismatchError, PathError, ReadOnlyError
        From the server.
    PartialTransferError
        Some entries could not be synced (everything else was): its ``stats`` is the run's
        :class:`SyncStats`, ``failures`` names each entry, the side (source or destination,
        and whether it was the server's) and why; ``exit_code`` 23 as rsync's. Raised by a
        dry run too, for what the real run could not do.
    VanishedSourceError
        (A ``PartialTransferError`` and a ``SourceChangedError``, exit code 24.) The only
        failures were source files that vanished or kept changing while they were read.
    MissingParentError
        (A ``DestinationError``, exit 11.) ``mkpath=False`` and the destination directory's
        parent is missing; :class:`~tb5sync.errors.MissingDirectoryError` (exit 3) when a single
        file's destination directory is.
    DestinationError, IntegrityError
        From the receiver; nothing half-written is left at a final path.
    """
    _check_arguments(src, dst, delete, exclude, checksum, dry_run, streams, compress, progress, token, state_dir)
    links = _check_link_arguments(hard_links=hard_links, sparse=sparse, xattrs=xattrs, copy_links=copy_links,
                                  copy_unsafe_links=copy_unsafe_links, safe_links=safe_links, link_dest=link_dest)
    rate = _check_rsync_options(delete_excluded, max_delete, itemize_changes, update, ignore_existing, size_only, bwlimit, mkpath)
    from tb5sync.engine.chunking import warn_if_pure_python

    warn_if_pure_python()
    for name, v in (("max_entries", max_entries), ("max_listing_bytes", max_listing_bytes)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ArgumentTypeError(f"sync(): {name} must be an int or None, not {type(v).__name__} {v!r:.80}")
        if v is not None and v < 1:
            raise UsageError(f"sync(): {name} must be 1 or more, not {v}")
    src_s, dst_s = os.fspath(src), os.fspath(dst)
    if not src_s or not dst_s:
        raise UsageError("source and destination must not be empty")
    options = SyncOptions(
        delete=delete,
        excludes=exclude_option(exclude),  # rsync's '- PAT', '+ PAT' and '!' forms
        checksum=checksum,
        dry_run=dry_run,
        compress=compress,
        streams=DEFAULT_STREAMS if streams is None else streams,
        fsync=fsync,
        **links,
        delete_excluded=delete_excluded,
        max_delete=max_delete,
        itemize=itemize_changes,
        update=update,
        ignore_existing=ignore_existing,
        size_only=size_only,
        bwlimit=rate,
        mkpath=mkpath,
    )
    from tb5sync.remote.client import parse_url, pull, push
    from tb5sync.tree.entry import source_name

    from tb5sync.wire.urls import with_family

    rsrc, rdst = parse_url(src_s), parse_url(dst_s)
    rsrc, rdst = (None if r is None else with_family(r, ip_version) for r in (rsrc, rdst))
    # rsync's transfer root: the source's parent when it has no trailing slash (exclude anchoring)
    options = dataclasses.replace(options, exclude_root=source_name(rsrc.path if rsrc is not None else src_s) or "")
    if rsrc is not None and rdst is not None:
        raise UsageError("both source and destination are remote; one side must be local")
    sdir = None if state_dir is None else os.path.abspath(os.fspath(state_dir))
    if rsrc is not None:
        stats = pull(rsrc, dst_s, options, token=token, progress=progress, state_dir=sdir, timeout=timeout, tls_ca=tls_ca,
                     max_entries=max_entries, max_listing_bytes=max_listing_bytes)
    elif rdst is not None:
        stats = push(src_s, rdst, options, token=token, progress=progress, timeout=timeout, tls_ca=tls_ca)
    else:
        stats = _local(src_s, dst_s, options, progress, sdir)
    if stats.exit_code:
        raise partial_error(stats)
    return stats


def _check_rsync_options(
    delete_excluded: object, max_delete: object, itemize_changes: object, update: object,
    ignore_existing: object, size_only: object, bwlimit: object, mkpath: object = None,
) -> int:
    """Check the rsync options' arguments of :func:`sync`; returns ``bwlimit`` in bytes per second.

    Raises
    ------
    TypeError
        (an :class:`ArgumentTypeError`) An argument of the wrong type, named.
    ValueError
        (a :class:`UsageError`) ``max_delete`` below 0, or a ``bwlimit`` rsync would refuse.
    """
    from tb5sync.tree.options import parse_rate

    for name, v in (("delete_excluded", delete_excluded), ("itemize_changes", itemize_changes), ("update", update),
                    ("ignore_existing", ignore_existing), ("size_only", size_only), ("mkpath", mkpath)):
        if not isinstance(v, bool) and not (name == "mkpath" and v is None):
            raise ArgumentTypeError(f"sync(): {name} must be a bool, not {type(v).__name__} {v!r:.80}")
    if max_delete is not None:
        if isinstance(max_delete, bool) or not isinstance(max_delete, int):
            raise ArgumentTypeError(f"sync(): max_delete must be an int or None, not {type(max_delete).__name__} {max_delete!r:.80}")
        if max_delete < 0:
            raise UsageError(f"sync(): max_delete must be 0 or more (0: no deletions), not {max_delete}")
    if bwlimit is None:
        return 0
    if isinstance(bwlimit, bool) or not isinstance(bwlimit, (int, float, str)):
        raise ArgumentTypeError(f"sync(): bwlimit must be a number of KiB/s or a str such as '4M', not {type(bwlimit).__name__} {bwlimit!r:.80}")
    if isinstance(bwlimit, (int, float)) and not (bwlimit >= 0 and bwlimit < float("inf")):
        raise UsageError(f"sync(): bwlimit must be 0 or more KiB/s, not {bwlimit}")
    if isinstance(bwlimit, str):
        return parse_rate(bwlimit)
    rate = int(bwlimit * 1024)
    if 0 < rate < MIN_BWLIMIT:
        raise UsageError(f"sync(): bwlimit {bwlimit} KiB/s is too small (min: 0.5, or 0 for unlimited)")
    return rate


def _check_arguments(
    src: object, dst: object, delete: object, exclude: object, checksum: object, dry_run: object,
    streams: object, compress: object, progress: object, token: object, state_dir: object,
) -> None:
    """Check the types of :func:`sync`'s arguments at the API boundary, naming the first wrong one.

    Raises
    ------
    TypeError
        (a :class:`UsageError` too) An argument of the wrong type.
    """

    def bad(name: str, want: str, got: object) -> ArgumentTypeError:
        return ArgumentTypeError(f"sync(): {name} must be {want}, not {type(got).__name__} {got!r:.80}")

    for name, v in (("src", src), ("dst", dst)):
        if not isinstance(v, (str, os.PathLike)):
            raise bad(name, "a str or os.PathLike", v)
    for name, v in (("delete", delete), ("checksum", checksum), ("dry_run", dry_run)):
        if not isinstance(v, bool):
            raise bad(name, "a bool", v)
    if isinstance(exclude, (str, bytes)) or not isinstance(exclude, Sequence) or not all(isinstance(p, str) for p in exclude):
        raise bad("exclude", "a list or tuple of str patterns (exclude=['*.log'], not exclude='*.log')", exclude)
    if streams is not None and (isinstance(streams, bool) or not isinstance(streams, int)):
        raise bad("streams", "an int or None", streams)
    if not isinstance(compress, str):
        raise bad("compress", "a str", compress)
    if progress is not None and not callable(progress):
        raise bad("progress", "a callable(bytes_done, bytes_total) or None", progress)
    if token is not None and not isinstance(token, (str, bytes)):
        raise bad("token", "bytes, str or None", token)
    if state_dir is not None and not isinstance(state_dir, (str, os.PathLike)):
        raise bad("state_dir", "a str, os.PathLike or None", state_dir)


def _check_link_arguments(**kw: object) -> dict[str, object]:
    """Check the -H/-S/-X/-L/--link-dest keywords of :func:`sync`; returns them as :class:`SyncOptions` fields.

    Raises
    ------
    TypeError
        (a :class:`UsageError` too) A flag that is not a bool, or ``link_dest`` not a list of paths.
    UsageError
        (a ``ValueError``) An empty ``link_dest`` entry, or more than 20.
    """
    from tb5sync.tree.options import LINK_OPTIONS, MAX_LINK_DEST

    for name in LINK_OPTIONS:
        if not isinstance(kw[name], bool):
            raise ArgumentTypeError(f"sync(): {name} must be a bool, not {type(kw[name]).__name__} {kw[name]!r:.80}")
    ld = kw["link_dest"]
    if isinstance(ld, (str, bytes, os.PathLike)) or not isinstance(ld, Sequence) or not all(isinstance(d, (str, os.PathLike)) for d in ld):
        raise ArgumentTypeError(f"sync(): link_dest must be a list of directories (link_dest=['../snap1']), not {ld!r:.80}")
    dirs = tuple(os.fspath(d) for d in ld)
    if len(dirs) > MAX_LINK_DEST or any(not d or "\0" in d for d in dirs):
        raise UsageError(f"sync(): link_dest takes 1 to {MAX_LINK_DEST} non-empty directory paths, not {dirs!r:.120}")
    return {**kw, "link_dest": dirs}


def _local(src: str, dst: str, options: SyncOptions, progress: ProgressFn | None, state_dir: str | None = None) -> SyncStats:
    from tb5sync._os.paths import follow_slash
    from tb5sync.remote.client import local_state
    from tb5sync.tree.entry import DIR, kind_of, source_name
    from tb5sync.remote.links import LocalLink
    from tb5sync.roles.receiver import Receiver, dest_base, follow_dest_link, prepare_dest_dir
    from tb5sync.roles.sender import Sender

    src_abs = os.path.abspath(src)
    if not os.path.lexists(src_abs):
        raise SourceNotFoundError(f"local source does not exist: {src}")
    src_abs = follow_slash(src_abs, src, follow=options.copy_links)  # "link/" is the directory it points to (rsync, POSIX)
    kind = kind_of(src_abs)
    dst_abs = follow_dest_link(os.path.abspath(dst))  # its state too is the directory's
    dest = dest_base(dst_abs, dst.endswith("/"), source_name(src), kind)
    # a destination inside its source is rsync's case too: the source is listed (Sender.prepare)
    # before anything is written, so each run nests the tree one level more, as rsync's does
    if dest == src_abs:
        raise UsageError(f"destination {dst} is the source {src}")
    sender = Sender(src_abs, options)
    sender.prepare()
    if (dest + "/").startswith(src_abs.rstrip("/") + "/"):  # inside the source: listed before it is made (rsync)
        try:
            sender.scanned()
        except BaseException:
            sender.close()
            raise
    try:
        created = prepare_dest_dir(dst_abs, dst, dst.endswith("/"), kind, mkpath=options.mkpath, dry_run=options.dry_run)
        fresh = not os.path.lexists(dest)
        state, prefix = local_state(dest, dst_abs, kind, writable=not options.dry_run, state_dir=state_dir)
    except BaseException:
        sender.close()
        raise
    link = LocalLink(sender)
    try:
        stats = Receiver(dest, link, options, state, prefix, progress, fresh_base=fresh).run()
        return dataclasses.replace(stats, created=created)
    finally:
        link.close()
        state.close()
