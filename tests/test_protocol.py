"""Tests of the sans-IO wire protocol (:mod:`tb5sync.wire.protocol`): bytes in, frames and messages out.

No sockets here: the handshake state machines are joined in memory by :class:`ConnectionPair`
(after h11's tests/helpers.py), and a Hypothesis fuzz invariant checks that any bytes give
frames, messages, or a :class:`RemoteProtocolError` / :class:`VersionMismatchError`.
"""

from __future__ import annotations

import datetime
import os
import struct
import tracemalloc
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tb5sync.wire.protocol as P
from tb5sync.errors import (
    AuthError,
    LocalProtocolError,
    ProtocolError,
    RemoteError,
    RemoteProtocolError,
    Tb5syncError,
    VersionMismatchError,
)
from tb5sync.wire.protocol import NEED_DATA, FrameReader, FrameType

RAW = struct.Struct("!4sBBHII")  # the header layout, written out independently of P.HEADER
TOKEN = b"s3cret-token"


def raw_header(
    ftype: int = FrameType.REQUEST,
    length: int = 0,
    *,
    magic: bytes = b"TB5S",
    version: int = P.PROTOCOL_VERSION,
    flags: int = 0,
    rid: int = 7,
) -> bytes:
    """A 16-byte frame header built by hand (any field may be invalid)."""
    return RAW.pack(magic, version, int(ftype), flags, rid, length)


def frames_of(data: bytes, reader: FrameReader | None = None) -> list[P.Frame]:
    """Feed ``data`` to a reader and collect every complete frame."""
    reader = reader or FrameReader()
    if data:  # b"" would mean end of stream
        reader.receive_data(data)
    out = []
    while True:
        ev = reader.next_event()
        if ev is NEED_DATA:
            return out
        assert isinstance(ev, P.Frame)
        out.append(ev)


# ---- headers -------------------------------------------------------------------------------


def test_header_layout_is_16_bytes_network_order() -> None:
    assert P.HEADER.size == 16
    assert P.MAGIC == b"TB5S"
    hdr = P.encode_frame(FrameType.RESPONSE, 0x01020304, 0x00ABCDEF)
    assert hdr == b"TB5S" + bytes([P.PROTOCOL_VERSION, FrameType.RESPONSE, 0, 0, 1, 2, 3, 4, 0x00, 0xAB, 0xCD, 0xEF])


@pytest.mark.parametrize("ftype", list(FrameType), ids=lambda t: t.name)
@pytest.mark.parametrize("rid", [0, 1, 2**32 - 1])
def test_header_round_trip(ftype: FrameType, rid: int) -> None:
    length = 12345
    h = P.parse_header(P.encode_frame(ftype, rid, length))
    assert (h.type, h.flags, h.rid, h.length, h.version) == (ftype, 0, rid, length, P.PROTOCOL_VERSION)
    assert h.type is ftype


def test_header_limits_are_inclusive() -> None:
    assert P.parse_header(raw_header(FrameType.REQUEST, P.MAX_CONTROL)).length == P.MAX_CONTROL
    assert P.parse_header(raw_header(FrameType.DATA, P.MAX_PAYLOAD)).length == P.MAX_PAYLOAD


@pytest.mark.parametrize(
    ("header", "words"),
    [
        (raw_header(magic=b"HTTP"), "magic"),
        (b"GET / HTTP/1.1\r\n", "magic"),
        (raw_header(ftype=0), "type"),
        (raw_header(ftype=99), "type"),
        (raw_header(ftype=255), "type"),
        (raw_header(flags=1), "flags"),
        (raw_header(flags=0x8000), "flags"),
        (raw_header(FrameType.REQUEST, P.MAX_CONTROL + 1), "exceeds"),
        (raw_header(FrameType.HELLO, P.MAX_PAYLOAD), "exceeds"),
        (raw_header(FrameType.ERROR, 2**32 - 1), "exceeds"),
        (raw_header(FrameType.DATA, P.MAX_PAYLOAD + 1), "exceeds"),
        (raw_header(FrameType.DATA, 2**32 - 1), "exceeds"),
    ],
    ids=[
        "magic", "http", "type0", "type99", "type255", "flag1", "flag8000",
        "control-over", "hello-64MiB", "error-4GiB", "data-over", "data-4GiB",
    ],
)
def test_bad_header_is_remote_protocol_error(header: bytes, words: str) -> None:
    with pytest.raises(RemoteProtocolError, match=words):
        P.parse_header(header)
    # the same from the incremental reader, from the 16 header bytes alone (no payload sent)
    reader = FrameReader()
    reader.receive_data(header)
    with pytest.raises(RemoteProtocolError, match=words):
        reader.next_event()


def test_bad_header_is_also_the_builtin_family() -> None:
    # STYLE 8: one hierarchy rooted at Tb5syncError
    with pytest.raises(Tb5syncError):
        P.parse_header(raw_header(magic=b"XXXX"))
    assert issubclass(RemoteProtocolError, ProtocolError)


@pytest.mark.parametrize("size", [0, 15, 17])
def test_header_of_wrong_size(size: int) -> None:
    with pytest.raises(RemoteProtocolError, match="16 bytes"):
        P.parse_header(b"\0" * size)


def test_absurd_length_rejected_before_any_allocation() -> None:
    """A header claiming 4 GiB is refused from its 16 bytes; nothing near that size is allocated."""
    header = raw_header(FrameType.DATA, 2**32 - 1)
    tracemalloc.start()
    try:
        with pytest.raises(RemoteProtocolError):
            P.parse_header(header)
        reader = FrameReader()
        reader.receive_data(header)
        with pytest.raises(RemoteProtocolError):
            reader.next_event()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_reader_max_payload_is_honoured() -> None:
    reader = FrameReader(max_payload=100)
    reader.receive_data(raw_header(FrameType.DATA, 101))
    with pytest.raises(RemoteProtocolError, match="exceeds limit 100"):
        reader.next_event()
    # control frames obey the smaller of the two limits
    assert P.parse_header(raw_header(FrameType.REQUEST, 100), max_payload=100).length == 100
    with pytest.raises(RemoteProtocolError):
        P.parse_header(raw_header(FrameType.REQUEST, 101), max_payload=100)


@pytest.mark.parametrize("theirs", [0, P.PROTOCOL_VERSION - 1, P.PROTOCOL_VERSION + 1, 255])
def test_other_version_is_version_mismatch(theirs: int) -> None:
    with pytest.raises(VersionMismatchError) as info:
        P.parse_header(raw_header(FrameType.HELLO, 10, version=theirs))
    assert (info.value.ours, info.value.theirs) == (P.PROTOCOL_VERSION, theirs)
    assert str(P.PROTOCOL_VERSION) in str(info.value) and str(theirs) in str(info.value)
    assert isinstance(info.value, ProtocolError)


def test_version_is_checked_before_type_and_length() -> None:
    # a future version may add frame types and larger frames: the peer must learn "wrong version"
    with pytest.raises(VersionMismatchError):
        P.parse_header(raw_header(ftype=200, length=2**32 - 1, version=P.PROTOCOL_VERSION + 1))


def test_magic_is_checked_before_version() -> None:
    with pytest.raises(RemoteProtocolError, match="magic"):
        P.parse_header(raw_header(magic=b"NOPE", version=P.PROTOCOL_VERSION + 1))


@pytest.mark.parametrize(
    ("rid", "length"), [(-1, 0), (2**32, 0), (0, -1), (0, P.MAX_PAYLOAD + 1)], ids=["rid-neg", "rid-big", "len-neg", "len-big"]
)
def test_encode_frame_refuses_out_of_range(rid: int, length: int) -> None:
    with pytest.raises(LocalProtocolError):
        P.encode_frame(FrameType.DATA, rid, length)


# ---- control and data payloads -------------------------------------------------------------

MESSAGES: list[dict[str, Any]] = [
    {},
    {"op": "pull", "path": "a/b", "streams": 4},
    {"nonce": os.urandom(32), "auth": True},
    {"nested": {"list": [1, -2, 3.5, None, True, b"\x00\xff", "é"]}, "big": 2**63 - 1},
]


@pytest.mark.parametrize("msg", MESSAGES, ids=["empty", "open", "bytes", "nested"])
def test_control_round_trip(msg: dict[str, Any]) -> None:
    data = P.encode_control(FrameType.REQUEST, 42, msg)
    (frame,) = frames_of(data)
    assert frame.header.type is FrameType.REQUEST
    assert frame.header.rid == 42
    assert frame.header.length == len(data) - 16
    assert P.decode_control(frame.payload) == msg


def test_encode_control_refuses_data_and_non_dicts() -> None:
    with pytest.raises(LocalProtocolError):
        P.encode_control(FrameType.DATA, 0, {})
    with pytest.raises(LocalProtocolError):
        P.encode_control(FrameType.REQUEST, 0, [1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize("body", [b"", b"x", os.urandom(100_000)], ids=["empty", "one", "100k"])
def test_data_round_trip_zero_copy(body: bytes) -> None:
    meta = {"parts": [[len(body), len(body), 0]], "wire": [len(body)]}
    data = P.encode_data_prefix(9, meta, len(body)) + body
    (frame,) = frames_of(data)
    assert frame.header.type is FrameType.DATA and frame.header.rid == 9
    got_meta, view = P.decode_data(frame.payload)
    assert got_meta == meta
    assert isinstance(view, memoryview)
    assert view == body
    # zero copy: the body is a view into the frame's payload buffer
    payload = bytearray(frame.payload)
    _, view2 = P.decode_data(payload)
    if body:
        payload[-1] ^= 0xFF
        assert view2[-1] == body[-1] ^ 0xFF
    assert view2.obj is payload


def test_data_prefix_length_counts_meta_and_body() -> None:
    prefix = P.encode_data_prefix(1, {"a": 1}, 1000)
    h = P.parse_header(prefix[:16])
    assert h.length == len(prefix) - 16 + 1000
    with pytest.raises(LocalProtocolError):
        P.encode_data_prefix(1, {}, P.MAX_PAYLOAD)


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        b"\x81",  # map of one, truncated
        b"\x82\xa1a\x01",  # map of two, one given
        msgpack.packb({"a": 1}) + b"\x00",  # trailing bytes
        msgpack.packb([1, 2, 3]),  # not a map
        msgpack.packb("just a string"),
        msgpack.packb(None),
        msgpack.packb({1: "int key"}),
        msgpack.packb({b"bytes": 1}, use_bin_type=True),
        msgpack.packb({"ok": 1, 2: 3}),
        b"\xdf\xff\xff\xff\xff",  # map claiming 4 billion pairs
        b"\xdb\xff\xff\xff\xff",  # str claiming 4 GiB
        b"\x91" * 100_000 + b"\xc0",  # deeply nested arrays
    ],
    ids=[
        "empty", "c1", "trunc-map", "short-map", "trailing", "array", "str", "nil",
        "int-key", "bytes-key", "mixed-keys", "huge-map", "huge-str", "deep",
    ],
)
def test_malformed_control_is_remote_protocol_error(payload: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        P.decode_control(payload)


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\x00\x00\x00",  # shorter than the meta length field
        b"\x00\x00\x00\x10" + msgpack.packb({"a": 1}),  # meta length beyond the payload
        b"\xff\xff\xff\xff",
        struct.pack("!I", 3) + msgpack.packb([1, 2]),  # meta not a map
        struct.pack("!I", 2) + b"\x81\xa1",  # meta truncated within its declared length
        struct.pack("!I", 0),  # empty meta
    ],
    ids=["empty", "short", "meta-over", "meta-4GiB", "meta-array", "meta-trunc", "meta-empty"],
)
def test_malformed_data_is_remote_protocol_error(payload: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        P.decode_data(payload)


# ---- FrameReader ---------------------------------------------------------------------------


def _stream() -> tuple[bytes, list[tuple[FrameType, int, bytes]]]:
    body = bytes(range(256)) * 3
    parts = [
        P.encode_control(FrameType.HELLO, 0, {"nonce": b"n" * 32}),
        P.encode_control(FrameType.REQUEST, 1, {"m": "manifest", "a": {}}),
        P.encode_frame(FrameType.BYE, 2, 0),  # empty payload
        P.encode_data_prefix(3, {"wire": [len(body)]}, len(body)) + body,
        P.encode_control(FrameType.RESPONSE, 2**32 - 1, {"ok": True}),
    ]
    want = []
    for p in parts:
        h = P.parse_header(p[:16])
        want.append((h.type, h.rid, p[16:]))
    return b"".join(parts), want


def test_reader_reassembles_split_at_every_byte_boundary() -> None:
    data, want = _stream()
    for cut in range(len(data) + 1):
        reader = FrameReader()
        got = frames_of(data[:cut], reader) + frames_of(data[cut:], reader)
        assert [(f.header.type, f.header.rid, bytes(f.payload)) for f in got] == want, cut
        reader.receive_data(b"")
        assert reader.next_event() is NEED_DATA


def test_reader_one_byte_at_a_time() -> None:
    data, want = _stream()
    reader = FrameReader()
    got = []
    for i in range(len(data)):
        got += frames_of(data[i : i + 1], reader)
    assert [(f.header.type, f.header.rid, bytes(f.payload)) for f in got] == want


def test_reader_needs_data_until_whole() -> None:
    reader = FrameReader()
    assert reader.next_event() is NEED_DATA
    reader.receive_data(P.encode_control(FrameType.BYE, 0, {})[:-1])
    assert reader.next_event() is NEED_DATA
    assert reader.next_event() is NEED_DATA  # asking again changes nothing


@pytest.mark.parametrize("keep", [1, 15, 16, 17], ids=["in-header", "header-minus-1", "header-only", "in-payload"])
def test_reader_eof_inside_a_frame(keep: int) -> None:
    frame = P.encode_control(FrameType.REQUEST, 1, {"m": "x"})
    reader = FrameReader()
    reader.receive_data(frame[:keep])
    assert reader.next_event() is NEED_DATA
    reader.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="inside a frame"):
        reader.next_event()
    # poisoned
    with pytest.raises(RemoteProtocolError, match="inside a frame"):
        reader.next_event()


def test_reader_clean_eof_between_frames() -> None:
    reader = FrameReader()
    reader.receive_data(P.encode_control(FrameType.BYE, 0, {}))
    reader.receive_data(b"")
    assert isinstance(reader.next_event(), P.Frame)
    assert reader.next_event() is NEED_DATA


def test_reader_refuses_data_after_eof() -> None:
    reader = FrameReader()
    reader.receive_data(b"")
    with pytest.raises(LocalProtocolError):
        reader.receive_data(b"more")


@pytest.mark.parametrize(
    ("bad", "exc"),
    [(raw_header(magic=b"BAD!"), RemoteProtocolError), (raw_header(version=9), VersionMismatchError)],
    ids=["magic", "version"],
)
def test_reader_is_poisoned_after_an_error(bad: bytes, exc: type[Exception]) -> None:
    good = P.encode_control(FrameType.BYE, 0, {})
    reader = FrameReader()
    reader.receive_data(good + bad + good)
    assert isinstance(reader.next_event(), P.Frame)
    with pytest.raises(exc) as first:
        reader.next_event()
    # every later call raises the same error again, even though a valid frame follows
    for _ in range(3):
        with pytest.raises(exc) as again:
            reader.next_event()
        assert again.value is first.value
    reader.receive_data(good)
    with pytest.raises(exc):
        reader.next_event()


# ---- handshake -----------------------------------------------------------------------------


class ConnectionPair:
    """A client and a server handshake joined in memory, each behind its own FrameReader.

    ``run()`` plays the whole exchange; a ``tamper`` hook may rewrite any frame's bytes on
    their way (``tamper(direction, frame_bytes) -> frame_bytes``, direction "c2s" or "s2c").
    """

    def __init__(self, client_token: bytes | None, server_token: bytes | None, tamper: Any = None) -> None:
        self.client = P.ClientHandshake(client_token, os.urandom(P.NONCE_SIZE))
        self.server = P.ServerHandshake(server_token, os.urandom(P.NONCE_SIZE))
        self.to_server = FrameReader()
        self.to_client = FrameReader()
        self.tamper = tamper or (lambda direction, data: data)
        self.log: list[tuple[str, FrameType]] = []

    def _deliver(self, direction: str, data: bytes, reader: FrameReader, peer: Any) -> bytes:
        """Pass ``data`` (tampered with) through ``reader`` to ``peer``; returns the peer's replies."""
        out = b""
        for frame in frames_of(self.tamper(direction, data), reader):
            self.log.append((direction, frame.header.type))
            out += peer.on_frame(frame)
        return out

    def send_to_server(self, data: bytes) -> bytes:
        return self._deliver("c2s", data, self.to_server, self.server)

    def send_to_client(self, data: bytes) -> bytes:
        return self._deliver("s2c", data, self.to_client, self.client)

    def run(self) -> None:
        data = self.client.start()
        for _ in range(10):
            if self.client.done and self.server.done:
                return
            reply = self.send_to_server(data)
            if not reply:
                break
            data = self.send_to_client(reply)
            if not data:
                break
        assert self.client.done and self.server.done


def _rewrite(data: bytes, **changes: Any) -> bytes:
    """Decode a control frame, update its message, and re-encode it with the same type and rid."""
    (frame,) = frames_of(data)
    msg = P.decode_control(frame.payload)
    msg.update(changes)
    return P.encode_control(frame.header.type, frame.header.rid, msg)


def test_handshake_with_token() -> None:
    pair = ConnectionPair(TOKEN, TOKEN)
    pair.run()
    assert pair.log == [
        ("c2s", FrameType.HELLO),
        ("s2c", FrameType.CHALLENGE),
        ("c2s", FrameType.AUTH),
        ("s2c", FrameType.WELCOME),
    ]


def test_handshake_without_token_on_either_side() -> None:
    pair = ConnectionPair(None, None)
    pair.run()
    assert pair.client.done and pair.server.done


def test_token_never_crosses_the_wire() -> None:
    seen: list[bytes] = []

    def spy(direction: str, data: bytes) -> bytes:
        seen.append(data)
        return data

    ConnectionPair(TOKEN, TOKEN, spy).run()
    assert seen and not any(TOKEN in d for d in seen)


def test_handshake_frames_have_rid_zero_and_fresh_nonces() -> None:
    a, b = ConnectionPair(TOKEN, TOKEN), ConnectionPair(TOKEN, TOKEN)
    hello_a, hello_b = a.client.start(), b.client.start()
    assert P.parse_header(hello_a[:16]).rid == 0
    assert hello_a != hello_b


def test_wrong_token_is_auth_error_on_server() -> None:
    pair = ConnectionPair(b"wrong-token", TOKEN)
    with pytest.raises(AuthError, match="wrong token"):
        pair.run()
    assert not pair.server.done
    assert isinstance(AuthError("x"), PermissionError)


def test_no_token_against_token_server_is_auth_error_on_client() -> None:
    pair = ConnectionPair(None, TOKEN)
    with pytest.raises(AuthError, match="requires a token"):
        pair.run()
    assert not pair.client.done and not pair.server.done


def test_empty_mac_against_token_server_is_auth_error() -> None:
    """A client that skips its own check and sends AUTH with an empty MAC is refused by the server."""
    server = P.ServerHandshake(TOKEN, os.urandom(32))
    (challenge,) = frames_of(server.on_frame(frames_of(P.encode_control(FrameType.HELLO, 0, {"nonce": os.urandom(32)}))[0]))
    assert P.decode_control(challenge.payload)["auth"] is True
    (auth,) = frames_of(P.encode_control(FrameType.AUTH, 0, {"mac": b""}))
    with pytest.raises(AuthError):
        server.on_frame(auth)
    assert not server.done


def test_server_with_wrong_mac_is_auth_error_on_client() -> None:
    """Mutual authentication: a server that does not know the token is caught by the client."""

    def forge(direction: str, data: bytes) -> bytes:
        if direction == "s2c" and P.parse_header(data[:16]).type is FrameType.WELCOME:
            return _rewrite(data, mac=bytes(32))
        return data

    pair = ConnectionPair(TOKEN, TOKEN, forge)
    with pytest.raises(AuthError, match="server failed to prove"):
        pair.run()
    assert not pair.client.done


def test_server_that_knows_another_token_is_auth_error_on_client() -> None:
    """An impostor server that accepts any MAC and signs with its own token is refused by the client."""
    client = P.ClientHandshake(TOKEN, os.urandom(32))
    impostor = P.ServerHandshake(b"other-token", os.urandom(32))
    (hello,) = frames_of(client.start())
    (challenge,) = frames_of(impostor.on_frame(hello))
    (auth,) = frames_of(client.on_frame(challenge))
    c_nonce = client.nonce
    mac = P.server_mac(b"other-token", c_nonce, impostor.nonce)
    (welcome,) = frames_of(P.encode_control(FrameType.WELCOME, 0, {"mac": mac}))
    del auth
    with pytest.raises(AuthError):
        client.on_frame(welcome)


def test_client_with_token_refuses_a_server_that_skips_auth() -> None:
    """DESIGN: both sides check the peer's MAC. An impostor that says auth=False proves nothing."""

    def downgrade(direction: str, data: bytes) -> bytes:
        ftype = P.parse_header(data[:16]).type
        if ftype is FrameType.CHALLENGE:
            return _rewrite(data, auth=False)
        if ftype is FrameType.WELCOME:
            return _rewrite(data, mac=b"")
        return data

    pair = ConnectionPair(TOKEN, TOKEN, downgrade)
    with pytest.raises(AuthError):
        pair.run()


def test_macs_are_hmac_sha256_and_direction_bound() -> None:
    import hashlib
    import hmac

    s, c = b"s" * 32, b"c" * 32
    assert P.client_mac(TOKEN, s, c) == hmac.new(TOKEN, b"tb5sync-c" + s + c, hashlib.sha256).digest()
    assert P.server_mac(TOKEN, c, s) == hmac.new(TOKEN, b"tb5sync-s" + c + s, hashlib.sha256).digest()
    # a client MAC can never be replayed as a server MAC for the same nonces
    assert P.client_mac(TOKEN, s, c) != P.server_mac(TOKEN, c, s)


def test_replayed_client_mac_for_other_nonce_fails() -> None:
    """A MAC recorded from one session is useless in the next (fresh server nonce)."""
    first = ConnectionPair(TOKEN, TOKEN)
    recorded: list[bytes] = []

    def record(direction: str, data: bytes) -> bytes:
        if P.parse_header(data[:16]).type is FrameType.AUTH:
            recorded.append(data)
        return data

    first.tamper = record
    first.run()
    second = ConnectionPair(None, TOKEN)
    second.client = P.ClientHandshake(None, first.client.nonce)  # same client nonce
    frames_of(second.server.on_frame(frames_of(second.client.start())[0]))
    with pytest.raises(AuthError):
        second.server.on_frame(frames_of(recorded[0])[0])


@pytest.mark.parametrize(
    "frame",
    [
        P.encode_control(FrameType.AUTH, 0, {"mac": b""}),  # AUTH before HELLO
        P.encode_control(FrameType.WELCOME, 0, {"mac": b""}),
        P.encode_control(FrameType.REQUEST, 1, {"m": "manifest"}),
        P.encode_control(FrameType.OPEN, 0, {"op": "pull"}),
        P.encode_frame(FrameType.DATA, 0, 0),
    ],
    ids=["auth-first", "welcome", "request", "open", "data"],
)
def test_server_out_of_order_is_remote_protocol_error(frame: bytes) -> None:
    server = P.ServerHandshake(TOKEN, os.urandom(32))
    with pytest.raises(RemoteProtocolError, match="unexpected"):
        server.on_frame(frames_of(frame)[0])


def test_server_second_hello_is_remote_protocol_error() -> None:
    server = P.ServerHandshake(None, os.urandom(32))
    hello = frames_of(P.encode_control(FrameType.HELLO, 0, {"nonce": os.urandom(32)}))[0]
    server.on_frame(hello)
    with pytest.raises(RemoteProtocolError, match="unexpected HELLO"):
        server.on_frame(hello)


def test_client_out_of_order_is_remote_protocol_error() -> None:
    # WELCOME before CHALLENGE
    client = P.ClientHandshake(TOKEN, os.urandom(32))
    client.start()
    with pytest.raises(RemoteProtocolError, match="unexpected WELCOME"):
        client.on_frame(frames_of(P.encode_control(FrameType.WELCOME, 0, {"mac": b""}))[0])
    # a frame before start()
    fresh = P.ClientHandshake(TOKEN, os.urandom(32))
    with pytest.raises(RemoteProtocolError):
        fresh.on_frame(frames_of(P.encode_control(FrameType.CHALLENGE, 0, {"nonce": os.urandom(32), "auth": True}))[0])
    # a second CHALLENGE
    other = P.ClientHandshake(None, os.urandom(32))
    other.start()
    ch = frames_of(P.encode_control(FrameType.CHALLENGE, 0, {"nonce": os.urandom(32), "auth": False}))[0]
    other.on_frame(ch)
    with pytest.raises(RemoteProtocolError):
        other.on_frame(ch)


def test_handshake_done_accepts_nothing_more() -> None:
    pair = ConnectionPair(TOKEN, TOKEN)
    pair.run()
    again = frames_of(P.encode_control(FrameType.AUTH, 0, {"mac": b""}))[0]
    with pytest.raises(RemoteProtocolError):
        pair.server.on_frame(again)
    with pytest.raises(LocalProtocolError):
        pair.client.start()


@pytest.mark.parametrize(
    "hello",
    [{}, {"nonce": b"short"}, {"nonce": "x" * 32}, {"nonce": os.urandom(33)}],
    ids=["missing", "short", "str", "long"],
)
def test_bad_hello_nonce_is_remote_protocol_error(hello: dict[str, Any]) -> None:
    server = P.ServerHandshake(None, os.urandom(32))
    with pytest.raises(RemoteProtocolError, match="nonce"):
        server.on_frame(frames_of(P.encode_control(FrameType.HELLO, 0, hello))[0])


def test_bad_auth_mac_type_is_remote_protocol_error() -> None:
    server = P.ServerHandshake(TOKEN, os.urandom(32))
    server.on_frame(frames_of(P.encode_control(FrameType.HELLO, 0, {"nonce": os.urandom(32)}))[0])
    with pytest.raises(RemoteProtocolError, match="mac"):
        server.on_frame(frames_of(P.encode_control(FrameType.AUTH, 0, {"mac": "not bytes"}))[0])


def test_malformed_handshake_payload_is_remote_protocol_error() -> None:
    server = P.ServerHandshake(None, os.urandom(32))
    bad = raw_header(FrameType.HELLO, 3, rid=0) + b"\x93\x01\x02"  # array, not map
    with pytest.raises(RemoteProtocolError):
        server.on_frame(frames_of(bad)[0])


def test_client_raises_the_servers_error_frame() -> None:
    client = P.ClientHandshake(TOKEN, os.urandom(32))
    client.start()
    err = P.error_frame(0, AuthError("authentication failed: wrong token"))
    with pytest.raises(AuthError, match="remote: authentication failed"):
        client.on_frame(frames_of(err)[0])
    # an error class the client does not know becomes RemoteError naming the kind
    client2 = P.ClientHandshake(TOKEN, os.urandom(32))
    client2.start()
    with pytest.raises(RemoteError) as info:
        client2.on_frame(frames_of(P.error_frame(0, VersionMismatchError(1, 2)))[0])
    assert info.value.kind == "VersionMismatchError"


def test_error_frame_shape() -> None:
    (frame,) = frames_of(P.error_frame(5, ValueError("boom")))
    assert frame.header.type is FrameType.ERROR and frame.header.rid == 5
    assert P.decode_control(frame.payload) == {"kind": "ValueError", "message": "boom"}


# ---- fuzz invariant ------------------------------------------------------------------------

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_any_msg = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=40) | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=12,
)


@st.composite
def _frame_bytes(draw: Any) -> bytes:
    """Mostly-valid frames (so the fuzzer gets past the header), sometimes corrupted."""
    kind = draw(st.sampled_from(["control", "data", "raw-payload", "garbage"]))
    if kind == "garbage":
        return bytes(draw(st.binary(max_size=64)))
    ftype = draw(st.sampled_from(list(FrameType)))
    rid = draw(st.integers(0, 2**32 - 1))
    if kind == "raw-payload":
        payload = draw(st.binary(max_size=200))
    elif kind == "data" or ftype is FrameType.DATA:
        meta = msgpack.packb(draw(_any_msg), use_bin_type=True)
        mlen = draw(st.sampled_from([len(meta), len(meta) + 1, max(0, len(meta) - 1), 2**32 - 1]))
        payload = struct.pack("!I", mlen) + meta + draw(st.binary(max_size=50))
    else:
        payload = msgpack.packb(draw(_any_msg), use_bin_type=True)
    version = draw(st.sampled_from([P.PROTOCOL_VERSION] * 4 + [0, P.PROTOCOL_VERSION + 1]))
    flags = draw(st.sampled_from([0, 0, 0, 1]))
    length = draw(st.sampled_from([len(payload)] * 6 + [len(payload) + 1, 2**32 - 1]))
    data = RAW.pack(b"TB5S", version, int(ftype), flags, rid, length) + payload
    if draw(st.booleans()) and data:
        i = draw(st.integers(0, len(data) - 1))
        data = data[:i] + bytes([draw(st.integers(0, 255))]) + data[i + 1 :]
    return data


@FUZZ
@given(
    chunks=st.lists(st.one_of(_frame_bytes(), st.binary(max_size=100)), max_size=6),
    splits=st.lists(st.integers(0, 400), max_size=5),
    eof=st.booleans(),
)
def test_fuzz_any_bytes_give_frames_or_protocol_errors(chunks: list[bytes], splits: list[int], eof: bool) -> None:
    data = b"".join(chunks)
    cuts = sorted({min(c, len(data)) for c in splits})
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
    reader = FrameReader()
    server = P.ServerHandshake(TOKEN, os.urandom(32))
    client = P.ClientHandshake(TOKEN, os.urandom(32))
    client.start()
    try:
        for piece in [p for p in pieces if p] + ([b""] if eof else []):
            reader.receive_data(piece)
            while True:
                ev = reader.next_event()
                if ev is NEED_DATA:
                    break
                assert isinstance(ev, P.Frame)
                assert len(ev.payload) == ev.header.length
                if ev.header.type is FrameType.DATA:
                    meta, body = P.decode_data(ev.payload)
                    assert isinstance(meta, dict) and all(isinstance(k, str) for k in meta)
                    assert isinstance(body, memoryview)
                else:
                    msg = P.decode_control(ev.payload)
                    assert isinstance(msg, dict) and all(isinstance(k, str) for k in msg)
                # the handshake machines see the same frames: they may refuse, never crash
                for machine in (server, client):
                    try:
                        machine.on_frame(ev)
                    except (ProtocolError, AuthError, RemoteError):
                        pass
                    except Tb5syncError as exc:  # an ERROR frame naming a known class is re-raised as it
                        assert ev.header.type is FrameType.ERROR, exc
    except (RemoteProtocolError, VersionMismatchError):
        pass


@FUZZ
@given(st.binary(max_size=300))
def test_fuzz_decoders_alone(data: bytes) -> None:
    for decode in (P.decode_control, P.decode_data):
        try:
            decode(data)
        except RemoteProtocolError:
            pass
    if len(data) >= 16:
        try:
            P.parse_header(data[:16])
        except (RemoteProtocolError, VersionMismatchError):
            pass


# ---- the container budget of a control payload -------------------------------------------------


@pytest.mark.parametrize("item", [b"\x90", b"\x80", b"\x91\x90", b"\x92\xc0\xc0", b"\x81\xa1k\x90"])
def test_decode_stops_at_the_container_budget(item: bytes) -> None:
    """A payload made of tiny arrays or maps (a byte each: ~70-200 bytes each in Python) is refused
    while decoding, whatever the nesting: at most one array per PAYLOAD_PER_CONTAINER bytes."""
    n = 1 << 20
    payload = b"\x81\xa1x\xdd" + struct.pack("!I", n) + item * n
    with pytest.raises(RemoteProtocolError, match="too many arrays and maps"):
        P.decode_control(payload)


def test_decode_refuses_extension_types() -> None:
    with pytest.raises(RemoteProtocolError, match="extension type 5"):
        P.decode_control(msgpack.packb({"x": msgpack.ExtType(5, b"abc")}))


@pytest.mark.parametrize("value", [
    datetime.datetime(2026, 1, 2, tzinfo=datetime.timezone.utc),
    msgpack.Timestamp(1, 2),
    msgpack.Timestamp(2**40, 5),  # the 12-byte form
])
def test_decode_refuses_the_timestamp_extension(value: Any) -> None:
    """msgpack decodes its timestamp (-1) without calling ext_hook: it is refused like the others."""
    payload = msgpack.packb({"x": value}, datetime=isinstance(value, datetime.datetime))
    with pytest.raises(RemoteProtocolError, match=r"extension type -1 \(a timestamp\)"):
        P.decode_control(payload)
    with pytest.raises(RemoteProtocolError, match="extension type -1"):
        P.decode_data(struct.pack("!I", len(payload)) + payload + b"body")


def _skims() -> list[Any]:
    import tb5sync.wire.skim_py as _skim_py

    out = [_skim_py.skim]
    try:
        from tb5sync._skim import skim
    except ImportError:
        pass
    else:
        out.append(skim)
    return out


_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=40) | st.binary(max_size=40),
    lambda kids: st.lists(kids, max_size=12) | st.dictionaries(st.text(max_size=8), kids, max_size=12),
    max_leaves=200,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_VALUES)
def test_skim_bounds_what_msgpack_builds(value: Any) -> None:
    """Both skimmers agree, and the bound they give is at least what msgpack really allocates
    (tracemalloc) for the value; a cut-short encoding is refused by both."""
    payload = msgpack.packb(value, use_bin_type=True)
    results = {skim(payload) for skim in _skims()}
    assert len(results) == 1, results
    cost, _containers, ext, end = results.pop()
    assert ext is None and end == len(payload)
    msgpack.unpackb(payload, raw=False, strict_map_key=False)  # warm: msgpack's own first-call allocations
    held = None
    for _ in range(3):  # tracemalloc counts every thread: a thread left by an earlier test may allocate
        tracemalloc.start()  # meanwhile, so the least of three measures is msgpack's own
        try:
            got = msgpack.unpackb(payload, raw=False, strict_map_key=False)
            now, _peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        del got
        held = now if held is None else min(held, now)
        if held <= cost + 512:
            break
    assert held is not None and held <= cost + 512, (held, cost)  # 512: tracemalloc's and the call's own few objects
    for cut in {0, len(payload) // 2, len(payload) - 1} - {len(payload)}:
        for skim in _skims():
            with pytest.raises(ValueError):
                skim(payload[:cut])


def _skim_or_error(skim: Any, data: bytes) -> Any:
    try:
        return skim(data)
    except ValueError as exc:
        return str(exc)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200), _VALUES, st.integers(min_value=0, max_value=255), st.integers(min_value=0))
def test_skim_twins_agree_on_any_bytes(noise: bytes, value: Any, byte: int, where: int) -> None:
    """Random bytes, and a valid encoding with one byte changed or cut short: the C skimmer (no
    bounds checks) and its Python twin give the same result or the same error."""
    payload = bytearray(msgpack.packb(value, use_bin_type=True))
    payload[where % len(payload)] = byte
    for data in (noise, bytes(payload), bytes(payload[: where % len(payload)])):
        results = [_skim_or_error(skim, data) for skim in _skims()]
        assert all(r == results[0] for r in results), (data, results)


@pytest.mark.parametrize("item", [b"\xe0", b"\xa2ab", b"\xd1\x01\x02", b"\xca\0\0\0\0", b"\xc4\x02ab"],
                         ids=["negfixint", "str2", "int16", "float32", "bin2"])
def test_dense_scalars_are_refused_before_anything_is_built(item: bytes) -> None:
    """A payload of small scalars that are each a new Python object (a one-byte -32 is a 32-byte
    int, 40 times its size) is refused from the skim alone: nothing of it is built, the error
    says what it would have held, and the same payload under the server's limit was the old ~20-40x."""
    n = 2 * 1024 * 1024 // len(item)
    payload = b"\x81\xa1x\xdd" + struct.pack("!I", n) + item * n
    tracemalloc.start()
    try:
        with pytest.raises(RemoteProtocolError, match="once decoded, over the limit") as info:
            P.decode_control(payload, max_decoded=len(payload) * 8)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, peak
    assert len(str(info.value)) < 200


def test_a_value_with_trailing_bytes_is_refused() -> None:
    with pytest.raises(RemoteProtocolError, match="2 bytes after its value"):
        P.decode_control(msgpack.packb({"a": 1}) + b"\x00\x00")


def test_server_receives_its_densest_legitimate_messages_within_its_limit() -> None:
    """What a server legitimately receives fits SERVER_MAX_DECODED: an fs put or wwrite of
    FS_MAX_WRITE, a store put_chunks of STORE_MAX_DIGESTS small chunks and of STORE_MAX_BATCH, an
    entries page of MAX_PAGE entries and PAGE_PATH_BYTES of astral-plane names, a have request."""
    from tb5sync.tree.entry import Entry
    from tb5sync.wire.messages import FS_MAX_WRITE, STORE_MAX_BATCH, STORE_MAX_DIGESTS, EntriesPage
    from tb5sync.roles.sender import MAX_PAGE, PAGE_PATH_BYTES

    width = PAGE_PATH_BYTES // MAX_PAGE // 4
    names = [f"d/{i:0{width}d}\U0001f600" for i in range(MAX_PAGE)]
    small = STORE_MAX_BATCH // STORE_MAX_DIGESTS
    msgs = [
        {"m": "put", "a": {"path": "x", "data": os.urandom(FS_MAX_WRITE), "mode": "overwrite"}},
        {"m": "wwrite", "a": {"handle": 1, "data": os.urandom(FS_MAX_WRITE)}},
        {"m": "put_chunks", "a": {"lease": "a" * 32, "chunks": [[os.urandom(32), b"c" * small] for _ in range(STORE_MAX_DIGESTS)]}},
        {"m": "put_chunks", "a": {"lease": "a" * 32, "chunks": [[os.urandom(32), os.urandom(STORE_MAX_BATCH)]]}},
        {"m": "have", "a": {"lease": "a" * 32, "digests": [os.urandom(32) for _ in range(STORE_MAX_DIGESTS)]}},
        EntriesPage([Entry(n, "f", 0o644, 2**40, 2**62, "") for n in names], False, {i: i for i in range(MAX_PAGE)}, {}).to_wire(),
    ]
    for msg in msgs:
        payload = msgpack.packb(msg, use_bin_type=True)
        assert len(payload) <= P.MAX_CONTROL
        assert P.decode_control(payload, max_decoded=P.SERVER_MAX_DECODED) == msgpack.unpackb(payload, strict_map_key=True)


def test_an_fs_listing_page_of_short_names_fits_a_clients_limit() -> None:
    """The densest page a server sends: an ls page (fsops.PAGE_BYTES of its estimate) of
    one-character names with every info field."""
    from tb5sync.daemon.fsops import PAGE_BYTES

    info = {"name": "d/a", "size": 2**40, "type": "file", "created": 1.5e9, "islink": False, "mode": 0o100644,
            "uid": 100000, "gid": 100000, "mtime": 1.5e9, "ino": 2**40, "nlink": 1, "destination": "x"}
    page = {"entries": [dict(info, name=f"d/{i}") for i in range(PAGE_BYTES // (160 + 2 * 3))], "more": "c" * 24}
    payload = msgpack.packb(page, use_bin_type=True)
    assert len(P.decode_control(payload)["entries"]) == len(page["entries"])


def test_legitimate_pages_are_within_the_budget() -> None:
    """The densest legitimate messages: an entries page with a hardlink pair and an xattr per
    entry, a read_files meta of empty files, a chunk list, fs info dicts."""
    from tb5sync.tree.entry import Entry
    from tb5sync.wire.messages import EntriesPage

    entries = [Entry(f"{i}", "f", 0o644, 0, 1, "") for i in range(16384)]
    page = EntriesPage(entries, False, {i: i // 2 for i in range(16384)}, {i: [(b"user.a", b"")] for i in range(16384)})
    msgs = [
        page.to_wire(),
        {"files": [[0, 1, 0o644, [], 0, 0] for _ in range(100_000)], "wire": [0] * 100_000},
        {"hl": [[i, i] for i in range(100_000)]},
        {"chunks": [[b"d" * 32, 1] for _ in range(100_000)]},
        {"entries": [{"name": f"{i}", "size": 0, "type": "file", "islink": False} for i in range(100_000)]},
    ]
    for msg in msgs:
        assert P.decode_control(msgpack.packb(msg, use_bin_type=True)) == msgpack.unpackb(msgpack.packb(msg, use_bin_type=True), strict_map_key=True)


def test_malformed_control_error_is_one_short_line() -> None:
    with pytest.raises(RemoteProtocolError) as info:
        P.decode_control(b"\xc1" * 10_000_000)
    assert len(str(info.value)) < 300 and "\n" not in str(info.value)


def test_error_frame_message_is_bounded() -> None:
    body = P.decode_control(P.error_frame(1, RemoteProtocolError("x" * 1_000_000))[P.HEADER.size :])
    assert len(body["message"]) <= P.MAX_ERROR_MESSAGE


def test_shown_is_a_bounded_repr() -> None:
    from tb5sync.errors import SHOWN_LIMIT, PathError, shown

    assert shown("a/b") == "'a/b'"
    for value in ("x" * 10_000_000, [[b"y" * 1000] * 1000] * 1000, {"k" * 5000: list(range(10**6))}, 10**5000):
        assert len(shown(value)) <= SHOWN_LIMIT
    assert len(str(PathError("z" * 10**6))) < SHOWN_LIMIT + 50


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_small_and_large_payloads_decode_alike_on_both_sides_of_the_uncounted_size(kind: Any) -> None:
    """A payload small enough to skip the container count decodes as msgpack does, from any
    buffer, and is refused for the same faults as a large one (bytes keys, ext types, not a map)."""
    for n in (0, 1, 100, 1090, 1093, 1100, 5000):
        msg = {"m": "info", "a": {"path": "x" * n, "items": [[1, 2]] * 3}}
        raw = msgpack.packb(msg, use_bin_type=True)
        assert P.decode_control(kind(raw)) == msgpack.unpackb(raw, raw=False) == msg
    for bad in ({b"bin key": 1}, [1, 2], 5):
        with pytest.raises(RemoteProtocolError):
            P.decode_control(kind(msgpack.packb(bad, use_bin_type=True)))
    with pytest.raises(RemoteProtocolError):
        P.decode_control(kind(msgpack.packb({"e": msgpack.ExtType(3, b"x")}, use_bin_type=True)))
    many = msgpack.packb({"a": [[]] * 20_000}, use_bin_type=True)  # over the budget: counted, refused
    with pytest.raises(RemoteProtocolError, match="too many"):
        P.decode_control(kind(many))
