"""The HTTP build cache (tb5sync.cache.httpcache): Bazel's HTTP remote cache protocol and ccache's HTTP
remote storage, each as its clients use it.

Expected behaviour is taken from Bazel's remote caching documentation (``/ac/`` and ``/cas/``
keyed by SHA-256, 200 hit / 404 miss, PUT answered 200), bazel-remote (a CAS upload whose body
does not hash to its key is refused with 400; an ActionResult whose CAS blobs are gone is a miss)
and ccache's remote storage documentation (``subdirs``, ``flat`` and ``bazel`` layouts; 404 miss).
Real ccache runs in ``test_ccache_rebuild_gets_remote_hits``.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import http_cache_port

from tb5sync.cli.command import main
from tb5sync.cache.httpcache import EMPTY_SHA256, HttpCache, parse_action_result
from tb5sync.store.blobs import blob_keys


@pytest.fixture
def cache(tmp_path: Any) -> Iterator[HttpCache]:
    with HttpCache(tmp_path / "store") as c:
        yield c


_OPEN: list[http.client.HTTPConnection] = []
_STOP: list[HttpCache] = []


@pytest.fixture(autouse=True)
def _close_connections() -> Iterator[None]:
    yield
    while _OPEN:
        _OPEN.pop().close()
    while _STOP:
        _STOP.pop().stop()


def conn(c: HttpCache) -> http.client.HTTPConnection:
    h = http.client.HTTPConnection("127.0.0.1", c.port, timeout=30)
    _OPEN.append(h)
    return h


def req(h: http.client.HTTPConnection, method: str, path: str, body: bytes | None = None,
        headers: dict[str, str] | None = None) -> tuple[int, bytes, http.client.HTTPResponse]:
    h.request(method, path, body=body, headers=headers or {})
    r = h.getresponse()
    return r.status, r.read(), r


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


# ---- protobuf encoding of REAPI messages (field numbers from remote_execution.proto) ----
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _ld(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def digest_pb(data: bytes) -> bytes:
    return _ld(1, sha(data).encode()) + _varint(2 << 3) + _varint(len(data))  # Digest{hash=1, size_bytes=2}


def action_result(files: list[bytes], stdout: bytes | None = None, tree: bytes | None = None) -> bytes:
    out = b""
    for k, f in enumerate(files):  # output_files = 2: OutputFile{path = 1, digest = 2}
        out += _ld(2, _ld(1, f"out/{k}".encode()) + _ld(2, digest_pb(f)))
    if tree is not None:  # output_directories = 3: OutputDirectory{path = 1, tree_digest = 3}
        out += _ld(3, _ld(1, b"dir") + _ld(3, digest_pb(tree)))
    out += _varint(4 << 3) + _varint(0)  # exit_code = 4
    if stdout is not None:
        out += _ld(6, digest_pb(stdout))  # stdout_digest = 6
    return out


def tree_pb(files: list[bytes]) -> bytes:
    # Tree{root = 1: Directory{files = 1: FileNode{name = 1, digest = 2}}}
    root = b"".join(_ld(1, _ld(1, f"f{k}".encode()) + _ld(2, digest_pb(f))) for k, f in enumerate(files))
    return _ld(1, root)


# ---- Bazel's protocol ----
def test_cas_hit_miss_put_and_head(cache: HttpCache) -> None:
    h = conn(cache)
    blob = os.urandom(3 * 1024 * 1024 + 11)
    key = f"/cas/{sha(blob)}"
    assert req(h, "GET", key)[0] == 404
    assert req(h, "HEAD", key)[0] == 404
    assert req(h, "PUT", key, blob)[0] == 200
    status, body, r = req(h, "GET", key)
    assert status == 200 and body == blob
    status, body, r = req(h, "HEAD", key)
    assert status == 200 and body == b"" and int(r.headers["Content-Length"]) == len(blob)
    # the empty blob is always there (Bazel never uploads it)
    assert req(h, "GET", f"/cas/{EMPTY_SHA256}")[:2] == (200, b"")


def test_cas_put_with_wrong_digest_is_refused_and_stores_nothing(cache: HttpCache) -> None:
    h = conn(cache)
    good = b"some compiler output"
    wrong = sha(b"something else")
    assert req(h, "PUT", f"/cas/{wrong}", good)[0] == 400
    assert req(h, "GET", f"/cas/{wrong}")[0] == 404
    assert blob_keys(cache.store) == []
    assert cache.store.stats()["chunks"] == 0


@pytest.mark.parametrize("sent", [0, 1, 500_000])
def test_body_cut_off_before_content_length_stores_nothing(cache: HttpCache, sent: int) -> None:
    data = os.urandom(1_000_000)
    key = f"/cas/{sha(data)}"
    s = socket.create_connection(("127.0.0.1", cache.port), timeout=10)
    s.sendall(f"PUT {key} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data[:sent])
    s.shutdown(socket.SHUT_WR)
    s.settimeout(10)
    try:
        while s.recv(65536):
            pass
    except OSError:
        pass
    s.close()
    h = conn(cache)
    assert req(h, "GET", key)[0] == 404
    # a kv (ccache) key is held to the same rule
    s = socket.create_connection(("127.0.0.1", cache.port), timeout=10)
    s.sendall(b"PUT /ab/cdef HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"x" * min(sent, 99))
    s.close()
    assert req(h, "GET", "/ab/cdef")[0] == 404
    assert blob_keys(cache.store) == []
    # the server still serves
    assert req(h, "PUT", key, data)[0] == 200
    assert req(h, "GET", key)[1] == data


def test_keep_alive_reuses_one_connection(cache: HttpCache) -> None:
    h = conn(cache)
    blobs = [os.urandom(n) for n in (10, 70_000, 2_000_000)]
    req(h, "GET", "/cas/" + "0" * 64)
    sock = h.sock
    assert sock is not None
    for b in blobs:
        status, _, r = req(h, "PUT", f"/cas/{sha(b)}", b)
        assert status == 200 and not r.will_close
        status, body, r = req(h, "GET", f"/cas/{sha(b)}")
        assert status == 200 and body == b and not r.will_close
        assert req(h, "GET", f"/ac/{sha(b)}")[0] == 404
    assert h.sock is sock  # never reconnected


def test_concurrent_puts_of_one_key(cache: HttpCache) -> None:
    data = os.urandom(4 * 1024 * 1024)
    key = f"/cas/{sha(data)}"
    statuses: list[int] = []

    def put() -> None:
        statuses.append(req(conn(cache), "PUT", key, data)[0])

    threads = [threading.Thread(target=put) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert statuses == [200] * 8
    assert req(conn(cache), "GET", key)[1] == data
    st = cache.store.stats()
    assert st["blobs"] == 1 and st["unique_bytes"] == len(data)


def test_action_result_is_a_hit_only_while_its_cas_blobs_are_there(cache: HttpCache) -> None:
    h = conn(cache)
    out1, out2, stdout = os.urandom(5000), os.urandom(300_000), b"compiled\n"
    ar = action_result([out1, out2], stdout=stdout)
    assert parse_action_result(ar)[0] == [(sha(out1), 5000), (sha(out2), 300_000), (sha(stdout), len(stdout))]
    akey = "/ac/" + sha(b"the action")
    assert req(h, "PUT", akey, ar)[0] == 200
    assert req(h, "GET", akey)[0] == 404  # no CAS blob yet
    for b in (out1, out2):
        assert req(h, "PUT", f"/cas/{sha(b)}", b)[0] == 200
    assert req(h, "GET", akey)[0] == 404  # stdout still missing
    assert req(h, "PUT", f"/cas/{sha(stdout)}", stdout)[0] == 200
    assert req(h, "GET", akey)[:2] == (200, ar)
    assert req(h, "DELETE", f"/cas/{sha(out2)}")[0] == 200
    assert req(h, "GET", akey)[0] == 404
    # an output directory: the Tree and every file in it
    f = os.urandom(1000)
    tree = tree_pb([f])
    ar2 = action_result([], tree=tree)
    akey2 = "/ac/" + sha(b"another action")
    assert req(h, "PUT", akey2, ar2)[0] == 200
    assert req(h, "PUT", f"/cas/{sha(tree)}", tree)[0] == 200
    assert req(h, "GET", akey2)[0] == 404  # the tree's file is missing
    assert req(h, "PUT", f"/cas/{sha(f)}", f)[0] == 200
    assert req(h, "GET", akey2)[:2] == (200, ar2)


def test_malformed_action_result_is_refused(cache: HttpCache) -> None:
    h = conn(cache)
    akey = "/ac/" + sha(b"x")
    assert req(h, "PUT", akey, b"\x12\xff\xff")[0] == 400  # a length beyond the message
    assert req(h, "PUT", akey, _ld(2, _ld(2, _ld(1, b"not-a-sha256"))))[0] == 400
    assert req(h, "GET", akey)[0] == 404
    assert req(h, "PUT", akey, b"")[0] == 200  # an empty ActionResult is well-formed


def test_instance_prefix_keeps_ac_and_cas_together(tmp_path: Any) -> None:
    """Bazel instance names are first path segments declared as such (``--bazel-instance``)."""
    cache = HttpCache(tmp_path / "store", bazel_instances=["inst", "other"]).start()
    _STOP.append(cache)
    h = conn(cache)
    out = b"object code"
    ar = action_result([out])
    assert req(h, "PUT", f"/inst/cas/{sha(out)}", out)[0] == 200
    assert req(h, "PUT", "/inst/ac/" + sha(b"a"), ar)[0] == 200
    assert req(h, "GET", "/inst/ac/" + sha(b"a"))[0] == 200
    assert req(h, "PUT", "/other/ac/" + sha(b"a"), ar)[0] == 200
    assert req(h, "GET", "/other/ac/" + sha(b"a"))[0] == 404  # its CAS is /other/cas/


# ---- ccache's key paths, access, metrics ----
def test_kv_keys_get_put_delete(cache: HttpCache) -> None:
    h = conn(cache)
    for key in ("/ab/cdefgh", "/flatkey0123", "/deep/a/b/c/d"):
        assert req(h, "GET", key)[0] == 404
        assert req(h, "PUT", key, b"v" + key.encode())[0] == 200
        assert req(h, "GET", key)[:2] == (200, b"v" + key.encode())
        assert req(h, "PUT", key, b"replaced")[0] == 200
        assert req(h, "GET", key)[1] == b"replaced"
        assert req(h, "DELETE", key)[0] == 200
        assert req(h, "GET", key)[0] == 404
        assert req(h, "DELETE", key)[0] == 404
    assert req(h, "PUT", "/a//b", b"x")[0] == 400
    assert req(h, "POST", "/a", b"x")[0] == 405


def test_read_only_serves_hits_and_refuses_writes(tmp_path: Any) -> None:
    data = b"cached"
    with HttpCache(tmp_path / "store") as c:
        assert req(conn(c), "PUT", "/k", data)[0] == 200
    with HttpCache(tmp_path / "store", read_only=True) as c:
        h = conn(c)
        assert req(h, "GET", "/k")[:2] == (200, data)
        assert req(h, "PUT", "/k", b"other")[0] == 403
        assert req(h, "PUT", "/new", b"other")[0] == 403
        assert req(h, "DELETE", "/k")[0] == 403
        assert req(h, "GET", "/k")[1] == data and req(h, "GET", "/new")[0] == 404


def test_basic_and_bearer_auth(tmp_path: Any) -> None:
    with HttpCache(tmp_path / "store", basic="alice:s3cret", bearer="tok123") as c:
        h = conn(c)
        status, _, r = req(h, "PUT", "/k", b"x")
        assert status == 401 and r.headers["WWW-Authenticate"].startswith("Basic")
        assert req(h, "GET", "/k", headers={"Authorization": "Bearer wrong"})[0] == 401
        good = "Basic " + base64.b64encode(b"alice:s3cret").decode()
        bad = "Basic " + base64.b64encode(b"alice:guess").decode()
        assert req(h, "PUT", "/k", b"x", {"Authorization": bad})[0] == 401
        assert req(h, "PUT", "/k", b"x", {"Authorization": good})[0] == 200
        assert req(h, "GET", "/k", headers={"Authorization": "Bearer tok123"})[:2] == (200, b"x")
        assert req(h, "GET", "/metrics")[0] == 401


def test_allow_list(tmp_path: Any) -> None:
    with HttpCache(tmp_path / "store", allow=["10.0.0.0/8"]) as c:
        assert req(conn(c), "GET", "/k")[0] == 403
    with HttpCache(tmp_path / "store", allow=["10.0.0.0/8", "127.0.0.0/8"]) as c:
        assert req(conn(c), "GET", "/k")[0] == 404


def test_metrics_status_and_store_stats(tmp_path: Any, capsys: Any) -> None:
    with HttpCache(tmp_path / "store") as c:
        h = conn(c)
        data = os.urandom(1000)
        req(h, "GET", f"/cas/{sha(data)}")
        req(h, "PUT", f"/cas/{sha(data)}", data)
        req(h, "GET", f"/cas/{sha(data)}")
        req(h, "GET", f"/cas/{sha(data)}")
        text = req(h, "GET", "/metrics")[1].decode()
        assert 'tb5sync_httpcache_hits_total{kind="cas"} 2' in text
        assert 'tb5sync_httpcache_misses_total{kind="cas"} 1' in text
        assert 'tb5sync_httpcache_bytes_sent_total{kind="cas"} 2000' in text
        assert 'tb5sync_httpcache_bytes_received_total{kind="cas"} 1000' in text
        assert 'tb5sync_httpcache_request_seconds_count{method="GET"} 3' in text
        assert 'tb5sync_httpcache_request_seconds_bucket{method="PUT",le="+Inf"} 1' in text
        st = json.loads(req(h, "GET", "/status")[1])
        assert st["counters"]["cas.hits"] == 2 and st["store"]["blobs"] == 1
    assert main(["store", "--store", str(tmp_path / "store"), "stats", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["http_cache"]["cas.hits"] == 2 and out["http_cache"]["cas.misses"] == 1
    assert main(["store", "--store", str(tmp_path / "store"), "stats"]) == 0
    assert "http cache cas.hits: 2" in capsys.readouterr().out


def test_quota_evicts_least_recently_used_entries(tmp_path: Any) -> None:
    from tb5sync.store import Store

    with Store(tmp_path / "store") as st:
        st.set_quota(1_000_000)
    with HttpCache(tmp_path / "store") as c:
        h = conn(c)
        blobs = [os.urandom(300_000) for _ in range(6)]
        for b in blobs:
            assert req(h, "PUT", f"/cas/{sha(b)}", b)[0] == 200
        deadline = __import__("time").time() + 30
        while c.store.stats()["stored_bytes"] > 1_000_000 and __import__("time").time() < deadline:
            __import__("time").sleep(0.1)
        assert c.store.stats()["stored_bytes"] <= 1_000_000
        held = [req(h, "GET", f"/cas/{sha(b)}")[0] for b in blobs]
        assert held[-1] == 200 and held.count(200) <= 3 and held[0] == 404


# ---- real ccache ----
C_HEADER = "#ifndef SHAPES_H\n#define SHAPES_H\nstruct pt { double x, y; };\ndouble area(const struct pt *p, int n);\n#endif\n"


def c_sources(d: str, n: int = 6) -> list[str]:
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "shapes.h"), "w") as f:
        f.write(C_HEADER)
    paths = []
    for k in range(n):
        p = os.path.join(d, f"unit{k}.c")
        with open(p, "w") as f:
            f.write('#include <stdio.h>\n#include <string.h>\n#include "shapes.h"\n'
                    f"static const char tag{k}[] = \"unit {k}\";\n"
                    f"double area{k}(const struct pt *p, int n) {{\n  double s = 0;\n"
                    f"  for (int i = 0; i < n; i++) s += p[i].x * p[(i + 1) % n].y - p[(i + 1) % n].x * p[i].y;\n"
                    f"  return s / 2 * {k + 1};\n}}\n"
                    f"int name{k}(char *out, size_t len) {{ return snprintf(out, len, \"%s %zu\", tag{k}, strlen(tag{k})); }}\n")
        paths.append(p)
    return paths


@pytest.mark.skipif(shutil.which("ccache") is None or shutil.which("gcc") is None, reason="needs ccache and gcc")
@pytest.mark.parametrize("layout", ["subdirs", "flat", "bazel"])
def test_ccache_rebuild_gets_remote_hits(tmp_path: Any, layout: str) -> None:
    srcs = c_sources(str(tmp_path / "src"))
    ref = tmp_path / "ref"
    ref.mkdir()
    for s in srcs:  # the reference: the compiler alone
        subprocess.run(["gcc", "-c", "-O2", s, "-o", str(ref / (os.path.basename(s) + ".o"))], check=True)
    # ccache's bazel layout stores its own entries under /ac/, so the server must not check them as ActionResults
    with HttpCache(tmp_path / "store", ac_validation=layout != "bazel") as c:
        env = dict(os.environ, CCACHE_DIR=str(tmp_path / "ccache"), CCACHE_CONFIGPATH=str(tmp_path / "ccache.conf"),
                   CCACHE_REMOTE_STORAGE=f"http://127.0.0.1:{c.port}/cc|layout={layout}", CCACHE_BASEDIR=str(tmp_path))

        def build(out: str) -> dict[str, int]:
            os.makedirs(out)
            subprocess.run(["ccache", "-z"], env=env, check=True, capture_output=True)
            for s in srcs:
                subprocess.run(["ccache", "gcc", "-c", "-O2", s, "-o", os.path.join(out, os.path.basename(s) + ".o")],
                               env=env, check=True, cwd=str(tmp_path))
            text = subprocess.run(["ccache", "--print-stats"], env=env, check=True, capture_output=True, text=True).stdout
            return {k: int(v) for k, v in (line.split("\t") for line in text.splitlines())}

        first = build(str(tmp_path / "b1"))
        assert first["remote_storage_miss"] == len(srcs) and first["remote_storage_hit"] == 0
        keys = blob_keys(c.store, "cc/")
        assert len(keys) >= len(srcs)
        if layout == "bazel":
            assert all(k.startswith("cc/ac/") for k in keys)
        elif layout == "subdirs":
            assert all(len(k.split("/")[1]) == 2 for k in keys)
        else:
            assert all(k.count("/") == 1 for k in keys)
        subprocess.run(["ccache", "-C"], env=env, check=True, capture_output=True)  # wipe the local cache
        second = build(str(tmp_path / "b2"))
        assert second["remote_storage_hit"] == len(srcs) and second["remote_storage_miss"] == 0
        assert second["local_storage_hit"] == 0
        shown = subprocess.run(["ccache", "-s"], env=env, check=True, capture_output=True, text=True).stdout
        assert "Remote storage:" in shown
    for s in srcs:
        name = os.path.basename(s) + ".o"
        expect = (ref / name).read_bytes()
        assert (tmp_path / "b1" / name).read_bytes() == expect
        assert (tmp_path / "b2" / name).read_bytes() == expect


# ---- real Bazel (Debian's bazel-bootstrap; offline, so genrules that call gcc: cc_* rules need a download) ----
BAZEL_BUILD = '''
genrule(name = "lib_o", srcs = ["lib.c", "lib.h"], outs = ["lib.o"], cmd = "gcc -O2 -c $(location lib.c) -o $@")
genrule(name = "hello", srcs = ["main.c", "lib.h", ":lib_o"], outs = ["hello.bin"],
        cmd = "gcc -O2 -I$$(dirname $(location lib.h)) $(location main.c) $(location :lib_o) -o $@")
'''


def bazel_workspace(ws: Any, build: str) -> None:
    """A Bazel workspace in the directory ``ws`` (a Path, created): ``build`` as its BUILD file, and
    the C sources its genrules compile (lib.h, lib.c, main.c)."""
    ws.mkdir()
    (ws / "WORKSPACE").write_text("")
    (ws / "BUILD").write_text(build)
    (ws / "lib.h").write_text("int add(int a, int b);\n")
    (ws / "lib.c").write_text('#include "lib.h"\nint add(int a, int b) { return a + b; }\n')
    (ws / "main.c").write_text('#include <stdio.h>\n#include "lib.h"\nint main(void) { printf("%d\\n", add(2, 3)); return 0; }\n')


@pytest.mark.skipif(shutil.which("bazel") is None or shutil.which("gcc") is None, reason="needs bazel (bazel-bootstrap) and gcc")
def test_bazel_build_gets_remote_hits_after_clean(tmp_path: Any) -> None:
    ws = tmp_path / "ws"
    bazel_workspace(ws, BAZEL_BUILD)
    bazel = ["bazel", f"--output_user_root={tmp_path / 'root'}", "--batch"]
    with HttpCache(tmp_path / "store") as c:  # ActionResults checked (the default)
        flags = [f"--remote_cache=http://127.0.0.1:{c.port}", "--noshow_progress"]

        def build() -> str:
            r = subprocess.run(bazel + ["build", *flags, "//:hello"], cwd=ws, capture_output=True, text=True, timeout=100)
            assert r.returncode == 0, r.stderr[-2000:]
            return r.stderr

        first = build()
        assert "remote cache hit" not in first
        out1 = (ws / "bazel-bin" / "hello.bin").read_bytes()
        subprocess.run(bazel + ["clean"], cwd=ws, check=True, capture_output=True, timeout=100)
        second = build()
        assert "2 remote cache hit" in second
        assert (ws / "bazel-bin" / "hello.bin").read_bytes() == out1
        assert subprocess.run([str(ws / "bazel-bin" / "hello.bin")], capture_output=True, text=True).stdout == "5\n"
        assert c.metrics.counts["ac.hits"] == 2
    subprocess.run(bazel + ["shutdown"], cwd=ws, capture_output=True, timeout=60)


@pytest.mark.parametrize("how", ["serve", "http-cache"])
def test_cli_serves_the_cache_and_stops_on_sigterm(tmp_path: Any, how: str) -> None:
    import signal
    import sys

    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "basic").write_text("bob:pw\n")
    if how == "serve":
        args = ["serve", str(root), "--bind", "127.0.0.1:0", "--http-cache", "127.0.0.1:0"]
        store = root / ".tb5sync" / "store"
    else:
        store = tmp_path / "store"
        args = ["http-cache", str(store), "--bind", "127.0.0.1:0", "--read-only"]
    p = subprocess.Popen([sys.executable, "-m", "tb5sync.cli", *args, "--http-basic-file", str(tmp_path / "basic")],
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stderr is not None
        port = http_cache_port(p.stderr)
        assert port
        h = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        _OPEN.append(h)
        auth = {"Authorization": "Basic " + base64.b64encode(b"bob:pw").decode()}
        assert req(h, "GET", "/k", headers=auth)[0] == 404
        assert req(h, "PUT", "/k", b"v", headers={})[0] == 401
        assert req(h, "PUT", "/k", b"v", headers=auth)[0] == (200 if how == "serve" else 403)
    finally:
        p.send_signal(signal.SIGTERM)
        err = p.communicate(timeout=30)[1]
        assert p.returncode == 0, err
    from tb5sync.store import Store
    from tb5sync.store.blobs import counters

    with Store(store) as st:
        got = counters(st)
        assert got["kv.misses"] == 1
        assert got.get("kv.puts", 0) == (1 if how == "serve" else 0)


def test_stalled_upload_is_cut_and_frees_its_slot(tmp_path: Any) -> None:
    import time

    with HttpCache(tmp_path / "store", concurrency=1, client_body_timeout=0.5) as c:
        s = socket.create_connection(("127.0.0.1", c.port), timeout=10)
        try:
            s.sendall(b"PUT /stalled HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"x" * 10)
            time.sleep(0.2)  # the upload holds the only request slot now
            t0 = time.monotonic()
            h = conn(c)
            assert req(h, "PUT", "/other", b"v")[0] == 200  # waits for the slot, served once the stall is cut
            assert time.monotonic() - t0 >= 0.2
            assert req(h, "GET", "/stalled")[0] == 404
            assert c.metrics.counts["kv.puts_cut"] == 1
        finally:
            s.close()


def test_concurrent_small_puts_are_written_together(cache: HttpCache) -> None:
    from concurrent.futures import ThreadPoolExecutor

    blobs = [os.urandom(4096) for _ in range(120)]

    def put(chunk: list[bytes]) -> list[int]:
        h = http.client.HTTPConnection("127.0.0.1", cache.port, timeout=30)
        try:
            return [req(h, "PUT", f"/cas/{sha(b)}", b)[0] for b in chunk]
        finally:
            h.close()

    with ThreadPoolExecutor(8) as ex:
        statuses = [s for part in ex.map(put, [blobs[k::8] for k in range(8)]) for s in part]
    assert statuses == [200] * len(blobs)
    h = conn(cache)
    assert all(req(h, "GET", f"/cas/{sha(b)}")[1] == b for b in blobs)
    st = cache.store.stats()
    assert st["blobs"] == len(blobs)
    assert st["packs"] < len(blobs)  # group commit: PUTs that arrived together share a pack


def test_entry_damaged_past_its_first_chunk_is_cut_short_then_dropped(cache: HttpCache) -> None:
    """A chunk found damaged while a body streams cuts the response short of its Content-Length
    (the status is already sent) and drops the entry: the next GET is a clean miss, not the same
    short body again."""
    from tb5sync.store.blobs import blob as blob_info

    data = os.urandom(6 * 1024 * 1024)  # several chunks
    key = f"/cas/{sha(data)}"
    h = conn(cache)
    assert req(h, "PUT", key, data)[0] == 200
    info = blob_info(cache.store, key.lstrip("/"), False) or blob_info(cache.store, key, False)
    assert info is not None and len(info.chunks) >= 2
    digest = info.chunks[-1][0]
    rows = cache.store._q("SELECT pieces FROM recipes WHERE digest=?", (digest,))
    if rows:  # store format v2: the chunk is kept as pieces; damage one of them
        from tb5sync.store.pieces import blob_to_recipe

        digest = blob_to_recipe(bytes(rows[0][0]))[0][0]
    pack, offset, _ = cache.store._q("SELECT pack, offset, length FROM chunks WHERE digest=?", (digest,))[0]
    with open(cache.store.packs.path(pack), "r+b") as f:
        f.seek(offset + 100)
        b = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([b[0] ^ 1]))
    h2 = conn(cache)
    h2.request("GET", key)
    r = h2.getresponse()
    assert r.status == 200
    with pytest.raises(http.client.IncompleteRead):
        r.read()
    assert req(conn(cache), "GET", key)[0] == 404


@pytest.mark.parametrize("name", ["notahex", "ABCDEF" + "0" * 58, "0" * 63, "0" * 65])
def test_cas_and_ac_keys_must_be_sha256_digests(tmp_path: Any, name: str) -> None:
    """Only a lowercase SHA-256 hex name below ``/ac/`` or ``/cas/`` is Bazel's. Another name there is
    no Bazel request (ccache's ``subdirs`` layout without a URL prefix makes such paths): it is an
    opaque key, never read back as a CAS blob (so it skips no digest check Bazel relies on). Below a
    declared Bazel instance every name must be a digest (400, as bazel-remote)."""
    cache = HttpCache(tmp_path / "store", bazel_instances=["inst"]).start()
    _STOP.append(cache)
    h = conn(cache)
    assert req(h, "PUT", f"/inst/cas/{name}", b"other")[0] == 400
    assert req(h, "GET", f"/inst/cas/{name}")[0] == 400
    assert blob_keys(cache.store) == []
    for ns in ("cas", "ac"):
        assert req(h, "PUT", f"/{ns}/{name}", b"other")[0] == 200
        assert req(h, "GET", f"/{ns}/{name}")[:2] == (200, b"other")
    assert req(h, "GET", f"/cas/{hashlib.sha256(b'other').hexdigest()}")[0] == 404
