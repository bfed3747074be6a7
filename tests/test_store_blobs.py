"""Keyed blobs in the artifact store (the HTTP build cache's entries): round trips, dedup, gc, quota LRU."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from tb5sync.errors import UsageError
from tb5sync.engine.hashing import chunk_digest
from tb5sync.store import Store
from tb5sync.store.blobs import blob_keys, check_blob_key, has_blobs, read_blob


def test_blob_round_trips_every_size_and_replaces(tmp_path: Any) -> None:
    with Store(tmp_path / "st") as st:
        for n in (0, 1, 4096, 300_000, 5 * 1024 * 1024 + 7):
            data = os.urandom(n)
            st.put_blob(f"k/{n}", data)
            info = st.blob(f"k/{n}")
            assert info is not None and info.size == n
            assert b"".join(read_blob(st, info)) == data
        src = tmp_path / "big"
        big = os.urandom(20 * 1024 * 1024 + 3)  # beyond one read window of put
        src.write_bytes(big)
        st.put_blob("big", str(src))
        assert b"".join(read_blob(st, st.blob("big"))) == big
        st.put_blob("k/1", b"new value")
        assert b"".join(read_blob(st, st.blob("k/1"))) == b"new value"
        assert st.blob("absent") is None
        assert has_blobs(st, ["k/0", "absent", "big"]) == {"k/0", "big"}
        assert blob_keys(st, "k/") == sorted(f"k/{n}" for n in (0, 1, 4096, 300_000, 5 * 1024 * 1024 + 7))
        assert st.delete_blob("k/0") and not st.delete_blob("k/0")
        assert st.stats()["blobs"] == 5


@pytest.mark.parametrize("key", ["", "a//b", "../x", "a/./b", "a\x00b", "x" * 1025])
def test_bad_keys_are_refused(tmp_path: Any, key: str) -> None:
    with Store(tmp_path / "st") as st, pytest.raises(UsageError):
        st.put_blob(key, b"x")


def test_blobs_dedup_with_each_other_and_refs(tmp_path: Any) -> None:
    data = os.urandom(3 * 1024 * 1024)
    (tmp_path / "f").write_bytes(data)
    with Store(tmp_path / "st") as st:
        st.put("tree", tmp_path / "f")
        before = st.stats()["unique_bytes"]
        st.put_blob("a", data)
        st.put_blob("b", data)
        assert st.stats()["unique_bytes"] == before  # the same chunks as the ref's file


def test_gc_keeps_blob_chunks_and_sweeps_deleted_ones(tmp_path: Any) -> None:
    a, b = os.urandom(200_000), os.urandom(200_000)  # below the 256 KiB minimum chunk: one chunk each
    with Store(tmp_path / "st") as st:
        st.put_blob("a", a)
        st.put_blob("b", b)
        st.gc(repack_below=1.0)
        assert b"".join(read_blob(st, st.blob("a"))) == a
        assert b"".join(read_blob(st, st.blob("b"))) == b
        st.delete_blob("a")
        res = st.gc(repack_below=1.0)
        assert res["chunks_deleted"] == 1
        assert not st.has(chunk_digest(a)) and st.has(chunk_digest(b))
        assert b"".join(read_blob(st, st.blob("b"))) == b


def test_quota_evicts_least_recently_used_blobs(tmp_path: Any) -> None:
    with Store(tmp_path / "st") as st:
        st.put_blob("old", os.urandom(400_000))
        st.put_blob("mid", os.urandom(400_000))
        time.sleep(0.01)
        st.put_blob("new", os.urandom(400_000))
        time.sleep(1.05)
        st.blob("old")  # used: now the most recent
        st.set_quota(900_000)  # room for two
        evicted = st.enforce_quota()
        assert evicted == ["blob:mid"]
        assert st.blob("mid") is None and st.blob("old") is not None and st.blob("new") is not None
        assert st.stats()["stored_bytes"] <= 900_000
        for k in ("old", "new"):
            assert len(b"".join(read_blob(st, st.blob(k)))) == 400_000


def test_put_blobs_group_commit_writes_one_pack(tmp_path: Any) -> None:
    from tb5sync.store.blobs import put_blobs

    items = [(f"g/{k}", os.urandom(4096)) for k in range(50)] + [("g/0", b"last wins")]
    with Store(tmp_path / "st") as st:
        infos = put_blobs(st, items)
        assert len(infos) == 51
        assert st.stats()["packs"] == 1 and st.stats()["blobs"] == 50
        assert b"".join(read_blob(st, st.blob("g/0"))) == b"last wins"
        assert b"".join(read_blob(st, st.blob("g/7"))) == items[7][1]
        with pytest.raises(UsageError):
            put_blobs(st, [("ok", b"1"), ("../bad", b"2")])
        assert st.blob("ok") is None


@pytest.mark.timeout(30)
@pytest.mark.parametrize("code", [*range(32), 0x7F])
def test_key_with_a_c0_control_character_or_del_is_refused(code: int) -> None:
    # C0 controls (U+0000..U+001F) and DEL (U+007F) are the control characters of ASCII (RFC 20)
    with pytest.raises(UsageError, match="control character"):
        check_blob_key(f"ns/a{chr(code)}b")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("key", ["ns/a b", "ns/~!", "ns/\u0080x", "ns/é", "ns/\u2028"])
def test_key_with_printable_or_non_ascii_characters_is_kept(key: str) -> None:
    assert check_blob_key(key) == key
