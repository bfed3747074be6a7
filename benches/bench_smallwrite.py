"""The Cython small-file writer alone (``tb5sync._write.write_files``): its named path (a temporary
name, renamed; macOS and ``TB5SYNC_NO_TMPFILE=1``) against its unnamed path (Linux ``O_TMPFILE``,
linked once whole), alternating round by round, each round into new directories.

Usage: ``python benches/bench_smallwrite.py [--files 2000] [--dirs 20] [--rounds 8] [--workdir DIR]``.
Prints seconds per batch call (median, per path) and the per-round figures. Files are 1-64 KiB of
random bytes, as the bench tree's. The destinations are removed at the end only (a removal slows
the next creations on a journal-less ext4: see benches/README.md).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

from tb5sync._write import tmpfile_state, write_files


def one_round(root: str, files: list[tuple[int, bytes]], dirs: int, tmpfile: bool) -> float:
    """Write ``files`` ((dir index, data)) into ``dirs`` new directories under ``root``: seconds."""
    fds = []
    for k in range(dirs):
        os.makedirs(os.path.join(root, f"d{k:03d}"))
        fds.append(os.open(os.path.join(root, f"d{k:03d}"), os.O_RDONLY | os.O_DIRECTORY))
    batch = [(fds[k], b".f%05d.00000000.tb5tmp" % i, b"f%05d" % i, data, 0o644, 1_700_000_000_000_000_000)
             for i, (k, data) in enumerate(files)]
    try:
        t0 = time.perf_counter()
        out = write_files(batch, False, tmpfile)
        took = time.perf_counter() - t0
    finally:
        for fd in fds:
            os.close(fd)
    bad = [r for r in out if isinstance(r, int)]
    if bad:
        raise SystemExit(f"{len(bad)} files failed, e.g. errno {bad[0]}")
    return took


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--dirs", type=int, default=20)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--workdir", default=tempfile.gettempdir())
    a = p.parse_args(argv)
    rng = random.Random(5)
    blob = os.urandom(64 * 1024)
    files = [(rng.randrange(a.dirs), blob[: rng.randint(1024, 64 * 1024)]) for _ in range(a.files)]
    top = tempfile.mkdtemp(prefix="smallwrite-", dir=a.workdir)
    runs: dict[str, list[float]] = {"named": [], "unnamed": []}
    try:
        for r in range(a.rounds):
            order = [("named", False), ("unnamed", True)] if r % 2 == 0 else [("unnamed", True), ("named", False)]
            for name, tmpfile in order:
                t = one_round(os.path.join(top, f"{r}-{name}"), files, a.dirs, tmpfile)
                runs[name].append(t)
                print(f"[{r + 1}/{a.rounds}] {name:8s} {t:.4f} s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    if tmpfile_state() < 0:
        print("note: O_TMPFILE is refused here: both rows are the named path")
    for name, ts in runs.items():
        print(f"{name:8s} median {statistics.median(ts):.4f} s  ({a.files} files, {1e6 * statistics.median(ts) / a.files:.1f} us/file)")
    wins = sum(u < n for n, u in zip(runs["named"], runs["unnamed"]))
    print(f"unnamed faster in {wins} of {a.rounds} rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
