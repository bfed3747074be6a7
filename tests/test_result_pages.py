"""A push's result in pages: a dry run (or ``-i`` run) whose lists are over a control frame's 32 MiB
is reported whole, its lines equal to rsync ``-n -v``'s / ``-i``'s on the same tree; small results
still go in one ``finish``; a malformed page is a protocol error."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
from conftest import start_server

import tb5sync
import tb5sync.remote.client as client
import tb5sync.wire.messages as messages
from tb5sync.errors import RemoteProtocolError
from tb5sync.wire.messages import ResultPages, result_pages

pytestmark = pytest.mark.usefixtures("need_rsync")


def _files(base: str, n: int, name_len: int) -> None:
    """``n`` empty files in 200 directories, each path ``name_len`` bytes long."""
    for d in range(200):
        os.makedirs(os.path.join(base, f"d{d:03d}"), exist_ok=True)
    pad = "n" * (name_len - 13)
    for i in range(n):
        os.close(os.open(os.path.join(base, f"d{i % 200:03d}/{pad}{i:08d}"), os.O_CREAT | os.O_WRONLY, 0o644))


def _rsync_n_v(src: str, cwd: str, extra: list[str]) -> list[str]:
    out = subprocess.run(["rsync", "-a", "-n", *extra, src, "dst"], capture_output=True, text=True, timeout=300,
                         check=True, cwd=cwd).stdout.splitlines()
    return sorted(ln for ln in out if ln and not ln.startswith(("sending ", "sent ", "total size")))


@pytest.mark.timeout(900)
def test_dry_run_push_over_32_mib_is_reported_whole(tmp_path: Any) -> None:
    """The issue's case: 200,000 files with 109-byte names, a dry-run push (~44 MB of lines)."""
    src = str(tmp_path / "src")
    _files(src, 200_000, 109)
    live = start_server(str(tmp_path / "root"))
    try:
        want = _rsync_n_v(src + "/", str(tmp_path), ["-v"])
        assert 2 * sum(map(len, want)) > 32 << 20  # the result carries each path twice: its transfer list and its lines
        got = subprocess.run([sys.executable, "-m", "tb5sync.cli", "sync", "-n", src + "/", live.url("dst")],
                             capture_output=True, text=True, timeout=600, check=False)
        assert got.returncode == 0, got.stderr[-2000:]
        assert sorted(ln for ln in got.stdout.splitlines() if ln) == want
        assert not os.path.exists(os.path.join(live.root, "dst"))
    finally:
        live.server.stop()


@pytest.mark.timeout(300)
def test_small_pages_dry_run_and_itemized(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the page limits made small (the server runs in this process), a dry run's change list
    and a real run's ``-i`` lines arrive in many pages, whole and in rsync's words."""
    monkeypatch.setattr(messages, "RESULT_WHOLE_MAX", 4096)
    monkeypatch.setattr(messages, "RESULT_PAGE_BYTES", 2048)
    sent: list[str] = []
    real = client._PushHandler.finish_part

    def counting(self: Any, section: object = None, key: object = None, items: object = None) -> Any:
        sent.append(f"{section}.{key}")
        return real(self, section, key, items)

    monkeypatch.setattr(client._PushHandler, "finish_part", counting)
    src = str(tmp_path / "src")
    _files(src, 3000, 60)
    live = start_server(str(tmp_path / "root"))
    try:
        want = [ln for ln in _rsync_n_v(src + "/", str(tmp_path), ["-v"]) if not ln.startswith("created directory")]
        st = tb5sync.sync(src + "/", live.url("dst"), dry_run=True)
        assert sorted(st.extra["changes"]["lines"]) == want
        assert len(sent) > 20 and {"changes.lines", "changes.transfer"} <= set(sent)
        sent.clear()
        ref = subprocess.run(["rsync", "-a", "-i", src + "/", str(tmp_path / "ref")], capture_output=True, text=True,
                             timeout=300, check=True).stdout.splitlines()
        assert ref[0] == f"created directory {tmp_path / 'ref'}"
        ref = ref[1:]
        st = tb5sync.sync(src + "/", live.url("dst"), itemize_changes=True)
        assert sorted("<" + x[1:] if x.startswith(">") else x for x in ref) == sorted(st.itemized)
        assert st.created == ("created directory dst",)
        assert len(sent) > 20 and "stats.itemized" in sent and set(sent) <= {"stats.itemized", "stats.created"}
        sent.clear()
        assert tb5sync.sync(src + "/", live.url("dst"), itemize_changes=True).itemized == ()
        assert sent == []  # a small result goes whole
    finally:
        live.server.stop()


@pytest.mark.timeout(30)
def test_pages_are_checked() -> None:
    result = {"stats": {"itemized": [f">f+++++++++ {'x' * 50}{i}" for i in range(500)], "files_total": 500},
              "changes": {"lines": ["a"] * 10}}
    rest, pages = result_pages(result, whole_max=1000, page_bytes=500)
    assert rest["stats"]["itemized"] == [] and rest["pages"] == len(pages) > 50
    assert all(sum(len(i) + 2 for i in p["items"]) <= 600 for p in pages)
    got = ResultPages()
    for p in pages:
        got.add(p["section"], p["key"], p["items"])
    merged = got.merge(rest)
    assert merged["stats"]["itemized"] == result["stats"]["itemized"] and merged["changes"]["lines"] == ["a"] * 10
    assert result_pages(result)[1] == []  # fits whole at the real limit
    with pytest.raises(RemoteProtocolError, match="malformed result page"):
        ResultPages().add("stats", "files_total", [1])
    with pytest.raises(RemoteProtocolError, match="malformed result page"):
        ResultPages().add("stats", "itemized", "not a list")
    short = ResultPages()
    short.add("stats", "itemized", ["x"])
    with pytest.raises(RemoteProtocolError, match="announced 2 result pages and sent 1"):
        short.merge({"stats": {}, "pages": 2})
