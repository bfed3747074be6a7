#!/usr/bin/env python3
"""Benchmark the HTTP build cache (``tb5sync http-cache``) against nginx serving files with WebDAV PUT, in one run.

What it measures (both servers on 127.0.0.1, each a single process: ``tb5sync http-cache`` and
nginx with ``worker_processes 1``, ``dav_methods PUT DELETE``, ``create_full_put_path on``):

1. **GET/PUT latency and throughput** for 4 KiB, 256 KiB and 16 MiB entries: one keep-alive
   ``http.client`` connection, distinct random entries under ``/cas/<sha256>`` (so tb5sync also
   checks each body's digest, as for Bazel), PUT all, then GET all. p50 and p99 of the per-request
   wall time (ms) and throughput (MiB/s over the sequence).
2. **concurrent small PUTs**: 4 KiB entries from 8 keep-alive connections at once (requests/s;
   tb5sync writes PUTs that arrive together as one pack).
3. **ccache rebuild with an empty local cache**: real C sources (the Cython-generated
   ``ext/_cdc.c`` and ``ext/_scan.c`` of this project, plus generated units) compiled with
   ``ccache gcc -O2 -c`` one after the other: with no remote (every compile runs), with the
   tb5sync remote and with the nginx remote (each populated by one build, then ``ccache -C``
   wipes the local cache and the rebuild is timed). Remote hits are read from ``ccache --print-stats``.
4. **Bazel rebuild from cache, HTTP vs gRPC** (when ``bazel`` is installed): one workspace of
   genrules (gcc compiles and several-MB outputs), built once against tb5sync's HTTP cache and once
   against its gRPC face (``--grpc``, the same server process; the two workspaces differ by a salt
   so each uploads its own entries), then ``bazel clean`` + rebuild, alternating HTTP and gRPC
   ``--rounds`` times: median wall (s) and the server's CPU seconds (``/proc/PID/stat``) per rebuild,
   and Bazel's "N remote cache hit" count. With BuildGrid installed (``--buildgrid BGD``, PyPI
   ``buildgrid`` in a venv of its own), the same workspace also against ``bgd server start`` (a
   generated cache-only config) as the gRPC peer; without it, its row says why. Then each
   target of issue 26 with its figure, the peer's from the same run, and met / NOT met.

Output: a table on stdout and JSON in ``benches/results/bench-httpcache-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PY = sys.executable

NGINX_CONF = """
worker_processes 1;
daemon off;
{user}
pid {p}/nginx.pid;
error_log {p}/error.log;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_max_body_size 0;
    client_body_temp_path {p}/body;
    proxy_temp_path {p}/proxy;
    fastcgi_temp_path {p}/fcgi;
    uwsgi_temp_path {p}/uwsgi;
    scgi_temp_path {p}/scgi;
    keepalive_requests 100000;
    server {{
        listen 127.0.0.1:{port};
        root {p}/data;
        dav_methods PUT DELETE;
        create_full_put_path on;
        dav_access user:rw group:r all:r;
    }}
}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 20.0) -> None:
    end = time.time() + timeout
    while time.time() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port}")


class Tb5Server:
    def __init__(self, work: str) -> None:
        self.port = free_port()
        self.grpc_port = free_port()
        self.proc = subprocess.Popen([PY, "-m", "tb5sync.cli", "http-cache", os.path.join(work, "store"),
                                      "--bind", f"127.0.0.1:{self.port}", *self.grpc_args()],
                                     stderr=subprocess.DEVNULL, text=True)
        wait_port(self.port)
        if self.grpc_port:
            wait_port(self.grpc_port)

    def grpc_args(self) -> list[str]:
        try:
            import grpc  # noqa: F401
        except ImportError:  # the grpc extra is not installed: no gRPC row
            self.grpc_port = 0
            return []
        return ["--grpc", f"127.0.0.1:{self.grpc_port}"]

    def cpu(self) -> float:
        """CPU seconds (user + system) the server process has used."""
        return proc_cpu(self.proc.pid)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)


class NginxServer:
    def __init__(self, work: str) -> None:
        p = os.path.join(work, "nginx")
        for d in ("data", "body", "proxy", "fcgi", "uwsgi", "scgi"):
            os.makedirs(os.path.join(p, d), exist_ok=True)
        self.port = free_port()
        conf = os.path.join(p, "nginx.conf")
        with open(conf, "w") as f:
            f.write(NGINX_CONF.format(p=p, port=self.port, user="user root;" if os.geteuid() == 0 else ""))
        self.proc = subprocess.Popen(["nginx", "-p", p, "-c", conf], stderr=subprocess.PIPE, text=True)
        wait_port(self.port)

    def cpu(self) -> float:
        """CPU seconds (user + system) of nginx's master and its worker(s)."""
        return sum(proc_cpu(pid) for pid in [self.proc.pid, *children(self.proc.pid)])

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGQUIT)
        self.proc.wait(30)


BUILDGRID_CONF = """
server:
  - !channel
    address: "127.0.0.1:{port}"
    insecure-mode: true
storages:
  - !disk-storage &main-storage
    path: {p}/cas
caches:
  - !lru-action-cache &main-action
    storage: *main-storage
    max-cached-refs: 1000000
    allow-updates: true
    cache-failed-actions: true
instances:
  - name: ''
    services:
      - !action-cache
        cache: *main-action
      - !cas
        storage: *main-storage
      - !bytestream
        storage: *main-storage
"""


class BuildGridServer:
    """BuildGrid (PyPI ``buildgrid``, a Python REAPI server) as a cache only: ``bgd server start``
    with a generated config (disk CAS, LRU action cache, the ``ActionCache``, ``CAS`` and
    ``ByteStream`` services on instance ``''``, no auth), on 127.0.0.1. ``bgd``: its executable
    (installed in a venv of its own: its pins differ from this project's)."""

    def __init__(self, work: str, bgd: str) -> None:
        p = os.path.join(work, "buildgrid")
        os.makedirs(os.path.join(p, "cas"), exist_ok=True)
        self.port = free_port()
        conf = os.path.join(p, "bgd.yml")
        with open(conf, "w") as f:
            f.write(BUILDGRID_CONF.format(p=p, port=self.port))
        self.proc = subprocess.Popen([bgd, "server", "start", conf], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_port(self.port, timeout=60)
        except RuntimeError:
            self.proc.kill()
            self.proc.wait()
            raise

    def cpu(self) -> float:
        """CPU seconds (user + system) of the bgd process and its children."""
        return sum(proc_cpu(pid) for pid in [self.proc.pid, *children(self.proc.pid)])

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def find_bgd(given: str | None) -> tuple[str | None, str]:
    """BuildGrid's ``bgd``: ``given`` (``--buildgrid``), else ``$TB5_BENCH_BGD``, else on PATH;
    ``(path, "")`` or ``(None, why not)``."""
    for cand in (given, os.environ.get("TB5_BENCH_BGD"), shutil.which("bgd")):
        if cand and os.access(cand, os.X_OK):
            return cand, ""
    return None, ("not installed: no bgd (python -m venv V && V/bin/pip install buildgrid, then --buildgrid V/bin/bgd "
                  "or TB5_BENCH_BGD=V/bin/bgd)")


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []


class Spy:
    """``py-spy record --gil --format raw`` of the tb5sync server during one phase (``--py-spy DIR``)."""

    def __init__(self, out_dir: str | None, pid: int) -> None:
        self.out_dir, self.pid, self.proc = out_dir, pid, None

    def start(self, name: str) -> None:
        if not self.out_dir:
            return
        spy = shutil.which("py-spy", path=os.path.dirname(PY) + os.pathsep + os.environ.get("PATH", ""))
        if spy is None:
            raise RuntimeError("--py-spy needs py-spy (pip install py-spy)")
        os.makedirs(self.out_dir, exist_ok=True)
        self.proc = subprocess.Popen([spy, "record", "--pid", str(self.pid), "--format", "raw", "--gil", "-r", "250",
                                      "-o", os.path.join(self.out_dir, f"{name}.txt")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(60)
            self.proc = None


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def latency(port: int, size: int, count: int) -> dict[str, Any]:
    h = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    blobs = [os.urandom(size) for _ in range(count)]
    keys = [f"/cas/{hashlib.sha256(b).hexdigest()}" for b in blobs]
    out: dict[str, Any] = {}
    for method in ("PUT", "GET"):
        times = []
        t0 = time.perf_counter()
        for k, b in zip(keys, blobs):
            t = time.perf_counter()
            h.request(method, k, body=b if method == "PUT" else None)
            r = h.getresponse()
            body = r.read()
            times.append(time.perf_counter() - t)
            if r.status not in (200, 201, 204) or (method == "GET" and body != b):
                raise RuntimeError(f"{method} {k}: {r.status}")
        total = time.perf_counter() - t0
        out[method] = {"p50_ms": statistics.median(times) * 1e3, "p99_ms": pct(times, 0.99) * 1e3,
                       "mib_s": size * count / total / 2**20, "requests": count}
    h.close()
    return out


def concurrent_puts(port: int, size: int, count: int, clients: int) -> dict[str, Any]:
    """``count`` PUTs of distinct entries from ``clients`` keep-alive connections at once: requests/s and MiB/s."""
    from concurrent.futures import ThreadPoolExecutor

    blobs = [os.urandom(size) for _ in range(count)]

    def run(part: list[bytes]) -> None:
        h = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        for b in part:
            h.request("PUT", f"/cas/{hashlib.sha256(b).hexdigest()}", body=b)
            r = h.getresponse()
            r.read()
            if r.status not in (200, 201, 204):
                raise RuntimeError(f"PUT: {r.status}")
        h.close()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as ex:
        list(ex.map(run, [blobs[k::clients] for k in range(clients)]))
    dt = time.perf_counter() - t0
    return {"requests_s": count / dt, "mib_s": size * count / dt / 2**20, "clients": clients, "requests": count}


C_UNIT = """#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
typedef struct {{ double x, y, z; }} vec{k};
static double dot{k}(const vec{k} *a, const vec{k} *b) {{ return a->x * b->x + a->y * b->y + a->z * b->z; }}
int sort_cmp{k}(const void *a, const void *b) {{ double d = *(const double *)a - *(const double *)b; return (d > 0) - (d < 0); }}
double work{k}(size_t n) {{
    vec{k} *v = malloc(n * sizeof *v);
    double *s = malloc(n * sizeof *s);
    for (size_t i = 0; i < n; i++) {{ v[i].x = sin((double)i * {k}); v[i].y = cos((double)i); v[i].z = (double)i / (n + 1); }}
    for (size_t i = 0; i < n; i++) s[i] = dot{k}(&v[i], &v[(i + 1) % n]);
    qsort(s, n, sizeof *s, sort_cmp{k});
    double r = s[n / 2];
    free(v); free(s);
    return r;
}}
"""


def sources(work: str, units: int) -> list[tuple[str, list[str]]]:
    d = os.path.join(work, "src")
    os.makedirs(d, exist_ok=True)
    out = []
    inc = sysconfig.get_paths()["include"]
    for name in ("_cdc.c", "_scan.c"):
        p = os.path.join(REPO, "ext", name)
        if os.path.exists(p):
            shutil.copy(p, d)
            out.append((os.path.join(d, name), [f"-I{inc}", "-fPIC"]))
    for k in range(units):
        p = os.path.join(d, f"unit{k}.c")
        with open(p, "w") as f:
            f.write(C_UNIT.format(k=k) * 1)
        out.append((p, []))
    return out


def ccache_build(srcs: list[tuple[str, list[str]]], env: dict[str, str], out: str) -> tuple[float, dict[str, int]]:
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    subprocess.run(["ccache", "-z"], env=env, check=True, capture_output=True)
    t0 = time.perf_counter()
    for src, flags in srcs:
        subprocess.run(["ccache", "gcc", "-O2", "-c", *flags, src, "-o", os.path.join(out, os.path.basename(src) + ".o")],
                       env=env, check=True)
    dt = time.perf_counter() - t0
    text = subprocess.run(["ccache", "--print-stats"], env=env, check=True, capture_output=True, text=True).stdout
    stats = {k: int(v) for k, v in (line.split("\t") for line in text.splitlines())}
    return dt, stats


def ccache_rebuilds(work: str, srcs: list[tuple[str, list[str]]], remotes: dict[str, int | None]) -> dict[str, Any]:
    res = {}
    for name, port in remotes.items():
        env = dict(os.environ, CCACHE_DIR=os.path.join(work, f"ccache-{name}"),
                   CCACHE_CONFIGPATH=os.path.join(work, f"ccache-{name}.conf"), CCACHE_BASEDIR=work)
        if port is not None:
            env["CCACHE_REMOTE_STORAGE"] = f"http://127.0.0.1:{port}/cc|layout=subdirs"
            ccache_build(srcs, env, os.path.join(work, f"obj-{name}-1"))  # populates the remote
            subprocess.run(["ccache", "-C"], env=env, check=True, capture_output=True)
        dt, st = ccache_build(srcs, env, os.path.join(work, f"obj-{name}"))
        res[name] = {"seconds": dt, "remote_hits": st.get("remote_storage_hit", 0),
                     "local_hits": st.get("local_storage_hit", 0), "misses": st.get("cache_miss", 0)}
    return res


BAZEL_BUILD = '''
genrule(name = "lib_o", srcs = ["lib.c", "lib.h"], outs = ["lib.o"], cmd = "gcc -O2 -c $(location lib.c) -o $@ # {salt}")
genrule(name = "hello", srcs = ["main.c", "lib.h", ":lib_o"], outs = ["hello.bin"],
        cmd = "gcc -O2 -I$$(dirname $(location lib.h)) $(location main.c) $(location :lib_o) -o $@ # {salt}")
{blobs}
genrule(name = "empty", outs = ["empty.txt"], cmd = "touch $@ # {salt}")
filegroup(name = "all", srcs = [":hello", ":empty"] + [":blob%d" % i for i in range({n})])
'''


def bazel_workspace(work: str, salt: str, blobs: int, small: int = 0) -> str:
    ws = os.path.join(work, f"ws-{salt}")
    os.makedirs(ws)
    rules = "\n".join(f'genrule(name = "blob{i}", outs = ["blob{i}.bin"], cmd = "head -c {(i % 4 + 1) * 1500000} /dev/urandom > $@ # {salt}")'
                      for i in range(blobs))
    # small outputs (1-16 KiB), the bulk of a real build's entries: named blob{blobs + i} so ":all" lists them
    rules += "\n" + "\n".join(f'genrule(name = "blob{blobs + i}", outs = ["small{i}.o"], cmd = "head -c {(i % 16 + 1) * 1024} /dev/urandom > $@ # {salt}")'
                               for i in range(small))
    blobs += small
    for name, text in (("WORKSPACE", ""), ("BUILD", BAZEL_BUILD.format(salt=salt, blobs=rules, n=blobs)),
                       ("lib.h", "int add(int a, int b);\n"), ("lib.c", '#include "lib.h"\nint add(int a, int b) { return a + b; }\n'),
                       ("main.c", '#include <stdio.h>\n#include "lib.h"\nint main(void) { printf("%d\\n", add(2, 3)); return 0; }\n')):
        with open(os.path.join(ws, name), "w") as f:
            f.write(text)
    return ws


def count_packs(work: str) -> int:
    return sum(len(files) for _, _, files in os.walk(os.path.join(work, "store", "packs")))


def bazel_rebuilds(work: str, tb5: Tb5Server, rounds: int, blobs: int, small: int = 0,
                   ngx: NginxServer | None = None, spy_dir: str | None = None,
                   bgd: BuildGridServer | None = None) -> dict[str, Any]:
    """Median rebuild wall and server CPU per remote (tb5sync HTTP, tb5sync gRPC, nginx WebDAV,
    BuildGrid over gRPC), alternating (see the module docstring); the first build's server CPU is
    the upload phase's."""
    remotes: dict[str, tuple[str, Any]] = {"http": (f"http://127.0.0.1:{tb5.port}", tb5)}
    if tb5.grpc_port:
        remotes["grpc"] = (f"grpc://127.0.0.1:{tb5.grpc_port}", tb5)
    if ngx is not None:
        remotes["nginx"] = (f"http://127.0.0.1:{ngx.port}", ngx)
    if bgd is not None:
        remotes["buildgrid"] = (f"grpc://127.0.0.1:{bgd.port}", bgd)
    tb5_names = {n for n, (_, srv) in remotes.items() if srv is tb5}
    spaces = {n: (bazel_workspace(work, n, blobs, small), ["bazel", f"--output_user_root={os.path.join(work, 'bzl-' + n)}"])
              for n in remotes}
    spy = Spy(spy_dir, tb5.proc.pid)

    def build(name: str) -> str:
        ws, bz = spaces[name]
        r = subprocess.run(bz + ["build", f"--remote_cache={remotes[name][0]}", "--noshow_progress", "//:all"],
                           cwd=ws, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"bazel build over {name} failed: {r.stderr[-2000:]}")
        return r.stderr

    res: dict[str, Any] = {n: {"wall": [], "server_cpu": [], "hits": []} for n in remotes}
    try:
        for name in remotes:
            srv = remotes[name][1]
            if name in tb5_names:
                spy.start(f"upload-{name}")
            c0, p0 = srv.cpu(), count_packs(work)
            t0 = time.perf_counter()
            build(name)
            res[name]["first_wall"] = time.perf_counter() - t0
            res[name]["first_server_cpu"] = srv.cpu() - c0
            if name in tb5_names:
                res[name]["packs_made"] = count_packs(work) - p0
            spy.stop()
        for k in range(rounds):
            for name in remotes:
                srv = remotes[name][1]
                ws, bz = spaces[name]
                subprocess.run(bz + ["clean"], cwd=ws, check=True, capture_output=True, timeout=120)
                if k == 0 and name in tb5_names:
                    spy.start(f"rebuild-{name}")
                c0 = srv.cpu()
                t0 = time.perf_counter()
                err = build(name)
                res[name]["wall"].append(time.perf_counter() - t0)
                res[name]["server_cpu"].append(srv.cpu() - c0)
                spy.stop()
                m = re.search(r"INFO: (\d+) process.*?(\d+) remote cache hit", err)
                res[name]["hits"].append(int(m.group(2)) if m else 0)
                res[name]["processes_line"] = (re.search(r"INFO: \d+ process.*", err) or re.search("$", "")).group(0)
    finally:
        spy.stop()
        for ws, bz in spaces.values():
            subprocess.run(bz + ["shutdown"], cwd=ws, capture_output=True, timeout=60)
    for r in res.values():
        r["median_wall"] = statistics.median(r["wall"]) if r["wall"] else None
        r["median_server_cpu"] = statistics.median(r["server_cpu"]) if r["server_cpu"] else None
    return res


def bazel_targets(bz: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """``(target, figure, wanted, "met" / "NOT met" / "not measured")`` of the Bazel rows, each
    against its peer in the same run (nginx for the HTTP cache, the HTTP cache and BuildGrid for gRPC)."""
    out: list[tuple[str, str, str, str]] = []

    def row(what: str, a: float | None, b: float | None, wanted: str, ok: Callable[[float], bool], unit: str = "s") -> None:
        if a is None or b is None or not b:
            out.append((what, "-", wanted, "not measured"))
            return
        r = a / b
        out.append((what, f"{a:.2f} {unit} vs {b:.2f} {unit} = {r:.2f}x", wanted, "met" if ok(r) else "NOT met"))

    http, ngx, grpc, bg = (bz.get(n, {}) for n in ("http", "nginx", "grpc", "buildgrid"))
    row("HTTP rebuild wall vs nginx", http.get("median_wall"), ngx.get("median_wall"), "<= 1.0x", lambda r: r <= 1.0)
    row("HTTP rebuild server CPU vs nginx", http.get("median_server_cpu"), ngx.get("median_server_cpu"), "<= 2x", lambda r: r <= 2.0)
    row("HTTP uploads server CPU vs nginx", http.get("first_server_cpu"), ngx.get("first_server_cpu"), "<= 2x", lambda r: r <= 2.0)
    row("HTTP first build wall vs nginx", http.get("first_wall"), ngx.get("first_wall"), "<= 1.0x", lambda r: r <= 1.0)
    row("gRPC rebuild wall vs HTTP", grpc.get("median_wall"), http.get("median_wall"), "< 1.0x", lambda r: r < 1.0)
    row("gRPC rebuild wall vs BuildGrid", grpc.get("median_wall"), bg.get("median_wall"), "< 1.0x", lambda r: r < 1.0)
    row("gRPC rebuild server CPU vs BuildGrid", grpc.get("median_server_cpu"), bg.get("median_server_cpu"), "< 1.0x", lambda r: r < 1.0)
    row("gRPC uploads server CPU vs BuildGrid", grpc.get("first_server_cpu"), bg.get("first_server_cpu"), "< 1.0x", lambda r: r < 1.0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--short", action="store_true", help="fewer requests and sources")
    ap.add_argument("--units", type=int, default=40, help="generated C units beside ext/*.c (default 40)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating Bazel rebuilds per protocol (default 5)")
    ap.add_argument("--bazel-only", action="store_true", help="only the Bazel rows (tb5sync HTTP, gRPC, nginx)")
    ap.add_argument("--blobs", type=int, default=24, help="Bazel genrules with 1.5-6 MB outputs (default 24)")
    ap.add_argument("--small", type=int, default=160, help="Bazel genrules with 1-16 KiB outputs (default 160)")
    ap.add_argument("--py-spy", metavar="DIR", help="py-spy raw profiles (--gil) of the server per Bazel phase into DIR "
                    "(first rebuild round only; the CPU figures of a profiled run are inflated)")
    ap.add_argument("--buildgrid", metavar="BGD", help="BuildGrid's bgd executable for the Bazel gRPC peer "
                    "(default $TB5_BENCH_BGD, else bgd on PATH; missing: its row says so)")
    a = ap.parse_args()
    for tool in (("bazel", "gcc", "nginx") if a.bazel_only else ("nginx", "ccache", "gcc")):
        if shutil.which(tool) is None:
            print(f"bench_httpcache: needs {tool} (apt-get install nginx-light ccache gcc)", file=sys.stderr)
            return 2
    plan = [(4096, 100 if a.short else 500), (256 * 1024, 40 if a.short else 200), (16 * 2**20, 4 if a.short else 16)]
    work = tempfile.mkdtemp(prefix="bench-httpcache-")
    result: dict[str, Any] = {"when": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpus": os.cpu_count(), "latency": {}}
    tb5 = Tb5Server(work)
    ngx = NginxServer(work)
    bgd: BuildGridServer | None = None
    try:
        if shutil.which("bazel") is not None and shutil.which("gcc") is not None:
            exe, why = find_bgd(a.buildgrid)
            if exe is not None:
                try:
                    bgd = BuildGridServer(work, exe)
                except (OSError, RuntimeError) as exc:
                    why = f"did not start: {exc}"
            result["buildgrid"] = why or "measured"
            result["bazel"] = bazel_rebuilds(work, tb5, 2 if a.short else a.rounds, 8 if a.short else a.blobs,
                                             40 if a.short else a.small, ngx, a.py_spy, bgd)
        if a.bazel_only:
            plan = []
        for size, count in plan:
            for name, srv in (("tb5sync", tb5), ("nginx", ngx)):
                assert srv is not None
                result["latency"].setdefault(str(size), {})[name] = latency(srv.port, size, count)
        for name, srv in (("tb5sync", tb5), ("nginx", ngx)) if not a.bazel_only else ():
            result.setdefault("concurrent_put_4k", {})[name] = concurrent_puts(srv.port, 4096, 200 if a.short else 800, 8)
        if not a.bazel_only:
            srcs = sources(work, 10 if a.short else a.units)
            result["ccache"] = ccache_rebuilds(work, srcs, {"none": None, "tb5sync": tb5.port, "nginx": ngx.port})
            result["ccache_sources"] = len(srcs)
    finally:
        tb5.stop()
        ngx.stop()
        if bgd is not None:
            bgd.stop()
        shutil.rmtree(work, ignore_errors=True)
    if result["latency"]:
        print(f"{'size':>9} {'server':>8} | {'PUT p50':>8} {'p99':>8} {'MiB/s':>8} | {'GET p50':>8} {'p99':>8} {'MiB/s':>8}")
    for size, row in result["latency"].items():
        for name, r in row.items():
            p, g = r["PUT"], r["GET"]
            print(f"{int(size):>9} {name:>8} | {p['p50_ms']:8.2f} {p['p99_ms']:8.2f} {p['mib_s']:8.1f} | "
                  f"{g['p50_ms']:8.2f} {g['p99_ms']:8.2f} {g['mib_s']:8.1f}")
    for name, r in result.get("concurrent_put_4k", {}).items():
        print(f"4 KiB PUTs from {r['clients']} connections at once, {name}: {r['requests_s']:.0f} requests/s")
    if "ccache" in result:
        print(f"ccache rebuild, empty local cache, {result['ccache_sources']} sources:")
        for name, r in result["ccache"].items():
            print(f"  {name:>8}: {r['seconds']:.2f} s (remote hits {r['remote_hits']}, misses {r['misses']})")
    if "bazel" in result:
        print("Bazel rebuild from cache after bazel clean (median of alternating rounds; server CPU: the cache's process):")
        for name, r in result["bazel"].items():
            print(f"  {name:>5}: wall {r['median_wall']:.2f} s, server CPU {r['median_server_cpu']:.2f} s "
                  f"(first build {r['first_wall']:.2f} s, server CPU {r['first_server_cpu']:.2f} s"
                  f"{', packs ' + str(r['packs_made']) if 'packs_made' in r else ''}); {r['processes_line']}")
        if result.get("buildgrid") != "measured":
            print(f"  buildgrid: {result.get('buildgrid')}")
        result["bazel_targets"] = bazel_targets(result["bazel"])
        print("Targets (issue 26), this run:")
        for what, figure, wanted, met in result["bazel_targets"]:
            print(f"  {what}: {figure} (wanted {wanted}): {met}")
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    path = os.path.join(HERE, "results", f"bench-httpcache-{re.sub(r'[^0-9T]', '', result['when'])}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
