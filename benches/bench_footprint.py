#!/usr/bin/env python3
"""Footprint of tb5sync: peak memory of both ends, start-up time, and the hashing-threads setting.

What it measures
----------------
1. **Peak RSS** (``ru_maxrss`` from ``os.wait4``, which counts mapped file pages while they are
   resident) of the server process and of the client process, for a push and a pull of one file
   of random bytes per size in ``--sizes`` (default 2 GiB and 8 GiB; ``--short``: 256 MiB and
   1 GiB), on loopback. Target (issue 4): at most 256 MiB for each, whatever the file size.
   Each transfer is checked: same size and BLAKE3 at both ends.
2. **Start-up**: wall time of ``python -c "import tb5sync"`` and of ``tb5sync --help`` (median
   of ``--startup-runs``), next to a bare ``python -c pass``, plus the in-process import time of
   ``tb5sync`` reported by ``python -X importtime``. Targets: import <= 100 ms, --help <= 150 ms.
3. **Hashing threads** (``--hash-threads 1,2,...``): the push of the first size again with
   ``tb5sync --hash-threads N`` at both ends, GB/s and CPU seconds per GB, one row per N.

Usage::

    python benches/bench_footprint.py [--short] [--sizes 2048,8192] [--hash-threads 1,2]
                                      [--workdir DIR] [--json-out PATH]

Data goes to ``WORKDIR/footprint`` (default ``/tmp/tb5sync-bench``) and is reused while the
sizes match; destinations are removed after each run. Exit status 1 if a transfer failed or
did not verify.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import blake3

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TARGET_RSS_MIB = 256


def tb5_cmd() -> list[str]:
    """The tb5sync command beside this Python, else on PATH, else ``python -m``-style from the repo."""
    cand = os.path.join(os.path.dirname(sys.executable), "tb5sync")
    if os.path.exists(cand):
        return [cand]
    found = shutil.which("tb5sync")
    if found:
        return [found]
    return [sys.executable, "-c", "import sys; sys.path.insert(0, %r); from tb5sync.cli.command import main; sys.exit(main())" % REPO]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def b3(path: str) -> str:
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    with open(path, "rb") as f:
        while True:
            b = f.read(16 << 20)
            if not b:
                return h.hexdigest()
            h.update(b)


def make_file(path: str, size: int) -> None:
    """A file of ``size`` random bytes at ``path``, reused when it already has that size."""
    if os.path.exists(path) and os.path.getsize(path) == size:
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        left = size
        while left:
            n = min(left, 64 << 20)
            f.write(os.urandom(n))
            left -= n
    os.rename(tmp, path)


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("server did not start listening")


def transfer(cmd: list[str], op: str, src_dir: str, work: str, extra: list[str]) -> dict:
    """One push (server ROOT = empty dir) or pull (server ROOT = src_dir); peak RSS of both ends."""
    dst = os.path.join(work, "dst")
    shutil.rmtree(dst, ignore_errors=True)
    os.makedirs(dst)
    shutil.rmtree(os.path.join(src_dir, ".tb5sync"), ignore_errors=True)
    port = free_port()
    root = dst if op == "push" else src_dir
    srv = subprocess.Popen(cmd + extra + ["serve", root, "--bind", f"127.0.0.1:{port}"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_port(port, srv)
        url = f"tb5://127.0.0.1:{port}/"
        args = [src_dir + "/", url + "d"] if op == "push" else [url, dst + "/"]
        t = time.perf_counter()
        cli = subprocess.Popen(cmd + extra + ["sync", *args, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = cli.stdout.read(), cli.stderr.read()  # type: ignore[union-attr]
        _, status, cru = os.wait4(cli.pid, 0)
        wall = time.perf_counter() - t
        cli.returncode = os.waitstatus_to_exitcode(status)
    finally:
        srv.send_signal(signal.SIGTERM)
        _, sstatus, sru = os.wait4(srv.pid, 0)
        srv.returncode = os.waitstatus_to_exitcode(sstatus)
    res = {"op": op, "wall": wall, "client_rss_mib": cru.ru_maxrss / 1024, "server_rss_mib": sru.ru_maxrss / 1024,
           "cpu_seconds": cru.ru_utime + cru.ru_stime + sru.ru_utime + sru.ru_stime, "ok": cli.returncode == 0}
    if cli.returncode != 0:
        res["error"] = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {cli.returncode}"]
        return res
    res["stats"] = json.loads(out)
    names = os.listdir(src_dir)
    files = [n for n in names if not n.startswith(".")]
    got = os.path.join(dst, "d", files[0]) if op == "push" else os.path.join(dst, files[0])
    res["verified"] = os.path.exists(got) and b3(got) == b3(os.path.join(src_dir, files[0]))
    res["ok"] = res["verified"]
    shutil.rmtree(dst, ignore_errors=True)
    return res


def startup(cmd: list[str], runs: int) -> dict:
    # As installed for a user: bytecode cached. PYTHONDONTWRITEBYTECODE (set on the development
    # machines) would make every start compile the sources again; a first unmeasured run writes
    # the caches.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}

    def med(argv: list[str]) -> float:
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=env)
        ts = []
        for _ in range(runs):
            t = time.perf_counter()
            subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=env)
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    py = sys.executable
    res = {"python_pass": med([py, "-c", "pass"]), "import_tb5sync": med([py, "-c", "import tb5sync"]),
           "tb5sync_help": med(cmd + ["--help"])}
    imp = subprocess.run([py, "-X", "importtime", "-c", "import tb5sync"], capture_output=True, text=True, check=True, env=env)
    m = [ln for ln in imp.stderr.splitlines() if re.search(r"\|\s*tb5sync$", ln)]
    res["import_inprocess"] = int(m[-1].split("|")[1]) / 1e6 if m else None
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--short", action="store_true", help="256 MiB and 1 GiB files")
    p.add_argument("--sizes", help="file sizes in MiB, comma-separated (default 2048,8192; short 256,1024)")
    p.add_argument("--hash-threads", default="", help="comma-separated thread counts to compare on a push")
    p.add_argument("--startup-runs", type=int, default=9, help="runs per start-up figure (median)")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "tb5sync-bench"))
    p.add_argument("--json-out", help="write the results as JSON here")
    a = p.parse_args()
    sizes = [int(x) for x in (a.sizes or ("256,1024" if a.short else "2048,8192")).split(",")]
    cmd = tb5_cmd()
    work = os.path.join(a.workdir, "footprint")
    os.makedirs(work, exist_ok=True)
    result: dict = {"sizes_mib": sizes, "runs": [], "hash_threads": [], "cmd": cmd}
    failed = False

    st = startup(cmd, a.startup_runs)
    result["startup"] = st
    print("start-up (median wall, s)")
    print(f"  python -c pass          {st['python_pass']:.3f}")
    print(f"  python -c 'import tb5sync' {st['import_tb5sync']:.3f}   (target <= 0.100; in-process import "
          f"{st['import_inprocess']:.3f} s)" if st["import_inprocess"] is not None else "")
    print(f"  tb5sync --help          {st['tb5sync_help']:.3f}   (target <= 0.150)")

    print(f"\npeak RSS (MiB), target <= {TARGET_RSS_MIB} for server and client")
    print("  size      op     server   client   GB/s   CPU s/GB  verified")
    for mib in sizes:
        src = os.path.join(work, f"src-{mib}")
        for old in os.listdir(work):
            if old.startswith("src-") and old != f"src-{mib}":
                shutil.rmtree(os.path.join(work, old), ignore_errors=True)
        make_file(os.path.join(src, "big.bin"), mib << 20)
        for op in ("push", "pull"):
            r = transfer(cmd, op, src, work, [])
            r["mib"] = mib
            result["runs"].append(r)
            gb = (mib << 20) / 1e9
            if not r["ok"]:
                failed = True
                print(f"  {mib:6d}   {op:5s}  FAILED {r.get('error', 'did not verify')}")
                continue
            print(f"  {mib:6d}   {op:5s}  {r['server_rss_mib']:7.0f}  {r['client_rss_mib']:7.0f}  "
                  f"{gb / r['wall']:5.2f}  {r['cpu_seconds'] / gb:8.2f}  yes")
        if mib == sizes[0] and a.hash_threads:
            print("\n  hashing threads (push of the first size)")
            for n in [int(x) for x in a.hash_threads.split(",")]:
                r = transfer(cmd, "push", src, work, ["--hash-threads", str(n)])
                r["threads"] = n
                result["hash_threads"].append(r)
                gb = (mib << 20) / 1e9
                print(f"  --hash-threads {n:2d}: {gb / r['wall']:5.2f} GB/s, {r['cpu_seconds'] / gb:5.2f} CPU s/GB"
                      + ("" if r["ok"] else "  FAILED"))
                failed |= not r["ok"]
            print()
        if mib != sizes[-1]:
            shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(result, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
