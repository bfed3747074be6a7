"""The tb5sync wire protocol, sans-IO: bytes in, events out; messages in, bytes out.

Nothing here touches a socket (the design follows h11: ``receive_data`` feeds
bytes, ``next_event`` returns a frame or the :data:`NEED_DATA` sentinel).

Frame layout (network byte order, 16-byte header, then ``length`` payload bytes)::

    offset size field
    0      4    magic     b"TB5S"
    4      1    version   protocol version (PROTOCOL_VERSION)
    5      1    type      FrameType
    6      2    flags     reserved, 0
    8      4    rid       request id (0 for handshake frames)
    12     4    length    payload length in bytes, <= the receiver's limit

Payloads:

* control frames (HELLO, CHALLENGE, AUTH, WELCOME, OPEN, REQUEST, RESPONSE,
  ERROR, BYE) carry one msgpack map;
* DATA frames carry ``u32 header_length | msgpack map | raw bytes``: the map
  describes the raw parts (e.g. chunk lengths and codecs), the raw bytes follow
  unframed so a receiver can ``recv_into`` a preallocated buffer.

Handshake (client C, server S); the token never crosses the wire::

    C -> S  HELLO     {"nonce": 32 random bytes}
    S -> C  CHALLENGE {"nonce": 32 random bytes, "auth": bool}
    C -> S  AUTH      {"mac": HMAC-SHA256(token, "tb5sync-c" | s_nonce | c_nonce)}
    S -> C  WELCOME   {"mac": HMAC-SHA256(token, "tb5sync-s" | c_nonce | s_nonce)}

Both sides check the peer's MAC (mutual authentication, RFC 2104 HMAC). A
version mismatch is detected from the first frame's header; the server answers
with an ERROR frame carrying its own version, then closes.
"""

from __future__ import annotations

import enum
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

import msgpack

from tb5sync.wire.skim_py import skim as _py_skim
from tb5sync.errors import SHOWN_LIMIT, AuthError, LocalProtocolError, RemoteProtocolError, Tb5syncError, VersionMismatchError, error_from_remote

# The one import site that picks the msgpack skimmer (TB5SYNC_PUREPYTHON=1 forces Python).
_cy_skim: Callable[[bytes | bytearray | memoryview], tuple[int, int, int | None, int]] | None
try:
    from tb5sync._skim import skim as _cy_skim
except ImportError:  # pragma: no cover - only without the Cython build
    _cy_skim = None
_skim = _cy_skim if _cy_skim is not None and os.environ.get("TB5SYNC_PUREPYTHON") != "1" else _py_skim
#: ``"cython"`` or ``"python"``: which skimmer :func:`decode_control` uses.
SKIM_IMPLEMENTATION: Final = "cython" if _skim is _cy_skim else "python"

__all__ = [
    "MAGIC",
    "PROTOCOL_VERSION",
    "HEADER",
    "MAX_CONTROL",
    "MAX_PAYLOAD",
    "MAX_HANDSHAKE",
    "MAX_DECODED",
    "SERVER_MAX_DECODED",
    "FrameType",
    "Header",
    "Frame",
    "NEED_DATA",
    "parse_header",
    "encode_frame",
    "encode_control",
    "decode_control",
    "encode_data_prefix",
    "decode_data",
    "FrameReader",
    "ClientHandshake",
    "ServerHandshake",
    "client_mac",
    "server_mac",
    "error_frame",
    "error_from_body",
]

MAGIC: Final = b"TB5S"
PROTOCOL_VERSION: Final = 4  # 2: chunk_list pieces, the fs session (tb5://); 3: tree/entries (listing digests) replace manifest; 4: names that are not valid UTF-8 travel as bin, failures reported per entry
HEADER: Final = struct.Struct("!4sBBHII")
#: Largest control (msgpack) payload accepted, bytes.
MAX_CONTROL: Final = 32 * 1024 * 1024
#: Largest payload of any frame accepted, bytes (DATA frames carry up to this much chunk data).
MAX_PAYLOAD: Final = 64 * 1024 * 1024
#: Largest payload accepted before the peer is authenticated, bytes: HELLO, CHALLENGE, AUTH and
#: WELCOME are under 64 bytes, a handshake ERROR under 300. Until the handshake is done a peer
#: that announces more is refused before anything is allocated (a stranger pins no memory).
MAX_HANDSHAKE: Final = 512
_U32 = struct.Struct("!I")


class FrameType(enum.IntEnum):
    """Frame types. Values are part of the wire format."""

    HELLO = 1
    CHALLENGE = 2
    AUTH = 3
    WELCOME = 4
    OPEN = 5
    REQUEST = 10
    RESPONSE = 11
    DATA = 12
    ERROR = 13
    BYE = 14


_CONTROL_TYPES = frozenset(FrameType) - {FrameType.DATA}
_TYPES: Final = {int(t): t for t in FrameType}


class Header(NamedTuple):
    """A parsed, validated frame header. ``length`` is the payload size in bytes.

    A named tuple (immutable, as a frozen dataclass, and made in a fifth of the time: one is
    made per frame received)."""

    type: FrameType
    flags: int
    rid: int
    length: int
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True)
class Frame:
    """A whole frame: header and payload bytes (not yet decoded)."""

    header: Header
    payload: bytes | bytearray | memoryview


class _NeedData:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NEED_DATA"


#: Returned by :meth:`FrameReader.next_event` when more bytes are needed.
NEED_DATA: Final = _NeedData()


def parse_header(data: bytes | bytearray | memoryview, *, max_payload: int = MAX_PAYLOAD) -> Header:
    """Parse and validate a 16-byte frame header.

    Parameters
    ----------
    data : bytes-like of exactly ``HEADER.size`` (16) bytes
    max_payload : int
        Largest payload length accepted, bytes. Checked before anything is allocated.

    Raises
    ------
    RemoteProtocolError
        Bad magic, unknown frame type, nonzero flags, or a length over the limit
        (over :data:`MAX_CONTROL` for control frames).
    VersionMismatchError
        The header's version is not :data:`PROTOCOL_VERSION`.
    """
    if len(data) != HEADER.size:
        raise RemoteProtocolError(f"frame header must be {HEADER.size} bytes, got {len(data)}")
    magic, version, ftype, flags, rid, length = HEADER.unpack(data)
    if magic != MAGIC:
        raise RemoteProtocolError(f"bad frame magic {bytes(magic)!r} (not a tb5sync peer?)")
    if version != PROTOCOL_VERSION:
        raise VersionMismatchError(PROTOCOL_VERSION, version)
    known = _TYPES.get(ftype)
    if known is None:
        raise RemoteProtocolError(f"unknown frame type {ftype}")
    ftype = known
    if flags != 0:
        raise RemoteProtocolError(f"unknown frame flags 0x{flags:04x}")
    limit = max_payload if ftype is FrameType.DATA else min(max_payload, MAX_CONTROL)
    if length > limit:
        raise RemoteProtocolError(f"{ftype.name} frame length {length} exceeds limit {limit}")
    return Header(ftype, flags, rid, length, version)


def encode_frame(ftype: FrameType, rid: int, payload_length: int) -> bytes:
    """Return the 16-byte header for a frame whose payload (sent separately) is ``payload_length`` bytes.

    Raises
    ------
    LocalProtocolError
        ``rid`` outside [0, 2**32) or ``payload_length`` over :data:`MAX_PAYLOAD`.
    """
    if not 0 <= rid < 1 << 32:
        raise LocalProtocolError(f"request id {rid} out of range")
    if not 0 <= payload_length <= MAX_PAYLOAD:
        raise LocalProtocolError(f"payload of {payload_length} bytes exceeds {MAX_PAYLOAD}")
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, int(ftype), 0, rid, payload_length)


def encode_control(ftype: FrameType, rid: int, message: dict[str, Any]) -> bytes:
    """Encode a whole control frame (header + msgpack map) as bytes.

    Raises
    ------
    LocalProtocolError
        ``ftype`` is DATA, ``message`` is not a dict, or it encodes larger than :data:`MAX_CONTROL`.
    """
    if ftype is FrameType.DATA or ftype not in _CONTROL_TYPES:
        raise LocalProtocolError(f"{ftype!r} is not a control frame type")
    if type(message) is not dict and not isinstance(message, dict):
        raise LocalProtocolError("control message must be a dict")
    payload = msgpack.packb(message, use_bin_type=True)
    n = len(payload)
    if n > MAX_CONTROL:
        raise LocalProtocolError(f"control message of {n} bytes exceeds {MAX_CONTROL}")
    if not 0 <= rid < 1 << 32:
        raise LocalProtocolError(f"request id {rid} out of range")
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, ftype, 0, rid, n) + payload


#: Containers (arrays and maps) one control payload may decode into: one per
#: :data:`PAYLOAD_PER_CONTAINER` bytes of it, plus :data:`CONTAINER_ALLOWANCE`. Every legitimate
#: message spends several bytes per container (an entry row is ~20+, a ``hl`` pair 3-7), while an
#: empty array is one byte that Python holds as a ~70-byte list.
PAYLOAD_PER_CONTAINER: Final = 4
#: The same for the meta of a DATA frame (a reply with bytes after it), whose densest legitimate
#: form, ``cat_many``'s ``[nbytes]`` per item, spends 2 bytes per array.
DATA_META_PER_CONTAINER: Final = 2
CONTAINER_ALLOWANCE: Final = 4096
#: Most bytes one decoded control payload (or DATA meta) may hold in Python, as
#: :func:`tb5sync.wire.skim_py.skim` bounds it before anything is built. A client's limit: the densest
#: page a server sends (an fs ``ls`` page of ~52,000 one-character names, ~100 MiB by that bound;
#: 45 MiB measured) fits it.
MAX_DECODED: Final = 128 * 1024 * 1024
#: The same on a server (``Channel.max_decoded`` once the peer is authenticated): what a server
#: receives is small except ``put``/``wwrite`` (16 MiB of bin, ~16 MiB decoded) and ``put_chunks``
#: (65,536 chunks, 16 MiB: ~32 MiB); an entries page of 16,384 entries and 4 MiB of astral-plane
#: names is ~22 MiB. A peer's frame then pins at most its payload (32 MiB) plus this, whatever its
#: shape (it was ~20-40 times the payload: 640 MiB to 1.3 GB for one 32 MiB frame).
SERVER_MAX_DECODED: Final = 48 * 1024 * 1024
#: Most characters of an ERROR frame's message: a bound on whatever it quotes (each quote of a
#: peer's value is itself cut to :data:`tb5sync.errors.SHOWN_LIMIT`).
MAX_ERROR_MESSAGE: Final = 1024

def _no_ext(code: int, data: bytes) -> Any:
    raise RemoteProtocolError(f"msgpack extension type {code} is not part of the protocol")


def decode_control(payload: bytes | bytearray | memoryview, per_container: int = PAYLOAD_PER_CONTAINER,
                   max_decoded: int = MAX_DECODED) -> dict[str, Any]:
    """Decode a control payload into a dict with str keys.

    What Python builds is checked before it is built: one pass over the encoding (``_skim``, C)
    counts the arrays and maps, bounds the bytes the decoded value will hold (cost model in
    :mod:`tb5sync.wire.skim_py`) and finds any extension type. Refused: more than one container per
    ``per_container`` bytes (:data:`PAYLOAD_PER_CONTAINER`; a DATA frame's meta
    :data:`DATA_META_PER_CONTAINER`) plus :data:`CONTAINER_ALLOWANCE`, a decoded size over
    ``max_decoded`` bytes (:data:`MAX_DECODED`; a server's channels :data:`SERVER_MAX_DECODED`),
    and every msgpack extension type, msgpack's timestamp (-1) included. No copy of the payload
    is made.

    Raises
    ------
    RemoteProtocolError
        Not valid msgpack, trailing bytes, over a budget, an extension type, or not a map with
        str keys.
    """
    try:
        cost, containers, ext, end = _skim(payload)
    except ValueError as exc:
        raise RemoteProtocolError(f"malformed control message: {str(exc)[:SHOWN_LIMIT]}") from exc
    if ext is not None:
        what = " (a timestamp)" if ext == -1 else ""
        raise RemoteProtocolError(f"msgpack extension type {ext}{what} is not part of the protocol")
    if containers > len(payload) // per_container + CONTAINER_ALLOWANCE:
        raise RemoteProtocolError("control message holds too many arrays and maps for its size")
    if cost > max_decoded:
        raise RemoteProtocolError(f"control message of {len(payload)} bytes would hold ~{cost} bytes once decoded, over the limit of {max_decoded}")
    if end != len(payload):
        raise RemoteProtocolError(f"malformed control message: {len(payload) - end} bytes after its value")
    try:
        # max_ext_len=0: msgpack itself refuses any extension too (the timestamp, -1, would
        # otherwise decode without calling ext_hook)
        msg = msgpack.unpackb(payload, raw=False, strict_map_key=True, ext_hook=_no_ext, max_ext_len=0)
    except RemoteProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated classes
        raise RemoteProtocolError(f"malformed control message: {str(exc)[:SHOWN_LIMIT]}") from exc
    if type(msg) is not dict:
        raise RemoteProtocolError("control message is not a map with string keys")
    for k in msg:
        if type(k) is not str:  # strict_map_key leaves str or bytes
            raise RemoteProtocolError("control message is not a map with string keys")
    return msg


def encode_data_prefix(rid: int, meta: dict[str, Any], body_length: int) -> bytes:
    """Encode a DATA frame's header and meta prefix; ``body_length`` raw bytes follow separately.

    The returned bytes are ``frame header | u32 meta length | msgpack(meta)``.

    Raises
    ------
    LocalProtocolError
        When the frame would exceed :data:`MAX_PAYLOAD`.
    """
    packed = msgpack.packb(meta, use_bin_type=True)
    total = _U32.size + len(packed) + body_length
    return encode_frame(FrameType.DATA, rid, total) + _U32.pack(len(packed)) + packed


def decode_data(payload: bytes | bytearray | memoryview, max_decoded: int = MAX_DECODED) -> tuple[dict[str, Any], memoryview]:
    """Split a DATA payload into its meta map and a memoryview of the raw body (no copy).

    Raises
    ------
    RemoteProtocolError
        Payload shorter than its declared meta length, or bad meta (see :func:`decode_control`;
        ``max_decoded`` is its limit for the meta).
    """
    view = memoryview(payload)
    if len(view) < _U32.size:
        raise RemoteProtocolError("DATA frame shorter than its meta length field")
    (mlen,) = _U32.unpack(view[: _U32.size])
    if mlen > len(view) - _U32.size:
        raise RemoteProtocolError(f"DATA meta length {mlen} exceeds frame payload {len(view)}")
    meta = decode_control(view[_U32.size : _U32.size + mlen], DATA_META_PER_CONTAINER, max_decoded)
    return meta, view[_U32.size + mlen :]


class FrameReader:
    """Incremental frame parser: feed bytes with :meth:`receive_data`, pull frames with :meth:`next_event`.

    Parameters
    ----------
    max_payload : int
        Largest payload accepted, bytes; longer frames raise before any allocation.

    Notes
    -----
    The transport's hot path reads headers and payloads straight into buffers
    with :func:`parse_header`; this class serves tests, fuzzing and small peers.
    After an error the reader is poisoned: every later call raises again.
    """

    def __init__(self, max_payload: int = MAX_PAYLOAD) -> None:
        self._buf = bytearray()
        self._header: Header | None = None
        self._eof = False
        self._error: RemoteProtocolError | VersionMismatchError | None = None
        self.max_payload = max_payload

    def receive_data(self, data: bytes) -> None:
        """Append received bytes; ``b""`` means the peer closed the stream."""
        if data:
            if self._eof:
                raise LocalProtocolError("data received after EOF")
            self._buf += data
        else:
            self._eof = True

    def next_event(self) -> Frame | _NeedData:
        """Return the next complete :class:`Frame`, or :data:`NEED_DATA`.

        Raises
        ------
        RemoteProtocolError
            Malformed header, or the stream ended inside a frame.
        VersionMismatchError
            The peer's frame is of another protocol version.
        """
        if self._error is not None:
            raise self._error
        try:
            if self._header is None:
                if len(self._buf) < HEADER.size:
                    return self._need()
                self._header = parse_header(bytes(self._buf[: HEADER.size]), max_payload=self.max_payload)
                del self._buf[: HEADER.size]
            if len(self._buf) < self._header.length:
                return self._need()
            n = self._header.length
            payload = bytes(self._buf[:n])
            del self._buf[:n]
            frame = Frame(self._header, payload)
            self._header = None
            return frame
        except (RemoteProtocolError, VersionMismatchError) as exc:
            self._error = exc
            raise

    def _need(self) -> _NeedData:
        if self._eof and (self._buf or self._header is not None):
            raise RemoteProtocolError("stream ended inside a frame")
        return NEED_DATA


def _compare_digest(a: bytes, b: bytes) -> bool:
    """``hmac.compare_digest`` (constant time), imported where a token is checked."""
    import hmac

    return hmac.compare_digest(a, b)


def client_mac(token: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """HMAC-SHA256 the client proves knowledge of ``token`` with (RFC 2104)."""
    import hmac  # here: ~2 ms of start-up (_hashlib) that a run without a token would not use

    return hmac.new(token, b"tb5sync-c" + server_nonce + client_nonce, "sha256").digest()


def server_mac(token: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """HMAC-SHA256 the server proves knowledge of ``token`` with (RFC 2104)."""
    import hmac

    return hmac.new(token, b"tb5sync-s" + client_nonce + server_nonce, "sha256").digest()


NONCE_SIZE: Final = 32


def _bytes_field(msg: dict[str, Any], key: str, size: int | None = None) -> bytes:
    value = msg.get(key)
    if not isinstance(value, bytes) or (size is not None and len(value) != size):
        want = f"{size} bytes" if size is not None else "bytes"
        raise RemoteProtocolError(f"handshake field {key!r} must be {want}")
    return value


class ClientHandshake:
    """Client side of the handshake as a state machine.

    Usage: send :meth:`start`'s bytes; feed every received frame to :meth:`on_frame`,
    which returns bytes to send (possibly empty) until :attr:`done` is true.

    Parameters
    ----------
    token : bytes or None
        Shared secret; None when the server asks for no authentication.
    nonce : bytes
        32 random bytes (``os.urandom(32)``).

    Raises
    ------
    AuthError
        The server requires a token and we have none, or its MAC is wrong.
    RemoteProtocolError
        A frame arrives out of order or malformed.
    """

    # state -> frame type expected next -> next state
    _TRANSITIONS: Final = {
        "start": {},
        "sent_hello": {FrameType.CHALLENGE: "sent_auth"},
        "sent_auth": {FrameType.WELCOME: "done"},
        "done": {},
    }

    def __init__(self, token: bytes | None, nonce: bytes) -> None:
        self.token = token
        self.nonce = nonce
        self.state = "start"
        self._server_nonce = b""
        self._auth = False

    @property
    def done(self) -> bool:
        return self.state == "done"

    def start(self) -> bytes:
        if self.state != "start":
            raise LocalProtocolError("handshake already started")
        self.state = "sent_hello"
        return encode_control(FrameType.HELLO, 0, {"nonce": self.nonce})

    def on_frame(self, frame: Frame) -> bytes:
        ftype = frame.header.type
        if ftype is FrameType.ERROR:
            msg = decode_control(frame.payload)
            _raise_handshake_error(msg)
        nxt = self._TRANSITIONS[self.state].get(ftype)
        if nxt is None:
            raise RemoteProtocolError(f"unexpected {ftype.name} frame during handshake ({self.state})")
        msg = decode_control(frame.payload)
        out = b""
        if ftype is FrameType.CHALLENGE:
            self._server_nonce = _bytes_field(msg, "nonce", NONCE_SIZE)
            self._auth = bool(msg.get("auth"))
            if self._auth and not self.token:
                raise AuthError("server requires a token (--token-file or TB5SYNC_TOKEN)")
            if self.token and not self._auth:
                raise AuthError("server does not authenticate, but we hold a token: refusing an unverified server")
            mac = client_mac(self.token, self._server_nonce, self.nonce) if self.token else b""
            out = encode_control(FrameType.AUTH, 0, {"mac": mac})
        elif ftype is FrameType.WELCOME and self._auth:
            assert self.token is not None
            theirs = _bytes_field(msg, "mac")
            if not _compare_digest(theirs, server_mac(self.token, self.nonce, self._server_nonce)):
                raise AuthError("server failed to prove it knows the token")
        self.state = nxt
        return out


class ServerHandshake:
    """Server side of the handshake as a state machine.

    Feed each received frame to :meth:`on_frame`; send the bytes it returns.
    :attr:`done` turns true once the client is authenticated.

    Parameters
    ----------
    token : bytes or None
        Shared secret; None disables authentication.
    nonce : bytes
        32 random bytes.
    gate : callable or None
        Called right before the client's MAC is checked (only with a token); may raise
        :class:`~tb5sync.errors.AuthError` to refuse without checking it. It returns a
        callable (or None) that is called once the MAC proved right.

    Raises
    ------
    AuthError
        Wrong MAC, or refused by ``gate``. The caller should send :func:`error_frame` and close.
    RemoteProtocolError
        A frame arrives out of order or malformed.
    """

    _TRANSITIONS: Final = {
        "start": {FrameType.HELLO: "sent_challenge"},
        "sent_challenge": {FrameType.AUTH: "done"},
        "done": {},
    }

    def __init__(self, token: bytes | None, nonce: bytes,
                 gate: Callable[[], Callable[[], None] | None] | None = None) -> None:
        self.token = token
        self.nonce = nonce
        self.gate = gate
        self.state = "start"
        self._client_nonce = b""

    @property
    def done(self) -> bool:
        return self.state == "done"

    def on_frame(self, frame: Frame) -> bytes:
        ftype = frame.header.type
        nxt = self._TRANSITIONS[self.state].get(ftype)
        if nxt is None:
            raise RemoteProtocolError(f"unexpected {ftype.name} frame during handshake ({self.state})")
        msg = decode_control(frame.payload)
        if ftype is FrameType.HELLO:
            self._client_nonce = _bytes_field(msg, "nonce", NONCE_SIZE)
            out = encode_control(FrameType.CHALLENGE, 0, {"nonce": self.nonce, "auth": self.token is not None})
        else:
            mac = _bytes_field(msg, "mac")
            reply = b""
            if self.token is not None:
                proved = self.gate() if self.gate is not None else None
                want = client_mac(self.token, self.nonce, self._client_nonce)
                if not _compare_digest(mac, want):
                    raise AuthError("authentication failed: wrong token")
                if proved is not None:
                    proved()
                reply = server_mac(self.token, self._client_nonce, self.nonce)
            out = encode_control(FrameType.WELCOME, 0, {"mac": reply})
        self.state = nxt
        return out


def error_frame(rid: int, exc: BaseException, message: str | None = None) -> bytes:
    """Encode an ERROR frame reporting ``exc`` as ``{"kind": class name, "message": str[, "errno": int]}``.

    ``message`` replaces ``str(exc)`` when given (e.g. with server paths made relative).
    """
    text = str(exc) if message is None else message
    if len(text) > MAX_ERROR_MESSAGE:
        text = text[: MAX_ERROR_MESSAGE - 3] + "..."
    if not text.isascii():  # a name that is not valid UTF-8 (surrogate escapes) shown as \xNN
        text = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    msg: dict[str, Any] = {"kind": type(exc).__name__, "message": text}
    code = getattr(exc, "errno", None)
    if isinstance(exc, OSError) and isinstance(code, int):
        msg["errno"] = code
    return encode_control(FrameType.ERROR, rid, msg)


def error_from_body(msg: dict[str, Any]) -> Tb5syncError:
    """The exception an ERROR frame's decoded body stands for (the one ERROR decoder).

    ``msg`` is ``{"kind": class name, "message": str, "errno": int (optional)}`` as
    :func:`error_frame` writes it; unknown kinds become :class:`~tb5sync.errors.RemoteError`.
    """
    code = msg.get("errno")
    return error_from_remote(str(msg.get("kind", "RemoteError")), str(msg.get("message", "")), code if isinstance(code, int) else None)


def _raise_handshake_error(msg: dict[str, Any]) -> None:
    raise error_from_body(msg)
