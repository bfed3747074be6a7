#!/usr/bin/env python3
"""CPU seconds per GB of a cold push of one large file, per side and per stage, and the 80 Gbps model.

Six parts, each printed as a table (``--parts`` picks them; ``e2e`` and ``gil`` together also
print the 80 Gbit/s model: cores and processes per side for 10 GB/s):

``e2e``
    ``tb5sync serve`` and ``rsync --daemon`` on 127.0.0.1 (a free port), one file of random bytes
    (``--size``, default 1 GiB) pushed cold (``tb5sync sync FILE tb5://...``, ``rsync -a FILE
    rsync://...``), alternately, ``--repeat`` times; the median of client and server CPU seconds
    (user+sys: ``wait4`` of the client, ``/proc`` of the server tree from just before the run)
    per GB (1e9 bytes), and wall time. The destination is compared with the source each run.
    The tools and process accounting are those of ``bench_sync.py``.
``medium``
    The same for a directory of ``--medium-files`` files of 6 MiB each (every one a large-file
    job: the per-file fixed costs of that path show here).
``stages``
    Each stage of the large-file path timed alone on this machine, on one thread (CPU seconds of
    the thread, ``time.thread_time``, per GB): the sender's window read (``pread`` from the page
    cache into a pooled buffer), FastCDC cut points, BLAKE3 of each chunk, the ``--compress
    auto`` sample test, ``sendfile`` to a loopback TCP socket and the matching ``recv_into``
    (both processes' CPU), the receiver's ``pwrite`` into a new file (page cache), and its
    verify + write of 8 MiB replies two ways (per reply, per chunk task; whole-process CPU).
    Each figure is the median of ``--repeat`` rounds.
``gil``
    GIL-held seconds per GB of each process during a push: ``py-spy record --gil --nonblocking``
    (a sample is kept only when some thread holds the GIL; ``--gil-rate`` Hz, default 250, as
    issue 24's figures were taken: at 1000 Hz py-spy's own CPU on a 2-core machine takes GIL
    holders off the CPU and the figure doubles) attached to the server and wrapping the client,
    ``--gil-runs`` pushes (default 3; medians: one 2 GiB push gives only ~50 samples a side); also without the stacks of fixed work (imports, first buffer allocations), and
    the leaf frames that hold it most. Needs ``py-spy`` (the ``bench`` extra) and ptrace rights.
``interp``
    CPU seconds per GB in the interpreter itself (``libpython``), per side: ``perf record -F 2000``
    of both processes of ``--gil-runs`` pushes, ``perf report --sort dso``. A floor under the
    GIL-held time that a descheduled GIL holder does not inflate. Needs ``perf``.
``procs``
    The multi-process prototype: the same bytes (two files of half ``--size``) moved by one
    client and one server process on all streams, against two client/server pairs at once, each
    moving one file on half the streams: CPU s/GB of all processes and wall time.

Usage::

    .venv/bin/python benches/bench_cpu.py                       # all parts, 1 GiB, 3 runs
    .venv/bin/python benches/bench_cpu.py --parts e2e --size 256M --repeat 5
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import bench_sync as bs  # noqa: E402  (the tools, the process accounting, the data)

MiB, GiB, GB = 1 << 20, 1 << 30, 1e9


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().rstrip("B").rstrip("I")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


# --------------------------------------------------------------------------- data


def ensure_file(workdir: str, size: int) -> str:
    """WORKDIR/data-cpu-SIZE/big.bin of ``size`` random bytes (made once, then reused)."""
    d = os.path.join(workdir, f"data-cpu-{size}")
    path = os.path.join(d, "big.bin")
    try:
        if os.path.getsize(path) == size:
            return path
    except OSError:
        pass
    os.makedirs(d, exist_ok=True)
    bs.make_big(path, size, bs.RandomStream(b"bench_cpu %d" % size))
    return path


# --------------------------------------------------------------------------- e2e


def ensure_medium(workdir: str, n: int, size: int = 6 * MiB) -> str:
    """WORKDIR/data-medium-N: ``n`` files of ``size`` random bytes (each takes the large-file path)."""
    d = os.path.join(workdir, f"data-medium-{n}-{size}")
    rs = bs.RandomStream(b"bench_cpu medium")
    os.makedirs(d, exist_ok=True)
    for i in range(n):
        path = os.path.join(d, f"f{i:04d}.bin")
        if not (os.path.exists(path) and os.path.getsize(path) == size):
            with open(path, "wb") as f:
                f.write(rs.read(size))
    return d


def e2e(args, src: str) -> dict:
    """Median CPU s/GB (client, server) and wall of ``--repeat`` cold pushes of directory ``src``'s
    contents by tb5sync and rsync, alternately, each checked against the source."""
    size = sum(os.path.getsize(os.path.join(src, n)) for n in os.listdir(src) if n != bs.STATE_DIR)
    log_dir = tempfile.mkdtemp(prefix="logs-", dir=args.workdir)
    token_file = os.path.join(log_dir, "token")
    with open(os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(os.urandom(24).hex() + "\n")
    cmd, env = bs.find_tb5sync(args.tb5sync_cmd)
    tools = [bs.Tb5sync(cmd, env, token_file, args.streams, 600.0, log_dir), bs.Rsync(600.0, log_dir)]
    verifier = bs.Verifier(sample=1000)
    runs: dict[str, list[bs.Run]] = {t.name: [] for t in tools}
    try:
        for i in range(args.repeat):
            for tool in tools:
                root = os.path.join(args.workdir, "runs", f"{tool.name}-{i}")
                shutil.rmtree(root, ignore_errors=True)
                os.makedirs(os.path.join(root, "dst"))
                os.sync()
                bs.clear_state(src)
                with tool.serve(root) as srv:
                    run = tool.sync(src + "/", tool.remote(srv, "dst"))
                run.cpu_server, run.rss_server = srv.cpu, srv.maxrss
                bad = verifier.verify(src, os.path.join(root, "dst"), f"{tool.name}-{i}")
                if bad:
                    raise SystemExit(f"{tool.name} run {i}: destination differs from the source: {bad}")
                shutil.rmtree(root, ignore_errors=True)
                runs[tool.name].append(run)
                print(f"  {tool.name} run {i}: wall {run.wall:.2f} s, client {run.cpu_client / size * GB:.2f}"
                      f" + server {run.cpu_server / size * GB:.2f} CPU s/GB", file=sys.stderr)
    finally:
        for proc in list(bs.LIVE):
            proc.stop(timeout=3)
        shutil.rmtree(log_dir, ignore_errors=True)
    out: dict = {"bytes": size, "files": len(os.listdir(src))}
    for name, rs in runs.items():
        c = statistics.median(r.cpu_client for r in rs) / size * GB
        s = statistics.median(r.cpu_server for r in rs) / size * GB
        t = statistics.median(r.cpu for r in rs) / size * GB
        w = statistics.median(r.wall for r in rs)
        out[name] = {"client": c, "server": s, "total": t, "wall": w, "runs": len(rs),
                     "rss_client_max": max((r.rss_client or 0 for r in rs), default=0) or None,
                     "rss_server_max": max((r.rss_server or 0 for r in rs), default=0) or None}
    # interpreter start-up and imports of the client, included in its CPU above
    t0 = bs.run_measured(cmd + ["--help"], 60, env=env)
    out["tb5sync"]["startup_cpu_s"] = t0.cpu
    return out


def print_e2e(res: dict, what: str) -> None:
    print(f"\nCold push of {what} on 127.0.0.1 (median CPU s/GB, GB = 1e9 bytes)\n")
    print(f"{'tool':10} {'client':>8} {'server':>8} {'total':>8} {'wall s':>8} {'peak RSS MiB client/server':>27}")
    for name in ("tb5sync", "rsync"):
        r = res[name]
        rss = "/".join(f"{(r.get(k) or 0) / MiB:.0f}" for k in ("rss_client_max", "rss_server_max"))
        print(f"{name:10} {r['client']:8.2f} {r['server']:8.2f} {r['total']:8.2f} {r['wall']:8.2f} {rss:>27}")
    ratio = res["tb5sync"]["total"] / res["rsync"]["total"]
    print(f"tb5sync / rsync CPU: {ratio:.2f}x  (tb5sync client start-up, `tb5sync --help`: "
          f"{res['tb5sync']['startup_cpu_s']:.2f} CPU s, included)")


# --------------------------------------------------------------------------- stages


def _per_gb(cpu: float, nbytes: int) -> float:
    return cpu / nbytes * GB


def _per_chunk(cuts: list[int], work) -> float:
    """Thread CPU seconds of ``work(start, end)`` over each chunk of ``cuts`` (end offsets from 0)."""
    t = time.thread_time()
    s = 0
    for e in cuts:
        work(s, e)
        s = e
    return time.thread_time() - t


def stages(args, path: str) -> dict:
    """Median over ``--repeat`` rounds of :func:`stages_once` (CPU s/GB per stage)."""
    rounds = [stages_once(args, path) for _ in range(args.repeat)]
    return {k: (statistics.median(r[k] for r in rounds) if not k.startswith("_") else rounds[0][k]) for k in rounds[0]}


def stages_once(args, path: str) -> dict:
    """CPU s/GB of each stage of the large-file path, one thread, on ``path`` (page cache)."""
    import lz4.block  # noqa: F401  (the sender's codec)

    import tb5sync.engine.chunking as chunking
    import tb5sync.engine.hashing as hashing
    import tb5sync.roles.sender as sender

    size = os.path.getsize(path)
    params = chunking.DEFAULT_PARAMS
    out: dict[str, float] = {}
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = bytearray(hashing.WINDOW)
        mv = memoryview(buf)
        bs.file_digest(path)  # in the page cache

        # pread into a reused window buffer (the sender's chunk list)
        t = time.thread_time()
        off = 0
        while off < size:
            n = os.preadv(fd, [mv[: min(len(mv), size - off)]], off)
            off += n
        out["pread window (sender)"] = _per_gb(time.thread_time() - t, size)

        # FastCDC and BLAKE3 per chunk, window by window
        cut_cpu = hash_cpu = xx_cpu = lz_cpu = 0.0
        nchunks = 0
        off = 0
        while off < size:
            n = os.preadv(fd, [mv[: min(len(mv), size - off)]], off)
            final = off + n >= size
            t = time.thread_time()
            cuts = chunking.cut_points(mv[:n], params, final)
            cut_cpu += time.thread_time() - t
            if not final and cuts:
                n = cuts[-1]
            hash_cpu += _per_chunk(cuts, lambda s, e: hashing.chunk_digest(mv[s:e]))
            xx_cpu += _per_chunk(cuts, lambda s, e: hashing.quick_digest(mv[s:e]))
            lz_cpu += _per_chunk(cuts, lambda s, e: sender._compressible(bytes(mv[s : s + sender._SAMPLE])))
            nchunks += len(cuts)
            off += n
        out["FastCDC cut points (sender)"] = _per_gb(cut_cpu, size)
        out["BLAKE3 per chunk (each side)"] = _per_gb(hash_cpu, size)
        out["xxh3-128 per chunk (not on this path)"] = _per_gb(xx_cpu, size)
        out["lz4 auto sample test (sender, per chunk)"] = _per_gb(lz_cpu, size)
        out["_chunks"] = nchunks

        # pwrite into a new file (the receiver's work file), page cache
        wpath = os.path.join(args.workdir, "stage-write.tmp")
        wfd = os.open(wpath, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.preadv(fd, [mv], 0)
            t = time.thread_time()
            off = 0
            while off < size:
                n = min(len(mv), size - off)
                os.pwrite(wfd, mv[:n], off)
                off += n
            out["pwrite new file (receiver)"] = _per_gb(time.thread_time() - t, size)
        finally:
            os.close(wfd)
            os.unlink(wpath)
    finally:
        os.close(fd)
    out.update(_chunk_list_stage(path))
    out.update(_verify_write_stage(args))
    send_cpu, recv_cpu = _socket_stage(path)
    out["sendfile to loopback TCP (sender)"] = send_cpu
    out["recv_into from loopback TCP (receiver)"] = recv_cpu
    return out


def _chunk_list_stage(path: str) -> dict[str, float]:
    """CPU s/GB (whole process: the hash pool's threads count) of the sender's chunk list of
    ``path`` as it runs (``hashing.iter_chunk_fd``: read, cut, hash each chunk in the pool), with
    windows of 32 MiB (before p16m) and of ``hashing.WINDOW`` (16 MiB since p16m), alternately."""
    import tb5sync.engine.chunking as chunking
    import tb5sync.engine.hashing as hashing

    size = os.path.getsize(path)
    out: dict[str, list[float]] = {}
    fd = os.open(path, os.O_RDONLY)
    try:
        for _round in range(2):
            for window in (32 * MiB, hashing.WINDOW):
                t = time.process_time()
                for _refs in hashing.iter_chunk_fd(fd, size, chunking.DEFAULT_PARAMS, window=window):
                    pass
                out.setdefault(f"chunk list, {window // MiB} MiB windows (sender, all threads)", []).append(
                    _per_gb(time.process_time() - t, size))
    finally:
        os.close(fd)
    return {k: min(v) for k, v in out.items()}


def _verify_write_stage(args) -> dict[str, float]:
    """CPU s/GB (whole process) of the receiver's verify + write of 8 MiB replies of 1 MiB chunks,
    12 replies in flight (96 MiB, out of cache): the whole reply hashed in the hash pool and then
    written on one thread (main before p15m), against each chunk hashed and written by one pool task
    (p15m), against one pool task per reply, as many replies side by side as there are hashing
    threads (p16m)."""
    from concurrent.futures import wait

    import tb5sync.roles.largefile as largefile
    from tb5sync._os.io import pwrite_all
    from tb5sync.engine.hashing import check_chunks, chunk_digest, hash_pool, hash_threads

    frames = [bytearray(os.urandom(8 * MiB)) for _ in range(12)]
    chunks = [(i * MiB, MiB) for i in range(8)]
    digests = [[chunk_digest(memoryview(f)[o : o + n]) for o, n in chunks] for f in frames]

    def two_passes(fd: int, base: int, mv: memoryview, ds: list[bytes]) -> None:
        assert all(check_chunks([(mv[o : o + n], d) for (o, n), d in zip(chunks, ds)]))
        for o, n in chunks:
            pwrite_all(fd, mv[o : o + n], base + o)

    def one_pass(fd: int, base: int, mv: memoryview, ds: list[bytes]) -> None:
        tasks = [hash_pool().submit(largefile._verify_write, mv[o : o + n], d, fd, base + o) for (o, n), d in zip(chunks, ds)]
        wait(tasks)
        assert all(t.result() for t in tasks)

    def per_reply(fd: int, base: int, mv: memoryview, ds: list[bytes]) -> None:
        group = [(base + o, n, d) for (o, n), d in zip(chunks, ds)]
        replies.append(hash_pool().submit(largefile._verify_write_reply, [mv[o : o + n] for o, n in chunks], group, fd))
        while len(replies) >= hash_threads():
            assert all(replies.pop(0).result())

    replies: list = []
    out = {}
    for name, fn in (("verify, then write (two passes, p14)", two_passes), ("verify + write per chunk task (p15m)", one_pass),
                     ("verify + write per reply task (p16m)", per_reply)):
        wpath = os.path.join(args.workdir, "stage-vw.tmp")
        fd = os.open(wpath, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            t = time.process_time()
            for rep in range(4):
                for i, f in enumerate(frames):
                    fn(fd, (rep * 12 + i) * 8 * MiB, memoryview(f), digests[i])
            while replies:
                assert all(replies.pop(0).result())
            out[name + " (receiver)"] = _per_gb(time.process_time() - t, 4 * 12 * 8 * MiB)
        finally:
            os.close(fd)
            os.unlink(wpath)
    return out


def _socket_stage(path: str) -> tuple[float, float]:
    """CPU s/GB of sendfile (this process) and recv_into (a child process) over loopback TCP."""
    size = os.path.getsize(path)
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    port = lsock.getsockname()[1]
    code = (
        "import socket,sys,time,resource\n"
        f"s=socket.create_connection(('127.0.0.1',{port}))\n"
        "b=bytearray(8<<20);m=memoryview(b);n=0\n"
        "t=time.thread_time()\n"
        "while True:\n"
        "    k=s.recv_into(m)\n"
        "    if not k: break\n"
        "    n+=k\n"
        "print(time.thread_time()-t,n)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    conn, _ = lsock.accept()
    lsock.close()
    fd = os.open(path, os.O_RDONLY)
    try:
        t = time.thread_time()
        off = 0
        while off < size:
            off += os.sendfile(conn.fileno(), fd, off, min(32 * MiB, size - off))
        send = time.thread_time() - t
    finally:
        os.close(fd)
        conn.close()
    out, _ = child.communicate(timeout=120)
    recv, n = out.split()
    assert int(n) == size, (n, size)
    return _per_gb(send, size), _per_gb(float(recv), size)


def print_stages(res: dict) -> None:
    print(f"\nStages of the large-file path, one thread each (median CPU s/GB; {res['_chunks']} chunks in the file)\n")
    for k, v in res.items():
        if not k.startswith("_"):
            print(f"  {k:52} {v:6.3f}")


# --------------------------------------------------------------------------- gil


#: Frames of fixed (per-process or per-session) GIL-held work: imports, first buffer allocations.
_FIXED = ("<module>", "importlib", "BufferPool.get")


def _raw_samples(path: str) -> tuple[int, dict[str, int], int]:
    """Total samples of a py-spy raw file, samples per leaf-most tb5sync/Python frame, and the
    samples in fixed work (a stack through one of :data:`_FIXED`)."""
    total, where, fixed = 0, {}, 0
    with open(path) as f:
        for line in f:
            line = line.rstrip()
            if not line:
                continue
            stack, n = line.rsplit(" ", 1)
            total += int(n)
            if any(f in stack for f in _FIXED):
                fixed += int(n)
            frames = stack.split(";")
            leaf = next((fr for fr in reversed(frames) if "tb5sync/" in fr), frames[-1])
            if frames[-1] != leaf:  # the library frame under it says what it does there (submit, notify, ...)
                leaf = f"{frames[-1].split(' (')[0]} <- {leaf}"
            where[leaf] = where.get(leaf, 0) + int(n)
    return total, where, fixed


def gil(args, path: str) -> dict:
    """GIL-held seconds per GB of each process of a push, sampled by py-spy (``--gil``: a sample
    is kept only when some thread of the process holds the GIL; ``--nonblocking``: the process is
    not paused). The client's figure includes its start-up (imports), the server's its session."""
    spy = shutil.which("py-spy", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if spy is None:
        return {"error": "py-spy not installed (pip install py-spy)"}
    size = os.path.getsize(path)
    rate = args.gil_rate
    log_dir = tempfile.mkdtemp(prefix="gil-", dir=args.workdir)
    token_file = os.path.join(log_dir, "token")
    with open(os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(os.urandom(24).hex() + "\n")
    cmd, env = bs.find_tb5sync(args.tb5sync_cmd)
    tool = bs.Tb5sync(cmd, env, token_file, args.streams, 600.0, log_dir)
    out: dict = {"rate_hz": rate, "runs": args.gil_runs}
    per_run: dict[str, list[tuple[int, int]]] = {"client": [], "server": []}
    walls: list[float] = []
    where_all: dict[str, dict[str, int]] = {"client": {}, "server": {}}
    try:
        for mode in [f"gil{i}" for i in range(args.gil_runs)]:
            flags = ["--gil"]
            root = os.path.join(args.workdir, "runs", f"gil-{mode}")
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(os.path.join(root, "dst"))
            bs.clear_state(os.path.dirname(path))
            srv_raw, cli_raw = os.path.join(log_dir, f"srv-{mode}.raw"), os.path.join(log_dir, f"cli-{mode}.raw")
            with tool.serve(root) as srv:
                spy_srv = subprocess.Popen([spy, "record", "--nonblocking", "-r", str(rate), "--format", "raw", "-o", srv_raw,
                                            *flags, "--pid", str(srv.proc.p.pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1.0)  # py-spy attached
                sync = cmd + ["sync", path, tool.remote(srv, "dst/"), "--token-file", token_file]
                if args.streams:
                    sync += ["--streams", str(args.streams)]
                res = bs.run_measured([spy, "record", "--nonblocking", "-r", str(rate), "--format", "raw", "-o", cli_raw, *flags,
                                       "--", *sync], 600, env=env)
                bs.check(res, "py-spy record -- tb5sync sync", 600)
                spy_srv.send_signal(signal.SIGINT)
                spy_srv.wait(timeout=30)
            shutil.rmtree(root, ignore_errors=True)
            walls.append(res.wall)
            for side, raw in (("client", cli_raw), ("server", srv_raw)):
                total, where, fixed = _raw_samples(raw)
                per_run[side].append((total, fixed))
                for k, n in where.items():
                    where_all[side][k] = where_all[side].get(k, 0) + n
            print(f"  gil run {mode}: client {per_run['client'][-1][0]} / server {per_run['server'][-1][0]} samples, "
                  f"wall {res.wall:.2f} s", file=sys.stderr)
        # medians over the runs; the leaf frames of all runs together
        for side in ("client", "server"):
            d = out.setdefault(side, {})
            totals = [t for t, _f in per_run[side]]
            steadies = [t - f for t, f in per_run[side]]
            d["gil_s_per_gb"] = statistics.median(totals) / rate / size * GB
            d["gil_steady_s_per_gb"] = statistics.median(steadies) / rate / size * GB
            d["gil_steady_runs_s_per_gb"] = [x / rate / size * GB for x in steadies]
            d["gil_fraction_of_wall"] = statistics.median(totals) / rate / statistics.median(walls)
            d["gil_top"] = sorted(where_all[side].items(), key=lambda kv: -kv[1])[:12]
            d["gil_samples"] = sum(totals)
        out["wall_gil_run"] = statistics.median(walls)
    finally:
        for proc in list(bs.LIVE):
            proc.stop(timeout=3)
        shutil.rmtree(log_dir, ignore_errors=True)
    return out


def print_gil(res: dict) -> None:
    if "error" in res:
        print(f"\nGIL: {res['error']}")
        return
    print(f"\nGIL-held time per GB (py-spy --gil at {res['rate_hz']} Hz, median of {res.get('runs', 1)} pushes; "
          f"median wall of the sampled pushes {res['wall_gil_run']:.2f} s)\n")
    print(f"{'side':8} {'GIL-held s/GB':>14} {'without fixed work':>19} {'share of wall':>14}")
    for side in ("client", "server"):
        d = res[side]
        runs = ", ".join(f"{x:.3f}" for x in d.get("gil_steady_runs_s_per_gb", []))
        print(f"{side:8} {d['gil_s_per_gb']:14.3f} {d['gil_steady_s_per_gb']:19.3f} {d['gil_fraction_of_wall']:14.2f}"
              f"   (steady, each run: {runs})")
    print("  (fixed work: stacks through imports or the first allocation of a pooled buffer)")
    for side in ("client", "server"):
        print(f"  {side}: where the GIL is held (share of GIL samples)")
        for k, n in res[side]["gil_top"][:10]:
            print(f"    {n / res[side]['gil_samples'] * 100:5.1f}%  {k[:140]}")


# --------------------------------------------------------------------------- interp


def _perf_seconds(perf: str, data: str, rate: int) -> tuple[float, float]:
    """CPU seconds in a ``perf record -F rate`` file: all samples, and those in the interpreter
    (``libpython*`` or a ``python3*`` executable)."""
    out = subprocess.run([perf, "report", "-i", data, "--stdio", "--sort", "dso", "-q", "-n"],
                         capture_output=True, text=True, check=False).stdout
    rows = [ln.split() for ln in out.splitlines() if len(ln.split()) >= 3 and ln.split()[1].isdigit()]
    total = sum(int(r[1]) for r in rows)
    py = sum(int(r[1]) for r in rows if "libpython" in r[-1] or r[-1].startswith("python3"))
    return total / rate, py / rate


def interp(args, path: str) -> dict:
    """CPU seconds per GB spent in the interpreter itself, per side, of ``--gil-runs`` cold pushes:
    ``perf record -F 2000`` of the server (attached) and of the client (wrapped), samples in
    ``libpython`` counted (``perf report --sort dso``). A floor under the GIL-held time that a
    descheduled GIL holder does not inflate (py-spy's figure does, on a busy machine); C code
    that runs with the GIL held (msgpack, the ``mmap`` module) is not in it. The client's includes
    its start-up (imports: ~0.07 s a run)."""
    perf = shutil.which("perf")
    if perf is None:
        return {"error": "perf not installed (linux-perf)"}
    size = os.path.getsize(path)
    rate = 2000
    log_dir = tempfile.mkdtemp(prefix="interp-", dir=args.workdir)
    cmd, env = bs.find_tb5sync(args.tb5sync_cmd)
    tool = bs.Tb5sync(cmd, env, None, args.streams, 600.0, log_dir)
    runs: dict[str, list[tuple[float, float]]] = {"client": [], "server": []}
    try:
        for i in range(args.gil_runs):
            root = os.path.join(args.workdir, "runs", f"interp-{i}")
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(os.path.join(root, "dst"))
            bs.clear_state(os.path.dirname(path))
            srv_data, cli_data = os.path.join(log_dir, f"srv-{i}.data"), os.path.join(log_dir, f"cli-{i}.data")
            with tool.serve(root) as srv:
                rec = subprocess.Popen([perf, "record", "-F", str(rate), "-o", srv_data, "-p", str(srv.proc.p.pid)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(0.5)  # attached
                sync = cmd + ["sync", path, tool.remote(srv, "dst/")]
                if args.streams:
                    sync += ["--streams", str(args.streams)]
                res = bs.run_measured([perf, "record", "-F", str(rate), "-o", cli_data, "--", *sync], 600, env=env)
                bs.check(res, "perf record -- tb5sync sync", 600)
                rec.send_signal(signal.SIGINT)
                rec.wait(timeout=60)
            shutil.rmtree(root, ignore_errors=True)
            for side, data in (("client", cli_data), ("server", srv_data)):
                runs[side].append(_perf_seconds(perf, data, rate))
            print(f"  interp run {i}: client {runs['client'][-1][1] / size * GB:.3f}, server "
                  f"{runs['server'][-1][1] / size * GB:.3f} interpreter CPU s/GB", file=sys.stderr)
    finally:
        for proc in list(bs.LIVE):
            proc.stop(timeout=3)
        shutil.rmtree(log_dir, ignore_errors=True)
    return {side: {"interp_s_per_gb": statistics.median(py for _t, py in v) / size * GB,
                   "sampled_s_per_gb": statistics.median(t for t, _py in v) / size * GB,
                   "interp_runs_s_per_gb": [py / size * GB for _t, py in v]} for side, v in runs.items()}


def print_interp(res: dict) -> None:
    if "error" in res:
        print(f"\nInterpreter CPU: {res['error']}")
        return
    print("\nInterpreter CPU per GB (perf record -F 2000, samples in libpython; median)\n")
    print(f"{'side':8} {'interpreter s/GB':>17} {'all sampled s/GB':>17}   each run")
    for side in ("client", "server"):
        d = res[side]
        runs = ", ".join(f"{x:.3f}" for x in d["interp_runs_s_per_gb"])
        print(f"{side:8} {d['interp_s_per_gb']:17.3f} {d['sampled_s_per_gb']:17.2f}   {runs}")
    print("  (the client's includes its start-up, ~0.07 s a run)")


# --------------------------------------------------------------------------- procs


def ensure_halves(workdir: str, size: int) -> str:
    """WORKDIR/data-halves-SIZE/{a/h.bin, b/h.bin}: two files of ``size // 2`` random bytes."""
    d = os.path.join(workdir, f"data-halves-{size}")
    rs = bs.RandomStream(b"bench_cpu halves")
    for part in ("a", "b"):
        path = os.path.join(d, part, "h.bin")
        if not (os.path.exists(path) and os.path.getsize(path) == size // 2):
            bs.make_big(path, size // 2, rs)
    return d


def procs(args) -> dict:
    """The same bytes (two files of half the size) moved by one client and one server process
    (one session, ``--streams`` streams), against two client/server pairs each moving one half
    on its own streams at the same time: total CPU s/GB of all processes and wall time."""
    src = ensure_halves(args.workdir, args.size)
    size = 2 * (args.size // 2)
    log_dir = tempfile.mkdtemp(prefix="procs-", dir=args.workdir)
    token_file = os.path.join(log_dir, "token")
    with open(os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(os.urandom(24).hex() + "\n")
    cmd, env = bs.find_tb5sync(args.tb5sync_cmd)
    verifier = bs.Verifier(sample=10)
    out: dict = {"one": [], "two": []}
    try:
        for i in range(args.repeat):
            for mode in ("one", "two"):
                root = os.path.join(args.workdir, "runs", f"procs-{mode}-{i}")
                shutil.rmtree(root, ignore_errors=True)
                os.makedirs(os.path.join(root, "dst"))
                os.sync()
                for part in ("a", "b"):
                    bs.clear_state(os.path.join(src, part))
                bs.clear_state(src)
                if mode == "one":
                    tool = bs.Tb5sync(cmd, env, token_file, args.streams, 600.0, log_dir)
                    with tool.serve(root) as srv:
                        run = tool.sync(src + "/", tool.remote(srv, "dst"))
                    cpu, wall = run.cpu_client + srv.cpu, run.wall
                else:
                    # each half streams the default count divided by two (at least 2)
                    half = max(2, (args.streams or 4) // 2)
                    tools = [bs.Tb5sync(cmd, env, token_file, half, 600.0, log_dir) for _ in range(2)]
                    servers = [t.serve(root) for t in tools]
                    runs: list = [None, None]
                    for s_ in servers:
                        s_.__enter__()
                    try:
                        def go(k: int) -> None:
                            part = "ab"[k]
                            runs[k] = tools[k].sync(os.path.join(src, part), tools[k].remote(servers[k], "dst"))
                        ths = [threading.Thread(target=go, args=(k,)) for k in range(2)]
                        t0 = time.perf_counter()
                        for t in ths:
                            t.start()
                        for t in ths:
                            t.join()
                        wall = time.perf_counter() - t0
                    finally:
                        for s_ in servers:
                            s_.__exit__(None, None, None)
                    if any(r is None for r in runs):
                        raise SystemExit("a half's push failed")
                    cpu = sum(r.cpu_client for r in runs) + sum(s_.cpu for s_ in servers)
                bad = verifier.verify(src, os.path.join(root, "dst"), f"procs-{mode}-{i}")
                if bad:
                    raise SystemExit(f"procs {mode} run {i}: {bad}")
                shutil.rmtree(root, ignore_errors=True)
                out[mode].append((cpu / size * GB, wall))
                print(f"  procs {mode} run {i}: {cpu / size * GB:.2f} CPU s/GB, wall {wall:.2f} s", file=sys.stderr)
    finally:
        for proc in list(bs.LIVE):
            proc.stop(timeout=3)
        shutil.rmtree(log_dir, ignore_errors=True)
    return {m: {"cpu_per_gb": statistics.median(c for c, _ in v), "wall": statistics.median(w for _, w in v),
                "gbps": size * 8 / 1e9 / statistics.median(w for _, w in v)} for m, v in out.items()}


def print_procs(res: dict, size: int) -> None:
    print(f"\nOne process per side against two (each one half of {size / MiB:.0f} MiB, its own streams; median)\n")
    print(f"{'processes per side':20} {'CPU s/GB (all)':>15} {'wall s':>8} {'Gbit/s':>8}")
    for m, label in (("one", "1"), ("two", "2")):
        r = res[m]
        print(f"{label:20} {r['cpu_per_gb']:15.2f} {r['wall']:8.2f} {r['gbps']:8.2f}")


def print_model(result: dict) -> None:
    """Cores and processes per side for 10 GB/s (80 Gbit/s) at this machine's measured costs."""
    print("\nAt 80 Gbit/s (10 GB/s of file data), from the figures above (GIL without fixed work)\n")
    print(f"{'side':8} {'CPU s/GB':>9} {'cores':>6} {'GIL s/GB':>9} {'GIL-bound GB/s/process':>23} {'processes (GIL <= 70% busy)':>28}")
    for side in ("client", "server"):
        cpu = result["e2e"]["tb5sync"][side]
        g = result["gil"][side]["gil_steady_s_per_gb"]
        print(f"{side:8} {cpu:9.2f} {cpu * 10:6.1f} {g:9.3f} {1 / g:23.1f} {-(-g * 10 // 0.7):28.0f}")


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=GiB, help="file size (default 1G)")
    p.add_argument("--repeat", type=int, default=3, help="runs per tool (median; default 3)")
    p.add_argument("--parts", default="e2e,medium,stages,gil,interp,procs",
                   help="comma-separated: e2e, medium, stages, gil, interp, procs")
    p.add_argument("--medium-files", type=int, default=64, help="files of 6 MiB in the medium workload (default 64)")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "tb5sync-bench-cpu"))
    p.add_argument("--streams", type=int, help="tb5sync sync --streams N")
    p.add_argument("--tb5sync-cmd", help="command to run tb5sync (default: beside this python)")
    p.add_argument("--gil-rate", type=int, default=250, help="py-spy samples per second in the gil part (default 250)")
    p.add_argument("--gil-runs", type=int, default=3, help="sampled pushes in the gil part (median; default 3)")
    p.add_argument("--json-out", help="write the figures as JSON here too")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.workdir = os.path.abspath(args.workdir)
    os.makedirs(args.workdir, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda s, f: (_ for _ in ()).throw(SystemExit(143)))
    parts = args.parts.split(",")
    path = ensure_file(args.workdir, args.size)
    result: dict = {"size": args.size, "cpus": os.cpu_count()}
    if "e2e" in parts:
        result["e2e"] = e2e(args, os.path.dirname(path))
        print_e2e(result["e2e"], f"one file of {args.size / MiB:.0f} MiB of random bytes")
    if "medium" in parts:
        result["medium"] = e2e(args, ensure_medium(args.workdir, args.medium_files))
        print_e2e(result["medium"], f"{args.medium_files} files of 6 MiB of random bytes (each a large-file job)")
    if "stages" in parts:
        result["stages"] = stages(args, path)
        print_stages(result["stages"])
    if "gil" in parts:
        result["gil"] = gil(args, path)
        print_gil(result["gil"])
    if "interp" in parts:
        result["interp"] = interp(args, path)
        print_interp(result["interp"])
    if "e2e" in parts and "gil" in parts and "error" not in result["gil"]:
        print_model(result)
    if "procs" in parts:
        result["procs"] = procs(args)
        print_procs(result["procs"], args.size)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
