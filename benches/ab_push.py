"""Cold pushes of one tree by two versions of tb5sync, alternating: wall time and CPU per side.

Each run starts a fresh ``tb5sync serve`` on 127.0.0.1 (a port picked by the kernel) into a new
empty directory, pushes ``TREE/`` into it with ``tb5sync sync``, stops the server and removes the
directory. The versions alternate run by run (old, new, old, new, ...), so a machine shared with
other jobs slows both alike. Client CPU is user+sys from ``os.wait4``; server CPU is the change of
its ``/proc/PID/stat`` counters over the push (Linux; elsewhere the server's whole ``os.wait4``
time, start-up included). Medians per version are printed, with the per-run figures.

The old version is a directory holding a ``tb5sync`` package (its Cython modules built), e.g.::

    git archive BASE tb5sync | tar -x -C /tmp/old
    cp tb5sync/_cdc*.so tb5sync/_scan*.so tb5sync/_write*.so tb5sync/_bytes*.so /tmp/old/tb5sync/
    .venv/bin/python benches/ab_push.py --old /tmp/old --tree /tmp/tb5sync-bench/data-full/tree --repeat 5

(copy only the extensions the old version had, unchanged since). The new version is the
``tb5sync`` this Python imports.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

# Runs the CLI from the directory OLD (given as argv[1]) instead of the installed package: an
# editable install's import hook would otherwise win over sys.path.
_OLD = (
    "import sys; old = sys.argv.pop(1); "
    "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]; "
    "sys.path.insert(0, old); sys.argv[0] = 'tb5sync'; from tb5sync.cli.command import run; run()"
)


def command(old: str | None) -> list[str]:
    """How to run one version's CLI."""
    if old is None:
        return [sys.executable, "-m", "tb5sync.cli"]
    return [sys.executable, "-c", _OLD, old]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_cpu(pid: int) -> float | None:
    """user+sys seconds of a running process, or None where /proc is not there."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def push(cmd: list[str], tree: str, workdir: str) -> tuple[float, float, float]:
    """One cold push: (wall seconds, client CPU seconds, server CPU seconds)."""
    root = tempfile.mkdtemp(prefix="ab-", dir=workdir)
    try:
        os.mkdir(os.path.join(root, "dst"))
        port = free_port()
        srv = subprocess.Popen(cmd + ["serve", root, "--bind", f"127.0.0.1:{port}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline or srv.poll() is not None:
                        raise SystemExit(f"server did not start: {' '.join(cmd)}")
                    time.sleep(0.05)
            before = proc_cpu(srv.pid)
            t0 = time.perf_counter()
            cli = subprocess.Popen(cmd + ["sync", tree.rstrip("/") + "/", f"tb5://127.0.0.1:{port}/dst"],
                                   stdout=subprocess.DEVNULL)
            _, status, ru = os.wait4(cli.pid, 0)
            wall = time.perf_counter() - t0
            after = proc_cpu(srv.pid)
            if status != 0:
                raise SystemExit(f"push failed (wait status {status}): {' '.join(cmd)}")
        finally:
            srv.terminate()
            _, _, sru = os.wait4(srv.pid, 0)
        server = after - before if before is not None and after is not None else sru.ru_utime + sru.ru_stime
        return wall, ru.ru_utime + ru.ru_stime, server
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", required=True, help="directory holding the old version's tb5sync package")
    p.add_argument("--tree", required=True, help="the source tree to push")
    p.add_argument("--repeat", type=int, default=5, help="runs per version (default 5)")
    p.add_argument("--workdir", default=tempfile.gettempdir(), help="where the destinations go (default: the temp dir)")
    a = p.parse_args(argv)
    runs: dict[str, list[tuple[float, float, float]]] = {"old": [], "new": []}
    for i in range(a.repeat):
        for name, old in (("old", a.old), ("new", None)):
            r = push(command(old), a.tree, a.workdir)
            runs[name].append(r)
            print(f"[{i + 1}/{a.repeat}] {name}  wall {r[0]:.3f} s  cpu client {r[1]:.3f} s  server {r[2]:.3f} s",
                  file=sys.stderr, flush=True)
    print("version  median wall s  client CPU s  server CPU s")
    for name, rs in runs.items():
        print(f"{name:7s}  {statistics.median(r[0] for r in rs):12.3f}  {statistics.median(r[1] for r in rs):12.3f}  "
              f"{statistics.median(r[2] for r in rs):12.3f}")
    wins = sum(n[0] < o[0] for o, n in zip(runs["old"], runs["new"]))
    print(f"new faster in {wins} of {a.repeat} alternating pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
