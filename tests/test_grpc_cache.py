"""The gRPC build cache (tb5sync.cache.grpccache): the Remote Execution API's cache services as its
spec (proto/build/bazel/remote/execution/v2/remote_execution.proto, proto/google/bytestream/bytestream.proto)
states them, and real Bazel over ``--remote_cache=grpc://``.

Clients are grpcio's own stubs generated from the same .proto files; servers listen on 127.0.0.1
port 0 and are stopped in teardown.
"""

from __future__ import annotations

import filecmp
import hashlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")

from tb5sync.cache._reapi_pb import bytestream_pb2 as bs  # noqa: E402
from tb5sync.cache._reapi_pb import bytestream_pb2_grpc as bs_grpc  # noqa: E402
from tb5sync.cache._reapi_pb import remote_execution_pb2 as re_pb  # noqa: E402
from tb5sync.cache._reapi_pb import remote_execution_pb2_grpc as re_grpc  # noqa: E402
from tb5sync.cache.grpccache import MAX_BATCH, GrpcCache, parse_resource_name, RpcRefused  # noqa: E402
from tb5sync.cache.httpcache import EMPTY_SHA256, HttpCache  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "s3cret-token"


class Served:
    """One HTTP cache with its gRPC face and a channel to it; stubs as attributes."""

    def __init__(self, cache: HttpCache, face: GrpcCache, channel: Any) -> None:
        self.cache, self.face, self.channel = cache, face, channel
        self.caps = re_grpc.CapabilitiesStub(channel)
        self.ac = re_grpc.ActionCacheStub(channel)
        self.cas = re_grpc.ContentAddressableStorageStub(channel)
        self.bs = bs_grpc.ByteStreamStub(channel)


@pytest.fixture
def serve(tmp_path: Any) -> Iterator[Callable[..., Served]]:
    made: list[Served] = []

    def make(channel: Any = None, tls: dict[str, str] | None = None, **kw: Any) -> Served:
        cache = HttpCache(tmp_path / f"store{len(made)}", **kw).start()
        try:
            face = GrpcCache(cache, "127.0.0.1", 0, **(tls or {})).start()
        except BaseException:
            cache.stop()
            raise
        ch = channel(face.port) if channel else grpc.insecure_channel(f"127.0.0.1:{face.port}")
        made.append(Served(cache, face, ch))
        return made[-1]

    yield make
    for s in made:
        s.channel.close()
        s.face.stop()
        s.cache.stop()


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def dg(b: bytes) -> Any:
    return re_pb.Digest(hash=sha(b), size_bytes=len(b))


def code_of(fn: Callable[[], Any]) -> Any:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code()


def upload(s: Served, blobs: list[bytes]) -> None:
    r = s.cas.BatchUpdateBlobs(re_pb.BatchUpdateBlobsRequest(
        requests=[re_pb.BatchUpdateBlobsRequest.Request(digest=dg(b), data=b) for b in blobs]))
    assert [x.status.code for x in r.responses] == [0] * len(blobs)


def writes(name: str, data: bytes, piece: int, start: int = 0, finish: bool = True) -> Iterator[Any]:
    for i in range(start, max(len(data), start + 1), piece):
        last = i + piece >= len(data)
        yield bs.WriteRequest(resource_name=name if i == start else "", write_offset=i, data=data[i:i + piece],
                              finish_write=finish and last)
        if last:
            break


# ---- stubs and packaging ----
@pytest.mark.timeout(60)
def test_generated_stubs_are_up_to_date(tmp_path: Any) -> None:
    pytest.importorskip("grpc_tools")
    out = tmp_path / "pb"
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gen_protos.py"), str(out)], check=True,
                   capture_output=True)
    committed = os.path.join(ROOT, "tb5sync", "cache", "_reapi_pb")
    names = sorted(n for n in os.listdir(out) if n.endswith(".py"))
    assert names == sorted(n for n in os.listdir(committed) if n.endswith(".py"))
    _, mismatch, errors = filecmp.cmpfiles(out, committed, names, shallow=False)
    assert not mismatch and not errors, f"run `make protos`: {mismatch or errors} differ from proto/"


@pytest.mark.timeout(60)
def test_import_tb5sync_and_the_http_cache_do_not_import_grpc() -> None:
    code = ("import sys, tb5sync, tb5sync.cache.httpcache, tb5sync.cli.command; "
            "bad = [m for m in ('grpc', 'google.protobuf') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.timeout(30)
def test_resource_names() -> None:
    h = "a" * 64
    assert parse_resource_name(f"blobs/{h}/12", upload=False) == ("", h, 12, "")
    assert parse_resource_name(f"main/blobs/{h}/0", upload=False) == ("main", h, 0, "")
    assert parse_resource_name(f"uploads/u-1/blobs/{h}/7", upload=True) == ("", h, 7, "u-1")
    assert parse_resource_name(f"i/uploads/u/blobs/{h}/7/extra/meta", upload=True) == ("i", h, 7, "u")
    for bad, up in [(f"blobs/{h}", False), (f"blobs/{h}/x", False), ("blobs/ABC/1", False),
                    (f"blobs/{h}/1/more", False), (f"uploads/blobs/{h}/1", True), (f"nothing/{h}/1", False)]:
        with pytest.raises(RpcRefused) as e:
            parse_resource_name(bad, upload=up)
        assert e.value.code == "INVALID_ARGUMENT", bad


# ---- each RPC against the spec ----
@pytest.mark.timeout(60)
def test_capabilities_sha256_and_batch_limit(serve: Callable[..., Served]) -> None:
    s = serve()
    caps = s.caps.GetCapabilities(re_pb.GetCapabilitiesRequest())
    cc = caps.cache_capabilities
    assert list(cc.digest_function) == [re_pb.DigestFunction.SHA256]
    assert cc.action_cache_update_capabilities.update_enabled
    assert cc.max_batch_total_size_bytes == MAX_BATCH
    assert caps.low_api_version.major == 2 and caps.high_api_version.major == 2
    assert not caps.HasField("execution_capabilities") or not caps.execution_capabilities.exec_enabled
    ro = serve(read_only=True)
    assert not ro.caps.GetCapabilities(re_pb.GetCapabilitiesRequest()).cache_capabilities.action_cache_update_capabilities.update_enabled


@pytest.mark.timeout(60)
def test_cas_find_missing_batch_update_and_read(serve: Callable[..., Served]) -> None:
    s = serve()
    a, b, empty = os.urandom(10_000), b"second blob", b""
    missing = s.cas.FindMissingBlobs(re_pb.FindMissingBlobsRequest(blob_digests=[dg(a), dg(b), dg(empty)]))
    assert sorted(d.hash for d in missing.missing_blob_digests) == sorted([sha(a), sha(b)])  # the empty blob is always there
    upload(s, [a])
    missing = s.cas.FindMissingBlobs(re_pb.FindMissingBlobsRequest(blob_digests=[dg(a), dg(b)]))
    assert [d.hash for d in missing.missing_blob_digests] == [sha(b)]
    r = s.cas.BatchReadBlobs(re_pb.BatchReadBlobsRequest(digests=[dg(a), dg(b), dg(empty)]))
    got = {x.digest.hash: x for x in r.responses}
    assert got[sha(a)].status.code == 0 and got[sha(a)].data == a
    assert got[sha(b)].status.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert got[EMPTY_SHA256].status.code == 0 and got[EMPTY_SHA256].data == b""
    # the same entries as the HTTP cache's /cas/
    import http.client

    h = http.client.HTTPConnection("127.0.0.1", s.cache.port, timeout=30)
    h.request("GET", f"/cas/{sha(a)}")
    resp = h.getresponse()
    assert resp.status == 200 and resp.read() == a
    h.close()
    m = s.cache.metrics.counts
    assert m["cas.puts"] == 1 and m["cas.hits"] >= 2 and m["cas.misses"] == 1 and m["grpc.requests"] >= 4
    # a batch over the advertised limit is refused whole
    big = os.urandom(MAX_BATCH // 2 + 1)
    other = os.urandom(MAX_BATCH // 2 + 1)
    assert code_of(lambda: s.cas.BatchUpdateBlobs(re_pb.BatchUpdateBlobsRequest(requests=[
        re_pb.BatchUpdateBlobsRequest.Request(digest=dg(x), data=x) for x in (big, other)]))) == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.timeout(60)
def test_wrong_digests_are_invalid_argument_and_store_nothing(serve: Callable[..., Served]) -> None:
    s = serve()
    data = b"compiler output"
    wrong_hash = re_pb.Digest(hash=sha(b"something else"), size_bytes=len(data))
    wrong_size = re_pb.Digest(hash=sha(data), size_bytes=len(data) + 1)
    r = s.cas.BatchUpdateBlobs(re_pb.BatchUpdateBlobsRequest(requests=[
        re_pb.BatchUpdateBlobsRequest.Request(digest=wrong_hash, data=data),
        re_pb.BatchUpdateBlobsRequest.Request(digest=wrong_size, data=data),
        re_pb.BatchUpdateBlobsRequest.Request(digest=re_pb.Digest(hash="XYZ", size_bytes=1), data=b"x")]))
    assert [x.status.code for x in r.responses] == [grpc.StatusCode.INVALID_ARGUMENT.value[0]] * 3
    assert s.cache.store.stats()["chunks"] == 0
    not_hex = re_pb.Digest(hash="ab" * 31, size_bytes=3)
    assert code_of(lambda: s.cas.FindMissingBlobs(re_pb.FindMissingBlobsRequest(blob_digests=[not_hex]))) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: s.ac.GetActionResult(re_pb.GetActionResultRequest(action_digest=not_hex))) == grpc.StatusCode.INVALID_ARGUMENT
    neg = re_pb.Digest(hash=sha(data), size_bytes=-1)
    assert code_of(lambda: s.cas.FindMissingBlobs(re_pb.FindMissingBlobsRequest(blob_digests=[neg]))) == grpc.StatusCode.INVALID_ARGUMENT
    # ByteStream: bytes that do not hash to the resource name's digest are refused at finish_write
    name = f"uploads/u1/blobs/{sha(b'other')}/{len(data)}"
    assert code_of(lambda: s.bs.Write(writes(name, data, 4))) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: list(s.bs.Read(bs.ReadRequest(resource_name=f"blobs/{sha(b'other')}/{len(data)}")))) == grpc.StatusCode.NOT_FOUND
    assert s.cache.store.stats()["chunks"] == 0
    # an undeclared instance name
    assert code_of(lambda: s.cas.FindMissingBlobs(re_pb.FindMissingBlobsRequest(
        instance_name="nope", blob_digests=[dg(data)]))) == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.timeout(60)
def test_action_cache_hit_only_when_every_output_is_in_the_cas(serve: Callable[..., Served]) -> None:
    s = serve(bazel_instances=["main"])
    out, err = os.urandom(3000), b"warning: x\n"
    tree_file = b"a file inside an output directory"
    tree = re_pb.Tree(root=re_pb.Directory(files=[re_pb.FileNode(name="f", digest=dg(tree_file))]))
    tree_b = tree.SerializeToString()
    result = re_pb.ActionResult(output_files=[re_pb.OutputFile(path="out/a", digest=dg(out))],
                                output_directories=[re_pb.OutputDirectory(path="out/d", tree_digest=dg(tree_b))],
                                exit_code=0, stderr_digest=dg(err))
    action = dg(b"the action")
    for inst in ("", "main"):
        get = re_pb.GetActionResultRequest(instance_name=inst, action_digest=action)
        assert code_of(lambda: s.ac.GetActionResult(get)) == grpc.StatusCode.NOT_FOUND
        s.ac.UpdateActionResult(re_pb.UpdateActionResultRequest(instance_name=inst, action_digest=action, action_result=result))
        assert code_of(lambda: s.ac.GetActionResult(get)) == grpc.StatusCode.NOT_FOUND  # outputs not uploaded yet
        s.cas.BatchUpdateBlobs(re_pb.BatchUpdateBlobsRequest(instance_name=inst, requests=[
            re_pb.BatchUpdateBlobsRequest.Request(digest=dg(x), data=x) for x in (out, err, tree_b)]))
        assert code_of(lambda: s.ac.GetActionResult(get)) == grpc.StatusCode.NOT_FOUND  # the tree's file is missing
        s.cas.BatchUpdateBlobs(re_pb.BatchUpdateBlobsRequest(instance_name=inst, requests=[
            re_pb.BatchUpdateBlobsRequest.Request(digest=dg(tree_file), data=tree_file)]))
        assert s.ac.GetActionResult(get) == result
    m = s.cache.metrics.counts
    assert m["ac.hits"] == 2 and m["ac.misses"] == 6 and m["ac.ac_incomplete"] == 4 and m["ac.puts"] == 2
    keys = set(__import__("tb5sync.store.blobs", fromlist=["blob_keys"]).blob_keys(s.cache.store))
    assert f"ac/{action.hash}" in keys and f"main/ac/{action.hash}" in keys and f"main/cas/{sha(out)}" in keys


@pytest.mark.timeout(60)
def test_bytestream_chunked_write_resume_and_read_with_offsets(serve: Callable[..., Served]) -> None:
    s = serve()
    data = os.urandom(5 * 1024 * 1024 + 123)  # over the batch limit and the in-memory spool
    h, n = sha(data), len(data)
    name = f"uploads/6f1c/blobs/{h}/{n}"
    # a write cut off before finish_write is kept: QueryWriteStatus tells where to resume
    half = 2 * 1024 * 1024 + 17
    r = s.bs.Write(writes(name, data[:half], 64 * 1024, finish=False))
    assert r.committed_size == half
    st = s.bs.QueryWriteStatus(bs.QueryWriteStatusRequest(resource_name=name))
    assert (st.committed_size, st.complete) == (half, False)
    # a resume at any other offset is refused
    bad = iter([bs.WriteRequest(resource_name=name, write_offset=half - 1, data=data[half - 1:half + 10])])
    assert code_of(lambda: s.bs.Write(bad)) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: s.bs.QueryWriteStatus(bs.QueryWriteStatusRequest(
        resource_name=f"uploads/other/blobs/{h}/{n}"))) == grpc.StatusCode.NOT_FOUND  # another upload, a blob not held
    # the refused resume dropped the partial write: start over, in uneven pieces
    r = s.bs.Write(writes(name, data, 300_001))
    assert r.committed_size == n
    st = s.bs.QueryWriteStatus(bs.QueryWriteStatusRequest(resource_name=name))
    assert (st.committed_size, st.complete) == (n, True)
    read = f"blobs/{h}/{n}"
    whole = list(s.bs.Read(bs.ReadRequest(resource_name=read)))
    assert b"".join(x.data for x in whole) == data and len(whole) > 1 and max(len(x.data) for x in whole) <= 1024 * 1024
    for off, limit in [(0, 10), (1, 0), (1024 * 1024 - 1, 3), (n - 5, 0), (n - 5, 100), (n, 0), (3_000_000, 1_500_000)]:
        got = b"".join(x.data for x in s.bs.Read(bs.ReadRequest(resource_name=read, read_offset=off, read_limit=limit)))
        assert got == data[off:off + limit if limit else n], (off, limit)
    assert code_of(lambda: list(s.bs.Read(bs.ReadRequest(resource_name=read, read_offset=n + 1)))) == grpc.StatusCode.OUT_OF_RANGE
    assert code_of(lambda: list(s.bs.Read(bs.ReadRequest(resource_name=read, read_offset=-1)))) == grpc.StatusCode.OUT_OF_RANGE
    assert code_of(lambda: list(s.bs.Read(bs.ReadRequest(resource_name=read, read_limit=-1)))) == grpc.StatusCode.INVALID_ARGUMENT
    missing = f"blobs/{sha(b'nope')}/4"
    assert code_of(lambda: list(s.bs.Read(bs.ReadRequest(resource_name=missing)))) == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: s.bs.QueryWriteStatus(bs.QueryWriteStatusRequest(
        resource_name=f"uploads/x/blobs/{sha(b'nope')}/4"))) == grpc.StatusCode.NOT_FOUND
    # more bytes than the digest's size
    small = b"0123456789"
    over = iter([bs.WriteRequest(resource_name=f"uploads/o/blobs/{sha(small)}/5", write_offset=0, data=small, finish_write=True)])
    assert code_of(lambda: s.bs.Write(over)) == grpc.StatusCode.INVALID_ARGUMENT
    # a small blob through ByteStream too, and the empty blob
    r = s.bs.Write(writes(f"uploads/s/blobs/{sha(small)}/{len(small)}", small, 3))
    assert r.committed_size == len(small)
    assert b"".join(x.data for x in s.bs.Read(bs.ReadRequest(resource_name=f"blobs/{sha(small)}/10", read_offset=4))) == small[4:]
    assert s.bs.Write(writes(f"uploads/e/blobs/{EMPTY_SHA256}/0", b"", 1)).committed_size == 0
    assert list(s.bs.Read(bs.ReadRequest(resource_name=f"blobs/{EMPTY_SHA256}/0"))) == []
    assert not os.listdir(s.cache.store.tmp_dir) or all(not f.endswith(".body") for f in os.listdir(s.cache.store.tmp_dir))


@pytest.mark.timeout(60)
def test_token_in_metadata_or_unauthenticated(serve: Callable[..., Served]) -> None:
    s = serve(bearer=TOKEN)
    data = b"x" * 100
    req = re_pb.FindMissingBlobsRequest(blob_digests=[dg(data)])
    assert code_of(lambda: s.cas.FindMissingBlobs(req)) == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: s.cas.FindMissingBlobs(req, metadata=[("authorization", "Bearer wrong")])) == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: s.caps.GetCapabilities(re_pb.GetCapabilitiesRequest())) == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: list(s.bs.Read(bs.ReadRequest(resource_name=f"blobs/{sha(data)}/100")))) == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: s.bs.Write(writes(f"uploads/u/blobs/{sha(data)}/100", data, 10))) == grpc.StatusCode.UNAUTHENTICATED
    assert s.cache.store.stats()["chunks"] == 0
    md = [("authorization", f"Bearer {TOKEN}")]
    assert len(s.cas.FindMissingBlobs(req, metadata=md).missing_blob_digests) == 1
    assert s.bs.Write(writes(f"uploads/u/blobs/{sha(data)}/100", data, 10), metadata=md).committed_size == 100
    assert s.cache.metrics.counts["grpc.unauthenticated"] == 5


@pytest.mark.timeout(60)
def test_read_only_and_allow_list(serve: Callable[..., Served]) -> None:
    s = serve(read_only=True)
    data = b"y" * 10
    assert code_of(lambda: s.bs.Write(writes(f"uploads/u/blobs/{sha(data)}/10", data, 5))) == grpc.StatusCode.PERMISSION_DENIED
    assert code_of(lambda: s.ac.UpdateActionResult(re_pb.UpdateActionResultRequest(
        action_digest=dg(b"a"), action_result=re_pb.ActionResult()))) == grpc.StatusCode.PERMISSION_DENIED
    assert code_of(lambda: s.cas.BatchUpdateBlobs(re_pb.BatchUpdateBlobsRequest(requests=[
        re_pb.BatchUpdateBlobsRequest.Request(digest=dg(data), data=data)]))) == grpc.StatusCode.PERMISSION_DENIED
    assert len(s.cas.FindMissingBlobs(re_pb.FindMissingBlobsRequest(blob_digests=[dg(data)])).missing_blob_digests) == 1
    far = serve(allow=["10.99.0.0/16"])
    assert code_of(lambda: far.caps.GetCapabilities(re_pb.GetCapabilitiesRequest())) == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.timeout(60)
def test_max_entry_size_and_quota_are_resource_exhausted(serve: Callable[..., Served]) -> None:
    s = serve(max_entry_size=1000)
    small, big = b"s" * 1000, os.urandom(1001)
    r = s.cas.BatchUpdateBlobs(re_pb.BatchUpdateBlobsRequest(requests=[
        re_pb.BatchUpdateBlobsRequest.Request(digest=dg(x), data=x) for x in (small, big)]))
    assert [x.status.code for x in r.responses] == [0, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]]
    # refused on the resource name's size, before any byte is kept
    assert code_of(lambda: s.bs.Write(writes(f"uploads/u/blobs/{sha(big)}/{len(big)}", big, 100))) == grpc.StatusCode.RESOURCE_EXHAUSTED
    missing = s.cas.FindMissingBlobs(re_pb.FindMissingBlobsRequest(blob_digests=[dg(small), dg(big)])).missing_blob_digests
    assert [d.hash for d in missing] == [sha(big)]
    assert s.cache.metrics.counts["cas.puts_too_large"] == 2
    q = serve()
    q.cache.store.set_quota(64 * 1024)
    huge = os.urandom(100 * 1024)
    assert code_of(lambda: q.bs.Write(writes(f"uploads/u/blobs/{sha(huge)}/{len(huge)}", huge, 32 * 1024))) == grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.timeout(60)
def test_tls_with_the_cert_and_key_options(serve: Callable[..., Served], tmp_path: Any) -> None:
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "chain.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    (tmp_path / "certs.pem").write_bytes(b"".join(b.bytes() for b in cert.cert_chain_pems))
    creds = grpc.ssl_channel_credentials(root_certificates=ca.cert_pem.bytes())
    s = serve(channel=lambda port: grpc.secure_channel(f"127.0.0.1:{port}", creds),
              tls={"tls_cert": str(tmp_path / "certs.pem"), "tls_key": str(tmp_path / "key.pem")}, bearer=TOKEN)
    assert s.face.tls
    md = [("authorization", f"Bearer {TOKEN}")]
    assert list(s.caps.GetCapabilities(re_pb.GetCapabilitiesRequest(), metadata=md).cache_capabilities.digest_function) == [1]
    plain = grpc.insecure_channel(f"127.0.0.1:{s.face.port}")
    try:
        with pytest.raises(grpc.RpcError):
            re_grpc.CapabilitiesStub(plain).GetCapabilities(re_pb.GetCapabilitiesRequest(), metadata=md, timeout=5)
    finally:
        plain.close()


@pytest.mark.timeout(60)
def test_cli_http_cache_grpc_with_token(tmp_path: Any) -> None:
    import signal

    (tmp_path / "tok").write_text(TOKEN + "\n")
    p = subprocess.Popen([sys.executable, "-m", "tb5sync.cli", "http-cache", str(tmp_path / "store"), "--bind", "127.0.0.1:0",
                          "--grpc", "127.0.0.1:0", "--http-token-file", str(tmp_path / "tok")], stderr=subprocess.PIPE, text=True)
    try:
        assert p.stderr is not None
        port = 0
        for _ in range(6):
            m = re.search(r"grpc cache of .* on 127\.0\.0\.1:(\d+)", p.stderr.readline())
            if m:
                port = int(m.group(1))
                break
        assert port
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            cas = re_grpc.ContentAddressableStorageStub(ch)
            data = b"through the command"
            req = re_pb.BatchUpdateBlobsRequest(requests=[re_pb.BatchUpdateBlobsRequest.Request(digest=dg(data), data=data)])
            assert code_of(lambda: cas.BatchUpdateBlobs(req)) == grpc.StatusCode.UNAUTHENTICATED
            assert cas.BatchUpdateBlobs(req, metadata=[("authorization", f"Bearer {TOKEN}")]).responses[0].status.code == 0
    finally:
        p.send_signal(signal.SIGTERM)
        err = p.communicate(timeout=30)[1]
        assert p.returncode == 0, err
    from tb5sync.store import Store
    from tb5sync.store.blobs import counters

    with Store(tmp_path / "store") as st:
        got = counters(st)
        assert got["cas.puts"] == 1 and got["grpc.unauthenticated"] == 1


# ---- real Bazel over grpc:// ----
BAZEL_BUILD = '''
genrule(name = "lib_o", srcs = ["lib.c", "lib.h"], outs = ["lib.o"], cmd = "gcc -O2 -c $(location lib.c) -o $@")
genrule(name = "hello", srcs = ["main.c", "lib.h", ":lib_o"], outs = ["hello.bin"],
        cmd = "gcc -O2 -I$$(dirname $(location lib.h)) $(location main.c) $(location :lib_o) -o $@")
genrule(name = "blob", outs = ["blob.bin"], cmd = "head -c 6000000 /dev/urandom > $@")
genrule(name = "empty", outs = ["empty.txt"], cmd = "touch $@")
genrule(name = "small", outs = ["small.txt"], cmd = "echo small > $@")
filegroup(name = "all", srcs = [":hello", ":blob", ":empty", ":small"])
'''
OUTPUTS = ["lib.o", "hello.bin", "blob.bin", "empty.txt", "small.txt"]


def bazel_processes(stderr: str) -> tuple[int, int, int]:
    """``(total, internal, remote cache hits)`` from Bazel's "INFO: N processes: ..." line."""
    m = re.search(r"INFO: (\d+) process(?:es)?(?:: (.*?))?\.?\n", stderr)
    assert m, stderr[-2000:]
    total = int(m.group(1))
    parts = dict((k.strip(), int(n)) for n, k in (p.strip().split(" ", 1) for p in (m.group(2) or "").split(",") if p.strip()))
    return total, parts.get("internal", 0), parts.get("remote cache hit", 0)


@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("bazel") is None or shutil.which("gcc") is None, reason="needs bazel (bazel-bootstrap) and gcc")
def test_bazel_grpc_rebuild_is_all_remote_hits_and_identical(tmp_path: Any) -> None:
    from test_httpcache import bazel_workspace

    ws = tmp_path / "ws"
    bazel_workspace(ws, BAZEL_BUILD)
    bazel = ["bazel", f"--output_user_root={tmp_path / 'root'}", "--batch"]
    cache = HttpCache(tmp_path / "store", bearer=TOKEN).start()
    face = GrpcCache(cache, "127.0.0.1", 0).start()
    try:
        flags = [f"--remote_cache=grpc://127.0.0.1:{face.port}", f"--remote_header=authorization=Bearer {TOKEN}",
                 "--noshow_progress"]

        def build() -> str:
            r = subprocess.run(bazel + ["build", *flags, "//:all"], cwd=ws, capture_output=True, text=True, timeout=200)
            assert r.returncode == 0, r.stderr[-3000:]
            return r.stderr

        first = build()
        total1, internal1, hits1 = bazel_processes(first)
        assert hits1 == 0 and total1 - internal1 == len(OUTPUTS)
        outs1 = {n: (ws / "bazel-bin" / n).read_bytes() for n in OUTPUTS}
        assert len(outs1["blob.bin"]) == 6_000_000 and outs1["empty.txt"] == b""
        subprocess.run(bazel + ["clean"], cwd=ws, check=True, capture_output=True, timeout=100)
        second = build()
        total2, internal2, hits2 = bazel_processes(second)
        line = re.search(r"INFO: \d+ process.*", second)
        print(line.group(0) if line else "")
        assert hits2 == total2 - internal2 == len(OUTPUTS), second[-2000:]
        for n in OUTPUTS:
            assert (ws / "bazel-bin" / n).read_bytes() == outs1[n], n
        assert subprocess.run([str(ws / "bazel-bin" / "hello.bin")], capture_output=True, text=True).stdout == "5\n"
        m = cache.metrics.counts
        assert m["ac.hits"] == len(OUTPUTS) and m.get("grpc.unauthenticated", 0) == 0
    finally:
        subprocess.run(bazel + ["shutdown"], cwd=ws, capture_output=True, timeout=60)
        face.stop()
        cache.stop()


@pytest.mark.timeout(60)
def test_bytestream_write_of_a_stored_blob_returns_at_once(serve: Callable[..., Served]) -> None:
    """A second Write of a large blob already stored is answered with its full size at once (the
    REAPI's early return) without reading the rest of the stream; the blob reads back intact, and a
    Write of other bytes under the same digest is still never stored."""
    s = serve()
    data = os.urandom(3 * 1024 * 1024 + 5)
    h, n = sha(data), len(data)
    assert s.bs.Write(writes(f"uploads/a/blobs/{h}/{n}", data, 16 * 1024)).committed_size == n
    sent = [0]

    def counted() -> Iterator[Any]:
        for w in writes(f"uploads/b/blobs/{h}/{n}", data, 16 * 1024):
            sent[0] += 1
            yield w

    assert s.bs.Write(counted()).committed_size == n
    assert sent[0] < n // (16 * 1024)  # not every message was taken
    assert s.cache.metrics.counts.get("cas.puts_skipped") == 1
    got = b"".join(x.data for x in s.bs.Read(bs.ReadRequest(resource_name=f"blobs/{h}/{n}")))
    assert got == data


def test_reads_hold_a_slot_for_store_work_only(serve: Callable[..., Served]) -> None:
    """With one read slot, a batch read of a blob read in a worker is answered (a read takes its
    slot for each piece of store work, never around a call that takes another), and so is it while
    a ByteStream Read of a large blob waits unread by its client."""
    s = serve(concurrency=1)
    small, big = os.urandom(1 << 20), os.urandom(8 << 20)  # above the size read on the event loop
    upload(s, [small])
    w = bs_grpc.ByteStreamStub(s.channel).Write(writes(f"uploads/{'0' * 8}/blobs/{sha(big)}/{len(big)}", big, 1 << 20))
    assert w.committed_size == len(big)
    r = s.cas.BatchReadBlobs(re_pb.BatchReadBlobsRequest(digests=[dg(small)]), timeout=20)
    assert r.responses[0].status.code == 0 and r.responses[0].data == small
    unread = bs_grpc.ByteStreamStub(s.channel).Read(bs.ReadRequest(resource_name=f"blobs/{sha(big)}/{len(big)}"), timeout=30)
    first = next(unread)  # started, then left unread: its stream waits on flow control
    assert first.data
    r = s.cas.BatchReadBlobs(re_pb.BatchReadBlobsRequest(digests=[dg(small)]), timeout=20)
    assert r.responses[0].data == small
    unread.cancel()


@pytest.mark.timeout(60)
def test_a_hot_v2_blob_of_pieces_is_hashed_once_and_a_flipped_piece_never_served(
        serve: Callable[..., Served], monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from tb5sync.store import blobs as blobs_mod
    from tb5sync.store import store as store_mod

    s = serve()
    assert s.cache.store.version == 2
    data = os.urandom(3 * 1024 * 1024 + 77)  # chunks of 256 KiB or more: kept as recipes of pieces
    h, n = sha(data), len(data)
    assert s.bs.Write(writes(f"uploads/v2/blobs/{h}/{n}", data, 1 << 20)).committed_size == n
    calls = [0]
    real = blobs_mod.chunk_digest

    def counting(b: Any) -> bytes:
        calls[0] += 1
        return real(b)

    monkeypatch.setattr(blobs_mod, "chunk_digest", counting)
    monkeypatch.setattr(store_mod, "chunk_digest", counting)
    read = bs.ReadRequest(resource_name=f"blobs/{h}/{n}")
    assert b"".join(x.data for x in s.bs.Read(read)) == data
    first = calls[0]
    assert first >= 2
    assert b"".join(x.data for x in s.bs.Read(read)) == data
    assert calls[0] == first  # hot: not hashed again
    # a byte of a piece flipped in its pack after verification: found, the blob dropped
    key = f"cas/{h}"
    info = blobs_mod.blob(s.cache.store, key, False)
    pieces = s.cache.store.recipe(info.chunks[0][0])
    assert pieces is not None
    pack, offset, length = s.cache.store._q("SELECT pack, offset, length FROM chunks WHERE digest=?", (pieces[2][0],))[0]
    time.sleep(0.03)
    with open(s.cache.store.packs.path(pack), "r+b") as f:
        f.seek(offset + length // 2)
        b = f.read(1)
        f.seek(offset + length // 2)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(grpc.RpcError) as e:
        got = b"".join(x.data for x in s.bs.Read(read))
        assert got != data
    assert e.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DATA_LOSS)
    assert blobs_mod.blob(s.cache.store, key, False) is None
    assert code_of(lambda: list(s.bs.Read(read))) == grpc.StatusCode.NOT_FOUND
