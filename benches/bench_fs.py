#!/usr/bin/env python3
"""Latency and throughput of the tb5:// fsspec filesystem against raw TCP, on loopback, in one run.

What it measures (each figure the median of ``--repeat`` runs, tb5 and its raw-TCP peer
alternating so drift hits both):

* **small-op round trips**: ``fs.info(path)`` and ``fs.cat_file(<4 KiB file>)`` one after the
  other (each waits for its reply), against a raw TCP ping-pong between two Python processes
  (64-byte request, 64-byte reply for info; 4 KiB reply for cat). Ratio = tb5 ops/s / ping-pongs/s.
* **pipelined small ops**: 2,000 ``info`` calls issued together (``asyncio.gather``) and one
  ``fs.cat`` of 2,000 files of 4 KiB (one ``cat_many`` round trip per 32 MiB), as ops/s.
* **sequential read**: ``fs.open(big, "rb").read(8 MiB)`` until EOF (the file object's readahead),
  and ``fs.cat_file(big)`` (16 MiB requests over all connections), against a raw TCP stream
  from one Python process to another (``sendall`` of 4 MiB buffers into ``recv_into``). GB/s and
  the ratio to raw TCP.

The server is a real ``tb5sync serve`` process on 127.0.0.1 with port picked free; the raw peers
are Python subprocesses on 127.0.0.1. Nothing goes to any other address.

Usage::

    python benches/bench_fs.py            # 1 GiB file, 5 s per latency figure, repeat 5
    python benches/bench_fs.py --short    # 256 MiB, 2 s, repeat 3: well under a minute

Output: a table on stdout and JSON in ``benches/results/fs-<timestamp>.json`` (or ``--json-out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import fsspec  # noqa: E402

from tb5sync.fs import TB5FileSystem  # noqa: E402

LOOPBACK = "127.0.0.1"
MiB = 1 << 20
GB = 1e9

# A ping-pong peer: answers each fixed-size request with a reply of REPLY bytes.
PONG = r"""
import socket, sys
port, req, reply = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", port)); srv.listen(1)
print("ready", flush=True)
conn, _ = srv.accept(); conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf = bytearray(req); view = memoryview(buf); out = bytes(reply)
while True:
    got = 0
    while got < req:
        n = conn.recv_into(view[got:])
        if not n:
            sys.exit(0)
        got += n
    conn.sendall(out)
"""

# A stream source: sends NBYTES in 4 MiB sendall calls.
SOURCE = r"""
import socket, sys, os
port, nbytes = int(sys.argv[1]), int(sys.argv[2])
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", port)); srv.listen(1)
print("ready", flush=True)
conn, _ = srv.accept()
block = memoryview(bytearray(os.urandom(4 << 20)))
left = nbytes
while left > 0:
    n = min(left, len(block))
    conn.sendall(block[:n])
    left -= n
conn.close()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def start_peer(code: str, *args: Any) -> tuple[subprocess.Popen[str], int]:
    port = free_port()
    p = subprocess.Popen([sys.executable, "-c", code, str(port), *map(str, args)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    if p.stdout.readline().strip() != "ready":
        p.kill()
        raise RuntimeError("raw TCP peer did not start")
    return p, port


def raw_pingpong(seconds: float, req: int, reply: int) -> float:
    """Round trips per second of a blocking request/reply loop over one TCP connection."""
    p, port = start_peer(PONG, req, reply)
    try:
        with socket.create_connection((LOOPBACK, port)) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            msg = bytes(req)
            buf = bytearray(reply)
            view = memoryview(buf)
            n = 0
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                s.sendall(msg)
                got = 0
                while got < reply:
                    got += s.recv_into(view[got:])
                n += 1
            return n / (time.perf_counter() - t0)
    finally:
        p.kill()
        p.wait()


def raw_stream(nbytes: int) -> float:
    """GB/s of one TCP stream from another process into ``recv_into`` of a 4 MiB buffer."""
    p, port = start_peer(SOURCE, nbytes)
    try:
        with socket.create_connection((LOOPBACK, port)) as s:
            buf = memoryview(bytearray(4 << 20))
            got = 0
            t0 = time.perf_counter()
            while True:
                k = s.recv_into(buf)
                if not k:
                    break
                got += k
            dt = time.perf_counter() - t0
        if got != nbytes:
            raise RuntimeError(f"raw stream: got {got} of {nbytes} bytes")
        return got / dt / GB
    finally:
        p.wait()


def rate(seconds: float, op: Callable[[], Any]) -> float:
    """Calls per second of ``op`` run back to back for about ``seconds``."""
    op()  # warm (connections, caches)
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        op()
        n += 1
    return n / (time.perf_counter() - t0)


def make_data(root: str, big_bytes: int, small: int) -> None:
    os.makedirs(os.path.join(root, "small"), exist_ok=True)
    for i in range(small):
        with open(os.path.join(root, "small", f"f{i:05d}"), "wb") as f:
            f.write(os.urandom(4096))
    with open(os.path.join(root, "big.bin"), "wb") as f:
        block = os.urandom(16 * MiB)
        left = big_bytes
        while left > 0:
            f.write(block[: min(left, len(block))])
            left -= len(block)


def start_server(root: str) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    exe = shutil.which("tb5sync", path=os.path.dirname(sys.executable)) or shutil.which("tb5sync")
    cmd = [exe] if exe else [sys.executable, "-c", "from tb5sync.cli import main; main()"]
    p = subprocess.Popen([*cmd, "serve", root, "--bind", f"{LOOPBACK}:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            socket.create_connection((LOOPBACK, port), timeout=0.2).close()
            return p, port
        except OSError:
            time.sleep(0.05)
    p.kill()
    raise RuntimeError("tb5sync serve did not start")


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--short", action="store_true", help="256 MiB file, 2 s per latency figure, repeat 3")
    ap.add_argument("--repeat", type=int, help="runs per figure (default 5, short 3)")
    ap.add_argument("--seconds", type=float, help="seconds per latency figure (default 5, short 2)")
    ap.add_argument("--size-mib", type=int, help="size of the big file in MiB (default 1024, short 256)")
    ap.add_argument("--streams", type=int, default=4, help="connections the filesystem keeps (default 4)")
    ap.add_argument("--workdir", default=None, help="where the served data lives (default: a temporary directory)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    repeat = args.repeat or (3 if args.short else 5)
    seconds = args.seconds or (2.0 if args.short else 5.0)
    size = (args.size_mib or (256 if args.short else 1024)) * MiB
    small = 2000

    work = args.workdir or tempfile.mkdtemp(prefix="tb5-bench-fs-")
    root = os.path.join(work, "root")
    if not os.path.exists(os.path.join(root, "big.bin")) or os.path.getsize(os.path.join(root, "big.bin")) != size:
        shutil.rmtree(root, ignore_errors=True)
        make_data(root, size, small)
    server, port = start_server(root)
    fs = TB5FileSystem(host=LOOPBACK, port=port, streams=args.streams, skip_instance_cache=True)
    smalls = [f"small/f{i:05d}" for i in range(small)]
    res: dict[str, list[float]] = {k: [] for k in ("raw_pp64", "raw_pp4k", "info", "cat4k", "info_gather", "cat_many", "raw_stream", "open_read", "cat_file")}

    async def gather_info() -> None:
        await asyncio.gather(*[fs._info(p) for p in smalls])

    try:
        for n in range(repeat):
            res["raw_pp64"].append(raw_pingpong(seconds, 64, 64))
            res["info"].append(rate(seconds, lambda: fs.info("small/f00001")))
            res["raw_pp4k"].append(raw_pingpong(seconds, 64, 4096))
            res["cat4k"].append(rate(seconds, lambda: fs.cat_file("small/f00002")))
            t = time.perf_counter()
            fsspec.asyn.sync(fs.loop, gather_info)
            res["info_gather"].append(small / (time.perf_counter() - t))
            t = time.perf_counter()
            got = fs.cat(smalls)
            res["cat_many"].append(small / (time.perf_counter() - t))
            assert len(got) == small and all(len(v) == 4096 for v in got.values())
            res["raw_stream"].append(raw_stream(size))
            t = time.perf_counter()
            total = 0
            with fs.open("big.bin", "rb") as f:
                while block := f.read(8 * MiB):
                    total += len(block)
            res["open_read"].append(total / (time.perf_counter() - t) / GB)
            assert total == size
            t = time.perf_counter()
            data = fs.cat_file("big.bin")
            res["cat_file"].append(len(data) / (time.perf_counter() - t) / GB)
            assert len(data) == size
            del data
            print(f"[{n + 1}/{repeat}] info {res['info'][-1]:.0f}/s vs ping-pong {res['raw_pp64'][-1]:.0f}/s; "
                  f"read {res['open_read'][-1]:.2f} GB/s vs raw {res['raw_stream'][-1]:.2f} GB/s", file=sys.stderr)
    finally:
        fs._holder.close()
        server.terminate()
        server.wait()
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)

    m = {k: median(v) for k, v in res.items()}
    rows = [
        ("info, one at a time", f"{m['info']:,.0f} ops/s", f"ping-pong 64 B: {m['raw_pp64']:,.0f}/s", m["info"] / m["raw_pp64"]),
        ("cat_file 4 KiB, one at a time", f"{m['cat4k']:,.0f} ops/s", f"ping-pong 4 KiB: {m['raw_pp4k']:,.0f}/s", m["cat4k"] / m["raw_pp4k"]),
        ("info x2000, gathered", f"{m['info_gather']:,.0f} ops/s", f"ping-pong 64 B: {m['raw_pp64']:,.0f}/s", m["info_gather"] / m["raw_pp64"]),
        ("cat of 2000 x 4 KiB files", f"{m['cat_many']:,.0f} files/s", f"ping-pong 4 KiB: {m['raw_pp4k']:,.0f}/s", m["cat_many"] / m["raw_pp4k"]),
        (f"open().read() {size // MiB} MiB", f"{m['open_read']:.2f} GB/s", f"raw TCP: {m['raw_stream']:.2f} GB/s", m["open_read"] / m["raw_stream"]),
        (f"cat_file {size // MiB} MiB", f"{m['cat_file']:.2f} GB/s", f"raw TCP: {m['raw_stream']:.2f} GB/s", m["cat_file"] / m["raw_stream"]),
    ]
    print(f"\ntb5:// fsspec on loopback, median of {repeat} (streams={args.streams}); ratio > 1 = tb5 faster than the raw peer\n")
    print(f"| {'figure':<32} | {'tb5://':>16} | {'raw TCP peer':<28} | ratio |")
    print(f"|{'-' * 34}|{'-' * 18}|{'-' * 30}|-------|")
    for name, ours, peer, ratio in rows:
        print(f"| {name:<32} | {ours:>16} | {peer:<28} | {ratio:5.2f} |")
    out = args.json_out or os.path.join(HERE, "results", f"fs-{time.strftime('%Y%m%d-%H%M%S')}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"repeat": repeat, "seconds": seconds, "size": size, "streams": args.streams, "runs": res, "median": m,
                   "ratios": {r[0]: r[3] for r in rows}}, f, indent=1)
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
