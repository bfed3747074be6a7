"""Property tests: generated trees with hostile names, modes, mtimes and types, synced local, push
and pull, with and without --delete onto a generated destination, each compared with
``rsync -a --no-D`` on the same input (tb5sync does not recreate special files: rsync without -D
is the reference for them): the same exit code class and the same resulting tree.

Names: bytes that are not UTF-8, 255-byte names, newlines, tabs, spaces at either end, leading
dashes, glob characters, backslashes. Modes: 000 files, 0555 and 0700 directories. Mtimes: before
1970, far in the future, with nanoseconds. Types: files, directories (empty ones too), symlinks
(dangling, absolute, to hostile names), FIFOs. Bounded: 15 examples per topology, no deadline,
a fixed seed in CI (``CI`` set: derandomized)."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from typing import Any

import pytest
from conftest import assert_same, digest_snapshot, rsync
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_vs_rsync import S, T0, Harness, build_tree, cp_a

import tb5sync
from tb5sync.errors import PartialTransferError, VanishedSourceError

pytestmark = pytest.mark.usefixtures("need_rsync")

_HOSTILE = [b"-rf", b"--delete", b" lead", b"trail ", b"new\nline", b"tab\there", b"*?[ab]", b"{x,y}", b"back\\slash",
            b"\xff\xfe", b"caf\xe9", "caf\u00e9".encode(), b"a" * 255, b"\xe9" * 255, b".hidden", b"a b", b"~home", b"#hash"]
_names = st.one_of(st.sampled_from(_HOSTILE), st.binary(min_size=1, max_size=12).filter(
    lambda b: b"/" not in b and b"\0" not in b and b not in (b".", b".."))).map(os.fsdecode)
_relpaths = st.lists(_names, min_size=1, max_size=3).map("/".join)
#: seconds from T0 (T0 has a sub-second part, so every mtime has nanoseconds): before 1970, near T0, far future
_when = st.one_of(st.integers(-(T0 // S) - 10**9, -(T0 // S) - 1), st.integers(0, 1000), st.integers(2**32, 2**33))
_file = st.tuples(st.just("f"), _relpaths, st.sampled_from([0, 1, 4096, 70_000]),
                  st.sampled_from([0o644, 0o000, 0o755, 0o400, 0o600]), _when)
_dir = st.tuples(st.just("d"), _relpaths, st.just(0), st.sampled_from([0o755, 0o555, 0o700]), _when)
_link = st.tuples(st.just("l"), _relpaths, st.one_of(_names, st.sampled_from(["../up", "/abs/x", "missing/x"])),
                  st.just(0o777), _when)
_fifo = st.tuples(st.just("p"), _relpaths, st.just(0), st.sampled_from([0o644, 0o600]), _when)
_tree = st.lists(st.one_of(_file, _file, _dir, _link, _fifo), min_size=1, max_size=10)


def _rmtree(path: str) -> None:
    """Remove ``path`` whatever modes its directories have (0555 ones when not root)."""
    if not os.path.lexists(path):
        return
    for dirpath, _dirs, _files in os.walk(path):
        os.chmod(dirpath, stat.S_IRWXU)
    shutil.rmtree(path)


def _outcome(run: Any) -> int:
    """The exit code class of a tb5sync run: 0, 23 or 24."""
    try:
        run()
    except VanishedSourceError:
        return 24
    except PartialTransferError as exc:
        return exc.exit_code
    return 0


@pytest.mark.timeout(600)  # 15 examples take seconds; shrinking a failure takes longer
@pytest.mark.parametrize("topology", ["local", "push", "pull"])
@settings(max_examples=15, deadline=None, database=None, derandomize=bool(os.environ.get("CI")),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(src_items=_tree, dst_items=st.one_of(st.none(), _tree), delete=st.booleans())
# found by this test: a destination FIFO that --delete removes; a destination directory named
# like a source FIFO, which rsync --no-D keeps (with what it holds)
@example(src_items=[("p", "trail ", 0, 0o644, 2)], dst_items=[("f", "-rf", 0, 0o644, -1), ("p", "--delete", 0, 0o644, 3)],
         delete=True)
@example(src_items=[("f", "-rf", 0, 0o644, 1), ("p", "\x01", 0, 0o644, 1)],
         dst_items=[("d", "\x01", 0, 0o755, 1), ("f", "\x01/in", 3, 0o644, 5)], delete=True)
@example(src_items=[("d", "x", 0, 0o755, 1), ("f", "x/y", 1, 0o644, 1)], dst_items=[("p", "x", 0, 0o644, 1)], delete=False)
def test_hostile_trees_like_rsync(server: Any, topology: str, src_items: list[Any], dst_items: list[Any] | None,
                                  delete: bool) -> None:
    for stale in ("push", "pullsrc"):  # the server fixture lives across examples
        _rmtree(os.path.join(server.root, stale))
    with tempfile.TemporaryDirectory(prefix="tb5-hostile-") as tmp:
        h = Harness(tmp, server, routes=("rsync", topology))
        build_tree(h.src, src_items, salt=1)
        tpl = os.path.join(tmp, "tpl")
        os.makedirs(tpl)
        if dst_items is not None:
            build_tree(os.path.join(tpl, "dst"), dst_items, salt=2)
        h.prepare(tpl)
        proc = rsync(h.src + "/", os.path.join(h.dp["rsync"], "dst"), delete=delete, check=False, extra=["--no-D"])
        assert proc.returncode in (0, 23, 24), proc.stderr
        if topology == "pull":
            h.stage_pull()
            src, dst = server.url("pullsrc/src/"), os.path.join(h.dp["pull"], "dst")
        elif topology == "push":
            src, dst = h.src + "/", server.url("push/dst")
        else:
            src, dst = h.src + "/", os.path.join(h.dp["local"], "dst")
        got = _outcome(lambda: tb5sync.sync(src, dst, delete=delete))
        assert got == proc.returncode, (topology, got, proc.stderr)
        assert_same(digest_snapshot(h.dp["rsync"]), digest_snapshot(h.dp[topology]), topology)
        _rmtree(h.dp[topology])
        _rmtree(h.dp["rsync"])
