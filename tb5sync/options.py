"""Options and statistics shared by the sender, the receiver and the API."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import UsageError

if TYPE_CHECKING:
    from .excludes import ExcludeRules

__all__ = ["SyncOptions", "SyncStats", "COMPRESS_MODES"]

COMPRESS_MODES = ("auto", "lz4", "none")


@dataclass(frozen=True)
class SyncOptions:
    """How one sync runs. Passed to sender and receiver (never globals).

    Attributes
    ----------
    delete : bool
        Remove destination entries that are not in the source (never excluded ones).
    excludes : tuple of str
        rsync-style exclude patterns (see :class:`tb5sync.excludes.ExcludeRules`).
    checksum : bool
        Compare content digests instead of size and mtime (rsync ``-c``).
    dry_run : bool
        Plan and report, change nothing.
    compress : str
        ``"auto"`` (lz4 per chunk only where a sample compresses to under 1/8),
        ``"lz4"`` (lz4 where it makes the chunk smaller) or ``"none"``.
    streams : int
        TCP streams per session, 1 to 64.
    fsync : bool
        Durable commits (rsync ``--fsync``): each file's data is flushed to disk
        (``fsync``) before it is renamed into place, and each directory that received
        entries is flushed after its renames, before the run reports success; so a file
        reported as synced survives a power cut. Off by default (as in rsync): a crash
        can then lose recent files, but never leaves a partial file at a final path.
    """

    delete: bool = False
    excludes: tuple[str, ...] = ()
    checksum: bool = False
    dry_run: bool = False
    compress: str = "auto"
    streams: int = 4
    fsync: bool = False

    def __post_init__(self) -> None:
        if self.compress not in COMPRESS_MODES:
            raise UsageError(f"compress must be one of {COMPRESS_MODES}, not {self.compress!r}")
        if not isinstance(self.streams, int) or not 1 <= self.streams <= 64:
            raise UsageError(f"streams must be an integer from 1 to 64, not {self.streams!r}")
        object.__setattr__(self, "excludes", tuple(self.excludes))
        self.rules  # validates patterns

    @property
    def rules(self) -> ExcludeRules:
        """The compiled exclude rules."""
        from .excludes import ExcludeRules

        return ExcludeRules(self.excludes)

    def to_wire(self) -> dict[str, Any]:
        """A msgpack-friendly dict of these options."""
        return {**dataclasses.asdict(self), "excludes": list(self.excludes)}

    @classmethod
    def from_wire(cls, d: object) -> SyncOptions:
        """Build options from a peer's dict, ignoring unknown keys.

        Raises
        ------
        UsageError
            Not a dict, or a field of the wrong type or range.
        """
        if not isinstance(d, dict):
            raise UsageError("options must be a map")
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        ex = kw.get("excludes", ())
        if not isinstance(ex, (list, tuple)) or not all(isinstance(p, str) for p in ex):
            raise UsageError("excludes must be a list of strings")
        for k in ("delete", "checksum", "dry_run", "fsync"):
            if k in kw and not isinstance(kw[k], bool):
                raise UsageError(f"option {k} must be a boolean")
        return cls(**kw)


@dataclass(frozen=True)
class SyncStats:
    """What one sync did. All fields are ints except ``seconds``.

    Attributes
    ----------
    files_total, bytes_total : int
        Regular files and their bytes considered at the source.
    files_transferred, bytes_transferred : int
        Files written at the destination and their logical bytes.
    wire_bytes : int
        Bytes on the wire, both directions, frame headers included (0 for local -> local).
    chunks_sent : int
        Chunks that crossed from sender to receiver, whole or (with a basis) only their
        sub-chunks the basis lacks (see :mod:`tb5sync.refine`).
    bytes_matched : int
        Bytes of those chunks found in the basis as sub-chunks and so not sent (rsync's
        "matched data").
    chunks_reused : int
        Chunks found at the destination (basis file, index or partial file), not sent.
    files_deleted : int
        Entries removed by ``delete``.
    seconds : float
        Wall time, seconds.
    """

    files_total: int = 0
    bytes_total: int = 0
    files_transferred: int = 0
    bytes_transferred: int = 0
    wire_bytes: int = 0
    chunks_sent: int = 0
    chunks_reused: int = 0
    bytes_matched: int = 0
    files_deleted: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def as_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (without ``extra``)."""
        d = dataclasses.asdict(self)
        d.pop("extra")
        return d
