"""Options and statistics shared by the sender, the receiver and the API."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tb5sync.tree.entry import path_from_wire, path_to_wire, show_path
from tb5sync.errors import UsageError

if TYPE_CHECKING:
    from tb5sync.tree.excludes import ExcludeRules

__all__ = ["SyncOptions", "SyncStats", "Failure", "COMPRESS_MODES", "SIDES", "LINK_OPTIONS", "BASE_OPTIONS", "WIRE_OPTIONS",
           "RSYNC_OPTIONS", "LENIENT_OPTIONS", "known_options", "parse_rate", "MIN_BWLIMIT"]

COMPRESS_MODES = ("auto", "lz4", "none")
#: The sides a :class:`Failure` can name.
SIDES = ("source", "destination")


#: The option names every server reads (those before a server's OPEN reply listed its own).
BASE_OPTIONS = ("delete", "excludes", "checksum", "dry_run", "compress", "streams", "exclude_root", "fsync")

# ---- rsync options -H -S -X -L --copy-unsafe-links --safe-links (the boolean ones; --link-dest apart)
#: Boolean option name -> (rsync's flag, what it does): the API's keyword, the CLI's flag.
LINK_OPTIONS: dict[str, tuple[str, str]] = {
    "hard_links": ("-H/--hard-links", "keep hard links: paths sharing an inode at the source share one at the destination"),
    "sparse": ("-S/--sparse", "write runs of zero blocks as holes"),
    "xattrs": ("-X/--xattrs", "copy extended attributes"),
    "copy_links": ("-L/--copy-links", "copy what symlinks point to instead of the links"),
    "copy_unsafe_links": ("--copy-unsafe-links", "copy what unsafe symlinks point to (absolute, or leading out of the tree)"),
    "safe_links": ("--safe-links", "leave out unsafe symlinks (absolute, or leading out of the tree)"),
}
#: At most this many ``--link-dest`` directories (rsync's limit).
MAX_LINK_DEST = 20
#: Most exclude patterns a peer's options may name (:meth:`SyncOptions.from_wire`): each is
#: matched against every entry, so their count multiplies the whole run's work (16,384 patterns
#: cost ~5 ms per entry); rsync users name tens to hundreds.
MAX_WIRE_EXCLUDES = 4096
#: Longest exclude pattern a peer's options may hold, characters (rsync's MAXPATHLEN): a pattern
#: of several stars is matched in time path length x its tokens.
MAX_PATTERN = 4096


def check_link_options(o: SyncOptions) -> tuple[str, ...]:
    """Check the -H/-S/-X/-L/--link-dest fields of ``o``; returns ``link_dest`` as a tuple.

    Raises
    ------
    UsageError
        A field of the wrong type, an empty or NUL-holding ``link_dest`` entry, more than
        :data:`MAX_LINK_DEST` of them.
    """
    for k in LINK_OPTIONS:
        if not isinstance(getattr(o, k), bool):
            raise UsageError(f"option {k} must be a boolean, not {getattr(o, k)!r:.80}")
    ld = o.link_dest
    if isinstance(ld, (str, bytes)) or not isinstance(ld, (list, tuple)):
        raise UsageError(f"link_dest must be a list of directories, not {ld!r:.80}")
    if len(ld) > MAX_LINK_DEST:
        raise UsageError(f"at most {MAX_LINK_DEST} --link-dest directories, not {len(ld)}")
    for d in ld:
        if not isinstance(d, str) or not d or "\0" in d:
            raise UsageError(f"--link-dest needs a directory path, not {d!r:.80}")
    return tuple(ld)
# ---- end of the -H -S -X -L block


@dataclass(frozen=True)
class SyncOptions:
    """How one sync runs. Passed to sender and receiver (never globals).

    Attributes
    ----------
    delete : bool
        Remove destination entries that are not in the source (never excluded ones).
    excludes : tuple of str
        rsync-style exclude patterns (see :class:`tb5sync.tree.excludes.ExcludeRules`).
    checksum : bool
        Compare content digests instead of size and mtime (rsync ``-c``).
    dry_run : bool
        Plan and report, change nothing.
    compress : str
        ``"auto"`` (lz4 per chunk only where a sample compresses to under 1/8),
        ``"lz4"`` (lz4 where it makes the chunk smaller) or ``"none"``.
    streams : int
        TCP streams per session, 1 to 64.
    exclude_root : str
        The source's name when it was given without a trailing slash (rsync's transfer root is
        then its parent, and patterns see paths as ``NAME/...``), else ``""``; set by
        :func:`tb5sync.sync`.
    fsync : bool
        Durable commits (rsync ``--fsync``): each file's data is flushed to disk
        (``fsync``) before it is renamed into place, and each directory that received
        entries is flushed after its renames, before the run reports success; so a file
        reported as synced survives a power cut. Off by default (as in rsync): a crash
        can then lose recent files, but never leaves a partial file at a final path.
    hard_links, sparse, xattrs, copy_links, copy_unsafe_links, safe_links : bool
        rsync's ``-H``, ``-S``, ``-X``, ``-L``, ``--copy-unsafe-links``, ``--safe-links``
        (see :data:`LINK_OPTIONS` and docs/ARCHITECTURE.md, "rsync options").
    link_dest : tuple of str
        rsync's ``--link-dest DIR`` (repeatable, at most 20): unchanged files are hard-linked
        from DIR (relative DIR: relative to the destination directory; on the receiving side).

    The rsync options below are the "second half" block (see :data:`RSYNC_OPTIONS`); each is
    off at its default, and a server that does not know one refuses the session instead of
    ignoring it (:meth:`unknown_to`).

    delete_excluded : bool
        Also delete excluded entries at the destination (rsync ``--delete-excluded``; implies
        ``delete``).
    max_delete : int or None
        At most this many deletions (rsync ``--max-delete=N``, 0 = none); the rest are skipped,
        counted in :attr:`SyncStats.deletes_skipped` (exit 25). None: no limit.
    itemize : bool
        Record one rsync ``--itemize-changes`` line per change (``SyncStats.itemized``).
    update : bool
        Skip regular files whose destination copy is newer (rsync ``-u``).
    ignore_existing : bool
        Skip every destination entry that exists, but directories (rsync ``--ignore-existing``).
    size_only : bool
        Quick check by size alone (rsync ``--size-only``).
    bwlimit : int
        Bytes per second the sender puts on the wire, all streams of the session together
        (rsync ``--bwlimit``, there in KiB/s); 0 = unlimited, else at least
        :data:`MIN_BWLIMIT` (512, rsync's floor; ``UsageError`` below it, a peer's too).
    mkpath : bool or None
        True: rsync ``--mkpath`` (the destination's missing directories made first). False: rsync
        3's rule, the CLI's without ``--mkpath``: a missing parent fails the sync. None (the
        Python API's default): rsync's rule where the parent exists, missing parents made where
        not, as the API always did (:func:`tb5sync.roles.receiver.prepare_dest_dir`). A server that
        does not know it is not refused for it (:data:`LENIENT_OPTIONS`).
    """

    delete: bool = False
    excludes: tuple[str, ...] = ()
    checksum: bool = False
    dry_run: bool = False
    compress: str = "auto"
    streams: int = 4
    exclude_root: str = ""
    fsync: bool = False
    # ---- rsync options -H -S -X -L --copy-unsafe-links --safe-links --link-dest (LINK_OPTIONS)
    hard_links: bool = False
    sparse: bool = False
    xattrs: bool = False
    copy_links: bool = False
    copy_unsafe_links: bool = False
    safe_links: bool = False
    link_dest: tuple[str, ...] = ()
    # ---- end of the -H -S -X -L block
    # -- rsync options, second half (defaults: off) --
    delete_excluded: bool = False
    max_delete: int | None = None
    itemize: bool = False
    update: bool = False
    ignore_existing: bool = False
    size_only: bool = False
    bwlimit: int = 0
    mkpath: bool | None = None

    def __post_init__(self) -> None:
        if self.delete_excluded and not self.delete:
            object.__setattr__(self, "delete", True)  # rsync: --delete-excluded implies --delete
        if self.max_delete is not None and (isinstance(self.max_delete, bool) or not isinstance(self.max_delete, int) or self.max_delete < 0):
            raise UsageError(f"max_delete must be an integer >= 0 or None, not {self.max_delete!r}")
        if isinstance(self.bwlimit, bool) or not isinstance(self.bwlimit, int) or self.bwlimit < 0:
            raise UsageError(f"bwlimit must be bytes per second, an integer >= 0, not {self.bwlimit!r}")
        if 0 < self.bwlimit < MIN_BWLIMIT:  # also a peer's options (from_wire): rsync's floor, on both sides
            raise UsageError(f"bwlimit {self.bwlimit} B/s is too small (min: {MIN_BWLIMIT} bytes per second, or 0 for unlimited)")
        if not isinstance(self.exclude_root, str) or "/" in self.exclude_root or self.exclude_root in (".", ".."):
            raise UsageError(f"exclude_root must be a single name, not {self.exclude_root!r}")
        if self.compress not in COMPRESS_MODES:
            raise UsageError(f"compress must be one of {COMPRESS_MODES}, not {self.compress!r}")
        if not isinstance(self.streams, int) or not 1 <= self.streams <= 64:
            raise UsageError(f"streams must be an integer from 1 to 64, not {self.streams!r}")
        object.__setattr__(self, "excludes", tuple(self.excludes))
        object.__setattr__(self, "link_dest", check_link_options(self))
        self.rules  # validates patterns

    @property
    def rules(self) -> ExcludeRules:
        """The compiled exclude rules."""
        from tb5sync.tree.excludes import ExcludeRules

        return ExcludeRules(self.excludes, self.exclude_root)

    @property
    def dest_rules(self) -> ExcludeRules:
        """The rules that hide and protect destination entries: none with ``delete_excluded``."""
        from tb5sync.tree.excludes import NO_RULES

        return NO_RULES if self.delete_excluded else self.rules

    def unknown_to(self, known: object) -> list[str]:
        """The options set here (not at their defaults) that a server's list of ``known`` option
        names (its OPEN reply's ``"options"``; absent from an older server's: None) lacks, as
        CLI flags (see :meth:`unsupported`)."""
        return [option_flag(name) for name in self.unsupported(known)]

    def to_wire(self) -> dict[str, Any]:
        """A msgpack-friendly dict of these options."""
        return {**dataclasses.asdict(self), "excludes": list(self.excludes), "exclude_root": path_to_wire(self.exclude_root),
                "link_dest": [path_to_wire(d) for d in self.link_dest]}

    def unsupported(self, known: object) -> list[str]:
        """The options set here (not at their defaults) that a peer knowing only ``known`` would ignore.

        ``known`` is the ``"options"`` list of a server's OPEN reply (the option names it reads);
        a server older than that list (``known`` not a list) knows :data:`BASE_OPTIONS`.
        """
        names = set(known) if isinstance(known, list) else set(BASE_OPTIONS)
        default = SyncOptions()
        return [f.name for f in dataclasses.fields(self)
                if f.name not in names and f.name not in LENIENT_OPTIONS and getattr(self, f.name) != getattr(default, f.name)]

    @classmethod
    def from_wire(cls, d: object) -> SyncOptions:
        """Build options from a peer's dict, ignoring unknown keys.

        Raises
        ------
        UsageError
            Not a dict, or a field of the wrong type or range; more than :data:`MAX_WIRE_EXCLUDES`
            exclude patterns, or one longer than :data:`MAX_PATTERN`.
        """
        if not isinstance(d, dict):
            raise UsageError("options must be a map")
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        ex = kw.get("excludes", ())
        if not isinstance(ex, (list, tuple)) or not all(isinstance(p, str) for p in ex):
            raise UsageError("excludes must be a list of strings")
        if len(ex) > MAX_WIRE_EXCLUDES:
            raise UsageError(f"at most {MAX_WIRE_EXCLUDES} exclude patterns may be sent, not {len(ex)}")
        if any(len(p) > MAX_PATTERN for p in ex):
            raise UsageError(f"an exclude pattern is longer than {MAX_PATTERN} characters")
        if isinstance(kw.get("exclude_root"), bytes):
            kw["exclude_root"] = path_from_wire(kw["exclude_root"])
        if isinstance(kw.get("link_dest"), (list, tuple)):
            kw["link_dest"] = tuple(path_from_wire(d) if isinstance(d, (str, bytes)) else d for d in kw["link_dest"])
        for k in ("delete", "checksum", "dry_run", "fsync", *LINK_OPTIONS,
                  "delete_excluded", "itemize", "update", "ignore_existing", "size_only"):
            if k in kw and not isinstance(kw[k], bool):
                raise UsageError(f"option {k} must be a boolean")
        if kw.get("mkpath") is not None and not isinstance(kw["mkpath"], bool):
            raise UsageError("option mkpath must be a boolean or None")
        return cls(**kw)


#: Options a server that does not know them may ignore without losing anything: ``mkpath``
#: False asks for rsync's missing-parent check, which an older server skips by creating the
#: parents; True, for them made first, which an older server does as it goes: it does more (or
#: the same) than asked, never deletes or leaves out.
LENIENT_OPTIONS = frozenset({"mkpath"})

#: The option names this version reads: a server's OPEN reply lists them, so that a client
#: never sends an option a server would silently ignore (:meth:`SyncOptions.unsupported`).
WIRE_OPTIONS = tuple(f.name for f in dataclasses.fields(SyncOptions))

#: The rsync options of the second half (name -> the CLI flag), for messages (see
#: :meth:`SyncOptions.unknown_to`).
RSYNC_OPTIONS = {
    "delete_excluded": "--delete-excluded", "max_delete": "--max-delete", "itemize": "--itemize-changes",
    "update": "--update", "ignore_existing": "--ignore-existing", "size_only": "--size-only", "bwlimit": "--bwlimit",
}


def option_flag(name: str) -> str:
    """The CLI flag of the :class:`SyncOptions` field ``name`` (``"hard_links"`` -> ``"-H/--hard-links"``)."""
    if name in LINK_OPTIONS:
        return LINK_OPTIONS[name][0]
    return RSYNC_OPTIONS.get(name, "--" + name.replace("_", "-"))


def known_options() -> list[str]:
    """Every SyncOptions field name: what a server lists in its OPEN reply (``"options"``)."""
    return list(WIRE_OPTIONS)


@dataclass(frozen=True)
class Failure:
    """One entry a sync could not handle (rsync names each on its own line and exits 23, or 24).

    Attributes
    ----------
    path : str
        The entry, relative to the transfer's base (``""`` for the base itself).
    side : str
        ``"source"`` (it could not be read) or ``"destination"`` (it could not be written,
        replaced or deleted).
    reason : str
        Why, one line (e.g. ``"Permission denied"``).
    vanished : bool
        The source file vanished (or kept changing) while the sync ran: rsync's exit 24
        rather than 23.
    server : bool
        The side that failed was the server's (a pull's source, a push's destination).
    """

    path: str
    side: str
    reason: str
    vanished: bool = False
    server: bool = False

    def __post_init__(self) -> None:
        if self.side not in SIDES:
            raise UsageError(f"failure side must be one of {SIDES}, not {self.side!r}")

    def line(self) -> str:
        """The one line the CLI prints: the side (and the server when it was the server's), the path, the reason."""
        where = f"{self.side} (server)" if self.server else self.side
        shown = show_path(self.path) if self.path else "."
        if self.vanished:
            return f"{where} file vanished: {shown!r}: {self.reason}"
        return f"{where} {shown!r}: {self.reason}"

    def to_wire(self) -> dict[str, Any]:
        """A msgpack-friendly dict: the fields, ``path`` as :func:`~tb5sync.tree.entry.path_to_wire` gives it."""
        return {**dataclasses.asdict(self), "path": path_to_wire(self.path)}

    @classmethod
    def from_wire(cls, d: object) -> Failure:
        """A failure from a peer's dict (unknown keys ignored).

        Raises
        ------
        UsageError
            Not a dict, or fields of the wrong type.
        """
        if not isinstance(d, dict):
            raise UsageError("a failure must be a map")
        path, side, reason = d.get("path"), d.get("side"), d.get("reason")
        if isinstance(path, bytes):
            path = path_from_wire(path)
        vanished, server = d.get("vanished", False), d.get("server", False)
        if not (isinstance(path, str) and isinstance(side, str) and isinstance(reason, str)):
            raise UsageError("a failure needs path, side and reason strings")
        if not (isinstance(vanished, bool) and isinstance(server, bool)):
            raise UsageError("a failure's vanished and server must be booleans")
        return cls(path, side, reason[:4096], vanished, server)


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
        sub-chunks the basis lacks (see :mod:`tb5sync.engine.refine`).
    bytes_matched : int
        Bytes of those chunks found in the basis as sub-chunks and so not sent (rsync's
        "matched data").
    chunks_reused : int
        Chunks found at the destination (basis file, index or partial file), not sent.
    files_deleted : int
        Entries removed by ``delete``.
    seconds : float
        Wall time, seconds.
    failures : tuple of Failure
        Entries that could not be synced (everything else was); empty on a complete sync.
        :func:`tb5sync.sync` raises :class:`~tb5sync.errors.PartialTransferError` carrying
        these statistics when it is not empty.
    skipped : tuple of (str, str)
        ``(path, what)`` of the source's special files (``what``: ``"fifo"``, ``"socket"``,
        ``"character device"``, ``"block device"``): not synced, as rsync without ``-D``
        skips them, and named on every route (not failures).
    deletes_skipped : int
        Deletions left undone by ``max_delete`` (rsync: "Deletions stopped due to
        --max-delete limit (N skipped)", exit 25).
    itemized : tuple of str
        With ``itemize``: rsync ``--itemize-changes`` lines (``">f+++++++++ path"``,
        ``"*deleting   path"``, ...), paths relative to the transfer root as rsync prints them.
    warnings : tuple of str
        Warnings of the receiving side that are not failures, in rsync's words (``"--link-dest
        arg does not exist: DIR"``); also logged where they arise, and by a client for its server's.
    created : tuple of str
        The lines rsync ``-v``/``-i`` print when the destination directory is (or, dry run,
        would be) created: ``"created directory DST"``, ``"created N directories for DST"``
        (``mkpath``), DST as the user named it (a push: the URL's path).
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
    failures: tuple[Failure, ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()
    deletes_skipped: int = 0
    itemized: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    created: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def as_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (without ``extra``)."""
        d = dataclasses.asdict(self)
        d.pop("extra")
        # JSON-ready: a path that is not valid UTF-8 is shown with \xNN escapes
        d["failures"] = [{**dataclasses.asdict(f), "path": show_path(f.path)} for f in self.failures]
        d["skipped"] = [{"path": show_path(p), "what": w} for p, w in self.skipped]
        return d

    @property
    def exit_code(self) -> int:
        """rsync's exit status for this result, its precedence too: 23 (some entries failed),
        24 (only vanished source files), 25 (``max_delete`` stopped deletions) or 0."""
        if self.failures:
            return 24 if all(f.vanished for f in self.failures) else 23
        return 25 if self.deletes_skipped else 0


#: The smallest ``--bwlimit`` but 0 (no limit), bytes per second: rsync's (options.c refuses
#: less than 512 B/s as "too small").
MIN_BWLIMIT = 512

_RATE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(?:([bkmgtp])(i?b)?)?", re.IGNORECASE)
_UNITS = {"b": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_rate(text: str) -> int:
    """rsync's ``--bwlimit=RATE`` in bytes per second.

    A number (fractions allowed) in KiB/s, or with a suffix: ``b`` bytes, ``K``/``M``/``G``/``T``/``P``
    (powers of 1024, also written ``KiB``...; ``KB``, ``MB``... are powers of 1000); case does not
    matter; ``0`` (or empty) is no limit. Source: rsync's ``parse_size_arg`` (options.c).

    Raises
    ------
    UsageError
        Not of that form, or a limit below 512 bytes per second (rsync: "too small").
    """
    t = text.strip()
    if not t:
        return 0
    m = _RATE.fullmatch(t)
    if m is None:
        raise UsageError(f"--bwlimit={text} is invalid (a number of KiB/s, or with a suffix: 512b, 100K, 4M, 1.5G)")
    number, unit, tail = m.groups()
    power = _UNITS[(unit or "k").lower()]
    base = 1000 if tail is not None and tail.lower() == "b" and power else 1024
    rate = int(float(number) * base**power)
    if 0 < rate < MIN_BWLIMIT:
        raise UsageError(f"--bwlimit={text} is too small (min: {MIN_BWLIMIT} bytes per second, or 0 for unlimited)")
    return rate
