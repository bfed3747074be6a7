#!/usr/bin/env python3
"""Cold push of one large file with the client and the server pinned to disjoint sets of cores.

For each count N in ``--cores`` (default 1, 2, 4, ... up to half the CPUs this process may run
on), the client is started on CPUs ``0..N-1`` and the server on ``N..2N-1`` of that set
(``os.sched_setaffinity`` of the spawning thread just before each ``fork``: the child and all
its threads and forks inherit it, as with ``taskset -c``). tb5sync (``tb5sync serve`` +
``tb5sync sync FILE tb5://...``) and rsync (``rsync --daemon`` + ``rsync -a FILE rsync://...``)
alternate, ``--repeat`` times each; the table gives the median GB/s (file bytes / client wall)
and CPU s/GB per side (user+sys; the tools and the accounting are ``bench_sync.py``'s), and each
destination is compared with the source.

On macOS there is no way to pin a process to cores (``sched_setaffinity`` does not exist; thread
affinity tags are only hints): the bench says so and runs one unpinned point with all cores.
On a machine with fewer than 2 CPUs it does the same.

Usage::

    .venv/bin/python benches/bench_pinned.py                    # 512 MiB, 3 runs per point
    .venv/bin/python benches/bench_pinned.py --size 2G --cores 1,2,4,8 --json-out pinned.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_cpu  # noqa: E402  (the data file)
import bench_sync as bs  # noqa: E402  (the tools, the process accounting)

MiB, GiB, GB = 1 << 20, 1 << 30, 1e9


def usable_cpus() -> list[int] | None:
    """The CPUs this process may run on, sorted; None where affinity cannot be set (macOS)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    return sorted(os.sched_getaffinity(0))


def default_counts(cpus: list[int] | None) -> list[int]:
    """1, 2, 4, ... up to half of ``cpus`` (at least [1])."""
    half = len(cpus) // 2 if cpus else 1
    out, n = [], 1
    while n <= max(1, half):
        out.append(n)
        n *= 2
    if half > 1 and out[-1] != half:
        out.append(half)
    return out


@contextlib.contextmanager
def pinned(cpus: set[int] | None):
    """Run the body (which forks the process to pin) with this thread's affinity set to ``cpus``;
    the former set is restored afterwards. ``None``: no change."""
    if cpus is None:
        yield
        return
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)


class PinnedTool:
    """A bench_sync tool whose server and client are started on given CPU sets."""

    def __init__(self, tool, server_cpus: set[int] | None, client_cpus: set[int] | None):
        self.tool, self.server_cpus, self.client_cpus = tool, server_cpus, client_cpus
        self.name = tool.name

    def serve(self, root: str):
        with pinned(self.server_cpus):
            return self.tool.serve(root)

    def remote(self, srv, rel: str) -> str:
        return self.tool.remote(srv, rel)

    def sync(self, src: str, dst: str):
        # the thread waits in wait4 on the client's CPUs: it sleeps there, it does not compete
        with pinned(self.client_cpus):
            return self.tool.sync(src, dst)


def point(args, src_dir: str, size: int, tools: list, server_cpus, client_cpus) -> dict:
    """Median GB/s and CPU s/GB per side of ``--repeat`` alternating cold pushes per tool."""
    verifier = bs.Verifier(sample=10)
    runs: dict[str, list] = {t.name: [] for t in tools}
    for i in range(args.repeat):
        for base in tools:
            tool = PinnedTool(base, server_cpus, client_cpus)
            root = os.path.join(args.workdir, "runs", f"{tool.name}-{i}")
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(os.path.join(root, "dst"))
            os.sync()
            bs.clear_state(src_dir)
            with tool.serve(root) as srv:
                run = tool.sync(src_dir + "/", tool.remote(srv, "dst"))
            run.cpu_server = srv.cpu
            bad = verifier.verify(src_dir, os.path.join(root, "dst"), f"{tool.name}-{i}")
            shutil.rmtree(root, ignore_errors=True)
            if bad:
                raise SystemExit(f"{tool.name} run {i}: destination differs from the source: {bad}")
            runs[tool.name].append(run)
            print(f"  {tool.name} run {i}: wall {run.wall:.2f} s, client {run.cpu_client / size * GB:.2f}"
                  f" + server {run.cpu_server / size * GB:.2f} CPU s/GB", file=sys.stderr)
    out = {}
    for name, rs in runs.items():
        wall = statistics.median(r.wall for r in rs)
        out[name] = {"gb_per_s": size / wall / GB, "wall": wall,
                     "cpu_per_gb": statistics.median(r.cpu for r in rs) / size * GB,
                     "client": statistics.median(r.cpu_client for r in rs) / size * GB,
                     "server": statistics.median(r.cpu_server for r in rs) / size * GB}
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=bench_cpu.parse_size, default=512 * MiB, help="file size (default 512M)")
    p.add_argument("--repeat", type=int, default=3, help="runs per tool and point (median; default 3)")
    p.add_argument("--cores", help="comma-separated cores per side (default 1,2,4,... up to half the CPUs)")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "tb5sync-bench-pinned"))
    p.add_argument("--streams", type=int, help="tb5sync sync --streams N")
    p.add_argument("--tb5sync-cmd", help="command to run tb5sync (default: beside this python)")
    p.add_argument("--json-out", help="write the figures as JSON here too")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.workdir = os.path.abspath(args.workdir)
    os.makedirs(args.workdir, exist_ok=True)
    cpus = usable_cpus()
    note = ""
    if cpus is None:
        note = f"{sys.platform}: pinning to cores is not available here (no sched_setaffinity); one unpinned point"
    elif len(cpus) < 2:
        note = f"only {len(cpus)} CPU: no two disjoint sets; one unpinned point"
    counts = [int(x) for x in args.cores.split(",")] if args.cores else default_counts(cpus)
    if note:
        counts = [0]
    elif cpus is not None and max(counts) * 2 > len(cpus):
        raise SystemExit(f"--cores {max(counts)} per side needs {2 * max(counts)} CPUs; this process may use {len(cpus)}")
    path = bench_cpu.ensure_file(args.workdir, args.size)
    src_dir = os.path.dirname(path)
    log_dir = tempfile.mkdtemp(prefix="logs-", dir=args.workdir)
    token_file = os.path.join(log_dir, "token")
    with open(os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(os.urandom(24).hex() + "\n")
    cmd, env = bs.find_tb5sync(args.tb5sync_cmd)
    tools = [bs.Tb5sync(cmd, env, token_file, args.streams, 600.0, log_dir), bs.Rsync(600.0, log_dir)]
    points = []
    bs.RSS.watch(os.getpid())  # its sampling thread starts here, unpinned (threads inherit affinity)
    bs.RSS.peak(os.getpid())
    try:
        for n in counts:
            client_cpus = set(cpus[:n]) if n else None
            server_cpus = set(cpus[n : 2 * n]) if n else None
            print(f"cores per side {n or 'all (unpinned)'}: client {sorted(client_cpus or [])} server "
                  f"{sorted(server_cpus or [])}", file=sys.stderr)
            res = point(args, src_dir, args.size, tools, server_cpus, client_cpus)
            points.append({"cores": n or "all (unpinned)", "client_cpus": sorted(client_cpus or []),
                           "server_cpus": sorted(server_cpus or []), **res})
    finally:
        for proc in list(bs.LIVE):
            proc.stop(timeout=3)
        shutil.rmtree(log_dir, ignore_errors=True)
    print(f"\nCold push of one file of {args.size / MiB:.0f} MiB, client and server on disjoint cores "
          f"(median of {args.repeat}; GB = 1e9 bytes; CPU s/GB client + server)\n")
    print(f"{'cores/side':>10} {'tb5sync GB/s':>13} {'rsync GB/s':>11} {'tb5sync CPU s/GB':>17} {'rsync CPU s/GB':>15}")
    for pt in points:
        t, r = pt["tb5sync"], pt["rsync"]
        print(f"{str(pt['cores']):>10} {t['gb_per_s']:13.2f} {r['gb_per_s']:11.2f} "
              f"{t['client']:8.2f}+{t['server']:.2f} {r['client']:7.2f}+{r['server']:.2f}")
    if note:
        print(f"({note})")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"size": args.size, "cpus": cpus, "note": note, "points": points}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
