"""Conditional writes on an object store: the probe of whether it honours ``If-None-Match``/``If-Match`` on
PUT (recorded per store), create-if-absent, and the ref update that loses nothing: compare-and-swap on
the ref's ETag where honoured, else under the lease object ``locks/refs``. See :mod:`tb5sync.store.objstore`.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from typing import Any

from tb5sync.errors import RefExistsError, Tb5syncError

#: A lease object (ref lease or writer lease) not renewed for this long is dead, seconds.
LEASE_TTL_OBJ = 60.0
#: Seconds a writer waits between writing the ref lease object and reading it back.
LEASE_SETTLE = 0.2


class RefConflictError(Tb5syncError, RuntimeError):
    """A ref changed under a compare-and-swap too many times in a row (another writer keeps winning)."""


class _Precondition(Exception):
    pass


class ConditionalWrites:
    """The conditional writes of :class:`~tb5sync.store.objstore.ObjectStore` (mixed into it): they use its
    ``fs``, ``root``, ``url``, ``owner``, ``cache_dir``, ``_conditional``, ``_doing`` and ``_ref_obj``."""

    def _s3_split(self, key: str) -> tuple[str, str]:
        bucket, _, k = key.partition("/")
        return bucket, k

    def _is_s3(self) -> bool:
        return hasattr(self.fs, "call_s3")

    def _put_if_absent(self, key: str, body: bytes) -> None:
        if self._is_s3() and self.conditional:
            b, k = self._s3_split(key)
            self._s3_put(Bucket=b, Key=k, Body=body, IfNoneMatch="*")
            return
        if self.fs.exists(key):
            raise _Precondition(key)
        self.fs.pipe_file(key, body)

    def _s3_put(self, **kw: Any) -> None:
        try:
            self.fs.call_s3("put_object", **kw)
        except Exception as exc:  # botocore ClientError, or s3fs's translation of it
            # s3fs turns 412 into OSError(EINVAL, "At least one of the pre-conditions ... did not hold")
            text = f"{exc!r} {getattr(exc, 'response', '')}".lower()
            if any(s in text for s in ("precondition", "pre-condition", "conditionalrequestconflict")):
                raise _Precondition(kw.get("Key")) from exc
            raise

    def _etag(self, key: str) -> str | None:
        try:
            info = self.fs.info(key, refresh=True) if self._is_s3() else self.fs.info(key)
        except FileNotFoundError:
            return None
        return str(info.get("ETag") or info.get("etag") or "")

    @property
    def conditional(self) -> bool:
        """Whether the backend honours ``If-None-Match``/``If-Match`` on PUT: probed once per store and
        recorded in the local cache directory (``conditional.json``), so later runs do not probe again."""
        if self._conditional is None:
            with self._doing("probing conditional writes (a PUT under locks/probe-*)"):
                found = self._probe_conditional()
            self._conditional = found
            with contextlib.suppress(OSError):
                tmp = os.path.join(self.cache_dir, f"conditional.json.{secrets.token_hex(6)}")
                with open(tmp, "w") as f:
                    json.dump({"conditional": found, "probed": time.time()}, f)
                os.replace(tmp, os.path.join(self.cache_dir, "conditional.json"))
        return self._conditional

    def _cached_probe(self) -> bool | None:
        """The probe result recorded in the cache directory, or None."""
        try:
            with open(os.path.join(self.cache_dir, "conditional.json"), "rb") as f:
                v = json.loads(f.read()).get("conditional")
        except (OSError, ValueError, AttributeError):
            return None
        return v if isinstance(v, bool) else None

    def _probe_conditional(self) -> bool:
        """Create-if-absent twice and If-Match with a wrong ETag: both refused means honoured. An error
        other than a refused precondition propagates (and nothing is recorded)."""
        if not self._is_s3():
            return False
        b, k = self._s3_split(f"{self.root}/locks/probe-{secrets.token_hex(8)}")
        try:
            self.fs.call_s3("put_object", Bucket=b, Key=k, Body=b"1", IfNoneMatch="*")
            try:
                self._s3_put(Bucket=b, Key=k, Body=b"2", IfNoneMatch="*")
                return False  # accepted twice: the header is ignored
            except _Precondition:
                pass
            try:
                self._s3_put(Bucket=b, Key=k, Body=b"3", IfMatch='"0123456789abcdef0123456789abcdef"')
                return False
            except _Precondition:
                return True
        finally:
            with contextlib.suppress(Exception):
                self.fs.call_s3("delete_object", Bucket=b, Key=k)

    @contextlib.contextmanager
    def _ref_lease(self) -> Any:
        """The lease object ``locks/refs`` (module docstring), for backends without conditional writes."""
        key = f"{self.root}/locks/refs"
        end = time.monotonic() + 2 * LEASE_TTL_OBJ
        me = f"{self.owner}:{secrets.token_hex(4)}"
        while True:
            try:
                cur = json.loads(self.fs.cat_file(key))
            except FileNotFoundError:
                cur = None
            except ValueError:
                cur = {"expires": 0}
            if cur is None or cur.get("expires", 0) < time.time():
                self.fs.pipe_file(key, json.dumps({"owner": me, "expires": time.time() + LEASE_TTL_OBJ}).encode())
                time.sleep(LEASE_SETTLE)
                with contextlib.suppress(FileNotFoundError, ValueError):
                    if json.loads(self.fs.cat_file(key)).get("owner") == me:
                        break
            if time.monotonic() > end:
                raise RefConflictError(f"{self.url}: the ref lease {key} stays held by {cur and cur.get('owner')}")
            time.sleep(0.05 + secrets.randbelow(100) / 1000)
        try:
            yield
        finally:
            with contextlib.suppress(FileNotFoundError, ValueError):
                if json.loads(self.fs.cat_file(key)).get("owner") == me:
                    self.fs.rm_file(key)

    def _update_ref(self, name: str, fn: Any, create_only: bool = False) -> dict[str, Any] | None:
        """Read ref object ``name``, compute ``fn(old or None)`` (a dict, or None for no change) and write it
        so that no concurrent update is lost; returns what was written."""
        key = f"{self.root}/refs/{name}"
        if not self.conditional:
            with self._ref_lease():
                old = self._ref_obj(name)
                new = fn(old)
                if new is not None:
                    self.fs.pipe_file(key, json.dumps(new).encode())
                return new
        b, k = self._s3_split(key)
        for _ in range(20):
            etag = self._etag(key)
            if etag is not None and create_only:
                raise RefExistsError(f"ref {name!r} already exists in store {self.url} (--force replaces it)")
            old = self._ref_obj(name) if etag is not None else None
            if etag is not None and old is None:
                time.sleep(0.02)  # removed between the two reads, or not yet readable where it was written
                continue
            new = fn(old)
            if new is None:
                return None
            body = json.dumps(new).encode()
            try:
                if etag is None:
                    self._s3_put(Bucket=b, Key=k, Body=body, IfNoneMatch="*")
                else:
                    self._s3_put(Bucket=b, Key=k, Body=body, IfMatch=etag)
                return new
            except _Precondition:
                if create_only:
                    raise RefExistsError(f"ref {name!r} already exists in store {self.url} (--force replaces it)") from None
                time.sleep(0.01 + secrets.randbelow(50) / 1000)
        raise RefConflictError(f"ref {name!r} in {self.url} changed under 20 updates in a row")
