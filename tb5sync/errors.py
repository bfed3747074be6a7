"""The tb5sync error hierarchy.

Every error tb5sync raises derives from :class:`Tb5syncError`. Branches also
subclass the builtin they mean (``ValueError``, ``PermissionError``,
``ConnectionError``, ...) so that callers who catch builtins keep working, and
carry their data as attributes. Foreign errors are translated at the boundary
with ``raise ... from exc``.

Each class has a stable ``exit_code`` that the CLI returns (rsync's errcode.h
was the model: distinct codes for usage, protocol, file I/O and timeouts).
"""

from __future__ import annotations

import errno
import reprlib
from typing import Any

__all__ = [
    "shown",
    "SHOWN_LIMIT",
    "Tb5syncError",
    "UsageError",
    "ArgumentTypeError",
    "ProtocolError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "VersionMismatchError",
    "PeerLimitError",
    "UnsafeManifestError",
    "UnsafeNameError",
    "AuthError",
    "RefusedError",
    "ConnectError",
    "BusyError",
    "ConnectionClosedError",
    "closed_mid_transfer",
    "LinkTimeoutError",
    "PathError",
    "RemoteNotFoundError",
    "SourceNotFoundError",
    "DeleteLimitError",
    "ReadOnlyError",
    "IntegrityError",
    "SourceChangedError",
    "DestinationError",
    "DestinationExistsError",
    "MissingParentError",
    "MissingDirectoryError",
    "QuotaError",
    "EntryTooLargeError",
    "SourceError",
    "PartialTransferError",
    "VanishedSourceError",
    "RemoteError",
    "RemoteOSError",
    "RemoteExistsError",
    "RemoteIsADirectoryError",
    "RemoteNotADirectoryError",
    "RemotePermissionError",
    "remote_os_error",
    "partial_error",
    "RefNotFoundError",
    "RefExistsError",
    "RefPinnedError",
]



#: Most characters of a peer's value an error message quotes (see :func:`shown`).
SHOWN_LIMIT = 200
_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxlist, _repr.maxdict, _repr.maxtuple, _repr.maxset = 2, 4, 4, 4, 4
_repr.maxstring = _repr.maxother = _repr.maxlong = SHOWN_LIMIT


def shown(value: object, limit: int = SHOWN_LIMIT) -> str:
    """``repr(value)`` bounded to about ``limit`` characters, in time and memory bounded too
    (containers are not walked past their first items): how an error quotes what a peer sent."""
    if isinstance(value, str) and len(value) <= limit:
        return repr(value)
    try:
        text = _repr.repr(value)
    except Exception:  # e.g. an int too long to print
        return f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Tb5syncError(Exception):
    """Base class of every tb5sync error. ``exit_code`` is the CLI's exit status."""

    exit_code = 1


class UsageError(Tb5syncError, ValueError):
    """Bad argument from the caller: a malformed URL, an unknown option value, a bad path."""

    exit_code = 2


class ArgumentTypeError(UsageError, TypeError):
    """An API argument of the wrong type (e.g. ``sync(..., exclude="*.log")``); the message names it."""


class InvalidSeekError(UsageError, OSError):
    """A seek to before the start of a file opened through ``tb5://``: an ``OSError`` with
    ``errno`` EINVAL, as Python's (and fsspec's LocalFileSystem's) files raise, and a
    ``ValueError``, as fsspec's buffered files raise (both kinds of caller catch it)."""

    def __init__(self, message: str) -> None:
        OSError.__init__(self, errno.EINVAL, message)


class ProtocolError(Tb5syncError):
    """The byte stream does not follow the tb5sync wire protocol."""

    exit_code = 12


class LocalProtocolError(ProtocolError):
    """We were asked to send something the protocol does not allow (a bug on our side)."""


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes that violate the protocol (bad magic, absurd length, bad message)."""


class PeerLimitError(RemoteProtocolError):
    """What a peer sent goes past a bound this side holds it to (a server's listing past the
    client's ``--max-entries``/``--max-listing-bytes``, a reply too large, a name or a link target
    too long): exit 12, rsync's protocol error. The message names the bound, the peer and the
    option that raises it, in one line; nothing partial is left at a final path."""


class UnsafeManifestError(RemoteProtocolError):
    """A ref manifest from a server or a fan-out source is malformed or holds an entry that could
    leave, or write through, the directory it is materialised into (an absolute path, ``..``, a
    duplicate, an entry below a file or a symlink): exit 12. The message names the ref, the source
    and the entry, in one line; no ref is committed."""


class UnsafeNameError(RemoteProtocolError):
    """A server's ``ls``/``find`` reply (``tb5://`` through fsspec) names an entry that is not a
    safe path below the one asked for (absolute, ``..``, ``.``, an empty name, NUL, or elsewhere in
    the tree), which a ``get`` would write outside its destination: exit 12, nothing written. The
    message names the server, the path asked for and the name, escaped, in one line."""


class VersionMismatchError(ProtocolError):
    """The peer speaks a protocol version we do not.

    Attributes
    ----------
    ours, theirs : int
        The two protocol versions.
    """

    def __init__(self, ours: int, theirs: int) -> None:
        older = "the peer's" if theirs < ours else "this"
        super().__init__(
            f"protocol version mismatch: we speak {ours}, peer speaks {theirs} (upgrade tb5sync on {older} side)"
        )
        self.ours = ours
        self.theirs = theirs


class AuthError(Tb5syncError, PermissionError):
    """The HMAC challenge-response on the shared token failed, or the client is not allowed."""

    exit_code = 5


class RefusedError(AuthError):
    """The server's admission refused this client's address (not in its ``--allow``): exit 10, as
    the other refusals at admission (``BusyError``), since no token can help. Still an
    :class:`AuthError` (what this refusal raised before), never a ``ConnectError``: it is not retried."""

    exit_code = 10


class ConnectError(Tb5syncError, ConnectionError):
    """The server could not be reached, or the connection dropped mid-session."""

    exit_code = 10


class BusyError(ConnectError):
    """The server is at one of its caps (connections, sessions) and refused the connection.

    Nothing was done; the same request may be retried later (rsync's daemon says
    "max connections reached -- try again later" in the same case).
    """


class ConnectionClosedError(ConnectError):
    """The peer closed (or reset) the connection in the middle of a session: a server stopped or
    killed mid-transfer. The message says which side closed it, in one line.

    ``exit_code`` 12 is rsync's ``RERR_STREAMIO`` ("error in rsync protocol data stream", after its
    "connection unexpectedly closed"); 10 stays for a server that cannot be reached or refused the
    client at admission. Still a :class:`ConnectError` (what this raised before), so callers that
    reconnect on a lost connection keep doing so.
    """

    exit_code = 12


def closed_mid_transfer(peer: str, exc: BaseException | None = None) -> ConnectionClosedError:
    """The one-line :class:`ConnectionClosedError` for ``peer`` (``"server"`` or ``"client"``)
    gone mid-session; ``exc`` (the socket's error, e.g. ``BrokenPipeError``) adds its reason:
    ``server closed the connection mid-transfer (Broken pipe)``."""
    if exc is None:
        return ConnectionClosedError(f"{peer} closed the connection mid-transfer")
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
    return ConnectionClosedError(f"{peer} closed the connection mid-transfer ({why})")


class LinkTimeoutError(ConnectError, TimeoutError):
    """The peer made no progress for longer than the configured timeout, or TCP keepalive
    found the link dead. The connection is closed; its resources are released.

    ``exit_code`` 30 is rsync's ``RERR_TIMEOUT`` ("timeout in data send/receive").
    """

    exit_code = 30


class PathError(Tb5syncError, PermissionError):
    """A request path is absolute, contains ``..``, or resolves outside the served ROOT.

    Attributes
    ----------
    path : str
        The offending path as given.
    """

    exit_code = 3

    def __init__(self, path: str, reason: str = "outside the served root") -> None:
        super().__init__(f"refused path {shown(path)}: {reason}")
        self.path = path


class RemoteNotFoundError(Tb5syncError, FileNotFoundError):
    """A source path does not exist (locally or on the server)."""

    exit_code = 23


class SourceNotFoundError(RemoteNotFoundError):
    """A local source path does not exist (a ``FileNotFoundError``, exit 23).

    It derives from :class:`RemoteNotFoundError` only so that code written when
    :func:`tb5sync.sync` raised that class for every missing source still catches it.
    """


class ReadOnlyError(Tb5syncError, PermissionError):
    """A write was attempted on a server started with ``--read-only``."""

    exit_code = 3


class IntegrityError(Tb5syncError):
    """A chunk's bytes do not match its BLAKE3 digest. Nothing was committed."""

    exit_code = 13


class SourceChangedError(Tb5syncError):
    """A source file changed while it was being read, and retries did not help.

    Attributes
    ----------
    path : str
        The file, relative to the source root.
    """

    exit_code = 24

    def __init__(self, path: str) -> None:
        super().__init__(f"source file changed during transfer: {path}")
        self.path = path


class DestinationError(Tb5syncError, OSError):
    """The destination could not be written (permissions, disk full, not a directory)."""

    exit_code = 11


class MissingParentError(DestinationError, FileNotFoundError):
    """The directory the destination lands in has missing parents and ``--mkpath`` was not given
    (rsync 3.x: ``mkdir "DST" failed: No such file or directory (2)``, exit 11).

    Attributes
    ----------
    path : str
        The destination directory as the user named it (``""`` when rebuilt from a server's error).
    """

    exit_code = 11

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path


class MissingDirectoryError(MissingParentError):
    """A single file's destination directory is missing and ``--mkpath`` was not given (rsync 3.x:
    ``change_dir "DIR" failed: No such file or directory (2)``, exit 3, as rsync's)."""

    exit_code = 3


class DestinationNotADirectoryError(DestinationError, NotADirectoryError):
    """The destination (or a directory on its path) exists as a non-directory where the sync needs
    a directory: a directory source onto a file (rsync 3.x: ``ERROR: destination must be a
    directory when copying more than 1 file``), or a path through a file, ``afile/`` or
    ``afile/x`` (``ERROR: cannot stat destination "DST": Not a directory (20)``); exit 3, as
    rsync's. Nothing is written.

    Attributes
    ----------
    path : str
        The destination as the user named it (``""`` when rebuilt from a server's error).
    """

    exit_code = 3

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path
        self.errno = errno.ENOTDIR


class QuotaError(DestinationError):
    """A write the server refuses by its limits: the session's ``--max-session-bytes`` or the
    ``--min-free-space`` it keeps (``errno`` ENOSPC). Nothing of the refused file is written."""

    exit_code = 11

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.errno = errno.ENOSPC


class EntryTooLargeError(QuotaError):
    """One entry (a ref put or pushed into a store, a build-cache entry) that can never fit: it
    needs more bytes than the store's quota or the cache's ``--max-entry-size`` allows. Refused
    before it is stored (its chunks are collected by the next gc); nothing is evicted for it."""


class DestinationExistsError(DestinationError, FileExistsError):
    """The destination exists and replacing it was not asked for (a usage error: ``--force`` replaces it)."""

    exit_code = 2


class SourceError(Tb5syncError, OSError):
    """One source entry could not be read (e.g. a file the sender may not open).

    The sync goes on without it and names it in :attr:`tb5sync.tree.options.SyncStats.failures`.
    The message is ``"PATH: reason"``.
    """

    exit_code = 23


class PartialTransferError(Tb5syncError):
    """Some entries could not be synced; everything else was (rsync's exit 23, "partial transfer").

    Attributes
    ----------
    stats : tb5sync.tree.options.SyncStats
        The run's statistics; ``stats.failures`` names each entry that failed.
    failures : tuple of tb5sync.tree.options.Failure
        The same as ``stats.failures``.
    """

    exit_code = 23

    def __init__(self, stats: Any) -> None:
        self.stats = stats
        self.failures = tuple(stats.failures)
        n = len(self.failures)
        first = self.failures[0].line() if n else ""
        super().__init__(f"some files could not be transferred ({n} failed{'; first: ' + first if n else ''})")


class VanishedSourceError(PartialTransferError, SourceChangedError):
    """Only source files that vanished (or kept changing) were not synced (rsync's exit 24).

    ``path`` is the first of them; see :class:`PartialTransferError` for ``stats`` and ``failures``.
    """

    exit_code = 24

    def __init__(self, stats: Any) -> None:
        PartialTransferError.__init__(self, stats)
        self.path = self.failures[0].path if self.failures else ""
        names = ", ".join(f.path for f in self.failures[:10]) + (" ..." if len(self.failures) > 10 else "")
        self.args = (f"source files vanished or kept changing during transfer: {names}",)


class DeleteLimitError(PartialTransferError):
    """``max_delete`` stopped deletions and nothing else went wrong (rsync's exit 25, "the
    --max-delete limit stopped deletions"); ``stats.deletes_skipped`` counts the deletions left
    undone. Everything else was synced."""

    exit_code = 25

    def __init__(self, stats: Any) -> None:
        PartialTransferError.__init__(self, stats)
        self.args = (f"deletions stopped due to the --max-delete limit ({stats.deletes_skipped} skipped)",)


class RemoteError(Tb5syncError):
    """The peer reported an error; ``kind`` names the peer's error class.

    Attributes
    ----------
    kind : str
        Class name of the error on the peer (e.g. ``"PathError"``).
    """

    exit_code = 14

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class RemoteOSError(Tb5syncError, OSError):
    """A file-system call on the server failed (fsspec layer); ``errno`` is the server's errno.

    Subclasses also derive from the builtin ``OSError`` subclass fsspec callers
    expect (``FileExistsError``, ``IsADirectoryError``, ...). Messages name the
    request path, never the server's absolute path.
    """

    exit_code = 11


class RemoteExistsError(RemoteOSError, FileExistsError):
    """The path already exists on the server (``EEXIST``)."""


class RemoteIsADirectoryError(RemoteOSError, IsADirectoryError):
    """A file operation was aimed at a directory on the server (``EISDIR``)."""


class RemoteNotADirectoryError(RemoteOSError, NotADirectoryError):
    """A path component on the server is not a directory (``ENOTDIR``)."""


class RemotePermissionError(RemoteOSError, PermissionError):
    """The server's operating system refused access (``EACCES``/``EPERM``)."""


class RefNotFoundError(RemoteNotFoundError):
    """An artifact store has no ref of that name (or a ref has no such path)."""


class RefExistsError(Tb5syncError, FileExistsError):
    """An artifact store already has a ref of that name (and replacing it was not asked for), or a ref
    whose name is a path prefix of the new name or has it as one (``a/b`` and ``a/b/c`` cannot coexist)."""

    exit_code = 2


class RefPinnedError(Tb5syncError, PermissionError):
    """A pinned ref was to be removed (``store unpin`` it first, or remove it with ``--force``)."""

    exit_code = 2


_BY_ERRNO: dict[int, type[Tb5syncError]] = {
    errno.ENOENT: RemoteNotFoundError,
    errno.EEXIST: RemoteExistsError,
    errno.EISDIR: RemoteIsADirectoryError,
    errno.ENOTDIR: RemoteNotADirectoryError,
    errno.EACCES: RemotePermissionError,
    errno.EPERM: RemotePermissionError,
}


def remote_os_error(exc: OSError, path: str) -> Tb5syncError:
    """Translate an ``OSError`` raised while serving ``path`` into the matching tb5sync class.

    The result keeps ``errno`` and names ``path`` (the request path, relative to
    the served root) instead of the server's absolute file name.
    """
    code = exc.errno if isinstance(exc.errno, int) else 0
    cls = _BY_ERRNO.get(code, RemoteOSError)
    reason = exc.strerror or str(exc)
    err = cls(f"{reason}: {shown(path)}" if path else reason)
    err.errno = code or None  # type: ignore[attr-defined]
    return err


# Error classes the peer may name in an ERROR message and that we re-raise as the same class.
_BY_NAME: dict[str, type[Tb5syncError]] = {
    cls.__name__: cls
    for cls in (
        UsageError,
        MissingParentError,
        MissingDirectoryError,
        DestinationNotADirectoryError,
        AuthError,
        RefusedError,
        BusyError,
        LinkTimeoutError,
        ReadOnlyError,
        RemoteNotFoundError,
        IntegrityError,
        DestinationError,
        SourceError,
        RemoteProtocolError,
        RemoteOSError,
        RemoteExistsError,
        RemoteIsADirectoryError,
        RemoteNotADirectoryError,
        RemotePermissionError,
        RefNotFoundError,
        RefExistsError,
        RefPinnedError,
        DestinationExistsError,
        QuotaError,
        EntryTooLargeError,
    )
}


def error_from_remote(kind: str, message: str, errno_: int | None = None) -> Tb5syncError:
    """Rebuild an error the peer reported as ``(kind, message[, errno])``.

    Known kinds come back as their own class (a ``PathError`` as ``PathError``); any
    other kind becomes :class:`RemoteError`. The message is prefixed with ``remote:``.
    ``errno_`` (when the peer sent one) is set on ``OSError`` subclasses.
    """
    text = f"remote: {message}"
    if kind == "PathError":
        err: Tb5syncError = PathError.__new__(PathError)
        Tb5syncError.__init__(err, text)
        err.path = ""  # type: ignore[attr-defined]
        return err
    if kind == "SourceChangedError":
        sc = SourceChangedError.__new__(SourceChangedError)
        Tb5syncError.__init__(sc, text)
        sc.path = ""
        return sc
    cls = _BY_NAME.get(kind)
    if cls is None:
        return RemoteError(kind, text)
    err = cls(text)
    if isinstance(err, OSError) and isinstance(errno_, int):
        err.errno = errno_
    return err


def partial_error(stats: Any) -> PartialTransferError:
    """The error for statistics with failures or skipped deletions, by rsync's precedence:
    :class:`PartialTransferError` (exit 23) when some entry failed other than by vanishing,
    :class:`VanishedSourceError` (exit 24) when only source files vanished, else
    :class:`DeleteLimitError` (exit 25, ``max_delete`` stopped deletions)."""
    if not stats.failures and getattr(stats, "deletes_skipped", 0):
        return DeleteLimitError(stats)
    if stats.failures and all(f.vanished for f in stats.failures):
        return VanishedSourceError(stats)
    return PartialTransferError(stats)
