"""``tb5store://HOST[:PORT]/REF/PATH``: a server's store refs, read-only, through fsspec.

A separate protocol from ``tb5://`` (which serves a directory tree): the path starts with a ref
name, and the ref is the longest prefix of the path that names a ref on the server (a store
refuses a ref name that is a path prefix of another, as git does, so at most one prefix is a ref;
stores written before that rule may hold both, and then the longer one wins). The
path levels above ref names list as directories (``ls("tb5store://host/models")`` shows
``models/qwen-0.5b``). Reads are ranged: each is answered from the packs on the server (at most
:data:`~tb5sync.wire.messages.STORE_MAX_BATCH` bytes per request), so a safetensors or GGUF header
and single tensors are read without fetching the whole file. Every chunk is checked against its
BLAKE3 digest on the server as it is read from its pack.

Example::

    import fsspec
    fs = fsspec.filesystem("tb5store", host="node2", port=8873)
    with fs.open("models/qwen-0.5b/q4/model.safetensors", "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = f.read(n)
"""

from __future__ import annotations

import stat
import threading
from typing import Any

from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from tb5sync.errors import RemoteProtocolError, UsageError
from tb5sync.wire.messages import DEFAULT_PORT, STORE_MAX_BATCH
from tb5sync.remote.storeclient import StoreSession
from tb5sync.wire.urls import Remote

__all__ = ["StoreFileSystem"]


class StoreFileSystem(AbstractFileSystem):
    """Read-only fsspec filesystem over the refs of a ``tb5sync serve --store`` server.

    Parameters
    ----------
    host : str
        Server address (default 127.0.0.1).
    port : int
        Server port (default 8873).
    token : bytes or str or None
        Shared secret (default ``$TB5SYNC_TOKEN``).
    """

    protocol = "tb5store"
    root_marker = ""

    def __init__(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT, token: bytes | str | None = None,
                 **kw: Any) -> None:
        super().__init__(**kw)
        self.remote = Remote(host, int(port), "")
        self.token = token
        self._session: StoreSession | None = None
        self._lock = threading.Lock()
        self._refs: list[str] | None = None
        self._listings: dict[str, dict[str, dict[str, Any]]] = {}

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        if isinstance(path, str) and path.startswith("tb5store://"):
            path = path[len("tb5store://"):]
            path = path.partition("/")[2]
        return path.strip("/")

    @staticmethod
    def _get_kwargs_from_urls(path: str) -> dict[str, Any]:
        from urllib.parse import urlsplit

        p = urlsplit(path)
        out: dict[str, Any] = {}
        if p.hostname:
            out["host"] = p.hostname
        if p.port:
            out["port"] = p.port
        return out

    # ---- the session and the ref names ---------------------------------------------------------
    def _call(self, method: str, args: dict[str, Any]) -> Any:
        with self._lock:
            if self._session is None:
                self._session = StoreSession(self.remote, self.token, 1)
            s = self._session
        return s.call(method, args)

    def close(self) -> None:
        """Close the connection."""
        with self._lock:
            s, self._session = self._session, None
        if s is not None:
            s.close()

    def _ref_names(self, refresh: bool = False) -> list[str]:
        if self._refs is None or refresh:
            got = self._call("refs", {"prefix": ""}).get("refs")
            if not isinstance(got, list):
                raise RemoteProtocolError("malformed refs reply")
            self._refs = sorted(r[0] for r in got if isinstance(r, list) and r and isinstance(r[0], str))
        return self._refs

    def split(self, path: str) -> tuple[str, str] | None:
        """``(ref, path inside it)`` for ``path``, the ref being the longest prefix that names one; None above refs."""
        path = self._strip_protocol(path)
        for refresh in (False, True):
            best = None
            for name in self._ref_names(refresh):
                if (path == name or path.startswith(name + "/")) and (best is None or len(name) > len(best)):
                    best = name
            if best is not None:
                return best, path[len(best) + 1:]
        return None

    def _listing(self, ref: str) -> dict[str, dict[str, Any]]:
        got = self._listings.get(ref)
        if got is None:
            entries = self._call("list", {"name": ref}).get("entries")
            if not isinstance(entries, list):
                raise RemoteProtocolError("malformed list reply")
            got = {}
            for e in entries:
                p, kind, mode, size, mtime_ns, target = e
                full = f"{ref}/{p}" if p else ref
                ftype = {"d": "directory", "f": "file", "l": "link"}[kind]
                fmt = {"d": stat.S_IFDIR, "f": stat.S_IFREG, "l": stat.S_IFLNK}[kind]
                got[p] = {"name": full, "size": size if kind == "f" else 0, "type": ftype, "mode": fmt | mode,
                          "mtime": mtime_ns / 1e9, "islink": kind == "l", "destination": target}
            self._listings[ref] = got
        return got

    # ---- fsspec surface ---------------------------------------------------------------------------
    def info(self, path: str, **kw: Any) -> dict[str, Any]:
        path = self._strip_protocol(path)
        hit = self.split(path)
        if hit is not None:
            ref, inner = hit
            entry = self._listing(ref).get(inner)
            if entry is None:
                raise FileNotFoundError(path)
            return dict(entry)
        if path == "" or any(n.startswith(path + "/") for n in self._ref_names()):
            return {"name": path, "size": 0, "type": "directory"}
        raise FileNotFoundError(path)

    def ls(self, path: str, detail: bool = True, **kw: Any) -> list[Any]:
        path = self._strip_protocol(path)
        hit = self.split(path)
        if hit is not None:
            ref, inner = hit
            listing = self._listing(ref)
            me = listing.get(inner)
            if me is None:
                raise FileNotFoundError(path)
            if me["type"] != "directory":
                out = [dict(me)]
            else:
                pre = inner + "/" if inner else ""
                out = [dict(v) for p, v in listing.items() if p.startswith(pre) and p and "/" not in p[len(pre):]]
        else:
            pre = path + "/" if path else ""
            kids: dict[str, dict[str, Any]] = {}
            for n in self._ref_names():
                if n.startswith(pre):
                    child = pre + n[len(pre):].split("/")[0]
                    kids.setdefault(child, {"name": child, "size": 0, "type": "directory"})
            if not kids:
                raise FileNotFoundError(path)
            out = list(kids.values())
        out.sort(key=lambda d: d["name"])
        return out if detail else [d["name"] for d in out]

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kw: Any) -> bytes:
        info = self.info(path)
        if info["type"] != "file":
            raise IsADirectoryError(path)
        size = info["size"]
        start = 0 if start is None else (start + size if start < 0 else start)
        end = size if end is None else (end + size if end < 0 else min(end, size))
        return self._read(path, max(0, start), max(0, end))

    def _read(self, path: str, start: int, end: int) -> bytes:
        hit = self.split(path)
        if hit is None:
            raise FileNotFoundError(path)
        ref, inner = hit
        out = bytearray()
        pos = start
        while pos < end:
            n = min(end - pos, STORE_MAX_BATCH)
            meta, body = self._call("read", {"name": ref, "path": inner, "offset": pos, "length": n})
            if not isinstance(meta, dict) or meta.get("length") != len(body) or len(body) > n:
                raise RemoteProtocolError("malformed read reply")
            if not body:
                break
            out += body
            pos += len(body)
        return bytes(out)

    def _open(self, path: str, mode: str = "rb", block_size: int | None = None, autocommit: bool = True,
              cache_options: Any = None, **kw: Any) -> StoreFile:
        if mode != "rb":
            raise UsageError(f"tb5store:// is read-only (mode {mode!r})")
        info = self.info(path)
        if info["type"] != "file":
            raise IsADirectoryError(path)
        return StoreFile(self, self._strip_protocol(path), mode, block_size or 4 * 1024 * 1024,
                         cache_options=cache_options, size=info["size"], **kw)

    def _rm(self, path: str) -> None:
        raise UsageError("tb5store:// is read-only")

    def created(self, path: str) -> Any:
        raise NotImplementedError

    def modified(self, path: str) -> Any:
        import datetime

        return datetime.datetime.fromtimestamp(self.info(path)["mtime"], tz=datetime.timezone.utc)


class StoreFile(AbstractBufferedFile):
    """A file of a ref, read by ranges (fsspec's read-ahead cache over :meth:`StoreFileSystem._read`)."""

    def _fetch_range(self, start: int, end: int) -> bytes:
        fs = self.fs
        assert isinstance(fs, StoreFileSystem)
        return fs._read(self.path, start, end)

