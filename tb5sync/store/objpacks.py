"""Packs on an object store: :class:`ObjectPackStorage`, each pack one whole PUT followed by its index
object ``index/<id>``, ranged reads tried again. See :mod:`tb5sync.store.objstore` for the layout.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import msgpack

from tb5sync.errors import IntegrityError
from tb5sync.store.objerrors import _TIMEOUT, _clear_errors
from tb5sync.store.packs import FsspecPackStorage, iter_frames

#: Tries of one ranged pack read before its error is raised.
READ_TRIES = 4


class ObjectPackStorage(FsspecPackStorage):
    """Packs on an fsspec filesystem, each followed by its index object ``INDEX/<id>`` (see the module docstring)."""

    def __init__(self, fs: object, root: str, index_root: str, url: str = "", timeout: float | None = None) -> None:
        super().__init__(fs, root)
        self.index_root = index_root
        self.url = url  # the store's URL, for errors
        self.timeout = timeout

    @_clear_errors("writing a pack")
    def put_file(self, name: str, path: str) -> int:
        with open(path, "rb") as f:
            data = f.read()
        rows = [[d, off, n] for d, off, n in iter_frames(data, name)]
        size = super().put_file(name, path)  # whole PUT; raises on a failed upload and references nothing
        self.put_index(name, size, time.time(), rows)
        return size

    def put_index(self, name: str, size: int, created: float, rows: Sequence[Sequence[Any]]) -> None:
        """Write the index object of pack ``name`` (``rows``: ``[digest, offset, length]`` per frame)."""
        idx = msgpack.packb({"v": 1, "size": size, "created": created, "chunks": [list(r) for r in rows]})
        try:
            self.fs.pipe_file(f"{self.index_root}/{name}", idx)
        except Exception as exc:
            exc._tb5_step = f"writing the index object of pack {name}"  # type: ignore[attr-defined]
            raise

    def get_range(self, name: str, offset: int, length: int) -> bytes:
        """As :meth:`FsspecPackStorage.get_range`, a failed read tried again ``READ_TRIES`` times in all
        (0.2, 0.4, 0.8 s apart): a replica's server going away mid-read costs a retry, not the read.
        A timeout is not tried again (the client's attempts are spent: the read stays within the request bound)."""
        for attempt in range(READ_TRIES):
            try:
                return super().get_range(name, offset, length)
            except (FileNotFoundError, IntegrityError):
                raise
            except Exception as exc:
                if attempt == READ_TRIES - 1 or _TIMEOUT.search(str(exc).lower()):
                    raise  # a timeout has had its attempts already (the request bound): not again
                time.sleep(0.2 * 2**attempt)
        raise AssertionError("unreachable")

    def delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(f"{self.index_root}/{name}")
        super().delete(name)

    def list(self) -> dict[str, tuple[int, float]]:
        """As :meth:`FsspecPackStorage.list`, with each pack's modification time (seconds) where the listing has it."""
        with contextlib.suppress(AttributeError, TypeError):
            self.fs.invalidate_cache(self.root)
        return super().list()

    def _listed_mtime(self, info: dict[str, Any]) -> float:
        return _mtime(info)


def _mtime(info: dict[str, Any]) -> float:
    """Modification time (s since epoch) of a listed object, 0.0 when the listing has none."""
    mt = info.get("LastModified") or info.get("mtime") or info.get("created")
    if mt is None:
        return 0.0
    return mt.timestamp() if hasattr(mt, "timestamp") else float(mt)
