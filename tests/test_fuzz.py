"""Fuzz targets: every decoder of peer input gives a result or a ProtocolError/UsageError, never
another exception (a crash of the reader thread, a server thread, or a wrong class to the user).

Decoders covered: the frame reader (:class:`tb5sync.wire.protocol.FrameReader`, any bytes, any split,
any limit), both handshake machines, every ``messages.*.from_wire``, ``SyncOptions.from_wire``,
``Entry.from_wire``, ``protocol.decode_control/decode_data/error_from_body``,
``rpc.reply_of`` and ``rpc.split_parts``.

Bounded for the test suite (``TB5SYNC_FUZZ_EXAMPLES``, default 100 per target); ``make fuzz``
raises it. Inputs are structure-aware: msgpack values whose maps use the protocol's own keys and
whose leaves sit near the checks' boundaries (32-byte digests, 0, -1, 2**32, 2**64-1), plus
valid messages with one field replaced, so the generator reaches the deep checks too.
"""

from __future__ import annotations

import os
import struct
from typing import Any, Callable

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tb5sync.wire.messages as M
import tb5sync.wire.protocol as P
from tb5sync.tree.entry import Entry
from tb5sync.errors import AuthError, ProtocolError, Tb5syncError, UsageError
from tb5sync.tree.options import SyncOptions
from tb5sync.wire.protocol import FrameType
from tb5sync.wire.rpc import reply_of, split_parts

EXAMPLES = int(os.environ.get("TB5SYNC_FUZZ_EXAMPLES", "100"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
ALLOWED = (ProtocolError, UsageError)

KEYS = [
    "root", "dirs", "total", "entries", "more", "size", "mtime_ns", "start", "end", "chunks", "digest", "digests",
    "parts", "wire", "files", "subs", "kind", "message", "errno", "excludes", "delete", "checksum", "dry_run",
    "compress", "streams", "nonce", "mac", "auth", "m", "a", "op", "path",
]
_ints = st.sampled_from([0, 1, -1, 31, 32, 33, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**64 - 1, -(2**63)]) | st.integers(-(2**63), 2**64 - 1)
_leaf = (
    st.none() | st.booleans() | _ints | st.floats(allow_nan=True) | st.binary(min_size=32, max_size=32)
    | st.binary(max_size=40) | st.text(max_size=12) | st.sampled_from(["", ".", "..", "/abs", "a/../b", "f", "d", "l", "a\0b"])
)
_value = st.recursive(
    _leaf,
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), kids, max_size=6),
    max_leaves=30,
)
_entry = st.tuples(st.sampled_from(["", "a", "a/b", "../x", "/x"]) | st.text(max_size=6), st.sampled_from(["f", "d", "l", "x", 1]),
                   _ints, _ints, _ints, st.text(max_size=6) | st.none()).map(list)


def _chunks(draw: Any) -> list[Any]:
    return draw(st.lists(st.tuples(st.binary(min_size=31, max_size=33) | _leaf, _ints).map(list), max_size=5))


@st.composite
def _near_valid(draw: Any) -> dict[str, Any]:
    """A reply shaped like a real one, one or two of its fields drawn from anything."""
    base: dict[str, Any] = draw(st.sampled_from([
        {"root": ["", "d", 0o755, 0, 0, ""], "dirs": [["", bytes(32), 1, 10]], "total": 1},
        {"entries": [["a", "f", 0o644, 3, 1, ""]], "more": False},
        {"size": 10, "mtime_ns": 1, "start": 0, "end": 10, "chunks": [[bytes(32), 10]], "digest": bytes(32)},
        {"digests": [bytes(32), None]},
        {"parts": [[5, 5, 0]], "wire": [5]},
        {"files": [[5, 1, 0o644, [[bytes(32), 5]], 5, 0], None], "wire": [5]},
        {"subs": [[]]},
        {"excludes": ["*.o"], "delete": True, "checksum": False, "dry_run": False, "compress": "auto", "streams": 4},
    ]))
    msg = dict(base)
    for _ in range(draw(st.integers(1, 2))):
        key = draw(st.sampled_from(sorted(msg) + ["chunks", "extra"]))
        msg[key] = _chunks(draw) if draw(st.booleans()) and key == "chunks" else draw(_value | _entry)
    return msg


_message = _near_valid() | _value


def _must(fn: Callable[[], Any], allowed: tuple[type[BaseException], ...] = ALLOWED) -> None:
    try:
        fn()
    except allowed:
        pass


# ---- frames and handshakes -----------------------------------------------------------------


@st.composite
def _frames(draw: Any) -> bytes:
    ftype = draw(st.sampled_from(list(FrameType)) | st.integers(0, 255))
    payload = draw(st.one_of(
        st.builds(lambda v: msgpack.packb(v, use_bin_type=True), _message),
        st.binary(max_size=120),
        st.builds(lambda v, body: struct.pack("!I", len(v)) + v + body,
                  st.builds(lambda v: msgpack.packb(v, use_bin_type=True), _message), st.binary(max_size=40)),
    ))
    length = draw(st.sampled_from([len(payload)] * 5 + [len(payload) + 1, P.MAX_HANDSHAKE + 1, 2**32 - 1]))
    version = draw(st.sampled_from([P.PROTOCOL_VERSION] * 5 + [2, 255]))
    flags = draw(st.sampled_from([0, 0, 0, 1]))
    return P.HEADER.pack(P.MAGIC, version, int(ftype), flags, draw(st.integers(0, 2**32 - 1)), length) + payload


@FUZZ
@given(st.lists(_frames() | st.binary(max_size=60), max_size=6), st.lists(st.integers(0, 600), max_size=6),
       st.sampled_from([P.MAX_HANDSHAKE, P.MAX_PAYLOAD]), st.booleans())
def test_frame_reader_and_handshakes(chunks: list[bytes], cuts: list[int], limit: int, eof: bool) -> None:
    data = b"".join(chunks)
    marks = sorted({min(c, len(data)) for c in cuts})
    reader = P.FrameReader(max_payload=limit)
    server = P.ServerHandshake(b"tok", os.urandom(32))
    client = P.ClientHandshake(b"tok", os.urandom(32))
    open_server = P.ServerHandshake(None, os.urandom(32))
    client.start()
    try:
        for piece in [data[a:b] for a, b in zip([0, *marks], [*marks, len(data)]) if b > a] + ([b""] if eof else []):
            reader.receive_data(piece)
            while (ev := reader.next_event()) is not P.NEED_DATA:
                assert isinstance(ev, P.Frame) and len(ev.payload) == ev.header.length <= limit
                for machine in (server, client, open_server):
                    try:
                        machine.on_frame(ev)
                    except (*ALLOWED, AuthError):
                        pass
                    except Tb5syncError:  # the peer's ERROR frame, decoded as the class it names
                        assert ev.header.type is FrameType.ERROR and machine is client
                _must(lambda: reply_of(ev.header, ev.payload), (*ALLOWED, Tb5syncError))
    except ALLOWED:
        pass


@FUZZ
@given(st.binary(max_size=200))
def test_control_and_data_decoders(data: bytes) -> None:
    _must(lambda: P.decode_control(data))
    _must(lambda: P.decode_data(data))


@FUZZ
@given(_value)
def test_error_body_always_gives_an_error(msg: Any) -> None:
    if isinstance(msg, dict) and all(isinstance(k, str) for k in msg):
        err = P.error_from_body(msg)
        assert isinstance(err, Tb5syncError)


# ---- message decoders ----------------------------------------------------------------------


@FUZZ
@given(_message)
def test_tree_and_entries_pages(msg: Any) -> None:
    _must(lambda: M.TreePage.from_wire(msg))
    _must(lambda: M.EntriesPage.from_wire(msg))


@FUZZ
@given(_message, st.integers(0, 3))
def test_chunk_lists_digests_and_subs(msg: Any, count: int) -> None:
    _must(lambda: M.ChunkListPiece.from_wire(msg, "f"))
    _must(lambda: M.FileDigests.from_wire(msg, count))
    _must(lambda: M.SubChunksReply.from_wire(msg, count))


@FUZZ
@given(_message, st.lists(st.integers(0, 100), max_size=3), st.lists(st.sampled_from(["a", "b/c"]), max_size=3))
def test_data_metas(meta: Any, lengths: list[int], paths: list[str]) -> None:
    _must(lambda: M.RangesMeta.from_wire(meta, lengths))
    _must(lambda: M.FilesMeta.from_wire(meta, paths))


@FUZZ
@given(_message | _entry)
def test_options_and_entries(value: Any) -> None:
    _must(lambda: SyncOptions.from_wire(value))
    _must(lambda: Entry.from_wire(value))


@FUZZ
@given(st.binary(max_size=64), st.lists(_ints, max_size=4))
def test_split_parts(body: bytes, lengths: list[Any]) -> None:
    _must(lambda: split_parts(memoryview(body), lengths))


@pytest.mark.parametrize("cls", [M.TreePage, M.EntriesPage, M.ChunkListPiece, M.FileDigests, M.RangesMeta, M.FilesMeta, M.SubChunksReply])
def test_every_reply_type_is_fuzzed(cls: type) -> None:
    """A new reply type in messages must be added to the targets above."""
    import inspect

    src = inspect.getsource(__import__(__name__))
    assert f"M.{cls.__name__}.from_wire" in src
    names = {n for n, v in vars(M).items() if inspect.isclass(v) and hasattr(v, "from_wire") and v.__module__ == M.__name__}
    assert names == {"TreePage", "EntriesPage", "ChunkListPiece", "FileDigests", "RangesMeta", "FilesMeta", "SubChunksReply"}
