"""Quota semantics of the HTTP build cache and the store (issue 21), after bazel-remote's: an entry
larger than what the quota (or ``max_entry_size``) allows is refused before it is stored (413 when
the client said its size up front with Content-Length, 507 Insufficient Storage when the body
shows it), never answered 200 and then dropped; eviction is least recently used, by size, down to
a low-water mark, and never takes the entry that caused it; a hit on an ActionResult is a use of
the CAS blobs it names (bazel-remote's ``GetValidatedActionResult`` reads them: a Bazel build
without the bytes, which asks only for ActionResults, keeps its outputs). ``store put`` and a
push past the quota follow the same rules.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tb5sync.cache.httpcache import HttpCache
from tb5sync.errors import EntryTooLargeError, QuotaError
from tb5sync.store import Store
from tb5sync.store.blobs import blob_keys

pytestmark = pytest.mark.timeout(120)

_OPEN: list[Any] = []


@pytest.fixture(autouse=True)
def _teardown() -> Iterator[None]:
    yield
    while _OPEN:
        _OPEN.pop().close()


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def start(tmp_path: Any, quota: int | None, **kw: Any) -> HttpCache:
    if quota is not None:
        with Store(tmp_path / "store") as st:
            st.set_quota(quota)
    c = HttpCache(tmp_path / "store", **kw).start()
    _OPEN.append(_Stopper(c))
    return c


class _Stopper:
    def __init__(self, c: HttpCache) -> None:
        self.c = c

    def close(self) -> None:
        self.c.stop()


def conn(c: HttpCache) -> http.client.HTTPConnection:
    h = http.client.HTTPConnection("127.0.0.1", c.port, timeout=30)
    _OPEN.insert(0, h)  # closed before the cache stops
    return h


def req(h: http.client.HTTPConnection, method: str, path: str, body: Any = None, chunked: bool = False) -> tuple[int, bytes]:
    if chunked:
        h.request(method, path, body=iter([body[k : k + 65536] for k in range(0, len(body), 65536)]),
                  encode_chunked=True, headers={"Transfer-Encoding": "chunked"})
    else:
        h.request(method, path, body=body)
    r = h.getresponse()
    return r.status, r.read()


def settle(c: HttpCache, quota: int) -> None:
    """Wait (at most 30 s) until the cache's quota runner is idle and the store fits ``quota``."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if not c._quota_running and c.store.stats()["stored_bytes"] <= quota:
            return
        time.sleep(0.05)
    raise AssertionError(f"store did not settle under {quota}: {c.store.stats()}")


# ---- an entry that can never fit ----
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("ns", ["cas", "ccache"])
def test_entry_larger_than_the_quota_is_refused_before_it_is_stored(tmp_path: Any, ns: str, chunked: bool) -> None:
    c = start(tmp_path, 1_000_000)
    h = conn(c)
    small = [os.urandom(100_000) for _ in range(3)]
    for b in small:
        assert req(h, "PUT", f"/cas/{sha(b)}", b)[0] == 200
    big = os.urandom(3 * 1024 * 1024)
    path = f"/cas/{sha(big)}" if ns == "cas" else "/ccache/ab/big"
    status, text = req(conn(c), "PUT", path, big, chunked=chunked)
    assert status == (507 if chunked else 413), text
    settle(c, 1_000_000)
    h = conn(c)
    assert req(h, "GET", path)[0] == 404
    assert [req(h, "GET", f"/cas/{sha(b)}")[0] for b in small] == [200, 200, 200]  # nothing evicted for it
    assert sorted(blob_keys(c.store)) == sorted(f"cas/{sha(b)}" for b in small)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_max_entry_size_refuses_larger_entries_without_a_quota(tmp_path: Any, chunked: bool) -> None:
    c = start(tmp_path, None, max_entry_size=64 * 1024)
    h = conn(c)
    assert req(h, "PUT", "/ccache/ok", b"x" * (64 * 1024), chunked=chunked)[0] == 200
    assert req(conn(c), "PUT", "/ccache/big", b"y" * (64 * 1024 + 1), chunked=chunked)[0] == (507 if chunked else 413)
    h = conn(c)
    assert req(h, "GET", "/ccache/big")[0] == 404
    assert req(h, "GET", "/ccache/ok")[0] == 200


# ---- eviction ----
def test_one_entry_evicts_only_the_least_recently_used_it_needs(tmp_path: Any) -> None:
    """Nine 100 kB entries in a 1 MB quota, then one of 250 kB: the oldest go, down to the
    low-water mark, never the new one, never the whole store."""
    quota = 1_000_000
    c = start(tmp_path, quota)
    h = conn(c)
    old = [os.urandom(100_000) for _ in range(9)]
    for b in old:
        assert req(h, "PUT", f"/cas/{sha(b)}", b)[0] == 200
        time.sleep(0.02)
    new = os.urandom(250_000)
    assert req(h, "PUT", f"/cas/{sha(new)}", new)[0] == 200
    settle(c, quota)
    held = [req(h, "GET", f"/cas/{sha(b)}")[0] == 200 for b in old]
    assert req(h, "GET", f"/cas/{sha(new)}")[0] == 200
    assert held[-5:] == [True] * 5 and held[0] is False  # least recently used first
    assert sum(held) >= 5  # no more than needed to reach the low-water mark
    assert c.store.stats()["stored_bytes"] >= 0.6 * quota


def action_result(files: list[bytes]) -> bytes:
    """An ActionResult naming ``files`` as its outputs (test_httpcache's encoder)."""
    from test_httpcache import action_result as encode

    return encode(files)


def test_working_set_larger_than_the_quota_keeps_the_entries_that_fit_and_hits(tmp_path: Any) -> None:
    """Bazel building without the bytes asks only for ActionResults: 30 actions of 100 kB (3 MB,
    a 2 MB quota), then rounds that rebuild the 10 newest (1 MB) and add 5 new actions. The hot
    actions keep hitting on every round, and the store stays near its quota."""
    quota = 2_000_000
    c = start(tmp_path, quota)
    h = conn(c)
    actions = []

    def add_action() -> str:
        out = os.urandom(100_000)
        ac = sha(os.urandom(16))
        assert req(h, "PUT", f"/cas/{sha(out)}", out)[0] == 200
        assert req(h, "PUT", f"/ac/{ac}", action_result([out]))[0] == 200
        actions.append(ac)
        return ac

    for _ in range(30):
        add_action()
    settle(c, quota)
    hot = actions[-10:]
    for rnd in range(5):
        time.sleep(1.1)  # past the store's touch grace: each round is a new use
        hits = [req(h, "GET", f"/ac/{ac}")[0] for ac in hot]
        assert hits == [200] * len(hot), f"round {rnd}: {hits}"
        for _ in range(5):
            add_action()
        settle(c, quota)
        assert c.store.stats()["stored_bytes"] >= 0.6 * quota


# ---- the store: put and push past the quota ----
def test_store_put_larger_than_the_quota_is_refused_and_evicts_nothing(tmp_path: Any) -> None:
    with Store(tmp_path / "store", quota=1_000_000) as st:
        (tmp_path / "a").write_bytes(os.urandom(300_000))
        st.put("a", tmp_path / "a")
        (tmp_path / "big").mkdir()
        for k in range(3):
            (tmp_path / "big" / f"f{k}").write_bytes(os.urandom(1_000_000))
        with pytest.raises(EntryTooLargeError) as ei:
            st.put("big", tmp_path / "big")
        assert isinstance(ei.value, QuotaError)
        assert [r.name for r in st.refs()] == ["a"]
        st.gc()
        assert st.stats()["stored_bytes"] < 1_000_000


def test_store_put_judges_the_stored_bytes_not_the_logical_size(tmp_path: Any) -> None:
    """Five copies of one 400 kB file are 2 MB of files and 400 kB of chunks: they fit 1 MB."""
    with Store(tmp_path / "store", quota=1_000_000) as st:
        (tmp_path / "d").mkdir()
        data = os.urandom(400_000)
        for k in range(5):
            (tmp_path / "d" / f"copy{k}").write_bytes(data)
        assert st.put("d", tmp_path / "d").size == 2_000_000


def test_push_past_the_quota_is_refused_before_its_chunks_are_all_stored(tmp_path: Any) -> None:
    """The server side of ``store push``: chunks past what the quota could ever hold are refused
    as they arrive, before the rest is written."""
    import secrets

    from tb5sync.engine.hashing import chunk_digest
    from tb5sync.store.ops import StoreOps

    with Store(tmp_path / "store", quota=1_000_000) as st:
        ops = StoreOps(st)
        lease = secrets.token_hex(16)
        blobs = [os.urandom(400_000) for _ in range(4)]
        try:
            with pytest.raises(EntryTooLargeError):
                for b in blobs:
                    ops.put_chunks(lease, [[chunk_digest(b), b]])
        finally:
            ops.close()
        assert st.stats()["chunks"] <= 3


def test_a_late_eviction_never_takes_an_entry_newer_than_the_one_that_triggered_it(tmp_path: Any) -> None:
    """Eviction runs after the PUT that triggered it is answered, so later PUTs may land first.
    Whenever it runs, it evicts least recently used first and nothing written (or used) at or after
    the entry that triggered it: an acknowledged newer entry is never dropped while an older one
    stays. Here the eviction of ``big`` runs only after ``new`` is stored."""
    from tb5sync.store.blobs import blob, put_blob
    from tb5sync.store.gc import enforce_quota

    MiB = 1 << 20
    with Store(str(tmp_path / "st"), quota=4 * MiB) as st:
        for k in ("s0", "s1", "s2"):
            put_blob(st, f"k/{k}", os.urandom(MiB))
            time.sleep(0.02)
        put_blob(st, "k/big", os.urandom(4 * MiB - 100_000))
        time.sleep(0.02)
        put_blob(st, "k/new", os.urandom(MiB))
        enforce_quota(st, keep_blobs=["k/big"])  # big's eviction, late
        assert blob(st, "k/new", False) is not None  # acknowledged after big: never its victim
        assert all(blob(st, f"k/{k}", False) is None for k in ("s0", "s1", "s2"))
        enforce_quota(st, keep_blobs=["k/new"])  # new's own: the least recently used goes
        assert blob(st, "k/new", False) is not None and blob(st, "k/big", False) is None
        assert st.stats()["stored_bytes"] <= 4 * MiB
