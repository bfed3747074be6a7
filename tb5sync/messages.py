"""The wire vocabulary: every request method, who answers it, the codecs and the limits.

Sans-IO, like :mod:`tb5sync.protocol` below it: no sockets, no files. A session is opened
with an OPEN frame (``{"op": "push" | "pull" | "fs" | "ls" | "ping" | "join" | "source", ...}``,
see :mod:`tb5sync.server`), then carries REQUEST frames ``{"m": method, "a": {args}}`` answered
by RESPONSE (a dict) or DATA (``(meta, parts)``) frames. The method sets below are the only
lists of what each session answers; servers, links and clients import them from here.

Methods
-------
Answered by a :class:`~tb5sync.sender.Sender` (pull: the server's; push: the client's):

``tree(start)``
    RESPONSE ``{"root": entry, "dirs": [[path, digest, files, bytes], ...], "total": int}``.
``entries(dirs, skip)``
    RESPONSE ``{"entries": [entry, ...], "more": bool}``.
``chunk_list(path, start, size, mtime_ns)``
    RESPONSE ``{"refs": [[digest, length], ...], "end": int, ...}`` (one piece of a large file's chunks).
``file_digests(paths)``
    RESPONSE ``{"digests": [bytes | None, ...]}``.
``read_ranges(path, ranges, size, mtime_ns)``
    DATA, meta ``{"parts": [[rawlen, wirelen, codec], ...], "wire": [wirelen, ...]}``.
``read_files(paths)``
    DATA, meta ``{"files": [[size, mtime_ns, mode, refs, wirelen, codec] | None, ...], "wire": [...]}``.
``sub_chunks(path, ranges, size, mtime_ns, params)``
    RESPONSE ``{"subs": [...]}`` (see :mod:`tb5sync.refine`).

Answered by the push client's handler only: ``finish(**result)`` (the server's result).

Answered by the fs session (:class:`~tb5sync.fsops.FsOps`): :data:`FS_METHODS`.
"""

from __future__ import annotations

from typing import Final

from .protocol import MAX_PAYLOAD

__all__ = [
    "DEFAULT_PORT",
    "SENDER_METHODS",
    "PUSH_CLIENT_METHODS",
    "DATA_METHODS",
    "READ_METHODS",
    "FS_METHODS",
    "FS_IDEMPOTENT",
    "PING_METHODS",
    "CODEC_RAW",
    "CODEC_LZ4",
    "SENDER_MAX_READ",
    "FS_MAX_READ",
    "FS_MAX_WRITE",
    "CAT_MANY_BUDGET",
]

#: TCP port a server listens on and a ``tb5://`` URL names when none is given.
DEFAULT_PORT: Final = 8873

#: Requests a sender answers (the server's in a pull, the client's in a push).
SENDER_METHODS: Final = frozenset({"tree", "entries", "chunk_list", "file_digests", "read_ranges", "read_files", "sub_chunks"})
#: Requests the push client answers: a sender's, plus the server's final ``finish``.
PUSH_CLIENT_METHODS: Final = SENDER_METHODS | {"finish"}
#: Sender requests answered with DATA frames (file bytes): sent on the data streams.
DATA_METHODS: Final = frozenset({"read_ranges", "read_files"})
#: Sender requests answered with RESPONSE that read file data: also sent on the data streams.
READ_METHODS: Final = frozenset({"sub_chunks"})
#: The ``ping`` session's only request (``tb5sync bench``).
PING_METHODS: Final = frozenset({"ping"})

#: Requests the fs session (``tb5://`` through fsspec) answers.
FS_METHODS: Final = frozenset(
    {
        "info",
        "ls",
        "find",
        "cat",
        "cat_many",
        "digest",
        "put",
        "wopen",
        "wwrite",
        "wclose",
        "rm",
        "mkdir",
        "rmdir",
        "move",
        "copy",
        "touch",
        "more",
    }
)
#: fs requests that change nothing: safe to send again on a new connection after a broken one.
FS_IDEMPOTENT: Final = frozenset({"info", "ls", "find", "cat", "cat_many", "digest"})

#: Part codecs in DATA replies: the raw bytes, or one lz4 block.
CODEC_RAW: Final = 0
CODEC_LZ4: Final = 1

#: Most bytes one sender read request (``read_ranges``/``read_files``) may ask for.
SENDER_MAX_READ: Final = 32 * 1024 * 1024
#: Most bytes one fs ``cat`` reply carries (a longer read is split into several requests).
FS_MAX_READ: Final = 16 * 1024 * 1024
#: Most bytes one fs ``put``/``wwrite`` request may carry.
FS_MAX_WRITE: Final = 16 * 1024 * 1024
#: Most bytes of file data one ``cat_many`` reply carries.
CAT_MANY_BUDGET: Final = 32 * 1024 * 1024

assert SENDER_MAX_READ < MAX_PAYLOAD and FS_MAX_READ < MAX_PAYLOAD and CAT_MANY_BUDGET < MAX_PAYLOAD
