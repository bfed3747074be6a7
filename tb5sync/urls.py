"""``tb5://HOST[:PORT]/PATH`` URLs and the token that goes with them.

Below both faces of the client: :mod:`tb5sync.client` (push, pull, ls) and
:mod:`tb5sync.fs` (the fsspec filesystem) parse URLs and find the token here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import urlsplit

from .errors import UsageError
from .messages import DEFAULT_PORT

__all__ = ["Remote", "parse_url", "token_of"]


@dataclass(frozen=True)
class Remote:
    """A parsed ``tb5://HOST[:PORT]/PATH`` URL. ``path`` is relative to the server's root."""

    host: str
    port: int
    path: str

    @property
    def slash(self) -> bool:
        """True when the path ends with ``/`` (rsync's "contents of")."""
        return self.path.endswith("/") or self.path == ""


def parse_url(url: str) -> Remote | None:
    """Parse ``tb5://HOST[:PORT]/PATH``; None for a local path.

    ``[v6addr]:port`` is accepted. The port defaults to 8873.

    Raises
    ------
    UsageError
        A ``tb5://`` URL without a host, with a bad port, or another scheme; or a local path
        that starts like a mistyped one (``tb5:/host/...``, ``tb5:host/...``): write
        ``./tb5:...`` for a local name that really starts so.
    """
    if "://" not in url:
        if url.lower().startswith("tb5:"):
            raise UsageError(f"{url!r} looks like a mistyped URL (expected tb5://HOST[:PORT]/PATH; "
                             f"write ./{url} for a local path)")
        return None
    parts = urlsplit(url)
    if parts.scheme != "tb5":
        raise UsageError(f"unsupported URL scheme {parts.scheme!r} in {url!r} (expected tb5://)")
    if not parts.hostname:
        raise UsageError(f"no host in {url!r}")
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError as exc:
        raise UsageError(f"bad port in {url!r}: {exc}") from exc
    path = parts.path[1:] if parts.path.startswith("/") else parts.path
    return Remote(parts.hostname, port, path)


def token_of(token: bytes | str | None) -> bytes | None:
    """The shared secret to authenticate with: ``token`` as bytes, or ``$TB5SYNC_TOKEN`` when None.

    Parameters
    ----------
    token : bytes or str or None
        The caller's token (a ``str`` is UTF-8 encoded); None reads the environment.

    Returns
    -------
    bytes or None
        None when neither is set (or the variable is empty): no authentication.
    """
    if token is None:
        token = os.environ.get("TB5SYNC_TOKEN") or None
    if isinstance(token, str):
        token = token.encode()
    return token
