#!/usr/bin/env python3
"""Latency and throughput of the tb5:// fsspec filesystem against raw TCP, on loopback, in one run.

What it measures (each figure the median of ``--repeat`` runs, tb5 and its raw-TCP peer
alternating so drift hits both):

* **small-op round trips**: ``fs.info(path)`` and ``fs.cat_file(<4 KiB file>)`` one after the
  other (each waits for its reply), against a raw TCP ping-pong between two Python processes
  (64-byte request, 64-byte reply for info; 4 KiB reply for cat). Ratio = tb5 ops/s / ping-pongs/s.
  For tb5 it also prints the CPU time per call of each side (this process, all its threads, from
  ``time.process_time``; the server from ``/proc/PID/stat``, Linux only), microseconds.
* **pipelined small ops**: 2,000 ``info`` calls issued together (``asyncio.gather``) and one
  ``fs.cat`` of 2,000 files of 4 KiB (one ``cat_many`` round trip per 32 MiB), as ops/s.
* **sequential read**: ``fs.open(big, "rb").read()`` (the whole file in one call),
  ``fs.open(big, "rb").read(8 MiB)`` until EOF (the file object's readahead), ``fs.cat_file(big)``
  (pieces over all connections), ``fs.get_file(big, local)`` and ``fs.put_file(local, new)``
  (nginx: WebDAV ``PUT``), against a raw TCP stream from one
  Python process to another (``sendall`` of 4 MiB buffers into ``recv_into``). GB/s and the ratio
  to raw TCP.
* **peers** (``--peers sshfs,http``, both by default when their servers are installed): the same
  small ops and reads through fsspec's SFTP filesystem (the ``sshfs`` package) against OpenSSH's
  ``sshd`` on 127.0.0.1 (a generated host key and client key in a temporary directory, the
  ``internal-sftp`` subsystem), and through fsspec's ``HTTPFileSystem`` against ``nginx`` serving
  the data directory on 127.0.0.1 (generated config, ``sendfile on``). Ratios tb5/sshfs and
  tb5/http: > 1 means tb5:// is faster.

The server is a real ``tb5sync serve`` process on 127.0.0.1 with port picked free; the raw peers
are Python subprocesses on 127.0.0.1; sshd and nginx listen on 127.0.0.1 only. Nothing goes to any
other address. Needs ``apt-get install openssh-server nginx-light`` and ``pip install sshfs`` for the
peers (a missing one is reported and skipped).

Usage::

    python benches/bench_fs.py            # 1 GiB file, 5 s per latency figure, repeat 5
    python benches/bench_fs.py --short    # 256 MiB, 2 s, repeat 3: well under a minute

Output: a table on stdout and JSON in ``benches/results/fs-<timestamp>.json`` (or ``--json-out``).
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import mmap
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

from tb5sync.fs.filesystem import TB5FileSystem  # noqa: E402

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


def raw_stream(nbytes: int, fresh: bool = False) -> float:
    """GB/s of one TCP stream from another process into ``recv_into`` of a reused 4 MiB buffer, or
    (``fresh``) into new memory of the whole size (an anonymous mapping, its pages first touched by
    ``recv``): what any read returning new ``bytes`` must also pay (page faults)."""
    p, port = start_peer(SOURCE, nbytes)
    try:
        with socket.create_connection((LOOPBACK, port)) as s:
            area = mmap.mmap(-1, nbytes) if fresh else None
            buf = memoryview(area if area is not None else bytearray(4 << 20))
            got = 0
            t0 = time.perf_counter()
            while True:
                k = s.recv_into(buf[got:] if fresh else buf)
                if not k:
                    break
                got += k
            dt = time.perf_counter() - t0
            buf.release()
            if area is not None:
                area.close()
        if got != nbytes:
            raise RuntimeError(f"raw stream: got {got} of {nbytes} bytes")
        return got / dt / GB
    finally:
        p.wait()


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far (Linux ``/proc``; NaN elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    """Live child processes of ``pid`` (``/proc``, Linux; none elsewhere)."""
    out = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit() or int(name) == pid:
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                if int(f.read().rpartition(")")[2].split()[1]) == pid:
                    out.append(int(name))
        except (OSError, IndexError, ValueError):
            continue
    return out


def tree_cpu(pid: int) -> float:
    """CPU seconds of process ``pid`` and of its live children (a server's worker processes), from
    ``/proc`` (Linux; NaN elsewhere)."""
    return proc_cpu(pid) + sum(proc_cpu(c) for c in child_pids(pid))


def rate(seconds: float, op: Callable[[], Any], cpu: list[tuple[float, float]] | None = None, server_pid: int | None = None) -> float:
    """Calls per second of ``op`` run back to back for about ``seconds``.

    With ``cpu``, appends ``(client, server)`` CPU microseconds per call: this process's CPU time
    (all its threads) and, with ``server_pid``, the server process's (``/proc/PID/stat``).
    """
    op()  # warm (connections, caches)
    n = 0
    c0, s0 = time.process_time(), tree_cpu(server_pid) if server_pid else float("nan")
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        op()
        n += 1
    dt = time.perf_counter() - t0
    if cpu is not None:
        s1 = tree_cpu(server_pid) if server_pid else float("nan")
        cpu.append(((time.process_time() - c0) / n * 1e6, (s1 - s0) / n * 1e6))
    return n / dt


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


def pinning_available() -> str | None:
    """None when the server can be pinned to 1 and then 2 cores here, else why not (one line)."""
    if not hasattr(os, "sched_setaffinity"):
        return "not available: no os.sched_setaffinity on this platform"
    if len(os.sched_getaffinity(0)) < 2:
        return "not available: this process may run on fewer than 2 cores"
    return None


def start_server(root: str, cpus: set[int] | None = None, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen[bytes], int]:
    """A ``tb5sync serve ROOT`` on 127.0.0.1 (port picked free), with ``cpus``: pinned to those
    cores before it starts (``os.sched_setaffinity`` in the child, so every thread and process
    it makes inherits it; Linux only, see :func:`pinning_available`). ``extra``: more options."""
    port = free_port()
    exe = shutil.which("tb5sync", path=os.path.dirname(sys.executable)) or shutil.which("tb5sync")
    cmd = [exe] if exe else [sys.executable, "-c", "from tb5sync.cli.command import main; main()"]
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    p = subprocess.Popen([*cmd, "serve", root, "--bind", f"{LOOPBACK}:{port}", *extra], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, preexec_fn=pin)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            socket.create_connection((LOOPBACK, port), timeout=0.2).close()
            return p, port
        except OSError:
            time.sleep(0.05)
    p.kill()
    raise RuntimeError("tb5sync serve did not start")


def wait_port(port: int, proc: subprocess.Popen[Any], what: str) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}")
        try:
            socket.create_connection((LOOPBACK, port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{what} did not start")


def start_sshd(work: str) -> tuple[subprocess.Popen[bytes], int, str]:
    """OpenSSH's sshd on 127.0.0.1 with a generated host key and one authorized client key; (proc, port, client key)."""
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    if not os.path.exists(sshd) or not shutil.which("ssh-keygen"):
        raise RuntimeError("sshd not installed (apt-get install openssh-server)")
    d = os.path.join(work, "ssh")
    os.makedirs(d, exist_ok=True)
    for name in ("host", "client"):
        if not os.path.exists(os.path.join(d, name)):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", os.path.join(d, name)], check=True)
    shutil.copy(os.path.join(d, "client.pub"), os.path.join(d, "authorized_keys"))
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
    port = free_port()
    conf = os.path.join(d, "sshd_config")
    with open(conf, "w") as f:
        f.write(f"Port {port}\nListenAddress {LOOPBACK}\nHostKey {d}/host\nAuthorizedKeysFile {d}/authorized_keys\n"
                f"PidFile {d}/sshd.pid\nPasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
                f"StrictModes no\nPermitRootLogin yes\nSubsystem sftp internal-sftp\n")
    p = subprocess.Popen([sshd, "-D", "-e", "-f", conf], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port, p, "sshd")
    return p, port, os.path.join(d, "client")


def start_nginx(work: str, root: str) -> tuple[subprocess.Popen[bytes], int]:
    """nginx serving ``root`` on 127.0.0.1 (generated config, sendfile on, no access log, WebDAV ``PUT``
    under ``/up/`` for ``put_file``); (proc, port)."""
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not os.path.exists(nginx):
        raise RuntimeError("nginx not installed (apt-get install nginx-light)")
    d = os.path.join(work, "nginx")
    os.makedirs(d, exist_ok=True)
    port = free_port()
    user = "user root;\n" if os.geteuid() == 0 else ""  # as root, workers must still read a 0700 temp dir
    conf = os.path.join(d, "nginx.conf")
    with open(conf, "w") as f:
        f.write(f"{user}worker_processes 1;\ndaemon off;\npid {d}/nginx.pid;\nerror_log {d}/error.log;\n"
                f"events {{ worker_connections 256; }}\nhttp {{ access_log off; sendfile on; tcp_nopush on; "
                f"keepalive_requests 1000000; client_body_temp_path {d}; proxy_temp_path {d}; fastcgi_temp_path {d}; "
                f"uwsgi_temp_path {d}; scgi_temp_path {d};\n"
                f"server {{ listen {LOOPBACK}:{port}; root {root}; client_max_body_size 0; "
                f"location /up/ {{ dav_methods PUT; create_full_put_path on; }} }} }}\n")
    p = subprocess.Popen([nginx, "-c", conf, "-p", d], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port, p, "nginx")
    return p, port


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


#: 4 KiB reads per figure of the many-in-flight rows
RANDOM_READS = 20_000


def random_reads(fs: TB5FileSystem, size: int, n: int, how: str, seed: int, server_pid: int) -> tuple[float, float, float]:
    """``n`` reads of 4 KiB at random 4 KiB-aligned offsets of ``big.bin`` (``size`` bytes), all in
    flight together: ``how`` = ``"cat_ranges"`` (one ``fs.cat_ranges`` call) or ``"gather"``
    (``asyncio.gather`` of ``fs._cat_file``, 2,000 at a time). Returns (ops/s, client CPU us per
    read, server CPU us per read, the server's worker processes included)."""
    import random

    rnd = random.Random(seed)
    offs = [rnd.randrange(0, size // 4096) * 4096 for _ in range(n)]

    async def gathered() -> int:
        got = 0
        for i in range(0, n, 2000):
            blocks = await asyncio.gather(*[fs._cat_file("big.bin", o, o + 4096) for o in offs[i : i + 2000]])
            got += sum(map(len, blocks))
        return got

    c0, s0, t0 = time.process_time(), tree_cpu(server_pid), time.perf_counter()
    if how == "gather":
        got = fsspec.asyn.sync(fs.loop, gathered)
    else:
        got = sum(map(len, fs.cat_ranges(["big.bin"] * n, offs, [o + 4096 for o in offs])))
    dt = time.perf_counter() - t0
    c1, s1 = time.process_time(), tree_cpu(server_pid)
    if got != 4096 * n:
        raise RuntimeError(f"random reads: got {got} of {4096 * n} bytes")
    return n / dt, (c1 - c0) / n * 1e6, (s1 - s0) / n * 1e6


def _client_reads(port: int, size: int, n: int, seed: int, go: Any, out: Any) -> None:
    """One client process of :func:`many_clients`: its own filesystem, a warm-up, then (once ``go``
    is set) ``n`` gathered random 4 KiB reads; puts (start, end, client CPU s) on ``out``."""
    fs = TB5FileSystem(host=LOOPBACK, port=port, skip_instance_cache=True)
    try:
        random_reads(fs, size, 2000, "gather", -1, os.getpid())
        go.wait()
        c0, t0 = time.process_time(), time.perf_counter()
        random_reads(fs, size, n, "gather", seed, os.getpid())
        out.put((t0, time.perf_counter(), time.process_time() - c0))
    finally:
        fs._holder.close()


def many_clients(port: int, size: int, n: int, clients: int, seed: int, server_pid: int) -> tuple[float, float, float]:
    """``clients`` processes (each a filesystem of its own) doing ``n`` gathered random 4 KiB reads
    each at once: (ops/s over all, client CPU us per read, server CPU us per read, its workers
    included). With 1 client, :func:`random_reads` in this process."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_client_reads, args=(port, size, n, seed * 100 + i, go, out)) for i in range(clients)]
    for p in procs:
        p.start()
    time.sleep(3.0)  # every client started and warm (spawn imports take ~1 s)
    s0 = tree_cpu(server_pid)
    go.set()
    got = [out.get(timeout=600) for _ in procs]
    s1 = tree_cpu(server_pid)
    for p in procs:
        p.join(60)
    total = n * clients
    wall = max(e for _, e, _ in got) - min(t for t, _, _ in got)
    return total / wall, sum(c for _, _, c in got) / total * 1e6, (s1 - s0) / total * 1e6


def small_op_targets(root: str, size: int, repeat: int, seconds: float, streams: int, serve_args: tuple[str, ...],
                     clients: int = 1) -> dict[str, Any]:
    """The tb5:// small-op targets of issue 26, each measured ``repeat`` times and printed with
    met / not met: CPU per ``info`` and per 4 KiB ``cat_file`` (one at a time, client and server),
    4 KiB random reads with many in flight, and the server pinned to 1 and then to 2 cores
    (two servers, one pinned each way, measured alternately; with ``clients`` > 1, that many client
    processes at once, see :func:`many_clients`, and a row of them unpinned). Returns the figures (medians)."""
    out: dict[str, Any] = {}
    server, port = start_server(root, extra=serve_args)
    fs = TB5FileSystem(host=LOOPBACK, port=port, streams=streams, skip_instance_cache=True)
    cpu_info: list[tuple[float, float]] = []
    cpu_cat: list[tuple[float, float]] = []
    rr: dict[str, list[tuple[float, float, float]]] = {"cat_ranges": [], "gather": []}
    try:
        for n in range(repeat):
            rate(seconds, lambda: fs.info("small/f00001"), cpu_info, server.pid)
            rate(seconds, lambda: fs.cat_file("small/f00002"), cpu_cat, server.pid)
            for how in rr:
                random_reads(fs, size, 2000, how, -1, server.pid)  # warm
                rr[how].append(random_reads(fs, size, RANDOM_READS, how, n, server.pid))
            if clients > 1:
                rr.setdefault("clients", []).append(many_clients(port, size, RANDOM_READS // clients, clients, n, server.pid))
            out["server_processes"] = 1 + len(child_pids(server.pid))
    finally:
        fs._holder.close()
        server.terminate()
        server.wait()
    for label, cpu in (("info", cpu_info), ("cat4k", cpu_cat)):
        out[f"{label}:cpu_client_us"] = median([c for c, _ in cpu])
        out[f"{label}:cpu_server_us"] = median([v for _, v in cpu])
    for how, runs in rr.items():
        out[f"random4k_{how}:ops"] = median([r[0] for r in runs])
        out[f"random4k_{how}:cpu_client_us"] = median([r[1] for r in runs])
        out[f"random4k_{how}:cpu_server_us"] = median([r[2] for r in runs])
    why = pinning_available()
    out["pinning"] = why or "measured"
    if why is None:
        cores = sorted(os.sched_getaffinity(0))
        servers: dict[int, tuple[subprocess.Popen[bytes], TB5FileSystem]] = {}
        got: dict[int, list[float]] = {1: [], 2: []}
        try:
            ports: dict[int, int] = {}
            for k in (1, 2):
                p, pport = start_server(root, set(cores[:k]), serve_args)
                ports[k] = pport
                servers[k] = (p, TB5FileSystem(host=LOOPBACK, port=pport, streams=streams, skip_instance_cache=True))
            for n in range(repeat):
                for k in ((1, 2) if n % 2 == 0 else (2, 1)):
                    p, f = servers[k]
                    if clients > 1:
                        got[k].append(many_clients(ports[k], size, RANDOM_READS // clients, clients, n, p.pid)[0])
                        continue
                    random_reads(f, size, 2000, "gather", -1, p.pid)
                    got[k].append(random_reads(f, size, RANDOM_READS, "gather", n, p.pid)[0])
        finally:
            for p, f in servers.values():
                f._holder.close()
                p.terminate()
                p.wait()
        out["pinned1:ops"], out["pinned2:ops"] = median(got[1]), median(got[2])
    fmt_us = lambda v: f"{v:.1f} us"  # noqa: E731
    targets = [
        ("server CPU per info", out["info:cpu_server_us"], 30.0, fmt_us),
        ("client CPU per info", out["info:cpu_client_us"], 30.0, fmt_us),
        ("server CPU per 4 KiB cat_file", out["cat4k:cpu_server_us"], 40.0, fmt_us),
        ("client CPU per 4 KiB cat_file", out["cat4k:cpu_client_us"], 40.0, fmt_us),
    ]
    rows = [[t, f(v), f"<= {f(lim)}", "met" if v <= lim else "NOT met"] for t, v, lim, f in targets]
    labels = [("cat_ranges", "4 KiB random reads in flight, cat_ranges"), ("gather", "4 KiB random reads in flight, gather(_cat_file)")]
    if clients > 1:
        labels.append(("clients", f"4 KiB random reads in flight, gather, {clients} client processes"))
    for how, label in labels:
        v = out[f"random4k_{how}:ops"]
        rows.append([label, f"{v:,.0f}/s (CPU {out[f'random4k_{how}:cpu_client_us']:.1f} us client, "
                     f"{out[f'random4k_{how}:cpu_server_us']:.1f} us server per read)", ">= 30,000/s", "met" if v >= 30_000 else "NOT met"])
    # one process is not the ceiling: its server CPU per request (all of it, an upper bound on the
    # GIL held) <= 10 us, or the requests served by several processes (the server's children counted)
    per_req = out["random4k_gather:cpu_server_us"]
    procs = out.get("server_processes", 1)
    several = procs > 1
    rows.append(["one server process not the ceiling", f"{per_req:.1f} us server CPU per request"
                 + (f", {procs} server processes" if several else ", one process (an upper bound on its GIL held)"),
                 "<= 10 us (GIL) or several processes", "met" if per_req <= 10 or several else "NOT met"])
    if why is None:
        r = out["pinned2:ops"] / out["pinned1:ops"]
        out["pinned_ratio"] = r
        # with 2 cores the client runs on the same cores as the server: client and server together
        # cannot pass 2 / (S + C) requests a second (S, C: CPU us per request, gather row), so the
        # 2-core figure is capped there however well the server scales (3+ cores: the client has its own)
        k = len(cores)
        s_us, c_us = out["random4k_gather:cpu_server_us"], out["random4k_gather:cpu_client_us"]
        out["pinned2_cap_ops"] = 2e6 / (s_us + c_us) if k == 2 else float("inf")
        cap = f" (2 cores shared with the client: at most {out['pinned2_cap_ops']:,.0f}/s)" if k == 2 else ""
        rows.append([f"server pinned to 2 cores vs 1 (gather{f', {clients} clients' if clients > 1 else ''})", f"{out['pinned2:ops']:,.0f}/s vs {out['pinned1:ops']:,.0f}/s = {r:.2f}x{cap}",
                     ">= 1.7x", "met" if r >= 1.7 else "NOT met"])
    else:
        rows.append(["server pinned to 2 cores vs 1", why, ">= 1.7x", "not measured"])
    out["rows"] = rows
    head = ["target (issue 26)", "this run", "wanted", ""]
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(4)]
    print(f"\ntb5:// small-op targets, median of {repeat} (tb5 streams={streams}; server {' '.join(serve_args) or 'defaults'}; "
          f"CPU per op from process_time and /proc, the server's workers included)\n")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--short", action="store_true", help="256 MiB file, 2 s per latency figure, repeat 3")
    ap.add_argument("--repeat", type=int, help="runs per figure (default 5, short 3)")
    ap.add_argument("--seconds", type=float, help="seconds per latency figure (default 5, short 2)")
    ap.add_argument("--size-mib", type=int, help="size of the big file in MiB (default 1024, short 256)")
    ap.add_argument("--streams", type=int, default=4, help="connections the filesystem keeps (default 4)")
    ap.add_argument("--peers", default="sshfs,http", help="comma-separated peers: sshfs, http (default both; '' for none)")
    ap.add_argument("--workdir", default=None, help="where the served data lives (default: a temporary directory)")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--clients", type=int, default=1, help="client processes of the many-clients and pinned rows (default 1)")
    ap.add_argument("--small-only", action="store_true", help="only the small-op targets (no big-file reads, no peers)")
    ap.add_argument("--serve-args", default="", help="more options for the tb5sync serve of the small-op targets (one string, split on spaces)")
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
    serve_args = tuple(args.serve_args.split())
    if args.small_only:
        try:
            small_res = small_op_targets(root, size, repeat, seconds, args.streams, serve_args, args.clients)
        finally:
            if args.workdir is None:
                shutil.rmtree(work, ignore_errors=True)
        out = args.json_out or os.path.join(HERE, "results", f"fs-small-{time.strftime('%Y%m%d-%H%M%S')}.json")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump({"repeat": repeat, "seconds": seconds, "streams": args.streams, "small_targets": small_res}, f, indent=1)
        print(f"\nJSON: {out}")
        return 0
    procs: list[subprocess.Popen[Any]] = []
    server, port = start_server(root)
    procs.append(server)
    fs = TB5FileSystem(host=LOOPBACK, port=port, streams=args.streams, skip_instance_cache=True)
    # contenders: name -> (filesystem, path of a name under root)
    peers: dict[str, tuple[Any, Callable[[str], str]]] = {"tb5": (fs, lambda n: n)}
    put_kwargs: dict[str, dict[str, Any]] = {"http": {"method": "put"}}  # HTTPFileSystem POSTs by default
    notes: list[str] = []
    for peer in [p for p in args.peers.split(",") if p]:
        try:
            if peer == "sshfs":
                from sshfs import SSHFileSystem

                sp, sport, key = start_sshd(work)
                procs.append(sp)
                sfs = SSHFileSystem(LOOPBACK, port=sport, username=getpass.getuser(), client_keys=[key], known_hosts=None,
                                    skip_instance_cache=True)
                peers["sshfs"] = (sfs, lambda n: os.path.join(root, n))
            elif peer == "http":
                hp, hport = start_nginx(work, root)
                procs.append(hp)
                hfs = fsspec.filesystem("http", skip_instance_cache=True)
                peers["http"] = (hfs, lambda n, hport=hport: f"http://{LOOPBACK}:{hport}/{n}")
            else:
                raise RuntimeError(f"unknown peer {peer!r}")
        except Exception as exc:  # a missing server or package: that column is skipped
            notes.append(f"peer {peer} skipped: {exc}")
            print(notes[-1], file=sys.stderr)
    smalls = [f"small/f{i:05d}" for i in range(small)]
    keys = ["info", "cat4k", "open_read_all", "open_read", "cat_file", "get_file", "put_file"]
    res: dict[str, list[float]] = {k: [] for k in ("raw_pp64", "raw_pp4k", "info_gather", "cat_many", "raw_stream", "raw_fresh")}
    for name in peers:
        for k in keys:
            res[f"{name}:{k}"] = []
    local = os.path.join(work, "got.bin")
    cpu_info: list[tuple[float, float]] = []  # (client, server) CPU us per tb5 info
    cpu_cat: list[tuple[float, float]] = []
    cpu_put: list[tuple[float, float]] = []  # (client, server) CPU seconds per tb5 put_file of the big file

    async def gather_info() -> None:
        await asyncio.gather(*[fs._info(p) for p in smalls])

    def read_all(f: Any, path: str) -> int:
        with f.open(path, "rb") as fh:
            return len(fh.read())

    def read_blocks(f: Any, path: str) -> int:
        total = 0
        with f.open(path, "rb") as fh:
            while block := fh.read(8 * MiB):
                total += len(block)
        return total

    def gbps(op: Callable[[], int]) -> float:
        t = time.perf_counter()
        got = op()
        dt = time.perf_counter() - t
        if got != size:
            raise RuntimeError(f"read {got} of {size} bytes")
        return size / dt / GB

    def get_file(f: Any, path: str) -> int:
        f.get_file(path, local)
        n = os.path.getsize(local)
        os.unlink(local)
        return n

    def put_file(name: str, f: Any, at: Callable[[str], str]) -> int:
        """``put_file`` of the local copy of the big file as a new remote file (removed after)."""
        f.put_file(local, at("up/put.bin"), **put_kwargs.get(name, {}))
        n = os.path.getsize(os.path.join(root, "up", "put.bin"))
        os.unlink(os.path.join(root, "up", "put.bin"))
        return n

    try:
        for n in range(repeat):
            # each figure: the raw peer, then every contender in turn (alternating, so drift hits all)
            res["raw_pp64"].append(raw_pingpong(seconds, 64, 64))
            for name, (f, at) in peers.items():
                res[f"{name}:info"].append(rate(seconds, lambda f=f, at=at: f.info(at("small/f00001")),
                                                cpu_info if name == "tb5" else None, server.pid))
            res["raw_pp4k"].append(raw_pingpong(seconds, 64, 4096))
            for name, (f, at) in peers.items():
                res[f"{name}:cat4k"].append(rate(seconds, lambda f=f, at=at: f.cat_file(at("small/f00002")),
                                                 cpu_cat if name == "tb5" else None, server.pid))
            t = time.perf_counter()
            fsspec.asyn.sync(fs.loop, gather_info)
            res["info_gather"].append(small / (time.perf_counter() - t))
            t = time.perf_counter()
            got = fs.cat(smalls)
            res["cat_many"].append(small / (time.perf_counter() - t))
            assert len(got) == small and all(len(v) == 4096 for v in got.values())
            del got
            res["raw_stream"].append(raw_stream(size))
            res["raw_fresh"].append(raw_stream(size, fresh=True))
            for name, (f, at) in peers.items():
                big = at("big.bin")
                res[f"{name}:open_read_all"].append(gbps(lambda f=f, big=big: read_all(f, big)))
                res[f"{name}:open_read"].append(gbps(lambda f=f, big=big: read_blocks(f, big)))
                res[f"{name}:cat_file"].append(gbps(lambda f=f, big=big: len(f.cat_file(big))))
                res[f"{name}:get_file"].append(gbps(lambda f=f, big=big: get_file(f, big)))
            shutil.copyfile(os.path.join(root, "big.bin"), local)
            # written back before the puts: otherwise the first contender after the copy pays for
            # the copy's writeback (measured: 0.3-0.8 GB/s for that put against 1.3 for the next ones)
            with open(local, "rb+") as fl:
                os.fsync(fl.fileno())
            os.makedirs(os.path.join(root, "up"), exist_ok=True)
            # every other repeat in the reverse order, so that the drift of writing back the previous
            # contender's file hits each contender alike
            for name, (f, at) in (peers.items() if n % 2 == 0 else reversed(peers.items())):
                c0, s0 = time.process_time(), proc_cpu(server.pid)
                res[f"{name}:put_file"].append(gbps(lambda name=name, f=f, at=at: put_file(name, f, at)))
                if name == "tb5":
                    cpu_put.append((time.process_time() - c0, proc_cpu(server.pid) - s0))
            os.unlink(local)
            print(f"[{n + 1}/{repeat}] " + "; ".join(f"{name}: info {res[name + ':info'][-1]:.0f}/s, read() {res[name + ':open_read_all'][-1]:.2f} GB/s"
                                                      for name in peers) + f"; raw ping-pong {res['raw_pp64'][-1]:.0f}/s, stream {res['raw_stream'][-1]:.2f} GB/s",
                  file=sys.stderr)
        fs._holder.close()
        for p in procs:
            p.terminate()
            p.wait()
        procs = []
        small_res = small_op_targets(root, size, repeat, seconds, args.streams, serve_args, args.clients)
    finally:
        fs._holder.close()
        for p in procs:
            p.terminate()
            p.wait()
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)

    m = {k: median(v) for k, v in res.items()}
    figures = [
        ("info, one at a time", "info", "ops/s", "raw_pp64", "ping-pong 64 B"),
        ("cat_file 4 KiB, one at a time", "cat4k", "ops/s", "raw_pp4k", "ping-pong 4 KiB"),
        (f"open().read() {size // MiB} MiB", "open_read_all", "GB/s", "raw_stream", "raw TCP stream"),
        (f"open().read(8 MiB) loop", "open_read", "GB/s", "raw_stream", "raw TCP stream"),
        (f"cat_file {size // MiB} MiB", "cat_file", "GB/s", "raw_stream", "raw TCP stream"),
        (f"get_file {size // MiB} MiB", "get_file", "GB/s", "raw_stream", "raw TCP stream"),
        (f"put_file {size // MiB} MiB (new file)", "put_file", "GB/s", "raw_stream", "raw TCP stream"),
    ]
    names = list(peers)
    others = [p for p in names if p != "tb5"]
    fmt = lambda v, unit: f"{v:,.0f}/s" if unit == "ops/s" else f"{v:.2f} GB/s"  # noqa: E731
    head = ["figure", "raw TCP", *names, "tb5/raw", *[f"tb5/{o}" for o in others]]
    rows = []
    ratios: dict[str, float] = {}
    for label, key, unit, raw_key, _raw_name in figures:
        tb5 = m[f"tb5:{key}"]
        row = [label, fmt(m[raw_key], unit), *[fmt(m[f"{p}:{key}"], unit) for p in names], f"{tb5 / m[raw_key]:.2f}"]
        ratios[f"{label}: tb5/raw"] = tb5 / m[raw_key]
        for o in others:
            row.append(f"{tb5 / m[f'{o}:{key}']:.2f}")
            ratios[f"{label}: tb5/{o}"] = tb5 / m[f"{o}:{key}"]
        rows.append(row)
    for label, key in [(f"open().read() {size // MiB} MiB", "open_read_all"), (f"cat_file {size // MiB} MiB", "cat_file")]:
        tb5 = m[f"tb5:{key}"]
        rows.append([f"{label} vs raw into new memory", fmt(m["raw_fresh"], "GB/s"), fmt(tb5, "GB/s"), *[""] * (len(names) - 1),
                     f"{tb5 / m['raw_fresh']:.2f}", *[""] * len(others)])
        ratios[f"{label}: tb5/raw into new memory"] = tb5 / m["raw_fresh"]
    rows.append(["info x2000, gathered (tb5 only)", fmt(m["raw_pp64"], "ops/s"), fmt(m["info_gather"], "ops/s"), *[""] * (len(names) - 1),
                 f"{m['info_gather'] / m['raw_pp64']:.2f}", *[""] * len(others)])
    rows.append(["cat of 2000 x 4 KiB (tb5 only)", fmt(m["raw_pp4k"], "ops/s"), fmt(m["cat_many"], "ops/s"), *[""] * (len(names) - 1),
                 f"{m['cat_many'] / m['raw_pp4k']:.2f}", *[""] * len(others)])
    print(f"\nfsspec filesystems on loopback, median of {repeat} (tb5 streams={args.streams}); raw TCP: ping-pong for the small ops "
          f"(64 B / 4 KiB replies), one stream into a reused 4 MiB buffer for the reads (and, last rows, into new memory of "
          f"the file's size); a ratio > 1 = tb5:// faster\n")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |")
    for label, cpu in (("info", cpu_info), ("cat_file 4 KiB", cpu_cat)):
        client_us, server_us = median([c for c, _ in cpu]), median([v for _, v in cpu])
        m[f"tb5:{label}:cpu_client_us"], m[f"tb5:{label}:cpu_server_us"] = client_us, server_us
        print(f"tb5 {label}, one at a time: CPU per call {client_us:.1f} us client (all threads), {server_us:.1f} us server (median of {len(cpu)})")
    if cpu_put:
        client_s, server_s = median([c for c, _ in cpu_put]), median([v for _, v in cpu_put])
        m["tb5:put_file:cpu_client_s"], m["tb5:put_file:cpu_server_s"] = client_s, server_s
        print(f"tb5 put_file {size // MiB} MiB: CPU {client_s:.3f} s client (all threads), {server_s:.3f} s server (median of {len(cpu_put)})")
    for note in notes:
        print(note)
    out = args.json_out or os.path.join(HERE, "results", f"fs-{time.strftime('%Y%m%d-%H%M%S')}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"repeat": repeat, "seconds": seconds, "size": size, "streams": args.streams, "peers": names, "runs": res,
                   "median": m, "ratios": ratios, "notes": notes,
                   "small_targets": small_res}, f, indent=1)
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
