"""``tb5://[TOKEN@]HOST[:PORT]/PATH`` URLs and the token that goes with them.

Below both faces of the client: :mod:`tb5sync.remote.client` (push, pull, ls) and
:mod:`tb5sync.fs.filesystem` (the fsspec filesystem) parse URLs and find the token here, so the
CLI, the API and fsspec accept the same forms:

``tb5://HOST[:PORT]/PATH``
    Plain TCP; the token comes from the caller or ``$TB5SYNC_TOKEN``.
``tb5s://HOST[:PORT]/PATH``
    The same over TLS (the server runs with ``--tls-cert``/``--tls-key``).
``tb5://[fe80::1%25bridge0]:8873/PATH``
    An IPv6 link-local address with its zone (the interface), percent-encoded as RFC 6874
    writes it (``%25``); a raw ``%`` is accepted too. ``Remote.host`` holds ``fe80::1%bridge0``.
``tb5://TOKEN@HOST/...``, ``tb5://USER:TOKEN@HOST/...``
    The token in the URL (percent-encoded where needed; the user name is ignored).
    Visible in process lists and shell history: prefer a token file or the environment.

A token never appears in an error message: URLs are quoted with the user part as ``***``.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field
from urllib.parse import quote, unquote, urlsplit

from tb5sync.errors import UsageError
from tb5sync.wire.messages import DEFAULT_PORT
from tb5sync.wire.transport import host_port  # noqa: F401  (re-exported: the one host:port form of messages)

__all__ = ["Remote", "parse_url", "token_of", "redact_url", "url_host", "with_family", "SCHEMES"]

#: URL schemes: plain TCP and TLS.
SCHEMES = ("tb5", "tb5s")


@dataclass(frozen=True)
class Remote:
    """A parsed ``tb5://HOST[:PORT]/PATH`` URL. ``path`` is relative to the server's root.

    ``token`` is the one written in the URL (never shown by ``repr``), ``tls`` is True for
    ``tb5s://``. ``family`` limits connections to one address family (``socket.AF_INET`` or
    ``AF_INET6``: rsync's ``-4``/``-6``, set by the caller, never by the URL); 0: any.
    """

    host: str
    port: int
    path: str
    token: bytes | None = field(default=None, repr=False, compare=False)
    tls: bool = False
    family: int = field(default=0, compare=False)

    @property
    def slash(self) -> bool:
        """True when the path ends with ``/`` (rsync's "contents of")."""
        return self.path.endswith("/") or self.path == ""


_USERINFO = re.compile(r"^(?P<head>[A-Za-z][A-Za-z0-9+.-]*:/*)(?P<user>[^/@]*)@")


_ZONED = re.compile(r"^(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/\[\]]*\[)(?P<addr>[^\]/%]*)%(?P<zone>[^\]/]*)(?P<tail>\].*)$", re.S)


def redact_url(url: str) -> str:
    """``url`` with any user part (``TOKEN@``, ``USER:TOKEN@``) replaced by ``***@``."""
    return _USERINFO.sub(lambda m: m.group("head") + "***@", url, count=1)


def parse_url(url: str) -> Remote | None:
    """Parse ``tb5[s]://[TOKEN@]HOST[:PORT]/PATH``; None for a local path.

    ``[v6addr]:port`` is accepted, with a zone: ``[fe80::1%25bridge0]`` (RFC 6874) or
    ``[fe80::1%bridge0]``; ``Remote.host`` is then ``fe80::1%bridge0``. The port defaults to 8873.

    Raises
    ------
    UsageError
        A ``tb5://`` URL that cannot be parsed (e.g. an unclosed ``[`` of an IPv6 host), without
        a host, with a bad port, or another scheme; or a local path
        that starts like a mistyped one (``tb5:/host/...``, ``tb5:host/...``) or like rsync's
        remote-shell ``HOST:PATH`` (a colon before any slash, rsync's rule): write ``./NAME``
        for a local name that really is so. The message quotes the URL
        without its token.
    """
    shown = redact_url(url)
    if "://" not in url:
        if url.lower().startswith(("tb5:", "tb5s:")):
            raise UsageError(f"{shown!r} looks like a mistyped URL (expected tb5://HOST[:PORT]/PATH; "
                             f"write ./{shown} for a local path)")
        colon = url.find(":")
        if colon > 0 and "/" not in url[:colon]:  # rsync's rule: a colon before any slash names a host
            raise UsageError(f"{shown!r} is rsync's HOST:PATH (remote shell) form, which tb5sync does not use: "
                             f"write tb5://{url[:colon]}/{url[colon + 1:].lstrip(':').lstrip('/')} "
                             f"(a tb5sync serve there), or ./{shown} for a local name with a colon")
        return None
    zone = ""
    zoned = _ZONED.match(url)
    if zoned:  # an IPv6 zone: RFC 6874's "%25" + percent-encoded name, or a raw "%"
        zone = zoned["zone"]
        zone = unquote(zone[2:]) if zone.startswith("25") else zone
        if not zone or not zoned["addr"] or any(c in zone for c in "%/[]@") or not zone.isprintable():
            raise UsageError(f"bad IPv6 zone in {shown!r} (expected tb5://[fe80::1%25IFACE]/PATH)")
        url = zoned["head"] + zoned["addr"] + zoned["tail"]  # urlsplit checks the address alone
    try:
        parts = urlsplit(url)
        hostname = parts.hostname
    except ValueError as exc:  # "Invalid IPv6 URL" and the like
        if "[" in url and "]" not in url:  # cut at "::": fsspec.open's chaining separator
            raise UsageError(f"malformed URL {shown!r}: an IPv6 address cut short, as fsspec.open does at '::' "
                             f"(its chaining separator); write the address without '::', e.g. "
                             f"tb5://[0:0:0:0:0:0:0:1]:8873/PATH, or use tb5sync.fs.filesystem.TB5FileSystem directly") from None
        raise UsageError(f"malformed URL {shown!r} ({exc}; expected tb5://HOST[:PORT]/PATH, "
                         f"an IPv6 host in brackets: tb5://[::1]/PATH)") from None
    if parts.scheme not in SCHEMES:
        raise UsageError(f"unsupported URL scheme {parts.scheme!r} in {shown!r} (expected tb5:// or tb5s://)")
    if not hostname:
        raise UsageError(f"no host in {shown!r}")
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError:
        raise UsageError(f"bad port in {shown!r} (expected 1..65535)") from None
    if ":" in hostname:  # an IPv6 address in its one short form (fe80:0:0:0:0:0:0:1 -> fe80::1)
        try:
            hostname = str(ipaddress.IPv6Address(hostname))
        except ValueError:
            pass
    if zone:
        hostname = f"{hostname}%{zone}"
    path = parts.path[1:] if parts.path.startswith("/") else parts.path
    secret = parts.password if parts.password is not None else parts.username
    token = unquote(secret).encode() if secret else None
    return Remote(hostname, port, path, token, parts.scheme == "tb5s")


def with_family(remote: Remote, ip_version: object) -> Remote:
    """``remote`` limited to IPv4 (``ip_version`` 4, rsync's ``-4``) or IPv6 (6, ``-6``); None: as it is.

    Raises
    ------
    UsageError
        ``ip_version`` is not None, 4 or 6.
    """
    import dataclasses
    import socket

    if ip_version is None:
        return remote
    if isinstance(ip_version, bool) or ip_version not in (4, 6):
        raise UsageError(f"ip_version must be 4, 6 or None, not {ip_version!r:.80}")
    return dataclasses.replace(remote, family=socket.AF_INET if ip_version == 4 else socket.AF_INET6)


def url_host(host: str) -> str:
    """``host`` as a URL writes it: an IPv6 address in brackets, its zone percent-encoded
    (``fe80::1%bridge0`` -> ``[fe80:0:0:0:0:0:0:1%25bridge0]``, RFC 6874); other hosts as they are.

    An IPv6 address is written without ``::`` (each group, leading zeros dropped): fsspec's
    ``open`` reads ``::`` in a URL as its chaining separator (``simplecache::tb5://...``), so a
    URL holding one cannot be opened through ``fsspec.open``; this form can."""
    if ":" not in host:
        return host
    addr, pct, zone = host.partition("%")
    try:
        addr = ":".join(g.lstrip("0") or "0" for g in ipaddress.IPv6Address(addr).exploded.split(":"))
    except ValueError:
        pass
    return f"[{addr}%25{quote(zone, safe='')}]" if pct else f"[{addr}]"


def token_of(token: bytes | str | None, remote: Remote | None = None) -> bytes | None:
    """The shared secret to authenticate with.

    The caller's ``token`` first, then the one in the URL (``remote.token``), then
    ``$TB5SYNC_TOKEN``.

    Parameters
    ----------
    token : bytes or str or None
        The caller's token (a ``str`` is UTF-8 encoded).
    remote : Remote or None
        The URL the token is for.

    Returns
    -------
    bytes or None
        None when none is set (or the variable is empty): no authentication.

    Raises
    ------
    UsageError
        The caller's token and the URL's differ (as fsspec refuses a storage option that
        contradicts the URL); neither is shown.
    """
    if isinstance(token, str):
        token = token.encode()
    url_token = remote.token if remote is not None else None
    if token is not None and url_token is not None and token != url_token:
        raise UsageError("two different tokens given: one in the URL and one as an option (or --token-file)")
    if token is None:
        token = url_token
    if token is None:
        env = os.environ.get("TB5SYNC_TOKEN") or None
        token = env.encode() if env else None
    return token
