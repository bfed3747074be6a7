"""Routing of the HTTP build cache by the first path segment only (issue 21).

A client's keys never collide with the Bazel routes (``/ac/``, ``/cas/``), the reserved
``/metrics`` and ``/status``, or each other: ccache's ``subdirs`` layout puts a key beginning
``ac`` under ``/PREFIX/ac/...``, its ``bazel`` layout under ``/PREFIX/ac/<64 hex>``, sccache's
WebDAV backend under ``/PREFIX/a/b/c/KEY``. The request shapes are ccache 4.7's
(``src/storage/remote/HttpStorage.cpp``: ``get_entry_path``; a key is 2 bytes of base16 then 18
of base32hex, 33 characters; ``put`` asks ``HEAD`` first, then ``PUT``).
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from tb5sync.cache.httpcache import HttpCache
from tb5sync.store.blobs import blob_keys

pytestmark = pytest.mark.timeout(240)

_B32HEX = str.maketrans("ABCDEFGHIJKLMNOPQRSTUV", "abcdefghijklmnopqrstuv")


def ccache_key(first: int, salt: bytes = b"") -> tuple[str, str]:
    """A ccache 4.7 key whose first byte is ``first``: (its string form, its 40-hex-digit form)."""
    raw = bytes([first]) + hashlib.sha1(bytes([first]) + salt).digest()[:19]
    b32 = base64.b32hexencode(raw[2:]).decode().rstrip("=").translate(_B32HEX).lower()
    return raw[:2].hex() + b32, raw.hex()


def ccache_path(layout: str, prefix: str, first: int) -> str:
    """The URL path ccache 4.7 uses for a key beginning with byte ``first`` under ``prefix``."""
    key, hexed = ccache_key(first)
    base = f"/{prefix}/" if prefix else "/"
    if layout == "bazel":
        return f"{base}ac/{(hexed + hexed)[:64]}"
    if layout == "flat":
        return base + key
    return f"{base}{key[:2]}/{key[2:]}"


@pytest.fixture
def cache(tmp_path: Any) -> Iterator[HttpCache]:
    with HttpCache(tmp_path / "store") as c:  # ActionResults checked: the default
        yield c


@pytest.fixture
def h(cache: HttpCache) -> Iterator[http.client.HTTPConnection]:
    c = http.client.HTTPConnection("127.0.0.1", cache.port, timeout=30)
    yield c
    c.close()


def req(h: http.client.HTTPConnection, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    h.request(method, path, body=body, headers={"Content-Type": "application/octet-stream"} if body else {})
    r = h.getresponse()
    return r.status, r.read()


def round_trips(h: http.client.HTTPConnection, layout: str, prefix: str) -> list[tuple[str, list[int]]]:
    """HEAD (miss), PUT, HEAD, GET, DELETE, GET of a key for each of the 256 first bytes, as ccache
    sends them; the paths whose answers were not 404 200 200 200 (same body) 200 404."""
    wrong = []
    for first in range(256):
        path = ccache_path(layout, prefix, first)
        body = b"entry " + path.encode()
        got = [req(h, "HEAD", path)[0], req(h, "PUT", path, body)[0], req(h, "HEAD", path)[0]]
        status, back = req(h, "GET", path)
        got += [status, int(back == body), req(h, "DELETE", path)[0], req(h, "GET", path)[0]]
        if got != [404, 200, 200, 200, 1, 200, 404]:
            wrong.append((path, got))
    return wrong


@pytest.mark.parametrize("layout", ["subdirs", "flat", "bazel"])
def test_every_two_character_prefix_of_every_ccache_layout_round_trips(cache: HttpCache, h: Any, layout: str) -> None:
    """HEAD (miss), PUT, HEAD, GET, DELETE of a key for each of the 256 first bytes, as ccache sends them."""
    assert round_trips(h, layout, "ccache") == []
    assert blob_keys(cache.store) == []


@pytest.mark.parametrize("layout", ["subdirs", "flat"])
def test_every_two_character_prefix_round_trips_without_a_url_prefix(cache: HttpCache, h: Any, layout: str) -> None:
    """ccache's default ``remote_storage = http://HOST:PORT`` has no URL prefix: a ``subdirs`` key
    beginning ``ac`` is then ``/ac/<31 characters>``, which no Bazel request can be (Bazel's names are
    64 hex digits), so it is ccache's key, never refused and never taken for an ActionResult."""
    assert round_trips(h, layout, "") == []


def test_every_two_character_prefix_keeps_its_entries_apart(cache: HttpCache, h: Any) -> None:
    """All 3 x 256 keys held at once, each read back as its own value (no route took one, none overwrote another)."""
    paths = [ccache_path(layout, "ccache", first) for layout in ("subdirs", "flat", "bazel") for first in range(256)]
    for p in paths:
        assert req(h, "PUT", p, p.encode())[0] == 200, p
    assert all(req(h, "GET", p) == (200, p.encode()) for p in paths)
    assert len(blob_keys(cache.store, "ccache/")) == len(paths)


@pytest.mark.parametrize("path", [
    "/sccache/a/c/0/ac0" + "1" * 61,     # sccache's WebDAV layout under a prefix
    "/x/ac/" + "0" * 64,                 # a client prefix, then a Bazel-shaped tail
    "/x/cas/notahex",                    # not Bazel's: the first segment is x
    "/ccache/metrics",                   # a reserved name below the first segment
    "/ccache/status/ab",
])
def test_keys_below_a_client_prefix_are_opaque(h: Any, path: str) -> None:
    assert req(h, "PUT", path, b"v")[0] == 200
    assert req(h, "GET", path) == (200, b"v")


@pytest.mark.parametrize("path", ["/metrics", "/status"])
def test_reserved_routes_never_store_a_key(cache: HttpCache, h: Any, path: str) -> None:
    """``PUT /metrics`` used to be stored as key ``metrics`` that no GET could ever read."""
    assert req(h, "PUT", path, b"v")[0] == 405
    assert req(h, "GET", path)[0] == 200
    assert blob_keys(cache.store) == []


@pytest.mark.skipif(shutil.which("ccache") is None or shutil.which("gcc") is None, reason="needs ccache and gcc")
def test_real_ccache_subdirs_key_beginning_ac_is_cached(tmp_path: Any, cache: HttpCache) -> None:
    """A real ccache (subdirs layout, the default) whose manifest or result key begins with ``ac``:
    stored on the first build, a remote hit once the local cache is wiped."""
    src = tmp_path / "src"
    src.mkdir()
    env = dict(os.environ, CCACHE_DIR=str(tmp_path / "ccache"), CCACHE_CONFIGPATH=str(tmp_path / "ccache.conf"),
               CCACHE_REMOTE_STORAGE=f"http://127.0.0.1:{cache.port}/ccache|layout=subdirs",
               CCACHE_LOGFILE=str(tmp_path / "ccache.log"), CCACHE_BASEDIR=str(tmp_path))
    key_re = re.compile(r"(?:Manifest|Result) key: ([0-9a-v]{33})")
    found = None
    for n in range(3000):  # 2 keys a compile: about 1 in 128 compiles has one beginning "ac"
        c = src / f"v{n}.c"
        c.write_text(f"int v{n}(void) {{ return {n}; }}\n")
        (tmp_path / "ccache.log").write_text("")
        subprocess.run(["ccache", "gcc", "-c", str(c), "-o", str(src / f"v{n}.o")], env=env, check=True, cwd=str(tmp_path))
        if any(k.startswith("ac") for k in key_re.findall((tmp_path / "ccache.log").read_text())):
            found = n
            break
    assert found is not None, "no ccache key beginning with ac in 3000 compiles"
    assert any(k.startswith("ccache/ac/") for k in blob_keys(cache.store, "ccache/"))
    subprocess.run(["ccache", "-C"], env=env, check=True, capture_output=True)
    subprocess.run(["ccache", "-z"], env=env, check=True, capture_output=True)
    c = src / f"v{found}.c"
    subprocess.run(["ccache", "gcc", "-c", str(c), "-o", str(src / "again.o")], env=env, check=True, cwd=str(tmp_path))
    text = subprocess.run(["ccache", "--print-stats"], env=env, check=True, capture_output=True, text=True).stdout
    stats = {k: int(v) for k, v in (line.split("\t") for line in text.splitlines())}
    assert stats["remote_storage_hit"] == 1 and stats["remote_storage_miss"] == 0
    assert (src / "again.o").read_bytes() == (src / f"v{found}.o").read_bytes()


def test_an_undeclared_bazel_prefix_is_named_in_one_warning(cache: HttpCache, h: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A PUT to ``NAME/ac/<sha256>`` with NAME undeclared is kept as an opaque key, and the log says
    once how to have it checked as Bazel's (``--bazel-instance NAME``), not silently."""
    import logging

    with caplog.at_level(logging.WARNING, logger="tb5sync.cache.httpcache"):
        for i in range(3):
            assert req(h, "PUT", f"/builds/ac/{hashlib.sha256(bytes([i])).hexdigest()}", b"x")[0] == 200
        assert req(h, "PUT", "/ccache/ab/" + "c" * 31, b"y")[0] == 200
    lines = [r.getMessage() for r in caplog.records if "--bazel-instance" in r.getMessage()]
    assert len(lines) == 1 and "--bazel-instance builds" in lines[0]
