"""Every mtime the filesystem stores survives a sync as ``rsync -a`` keeps it: after 2262-04-11
(past 2^63 ns), before 1970 (negative), with nanoseconds; for files, directories and symlinks;
local, push and pull; and a second run finds nothing to do (the scan cache stores them too)."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
from conftest import local_agrees_with_rsync
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_vs_rsync import Harness, rsync, write

import tb5sync
import tb5sync.tree.scan as scan

S = 1_000_000_000
#: (id, mtime in ns): the issue's example (first second past 2^63 ns), far future, the epoch,
#: one ns before it, before 1970 with a fraction, the oldest 32-bit time, and 2^63 ns itself.
MTIMES = [
    ("2262-04-11T23:47:17", 9_223_372_037 * S),
    ("2^63ns", 1 << 63),
    ("2400", 13_569_465_600 * S + 123_456_789),
    ("epoch", 0),
    ("epoch-1ns", -1),
    ("1960.5", -315_619_199 * S - 500_000_000),
    ("1901", -(2**31) * S),
]


pytestmark = pytest.mark.usefixtures("need_rsync")  # conftest: skipped without rsync



def _stored(path: str, ns: int) -> int:
    """Set ``path``'s mtime to ``ns`` (symlinks not followed) and return what the filesystem kept."""
    os.utime(path, ns=(ns, ns), follow_symlinks=False)
    return os.lstat(path).st_mtime_ns


@pytest.mark.parametrize("name,ns", MTIMES, ids=[m[0] for m in MTIMES])
def test_mtime_round_trips_like_rsync(h: Harness, name: str, ns: int) -> None:
    src = h.src
    write(os.path.join(src, "small.txt"), b"small", 0o644)
    write(os.path.join(src, "large.bin"), os.urandom(5 * 1024 * 1024 + 7), 0o644)
    os.makedirs(os.path.join(src, "dir"))
    write(os.path.join(src, "dir", "inner.txt"), b"inner", 0o600)
    os.symlink("small.txt", os.path.join(src, "link"))
    for p in ("small.txt", "large.bin", "dir/inner.txt", "link", "dir"):
        kept = _stored(os.path.join(src, p), ns)
        if kept != ns:
            pytest.skip(f"this filesystem stores {ns} ns as {kept}")
    os.utime(src, ns=(ns, ns))
    h.prepare()
    h.stage_pull()
    want = {p: os.lstat(os.path.join(src, p)).st_mtime_ns for p in ("small.txt", "large.bin", "dir", "link", "dir/inner.txt")}
    # no source mtime is within the current second, so the harness's settling is not needed (it
    # would move these future mtimes 5 s back, the 2262 example below 2^63 ns again)
    for attempt in ("first", "second"):
        rsync(src + "/", os.path.join(h.dp["rsync"], "dst"))
        runs = {
            "local": tb5sync.sync(src + "/", os.path.join(h.dp["local"], "dst")),
            "push": tb5sync.sync(src + "/", h.server.url("push/dst")),
            "pull": tb5sync.sync(h.server.url("pullsrc/src/"), os.path.join(h.dp["pull"], "dst")),
        }
        for r, stats in runs.items():
            final = os.path.join(h.dp[r], "dst")
            assert {p: os.lstat(os.path.join(final, p)).st_mtime_ns for p in want} == want, r
            if attempt == "second":  # everything is up to date
                assert stats.files_transferred == 0, r
        h.check()


@settings(max_examples=30, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(mtimes=st.lists(
    st.one_of(  # before 1970, 1970 to 2262, past 2^63 ns (the filesystem keeps what it can)
        st.integers(-(2**31) * S, -1), st.integers(0, (1 << 63) - 1), st.integers(1 << 63, (1 << 64) - 1)
    ),
    min_size=1, max_size=4,
))
def test_property_any_stored_mtime_round_trips(mtimes: list[int]) -> None:
    """Whatever mtime the filesystem keeps for a file or directory, rsync -a and tb5sync (local)
    leave the same one, and both directory listers read it alike."""
    with tempfile.TemporaryDirectory(prefix="tb5-times-") as tmp:
        src = os.path.join(tmp, "src")
        os.makedirs(os.path.join(src, "d"))
        for i, ns in enumerate(mtimes):
            p = os.path.join(src, "d", f"f{i}")
            write(p, b"x" * i)
            _stored(p, ns)
        _stored(os.path.join(src, "d"), mtimes[0])
        if scan.cy_listdir_stat is not None:
            assert sorted(scan.cy_listdir_stat(os.path.join(src, "d"))) == sorted(scan.py_listdir_stat(os.path.join(src, "d")))
        local_agrees_with_rsync(src, tmp)


def test_state_keeps_integers_past_64_bits_and_old_rows(tmp_path: Any) -> None:
    """The scan cache finds a row again whatever its mtime (ns) and inode (up to 2^64 - 1), and a
    row written the old way (an INTEGER) is still found: the schema did not change."""
    from tb5sync.tree.state import TreeState

    refs = [(b"\x01" * 32, 10)]
    state = TreeState(str(tmp_path))
    try:
        for mtime_ns, ino in [(1 << 63, (1 << 64) - 1), (-(1 << 63) - 1, 5), (13_569_465_600 * S, 7), (-1, 8), (5, 9)]:
            state.record(f"f{ino}", 10, mtime_ns, ino, refs)
            assert state.lookup(f"f{ino}", 10, mtime_ns, ino) is not None
            assert state.lookup(f"f{ino}", 10, mtime_ns + 1, ino) is None
    finally:
        state.close()
