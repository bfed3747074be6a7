"""Hostile peers at piece level: recipes a pushing client or a pulling client's server sends must
have the shape the store's piece parameters give (FastCDC: every piece but the last at least
``min_size`` bytes, every piece at most ``max_size``), and ``store reindex`` must not let file
data that looks like a recipe record hide the real record of the same chunk."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
from conftest import start_server

from tb5sync.engine.hashing import chunk_digest
from tb5sync.errors import Tb5syncError
from tb5sync.remote.storeclient import StoreSession, pull_ref
from tb5sync.store import Store
from tb5sync.store.pieces import PIECE_PARAMS_V1, SPLIT_MIN, recipe_record, recipe_to_blob, split
from tb5sync.wire.urls import parse_url

pytestmark = pytest.mark.timeout(120)

MiB = 1024 * 1024


def _url(live: Any) -> Any:
    r = parse_url(f"tb5://127.0.0.1:{live.port}")
    assert r is not None
    return r


def _one_byte_recipe(data: bytes) -> bytes:
    """A recipe of ``data`` (all zero bytes) as one-byte pieces: it rebuilds the chunk, but is 36 bytes
    of recipe per byte of chunk, and names pieces FastCDC v1 would never cut."""
    assert set(data) == {0}
    return (chunk_digest(b"\0") + (1).to_bytes(4, "little")) * len(data)


def test_a_pushed_recipe_of_tiny_pieces_is_refused_and_pulls_still_work(tmp_path: Any) -> None:
    zeros = bytes(SPLIT_MIN)
    d = chunk_digest(zeros)
    Store(tmp_path / "remote_store").close()
    live = start_server(str(tmp_path / "root"), store=str(tmp_path / "remote_store"))
    try:
        with StoreSession(_url(live), streams=1) as s:
            assert "pieces" in s.features
            lease = "ef" * 16
            with pytest.raises(Tb5syncError, match="malformed") as ei:
                s.call("put_recipes", {"lease": lease, "recipes": [[d, _one_byte_recipe(zeros)]],
                                       "pieces": [[chunk_digest(b"\0"), b"\0"]]})
            assert "\n" not in str(ei.value)
            s.call("flush", {"lease": lease})
        # an honest client's ref holding that chunk pulls back whole
        os.makedirs(tmp_path / "src")
        with open(tmp_path / "src" / "z", "wb") as f:
            f.write(zeros)
        from tb5sync.remote.storeclient import push_ref

        with Store(tmp_path / "a") as a:
            a.put("z", str(tmp_path / "src"))
            push_ref(a, "z", _url(live))
        with Store(tmp_path / "c") as c:
            pull_ref(c, "z", _url(live))
            assert c.cat("z", "z") == zeros and c.verify()["ok"]
    finally:
        live.server.stop()
    with Store(tmp_path / "remote_store") as r:
        rec = r.recipe(d)
        assert rec is None or all(n >= PIECE_PARAMS_V1.min_size for _, n in rec[:-1])
        assert r.verify()["ok"]


def test_a_pulling_client_refuses_a_servers_recipe_of_tiny_pieces(tmp_path: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import tb5sync.store.ops as ops_mod

    zeros = bytes(SPLIT_MIN)
    d = chunk_digest(zeros)
    os.makedirs(tmp_path / "src")
    with open(tmp_path / "src" / "z", "wb") as f:
        f.write(zeros)
    with Store(tmp_path / "remote_store") as r:
        r.put("z", str(tmp_path / "src"))
    real = ops_mod.StoreOps.recipes

    def hostile(self: Any, digests: list[bytes]) -> dict[str, Any]:
        out = real(self, digests)
        out["recipes"] = [_one_byte_recipe(zeros) if x == d else b for x, b in zip(digests, out["recipes"])]
        return out

    monkeypatch.setattr(ops_mod.StoreOps, "recipes", hostile)
    os.makedirs(tmp_path / "one")
    with open(tmp_path / "one" / "b", "wb") as f:
        f.write(b"\0")  # the client holds the one-byte piece: the recipe is worth using
    live = start_server(str(tmp_path / "root"), store=str(tmp_path / "remote_store"))
    try:
        with Store(tmp_path / "c") as c:
            c.put("one", str(tmp_path / "one"))
            try:
                pull_ref(c, "z", _url(live))
            except Tb5syncError as exc:  # refused as malformed: one line
                assert "\n" not in str(exc) and d.hex() in str(exc)
            else:
                assert c.cat("z", "z") == zeros
            rec = c.recipe(d)
            assert rec is None or all(n >= PIECE_PARAMS_V1.min_size for _, n in rec[:-1])
            assert c.verify()["ok"]
    finally:
        live.server.stop()


def test_reindex_tries_every_record_of_a_chunk(tmp_path: Any) -> None:
    # file data that is a well-formed record of chunk d naming pieces the store never held, in a
    # pack read before the one holding d's real record: d's recipe must still be rebuilt
    data = random.Random(5).randbytes(MiB)
    cut = split(data)
    d = chunk_digest(data)
    lying = [(chunk_digest(b"x" + bytes([i])), s, e) for i, (_, s, e) in enumerate(cut)]
    decoy, real = recipe_record(d, recipe_to_blob(lying)), recipe_record(d, recipe_to_blob(cut))
    for sub, name, body in (("a", "decoy", decoy), ("b", "real", data)):
        os.makedirs(tmp_path / sub)
        with open(tmp_path / sub / name, "wb") as f:
            f.write(body)
    st_dir = tmp_path / "st"
    with Store(st_dir) as st:
        st.put("decoy", str(tmp_path / "a"))
        st.put("real", str(tmp_path / "b"))
        packs = {bytes(dg): p for p, dg in st._q("SELECT pack, digest FROM chunks")}
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(f"{st_dir}/index.sqlite{suffix}"):
            os.unlink(f"{st_dir}/index.sqlite{suffix}")
    # the decoy's pack sorts first, the real record's last (reindex reads packs in name order)
    for p, new in ((packs[chunk_digest(decoy)], "0" * 32), (packs[chunk_digest(real)], "f" * 32)):
        os.makedirs(st_dir / "packs" / new[:2], exist_ok=True)
        os.rename(st_dir / "packs" / p[:2] / p, st_dir / "packs" / new[:2] / new)
    with Store(st_dir) as st:
        res = st.reindex()
        assert res["recipes_added"] == 1 and res["damaged"] == 0
        assert st.read_chunk(d) == data


def test_put_recipes_refuses_an_oversized_recipe_before_it_parses_it(tmp_path: Any) -> None:
    # a 40 MiB recipe blob (1.1 M one-byte pieces; a 32 MiB chunk has at most 8193 pieces) must
    # be refused on its length, not parsed into a million Python tuples first
    import tracemalloc

    from tb5sync.errors import UsageError
    from tb5sync.store.ops import StoreOps

    blob = (chunk_digest(b"\0") + (1).to_bytes(4, "little")) * (40 * MiB // 36)
    with Store(tmp_path / "s") as st:
        ops = StoreOps(st)
        tracemalloc.start()
        try:
            with pytest.raises(UsageError, match="malformed"):
                ops.put_recipes("ab" * 16, [[chunk_digest(b"x"), blob]], [])
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        ops.close()
    assert peak < 16 * MiB, f"{peak} bytes allocated to refuse a {len(blob)}-byte recipe"


def test_reindex_keeps_the_whole_frames_of_a_pack_whose_last_frame_is_truncated(tmp_path: Any) -> None:
    # reindex: "intact chunks missing from the index are added"; a pack cut short inside its last
    # frame (a truncated recipe record here) still holds every frame before it whole
    rnd = random.Random(7)
    files = {f"f{i}": rnd.randbytes(1000 + i) for i in range(3)}
    files["big"] = rnd.randbytes(MiB)  # its pieces and its recipe record
    os.makedirs(tmp_path / "s")
    for name, body in files.items():
        with open(tmp_path / "s" / name, "wb") as f:
            f.write(body)
    st_dir = tmp_path / "st"
    with Store(st_dir) as st:
        st.put("r", str(tmp_path / "s"))
        rows = st._q("SELECT pack, offset, length, digest FROM chunks")
    (pack,) = {p for p, _, _, _ in rows}
    last = max(rows, key=lambda r: r[1])
    path = st_dir / "packs" / pack[:2] / pack
    os.truncate(path, last[1] + last[2] - 10)  # the last frame loses its last 10 bytes
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(f"{st_dir}/index.sqlite{suffix}"):
            os.unlink(f"{st_dir}/index.sqlite{suffix}")
    with Store(st_dir) as st:
        res = st.reindex()
        assert res["chunks_added"] == len(rows) - 1
        for name in ("f0", "f1", "f2"):
            if chunk_digest(files[name]) != bytes(last[3]):
                assert st.read_chunk(chunk_digest(files[name])) == files[name]
