"""Store refs between nodes: push/pull through a server's store session (tb5sync.remote.storeclient, store.ops).

Servers run on 127.0.0.1 port 0 and stop in teardown. Expected values: the bytes of the source
trees, and the chunk counts a node can be known to lack (computed from the manifests).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from conftest import make_tree, slurp, snapshot, start_server

from tb5sync.errors import AuthError, IntegrityError, ReadOnlyError, RefExistsError, RefNotFoundError, UsageError
from tb5sync.engine.hashing import chunk_digest
from tb5sync.store import Store
from tb5sync.store.ops import StoreOps
from tb5sync.remote.storeclient import pull_ref, push_ref, remote_refs
from tb5sync.wire.urls import parse_url

MiB = 1024 * 1024


def url(live: Any) -> Any:
    r = parse_url(f"tb5://127.0.0.1:{live.port}")
    assert r is not None
    return r


def test_push_then_pull_sends_only_missing_chunks(tmp_path: Any, node: Any) -> None:
    src = make_tree(str(tmp_path / "v1"), files=15)
    with Store(tmp_path / "a") as a:
        a.put("builds/main/1", src, description="v1")
        total = len({d for it in a.manifest("builds/main/1") for d, _ in it.chunks} | {d for d, _ in a.ref("builds/main/1").mchunks})
        res = push_ref(a, "builds/main/1", url(node), streams=3)
        assert res["chunks"] == total and res["chunks_sent"] == total
        again = push_ref(a, "builds/main/1", url(node), as_name="builds/main/1-copy")
        assert again["chunks_sent"] == 0 and again["bytes_sent"] == 0 and not again["unchanged"]
        same = push_ref(a, "builds/main/1", url(node))  # the server has this very ref: a no-op success
        assert same["unchanged"] and same["chunks_sent"] == 0 and same["chunks"] == total
        a.put("other", make_tree(str(tmp_path / "other"), seed=5, files=5))
        with pytest.raises(RefExistsError, match="other content"):  # same name, other snapshot: refused
            push_ref(a, "other", url(node), as_name="builds/main/1")
        # a second version: 1 MiB of the big file changed
        big = os.path.join(src, "big.bin")
        with open(big, "r+b") as f:
            f.seek(4 * MiB)
            f.write(os.urandom(MiB))
        a.put("builds/main/2", src)
        old = {d for it in a.manifest("builds/main/1") for d, _ in it.chunks}
        new_chunks = {d for it in a.manifest("builds/main/2") for d, _ in it.chunks} - old
        res2 = push_ref(a, "builds/main/2", url(node), streams=4)
        assert res2["chunks_sent"] == len(new_chunks) + 1  # the new chunks and the new manifest
    assert [r.name for r in remote_refs(url(node), "builds/")] == ["builds/main/1", "builds/main/1-copy", "builds/main/2"]
    with Store(tmp_path / "c") as c:
        got = pull_ref(c, "builds/main/1", url(node), streams=4)
        # push and pull count the same chunks: the files' and the manifest's
        assert got["chunks"] == res["chunks"] == total and got["chunks_fetched"] == total
        got2 = pull_ref(c, "builds/main/2", url(node), streams=2)
        assert got2["chunks_fetched"] == len(new_chunks) + 1 and got2["chunks"] == res2["chunks"]
        assert pull_ref(c, "builds/main/2", url(node))["unchanged"]  # here already: a no-op success
        assert c.ref("builds/main/1").description == "v1"
        c.get("builds/main/2", str(tmp_path / "out"))
        assert snapshot(str(tmp_path / "out")) == snapshot(src)
        assert c.verify()["ok"]
        with pytest.raises(RefNotFoundError) as ei:
            pull_ref(c, "builds/nope", url(node))
        # no server path leaves; the message names the server asked
        assert str(tmp_path) not in str(ei.value) and f"127.0.0.1:{node.port}" in str(ei.value)
    with Store(tmp_path / "remote_store") as r:
        assert r.verify()["ok"]


def test_read_only_token_allow_and_no_store(tmp_path: Any) -> None:
    write_tree = make_tree(str(tmp_path / "src"), files=3)
    with Store(tmp_path / "a") as a:
        a.put("r/1", write_tree)
        ro = start_server(str(tmp_path / "ro_root"), store=str(tmp_path / "a"), read_only=True)
        tok = start_server(str(tmp_path / "tok_root"), store=str(tmp_path / "t"), token=b"s3cret")
        deny = start_server(str(tmp_path / "deny_root"), store=str(tmp_path / "d"), allow=["10.9.9.0/24"])
        bare = start_server(str(tmp_path / "bare_root"))
        try:
            with pytest.raises(ReadOnlyError):
                push_ref(a, "r/1", url(ro), as_name="r/2")
            with Store(tmp_path / "b") as b:
                assert pull_ref(b, "r/1", url(ro))["chunks_fetched"] > 0  # reads are allowed
            with pytest.raises(AuthError):
                push_ref(a, "r/1", url(tok), token=b"wrong")
            assert push_ref(a, "r/1", url(tok), token=b"s3cret")["chunks_sent"] > 0
            with pytest.raises(AuthError):
                push_ref(a, "r/1", url(deny))
            with pytest.raises(UsageError):
                push_ref(a, "r/1", url(bare))
        finally:
            for s in (ro, tok, deny, bare):
                s.server.stop()


def test_store_ops_refuses_bad_chunks_and_incomplete_commits(tmp_path: Any) -> None:
    with Store(tmp_path / "s") as st:
        ops = StoreOps(st)
        lease = "ab" * 16
        data = os.urandom(5000)
        with pytest.raises(IntegrityError):
            ops.put_chunks(lease, [[chunk_digest(b"other"), data]])
        with pytest.raises(UsageError):
            ops.put_chunks("not-a-lease", [[chunk_digest(data), data]])
        with pytest.raises(UsageError):
            ops.have([b"short"], lease)
        # a manifest whose file chunk never arrived: no ref
        src = tmp_path / "t"
        os.makedirs(src)
        (src / "f").write_bytes(data)
        with Store(tmp_path / "other") as o:
            info = o.put("x/1", str(src))
            mchunks = [[d, o.read_chunk(d)] for d, _ in info.mchunks]
        ops.put_chunks(lease, mchunks)
        from tb5sync.engine.hashing import refs_to_blob

        with pytest.raises(IntegrityError):
            ops.commit(lease, "x/1", info.manifest, refs_to_blob(info.mchunks))
        assert st.refs() == []
        ops.put_chunks(lease, [[chunk_digest(data), data]])
        ops.commit(lease, "x/1", info.manifest, refs_to_blob(info.mchunks))
        assert st.cat("x/1", "f") == data
        ops.close()


_PUSH = """
import sys
from tb5sync.store import Store
from tb5sync.remote.storeclient import push_ref
from tb5sync.wire.urls import parse_url
st = Store(sys.argv[1])
print("start", flush=True)
push_ref(st, "big/1", parse_url(sys.argv[2]), streams=4)
print("done", flush=True)
"""


def _serve(tmp_path: Any, store: str) -> tuple[subprocess.Popen[str], int]:
    p = subprocess.Popen([sys.executable, "-m", "tb5sync.cli", "serve", str(tmp_path / "root"), "--bind", "127.0.0.1:0",
                          "--store", store], stderr=subprocess.PIPE, text=True)
    assert p.stderr is not None
    m = re.search(r":(\d+)\s*$", p.stderr.readline())
    assert m, "server did not start"
    return p, int(m.group(1))


def test_sigkill_during_push_client_and_server(tmp_path: Any) -> None:
    os.makedirs(tmp_path / "root")
    src = tmp_path / "src"
    os.makedirs(src)
    rnd = random.Random(8)
    for i in range(6):
        (src / f"w{i}").write_bytes(rnd.randbytes(6 * MiB))
    with Store(tmp_path / "a", pack_target=4 * MiB) as a:
        a.put("big/1", str(src))
    remote_store = str(tmp_path / "r")
    Store(remote_store, pack_target=2 * MiB).close()  # small packs: some are in place when the kill comes
    for victim, delay in (("client", 0.12), ("server", 0.15), ("client", 0.25)):
        srv, port = _serve(tmp_path, remote_store)
        try:
            cl = subprocess.Popen([sys.executable, "-c", _PUSH, str(tmp_path / "a"), f"tb5://127.0.0.1:{port}"],
                                  stdout=subprocess.PIPE, text=True)
            assert cl.stdout is not None and cl.stdout.readline() == "start\n"
            time.sleep(delay)
            (cl if victim == "client" else srv).send_signal(signal.SIGKILL)
            cl.communicate(timeout=60)
        finally:
            srv.send_signal(signal.SIGKILL)
            srv.wait(timeout=30)
            assert srv.stderr is not None
            srv.stderr.close()
        with Store(remote_store) as r:
            rep = r.verify()
            assert rep["ok"], rep
            if r.refs():  # the push may have finished before the kill
                r.rm("big/1")
    srv, port = _serve(tmp_path, remote_store)
    try:
        with Store(tmp_path / "a") as a:
            push_ref(a, "big/1", parse_url(f"tb5://127.0.0.1:{port}"), streams=4)
    finally:
        srv.send_signal(signal.SIGTERM)
        srv.wait(timeout=30)
        assert srv.stderr is not None
        srv.stderr.close()
    with Store(remote_store) as r:
        r.gc()
        assert r.verify()["ok"]
        r.get("big/1", str(tmp_path / "out"))
    for i in range(6):
        assert slurp(str(tmp_path / "out" / f"w{i}")) == slurp(str(src / f"w{i}"))


# ---- read access without materialising: tb5store:// -------------------------------------------


def _safetensors(path: str, tensors: dict[str, bytes]) -> dict[str, tuple[int, int]]:
    """Write a safetensors file (8-byte LE header length, JSON header, data); returns name -> (begin, end) in the data."""
    import json
    import struct

    header: dict[str, Any] = {}
    off = 0
    for name, data in tensors.items():
        header[name] = {"dtype": "U8", "shape": [len(data)], "data_offsets": [off, off + len(data)]}
        off += len(data)
    head = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for data in tensors.values():
            f.write(data)
    return {k: tuple(v["data_offsets"]) for k, v in header.items()}


def test_tb5store_fsspec_reads_a_tensor_without_the_file(tmp_path: Any, node: Any) -> None:
    import json
    import struct

    import fsspec

    rnd = random.Random(12)
    tensors = {f"layer.{i}.weight": rnd.randbytes(6 * MiB) for i in range(4)}
    os.makedirs(tmp_path / "m" / "sub")
    spans = _safetensors(str(tmp_path / "m" / "model.safetensors"), tensors)
    (tmp_path / "m" / "sub" / "config.json").write_bytes(b'{"a": 1}')
    with Store(tmp_path / "a") as a:
        a.put("models/qwen-0.5b/q4", str(tmp_path / "m"))
        a.put("models/qwen-0.5b-cfg", str(tmp_path / "m" / "sub"))  # a name prefix, not a path prefix
        push_ref(a, "models/qwen-0.5b/q4", url(node))
        push_ref(a, "models/qwen-0.5b-cfg", url(node))
    fs = fsspec.filesystem("tb5store", host="127.0.0.1", port=node.port, skip_instance_cache=True)
    try:
        assert fs.ls("models", detail=False) == ["models/qwen-0.5b", "models/qwen-0.5b-cfg"]
        assert fs.ls("tb5store://127.0.0.1/models/qwen-0.5b/q4", detail=False) == [
            "models/qwen-0.5b/q4/model.safetensors", "models/qwen-0.5b/q4/sub"]
        assert fs.cat_file("models/qwen-0.5b-cfg/config.json") == b'{"a": 1}'
        path = "models/qwen-0.5b/q4/model.safetensors"
        src = slurp(str(tmp_path / "m" / "model.safetensors"))
        assert fs.info(path)["size"] == len(src) and fs.info(path)["type"] == "file"
        before = fs._session.req.wire_bytes
        n = struct.unpack("<Q", fs.cat_file(path, 0, 8))[0]
        header = json.loads(fs.cat_file(path, 8, 8 + n))
        b, e = header["layer.3.weight"]["data_offsets"]
        assert (b, e) == spans["layer.3.weight"]
        got = fs.cat_file(path, 8 + n + b + 1000, 8 + n + b + 5096)
        assert got == tensors["layer.3.weight"][1000:5096]
        assert fs._session.req.wire_bytes - before < 64 * 1024  # not the 24 MiB file
        with fs.open(path, "rb", block_size=MiB) as f:
            f.seek(8 + n + spans["layer.1.weight"][0])
            assert f.read(3 * MiB) == tensors["layer.1.weight"][: 3 * MiB]
        assert fs.cat_file(path, -10) == src[-10:]
        with pytest.raises(FileNotFoundError):
            fs.info("models/qwen-0.5b/q4/nope")
        with pytest.raises(FileNotFoundError):
            fs.ls("nothing/here")
        with pytest.raises(UsageError):
            fs.open(path, "wb")
    finally:
        fs.close()


def test_serve_store_under_the_roots_state(tmp_path: Any) -> None:
    """``tb5sync serve ROOT --store`` (no DIR) serves ROOT/.tb5sync/store, which a sync of ROOT never lists."""
    os.makedirs(tmp_path / "root" / "data")
    (tmp_path / "root" / "data" / "x").write_bytes(b"x")
    p = subprocess.Popen([sys.executable, "-m", "tb5sync.cli", "serve", str(tmp_path / "root"), "--bind", "127.0.0.1:0",
                          "--store"], stderr=subprocess.PIPE, text=True)
    try:
        assert p.stderr is not None
        m = re.search(r":(\d+)\s*$", p.stderr.readline())
        assert m
        with Store(tmp_path / "a") as a:
            a.put("r/1", str(tmp_path / "root" / "data"))
            assert push_ref(a, "r/1", parse_url(f"tb5://127.0.0.1:{m.group(1)}"))["chunks_sent"] == 2
        import tb5sync

        tb5sync.sync(f"tb5://127.0.0.1:{m.group(1)}/", str(tmp_path / "copy"))
        # the server's .tb5sync (state and store) did not travel; the copy's own state is in the user's cache directory
        assert sorted(os.listdir(tmp_path / "copy")) == ["data"]
        assert not os.path.exists(tmp_path / "copy" / ".tb5sync" / "store")  # the server's store did not travel
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
        if p.stderr is not None:
            p.stderr.close()
    with Store(tmp_path / "root" / ".tb5sync" / "store") as r:
        assert [x.name for x in r.refs()] == ["r/1"] and r.verify()["ok"]


def test_pull_refuses_a_corrupting_server(tmp_path: Any, node: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_tree(str(tmp_path / "src"), files=4)
    with Store(tmp_path / "a") as a:
        a.put("c/1", src)
        push_ref(a, "c/1", url(node))
    real = StoreOps.chunks

    def flipped(self: StoreOps, digests: list[bytes]) -> Any:
        meta, parts = real(self, digests)
        if parts and len(parts[-1]) > 100:
            p = bytearray(parts[-1])
            p[50] ^= 1
            parts[-1] = bytes(p)
        return meta, parts

    monkeypatch.setattr(StoreOps, "chunks", flipped)
    with Store(tmp_path / "c") as c:
        with pytest.raises(IntegrityError):
            pull_ref(c, "c/1", url(node), streams=2)
        assert c.refs() == []
        monkeypatch.undo()
        pull_ref(c, "c/1", url(node), streams=2)  # the store takes new work, and the good copy
        assert c.verify()["ok"]


def test_unsafe_manifests_are_refused(tmp_path: Any) -> None:
    """A manifest is data from a peer: paths that climb out, and files under a symlink, are refused."""
    import msgpack

    from tb5sync.engine.hashing import file_digest, refs_to_blob
    from tb5sync.store.manifest import Item, decode_manifest, encode_manifest

    for bad in (b"../x", b"/abs", b"a//b", b"a/./b", b"a\0b"):
        raw = msgpack.packb({"v": 1, "entries": [[b"", "d", 0o755, 0, 0, None, None, b""],
                                                  [bad, "d", 0o755, 0, 0, None, None, b""]]}, use_bin_type=True)
        with pytest.raises(IntegrityError):
            decode_manifest(raw)
    for junk in (b"", b"\xc1", msgpack.packb({"v": 2, "entries": []}), msgpack.packb([1, 2])):
        with pytest.raises(IntegrityError):
            decode_manifest(junk)
    outside = tmp_path / "outside"
    os.makedirs(outside)
    data = b"evil"
    with Store(tmp_path / "s") as st:
        lease = st.lease()
        from tb5sync.store.store import PackWriter

        w = PackWriter(st, lease)
        d = chunk_digest(data)
        w.add(d, data)
        items = [Item(b"", "d", 0o755, 0, 0), Item(b"a", "l", 0o777, 1, 0, target=os.fsencode(str(outside))),
                 Item(b"a/evil", "f", 0o644, 4, 0, digest=file_digest([d]), chunks=[(d, 4)])]
        mdigest, mrefs = st.put_bytes(encode_manifest(items), lease, w)
        w.flush()
        st.commit_ref(lease, "bad/1", mdigest, mrefs, items)
        with pytest.raises(IntegrityError):
            st.get("bad/1", str(tmp_path / "got"))
        assert os.listdir(outside) == [] and not os.path.exists(tmp_path / "got")
        assert refs_to_blob(mrefs)  # the manifest itself was stored whole


def test_cli_push_of_a_ref_already_there_and_urls_with_a_path(tmp_path: Any, node: Any) -> None:
    src = make_tree(str(tmp_path / "src"), files=5)
    cli = [sys.executable, "-m", "tb5sync.cli", "store", "--store", str(tmp_path / "a")]
    dest = f"tb5://127.0.0.1:{node.port}"
    assert subprocess.run([*cli, "put", "r", src], capture_output=True, timeout=60).returncode == 0
    assert subprocess.run([*cli, "push", "r", dest], capture_output=True, timeout=60).returncode == 0
    # the same ref again: the server has it with the same digest: exit 0, said so, nothing sent
    r = subprocess.run([*cli, "push", "r", dest], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "same content already" in r.stdout, (r.stdout, r.stderr)
    r = subprocess.run([*cli, "pull", "r", dest], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "same content already" in r.stdout, (r.stdout, r.stderr)
    # another snapshot under that name is still refused (exit 2), naming --force
    other = make_tree(str(tmp_path / "other"), seed=4, files=5)
    assert subprocess.run([*cli, "put", "o", other], capture_output=True, timeout=60).returncode == 0
    r = subprocess.run([*cli, "push", "o", dest, "--as", "r"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--force" in r.stderr, r.stderr
    # a path in the server URL is refused, not ignored: push, pull, ls --url and pull --from
    for args in (["push", "r", dest + "/some/dir"], ["pull", "r", dest + "/x"], ["ls", "--url", dest + "/x"],
                 ["pull", "r", "--from", dest + "/x"]):
        r = subprocess.run([*cli, *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "without a path" in r.stderr, (args, r.stderr)
    with Store(str(tmp_path / "remote_store")) as rs:
        assert [x.name for x in rs.refs()] == ["r"]
