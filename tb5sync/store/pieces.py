"""Pieces: the second level of content-defined chunking inside a store chunk (store format v2).

A store chunk is the sync engine's chunk (FastCDC format v1, ~1 MiB, BLAKE3-256 address), so the
chunk index stays shared with the engine. In a format v2 store a chunk of at least
:data:`SPLIT_MIN` bytes (256 KiB) is kept as a *recipe*: the list of its pieces, cut by FastCDC with
:data:`PIECE_PARAMS_V1` (4 KiB min, 16 KiB average, 64 KiB max, normalization 2; the sync
engine's sub-chunk parameters, :data:`tb5sync.engine.refine.SUB_PARAMS`, so a store chunk's
pieces start where the engine's sub-chunks do) from the chunk's first byte, each piece named by
its BLAKE3-256 digest. Packs hold pieces as frames; an edit of 80 KB inside a 1 MiB chunk then
costs the ~5 pieces it touches (~100 KB) instead of the whole chunk.

FastCDC: W. Xia, Y. Zhou, H. Jiang, D. Feng, Y. Hua, Y. Hu, Q. Liu, Y. Zhang, "FastCDC: a Fast and
Efficient Content-Defined Chunking Approach for Data Deduplication", USENIX ATC 2016. Two levels
of content-defined chunking (coarse units for the index and the wire, fine ones for storage) as
in Hugging Face's Xet storage (64 KiB chunks grouped into larger units) and casync's 64 KiB chunks.
"""

from __future__ import annotations

from collections.abc import Sequence

import tb5sync.engine.chunking as chunking
from tb5sync.engine.hashing import chunk_digest
from tb5sync.engine.params import ChunkParams
from tb5sync.errors import IntegrityError, UsageError

__all__ = ["PIECE_PARAMS_V1", "PIECE_PARAMS_BY_VERSION", "SPLIT_MIN", "Piece", "split", "recipe_to_blob",
           "blob_to_recipe", "piece_params", "RECIPE_MAGIC", "recipe_record", "parse_recipe_record",
           "record_digest", "recipe_shape_error", "max_recipe_blob"]

#: Piece parameters v1 (``piece_params: 1`` in a v2 store's config): 4 KiB min, 16 KiB average,
#: 64 KiB max, normalization level 2. A given version always means the same parameters.
PIECE_PARAMS_V1 = ChunkParams(version=1, min_size=4096, avg_size=16384, max_size=65536, normalization=2)
#: Every piece parameter set that may appear in a store's config, by version.
PIECE_PARAMS_BY_VERSION: dict[int, ChunkParams] = {1: PIECE_PARAMS_V1}
#: Chunks shorter than this (bytes: the engine's minimum chunk size, 256 KiB) are kept whole, as one
#: frame, even in a v2 store: only a file's last chunk can be that short, a small file gains little
#: from pieces, and a whole frame is one index row and one read.
SPLIT_MIN = 256 * 1024

#: First bytes of a recipe record: the frame a v2 pack holds for each recipe, so that
#: ``store reindex`` rebuilds the recipes from the packs alone (:func:`recipe_record`).
RECIPE_MAGIC = b"TB5RCP1\x00"

#: One piece of a chunk: ``(digest, start, end)``: BLAKE3-256 (32 bytes) and byte offsets in the chunk.
Piece = tuple[bytes, int, int]


def piece_params(version: object) -> ChunkParams:
    """The piece parameters of ``version`` (a config's ``piece_params``).

    Raises
    ------
    UsageError
        An unknown version.
    """
    p = PIECE_PARAMS_BY_VERSION.get(version) if isinstance(version, int) else None
    if p is None:
        raise UsageError(f"unknown piece parameter version {version!r}")
    return p


def split(data: bytes | bytearray | memoryview, params: ChunkParams = PIECE_PARAMS_V1) -> list[Piece]:
    """Cut chunk ``data`` into pieces with FastCDC ``params`` (from its first byte) and hash each.

    Returns
    -------
    list of (digest, start, end)
        32-byte BLAKE3-256 digests and byte offsets; the pieces cover ``data`` in order. A chunk
        shorter than :data:`SPLIT_MIN` is one piece (whose digest is then the chunk's own).
    """
    mv = memoryview(data)
    if len(mv) < SPLIT_MIN:
        return [(chunk_digest(mv), 0, len(mv))]
    out: list[Piece] = []
    prev = 0
    for c in chunking.cut_points(mv, params):
        out.append((chunk_digest(mv[prev:c]), prev, c))
        prev = c
    return out


def recipe_shape_error(pieces: Sequence[tuple[bytes, int]], params: ChunkParams = PIECE_PARAMS_V1) -> str | None:
    """Why ``pieces`` (``[(piece digest, length in bytes), ...]``) cannot be a recipe cut with
    ``params``, or None when it can: FastCDC (Xia et al. 2016, the module docstring) cuts every piece
    but the last at ``params.min_size`` bytes or more and every piece at ``params.max_size`` or
    less, so a recipe from a peer or a record read back with other lengths (e.g. one-byte pieces,
    36 bytes of recipe per byte of chunk) was not cut by any writer of this format.
    """
    if not pieces:
        return "no pieces"
    for i, (_, n) in enumerate(pieces):
        if n > params.max_size or n <= 0 or (n < params.min_size and i != len(pieces) - 1):
            return (f"piece {i} is {n} bytes (pieces are {params.min_size}..{params.max_size} bytes, "
                    f"the last one 1..{params.max_size})")
    return None


def max_recipe_blob(length: int, params: ChunkParams = PIECE_PARAMS_V1) -> int:
    """The most bytes a recipe blob (:func:`recipe_to_blob`) of a chunk of ``length`` bytes cut with
    ``params`` can have: 36 per piece, at most ``length // params.min_size + 1`` pieces (every piece
    but the last is ``min_size`` bytes or more). A longer blob from a peer is refused unparsed."""
    return 36 * (length // params.min_size + 1)


def recipe_to_blob(pieces: Sequence[Piece]) -> bytes:
    """A recipe as stored in the index: per piece its 32 digest bytes then its length (u32 LE)."""
    out = bytearray()
    for d, s, e in pieces:
        out += d
        out += (e - s).to_bytes(4, "little")
    return bytes(out)


def blob_to_recipe(blob: bytes) -> list[tuple[bytes, int]]:
    """Inverse of :func:`recipe_to_blob`: ``[(piece digest, length in bytes), ...]``.

    Raises
    ------
    IntegrityError
        ``blob``'s length is not a multiple of 36 (a damaged index row).
    """
    if len(blob) % 36:
        raise IntegrityError("recipe blob length is not a multiple of 36")
    return [(blob[k : k + 32], int.from_bytes(blob[k + 32 : k + 36], "little")) for k in range(0, len(blob), 36)]


def recipe_record(digest: bytes, blob: bytes) -> bytes:
    """The recipe record of chunk ``digest`` whose recipe is ``blob`` (:func:`recipe_to_blob`).

    Layout (recipe record v1)::

        b"TB5RCP1\\x00" | chunk digest (32) | chunk length (u32 LE) | recipe blob (36 bytes per piece)

    A v2 pack holds it as an ordinary frame (named by the BLAKE3-256 of these bytes, indexed in
    ``chunks`` like any frame, so verify checks it and repack carries it), written by the writer
    that indexes the recipe, into the pack indexed with it. gc marks it with its recipe
    (:func:`record_digest`), so it lives exactly as long as the recipe does.
    """
    n = sum(k for _, k in blob_to_recipe(blob))
    return RECIPE_MAGIC + digest + n.to_bytes(4, "little") + blob


def record_digest(digest: bytes, blob: bytes) -> bytes:
    """The frame digest of :func:`recipe_record` ``(digest, blob)``: what gc marks with the recipe."""
    return chunk_digest(recipe_record(digest, blob))


def parse_recipe_record(data: bytes | memoryview) -> tuple[bytes, bytes] | None:
    """``(chunk digest, recipe blob)`` when ``data`` is a well-formed recipe record, else None (a frame
    of file data that merely starts like one is still checked by whoever uses the recipe: the chunk
    it rebuilds must hash to its digest)."""
    mv = memoryview(data)
    if len(mv) < 80 or bytes(mv[:8]) != RECIPE_MAGIC or (len(mv) - 44) % 36:
        return None
    blob = bytes(mv[44:])
    pieces = blob_to_recipe(blob)
    if any(k <= 0 for _, k in pieces) or sum(k for _, k in pieces) != int.from_bytes(mv[40:44], "little"):
        return None
    return bytes(mv[8:40]), blob
