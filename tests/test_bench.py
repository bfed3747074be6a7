"""``tb5sync bench URL``: RTT, raw TCP both ways, disks at both ends, CPU, a real push and pull, a
verdict; the server's ``sink`` and ``disk`` session ops and their bounds; the disk test's cache
dropping and its portable path."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import LiveServer, start_server
import tb5sync._os.diskbench as _diskbench
from tb5sync.api.bench import (
    BOUNDS, STREAM_COUNTS, VERDICT_MIN_BYTES, format_report, measure_tcp, run_bench, server_disk, verdict)
from tb5sync.cli.command import main
from tb5sync.errors import AuthError, BusyError, ReadOnlyError, RemoteProtocolError, UsageError
from tb5sync.wire.messages import BENCH_MAX_BYTES, BENCH_MAX_DISK
from tb5sync.wire.protocol import FrameType
from tb5sync.wire.rpc import open_session
from tb5sync.wire.transport import dial
from tb5sync.wire.urls import parse_url

pytestmark = pytest.mark.timeout(120)

SMALL = {"size": 2 * 1024 * 1024, "tcp_bytes": 4 * 1024 * 1024, "pings": 20}


def leftovers(*dirs: str) -> list[str]:
    """Bench files left anywhere below ``dirs`` (there must be none)."""
    out = []
    for d in dirs:
        for base, subdirs, files in os.walk(d):
            out += [os.path.join(base, n) for n in subdirs + files if n.startswith(".tb5sync-bench-")]
    return out


def check_result(res: dict[str, Any], streams: int = 4) -> None:
    """The structure of a bench result and the figures' sanity."""
    assert res["rtt"]["count"] == SMALL["pings"]
    assert 0 < res["rtt"]["min_us"] <= res["rtt"]["median_us"] <= res["rtt"]["p99_us"]
    assert sorted((t["direction"], t["streams"]) for t in res["tcp"]) == sorted(
        (d, n) for d in ("down", "up") for n in STREAM_COUNTS)
    for t in res["tcp"]:
        assert t["bytes"] == SMALL["tcp_bytes"] // t["streams"] * t["streams"] and t["bytes_per_s"] > 0
    for side in ("client", "server"):
        d = res["disk"][side]
        assert d["bytes"] == SMALL["size"] and d["write_bytes_per_s"] > 0 and d["read_bytes_per_s"] > 0
        assert d["method"] == _diskbench.cache_drop_method() and d["cold"] == (d["method"] != "none")
    assert res["cpu"]["bytes_per_s"] > 0 and res["cpu"]["bytes"] == SMALL["size"]
    for direction in ("push", "pull"):
        s = res["sync"][direction]
        assert s["bytes"] == SMALL["size"] and s["bytes_per_s"] > 0
        assert s["wire_bytes"] >= SMALL["size"]  # random bytes: nothing to reuse or compress
    v = res["verdict"]
    assert v["bound"] in BOUNDS and v["direction"] in ("push", "pull")
    if res["size"] < VERDICT_MIN_BYTES:  # a few MiB: too short to tell, never a ceiling picked at random
        assert v["bound"] == "inconclusive" and "too short" in v["why"]
        return
    ceilings = v["ceilings"][v["direction"]]
    if v["bound"] != "engine":
        assert ceilings[v["bound"]] == min(ceilings.values())
    assert "cleanup" not in res["sync"]


def test_bench_api(server: LiveServer, tmp_path: Path) -> None:
    here = tmp_path / "here"
    here.mkdir()
    steps: list[str] = []
    res = run_bench(parse_url(server.url()), directory=str(here), progress=steps.append, **SMALL)
    check_result(res)
    assert any("sync" in s for s in steps) and any("disk" in s for s in steps)
    assert leftovers(str(here), server.root) == [] and os.listdir(here) == []
    lines = format_report(res)
    assert lines[-1].startswith("verdict      inconclusive (")
    json.dumps(res)  # JSON-able as it is


def test_bench_cli_json_and_text(server: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", server.url(), "--size", "2M", "--tcp-size", "4M", "--pings", "20", "--dir", str(tmp_path)]
    assert main([*args, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    check_result(res)
    assert main(args) == 0
    out = capsys.readouterr().out
    for word in ("rtt", "raw TCP down", "raw TCP up", "disk here", "disk server", "cpu", "sync", "verdict"):
        assert word in out
    verdict_line = [line for line in out.splitlines() if line.startswith("verdict")][0]
    assert verdict_line.startswith("verdict      inconclusive (a 2 MiB sync test is too short")
    # the older HOST:PORT form still works
    assert main(["bench", f"127.0.0.1:{server.port}", "--size", "2M", "--tcp-size", "4M", "--pings", "20",
                 "--dir", str(tmp_path), "--json"]) == 0
    check_result(json.loads(capsys.readouterr().out))
    assert leftovers(str(tmp_path), server.root) == []


def test_bench_read_only_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    live = start_server(str(tmp_path / "ro"), read_only=True)
    try:
        with pytest.raises(ReadOnlyError, match="read-only"):
            run_bench(parse_url(live.url()), directory=str(tmp_path), **SMALL)
        rc = main(["bench", live.url(), "--size", "2M", "--dir", str(tmp_path)])
        err = capsys.readouterr().err
        assert rc == ReadOnlyError.exit_code
        assert err.count("\n") == 1 and "is read-only" in err
        # the disk op on its own is refused too, and nothing was written
        with pytest.raises(ReadOnlyError):
            server_disk(parse_url(live.url()), None, 2 * 1024 * 1024)
        assert os.listdir(live.root) == []
    finally:
        live.server.stop()


def test_bench_bad_token(token_server: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(AuthError):
        run_bench(parse_url(token_server.url()), token=b"wrong", directory=str(tmp_path), **SMALL)
    url = f"tb5://wrong@127.0.0.1:{token_server.port}"
    rc = main(["bench", url, "--size", "2M", "--dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == AuthError.exit_code and err.count("\n") == 1 and "authentication failed" in err
    assert "wrong" not in err.replace("wrong token", "")  # the token itself is never shown
    # the right token in the URL works
    res = run_bench(parse_url(f"tb5://s3cret-token@127.0.0.1:{token_server.port}"), directory=str(tmp_path), **SMALL)
    check_result(res)


def test_bench_bad_arguments(server: LiveServer, tmp_path: Path) -> None:
    url = parse_url(server.url())
    for kw, what in (({"size": 1000}, "size"), ({"tcp_bytes": 3}, "tcp bytes"), ({"pings": 2}, "pings"),
                     ({"streams": 0}, "streams"), ({"directory": str(tmp_path / "nope")}, "directory")):
        with pytest.raises(UsageError, match=what):
            run_bench(url, **{"directory": str(tmp_path), **SMALL, **kw})


def test_sink_and_source_bounds(server: LiveServer) -> None:
    """The server refuses a source or sink beyond its cap, and a sink fed something other than DATA."""
    for op in ("source", "sink"):
        ch = dial("127.0.0.1", server.port, None)
        try:
            with pytest.raises(UsageError, match=f"{op} bytes must be 0..{BENCH_MAX_BYTES}"):
                open_session(ch, {"op": op, "bytes": BENCH_MAX_BYTES + 1})
        finally:
            ch.close()
    ch = dial("127.0.0.1", server.port, None)
    try:
        open_session(ch, {"op": "sink", "bytes": 10})
        ch.send_control(FrameType.REQUEST, 1, {"m": "ping", "a": {}})
        fr = ch.recv_frame()
        assert fr is not None and fr[0].type is FrameType.ERROR
        with pytest.raises(RemoteProtocolError, match="sink: expected DATA"):
            from tb5sync.wire.rpc import reply_of

            reply_of(*fr)
    finally:
        ch.close()
    # and the server is still up
    assert measure_tcp(parse_url(server.url()), None, 2, 1 << 20, "up")["bytes"] == 1 << 20


def test_disk_op_bounds(server: LiveServer) -> None:
    url = parse_url(server.url())
    with pytest.raises(UsageError, match="disk test bytes"):
        server_disk(url, None, BENCH_MAX_DISK + 1)
    with pytest.raises(UsageError, match="disk test bytes"):
        server_disk(url, None, 10)
    # one disk test at a time
    assert server.server._disk_lock.acquire()
    try:
        with pytest.raises(BusyError, match="another disk test"):
            server_disk(url, None, 2 * 1024 * 1024)
    finally:
        server.server._disk_lock.release()
    d = server_disk(url, None, 2 * 1024 * 1024)
    assert d["bytes"] == 2 * 1024 * 1024 and leftovers(server.root) == []


def _almost_full_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file system reports 10 blocks free (``os.statvfs``), its block size as it is."""
    real = os.statvfs

    class Tiny:
        def __init__(self, st: Any) -> None:
            self.f_frsize = st.f_frsize
            self.f_bavail = 10

    monkeypatch.setattr(os, "statvfs", lambda p: Tiny(real(p)))


def test_disk_rates_free_space_and_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tb5sync.errors import DestinationError

    with pytest.raises(DestinationError, match="disk test in"):
        _diskbench.disk_rates(tmp_path / "missing", 2 * 1024 * 1024)
    _almost_full_disk(monkeypatch)
    with pytest.raises(DestinationError, match="choose a smaller size"):
        _diskbench.disk_rates(tmp_path, 2 * 1024 * 1024)
    assert leftovers(str(tmp_path)) == []


def test_sync_test_needs_free_space(server: LiveServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tb5sync.api.bench import sync_round_trip
    from tb5sync.errors import DestinationError

    _almost_full_disk(monkeypatch)
    with pytest.raises(DestinationError, match="choose a smaller size"):
        sync_round_trip(parse_url(server.url()), None, str(tmp_path), 2 * 1024 * 1024, 2)
    assert leftovers(str(tmp_path), server.root) == []


def test_disk_rates_portable_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without posix_fadvise (macOS has none; F_NOCACHE is macOS-only) the portable path runs: the
    read may be cached and the result says so; with it (Linux) the read is cold."""
    if sys.platform.startswith("linux"):
        assert _diskbench.cache_drop_method() == "fadvise"
        res = _diskbench.disk_rates(tmp_path, 2 * 1024 * 1024)
        assert res["cold"] and res["method"] == "fadvise"
    monkeypatch.delattr(os, "posix_fadvise", raising=False)
    monkeypatch.setattr(sys, "platform", "darwin")  # macOS has no posix_fadvise: F_NOCACHE instead
    assert _diskbench.cache_drop_method() == "nocache"
    monkeypatch.setattr(sys, "platform", "linux")  # not darwin: no F_NOCACHE either
    assert _diskbench.cache_drop_method() == "none"
    res = _diskbench.disk_rates(tmp_path, 2 * 1024 * 1024)
    assert res == {**res, "bytes": 2 * 1024 * 1024, "cold": False, "method": "none"}
    assert leftovers(str(tmp_path)) == []


def test_verdict_names_the_lowest_ceiling() -> None:
    """Figures made up so that each resource in turn is the lowest: the verdict follows."""
    def result(link: float, disk: float, cpu: float, push: float = 0.9, size: int = 2**30) -> dict[str, Any]:
        disk_side = {"read_bytes_per_s": disk, "write_bytes_per_s": disk}
        return {"size": size,
                "tcp": [{"direction": d, "streams": n, "bytes_per_s": link} for d in ("up", "down") for n in STREAM_COUNTS],
                "disk": {"client": disk_side, "server": disk_side}, "cpu": {"bytes_per_s": cpu},
                "sync": {"push": {"bytes_per_s": push * min(link, disk, cpu)}, "pull": {"bytes_per_s": min(link, disk, cpu)}}}

    assert verdict(result(1e9, 5e9, 6e9), 4)["bound"] == "link"
    assert verdict(result(5e9, 1e9, 6e9), 4)["bound"] == "disk"
    v = verdict(result(5e9, 6e9, 1e9), 4)
    assert v["bound"] == "cpu" and v["direction"] == "push" and "cpu" in v["why"]


def test_verdict_below_every_ceiling_and_small_sizes() -> None:
    """The reported case: push 397 MB/s against ceilings link 1,730, disk 1,349, cpu 2,012 MB/s."""
    disk_side = {"read_bytes_per_s": 1349e6, "write_bytes_per_s": 1349e6}
    res = {"size": 2**30, "tcp": [{"direction": d, "streams": 4, "bytes_per_s": 1730e6} for d in ("up", "down")],
           "disk": {"client": disk_side, "server": disk_side}, "cpu": {"bytes_per_s": 2012e6},
           "sync": {"push": {"bytes_per_s": 397e6}, "pull": {"bytes_per_s": 900e6}}}
    v = verdict(res, 4)
    assert v["bound"] == "engine" and v["direction"] == "push"
    assert "below every ceiling measured" in v["why"] and "other end's CPU" in v["why"]
    for figure in ("397", "1,730", "1,349", "2,012"):
        assert figure in v["why"]
    # any size under the minimum: inconclusive whatever the figures (no verdict flipping between runs)
    for size in (2 * 2**20, VERDICT_MIN_BYTES - 1):
        for push in (397e6, 1300e6):
            res2 = dict(res, size=size, sync={"push": {"bytes_per_s": push}, "pull": {"bytes_per_s": 900e6}})
            assert verdict(res2, 4)["bound"] == "inconclusive"
    assert verdict(dict(res, size=VERDICT_MIN_BYTES), 4)["bound"] == "engine"


def test_bench_url_path_must_be_an_existing_directory(server: LiveServer, tmp_path: Path) -> None:
    before = sorted(os.listdir(server.root))
    for path in ("some/path", "nope"):
        with pytest.raises(UsageError, match="not there on the server.*none is created"):
            run_bench(parse_url(server.url(path)), directory=str(tmp_path), **SMALL)
    Path(server.root, "file").write_bytes(b"x")
    with pytest.raises(UsageError, match="not a directory"):
        run_bench(parse_url(server.url("file")), directory=str(tmp_path), **SMALL)
    assert sorted(os.listdir(server.root)) == sorted(before + ["file"])  # no directory made
    os.mkdir(os.path.join(server.root, "here"))
    res = run_bench(parse_url(server.url("here")), directory=str(tmp_path), **SMALL)
    check_result(res)
    assert leftovers(server.root) == [] and os.listdir(os.path.join(server.root, "here")) == []


def test_bench_link_api(server: LiveServer) -> None:
    """The older ``client.bench_link`` (RTT and raw TCP down per stream count), now over the same
    measurements as ``tb5sync bench``."""
    from tb5sync.remote.client import bench_link

    lines = list(bench_link("127.0.0.1", server.port, seconds=0.1))
    assert len(lines) == 1 + len(STREAM_COUNTS)
    assert lines[0].startswith("rtt: median ") and "p99" in lines[0]
    for n, line in zip(STREAM_COUNTS, lines[1:]):
        assert line.startswith(f"raw TCP, {n} stream") and f"{n * 256} MiB" in line
