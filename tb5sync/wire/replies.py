"""The bytes of a sender's DATA replies on the receiving side: part codecs undone.

Used by the small-file path (:mod:`tb5sync.roles.receiver`) and the large-file path
(:mod:`tb5sync.roles.largefile`); the sender's side of the codecs is :func:`tb5sync.roles.sender.encode_part`.
The shape of each reply is checked once, by its type in :mod:`tb5sync.wire.messages`
(:class:`~tb5sync.wire.messages.RangesMeta`, :class:`~tb5sync.wire.messages.FilesMeta`); this module
only turns checked parts into raw bytes. Bytes that do not decode raise
:class:`~tb5sync.errors.IntegrityError`.
"""

from __future__ import annotations

from typing import Any

import lz4.block

from tb5sync.errors import IntegrityError, RemoteProtocolError
from tb5sync.wire.messages import CODEC_LZ4, CODEC_RAW, RangesMeta

__all__ = ["decode_part", "decode_ranges"]


def decode_part(part: memoryview | bytes, rawlen: int, codec: int) -> memoryview | bytes:
    """The raw bytes of one part of a DATA reply.

    Parameters
    ----------
    part : bytes-like
        The part as it came over the wire.
    rawlen : int
        Its length once decoded, bytes (as the reply's meta declares it).
    codec : int
        :data:`~tb5sync.wire.messages.CODEC_RAW` or :data:`~tb5sync.wire.messages.CODEC_LZ4`.

    Returns
    -------
    bytes-like
        ``part`` itself (raw), or the decompressed bytes; ``rawlen`` long.

    Raises
    ------
    RemoteProtocolError
        An unknown codec, or a raw part whose length is not ``rawlen``.
    IntegrityError
        An lz4 part that does not decompress to ``rawlen`` bytes.
    """
    if codec == CODEC_RAW:
        if len(part) != rawlen:
            raise RemoteProtocolError("raw part length differs from its declared length")
        return part
    if codec == CODEC_LZ4:
        try:
            out = lz4.block.decompress(part, uncompressed_size=rawlen)
        except Exception as exc:
            raise IntegrityError(f"lz4 part does not decompress: {exc}") from exc
        if len(out) != rawlen:
            raise IntegrityError("lz4 part decompressed to the wrong length")
        return out
    raise RemoteProtocolError(f"unknown codec {codec}")


def decode_ranges(meta: dict[str, Any], parts: list[Any], lengths: list[int]) -> list[memoryview | bytes]:
    """The raw bytes of each part of a ``read_ranges`` reply, checked against the asked ``lengths``.

    Raises
    ------
    RemoteProtocolError
        The reply has another number of parts than ranges asked for, or a part of another length.
    IntegrityError
        See :func:`decode_part`.
    """
    checked = RangesMeta.from_wire(meta, lengths)
    if len(parts) != len(lengths):
        raise RemoteProtocolError("read_ranges reply does not match the request")
    return [decode_part(part, rawlen, codec) for part, (rawlen, _w, codec) in zip(parts, checked.parts)]
