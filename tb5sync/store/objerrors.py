"""Errors of the artifact store on an object store: :class:`ObjectStoreError` and how a client error
(botocore, aiohttp, OSError) becomes one that names the store URL, the step and what to check
(:func:`describe_error`, the ``_clear_errors`` decorator). See :mod:`tb5sync.store.objstore`.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from tb5sync.errors import DestinationError, Tb5syncError

#: Attempts botocore makes of one request.
REQUEST_ATTEMPTS = 3


class ObjectStoreError(Tb5syncError, OSError):
    """The object store failed a request (unreachable, timed out, refused a write); names the store URL,
    what was being done and the backend's own message. Nothing half-written is referenced."""

    exit_code = 11


_F = TypeVar("_F", bound=Callable[..., Any])

_AUTH_WORDS = ("forbidden", "accessdenied", "access denied", "invalidaccesskeyid", "signaturedoesnotmatch",
               "invalidtoken", "expiredtoken", "403", "unauthorized", "nocredentials", "unable to locate credentials")
_TIMEOUT_WORDS = ("timeout", "timed out")
_CONNECT_WORDS = ("could not connect", "connection refused", "cannot connect", "endpointconnectionerror",
                  "name or service not known", "nodename nor servname")
_BUCKET_WORDS = ("nosuchbucket", "invalidbucketname", "bucket is not valid", "bucket does not exist")


def _words(*words: str) -> re.Pattern[str]:
    """One pattern matching any of ``words`` inside the text (``timeout`` in ``readtimeouterror``),
    a number only as a whole word (the status ``403``, not the ``403`` of a digest's ``ab4035``)."""
    return re.compile("|".join(rf"\b{w}\b" if w.isdigit() else re.escape(w) for w in words))


_AUTH, _TIMEOUT, _CONNECT, _BUCKET = (_words(*w) for w in (_AUTH_WORDS, _TIMEOUT_WORDS, _CONNECT_WORDS, _BUCKET_WORDS))
#: A token with a ``/`` in it (an endpoint URL, an object key): its words are names, not the error's.
_PATH_TOKEN = re.compile(r"\S*/\S*")


def describe_error(store: Any, what: str, exc: BaseException) -> ObjectStoreError:
    """An :class:`ObjectStoreError` for ``exc`` raised by the object store's client during ``what``:
    ``"<url>: <what> failed [while <step>]: <type>: <message>[; <hint>]"``. The step is the innermost
    :meth:`ObjectStore._doing` the error passed through; the hint says what to check for a refused
    login (credentials, endpoint), an unreachable endpoint, or a timeout (``--timeout``)."""
    url = getattr(store, "url", None) or getattr(store, "root", "?")
    step = getattr(exc, "_tb5_step", None)
    text = f"{type(exc).__name__}: {exc}".strip()
    low = f"{text} {getattr(exc, 'response', '')}".lower()
    cause = exc.__cause__ or exc.__context__
    if cause is not None:
        low += f" {type(cause).__name__} {cause}".lower()
    low = _PATH_TOKEN.sub(" ", low)  # object keys hold hex digests ("...ab4035..."), URLs hold ports
    if isinstance(exc, PermissionError) or _AUTH.search(low):
        hint = ("the object store refused these credentials: check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "(or --storage-option key=... --storage-option secret=...) and that the endpoint "
                "(AWS_ENDPOINT_URL, or --storage-option endpoint_url=...) is the store's")
    elif _BUCKET.search(low):
        hint = "check the bucket in the store URL (s3://BUCKET/PREFIX): it must exist and be a valid name"
    elif _TIMEOUT.search(low):
        t = getattr(store, "timeout", None)
        hint = (f"no answer within the request timeout ({t:g} s, {REQUEST_ATTEMPTS} attempts; --timeout S)"
                if t else "no answer in time")
    elif _CONNECT.search(low) or isinstance(exc, ConnectionError):
        hint = "cannot reach the object store: check the endpoint (AWS_ENDPOINT_URL or --storage-option endpoint_url=...)"
    else:
        hint = ""
    msg = f"{url}: {what} failed" + (f" while {step}" if step and step != what else "") + f": {text}"
    return ObjectStoreError(msg + (f"; {hint}" if hint else ""))


def _name_store(store: Any, exc: Tb5syncError) -> None:
    """Make a store error name the store URL (once)."""
    url = getattr(store, "url", None)
    if url and exc.args and isinstance(exc.args[0], str) and url not in exc.args[0]:
        exc.args = (f"{url}: {exc.args[0]}", *exc.args[1:])


_nesting = threading.local()


def _clear_errors(what: str) -> Callable[[_F], _F]:
    """Errors of the object store's client (botocore, aiohttp, OSError) leave the outermost wrapped call as
    :class:`ObjectStoreError` (see :func:`describe_error`: that call's ``what``, the innermost step);
    tb5sync's own errors (but a local destination's) are made to name the store URL."""

    def deco(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(self: Any, *args: Any, **kw: Any) -> Any:
            depth = getattr(_nesting, "depth", 0)
            _nesting.depth = depth + 1
            try:
                return fn(self, *args, **kw)
            except (DestinationError, KeyboardInterrupt):
                raise
            except Tb5syncError as exc:
                _name_store(self, exc)
                raise
            except FileNotFoundError:
                raise
            except Exception as exc:
                if getattr(exc, "_tb5_step", None) is None:
                    with contextlib.suppress(AttributeError, TypeError):
                        exc._tb5_step = what  # type: ignore[attr-defined]
                if depth:
                    raise  # an outer call names the operation
                raise describe_error(self, what, exc) from exc
            finally:
                _nesting.depth = depth

        return wrapper  # type: ignore[return-value]

    return deco
