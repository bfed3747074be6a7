"""Server CPU per large GET of the HTTP build cache (hits of 1.5-6 MB, as Bazel's big outputs), against nginx.

Each server in turn (alternating, ``--reps`` times): a fresh store, 24 blobs of 1.5-6 MB PUT at
``/cas/<sha256>``, each read once (the first read verifies), then ``--rounds`` GETs of every blob
on one keep-alive connection; the server's CPU (user + system, ``/proc/PID/stat``, master and
workers for nginx) over those GETs, divided by their number. Servers:

- ``tb5-v2``: ``tb5sync http-cache`` on a new store (format v2: chunks of 256 KiB or more kept as
  recipes of pieces; hits verified since their pieces' packs last changed go out as the pieces'
  ranges in one ``os.sendfile`` loop);
- ``tb5-v1``: on a format v1 store (chunks whole in frames: hits verified since their pack last
  changed go out with sendfile);
- ``tb5-v1-portable``: the same with ``TB5SYNC_CACHE_SENDFILE_PORTABLE=1`` (read and written through
  the transport, the path before sendfile);
- ``nginx``: WebDAV PUT/GET, the configuration of ``bench_httpcache.py``;
- with ``--base DIR`` (a copy of another version's ``tb5sync`` package, e.g. ``git archive`` of a
  commit plus the built extension modules), ``tb5-v2-base`` and ``tb5-v1-base``: that version, for
  a before/after in the same run.

    python benches/bench_bigget.py [--reps 3] [--rounds 10] [--only tb5-v1,nginx] [--base DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_httpcache import PY, NginxServer, free_port, proc_cpu, wait_port  # noqa: E402

KINDS = ("tb5-v2", "tb5-v1", "tb5-v1-portable", "nginx")
BASE = [""]


class Tb5(object):
    def __init__(self, work: str, kind: str) -> None:
        env = dict(os.environ)
        env["TB5SYNC_STORE_FORMAT"] = "2" if kind.startswith("tb5-v2") else "1"
        if kind.endswith("portable"):
            env["TB5SYNC_CACHE_SENDFILE_PORTABLE"] = "1"
        self.port = free_port()
        # an editable install's import hook comes before sys.path: dropped for a --base version
        run = (["-c", "import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); "
                "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in getattr(f, '__module__', '')]; "
                "runpy.run_module('tb5sync.cli', run_name='__main__')", BASE[0]]
               if kind.endswith("-base") else ["-m", "tb5sync.cli"])
        self.proc = subprocess.Popen([PY, *run, "http-cache", os.path.join(work, "store"),
                                      "--bind", f"127.0.0.1:{self.port}"], stderr=subprocess.DEVNULL, env=env)
        wait_port(self.port)

    def cpu(self) -> float:
        return proc_cpu(self.proc.pid)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def blobs(n: int = 24, seed: int = 26) -> list[bytes]:
    rnd = random.Random(seed)
    return [rnd.randbytes(rnd.randint(1_500_000, 6_000_000)) for _ in range(n)]


def one(kind: str, data: list[bytes], rounds: int) -> float:
    """Server CPU milliseconds per GET."""
    work = tempfile.mkdtemp(prefix="bench-bigget-")
    srv = NginxServer(work) if kind == "nginx" else Tb5(work, kind)
    try:
        h = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
        paths = []
        for b in data:
            p = f"/cas/{hashlib.sha256(b).hexdigest()}"
            h.request("PUT", p, body=b)
            r = h.getresponse()
            r.read()
            assert r.status in (200, 201, 204), (kind, r.status)
            paths.append(p)

        def get_all() -> None:
            for p, b in zip(paths, data):
                h.request("GET", p)
                r = h.getresponse()
                body = r.read()
                assert r.status == 200 and len(body) == len(b), (kind, r.status, len(body))

        get_all()  # the first reads verify
        c0 = srv.cpu()
        for _ in range(rounds):
            get_all()
        c1 = srv.cpu()
        h.close()
        return (c1 - c0) * 1000 / (rounds * len(data))
    finally:
        srv.stop()
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--only", default="")
    ap.add_argument("--base", default="", help="directory holding another version's tb5sync package")
    a = ap.parse_args()
    BASE[0] = os.path.abspath(a.base) if a.base else ""
    kinds = [k for k in (a.only or ",".join(KINDS + (("tb5-v2-base", "tb5-v1-base") if a.base else ()))).split(",") if k]
    data = blobs()
    got: dict[str, list[float]] = {k: [] for k in kinds}
    for rep in range(a.reps):
        for k in (kinds if rep % 2 == 0 else kinds[::-1]):
            got[k].append(one(k, data, a.rounds))
    print(f"server CPU per GET of 24 blobs of 1.5-6 MB (mean {sum(map(len, data)) / len(data) / 1e6:.2f} MB), "
          f"{a.rounds} rounds, median of {a.reps} alternating runs:")
    for k in kinds:
        print(f"  {k:16s} {statistics.median(got[k]):6.2f} ms   (runs: {', '.join(f'{x:.2f}' for x in got[k])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
