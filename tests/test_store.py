"""The artifact store (tb5sync.store): put/get/cat/ls/rm/diff/pin, dedup, verify, gc, quota, crashes, concurrency.

References: the sync engine's own chunking (``hashing.chunk_fd``) for what the store's chunks must
be; ``rsync -a`` for what a materialised tree looks like; Python slicing of the source file for
ranged reads.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from conftest import have_rsync, make_tree, slurp, snapshot

from tb5sync.cli.command import main
from tb5sync.errors import DestinationError, IntegrityError, RefExistsError, RefNotFoundError, UsageError
from tb5sync.engine.hashing import chunk_fd
from tb5sync.store import Store
from tb5sync.store.packs import PACK_MAGIC

MiB = 1024 * 1024
PY = sys.executable


def write(path: str, data: bytes) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return path


def pack_files(store: Store) -> list[str]:
    return [os.path.join(d, n) for d, _, ns in os.walk(os.path.join(store.path, "packs")) for n in ns]


# ---- sizes, chunks, ranges --------------------------------------------------------------------

SIZES = [0, 1, 63, 64, 4095, 256 * 1024 - 1, 256 * 1024, MiB + 1, 4 * MiB, 4 * MiB + 1, 9 * MiB + 7, 16 * MiB + 5 * MiB // 3]


def test_every_size_round_trips_with_the_engines_chunks(tmp_path: Any) -> None:
    rnd = random.Random(5)
    src = tmp_path / "src"
    for n in SIZES:
        write(str(src / f"f{n}"), rnd.randbytes(n))
    with Store(tmp_path / "st", pack_target=2 * MiB) as st:
        st.put("sizes/1", str(src))
        items = {it.path.decode(): it for it in st.manifest("sizes/1")}
        for n in SIZES:
            p = str(src / f"f{n}")
            with open(p, "rb") as f:
                assert items[f"f{n}"].chunks == chunk_fd(f.fileno(), n), n  # the sync engine's chunks
            assert st.cat("sizes/1", f"f{n}") == slurp(p)
        st.get("sizes/1", str(tmp_path / "out"))
        for n in SIZES:
            assert slurp(str(tmp_path / "out" / f"f{n}")) == slurp(str(src / f"f{n}"))
        # a single file as a ref, every size
        for n in SIZES:
            st.put(f"file/{n}", str(src / f"f{n}"))
            st.get(f"file/{n}", str(tmp_path / f"one{n}"))
            assert slurp(str(tmp_path / f"one{n}")) == slurp(str(src / f"f{n}"))
        assert st.verify()["ok"]


def test_ranged_cat_matches_slicing(tmp_path: Any) -> None:
    data = random.Random(7).randbytes(6 * MiB + 333)
    write(str(tmp_path / "m" / "model.bin"), data)
    with Store(tmp_path / "st") as st:
        st.put("models/m/1", str(tmp_path / "m"))
        rnd = random.Random(1)
        for _ in range(40):
            off = rnd.randrange(0, len(data) + 10)
            ln = rnd.choice([0, 1, 8, 4096, MiB, 3 * MiB, len(data)])
            assert st.cat("models/m/1", "model.bin", off, ln) == data[off : off + ln]
        assert st.cat("models/m/1", "/model.bin", len(data) - 5) == data[-5:]
        with pytest.raises(RefNotFoundError):
            st.cat("models/m/1", "nope")
        with pytest.raises(UsageError):
            st.cat("models/m/1", "model.bin", -1, 3)


def test_tree_metadata_like_rsync_a(tmp_path: Any) -> None:
    src = make_tree(str(tmp_path / "src"), files=20)
    os.makedirs(os.path.join(src, "ro"))
    write(os.path.join(src, "ro", "x"), b"x")
    os.chmod(os.path.join(src, "ro"), 0o555)
    odd = os.path.join(os.fsencode(src), b"caf\xe9-\xff.bin")  # not UTF-8
    with open(odd, "wb") as f:
        f.write(b"latin-1 name")
    try:
        with Store(tmp_path / "st") as st:
            st.put("t/1", src)
            st.get("t/1", str(tmp_path / "got"))
        got = snapshot(str(tmp_path / "got"))
        assert got == snapshot(src)  # rsync -a keeps permissions, times (ns), symlinks
        if have_rsync():  # and what rsync -a makes of the same tree, times left out (rsync's precision varies)
            subprocess.run(["rsync", "-a", src + "/", str(tmp_path / "ref") + "/"], check=True)

            def untimed(snap: dict[str, tuple[Any, ...]]) -> dict[str, tuple[Any, ...]]:
                return {k: tuple(x for i, x in enumerate(v) if not (isinstance(x, int) and x > 10**18)) for k, v in snap.items()}

            assert untimed(got) == untimed(snapshot(str(tmp_path / "ref")))
        assert os.path.exists(os.path.join(os.fsencode(str(tmp_path / "got")), b"caf\xe9-\xff.bin"))
    finally:
        for d in (src, str(tmp_path / "got"), str(tmp_path / "ref")):
            if os.path.isdir(os.path.join(d, "ro")):
                os.chmod(os.path.join(d, "ro"), 0o755)


def test_get_is_atomic_and_refuses_to_clobber(tmp_path: Any) -> None:
    write(str(tmp_path / "a" / "f"), b"one")
    write(str(tmp_path / "b" / "g"), b"two")
    with Store(tmp_path / "st") as st:
        st.put("r/a", str(tmp_path / "a"))
        st.put("r/b", str(tmp_path / "b"))
        dest = str(tmp_path / "dest")
        os.mkdir(dest)  # an empty directory may be the destination
        st.get("r/a", dest)
        with pytest.raises(DestinationError):
            st.get("r/b", dest)
        assert os.listdir(dest) == ["f"]
        st.get("r/b", dest, replace=True)
        assert os.listdir(dest) == ["g"]
        assert [n for n in os.listdir(tmp_path) if n.endswith(".tb5tmp")] == []


def test_identical_files_are_cloned_or_linked(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    data = os.urandom(300_000)
    for n in ("a", "b", "c"):
        write(str(tmp_path / "s" / n), data)
        os.utime(str(tmp_path / "s" / n), ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
    os.chmod(str(tmp_path / "s" / "c"), 0o600)
    with Store(tmp_path / "st") as st:
        st.put("dup/1", str(tmp_path / "s"))
        monkeypatch.setenv("TB5SYNC_NO_REFLINK", "1")  # the portable path: plain writes
        st.get("dup/1", str(tmp_path / "copy"))
        inos = {os.stat(tmp_path / "copy" / n).st_ino for n in "abc"}
        assert len(inos) == 3 and all(slurp(str(tmp_path / "copy" / n)) == data for n in "abc")
        st.get("dup/1", str(tmp_path / "linked"), hardlink=True)
        st_a, st_b, st_c = (os.stat(tmp_path / "linked" / n) for n in "abc")
        assert st_a.st_ino == st_b.st_ino  # same content, mode and mtime
        assert st_c.st_ino != st_a.st_ino and (st_c.st_mode & 0o777) == 0o600  # other mode: own file


# ---- refs -------------------------------------------------------------------------------------


def test_refs_ls_rm_pin_diff(tmp_path: Any) -> None:
    write(str(tmp_path / "v1" / "a"), b"a1")
    write(str(tmp_path / "v1" / "b"), b"b")
    write(str(tmp_path / "v2" / "a"), b"a2")
    write(str(tmp_path / "v2" / "c"), b"c")
    with Store(tmp_path / "st") as st:
        st.put("builds/main/3f2c1e", str(tmp_path / "v1"), description="first")
        st.put("builds/main/4a0b77", str(tmp_path / "v2"))
        with pytest.raises(RefExistsError):
            st.put("builds/main/4a0b77", str(tmp_path / "v1"))
        for bad in ("", "/x", "a//b", "a/../b", "a b", "a/./b"):
            with pytest.raises(UsageError):
                st.put(bad, str(tmp_path / "v1"))
        assert [r.name for r in st.refs("builds/")] == ["builds/main/3f2c1e", "builds/main/4a0b77"]
        assert st.ref("builds/main/3f2c1e").description == "first"
        assert st.ref("builds/main/3f2c1e").size == 3
        d = dict((p, k) for k, p in st.diff("builds/main/3f2c1e", "builds/main/4a0b77"))
        assert d["a"] == "M" and d["b"] == "-" and d["c"] == "+"
        st.pin("builds/main/3f2c1e")
        assert st.ref("builds/main/3f2c1e").pinned
        st.rm("builds/main/4a0b77")
        with pytest.raises(RefNotFoundError):
            st.rm("builds/main/4a0b77")
        with pytest.raises(RefNotFoundError):
            st.get("builds/main/4a0b77", str(tmp_path / "x"))


def test_dedup_one_percent_change(tmp_path: Any) -> None:
    rnd = random.Random(11)
    data = bytearray(rnd.randbytes(48 * MiB))
    write(str(tmp_path / "v1" / "w.bin"), bytes(data))
    for k in range(4):  # 1% of the bytes, in four places
        off = (k * 2 + 1) * len(data) // 9
        data[off : off + len(data) // 400] = rnd.randbytes(len(data) // 400)
    write(str(tmp_path / "v2" / "w.bin"), bytes(data))
    with Store(tmp_path / "st") as st:
        st.put("m/v1", str(tmp_path / "v1"))
        before = st.stats()
        st.put("m/v2", str(tmp_path / "v2"))
        after = st.stats()
    new = after["unique_bytes"] - before["unique_bytes"]
    # each changed region costs itself plus at most the chunks it touches (1 MiB average, 4 MiB max)
    assert new < 0.25 * len(data), new
    assert after["logical_bytes"] == 2 * len(data)
    assert after["dedup_ratio"] > 1.6


# ---- integrity ----------------------------------------------------------------------------------


def test_tampered_pack_byte_is_found_and_refused(tmp_path: Any) -> None:
    write(str(tmp_path / "s" / "f"), os.urandom(2 * MiB))
    write(str(tmp_path / "t" / "g"), os.urandom(1000))
    # format v1: the chunk is one frame (format v2's pieces: tests/test_store_pieces.py)
    with Store(tmp_path / "st", pack_target=MiB, version=1) as st:
        st.put("t/damaged", str(tmp_path / "s"))
        st.put("t/fine", str(tmp_path / "t"))
        it = st.item("t/damaged", "f")
        pack, offset, _ = st._q("SELECT pack, offset, length FROM chunks WHERE digest=?", (it.chunks[0][0],))[0]
        path = st.packs.path(pack)
        with open(path, "r+b") as f:
            f.seek(offset + 12345)
            b = f.read(1)
            f.seek(offset + 12345)
            f.write(bytes([b[0] ^ 1]))
    with Store(tmp_path / "st") as st:  # a fresh process view: no cached descriptor
        rep = st.verify()
        assert not rep["ok"]
        assert rep["refs"]["t/damaged"]["ok"] is False and rep["refs"]["t/damaged"]["damaged"] == 1
        assert rep["refs"]["t/fine"]["ok"] is True
        with pytest.raises(IntegrityError):
            st.cat("t/damaged", "f")
        with pytest.raises(IntegrityError):
            st.get("t/damaged", str(tmp_path / "out"))
        assert not os.path.exists(tmp_path / "out")
        assert [n for n in os.listdir(tmp_path) if n.endswith(".tb5tmp")] == []
        assert main(["store", "--store", str(tmp_path / "st"), "verify"]) == 13


def test_pack_format_is_self_describing(tmp_path: Any) -> None:
    from tb5sync.engine.hashing import chunk_digest
    from tb5sync.store.packs import iter_frames

    write(str(tmp_path / "s" / "f"), os.urandom(3 * MiB))
    with Store(tmp_path / "st") as st:
        st.put("p/1", str(tmp_path / "s"))
        index = {bytes(d): (p, o, n) for d, p, o, n in st._q("SELECT digest, pack, offset, length FROM chunks")}
        for path in pack_files(st):
            data = slurp(path)
            assert data.startswith(PACK_MAGIC)
            for digest, off, n in iter_frames(data):
                assert chunk_digest(data[off : off + n]) == digest
                assert index[digest] == (os.path.basename(path), off, n)


def test_reindex_rebuilds_the_chunk_index_from_the_packs(tmp_path: Any) -> None:
    src = make_tree(str(tmp_path / "src"), files=6)
    with Store(tmp_path / "st", pack_target=MiB) as st:
        st.put("r/1", src)
        rows = sorted(st._q("SELECT digest, pack, offset, length FROM chunks"))
        with st._tx() as db:  # the index loses its chunk rows (refs stay)
            db.execute("DELETE FROM chunks")
            db.execute("DELETE FROM packs")
        assert not st.verify()["refs"]["r/1"]["ok"]
        res = st.reindex()
        assert res["chunks_added"] == len(rows) and res["damaged"] == 0
        assert sorted(st._q("SELECT digest, pack, offset, length FROM chunks")) == rows
        assert st.verify()["ok"]
        st.get("r/1", str(tmp_path / "out"))
        assert snapshot(str(tmp_path / "out")) == snapshot(src)
        os.unlink(pack_files(st)[0])  # a pack lost: its rows go, the ref shows as damaged
        assert st.reindex()["rows_dropped"] > 0
        assert not st.verify()["refs"]["r/1"]["ok"]


# ---- gc and quota -------------------------------------------------------------------------------


def test_gc_sweeps_and_repacks_only_the_unreferenced(tmp_path: Any) -> None:
    rnd = random.Random(3)
    for i in range(4):
        write(str(tmp_path / f"v{i}" / "f"), rnd.randbytes(MiB + i))
        write(str(tmp_path / f"v{i}" / "shared"), b"s" * 300_000)
    with Store(tmp_path / "st", pack_target=4 * MiB) as st:
        for i in range(4):
            st.put(f"g/{i}", str(tmp_path / f"v{i}"))
        st.rm("g/1")
        st.rm("g/2")
        res = st.gc(repack_below=1.0)
        assert res["chunks_deleted"] >= 2 and res["bytes_freed"] > 0
        rep = st.verify()
        assert rep["ok"] and set(rep["refs"]) == {"g/0", "g/3"}
        s = st.stats()
        assert s["stored_bytes"] < 3 * MiB  # two 1 MiB files, the shared file once, frames
        for i in (0, 3):
            st.get(f"g/{i}", str(tmp_path / f"out{i}"))
            assert slurp(str(tmp_path / f"out{i}" / "f")) == slurp(str(tmp_path / f"v{i}" / "f"))
        st.rm("g/0")
        st.rm("g/3")
        st.gc()
        assert st.stats()["stored_bytes"] == 0 and pack_files(st) == []


def test_gc_keeps_a_ref_committed_between_its_mark_and_its_sweep(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The window restic's prune closes with an exclusive lock: a put finishing while gc marks."""
    write(str(tmp_path / "old" / "f"), os.urandom(MiB))
    write(str(tmp_path / "new" / "g"), os.urandom(2 * MiB))
    st = Store(tmp_path / "st", pack_target=MiB)
    other = Store(tmp_path / "st", pack_target=MiB)  # another writer on the same store
    try:
        st.put("old", str(tmp_path / "old"))
        real_q = st._q
        done = []

        def q(sql: str, args: Any = ()) -> Any:
            rows = real_q(sql, args)
            if sql.startswith("SELECT manifest, mchunks FROM refs") and not done:
                done.append(other.put("new", str(tmp_path / "new")))  # committed after the mark read the refs
            return rows

        monkeypatch.setattr(st, "_q", q)
        st.gc(repack_below=1.0)
        monkeypatch.undo()
        assert done and st.verify()["ok"]
        assert st.cat("new", "g") == slurp(str(tmp_path / "new" / "g"))
    finally:
        st.close()
        other.close()


def test_quota_names_what_it_evicts(tmp_path: Any) -> None:
    """``store quota SIZE`` (and a put over the quota) names each ref it evicts, on stderr, one line;
    it said only the new quota while refs vanished."""
    rnd = random.Random(10)
    for i in range(2):
        write(str(tmp_path / f"v{i}" / "f"), rnd.randbytes(3 * MiB))
    st = ["--store", str(tmp_path / "st")]

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tb5sync.cli", "store", *st, *args], capture_output=True, text=True,
                              timeout=60)

    assert cli("put", "r/a", str(tmp_path / "v0")).returncode == 0
    time.sleep(0.15)
    assert cli("put", "r/b", str(tmp_path / "v1")).returncode == 0
    p = cli("quota", "4M")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "4.0 MiB"  # what scripts read stays as it was
    lines = [ln for ln in p.stderr.splitlines() if "evicted" in ln]
    assert len(lines) == 1 and "ref r/a" in lines[0] and "r/b" not in lines[0], p.stderr
    assert [ln.split()[-1] for ln in cli("ls").stdout.splitlines()] == ["r/b"]


def test_quota_evicts_lru_and_never_pinned(tmp_path: Any) -> None:
    rnd = random.Random(9)
    for i in range(5):
        write(str(tmp_path / f"v{i}" / "f"), rnd.randbytes(2 * MiB))
    with Store(tmp_path / "st", pack_target=MiB) as st:
        st.put("q/0", str(tmp_path / "v0"))
        st.pin("q/0")
        st.put("q/1", str(tmp_path / "v1"))
        st.put("q/2", str(tmp_path / "v2"))
        time.sleep(0.15)  # uses closer than 0.1 s to the last one are not recorded
        st.cat("q/1", "f", 0, 10)  # q/1 used after q/2: q/2 is now the least recently used unpinned ref
        st.set_quota(7 * MiB)
        st.put("q/3", str(tmp_path / "v3"))
        names = {r.name for r in st.refs()}
        assert names == {"q/0", "q/1", "q/3"}
        st.put("q/4", str(tmp_path / "v4"))
        names = {r.name for r in st.refs()}
        assert "q/0" in names and "q/4" in names and len(names) == 3
        assert st.stats()["stored_bytes"] <= 7 * MiB
        assert st.verify()["ok"]
        st.set_quota(MiB)  # below what the pinned ref alone needs: the pinned ref stays whole
        st.enforce_quota()
        assert {r.name for r in st.refs()} == {"q/0"}
        assert st.verify()["ok"]
        assert st.cat("q/0", "f") == slurp(str(tmp_path / "v0" / "f"))


# ---- crashes --------------------------------------------------------------------------------------

# each round puts new data (three fresh 700 KB files: several 1 MiB packs to write)
_ROUND = """
import os, sys
from tb5sync.store import Store
st = Store(sys.argv[1], pack_target=1 << 20)
work = os.path.join(sys.argv[2], str(os.getpid()))
os.makedirs(work, exist_ok=True)
i = 0
while True:
    for k in range(3):
        with open(os.path.join(work, f"f{k}"), "wb") as f:
            f.write(os.urandom(700_000))
    name = f"crash/{os.getpid()}/{i}"
    st.put(name, work)
    if MODE == "gc":  # garbage for the collector, then collect it (sweep and repack)
        st.rm(name)
        st.gc(repack_below=1.0)
    print(i, flush=True)
    i += 1
"""
_PUT_LOOP = "MODE = 'put'" + _ROUND
_GC_LOOP = "MODE = 'gc'" + _ROUND


def _kill_after(args: list[str], delay: float) -> int:
    """Run ``python -c args`` until it has printed a first line, ``delay`` s more, SIGKILL; returns lines printed."""
    p = subprocess.Popen([PY, "-c", *args], stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None
        p.stdout.readline()  # the first round is done: we are past the start-up
        time.sleep(delay)
    finally:
        p.send_signal(signal.SIGKILL)
        out, _ = p.communicate(timeout=30)
    assert p.returncode == -signal.SIGKILL  # killed, not ended by an error of its own
    return 1 + len(out.splitlines())


def test_sigkill_during_put_and_gc_leaves_every_ref_whole(tmp_path: Any) -> None:
    rnd = random.Random(2)
    src = tmp_path / "src"
    for i in range(6):
        write(str(src / f"f{i}"), rnd.randbytes(700_000 + i))
    store = str(tmp_path / "st")
    with Store(store, pack_target=MiB) as st:
        st.put("keep/1", str(src))
    for delay in (0.05, 0.13, 0.21, 0.37):
        assert _kill_after([_PUT_LOOP, store, str(tmp_path / "work")], delay) >= 1
    with Store(store) as st:
        st.rm("keep/1")  # garbage for the collector, and refs of the killed puts stay
        st.put("keep/2", str(src))
    for delay in (0.05, 0.13, 0.21, 0.37):
        assert _kill_after([_GC_LOOP, store, str(tmp_path / "work")], delay) >= 1
        with Store(store) as st:
            rep = st.verify()
            assert rep["ok"], rep
            st.put(f"after/{delay}", str(src))
    with Store(store) as st:
        st.gc()
        rep = st.verify()
        assert rep["ok"] and rep["refs"], rep
        assert sum(1 for n in rep["refs"] if n.startswith("crash/")) >= 4
        for name in rep["refs"]:
            st.get(name, str(tmp_path / "out" / name))  # every chunk read back and checked
        for name in [n for n in rep["refs"] if n.startswith(("keep/", "after/"))]:
            for i in range(6):
                assert slurp(str(tmp_path / "out" / name / f"f{i}")) == slurp(str(src / f"f{i}"))
        assert os.listdir(os.path.join(store, "tmp")) == [] or all(
            n.startswith("config.") for n in os.listdir(os.path.join(store, "tmp")))
        indexed = {p for (p,) in st._q("SELECT id FROM packs")}
        assert {os.path.basename(p) for p in pack_files(st)} == indexed  # no orphan left after gc


# ---- concurrency ----------------------------------------------------------------------------------

_WORKER = """
import os, sys, random
from tb5sync.store import Store
store, src, role, n, work = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
st = Store(store, pack_target=1 << 20)
if role == "put":  # new data every round (packs written while gc runs); odd rounds become garbage
    for i in range(6):
        d = os.path.join(work, f"w{n}", str(i))
        os.makedirs(d)
        for k in range(3):
            with open(os.path.join(d, f"f{k}"), "wb") as f:
                f.write(os.urandom(300_000 + k))
        with open(os.path.join(d, "shared"), "wb") as f:  # a chunk every round shares with base
            f.write(open(os.path.join(src, "f0"), "rb").read())
        st.put(f"w{n}/{i}", d)
        if i % 2:
            st.rm(f"w{n}/{i}")
elif role == "gc":
    for _ in range(10):
        st.gc(repack_below=1.0)
elif role == "get":
    for i in range(8):
        out = os.path.join(work, "gets", f"{n}-{i}")
        st.get("base", out)
        for name in os.listdir(src):
            with open(os.path.join(src, name), "rb") as a, open(os.path.join(out, name), "rb") as b:
                assert a.read() == b.read(), name
"""


def test_concurrent_put_gc_get_processes(tmp_path: Any) -> None:
    rnd = random.Random(4)
    src = tmp_path / "src"
    for i in range(5):
        write(str(src / f"f{i}"), rnd.randbytes(400_000 + 1000 * i))
    store = str(tmp_path / "st")
    with Store(store, pack_target=MiB) as st:
        st.put("base", str(src))
        st.put("garbage", str(tmp_path / "src" / "f1"))
        st.rm("garbage")
    work = tmp_path / "work"
    os.makedirs(work / "gets")
    procs = [subprocess.Popen([PY, "-c", _WORKER, store, str(src), role, str(n), str(work)])
             for role, n in (("put", 1), ("put", 2), ("gc", 3), ("get", 4), ("gc", 5))]
    try:
        for p in procs:
            assert p.wait(timeout=100) == 0
    finally:  # a hung worker must not outlive the test
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    with Store(store) as st:
        rep = st.verify()
        assert rep["ok"], rep
        kept = {f"w{n}/{i}" for n in (1, 2) for i in (0, 2, 4)}
        assert {r.name for r in st.refs()} == {"base"} | kept
        st.gc()
        assert st.verify()["ok"]
        for name in sorted(kept):
            st.get(name, str(tmp_path / "out" / name))
            assert snapshot(str(tmp_path / "out" / name)) == snapshot(str(work / name))


def test_threads_share_one_store(tmp_path: Any) -> None:
    """Threads putting, getting and collecting through one Store object (and a second one on the same directory)."""
    import threading

    rnd = random.Random(6)
    srcs = []
    for t in range(4):
        d = tmp_path / f"s{t}"
        write(str(d / "own"), rnd.randbytes(500_000))
        write(str(d / "shared"), b"z" * 300_000)
        srcs.append(d)
    errors: list[BaseException] = []
    st = Store(tmp_path / "st", pack_target=MiB)
    other = Store(tmp_path / "st", pack_target=MiB)

    def work(t: int) -> None:
        try:
            for i in range(4):
                s = st if (t + i) % 2 else other
                s.put(f"t{t}/{i}", str(srcs[t]))
                s.get(f"t{t}/{i}", str(tmp_path / "out" / f"t{t}-{i}"))
                assert slurp(str(tmp_path / "out" / f"t{t}-{i}" / "own")) == slurp(str(srcs[t] / "own"))
                if i % 2:
                    s.rm(f"t{t}/{i}")
                if t == 0:
                    s.gc(repack_below=1.0)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=90)
    try:
        assert not errors, errors
        assert {r.name for r in st.refs()} == {f"t{t}/{i}" for t in range(4) for i in (0, 2)}
        st.gc()
        assert st.verify()["ok"]
    finally:
        st.close()
        other.close()


# ---- CLI --------------------------------------------------------------------------------------------


def test_cli_stats_prints_one_line_per_figure(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """``store stats`` is several lines of the store's own text: each printed as a line, not one
    line with its newlines escaped for the terminal (only peer text is escaped)."""
    write(str(tmp_path / "s" / "f"), b"hello world")
    st = str(tmp_path / "st")
    assert main(["store", "--store", st, "put", "a/1", str(tmp_path / "s")]) == 0
    capsys.readouterr()
    assert main(["store", "--store", st, "stats"]) == 0
    out = capsys.readouterr().out
    assert "\\#012" not in out
    lines = out.splitlines()
    assert lines[0] == "refs: 1 (1 files)" and any(line.startswith("dedup ratio: ") for line in lines)


def test_cli_put_ls_stats_json(tmp_path: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    write(str(tmp_path / "s" / "f"), b"hello world")
    monkeypatch.setenv("TB5SYNC_STORE", str(tmp_path / "envstore"))
    assert main(["store", "put", "cli/1", str(tmp_path / "s"), "-m", "desc", "--json"]) == 0
    put = json.loads(capsys.readouterr().out)
    assert put["name"] == "cli/1" and put["size"] == 11 and put["description"] == "desc"
    assert main(["store", "ls", "--json"]) == 0
    assert [r["name"] for r in json.loads(capsys.readouterr().out)] == ["cli/1"]
    assert main(["store", "stats", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["refs"] == 1 and s["logical_bytes"] == 11
    assert main(["store", "put", "cli/1", str(tmp_path / "s")]) == 0  # the same content: nothing to do
    assert capsys.readouterr().out == "cli/1: same content already; nothing to do\n"
    write(str(tmp_path / "s" / "f"), b"other")
    assert main(["store", "put", "cli/1", str(tmp_path / "s")]) == RefExistsError.exit_code
    assert main(["store", "rm", "cli/nope"]) == RefNotFoundError.exit_code
    assert main(["store", "--store", str(tmp_path / "other"), "ls"]) == 0
    assert capsys.readouterr().out == ""
    assert os.path.isdir(tmp_path / "envstore" / "packs")


# ---- the corpus: a real model file ----------------------------------------------------------------


@pytest.mark.slow
def test_corpus_model_second_version_stores_about_the_change(tmp_path: Any) -> None:
    """A second version of the corpus's largest model file with 1% of its bytes rewritten (one
    contiguous region, as a fine-tuned tensor would be) adds about 1% new bytes: the changed
    region plus the chunks it straddles (FastCDC resynchronises within one chunk, 4 MiB at most)."""
    corpus = os.environ.get("TB5SYNC_CORPUS")
    if not corpus or not os.path.isdir(os.path.join(corpus, "models")):
        pytest.skip("TB5SYNC_CORPUS with models/ not set (make corpus)")
    models = os.path.join(corpus, "models")
    files = [os.path.join(d, n) for d, _, ns in os.walk(models) for n in ns]
    big = max(files, key=os.path.getsize)
    size = os.path.getsize(big)
    v2 = tmp_path / "v2"
    for f in files:  # the same tree, hard-linked, except the model file: copied and edited
        dst = v2 / os.path.relpath(f, models)
        os.makedirs(dst.parent, exist_ok=True)
        if f == big:
            data = bytearray(slurp(f))
            off, n = size // 2, size // 100
            data[off : off + n] = random.Random(1).randbytes(n)
            dst.write_bytes(bytes(data))
            del data
        else:
            os.link(f, dst)
    with Store(tmp_path / "st") as st:
        st.put("models/all/v1", models)
        before = st.stats()
        st.put("models/all/v2", str(v2))
        after = st.stats()
        new = after["unique_bytes"] - before["unique_bytes"]
        assert size // 100 <= new <= size // 100 + 2 * 4 * MiB, (new, size)
        assert after["logical_bytes"] == 2 * before["logical_bytes"]
        assert after["dedup_ratio"] >= 1.9
        rel = os.path.relpath(big, models)
        assert st.cat("models/all/v2", rel, size // 2 - 10, 20) == slurp(str(v2 / rel))[size // 2 - 10 : size // 2 + 10]
        print(f"\n{rel}: {size} bytes, 1% rewritten: {new} new bytes ({100 * new / size:.2f}%), "
              f"dedup ratio {after['dedup_ratio']}")


def test_put_exclude_like_rsync(tmp_path: Any) -> None:
    src = make_tree(str(tmp_path / "src"), files=10)
    excl = ["d1/", "*.bin", "/rel_link"]
    with Store(tmp_path / "st") as st:
        st.put("x/1", src, exclude=excl)
        st.get("x/1", str(tmp_path / "got"))
    if not have_rsync():
        pytest.skip("rsync is not installed")
    subprocess.run(["rsync", "-a", *[f"--exclude={e}" for e in excl], src + "/", str(tmp_path / "ref") + "/"], check=True)
    got, ref = snapshot(str(tmp_path / "got")), snapshot(str(tmp_path / "ref"))
    assert sorted(got) == sorted(ref)
    assert {k: v[:2] for k, v in got.items()} == {k: v[:2] for k, v in ref.items()}


def test_packs_on_an_fsspec_filesystem(tmp_path: Any) -> None:
    """The pack storage interface is all the store needs: the same operations with packs in fsspec's memory filesystem."""
    import fsspec

    from tb5sync.store import FsspecPackStorage

    mem = fsspec.filesystem("memory", skip_instance_cache=True)
    root = f"/tb5-{os.getpid()}-{random.randrange(1 << 30)}/packs"
    src = make_tree(str(tmp_path / "src"), files=8)
    try:
        with Store(tmp_path / "st", pack_target=MiB, packs=FsspecPackStorage(mem, root)) as st:
            st.put("o/1", src)
            write(str(tmp_path / "two" / "x"), os.urandom(2 * MiB))
            st.put("o/2", str(tmp_path / "two"))
            assert not os.listdir(tmp_path / "st" / "packs") if os.path.isdir(tmp_path / "st" / "packs") else True
            assert len(mem.find(root)) == st.stats()["packs"] > 0
            st.get("o/1", str(tmp_path / "out"))
            assert snapshot(str(tmp_path / "out")) == snapshot(src)
            assert st.cat("o/2", "x", 5, 10) == slurp(str(tmp_path / "two" / "x"))[5:15]
            st.rm("o/2")
            st.gc(repack_below=1.0)
            assert st.verify()["ok"] and len(mem.find(root)) == st.stats()["packs"]
    finally:
        if mem.exists(root.rsplit("/", 1)[0]):
            mem.rm(root.rsplit("/", 1)[0], recursive=True)


def test_cat_without_a_path_and_get_onto_an_existing_path(tmp_path: Any, capsys: Any) -> None:
    # `store cat REF` reads the file of a single-file ref; of a directory ref it says to give a path;
    # `store get` onto an existing path names the CLI flag, not the Python keyword
    f = tmp_path / "one.bin"
    f.write_bytes(os.urandom(5000))
    d = make_tree(str(tmp_path / "tree"), files=5)
    st = ["store", "--store", str(tmp_path / "st")]
    assert main([*st, "put", "file", str(f)]) == 0
    assert main([*st, "put", "dir", d]) == 0
    capsys.readouterr()
    with Store(str(tmp_path / "st")) as s:
        assert s.cat("file") == f.read_bytes()
        with pytest.raises(UsageError, match="root of ref 'dir' is a directory, not a file: give a file's path"):
            s.cat("dir")
        with pytest.raises(UsageError, match="path 'd0' of ref 'dir' is a directory"):
            s.cat("dir", "d0")
        with pytest.raises(DestinationError) as ei:
            s.get("file", str(f))
        assert "--force" in str(ei.value) and "replace=" not in str(ei.value)
    r = subprocess.run([sys.executable, "-m", "tb5sync.cli", *st, "cat", "file"], capture_output=True, timeout=60)
    assert r.returncode == 0 and r.stdout == f.read_bytes()


def test_gc_reports_the_live_leases_that_kept_chunks(tmp_path: Any, capsys: Any) -> None:
    # a writer's lease keeps chunks no ref reaches yet; gc says which lease (owner, since, expiry) kept how many
    src = make_tree(str(tmp_path / "src"), files=5)
    with Store(str(tmp_path / "st")) as st:
        st.put("a", src)
        digests = [bytes(d) for (d,) in st._q("SELECT digest FROM chunks")]
        lease = st.lease()
        assert all(lease.protect(digests))
        st.rm("a")
        res = st.gc()
        [b] = res["blocked_by"]
        assert b["lease"] == lease.id and b["owner"] == f"{st.host}:{os.getpid()}" and b["chunks"] == len(digests)
        assert b["since"] <= time.time() < b["expires"]
        assert res["chunks_deleted"] == 0
        assert main(["store", "--store", str(tmp_path / "st"), "gc"]) == 0
        err = capsys.readouterr().err
        assert f"writer lease {lease.id} held by {st.host}:{os.getpid()} since" in err and f"kept {len(digests)} chunks" in err
        lease.release()
        res = st.gc()
        assert res["blocked_by"] == [] and res["chunks_deleted"] == len(digests)


# ---- put: windows read ahead, packs finished behind ------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fmt", [1, 2])
def test_put_across_many_read_windows_and_packs_keeps_the_engines_chunks(tmp_path: Any, monkeypatch: Any, fmt: int) -> None:
    import tb5sync.store.store as store_mod

    monkeypatch.setattr(store_mod, "READ_WINDOW", 2 * MiB)  # a 9 MiB file: five windows, read ahead
    data = random.Random(41).randbytes(9 * MiB + 12345)
    p = write(str(tmp_path / "src" / "w.bin"), data)
    with Store(tmp_path / "st", pack_target=MiB, version=fmt) as st:  # packs fill (and finish behind) mid-put
        st.put("w/1", p)
        with open(p, "rb") as f:
            assert st.manifest("w/1")[0].chunks == chunk_fd(f.fileno(), len(data))  # the sync engine's chunks
        assert len(pack_files(st)) > 4
        st.get("w/1", str(tmp_path / "out"))
        assert slurp(str(tmp_path / "out")) == data
        assert st.verify()["ok"]


@pytest.mark.timeout(60)
def test_an_error_finishing_a_pack_behind_fails_the_put_and_names_no_ref(tmp_path: Any) -> None:
    data = random.Random(42).randbytes(6 * MiB)
    p = write(str(tmp_path / "src" / "e.bin"), data)
    with Store(tmp_path / "st", pack_target=MiB) as st:
        real = st.packs.put_file
        calls = []

        def failing(pack: str, tmp: str) -> int:
            calls.append(pack)
            if len(calls) == 2:
                raise OSError(28, "No space left on device")
            return real(pack, tmp)

        st.packs.put_file = failing  # type: ignore[method-assign]
        with pytest.raises(OSError):
            st.put("e/1", p)
        assert [r.name for r in st.refs()] == []
        st.packs.put_file = real  # type: ignore[method-assign]
        st.put("e/1", p)  # the store is still usable
        st.get("e/1", str(tmp_path / "out"))
        assert slurp(str(tmp_path / "out")) == data
        assert st.verify()["ok"]


# ---- verify's memory ------------------------------------------------------------------------


def _verify_peak(tmp_path: Any, name: str, mib: int) -> tuple[int, dict[str, Any]]:
    import tracemalloc

    data = random.Random(mib).randbytes(mib * MiB)
    with Store(tmp_path / name, pack_target=MiB, version=2) as st:  # format v2: ~64 piece frames per MiB
        st.put("r/1", write(str(tmp_path / f"{name}-src" / "f"), data))  # one ref, one file: a manifest of one item
        tracemalloc.start()
        try:
            rep = st.verify()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    return peak, rep


@pytest.mark.timeout(120)
def test_verify_peak_memory_does_not_grow_with_the_number_of_frames(tmp_path: Any) -> None:
    small, rep1 = _verify_peak(tmp_path, "s", 8)
    big, rep4 = _verify_peak(tmp_path, "b", 32)  # 4x the frames, the same refs and manifests but for 24 chunks
    assert rep1["ok"] and rep4["ok"]
    assert rep4["frames"] >= 3 * rep1["frames"] and rep4["frames"] > 1500
    # keeping each frame's location (a few hundred bytes a frame) would add ~0.5 MiB for the ~1500 frames more
    assert big - small < 128 * 1024, (small, big)
