"""A pushing peer cannot grow a server's memory without limit through its listing.

The server's receiver holds the source's listing (directory summaries, entries, hard-link
groups, extended attributes) for the session. ``Server(max_entries=, max_listing_bytes=)``
(``tb5sync serve --max-entries --max-listing-bytes``) caps it: an announced total past the
cap is refused at the first page, pages past it end the session with a ``UsageError`` naming
the option, and the server goes on serving.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from conftest import start_server, wait_for

import tb5sync
import tb5sync.roles.sender as sender_mod
from tb5sync.errors import UsageError
from tb5sync.roles.generator import ENTRY_COST, MAX_ENTRIES, MAX_LISTING_BYTES, STRING_COST

pytestmark = pytest.mark.timeout(60)


def _src(tmp_path: Path, files: int = 3) -> str:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(files):
        (src / f"f{i}").write_bytes(b"x" * i)
    return str(src)


def _evil_tree(monkeypatch: pytest.MonkeyPatch, per_page: int, total: int, name_len: int = 20) -> list[int]:
    """Make this process's (the push client's) sender answer ``tree`` with ``per_page`` made-up
    directories a page, announcing ``total``; returns the count of pages served."""
    orig = sender_mod.Sender.tree
    served = [0]

    def tree(self: Any, start: int = 0) -> dict[str, Any]:
        page = orig(self, 0)
        served[0] += 1
        page["dirs"] = [["d%09d/%s" % (start + i, "x" * name_len), b"\0" * 32, 0, 0] for i in range(per_page)]
        page["total"] = total
        return page

    monkeypatch.setattr(sender_mod.Sender, "tree", tree)
    return served


def test_defaults_are_documented_values() -> None:
    assert (MAX_ENTRIES, MAX_LISTING_BYTES, ENTRY_COST, STRING_COST) == (3_000_000, 2 << 30, 704, 3)


def test_announced_total_past_the_cap_is_refused_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The report's attack: total = 2**40 and full pages forever. One page is read, then the session ends."""
    served = _evil_tree(monkeypatch, 1000, 2**40)
    live = start_server(str(tmp_path / "root"))
    try:
        with pytest.raises(UsageError, match=r"--max-entries"):
            tb5sync.sync(_src(tmp_path) + "/", live.url("dst/"), timeout=30)
        assert served[0] == 1
        wait_for(lambda: live.server.threads == 0, 10, "the session's threads to end")
    finally:
        live.server.stop()


def test_pages_past_the_entry_cap_end_the_session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    served = _evil_tree(monkeypatch, 600, 1000)  # a total within the cap, then more than it in pages
    live = start_server(str(tmp_path / "root"), max_entries=1000)
    try:
        with pytest.raises(UsageError, match=r"more than the 1000 entries.*--max-entries"):
            tb5sync.sync(_src(tmp_path) + "/", live.url("dst/"), timeout=30)
        assert served[0] == 2
    finally:
        live.server.stop()


def test_pages_past_the_byte_cap_end_the_session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _evil_tree(monkeypatch, 100, 10**6, name_len=2000)  # ~200 KB of paths a page
    live = start_server(str(tmp_path / "root"), max_listing_bytes=1_000_000)
    try:
        with pytest.raises(UsageError, match=r"larger than the 1000000 bytes.*--max-listing-bytes"):
            tb5sync.sync(_src(tmp_path) + "/", live.url("dst/"), timeout=30)
    finally:
        live.server.stop()


def test_honest_tree_past_the_cap_is_refused_and_one_within_it_syncs(tmp_path: Path) -> None:
    """Real entries count too: 50 files are more than max_entries=20; 10 files are not."""
    src = tmp_path / "big"
    src.mkdir()
    for i in range(50):
        (src / f"f{i:02d}").write_bytes(b"%d" % i)
    small = tmp_path / "small"
    small.mkdir()
    for i in range(10):
        (small / f"f{i}").write_bytes(b"%d" % i)
    live = start_server(str(tmp_path / "root"), max_entries=20)
    try:
        with pytest.raises(UsageError, match="--max-entries"):
            tb5sync.sync(str(src) + "/", live.url("big/"), timeout=30)
        tb5sync.sync(str(small) + "/", live.url("small/"), timeout=30)
    finally:
        live.server.stop()
    assert sorted(os.listdir(os.path.join(live.root, "small"))) == [f"f{i}" for i in range(10)]
    assert not os.path.exists(os.path.join(live.root, "big", "f00"))


@pytest.mark.parametrize("kw", [{"max_entries": 0}, {"max_listing_bytes": -1}])
def test_caps_must_be_positive(tmp_path: Path, kw: dict[str, int]) -> None:
    from tb5sync.daemon.server import Server

    with pytest.raises(UsageError, match=next(iter(kw))):
        Server(str(tmp_path), port=0, **kw)


def _push_forged_listing(port: int, pid: int, n: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[str, int]:
    """Dry-run push of a made-up listing of ``n`` files in one directory (attacker6's
    listing_mem.py) to ``tb5sync serve`` at ``port``; returns the outcome and the server's peak
    RSS growth meanwhile, bytes."""
    import threading
    import time

    from test_daemon import rss_kib

    from tb5sync.tree.entry import Entry
    from tb5sync.tree.scan import Tree

    now = time.time_ns()
    files = [Entry(f"f{i:08d}", "f", 0o644, 0, now, "") for i in range(n)]
    tree = Tree(entries=[Entry("", "d", 0o755, 0, now, "")] + files, children={"": files})
    monkeypatch.setattr(sender_mod.Sender, "scanned", lambda self: tree)
    base = rss_kib(pid)
    peak = [base]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_kib(pid))
            time.sleep(0.01)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    src = tmp_path / "empty"
    src.mkdir(exist_ok=True)
    try:
        tb5sync.sync(str(src) + "/", f"tb5://127.0.0.1:{port}/lm{n}/", dry_run=True, timeout=60)
        outcome = "ok"
    except UsageError as exc:
        outcome = str(exc)
    finally:
        done.set()
        t.join()
    return outcome, (peak[0] - base) * 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the server's RSS from /proc")
def test_listing_bytes_bound_the_servers_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """attacker6's listing_mem.py: 1M entries counted as 70 MiB held ~630 MiB (64 bytes counted per
    entry). The count is now what the server really holds: a listing within --max-listing-bytes
    grows its RSS by about what was counted, no more, and one past it is refused before the
    server holds much more than the cap."""
    from test_daemon import start_serve_process

    cap = 48 << 20
    n_in = 50_000
    counted_in = n_in * (ENTRY_COST + STRING_COST * 9) + ENTRY_COST  # 9-byte names, and the root
    assert counted_in < cap
    proc, port = start_serve_process(str(tmp_path / "root"), "--max-listing-bytes", str(cap))
    try:
        outcome, grown = _push_forged_listing(port, proc.pid, n_in, monkeypatch, tmp_path)
        print(f"{n_in} entries: counted {counted_in >> 20} MiB, server RSS +{grown >> 20} MiB")
        assert outcome == "ok"
        assert grown < 1.25 * counted_in + (8 << 20), (grown, counted_in)
        assert grown > 0.4 * counted_in, (grown, counted_in)  # not a wild overcount either
    finally:
        proc.terminate()
        proc.wait(10)
        assert proc.stderr is not None
        proc.stderr.close()
    proc, port = start_serve_process(str(tmp_path / "root2"), "--max-listing-bytes", str(cap))
    try:
        outcome, grown = _push_forged_listing(port, proc.pid, 200_000, monkeypatch, tmp_path)
        print(f"200000 entries, cap {cap >> 20} MiB: server RSS +{grown >> 20} MiB; {outcome[:80]}")
        assert "--max-listing-bytes" in outcome
        assert grown < 1.5 * cap, grown
    finally:
        proc.terminate()
        proc.wait(10)
        assert proc.stderr is not None
        proc.stderr.close()
