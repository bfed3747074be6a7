#!/usr/bin/env python3
"""Benchmark the artifact store (``tb5sync store``) against cp -a, tar, rsync and the sync engine, in one run.

What it measures (every tool through its command line, wall time of the whole command, median
of ``--repeat`` runs, tools alternating; page cache not dropped):

1. **put** (a snapshot into storage): ``tb5sync store put`` into a fresh store, against
   ``cp -a SRC DST``, ``tar cf DST.tar -C SRC .`` and the sync engine's ``tb5sync sync SRC/ DST``
   (local, fresh destination). GB/s and files/s.
2. **get** (the snapshot back out): ``tb5sync store get`` into a fresh directory, against
   ``cp -a`` from the copy, ``tar xf`` of the tar, and ``tb5sync sync`` from the copy.
3. **N versions**: the models tree and N-1 edited versions of it (each rewrites 1% of the largest
   file at a new place and adds a file). Disk bytes after storing all N: the store's packs,
   N ``cp -a`` copies, N tars, and ``rsync -a --link-dest=<previous>`` snapshots (unchanged files
   hard-linked: the usual rsync snapshot scheme; ``du`` counts a hard link once).
4. **between nodes**: ``tb5sync store push`` of version 1 to ``tb5sync serve --store`` on 127.0.0.1
   (cold), then of version 2 (only its new chunks), and ``store pull`` of both into a fresh store;
   against ``rsync -a`` to an ``rsync --daemon`` on 127.0.0.1 (cold, then version 2 over version 1:
   rsync's delta), and the sync engine's ``tb5sync sync`` push to ``tb5sync serve``.

5. **peers** (``--peers``, or alone with ``--peers-only``): the issue-25 workload: the models tree plus
   three stdlib packages (json, email, asyncio) as 5 versions, each later version rewriting 8
   random 80 KB ranges of every model file (~1%, scattered); each tool into its own empty repository,
   no encryption where the tool allows it: ``tb5sync store`` as format v1 (``TB5SYNC_STORE_FORMAT=1``:
   the store before pieces) and format v2, ``restic`` (0.14: always encrypted, ``--compression off``
   where supported), ``borg`` (``-e none``, ``--compression none``), ``casync`` (64 KiB chunks, its
   default compression). Per tool: put of v1 (s, CPU s, peak RSS), median put of a later version,
   repository growth per version (% of the repository after v1), restore of v5 (s, CPU s), and
   ``cp -a`` of v5 on the same disk. A peer whose Debian package is missing is skipped with a line
   naming it (``apt-get install -y restic borgbackup casync``). Per tb5sync format also ``store push``
   and ``store pull`` of each later version over loopback: wire bytes against the bytes new to the
   receiving store (format v2 also with ``TB5SYNC_STORE_PIECES=0``: whole chunks, as before pieces
   travelled). ``--short`` (CI, ``make bench-short``): section 5 only, on a generated 24 MiB
   tree and 3 versions, ~15 s.

Data: the stdlib tree (site-packages left out) and ``$TB5SYNC_CORPUS/models`` (or ``.corpus/models``,
``make corpus``); without the corpus a generated 256 MiB "model" directory stands in.
Output: a table on stdout and JSON in ``benches/results/bench-store-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
PY = sys.executable
TB5 = [PY, "-m", "tb5sync.cli"]


def run(cmd: list[str], **kw: Any) -> tuple[float, str]:
    t0 = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)
    return time.perf_counter() - t0, out.stdout


def du(path: str) -> int:
    """Disk bytes under ``path`` (hard links once), as ``du -sb`` (apparent sizes)."""
    out = subprocess.run(["du", "-sb", path], check=True, capture_output=True, text=True).stdout
    return int(out.split()[0])


def tree_size(path: str) -> tuple[int, int]:
    files = size = 0
    for d, _, ns in os.walk(path):
        for n in ns:
            p = os.path.join(d, n)
            if os.path.isfile(p) and not os.path.islink(p):
                files += 1
                size += os.path.getsize(p)
    return files, size


def stored(store: str) -> int:
    """Bytes of pack files in store directory ``store`` (``store stats``' stored_bytes), 0 before it exists."""
    if not os.path.isfile(os.path.join(store, "config")):
        return 0
    return int(json.loads(run([*TB5, "store", "--store", store, "stats", "--json"])[1])["stored_bytes"])


def fresh(path: str) -> str:
    shutil.rmtree(path, ignore_errors=True)
    return path


def make_versions(models: str, work: str, n: int) -> list[str]:
    """``models`` and ``n - 1`` edited versions (hard links except the edited file)."""
    out = [models]
    files = [os.path.join(d, f) for d, _, fs in os.walk(models) for f in fs]
    big = max(files, key=os.path.getsize)
    rnd = random.Random(7)
    prev = models
    for k in range(1, n):
        v = os.path.join(work, f"models-v{k + 1}")
        if not os.path.isdir(v):
            for d, _, fs in os.walk(prev):
                for f in fs:
                    src = os.path.join(d, f)
                    dst = os.path.join(v, os.path.relpath(src, prev))
                    os.makedirs(os.path.dirname(dst), exist_ok=True)
                    if os.path.relpath(src, prev) == os.path.relpath(big, models):
                        shutil.copy2(src, dst)
                        size = os.path.getsize(dst)
                        with open(dst, "r+b") as fh:
                            fh.seek(rnd.randrange(0, size - size // 100))
                            fh.write(rnd.randbytes(size // 100))
                    else:
                        os.link(src, dst)
            with open(os.path.join(v, f"CHANGES-{k + 1}"), "w") as fh:
                fh.write(f"version {k + 1}\n")
        out.append(v)
        prev = v
    return out


def start(cmd: list[str], pattern: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], int]:
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    assert p.stderr is not None
    m = re.search(pattern, p.stderr.readline())
    if not m:
        p.kill()
        raise SystemExit(f"{cmd[0]} did not start")
    return p, int(m.group(1))


def stop(p: subprocess.Popen[str]) -> None:
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    if p.stderr is not None:
        p.stderr.close()


def rsync_daemon(work: str, root: str) -> tuple[subprocess.Popen[bytes], int]:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    conf = os.path.join(work, "rsyncd.conf")
    with open(conf, "w") as f:
        f.write(f"use chroot = no\nport = {port}\naddress = 127.0.0.1\npid file = {work}/rsyncd.pid\n"
                f"[root]\npath = {root}\nread only = no\nuid = {os.getuid()}\ngid = {os.getgid()}\n")
    p = subprocess.Popen(["rsync", "--daemon", "--no-detach", f"--config={conf}"])
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    return p, port


def timed(cmd: list[str], cwd: str | None = None, env: dict[str, str] | None = None) -> dict[str, float]:
    """Run ``cmd``; wall s, CPU s (user + system of the child and its children) and peak RSS (MiB) of the child."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    assert p.stderr is not None
    err = p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"{cmd[0]} failed ({p.returncode}): {err.decode(errors='replace')[-2000:]}")
    return {"s": wall, "cpu": ru.ru_utime + ru.ru_stime, "rss": ru.ru_maxrss / 1024}


def make_peer_versions(models: str, work: str, n: int) -> list[str]:
    """The issue-25 workload: models + three stdlib packages as ``n`` versions; each later version
    rewrites 8 random 80 KB ranges of every model file (files over 1 MB), the rest hard-linked."""
    base = os.path.join(work, "peers-v1")
    if not os.path.isdir(base):
        shutil.copytree(models, os.path.join(base, "models"))
        lib = sysconfig.get_paths()["stdlib"]
        for pkg in ("json", "email", "asyncio"):
            shutil.copytree(os.path.join(lib, pkg), os.path.join(base, "lib", pkg),
                            ignore=shutil.ignore_patterns("__pycache__"))
    out = [base]
    rnd = random.Random(25)
    for k in range(2, n + 1):
        v = os.path.join(work, f"peers-v{k}")
        if not os.path.isdir(v):
            prev = out[-1]
            for d, _, fs in os.walk(prev):
                for f in fs:
                    src = os.path.join(d, f)
                    dst = os.path.join(v, os.path.relpath(src, prev))
                    os.makedirs(os.path.dirname(dst), exist_ok=True)
                    size = os.path.getsize(src)
                    if os.path.relpath(src, prev).startswith("models") and size > 1_000_000:
                        shutil.copy2(src, dst)
                        with open(dst, "r+b") as fh:
                            for _ in range(8):
                                fh.seek(rnd.randrange(0, size - 80_000))
                                fh.write(rnd.randbytes(80_000))
                    else:
                        os.link(src, dst)
        out.append(v)
    return out


def peers(work: str, models: str, n: int) -> dict[str, Any]:
    """Section 5: every tool over the same versions, each into its own empty repository."""
    versions = make_peer_versions(models, work, n)
    size1 = tree_size(versions[0])[1]
    pw = {"RESTIC_PASSWORD": "bench", "RESTIC_CACHE_DIR": os.path.join(work, "restic-cache"),
          "BORG_UNKNOWN_UNENCRYPTED_REPO_ACCESS_IS_OK": "yes", "BORG_BASE_DIR": os.path.join(work, "borg-base"),
          "BORG_RELOCATED_REPO_ACCESS_IS_OK": "yes"}

    def tb5(fmt: str) -> dict[str, Any]:
        env = {"TB5SYNC_STORE_FORMAT": fmt}
        return {"env": env,
                "init": None,
                "put": lambda r, k, v: ([*TB5, "store", "--store", r, "put", f"m/v{k}", v], None),
                "get": lambda r, k, o: ([*TB5, "store", "--store", r, "get", f"m/v{k}", o], None)}

    tools: dict[str, Any] = {"tb5sync store (format v1: before)": tb5("1"), "tb5sync store (format v2: after)": tb5("2")}
    skipped: list[tuple[str, str]] = []  # (command, Debian package) of the peers not installed
    if shutil.which("restic"):
        ver = subprocess.run(["restic", "version"], capture_output=True, text=True).stdout
        m = re.search(r"restic (\d+)\.(\d+)", ver)
        comp = ["--compression", "off"] if m and (int(m.group(1)), int(m.group(2))) >= (0, 14) else []
        tools[f"restic {m.group(1)}.{m.group(2) if m else '?'}"] = {
            "env": pw, "init": lambda r: ["restic", "-r", r, "init", *(["--repository-version", "2"] if comp else [])],
            "put": lambda r, k, v: (["restic", "-r", r, "backup", "--host", "bench", *comp, "."], v),
            "get": lambda r, k, o: (["restic", "-r", r, "restore", "latest", "--target", o], None)}
    else:
        skipped.append(("restic", "restic"))
    if shutil.which("borg"):
        tools["borg (no compression)"] = {
            "env": pw, "init": lambda r: ["borg", "init", "-e", "none", r],
            "put": lambda r, k, v: (["borg", "create", "--compression", "none", f"{r}::v{k}", "."], v),
            "get": lambda r, k, o: (["borg", "extract", f"{r}::v{k}"], o)}
    else:
        skipped.append(("borg", "borgbackup"))
    if shutil.which("casync"):
        tools["casync (64 KiB chunks)"] = {
            "env": {}, "init": None,
            "put": lambda r, k, v: (["casync", "make", f"--store={r}/default.castr", f"{r}/v{k}.caidx", v], None),
            "get": lambda r, k, o: (["casync", "extract", f"--store={r}/default.castr", f"{r}/v{k}.caidx", o], None)}
    else:
        skipped.append(("casync", "casync"))
    out: dict[str, Any] = {"v1 bytes": size1, "versions": n, "tools": {},
                           "skipped": {c: f"{c} not installed (apt-get install -y {p})" for c, p in skipped}}
    for name, t in tools.items():
        repo = fresh(os.path.join(work, "peer-repo"))
        if t["init"] is not None:
            timed(t["init"](repo), env=t["env"])
        else:
            os.makedirs(repo)
        sizes, puts = [], []
        for k, v in enumerate(versions, 1):
            cmd, cwd = t["put"](repo, k, v)
            puts.append(timed(cmd, cwd=cwd, env=t["env"]))
            sizes.append(du(repo))
        dest = fresh(os.path.join(work, "peer-out"))
        cmd, cwd = t["get"](repo, n, dest)
        if cwd is not None:
            os.makedirs(cwd)
        got = timed(cmd, cwd=cwd, env=t["env"])
        later = puts[1:]
        nodes = tb5_nodes(work, repo, n, t["env"]) if name.startswith("tb5sync") else {}
        if t["env"].get("TB5SYNC_STORE_FORMAT") == "2":  # the same stores, whole chunks on the wire (before)
            whole = tb5_nodes(work, repo, n, {**t["env"], "TB5SYNC_STORE_PIECES": "0"})
            nodes.update({f"whole chunks: {k}": v for k, v in whole.items()})
        out["tools"][name] = {**nodes,
            "put v1 s": puts[0]["s"], "put v1 cpu s": puts[0]["cpu"], "put v1 peak rss MiB": puts[0]["rss"],
            "put later s": med([p["s"] for p in later]), "put later cpu s": med([p["cpu"] for p in later]),
            "put later peak rss MiB": max((p["rss"] for p in later), default=0),
            "repo after v1 bytes": sizes[0],
            "growth per version %": 100 * (sizes[-1] - sizes[0]) / max(1, n - 1) / sizes[0],
            "restore s": got["s"], "restore cpu s": got["cpu"]}
        shutil.rmtree(repo, ignore_errors=True)
        shutil.rmtree(dest, ignore_errors=True)
    dest = fresh(os.path.join(work, "peer-out"))
    cp = timed(["cp", "-a", versions[-1], dest])
    shutil.rmtree(dest, ignore_errors=True)
    out["cp -a of v5 s"] = cp["s"]
    return out


def tb5_nodes(work: str, repo: str, n: int, env: dict[str, str]) -> dict[str, Any]:
    """``store push`` of every version of store ``repo`` to a ``tb5sync serve --store`` on 127.0.0.1,
    then ``store pull`` of each into a fresh store (both of the format ``env`` asks for): per later
    version the wire bytes of the command (``wire_bytes``: frames, both ways) over the bytes new to
    the receiving store (its ``stored_bytes`` growth); medians over versions 2..n."""
    rb = fresh(os.path.join(work, "peer-remote-store"))
    root = fresh(os.path.join(work, "peer-remote-root"))
    os.makedirs(root)
    envx = {**os.environ, **env}
    ratios: dict[str, list[float]] = {"push": [], "pull": []}
    wires: dict[str, list[int]] = {"push": [], "pull": []}
    srv, port = start([*TB5, "serve", root, "--bind", "127.0.0.1:0", "--store", rb], r":(\d+)\s*$", env)
    try:
        url = f"tb5://127.0.0.1:{port}"
        sc = fresh(os.path.join(work, "peer-pull-store"))
        for what, st, cmd in (("push", rb, "push"), ("pull", sc, "pull")):
            for k in range(1, n + 1):
                before = stored(st)
                here = repo if what == "push" else sc
                out = run([*TB5, "store", "--store", here, cmd, f"m/v{k}", url, "--json"], env=envx)[1]
                if k > 1:
                    wire = json.loads(out)["wire_bytes"]
                    wires[what].append(wire)
                    ratios[what].append(wire / max(1, stored(st) - before))
    finally:
        stop(srv)
        for q in (rb, root, os.path.join(work, "peer-pull-store")):
            shutil.rmtree(q, ignore_errors=True)
    return {"push later wire MB": med(wires["push"]) / 1e6, "push later wire / new": med(ratios["push"]),
            "pull later wire MB": med(wires["pull"]) / 1e6, "pull later wire / new": med(ratios["pull"])}


def scaling(work: str, models: str, scales: list[int]) -> dict[str, Any]:
    """Section 6: ``store gc`` and ``store verify`` of one store holding 1x, 4x, 16x ... the models
    tree: copy k is the tree with every byte XORed with k (as new to the store as the first), each
    put as its own ref; at each scale gc (mark every ref, sweep; nothing to free) and verify (every
    frame re-hashed), wall s, CPU s and peak RSS, and the same per GB stored."""
    st = fresh(os.path.join(work, "scale-store"))
    files = [os.path.join(d, f) for d, _, fs in os.walk(models) for f in fs]
    out: dict[str, Any] = {"unit bytes": tree_size(models)[1], "points": []}
    k = 0
    for scale in sorted(scales):
        while k < scale:
            k += 1
            src = fresh(os.path.join(work, "scale-src"))
            table = bytes((b ^ (k % 256)) for b in range(256))
            for f in files:
                dst = os.path.join(src, os.path.relpath(f, models))
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                with open(f, "rb") as fi, open(dst, "wb") as fo:  # in 16 MiB blocks: the bench stays small, so
                    while block := fi.read(16 << 20):  # the peak RSS its children report is theirs
                        fo.write(block.translate(table))
            run([*TB5, "store", "--store", st, "put", f"copy/{k}", src])
            shutil.rmtree(src, ignore_errors=True)
        size = stored(st)
        g = timed([*TB5, "store", "--store", st, "gc"])
        v = timed([*TB5, "store", "--store", st, "verify"])
        out["points"].append({"scale": scale, "stored bytes": size, "gc s": g["s"], "gc cpu s": g["cpu"],
                              "gc peak rss MiB": g["rss"], "verify s": v["s"], "verify cpu s": v["cpu"],
                              "verify peak rss MiB": v["rss"], "gc cpu s per GB": g["cpu"] / (size / 1e9),
                              "verify cpu s per GB": v["cpu"] / (size / 1e9)})
    shutil.rmtree(st, ignore_errors=True)
    return out


def print_scaling(sc: dict[str, Any]) -> None:
    print(f"\nscaling: one store holding N distinct copies of the models tree ({sc['unit bytes'] / 1e6:.0f} MB each)")
    print(f"  {'N':>3} {'stored GB':>9} {'gc s':>6} {'(cpu)':>6} {'RSS':>5} {'cpu s/GB':>8} "
          f"{'verify s':>8} {'(cpu)':>6} {'RSS':>5} {'cpu s/GB':>8}")
    for p in sc["points"]:
        print(f"  {p['scale']:>3} {p['stored bytes'] / 1e9:>9.2f} {p['gc s']:>6.2f} {p['gc cpu s']:>6.2f} "
              f"{p['gc peak rss MiB']:>5.0f} {p['gc cpu s per GB']:>8.3f} {p['verify s']:>8.2f} "
              f"{p['verify cpu s']:>6.2f} {p['verify peak rss MiB']:>5.0f} {p['verify cpu s per GB']:>8.3f}")


def print_peers(p: dict[str, Any]) -> None:
    print(f"\npeers: {p['versions']} versions, v1 = {p['v1 bytes'] / 1e6:.0f} MB; each later version rewrites 8 random "
          "80 KB ranges of every model file")
    print(f"  {'tool':<36} {'put v1 s':>8} {'(cpu)':>6} {'RSS MiB':>7} {'put later s':>11} {'(cpu)':>6} "
          f"{'growth/version %':>16} {'restore s':>9} {'(cpu)':>6}")
    for name, r in p["tools"].items():
        print(f"  {name:<36} {r['put v1 s']:>8.2f} {r['put v1 cpu s']:>6.2f} {r['put v1 peak rss MiB']:>7.0f} "
              f"{r['put later s']:>11.2f} {r['put later cpu s']:>6.2f} {r['growth per version %']:>16.2f} "
              f"{r['restore s']:>9.2f} {r['restore cpu s']:>6.2f}")
    for name, why in p.get("skipped", {}).items():
        print(f"  {name:<36} skipped: {why}")
    print(f"  cp -a of v{p['versions']}: {p['cp -a of v5 s']:.2f} s")
    for name, r in p["tools"].items():
        if "push later wire / new" in r:
            print(f"  {name}: store push of a later version: {r['push later wire MB']:.2f} MB on the wire, "
                  f"{r['push later wire / new']:.2f}x the bytes new to the receiving store; pull "
                  f"{r['pull later wire MB']:.2f} MB, {r['pull later wire / new']:.2f}x")
        if "whole chunks: push later wire / new" in r:
            print(f"  {name}, whole chunks on the wire (TB5SYNC_STORE_PIECES=0: before): push "
                  f"{r['whole chunks: push later wire MB']:.2f} MB, {r['whole chunks: push later wire / new']:.2f}x; "
                  f"pull {r['whole chunks: pull later wire MB']:.2f} MB, {r['whole chunks: pull later wire / new']:.2f}x")


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument("--workdir", help="scratch directory (default /tmp/tb5sync-bench-store, -short with --short)")
    ap.add_argument("--json-out")
    ap.add_argument("--peers", action="store_true", help="also run section 5 (restic, borg, casync)")
    ap.add_argument("--peers-only", action="store_true", help="run only section 5")
    ap.add_argument("--short", action="store_true",
                    help="section 5 only, on a generated 24 MiB 'model' tree and 3 versions (CI: well under a minute)")
    ap.add_argument("--scaling", metavar="N,N,...", help="only section 6: gc and verify of a store holding N "
                    "distinct copies of the models tree (the issue's figure: 1,4,16)")
    a = ap.parse_args()
    if a.short:
        a.peers_only, a.versions = True, min(a.versions, 3)
    work = a.workdir or ("/tmp/tb5sync-bench-store-short" if a.short else "/tmp/tb5sync-bench-store")
    os.makedirs(work, exist_ok=True)
    corpus = os.environ.get("TB5SYNC_CORPUS") or os.path.join(HERE, "..", ".corpus")
    models = os.path.abspath(os.path.join(corpus, "models"))
    if a.short:  # generated, so CI's short run needs no corpus: two weight files of random bytes
        models = os.path.join(work, "short-models")
        if not os.path.isdir(models):
            os.makedirs(models)
            rnd = random.Random(2)
            for name, size in (("model.safetensors", 16 << 20), ("adapter.bin", 8 << 20)):
                with open(os.path.join(models, name), "wb") as f:
                    f.write(rnd.randbytes(size))
    elif not os.path.isdir(models):
        models = os.path.join(work, "gen-models")
        if not os.path.isdir(models):
            os.makedirs(models)
            with open(os.path.join(models, "weights.bin"), "wb") as f:
                f.write(random.Random(1).randbytes(256 * 1024 * 1024))
    if a.scaling:
        sc = scaling(work, models, [int(x) for x in a.scaling.split(",")])
        print_scaling(sc)
        out = a.json_out or os.path.join(HERE, "results", f"bench-store-scaling-{time.strftime('%Y%m%d-%H%M%S')}.json")
        with open(out, "w") as f:
            json.dump({"scaling": sc}, f, indent=1)
        print(f"\nJSON: {out}")
        return 0
    if a.peers_only:
        p = peers(work, models, a.versions)
        print_peers(p)
        out = a.json_out or os.path.join(HERE, "results", f"bench-store-peers-{time.strftime('%Y%m%d-%H%M%S')}.json")
        with open(out, "w") as f:
            json.dump({"peers": p}, f, indent=1)
        print(f"\nJSON: {out}")
        return 0
    stdlib_src = sysconfig.get_paths()["stdlib"]
    stdlib = os.path.join(work, "stdlib")  # a copy without site-packages, so every tool sees the same tree
    if not os.path.isdir(stdlib):
        subprocess.run(["rsync", "-a", "--exclude=site-packages/", "--exclude=dist-packages/", stdlib_src + "/", stdlib + "/"],
                       check=True)
    datasets = {"stdlib": stdlib, "models": models}
    res: dict[str, Any] = {"repeat": a.repeat, "datasets": {}, "put": {}, "get": {}, "versions": {}, "nodes": {}}
    for name, path in datasets.items():
        res["datasets"][name] = dict(zip(("files", "bytes"), tree_size(path)))

    # 1 and 2: put and get
    for name, path in datasets.items():
        files, size = tree_size(path)
        t: dict[str, list[float]] = {k: [] for k in ("store put", "cp -a", "tar c", "tb5sync sync")}
        g: dict[str, list[float]] = {k: [] for k in ("store get", "cp -a", "tar x", "tb5sync sync")}
        for _ in range(a.repeat):
            st = fresh(os.path.join(work, "st"))
            t["store put"].append(run([*TB5, "store", "--store", st, "put", "x/1", path])[0])
            t["cp -a"].append(run(["cp", "-a", path, fresh(os.path.join(work, "cp"))])[0])
            tar = os.path.join(work, "t.tar")
            t["tar c"].append(run(["tar", "cf", tar, "-C", path, "."])[0])
            t["tb5sync sync"].append(run([*TB5, "sync", path + "/", fresh(os.path.join(work, "sy"))])[0])
            g["store get"].append(run([*TB5, "store", "--store", st, "get", "x/1", fresh(os.path.join(work, "out"))])[0])
            g["cp -a"].append(run(["cp", "-a", os.path.join(work, "cp"), fresh(os.path.join(work, "cp2"))])[0])
            os.makedirs(fresh(os.path.join(work, "tx")))
            g["tar x"].append(run(["tar", "xf", tar, "-C", os.path.join(work, "tx")])[0])
            g["tb5sync sync"].append(run([*TB5, "sync", os.path.join(work, "cp") + "/", fresh(os.path.join(work, "sy2"))])[0])
        for key, src in (("put", t), ("get", g)):
            res[key][name] = {tool: {"seconds": med(v), "GB/s": size / med(v) / 1e9, "files/s": files / med(v)}
                              for tool, v in src.items()}
    for p in ("st", "cp", "cp2", "t.tar", "sy", "sy2", "out", "tx"):
        q = os.path.join(work, p)
        shutil.rmtree(q, ignore_errors=True) if os.path.isdir(q) else (os.path.exists(q) and os.unlink(q))

    # 3: N versions
    versions = make_versions(models, work, a.versions)
    logical = sum(tree_size(v)[1] for v in versions)
    st = fresh(os.path.join(work, "stN"))
    for k, v in enumerate(versions):
        run([*TB5, "store", "--store", st, "put", f"models/v{k + 1}", v])
    stats = json.loads(run([*TB5, "store", "--store", st, "stats", "--json"])[1])
    tars = 0
    for v in versions:
        tar = os.path.join(work, "v.tar")
        run(["tar", "cf", tar, "-C", v, "."])
        tars += os.path.getsize(tar)
        os.unlink(tar)
    snaps = fresh(os.path.join(work, "snaps"))
    os.makedirs(snaps)
    for k, v in enumerate(versions):
        cmd = ["rsync", "-a", v + "/", os.path.join(snaps, f"v{k + 1}") + "/"]
        if k:
            cmd.insert(2, f"--link-dest={os.path.join(snaps, f'v{k}')}")
        run(cmd)
    res["versions"] = {"n": len(versions), "logical bytes": logical, "store packs": du(os.path.join(st, "packs")),
                       "store total (index too)": du(st), "cp -a copies": logical, "tar files": tars,
                       "rsync --link-dest snapshots": du(snaps), "store dedup ratio": stats["dedup_ratio"]}
    shutil.rmtree(snaps, ignore_errors=True)

    # 4: between nodes, versions 1 and 2
    v1, v2 = versions[0], versions[1]
    size1 = tree_size(v1)[1]
    nodes: dict[str, list[float]] = {k: [] for k in ("store push v1", "store push v2", "store pull v1", "store pull v2",
                                                     "rsync v1", "rsync v2 over v1", "tb5sync sync v1", "tb5sync sync v2 over v1")}
    moved: dict[str, int] = {}
    # (wire bytes of the command, bytes new to the receiving store) per run: the issue-25 ratio
    wire: dict[str, list[tuple[int, int]]] = {k: [] for k in ("store push v1", "store push v2", "store pull v1",
                                                              "store pull v2")}
    for _ in range(a.repeat):
        rb = fresh(os.path.join(work, "remote-store"))
        root = fresh(os.path.join(work, "remote-root"))
        os.makedirs(root)
        srv, port = start([*TB5, "serve", root, "--bind", "127.0.0.1:0", "--store", rb], r":(\d+)\s*$")
        try:
            url = f"tb5://127.0.0.1:{port}"
            for k, v in ((1, v1), (2, v2)):
                before = stored(rb)
                dt, out = run([*TB5, "store", "--store", st, "push", f"models/v{k}", url, "--json"])
                nodes[f"store push v{k}"].append(dt)
                moved[f"store push v{k}"] = json.loads(out)["bytes_sent"]
                wire[f"store push v{k}"].append((json.loads(out)["wire_bytes"], stored(rb) - before))
            sc = fresh(os.path.join(work, "store-c"))
            for k in (1, 2):
                before = stored(sc)
                dt, out = run([*TB5, "store", "--store", sc, "pull", f"models/v{k}", url, "--json"])
                nodes[f"store pull v{k}"].append(dt)
                moved[f"store pull v{k}"] = json.loads(out)["bytes_fetched"]
                wire[f"store pull v{k}"].append((json.loads(out)["wire_bytes"], stored(sc) - before))
            nodes["tb5sync sync v1"].append(run([*TB5, "sync", v1 + "/", f"{url}/m/"])[0])
            nodes["tb5sync sync v2 over v1"].append(run([*TB5, "sync", v2 + "/", f"{url}/m/"])[0])
        finally:
            stop(srv)
        rroot = fresh(os.path.join(work, "rsync-root"))
        os.makedirs(rroot)
        rp, rport = rsync_daemon(work, rroot)
        try:
            dst = f"rsync://127.0.0.1:{rport}/root/m/"
            dt, out = run(["rsync", "-a", "--stats", v1 + "/", dst])
            nodes["rsync v1"].append(dt)
            dt, out = run(["rsync", "-a", "--stats", v2 + "/", dst])
            nodes["rsync v2 over v1"].append(dt)
            m = re.search(r"Total bytes sent: ([\d,]+)", out)
            moved["rsync v2 over v1"] = int(m.group(1).replace(",", "")) if m else -1
        finally:
            rp.send_signal(signal.SIGTERM)
            rp.wait(timeout=10)
        for p in (rb, root, rroot, os.path.join(work, "store-c")):
            shutil.rmtree(p, ignore_errors=True)
    res["nodes"] = {k: {"seconds": med(v), "GB/s": size1 / med(v) / 1e9, "bytes moved": moved.get(k)} for k, v in nodes.items()}
    for k, runs in wire.items():
        res["nodes"][k]["wire bytes"] = med([w for w, _ in runs])
        res["nodes"][k]["new bytes at the receiver"] = med([n for _, n in runs])
        res["nodes"][k]["wire / new"] = med([w / max(1, n) for w, n in runs])
    shutil.rmtree(st, ignore_errors=True)

    # the table
    print(f"datasets: " + ", ".join(f"{k} {v['files']} files {v['bytes'] / 1e6:.0f} MB" for k, v in res["datasets"].items()))
    for key in ("put", "get"):
        print(f"\n{key:<6} {'tool':<16} {'seconds':>8} {'GB/s':>7} {'files/s':>9}")
        for name, tools in res[key].items():
            for tool, r in tools.items():
                print(f"{name:<6} {tool:<16} {r['seconds']:>8.3f} {r['GB/s']:>7.2f} {r['files/s']:>9.0f}")
    v = res["versions"]
    print(f"\n{v['n']} versions of the models tree ({v['logical bytes'] / 1e6:.0f} MB logical): bytes on disk")
    for k in ("store packs", "store total (index too)", "cp -a copies", "tar files", "rsync --link-dest snapshots"):
        print(f"  {k:<28} {v[k] / 1e6:>9.1f} MB")
    print(f"  store dedup ratio {v['store dedup ratio']}")
    print(f"\nbetween nodes (loopback), models v1 = {size1 / 1e6:.0f} MB; v2 rewrites 1% of its largest file")
    print(f"  {'step':<26} {'seconds':>8} {'GB/s (v1 size)':>15} {'MB moved':>9}")
    for k, r in res["nodes"].items():
        mb = f"{r['bytes moved'] / 1e6:>9.1f}" if r["bytes moved"] is not None else f"{'':>9}"
        ratio = (f"  wire {r['wire bytes'] / 1e6:.2f} MB for {r['new bytes at the receiver'] / 1e6:.2f} MB new there "
                 f"({r['wire / new']:.2f}x)") if "wire bytes" in r else ""
        print(f"  {k:<26} {r['seconds']:>8.3f} {r['GB/s']:>15.2f} {mb}{ratio}")
    if a.peers:
        res["peers"] = peers(work, models, a.versions)
        print_peers(res["peers"])
    out = a.json_out or os.path.join(HERE, "results", f"bench-store-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
