#!/usr/bin/env python3
"""Benchmark tb5sync against rsync and raw TCP, on loopback, in one run.

What it measures
----------------
The same workloads go through three movers on 127.0.0.1 (never any other address):

* **tb5sync**: ``tb5sync serve ROOT --bind 127.0.0.1:PORT`` in a subprocess, driven by
  ``tb5sync sync SRC DST --json`` (push to the daemon; the big file is also pulled from it).
* **rsync**: ``rsync --daemon --no-detach`` with a generated rsyncd.conf, driven by
  ``rsync -a --stats SRC rsync://127.0.0.1:PORT/root/...``. Over a daemon, rsync uses its delta
  algorithm (no ``--whole-file``), so a basis at the destination is used.
* **raw TCP limits**: ``iperf3`` (1 stream and N streams), and a plain-Python socket
  ``sendall``/``recv_into`` of 4 MiB buffers between two processes.

Workloads (``--short`` shrinks the sizes so the whole run takes ~3 minutes):

1. ``big_push`` / ``big_pull``: one file of random (incompressible) bytes, 2 GiB (256 MiB short),
   destination empty.
2. ``tree_cold``: 20,000 files of 1-64 KiB (2,000 short) in ~200 directories, part random, part
   text-like (compressible), destination empty.
3. ``tree_nochange``: the same tree synced again right after, nothing changed.
4. ``tree_pull``: the same tree pulled from the server into an empty destination (the mirror of
   ``tree_cold``: a push should be no slower than this).
5. ``big_delta``: the big file after 64 scattered overwrites totalling 1% of it plus one 4 KiB
   insertion in the middle; the previous version is at the destination (a plain copy with its
   mtime, so neither tool has state about it).

How
---
Data is generated once into ``WORKDIR/data-<profile>`` and reused by later runs. The page cache is
not dropped (that needs root and makes every run slow); instead each workload runs the tools
alternately (tb5sync, rsync, tb5sync, rsync, ... ``--repeat`` times) and the median is reported.
Every cold run gets a fresh destination and a fresh server process; ``.tb5sync`` state in the
source is removed before cold runs so that they really are first syncs.

Wall time is the whole client command as a user sees it (process start included). CPU time is
user+sys of the client (``os.wait4`` on it) plus the server process (its ``/proc`` counters when
the client starts, its ``os.wait4`` rusage after SIGTERM, which includes reaped children such as
rsync's per-connection forks). Wire bytes: tb5sync's own ``wire_bytes``; for rsync the sum of
"Total bytes sent" and "Total bytes received" from ``--stats``. Peak RSS per side: ``ru_maxrss`` of
the client's ``wait4`` and of the server's when it is stopped (the largest of the process and the
children it reaped: rsync's per-connection forks), reported as the largest over the runs.

After each run the destination is checked (file set, sizes, mtimes, BLAKE3 of a sample of files,
the whole big file); a failure is printed loudly, marked ``!`` in the table, and makes the exit
status 1. If tb5sync cannot run at all, its cells say FAILED with the one-line reason and the
rsync and raw rows are still produced.

Output: one table on stdout, and the same as JSON in ``benches/results/bench-<timestamp>.json``
(or ``--json-out``). Progress goes to stderr.

Usage::

    python benches/bench_sync.py --short
    python benches/bench_sync.py [--short] [--workdir DIR] [--repeat N] [--json-out PATH]
"""
from __future__ import annotations

import argparse
import grp
import hashlib
import json
import os
import platform
import pwd
import random
import re
import shlex
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

try:  # BLAKE3 when available (fast, multi-threaded); the harness works without it
    import blake3
except ImportError:  # pragma: no cover - depends on the venv
    blake3 = None

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
LOOPBACK = "127.0.0.1"
STATE_DIR = ".tb5sync"  # tb5sync's per-root state; never compared, never sent by rsync here
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
GB = 1e9  # rates and sizes in the report are decimal (GB/s, MB)
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- profiles


@dataclass(frozen=True)
class Profile:
    name: str
    big_bytes: int
    n_files: int
    n_dirs: int
    min_file: int = 1 * KiB
    max_file: int = 64 * KiB
    edits: int = 64
    edit_fraction: float = 0.01
    insert_bytes: int = 4 * KiB
    seed: int = 5


FULL = Profile("full", big_bytes=2 * GiB, n_files=20_000, n_dirs=200)
SHORT = Profile("short", big_bytes=256 * MiB, n_files=2_000, n_dirs=20)

# workload key -> (description, how the headline figure is expressed)
WORKLOADS = {
    "big_push": ("big file, cold push", "GB/s"),
    "big_pull": ("big file, cold pull", "GB/s"),
    "tree_cold": ("small-file tree, cold push", "files/s"),
    "tree_nochange": ("small-file tree, no-change re-run", "s"),
    "tree_pull": ("small-file tree, cold pull", "files/s"),
    "big_delta": ("big file, 1% edits + 4 KiB insert, delta push", "s"),
}


# --------------------------------------------------------------------------- small helpers


class ToolError(Exception):
    """A tool failed; the message is the one-line reason shown in the report."""


def one_line(text: str, limit: int = 240) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    line = lines[-1] if lines else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3g} {unit}" if n / div < 100 else f"{n / div:.0f} {unit}"
    return f"{int(n)} B"


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def port_listening(port: int) -> bool:
    """True when something LISTENs on the port (read from /proc, so no probe connection)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                        return True
        except OSError:
            continue
    return False


def _proc_stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    return s[s.rindex(")") + 2 :].split()  # fields from "state" (field 3) on


def _all_stats() -> dict[int, list[str]]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _proc_stat(int(name))
            if st is not None:
                out[int(name)] = st
    return out


def _cpu_of(st: list[str]) -> float:
    return sum(int(x) for x in st[11:15]) / CLK_TCK  # utime, stime, cutime, cstime


def proc_tree_cpu(pid: int) -> float:
    """user+sys of a live process, its reaped children and its live descendants (from /proc,
    clock-tick resolution), so that worker processes a server keeps are counted too."""
    stats = _all_stats()
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        if p in stats:
            total += _cpu_of(stats[p])
            todo.extend(c for c, st in stats.items() if st[1] == str(p))
    return total


def children_of(pid: int) -> list[int]:
    return [c for c, st in _all_stats().items() if st[1] == str(pid)]


def group_members(pgid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _proc_stat(int(name))
            if st is not None and st[2] == str(pgid):
                out.append(int(name))
    return out


def file_digest(path: str) -> str:
    h = blake3.blake3(max_threads=blake3.blake3.AUTO) if blake3 else hashlib.blake2b()
    buf = bytearray(8 * MiB)
    mv = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(mv[:n])
    return h.hexdigest()


class RandomStream:
    """Incompressible, non-repeating bytes: the BLAKE3 XOF (fast) or os.urandom."""

    def __init__(self, seed: bytes):
        self._h = blake3.blake3(seed) if blake3 else None
        self._pos = 0

    def read(self, n: int) -> bytes:
        if self._h is None:
            return os.urandom(n)
        out = self._h.digest(length=n, seek=self._pos)
        self._pos += n
        return out


# --------------------------------------------------------------------------- processes

LIVE: set["Proc"] = set()  # servers to stop in `finally`, whatever happens


def maxrss_bytes(ru) -> int | None:
    """``ru_maxrss`` of a ``resource.struct_rusage`` in bytes, on macOS only (there it is bytes and
    the best there is). On Linux a child forked from this harness carries the harness's own
    high-water mark across ``exec`` into ``ru_maxrss``, so :class:`RssWatch` reads ``VmHWM``
    instead and this returns None."""
    return ru.ru_maxrss if sys.platform == "darwin" else None


def _vm_hwm(pid: int) -> int | None:
    """``VmHWM`` (peak resident set) of a live process in bytes, from ``/proc/PID/status``."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


class RssWatch:
    """Peak RSS of process groups while a client runs (Linux: ``VmHWM`` from ``/proc``).

    ``watch(pgid)`` adds a group (each client and server here leads its own session); a thread
    reads the leaders' ``VmHWM`` every 20 ms and every member's (rsync's per-connection forks)
    every 100 ms. ``peak(pgid)`` is the largest single process seen, in bytes, or None where
    there is no ``/proc``. The high-water mark is kept by the kernel, so a reading late in a
    process's life still sees its earlier peak; only a child that lives < 100 ms can be missed.
    """

    def __init__(self) -> None:
        self._peaks: dict[int, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, pgid: int) -> None:
        with self._lock:
            self._peaks.setdefault(pgid, 0)
        if self._thread is None and os.path.isdir("/proc/self"):
            self._thread = threading.Thread(target=self._run, name="rss-watch", daemon=True)
            self._thread.start()

    def sample(self, members: bool = True) -> None:
        with self._lock:
            groups = list(self._peaks)
        for g in groups:
            pids = group_members(g) if members else [g]
            for pid in pids:
                v = _vm_hwm(pid)
                if v:
                    with self._lock:
                        if g in self._peaks and v > self._peaks[g]:
                            self._peaks[g] = v

    def peak(self, pgid: int, forget: bool = True) -> int | None:
        self.sample()
        with self._lock:
            v = self._peaks.pop(pgid, None) if forget else self._peaks.get(pgid)
        return v or None

    def _run(self) -> None:
        n = 0
        while not self._stop.wait(0.02):
            n += 1
            self.sample(members=n % 5 == 0)


RSS = RssWatch()


class Proc:
    """A background process (a server) whose CPU time we can account for exactly."""

    def __init__(self, name: str, cmd: list[str], log_dir: str, env=None):
        self.name = name
        self.cmd = cmd
        self.err_path = os.path.join(log_dir, f"{name}.err")
        self._out = open(os.path.join(log_dir, f"{name}.out"), "wb")
        self._err = open(self.err_path, "wb")
        self.status: int | None = None
        self.maxrss: int | None = None
        self.cpu_total = 0.0
        self.cpu_base = 0.0
        self.p = subprocess.Popen(cmd, stdout=self._out, stderr=self._err,
                                  stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        RSS.watch(self.p.pid)
        LIVE.add(self)

    def _reap(self, flags: int) -> bool:
        if self.status is not None:
            return True
        try:
            pid, status, ru = os.wait4(self.p.pid, flags)
        except ChildProcessError:
            self.status = -1
            return True
        if pid == 0:
            return False
        self.status = status
        self.p.returncode = os.waitstatus_to_exitcode(status)
        self.cpu_total = ru.ru_utime + ru.ru_stime
        self.maxrss = self.maxrss or RSS.peak(self.p.pid) or maxrss_bytes(ru)
        return True

    def running(self) -> bool:
        return not self._reap(os.WNOHANG)

    def last_error(self) -> str:
        try:
            with open(self.err_path, errors="replace") as f:
                return one_line(f.read())
        except OSError:
            return ""

    def wait_listening(self, port: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if not self.running():
                raise ToolError(f"{self.name} exited ({self.p.returncode}) before listening: "
                                f"{self.last_error() or 'no message'}")
            if port_listening(port):
                return
            if time.monotonic() > deadline:
                raise ToolError(f"{self.name} not listening on {LOOPBACK}:{port} after {timeout:.0f} s")
            time.sleep(0.01)

    def mark(self) -> None:
        """Start the CPU account here (excludes interpreter start-up and imports)."""
        self.cpu_base = proc_tree_cpu(self.p.pid)

    def settle(self, timeout: float = 1.0) -> None:
        """Give per-connection children (rsync's forks) a moment to exit and be reaped."""
        deadline = time.monotonic() + timeout
        while children_of(self.p.pid) and time.monotonic() < deadline:
            time.sleep(0.005)

    def cpu_now(self) -> float:
        """CPU seconds used since mark() by the process tree (live process only)."""
        self.settle()
        return max(0.0, proc_tree_cpu(self.p.pid) - self.cpu_base)

    def stop(self, timeout: float = 10.0) -> float:
        """SIGTERM, reap, and return the CPU seconds used since mark()."""
        if self.running():
            used = self.cpu_now()
            self.maxrss = RSS.peak(self.p.pid)
            try:
                os.kill(self.p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + timeout
            while not self._reap(os.WNOHANG):
                if time.monotonic() > deadline:
                    self.kill()
                    self._reap(0)
                    break
                time.sleep(0.01)
        else:  # it exited by itself (iperf3 -s -1): its rusage from wait4 is exact
            used = max(0.0, self.cpu_total - self.cpu_base)
        # anything left in the server's own process group (it was started in a new session)
        for pid in group_members(self.p.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        LIVE.discard(self)
        self._out.close()
        self._err.close()
        return used

    def kill(self) -> None:
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@dataclass
class CmdResult:
    rc: int
    wall: float
    cpu: float
    out: str
    err: str
    timed_out: bool = False
    maxrss: int | None = None  # bytes


def run_measured(cmd: list[str], timeout: float, env=None) -> CmdResult:
    """Run a client command; wall time from spawn to exit, CPU = its rusage (incl. children)."""
    with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe:
        fired = threading.Event()

        def on_timeout():
            fired.set()
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL, env=env,
                             start_new_session=True)
        RSS.watch(p.pid)
        timer = threading.Timer(timeout, on_timeout)
        timer.start()
        try:
            _, status, ru = os.wait4(p.pid, 0)
        except BaseException:
            on_timeout()
            os.wait4(p.pid, 0)
            raise
        finally:
            timer.cancel()
        wall = time.perf_counter() - t0
        p.returncode = rc = os.waitstatus_to_exitcode(status)
        fo.seek(0)
        fe.seek(0)
        return CmdResult(rc, wall, ru.ru_utime + ru.ru_stime,
                         fo.read().decode(errors="replace"), fe.read().decode(errors="replace"),
                         fired.is_set(), RSS.peak(p.pid) or maxrss_bytes(ru))


def check(res: CmdResult, what: str, timeout: float) -> None:
    if res.timed_out:
        raise ToolError(f"{what} timed out after {timeout:.0f} s")
    if res.rc != 0:
        raise ToolError(f"{what} exit {res.rc}: {one_line(res.err) or one_line(res.out) or 'no message'}")


# --------------------------------------------------------------------------- test data


def _text_corpus(rng: random.Random, size: int) -> bytes:
    letters = "etaoinshrdlucmfwypvbgkqjxz_"
    vocab = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 10))) for _ in range(400)]
    vocab += ["def", "return", "int", "static", "const", "#include", "{", "}", "(", ")", "=", ";"]
    parts, n = [], 0
    while n < size:
        line = " ".join(rng.choice(vocab) for _ in range(rng.randint(3, 12))) + "\n"
        parts.append(line)
        n += len(line)
    return "".join(parts).encode()[:size]


def make_big(path: str, size: int, rs: RandomStream) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 16 * MiB)
            f.write(rs.read(n))
            left -= n


def make_edited(src: str, dst: str, prof: Profile, rng: random.Random, rs: RandomStream) -> dict:
    """dst = src with `edits` evenly spread random overwrites (edit_fraction of the file in all)
    and one insertion of insert_bytes in the middle (everything after it shifts)."""
    size = os.path.getsize(src)
    seg = size // prof.edits
    elen = max(1, int(size * prof.edit_fraction) // prof.edits)
    edits = [(i * seg + rng.randrange(max(1, seg - elen)), rs.read(elen)) for i in range(prof.edits)]
    ins_at = size // 2 + 1237  # deliberately not block-aligned
    ins = rs.read(prof.insert_bytes)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        pos = 0
        while chunk := fi.read(16 * MiB):
            buf = bytearray(chunk)
            end = pos + len(buf)
            for off, data in edits:
                s, e = max(off, pos), min(off + len(data), end)
                if s < e:
                    buf[s - pos : e - pos] = data[s - off : e - off]
            if pos <= ins_at < end:
                fo.write(buf[: ins_at - pos])
                fo.write(ins)
                fo.write(buf[ins_at - pos :])
            else:
                fo.write(buf)
            pos = end
    return {"edits": prof.edits, "edit_bytes_each": elen, "edited_bytes": elen * prof.edits,
            "insert_at": ins_at, "insert_bytes": prof.insert_bytes}


def make_tree(root: str, prof: Profile, rng: random.Random, rs: RandomStream) -> dict:
    """n_files files of min..max bytes in n_dirs leaf directories (10 per parent):
    ~1/3 random bytes, ~1/3 text-like, ~1/3 half text + half random."""
    corpus = _text_corpus(rng, 2 * MiB)
    dirs = [os.path.join(root, f"d{i // 10:03d}", f"s{i % 10}") for i in range(prof.n_dirs)]
    for d in dirs:
        os.makedirs(d, exist_ok=True)
    exts = ("o", "txt", "bin", "json", "h")
    total = 0
    for i in range(prof.n_files):
        size = rng.randint(prof.min_file, prof.max_file)
        kind = rng.random()
        if kind < 0.35:
            data = rs.read(size)
        else:
            n_text = size if kind < 0.7 else size // 2
            off = rng.randrange(len(corpus) - n_text)
            data = corpus[off : off + n_text] + rs.read(size - n_text)
        with open(os.path.join(rng.choice(dirs), f"f{i:05d}.{rng.choice(exts)}"), "wb") as f:
            f.write(data)
        total += size
    return {"files": prof.n_files, "dirs": prof.n_dirs, "bytes": total}


def ensure_data(workdir: str, prof: Profile) -> dict:
    """Generate the data set once per profile; reuse it when its parameters match."""
    data = os.path.join(workdir, f"data-{prof.name}")
    meta_path = os.path.join(workdir, f"data-{prof.name}.json")
    want = {"format": 1, "profile": asdict(prof)}
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        if meta.get("params") == want and all(
            os.path.exists(os.path.join(data, p)) for p in ("big/big.bin", "big_v2/big.bin", "tree")
        ):
            return meta
    except (OSError, ValueError):
        pass
    shutil.rmtree(data, ignore_errors=True)
    need = 2.2 * prof.big_bytes + prof.n_files * prof.max_file
    if shutil.disk_usage(workdir).free < need + 4 * prof.big_bytes:
        print(f"warning: {workdir} may be short of space for the data and destinations", file=sys.stderr)
    print(f"generating data in {data} ...", file=sys.stderr)
    t0 = time.perf_counter()
    rng = random.Random(prof.seed)
    rs = RandomStream(b"tb5sync-bench/%d" % prof.seed)
    make_big(os.path.join(data, "big", "big.bin"), prof.big_bytes, rs)
    edit = make_edited(os.path.join(data, "big", "big.bin"), os.path.join(data, "big_v2", "big.bin"),
                       prof, rng, rs)
    tree = make_tree(os.path.join(data, "tree"), prof, rng, rs)
    meta = {"params": want, "edit": edit, "tree": tree}
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=1)
    print(f"  done in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return meta


def clear_state(path: str) -> None:
    shutil.rmtree(os.path.join(path, STATE_DIR), ignore_errors=True)


# --------------------------------------------------------------------------- verification


def scan(root: str) -> dict[str, os.stat_result]:
    out, stack = {}, [""]
    while stack:
        rel = stack.pop()
        with os.scandir(os.path.join(root, rel)) as it:
            for e in it:
                if e.name == STATE_DIR:
                    continue
                r = os.path.join(rel, e.name)
                if e.is_dir(follow_symlinks=False):
                    stack.append(r)
                else:
                    out[r] = e.stat(follow_symlinks=False)
    return out


class Verifier:
    def __init__(self, sample: int):
        self.sample = sample
        self._src_digests: dict[tuple, str] = {}

    def _src_digest(self, path: str, st: os.stat_result) -> str:
        key = (path, st.st_size, st.st_mtime_ns, st.st_ino)
        if key not in self._src_digests:
            self._src_digests[key] = file_digest(path)
        return self._src_digests[key]

    def verify(self, src: str, dst: str, label: str) -> str | None:
        """None if dst mirrors src (set, sizes, mtimes, sampled/whole contents), else why not."""
        a, b = scan(src), scan(dst)
        missing, extra = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
        if missing:
            return f"{len(missing)} of {len(a)} files missing at destination, e.g. {missing[0]}"
        if extra:
            return f"{len(extra)} unexpected files at destination, e.g. {extra[0]}"
        for rel, sa in a.items():
            sb = b[rel]
            if sa.st_size != sb.st_size:
                return f"{rel}: size {sb.st_size} != {sa.st_size}"
            if sa.st_mtime_ns != sb.st_mtime_ns:
                return f"{rel}: mtime differs by {sb.st_mtime_ns - sa.st_mtime_ns} ns"
        rels = sorted(a)
        if len(rels) > self.sample:  # a reproducible sample, always including the largest file
            rels = random.Random(label).sample(rels, self.sample) + [max(a, key=lambda r: a[r].st_size)]
        for rel in rels:
            if self._src_digest(os.path.join(src, rel), a[rel]) != file_digest(os.path.join(dst, rel)):
                return f"{rel}: content differs"
        return None


# --------------------------------------------------------------------------- the tools


@dataclass
class Run:
    """One timed transfer."""
    ok: bool
    error: str | None = None
    wall: float | None = None
    cpu_client: float | None = None
    cpu_server: float | None = None
    wire_bytes: int | None = None
    rss_client: int | None = None  # peak RSS, bytes
    rss_server: int | None = None
    stats: dict = field(default_factory=dict)
    verify: str | None = None  # None = fine (or not checked: see `verified`)
    verified: bool = False

    @property
    def cpu(self):
        if self.cpu_client is None or self.cpu_server is None:
            return None
        return self.cpu_client + self.cpu_server


class Server:
    def __init__(self, proc: Proc, port: int):
        self.proc, self.port = proc, port
        self.cpu: float | None = None
        self.maxrss: int | None = None  # bytes, once stopped

    def __enter__(self):
        self.proc.mark()
        return self

    def __exit__(self, *exc):
        self.cpu = self.proc.stop()
        self.maxrss = self.proc.maxrss


class Tb5sync:
    name = "tb5sync"

    def __init__(self, cmd: list[str], env: dict, token_file: str | None, streams: int | None,
                 timeout: float, log_dir: str):
        self.cmd, self.env, self.token_file = cmd, env, token_file
        self.streams, self.timeout, self.log_dir = streams, timeout, log_dir
        self._n = 0

    def _token(self) -> list[str]:
        return ["--token-file", self.token_file] if self.token_file else []

    def probe(self) -> str | None:
        """None if the command starts, else the one-line reason it does not."""
        try:
            res = run_measured(self.cmd + ["--help"], 60, env=self.env)
        except OSError as e:
            return f"cannot start {self.cmd[0]}: {e}"
        if res.rc != 0 or res.timed_out:
            return f"`tb5sync --help` exit {res.rc}: {one_line(res.err) or one_line(res.out)}"
        return None

    def serve(self, root: str) -> Server:
        self._n += 1
        port = free_port()
        proc = Proc(f"tb5sync-serve-{self._n}",
                    self.cmd + ["serve", root, "--bind", f"{LOOPBACK}:{port}"] + self._token(),
                    self.log_dir, env=self.env)
        try:
            proc.wait_listening(port)
        except BaseException:
            proc.stop()
            raise
        return Server(proc, port)

    def remote(self, srv: Server, rel: str) -> str:
        return f"tb5://{LOOPBACK}:{srv.port}/{rel}"

    def sync(self, src: str, dst: str) -> Run:
        cmd = self.cmd + ["sync", src, dst, "--json"] + self._token()
        if self.streams:
            cmd += ["--streams", str(self.streams)]
        res = run_measured(cmd, self.timeout, env=self.env)
        check(res, "tb5sync sync", self.timeout)
        stats = None
        for line in reversed(res.out.splitlines()):
            if line.strip().startswith("{"):
                try:
                    stats = json.loads(line)
                    break
                except ValueError:
                    pass
        if stats is None:
            try:
                stats = json.loads(res.out)
            except ValueError:
                raise ToolError(f"tb5sync sync --json printed no JSON object: {one_line(res.out)!r}")
        return Run(ok=True, wall=res.wall, cpu_client=res.cpu, wire_bytes=stats.get("wire_bytes"),
                   rss_client=res.maxrss, stats=stats)


class Rsync:
    name = "rsync"
    ENV = dict(os.environ, LC_ALL="C")

    def __init__(self, timeout: float, log_dir: str):
        self.timeout, self.log_dir = timeout, log_dir
        self._n = 0

    def serve(self, root: str) -> Server:
        self._n += 1
        port = free_port()
        conf = os.path.join(self.log_dir, f"rsyncd-{self._n}.conf")
        with open(conf, "w") as f:
            f.write(
                f"use chroot = false\n"
                f"uid = {pwd.getpwuid(os.getuid()).pw_name}\n"
                f"gid = {grp.getgrgid(os.getgid()).gr_name}\n"
                f"reverse lookup = no\n"
                f"max connections = 0\n"
                f"log file = {os.path.join(self.log_dir, f'rsyncd-{self._n}.log')}\n"
                f"[root]\n"
                f"    path = {root}\n"
                f"    read only = false\n"
                f"    hosts allow = {LOOPBACK}\n"
            )
        proc = Proc(f"rsyncd-{self._n}", ["rsync", "--daemon", "--no-detach", f"--config={conf}",
                                          f"--port={port}", f"--address={LOOPBACK}"],
                    self.log_dir, env=self.ENV)
        try:
            proc.wait_listening(port)
        except BaseException:
            proc.stop()
            raise
        return Server(proc, port)

    def remote(self, srv: Server, rel: str) -> str:
        return f"rsync://{LOOPBACK}:{srv.port}/root/{rel}"

    @staticmethod
    def parse_stats(out: str) -> dict:
        def num(pattern):
            m = re.search(pattern, out)
            return int(m.group(1).replace(",", "")) if m else None

        st = {
            "files_total": num(r"reg: ([\d,]+)") or num(r"Number of files: ([\d,]+)"),
            "bytes_total": num(r"Total file size: ([\d,]+)"),
            "files_transferred": num(r"Number of regular files transferred: ([\d,]+)"),
            "bytes_transferred": num(r"Total transferred file size: ([\d,]+)"),
            "bytes_sent": num(r"Total bytes sent: ([\d,]+)"),
            "bytes_received": num(r"Total bytes received: ([\d,]+)"),
        }
        if st["bytes_sent"] is not None and st["bytes_received"] is not None:
            st["wire_bytes"] = st["bytes_sent"] + st["bytes_received"]
        return st

    def sync(self, src: str, dst: str) -> Run:
        res = run_measured(["rsync", "-a", "--stats", f"--exclude={STATE_DIR}/", src, dst],
                           self.timeout, env=self.ENV)
        check(res, "rsync", self.timeout)
        stats = self.parse_stats(res.out)
        return Run(ok=True, wall=res.wall, cpu_client=res.cpu, wire_bytes=stats.get("wire_bytes"),
                   rss_client=res.maxrss, stats=stats)


def find_tb5sync(override: str | None) -> tuple[list[str], dict]:
    # Run as a user's install does: with cached bytecode. PYTHONDONTWRITEBYTECODE (set on the
    # development machines) would make every client and server start compile all its sources.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    if override:
        return shlex.split(override), env
    beside = os.path.join(os.path.dirname(sys.executable), "tb5sync")
    if os.access(beside, os.X_OK):
        return [beside], env
    found = shutil.which("tb5sync")
    if found:
        return [found], env
    # not installed: run the source tree's cli.main() with this interpreter
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return [sys.executable, "-c", "from tb5sync.cli.command import run; run()"], env


# --------------------------------------------------------------------------- workloads


class Bench:
    """Paths, tools and results of one harness run."""

    def __init__(self, args, prof: Profile, meta: dict, tools: list, verifier: Verifier):
        self.args, self.prof, self.meta, self.tools, self.verifier = args, prof, meta, tools, verifier
        self.data = os.path.join(args.workdir, f"data-{prof.name}")
        self.big_dir = os.path.join(self.data, "big")
        self.big_v2_dir = os.path.join(self.data, "big_v2")
        self.tree_dir = os.path.join(self.data, "tree")
        self.runs_dir = os.path.join(args.workdir, "runs")
        self.results: dict[str, dict[str, list[Run]]] = {w: {t.name: [] for t in tools} for w in WORKLOADS}
        self.deferred: list[str] = []  # tree runs' directories, removed once the workload is over

    def fresh(self, label: str) -> str:
        d = os.path.join(self.runs_dir, label)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(os.path.join(d, "dst"))
        os.sync()  # write back earlier runs' dirty pages now, not during the next timed run
        return d

    def checked(self, run: Run, src: str, dst: str, label: str) -> Run:
        run.verify = self.verifier.verify(src, dst, label)
        run.verified = True
        if run.verify:
            print(f"\n!!! VERIFY FAILED [{label}]: {run.verify}\n", file=sys.stderr)
        return run

    # Each workload runs one tool once and returns {workload key: Run}.

    def big_push(self, tool, i: int) -> dict:
        d = self.fresh(f"{tool.name}-big_push-{i}")
        try:
            clear_state(self.big_dir)
            with tool.serve(d) as srv:
                run = tool.sync(self.big_dir + "/", tool.remote(srv, "dst"))
            run.cpu_server, run.rss_server = srv.cpu, srv.maxrss
            return {"big_push": self.checked(run, self.big_dir, os.path.join(d, "dst"), f"big_push-{i}")}
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def big_pull(self, tool, i: int) -> dict:
        d = self.fresh(f"{tool.name}-big_pull-{i}")
        try:
            clear_state(self.data)
            clear_state(self.big_dir)
            with tool.serve(self.data) as srv:  # the server's ROOT is the data directory
                run = tool.sync(tool.remote(srv, "big/"), os.path.join(d, "dst"))
            run.cpu_server, run.rss_server = srv.cpu, srv.maxrss
            return {"big_pull": self.checked(run, self.big_dir, os.path.join(d, "dst"), f"big_pull-{i}")}
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def tree(self, tool, i: int) -> dict:
        """Cold push of the tree, then the same command again with nothing changed."""
        d = self.fresh(f"{tool.name}-tree-{i}")
        dst = os.path.join(d, "dst")
        out = {}
        try:
            clear_state(self.tree_dir)
            with tool.serve(d) as srv:
                cold = tool.sync(self.tree_dir + "/", tool.remote(srv, "dst"))
                cold.cpu_server = srv.proc.cpu_now()
                out["tree_cold"] = self.checked(cold, self.tree_dir, dst, f"tree_cold-{i}")
                srv.proc.mark()  # the re-run's server CPU starts here
                try:
                    again = tool.sync(self.tree_dir + "/", tool.remote(srv, "dst"))
                except ToolError as e:
                    again = Run(ok=False, error=str(e))
            cold.rss_server = srv.maxrss  # the peak of the server over both runs
            if again.ok:
                again.cpu_server, again.rss_server = srv.cpu, srv.maxrss
                out["tree_nochange"] = self.checked(again, self.tree_dir, dst, f"tree_nochange-{i}")
            else:
                out["tree_nochange"] = again
            return out
        finally:
            if self.args.delete_between:
                shutil.rmtree(d, ignore_errors=True)
            else:  # see run_all
                self.deferred.append(d)

    def tree_pull(self, tool, i: int) -> dict:
        """Cold pull of the tree from a server whose root holds it, into an empty destination."""
        d = self.fresh(f"{tool.name}-tree_pull-{i}")
        dst = os.path.join(d, "dst")
        try:
            clear_state(self.data)
            clear_state(self.tree_dir)
            with tool.serve(self.data) as srv:
                run = tool.sync(tool.remote(srv, "tree/"), dst)
            run.cpu_server, run.rss_server = srv.cpu, srv.maxrss
            return {"tree_pull": self.checked(run, self.tree_dir, dst, f"tree_pull-{i}")}
        finally:
            if self.args.delete_between:
                shutil.rmtree(d, ignore_errors=True)
            else:  # see run_all
                self.deferred.append(d)

    def big_delta(self, tool, i: int) -> dict:
        d = self.fresh(f"{tool.name}-big_delta-{i}")
        dst = os.path.join(d, "dst")
        try:
            # the previous version, as a plain copy with its mtime: no tool has state about it
            shutil.copy2(os.path.join(self.big_dir, "big.bin"), os.path.join(dst, "big.bin"))
            clear_state(self.big_v2_dir)
            with tool.serve(d) as srv:
                run = tool.sync(self.big_v2_dir + "/", tool.remote(srv, "dst"))
            run.cpu_server, run.rss_server = srv.cpu, srv.maxrss
            return {"big_delta": self.checked(run, self.big_v2_dir, dst, f"big_delta-{i}")}
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def run_all(self, selected: list[str]) -> None:
        plan = [(self.big_push, ["big_push"]), (self.big_pull, ["big_pull"]),
                (self.tree, ["tree_cold", "tree_nochange"]), (self.tree_pull, ["tree_pull"]),
                (self.big_delta, ["big_delta"])]
        for fn, keys in plan:
            keys = [k for k in keys if k in selected]
            if not keys:
                continue
            given_up: set[str] = set()
            for i in range(self.args.repeat):
                for tool in self.tools:
                    if tool.name in given_up:
                        continue
                    if getattr(tool, "unavailable", None):
                        runs = {k: Run(ok=False, error=tool.unavailable) for k in keys}
                    else:
                        try:
                            runs = fn(tool, i)
                        except ToolError as e:
                            runs = {k: Run(ok=False, error=str(e)) for k in keys}
                        except Exception as e:  # e.g. odd output: report it, keep going
                            runs = {k: Run(ok=False, error=f"{type(e).__name__}: {e}") for k in keys}
                    for k in keys:
                        run = runs.get(k) or Run(ok=False, error="not run")
                        self.results[k][tool.name].append(run)
                        self._progress(k, i, tool.name, run)
                    if not all(r.ok for r in runs.values()):
                        given_up.add(tool.name)  # a tool that fails once fails again: save time
            # The trees' copies are removed only now, not after each run: on ext4 without a journal
            # (this VM's disk) a new inode skips every inode of its group deleted in the last
            # 60-360 s, which made whichever run followed a removal of 20,000 files pay 30-36% more
            # CPU for its creates (benches/README.md, p16s). A Mac's APFS has no such rule; each tool's
            # run now meets the same quiet file system. --delete-between restores the old order.
            for d in self.deferred:
                shutil.rmtree(d, ignore_errors=True)
            self.deferred.clear()

    def size_of(self, key: str) -> tuple[int, int]:
        """(bytes, files) at the source of a workload."""
        if key.startswith("tree"):
            return self.meta["tree"]["bytes"], self.meta["tree"]["files"]
        if key == "big_delta":
            return self.prof.big_bytes + self.prof.insert_bytes, 1
        return self.prof.big_bytes, 1

    def _progress(self, key: str, i: int, tool: str, run: Run) -> None:
        head = f"[{key} {i + 1}/{self.args.repeat}] {tool:8s}"
        if not run.ok:
            print(f"{head} FAILED: {run.error}", file=sys.stderr)
            return
        nbytes, nfiles = self.size_of(key)
        files = f"{nfiles / run.wall:7.0f} files/s  " if nfiles > 1 else ""
        print(f"{head} wall {run.wall:7.3f} s  {nbytes / run.wall / GB:6.2f} GB/s  {files}"
              f"wire {fmt_bytes(run.wire_bytes):>8s}  "
              f"cpu {run.cpu_client or 0:.2f}+{run.cpu_server or 0:.2f} s  "
              f"verify {'FAILED' if run.verify else 'ok'}", file=sys.stderr)


# --------------------------------------------------------------------------- raw TCP

PY_SINK = r"""
import socket, struct, sys
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", int(sys.argv[1])))
srv.listen(1)
conn, _ = srv.accept()
buf = memoryview(bytearray(int(sys.argv[2])))
total = 0
while True:
    n = conn.recv_into(buf)
    if not n:
        break
    total += n
conn.sendall(struct.pack("!Q", total))
conn.close()
"""


def raw_iperf3(log_dir: str, streams: int, seconds: int, n: int) -> dict:
    port = free_port()
    srv = Proc(f"iperf3-s-P{streams}-{n}", ["iperf3", "-s", "-1", "-B", LOOPBACK, "-p", str(port)], log_dir)
    try:
        srv.wait_listening(port)
        srv.mark()
        res = run_measured(["iperf3", "-c", LOOPBACK, "-p", str(port), "-t", str(seconds), "-J",
                            "-P", str(streams)], seconds + 30)
    finally:
        cpu_server = srv.stop()
    try:
        j = json.loads(res.out)
    except ValueError:
        j = {}
    if res.rc != 0 or "error" in j or "end" not in j:
        raise ToolError(f"iperf3 exit {res.rc}: {j.get('error') or one_line(res.err) or one_line(res.out)}")
    recv = j["end"]["sum_received"]
    return {"gbps": recv["bytes"] / recv["seconds"] / GB, "bytes": recv["bytes"],
            "seconds": recv["seconds"], "cpu": res.cpu + cpu_server}


def raw_pysocket(log_dir: str, seconds: float, n: int, bufsize: int = 4 * MiB) -> dict:
    port = free_port()
    sink = Proc(f"pysock-sink-{n}", [sys.executable, "-c", PY_SINK, str(port), str(bufsize)], log_dir)
    try:
        sink.wait_listening(port)
        sink.mark()
        payload = memoryview(bytearray(os.urandom(bufsize)))
        with socket.create_connection((LOOPBACK, port)) as s:
            c0, t0, sent = time.thread_time(), time.perf_counter(), 0
            while time.perf_counter() - t0 < seconds:
                s.sendall(payload)
                sent += bufsize
            s.shutdown(socket.SHUT_WR)
            ack = b""
            while len(ack) < 8:
                got = s.recv(8 - len(ack))
                if not got:
                    raise ToolError("python socket sink closed without acknowledging")
                ack += got
            elapsed = time.perf_counter() - t0
            cpu_client = time.thread_time() - c0
    finally:
        cpu_server = sink.stop()
    (received,) = struct.unpack("!Q", ack)
    if received != sent:
        raise ToolError(f"python socket: sent {sent} bytes, sink received {received}")
    return {"gbps": sent / elapsed / GB, "bytes": sent, "seconds": elapsed, "cpu": cpu_client + cpu_server}


def run_raw(args, log_dir: str, streams: int) -> dict:
    """Raw TCP figures: {name: {"runs": [...], "gbps": median, "error": ...}}."""
    tests = []
    if shutil.which("iperf3"):
        tests.append(("iperf3 -P1", lambda n: raw_iperf3(log_dir, 1, args.iperf_seconds, n)))
        if streams > 1:
            tests.append((f"iperf3 -P{streams}",
                          lambda n: raw_iperf3(log_dir, streams, args.iperf_seconds, n)))
    tests.append(("python socket 4 MiB", lambda n: raw_pysocket(log_dir, args.iperf_seconds, n)))
    out = {}
    if not shutil.which("iperf3"):
        out["iperf3 -P1"] = {"runs": [], "gbps": None, "error": "iperf3 not installed"}
    for name, fn in tests:
        runs, err = [], None
        for n in range(args.repeat):
            try:
                r = fn(n)
            except (ToolError, OSError) as e:
                err = str(e)
                print(f"[raw] {name}: FAILED: {err}", file=sys.stderr)
                break
            runs.append(r)
            print(f"[raw {n + 1}/{args.repeat}] {name}: {r['gbps']:.2f} GB/s  cpu {r['cpu']:.2f} s",
                  file=sys.stderr)
        out[name] = {"runs": runs, "gbps": median(r["gbps"] for r in runs),
                     "cpu_per_gb": median(r["cpu"] / (r["bytes"] / GB) for r in runs), "error": err}
    return out


# --------------------------------------------------------------------------- report


def summarize(bench: Bench, key: str, runs: list[Run]) -> dict:
    nbytes, nfiles = bench.size_of(key)
    ok = [r for r in runs if r.ok]
    s = {"runs": [dict(asdict(r), cpu=r.cpu) for r in runs], "n_ok": len(ok), "n": len(runs),
         "error": next((r.error for r in runs if not r.ok), None),
         "verify_failed": [r.verify for r in runs if r.verify]}
    if ok:
        wall = median(r.wall for r in ok)
        cpu = median(r.cpu for r in ok)
        s.update(wall=wall, gb_per_s=nbytes / wall / GB, files_per_s=nfiles / wall,
                 wire_bytes=median(r.wire_bytes for r in ok),
                 rss_client_max=max((r.rss_client for r in ok if r.rss_client), default=None),
                 rss_server_max=max((r.rss_server for r in ok if r.rss_server), default=None),
                 cpu_seconds=cpu, cpu_per_gb=cpu / (nbytes / GB) if cpu is not None else None)
    return s


def headline(key: str, s: dict) -> str:
    if not s or not s.get("n_ok"):
        return "FAILED" if s and s.get("error") else "-"
    unit = WORKLOADS[key][1]
    txt = {"GB/s": f"{s['gb_per_s']:.2f} GB/s", "files/s": f"{s['files_per_s']:,.0f} files/s",
           "s": f"{s['wall']:.3f} s"}[unit]
    if unit == "files/s":
        txt += f" ({s['gb_per_s']:.2f} GB/s)"
    if s["verify_failed"]:
        txt += " !"
    if s["n_ok"] < s["n"]:
        txt += f" ({s['n'] - s['n_ok']}/{s['n']} failed)"
    return txt


def build_report(bench: Bench, raw: dict, selected: list[str]) -> tuple[list[list[str]], dict]:
    """Rows of the table and the per-workload JSON."""
    iperf = [v["gbps"] for k, v in raw.items() if k.startswith("iperf3") and v.get("gbps")]
    best_iperf = max(iperf) if iperf else None
    best_raw = max([v["gbps"] for v in raw.values() if v.get("gbps")], default=None)
    py = raw.get("python socket 4 MiB", {}).get("gbps")
    ref_txt = " / ".join(x for x in (f"{best_iperf:.2f}" if best_iperf else "-",
                                     f"{py:.2f} GB/s" if py else "-"))
    header = ["workload", "tb5sync", "rsync", "iperf3 / py socket", "tb5/rsync", "tb5/iperf3",
              "wire bytes tb5 | rsync", "CPU s/GB tb5 | rsync"]
    rows = [header]
    for name, v in raw.items():
        val = f"{v['gbps']:.2f} GB/s" if v.get("gbps") else f"FAILED: {v.get('error')}"
        cpu = f"{v['cpu_per_gb']:.2f}" if v.get("cpu_per_gb") is not None else "-"
        rows.append([f"raw TCP: {name}", "", "", val, "", "", "", cpu])
    wl_json = {}
    for key in selected:
        nbytes, nfiles = bench.size_of(key)
        t = summarize(bench, key, bench.results[key].get("tb5sync", []))
        r = summarize(bench, key, bench.results[key].get("rsync", []))
        ratio_rsync = ratio_raw = None
        if t.get("n_ok") and r.get("n_ok"):
            ratio_rsync = r["wall"] / t["wall"]  # ratio of rates: >1 means tb5sync is faster
        if t.get("n_ok") and best_iperf and key != "tree_nochange":
            ratio_raw = t["gb_per_s"] / best_iperf
        wl_json[key] = {"description": WORKLOADS[key][0], "unit": WORKLOADS[key][1],
                        "bytes": nbytes, "files": nfiles, "tb5sync": t, "rsync": r,
                        "ratio_tb5_rsync": ratio_rsync, "ratio_tb5_iperf3": ratio_raw,
                        "ratio_tb5_best_raw": (t["gb_per_s"] / best_raw if ratio_raw and best_raw
                                               else None)}
        cpu = " | ".join(f"{s['cpu_per_gb']:.2f}" if s.get("cpu_per_gb") is not None else "-"
                         for s in (t, r))
        wire = " | ".join(fmt_bytes(s.get("wire_bytes")) for s in (t, r))
        rows.append([key, headline(key, t), headline(key, r),
                     ref_txt if key != "tree_nochange" else "",
                     f"{ratio_rsync:.2f}x" if ratio_rsync else "-",
                     f"{ratio_raw:.2f}x" if ratio_raw else "-", wire, cpu])
    return rows, wl_json


def print_table(rows: list[list[str]]) -> None:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    line = "  ".join("-" * w for w in widths)
    for n, r in enumerate(rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
        if n == 0:
            print(line)


def host_info() -> dict:
    def version(cmd):
        try:
            return one_line(subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.split("\n")[0])
        except (OSError, subprocess.SubprocessError):
            return None

    git = None
    if os.path.isdir(os.path.join(REPO, ".git")):
        git = version(["git", "-C", REPO, "rev-parse", "--short", "HEAD"])
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
            "rsync": version(["rsync", "--version"]), "iperf3": version(["iperf3", "--version"]),
            "hash": "blake3" if blake3 else "blake2b", "git": git}


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--short", action="store_true", help="256 MiB file and 2,000 files (~3 minutes)")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "tb5sync-bench"),
                   help="data and destinations (data is kept and reused; default %(default)s)")
    p.add_argument("--repeat", type=int, default=3, help="runs per tool and workload, median (default 3)")
    p.add_argument("--json-out", help="JSON result path (default benches/results/bench-<timestamp>.json)")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help="comma-separated subset of: " + ", ".join(WORKLOADS))
    p.add_argument("--tools", default="tb5sync,rsync", help="comma-separated subset of tb5sync,rsync")
    p.add_argument("--no-raw", action="store_true", help="skip iperf3 and the python socket test")
    p.add_argument("--streams", type=int, help="tb5sync sync --streams N (default: tb5sync's own)")
    p.add_argument("--tb5sync-cmd", help="command to run tb5sync (default: the `tb5sync` entry point "
                   "beside this python or on PATH, else python -c 'from tb5sync.cli import main; main()' on the repo)")
    p.add_argument("--no-token", action="store_true", help="run tb5sync without --token-file")
    p.add_argument("--iperf-seconds", type=int, default=3, help="length of each raw TCP test (default 3)")
    p.add_argument("--timeout", type=float, help="per-command timeout in s (default 900, 300 with --short)")
    p.add_argument("--sample", type=int, default=200, help="files hashed per tree verification")
    p.add_argument("--keep", action="store_true", help="keep server logs under WORKDIR/logs")
    p.add_argument("--delete-between", action="store_true",
                   help="remove each tree run's copy right after it (default: after the workload's last run; "
                        "needs the tree's size free per run)")
    a = p.parse_args(argv)
    a.workdir = os.path.abspath(a.workdir)
    a.timeout = a.timeout or (300.0 if a.short else 900.0)
    if a.repeat < 1:
        p.error("--repeat must be >= 1")
    for w in a.workloads.split(","):
        if w not in WORKLOADS:
            p.error(f"unknown workload {w!r}")
    for t in a.tools.split(","):
        if t not in ("tb5sync", "rsync"):
            p.error(f"unknown tool {t!r}")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    prof = SHORT if args.short else FULL
    selected = [w for w in WORKLOADS if w in args.workloads.split(",")]
    started = time.strftime("%Y%m%d-%H%M%S")
    os.makedirs(args.workdir, exist_ok=True)
    log_dir = os.path.join(args.workdir, "logs", started)
    os.makedirs(log_dir, exist_ok=True)
    shutil.rmtree(os.path.join(args.workdir, "runs"), ignore_errors=True)

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    t_start = time.perf_counter()
    raw, tools, bench = {}, [], None
    try:
        meta = ensure_data(args.workdir, prof)
        tool_names = args.tools.split(",")
        tb5_info = {}
        if "tb5sync" in tool_names:
            token_file = None
            if not args.no_token:
                token_file = os.path.join(log_dir, "token")
                with open(os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                    f.write(os.urandom(24).hex() + "\n")
            cmd, env = find_tb5sync(args.tb5sync_cmd)
            tb5 = Tb5sync(cmd, env, token_file, args.streams, args.timeout, log_dir)
            tb5.unavailable = tb5.probe()
            tb5_info = {"cmd": cmd, "unavailable": tb5.unavailable}
            if tb5.unavailable:
                print(f"tb5sync unavailable: {tb5.unavailable}", file=sys.stderr)
            tools.append(tb5)
        if "rsync" in tool_names:
            rs = Rsync(args.timeout, log_dir)
            if not shutil.which("rsync"):
                rs.unavailable = "rsync not installed"
            tools.append(rs)
        if not args.no_raw:
            raw = run_raw(args, log_dir, args.streams or max(2, min(4, os.cpu_count() or 2)))
        bench = Bench(args, prof, meta, tools, Verifier(args.sample))
        bench.run_all(selected)
    finally:
        for proc in list(LIVE):
            proc.stop(timeout=3)
        shutil.rmtree(os.path.join(args.workdir, "runs"), ignore_errors=True)
        if not args.keep:
            shutil.rmtree(log_dir, ignore_errors=True)

    rows, wl_json = build_report(bench, raw, selected)
    print(f"\ntb5sync benchmark, {prof.name} profile: big file {fmt_bytes(prof.big_bytes)}, "
          f"tree {meta['tree']['files']:,} files / {fmt_bytes(meta['tree']['bytes'])}, "
          f"repeat {args.repeat} (median), loopback {LOOPBACK}, {os.cpu_count()} CPUs\n")
    print_table(rows)
    failures: dict[tuple[str, str], list[str]] = {}  # (tool, error) -> workloads
    notes = []
    for key, w in wl_json.items():
        for tool in ("tb5sync", "rsync"):
            s = w[tool]
            if s.get("error"):
                failures.setdefault((tool, s["error"]), []).append(key)
            for v in s.get("verify_failed", []):
                notes.append(f"!!! {tool} {key}: VERIFY FAILED: {v}")
    notes = [f"{tool} FAILED ({', '.join(keys)}): {err}" for (tool, err), keys in failures.items()] + notes
    print("\nRatios are rate ratios: >1x means tb5sync is faster. GB = 1e9 bytes. "
          "CPU = client+server user+sys per GB at the source.")
    for n in notes:
        print(n)

    result = {"schema": 1, "timestamp": started, "argv": sys.argv, "profile": asdict(prof),
              "data": meta, "host": host_info(), "repeat": args.repeat,
              "elapsed_seconds": time.perf_counter() - t_start,
              "tools": {"tb5sync": tb5_info}, "raw": raw, "workloads": wl_json,
              "table": rows, "notes": notes}
    out = args.json_out or os.path.join(HERE, "results", f"bench-{started}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"\nJSON: {out}  ({time.perf_counter() - t_start:.0f} s)")
    return 1 if any(n.startswith("!!!") for n in notes) else 0


if __name__ == "__main__":
    sys.exit(main())
