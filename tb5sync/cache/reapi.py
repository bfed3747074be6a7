"""A minimal reader of Bazel's Remote Execution API (REAPI v2) protobufs: the CAS digests an
ActionResult (and an output directory's Tree) references.

The protobuf wire format (varints, length-delimited fields; https://protobuf.dev/programming-guides/encoding/)
is read directly: only a handful of fields are needed, and unknown fields are skipped by wire type
as every protobuf parser does, so newer ActionResults parse too. Field numbers are those of
build/bazel/remote/execution/v2/remote_execution.proto. Sans-IO: bytes in, digests out.
"""

from __future__ import annotations

import re
from typing import Any

from tb5sync.errors import UsageError

__all__ = ["ActionResultError", "parse_action_result", "tree_files"]


class ActionResultError(UsageError):
    """Bytes that are not a well-formed ActionResult protobuf."""


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ActionResultError("truncated or overlong varint")
        b = buf[pos]
        pos += 1
        out |= (b & 0x7F) << shift
        if not b & 0x80:
            return out, pos
        shift += 7


def _fields(buf: bytes) -> list[tuple[int, int, Any]]:
    """``(field number, wire type, value)`` of one protobuf message: ints for varints and fixed, bytes for length-delimited."""
    out = []
    pos = 0
    while pos < len(buf):
        tag, pos = _varint(buf, pos)
        num, wt = tag >> 3, tag & 7
        if num == 0:
            raise ActionResultError("field number 0")
        if wt == 0:
            val, pos = _varint(buf, pos)
        elif wt == 1:
            if pos + 8 > len(buf):
                raise ActionResultError("truncated fixed64")
            val, pos = int.from_bytes(buf[pos : pos + 8], "little"), pos + 8
        elif wt == 2:
            n, pos = _varint(buf, pos)
            if pos + n > len(buf):
                raise ActionResultError("truncated length-delimited field")
            val, pos = buf[pos : pos + n], pos + n
        elif wt == 5:
            if pos + 4 > len(buf):
                raise ActionResultError("truncated fixed32")
            val, pos = int.from_bytes(buf[pos : pos + 4], "little"), pos + 4
        else:
            raise ActionResultError(f"unsupported wire type {wt}")
        out.append((num, wt, val))
    return out


def _digest(buf: bytes) -> tuple[str, int]:
    """A REAPI ``Digest {hash = 1; size_bytes = 2}``."""
    h, size = "", 0
    for num, wt, val in _fields(buf):
        if num == 1 and wt == 2:
            try:
                h = val.decode("ascii")
            except UnicodeDecodeError:
                raise ActionResultError("digest hash is not ASCII") from None
        elif num == 2 and wt == 0:
            size = val
    if not re.fullmatch(r"[0-9a-f]{64}", h):
        raise ActionResultError(f"digest hash {h[:80]!r} is not 64 lowercase hex digits (SHA-256)")
    return h, size


def _sub(buf: bytes, field: int) -> list[bytes]:
    return [v for n, wt, v in _fields(buf) if n == field and wt == 2]


def parse_action_result(buf: bytes) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """The CAS digests an ActionResult references: ``(blobs, trees)``, each a list of ``(sha256 hex, size)``.

    Fields read (REAPI v2, build/bazel/remote/execution/v2/remote_execution.proto):
    ``ActionResult.output_files = 2`` -> ``OutputFile.digest = 2``; ``output_directories = 3`` ->
    ``OutputDirectory.tree_digest = 3``; ``stdout_digest = 6``; ``stderr_digest = 8``; ``Digest {hash =
    1; size_bytes = 2}``. Other fields are skipped by wire type, as protobuf parsers do.

    Raises
    ------
    ActionResultError
        Malformed protobuf or a digest that is not SHA-256 hex.
    """
    blobs: list[tuple[str, int]] = []
    trees: list[tuple[str, int]] = []
    for num, wt, val in _fields(buf):
        if wt != 2:
            continue
        if num == 2:
            for d in _sub(val, 2):
                blobs.append(_digest(d))
        elif num == 3:
            for d in _sub(val, 3):
                trees.append(_digest(d))
        elif num in (6, 8):
            blobs.append(_digest(val))
    return blobs, trees


def tree_files(buf: bytes) -> list[tuple[str, int]]:
    """File digests of a REAPI ``Tree {root = 1; children = 2}`` of ``Directory {files = 1 (FileNode {digest = 2})}``.

    Raises
    ------
    ActionResultError
        Malformed protobuf.
    """
    out = []
    for num, wt, val in _fields(buf):
        if num in (1, 2) and wt == 2:
            for fnode in _sub(val, 1):
                for d in _sub(fnode, 2):
                    out.append(_digest(d))
    return out
