"""Shared pytest fixtures. Each block below belongs to one module's tests; append new blocks."""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Callable

import pytest

# --- the user's cache directory (local and pulled destinations' state) -----------------------


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Local and pulled destinations keep their state in the user's cache directory
    (platformdirs): point it at a directory of this session (subprocesses inherit it)."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("user-cache"))
    yield
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


# --- chunking (tb5sync.engine.chunking / tb5sync._cdc) ----------------------------------------------

import tb5sync.engine.chunking as chunking


@dataclass(frozen=True)
class ChunkerImpl:
    """One chunker twin: its ``cut_points`` function and ``Chunker`` class."""

    name: str
    cut_points: Callable[..., list[int]]
    Chunker: type[Any]


def require_cython() -> bool:
    """True when a missing Cython extension must fail the tests (CI sets TB5SYNC_REQUIRE_CYTHON=1)."""
    return os.environ.get("TB5SYNC_REQUIRE_CYTHON") == "1"


def cython_chunker_or_skip() -> ChunkerImpl:
    """The Cython twin; skips the test when it is not built (fails under TB5SYNC_REQUIRE_CYTHON=1)."""
    if chunking.cy_cut_points is None or chunking.CyChunker is None:
        if require_cython():
            pytest.fail("tb5sync._cdc is not built but TB5SYNC_REQUIRE_CYTHON=1")
        pytest.skip("tb5sync._cdc is not built")
    return ChunkerImpl("cy", chunking.cy_cut_points, chunking.CyChunker)


@pytest.fixture(scope="session", params=["cy", "py"])
def chunker_impl(request: pytest.FixtureRequest) -> ChunkerImpl:
    """Each chunker twin in turn (ids ``cy`` and ``py``)."""
    if request.param == "cy":
        return cython_chunker_or_skip()
    return ChunkerImpl("py", chunking.py_cut_points, chunking.PyChunker)


@pytest.fixture(scope="session")
def cy_chunker() -> ChunkerImpl:
    """The Cython twin only (skipped when not built, unless TB5SYNC_REQUIRE_CYTHON=1)."""
    return cython_chunker_or_skip()


@pytest.fixture(scope="session")
def small_chunk_params() -> chunking.ChunkParams:
    """Small chunk sizes (64 B / 256 B / 1 KiB) so that tests see many chunks in little data."""
    return chunking.ChunkParams(version=0, min_size=64, avg_size=256, max_size=1024)


# --- servers and trees (tb5sync.daemon.server, tb5sync.sync) ----------------------------------------

import shutil
import stat as _stat

from tb5sync.daemon.server import Server


@dataclass
class LiveServer:
    """A `tb5sync.daemon.server.Server` on 127.0.0.1 with a free port, serving ``root``."""

    server: Server
    root: str
    token: bytes | None

    @property
    def port(self) -> int:
        return self.server.port

    def url(self, path: str = "") -> str:
        """``tb5://127.0.0.1:PORT/path``."""
        return f"tb5://127.0.0.1:{self.port}/{path}"


def start_server(root: str, **kw: Any) -> LiveServer:
    """Start a server on 127.0.0.1:0 (the caller stops it)."""
    os.makedirs(root, exist_ok=True)
    srv = Server(root, host="127.0.0.1", port=0, **kw).start()
    return LiveServer(srv, srv.root, kw.get("token"))


@pytest.fixture
def server(tmp_path: Any) -> Any:
    """A live server with no token, root ``tmp_path/server``; stopped at teardown."""
    live = start_server(str(tmp_path / "server"))
    try:
        yield live
    finally:
        live.server.stop()


@pytest.fixture
def token_server(tmp_path: Any) -> Any:
    """A live server requiring the token ``b"s3cret-token"``; stopped at teardown."""
    live = start_server(str(tmp_path / "tserver"), token=b"s3cret-token")
    try:
        yield live
    finally:
        live.server.stop()


def make_tree(base: str, seed: int = 1, files: int = 40) -> str:
    """A small but varied tree: nested dirs, empty file, odd modes, symlinks (relative, absolute, dangling), a 9 MiB file."""
    import random

    rnd = random.Random(seed)
    os.makedirs(base, exist_ok=True)
    for i in range(files):
        d = os.path.join(base, f"d{i % 5}", f"sub{i % 3}")
        os.makedirs(d, exist_ok=True)
        size = rnd.choice([0, 1, 100, 4096, 70_000, 300_000])
        with open(os.path.join(d, f"f{i}.bin"), "wb") as f:
            f.write(rnd.randbytes(size))
    big = os.path.join(base, "big.bin")
    with open(big, "wb") as f:
        f.write(rnd.randbytes(9 * 1024 * 1024 + 123))
    os.chmod(os.path.join(base, "d0", "sub0", "f0.bin"), 0o751)
    os.makedirs(os.path.join(base, "empty_dir"), exist_ok=True)
    os.symlink("d1/sub1/f1.bin", os.path.join(base, "rel_link"))
    os.symlink("/etc/hostname", os.path.join(base, "abs_link"))
    os.symlink("does/not/exist", os.path.join(base, "dangling_link"))
    os.utime(os.path.join(base, "d2"), ns=(1_600_000_000_123_456_789, 1_600_000_000_123_456_789))
    return base


def snapshot(base: str) -> dict[str, tuple[Any, ...]]:
    """Relative path -> (kind, mode, size, mtime_ns, content or link target), without .tb5sync.

    Directory mtimes are included; the base directory itself is included as ``"."``. Every
    lookup is relative to its directory's descriptor (``os.fwalk``), so trees deeper than
    PATH_MAX are read too.
    """
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames, dfd in os.fwalk(base):
        dirnames[:] = [d for d in dirnames if d != ".tb5sync"]
        rel_dir = os.path.relpath(dirpath, base)
        if rel_dir == ".":
            st = os.fstat(dfd)
            out["."] = ("d", _stat.S_IMODE(st.st_mode), st.st_mtime_ns)
        for name in [*dirnames, *filenames]:
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            st = os.lstat(name, dir_fd=dfd)
            if _stat.S_ISLNK(st.st_mode):
                out[rel] = ("l", os.readlink(name, dir_fd=dfd), st.st_mtime_ns)
            elif _stat.S_ISDIR(st.st_mode):
                out[rel] = ("d", _stat.S_IMODE(st.st_mode), st.st_mtime_ns)
            else:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
                with open(fd, "rb") as f:
                    data = f.read()
                out[rel] = ("f", _stat.S_IMODE(st.st_mode), st.st_size, st.st_mtime_ns, data)
    return out


@pytest.fixture
def tree(tmp_path: Any) -> str:
    """A fresh :func:`make_tree` under ``tmp_path/src``."""
    return make_tree(str(tmp_path / "src"))


def have_rsync() -> bool:
    """True when rsync is installed; fails instead when TB5SYNC_REQUIRE_RSYNC=1 and it is missing."""
    if shutil.which("rsync"):
        return True
    if os.environ.get("TB5SYNC_REQUIRE_RSYNC") == "1":
        pytest.fail("rsync is not installed but TB5SYNC_REQUIRE_RSYNC=1")
    return False


# --- tb5:// filesystem (tb5sync.fs.filesystem) -------------------------------------------------------------


def tb5fs(live: LiveServer, **kw: Any) -> Any:
    """A :class:`tb5sync.fs.filesystem.TB5FileSystem` of its own (not from fsspec's instance cache) for ``live``."""
    from tb5sync.fs.filesystem import TB5FileSystem

    return TB5FileSystem(host="127.0.0.1", port=live.port, token=live.token, skip_instance_cache=True, **kw)


@contextlib.contextmanager
def served_fs(root: str, **kw: Any) -> Iterator[tuple[LiveServer, Any]]:
    """A server on 127.0.0.1:0 over ``root`` (``kw``: :class:`~tb5sync.daemon.server.Server` options) and a
    :func:`tb5fs` filesystem of it, ``(live, fs)``; both closed on exit."""
    live = start_server(root, **kw)
    fs = tb5fs(live)
    try:
        yield live, fs
    finally:
        fs._holder.close()
        live.server.stop()


def http_cache_port(stderr: Any, lines: int = 5) -> int:
    """The port a ``tb5sync serve --http-cache``/``http-cache`` child announces on ``stderr`` (a text
    stream) within its first ``lines`` lines; 0 when it says none."""
    import re

    for _ in range(lines):
        m = re.search(r"http cache of .* on 127\.0\.0\.1:(\d+)", stderr.readline())
        if m:
            return int(m.group(1))
    return 0


def slurp(path: str) -> bytes:
    """The bytes of a local file."""
    with open(path, "rb") as f:
        return f.read()


def tmp_files(root: str) -> list[str]:
    """Temporary files of writes in progress (``*.tb5tmp``) anywhere under ``root``."""
    return [os.path.join(d, n) for d, _, names in os.walk(root) for n in names if n.endswith(".tb5tmp")]


# --- threads (every test that joins a thread checks that it finished) ---------------------------

import threading as _threading


def joined(thread: _threading.Thread, timeout: float = 10.0) -> None:
    """Join ``thread`` and fail the test if it is still running after ``timeout`` seconds (a hang)."""
    thread.join(timeout)
    assert not thread.is_alive(), f"thread {thread.name} still running after {timeout} s"


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``cond`` every 20 ms until true; returns the seconds it took, fails after ``timeout``."""
    import time as _time

    t0 = _time.monotonic()
    while not cond():
        if _time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        _time.sleep(0.02)
    return _time.monotonic() - t0


# --- comparing with rsync (the reference of every *_vs_rsync module) ----------------------------


@pytest.fixture
def need_rsync() -> None:
    """Skips a test when rsync is not installed (``pytestmark = pytest.mark.usefixtures("need_rsync")``)."""
    if not have_rsync():
        pytest.skip("rsync is not installed")


@pytest.fixture
def h(tmp_path: Any, server: Any) -> Any:
    """A :class:`test_vs_rsync.Harness`: one scenario on the rsync, local, push and pull routes."""
    from test_vs_rsync import Harness

    return Harness(tmp_path, server)


def rsync(src: str, dst: str, *, delete: bool = False, exclude: Sequence[str] = (), checksum: bool = False,
          check: bool = True, extra: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    """Run ``rsync -a [extra...]`` local to local; raise with its stderr when ``check`` and it fails."""
    args = ["rsync", "-a", *extra]
    if delete:
        args.append("--delete")
    args += [f"--exclude={p}" for p in exclude]
    if checksum:
        args.append("-c")
    args += [src, dst]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=100, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr}")
    return proc


def digest_snapshot(base: str, ignore_mtime: Iterable[str] = ("",)) -> dict[str, tuple[Any, ...]]:
    """``snapshot(base)`` with contents replaced by their SHA-256 (readable diffs) and the
    mtimes of ``ignore_mtime`` (paths relative to ``base``, ``""`` for ``base``) blanked."""
    ign = {os.path.normpath(p) if p else "." for p in ignore_mtime}
    out: dict[str, tuple[Any, ...]] = {}
    for rel, val in snapshot(base).items():
        if val[0] == "f":
            val = (*val[:4], hashlib.sha256(val[4]).hexdigest())
        if rel in ign:
            val = (*val[:-2], None, val[-1]) if val[0] == "f" else (*val[:-1], None)
        out[rel] = val
    return out


def assert_same(ref: dict[str, Any], got: dict[str, Any], route: str) -> None:
    """Assert two digest snapshots are equal, with a short, per-path report of differences."""
    if ref == got:
        return
    lines = []
    for p in sorted(set(ref) | set(got)):
        a, b = ref.get(p), got.get(p)
        if a != b:
            lines.append(f"  {p!r}: rsync={a} {route}={b}")
    raise AssertionError(f"{route} differs from rsync -a in {len(lines)} paths:\n" + "\n".join(lines[:40]))


def local_agrees_with_rsync(src: str, tmp: str, what: str = "local") -> None:
    """``rsync -a SRC/ TMP/ref`` and ``tb5sync.sync(SRC/, TMP/mine)`` give the same tree, and a
    second sync transfers nothing (the property tests' one comparison)."""
    import tb5sync

    ref, mine = os.path.join(tmp, "ref"), os.path.join(tmp, "mine")
    rsync(src + "/", ref)
    tb5sync.sync(src + "/", mine)
    assert_same(digest_snapshot(ref), digest_snapshot(mine), what)
    assert tb5sync.sync(src + "/", mine).files_transferred == 0


# --- the small-file writer (tb5sync.roles.destination / tb5sync._write) -----------------------------


def _both_impls(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, module: Any, attr: str, ext: str) -> str:
    """Run the test with ``module.<attr>`` (a Cython core's batch function, ``tb5sync.<ext>``) set,
    then with it None (the per-file Python path); skipped when the core is not built, failed under
    TB5SYNC_REQUIRE_CYTHON=1. In the TB5SYNC_PUREPYTHON=1 run both are still tested."""
    if request.param == "python":
        monkeypatch.setattr(module, attr, None)
    elif getattr(module, attr) is None:
        import importlib

        try:
            fn = getattr(importlib.import_module(f"tb5sync.{ext}"), attr.removeprefix("_cy_"))
        except ImportError:
            if require_cython():
                pytest.fail(f"tb5sync.{ext} is not built but TB5SYNC_REQUIRE_CYTHON=1")
            pytest.skip(f"tb5sync.{ext} is not built")
        monkeypatch.setattr(module, attr, fn)
    return str(request.param)


@pytest.fixture(params=["cython", "named", "python"])
def write_impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each small-file writer in turn: the Cython batch writer (``tb5sync._write``; ``"cython"``
    with its unnamed path where Linux has ``O_TMPFILE``, ``"named"`` forced onto the portable
    temporary name + rename, as on macOS) and :meth:`Destination.write_file` per file."""
    import tb5sync.roles.destination as destination

    if request.param == "named":
        monkeypatch.setenv(destination.NO_TMPFILE_ENV, "1")
    return _both_impls(request, monkeypatch, destination, "_cy_write_files", "_write")


@pytest.fixture(params=["cython", "python"])
def read_impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each small-file reader of the sender in turn: the Cython batch reader (``tb5sync._read``) and
    ``Sender._read_one`` per file."""
    import tb5sync.roles.sender as sender

    return _both_impls(request, monkeypatch, sender, "_cy_read_files", "_read")


@pytest.fixture(params=["openat2", "portable"])
def jail_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each lookup strategy of the Jail (openat2 where the kernel has it, and the portable walk)."""
    if request.param == "portable":
        monkeypatch.setenv("TB5SYNC_JAIL_PORTABLE", "1")
    else:
        from tb5sync._os.paths import openat2_available

        if not openat2_available():
            pytest.skip("no openat2 on this kernel (the portable walk is tested)")
        monkeypatch.delenv("TB5SYNC_JAIL_PORTABLE", raising=False)
    return str(request.param)


@pytest.fixture
def node(tmp_path: Any) -> Any:
    """A live server with a store at ``tmp_path/remote_store``."""
    live = start_server(str(tmp_path / "root"), store=str(tmp_path / "remote_store"))
    try:
        yield live
    finally:
        live.server.stop()
