"""Small entries that arrive one by one share packs (tb5sync.cache.httpcache: batches by size and
time), and an entry is acknowledged only once it is durable and indexed: after a ``kill -9`` of the
server every entry answered 200 is there, byte for byte."""

from __future__ import annotations

import hashlib
import http.client
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import http_cache_port

from tb5sync.cache import httpcache
from tb5sync.cache.httpcache import HttpCache
from tb5sync.store import Store
from tb5sync.store.blobs import blob, read_blob

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cache(tmp_path: Any) -> Iterator[HttpCache]:
    with HttpCache(tmp_path / "store") as c:
        yield c


def packs(store_dir: Any) -> int:
    return sum(len(files) for _, _, files in os.walk(os.path.join(store_dir, "packs")))


def uploader(port: int, blobs: list[bytes], acked: list[str], stop: threading.Event | None = None,
             pause: float = 0.0) -> None:
    h = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        for b in blobs:
            if stop is not None and stop.is_set():
                return
            key = f"/cas/{hashlib.sha256(b).hexdigest()}"
            h.request("PUT", key, body=b)
            r = h.getresponse()
            r.read()
            if r.status == 200:
                acked.append(key)
            if pause:
                time.sleep(pause)
    except (OSError, http.client.HTTPException):
        return  # the server was killed
    finally:
        h.close()


def test_small_puts_from_several_clients_share_packs(cache: HttpCache) -> None:
    """400 small entries from 8 connections, each one after the other with a pause (uploads that
    overlap but do not arrive together): far fewer packs than entries, and every entry readable."""
    blobs = [os.urandom(1024 + k) for k in range(400)]
    acked: list[str] = []
    threads = [threading.Thread(target=uploader, args=(cache.port, blobs[k::8], acked, None, 0.001)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(acked) == sorted(f"/cas/{hashlib.sha256(b).hexdigest()}" for b in blobs)
    n = packs(cache.store.path)
    assert n <= len(blobs) // 4, f"{n} packs for {len(blobs)} entries"
    for b in blobs[::37]:
        info = blob(cache.store, f"cas/{hashlib.sha256(b).hexdigest()}", False)
        assert info is not None and b"".join(read_blob(cache.store, info)) == b


def test_a_lone_uploader_is_not_kept_waiting(cache: HttpCache, monkeypatch: pytest.MonkeyPatch) -> None:
    """One client uploading one entry at a time: nothing else is arriving, so no PUT waits for the
    batch's linger (set long here: a wait would show)."""
    monkeypatch.setattr(httpcache, "BATCH_LINGER", 2.0)
    blobs = [os.urandom(2048) for _ in range(10)]
    acked: list[str] = []
    t0 = time.monotonic()
    uploader(cache.port, blobs, acked)
    assert len(acked) == 10
    assert time.monotonic() - t0 < 5.0


def test_every_acknowledged_entry_survives_kill_9(tmp_path: Any) -> None:
    store = tmp_path / "store"
    p = subprocess.Popen([sys.executable, "-m", "tb5sync.cli", "http-cache", str(store), "--bind", "127.0.0.1:0"],
                         stderr=subprocess.PIPE, text=True)
    try:
        port = http_cache_port(p.stderr)
        assert port
        blobs = [os.urandom(512 + k * 7) for k in range(4000)]
        acked: list[str] = []
        stop = threading.Event()
        threads = [threading.Thread(target=uploader, args=(port, blobs[k::8], acked, stop)) for k in range(8)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while len(acked) < 300 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(p.pid, signal.SIGKILL)  # mid-stream: batches open, bodies arriving
        p.wait(30)
        stop.set()
        for t in threads:
            t.join(30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
        assert p.stderr is not None
        p.stderr.close()
    got = list(acked)
    assert 300 <= len(got) < len(blobs)
    by_key = {f"/cas/{hashlib.sha256(b).hexdigest()}": b for b in blobs}
    with Store(store) as s:
        for key in got:
            info = blob(s, key.lstrip("/"), False)
            assert info is not None, f"{key} was acknowledged but is gone"
            assert b"".join(read_blob(s, info)) == by_key[key]
        assert packs(store) < len(got) // 2
