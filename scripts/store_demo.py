"""make demo, the artifact store part: put, dedup, push through `tb5sync serve --store`, get back, verify.

Steps, each through the real command line (``python -m tb5sync.cli store ...``):

1. put the stdlib tree (site-packages left out) and the corpus models (when built) into store A;
2. put an edited second version of the models (1% of the largest file rewritten, one file
   added) and show the new bytes and the dedup ratio (``store stats``);
3. start ``tb5sync serve --store B`` on loopback and push every ref of A to it (the second
   version sends only its new chunks);
4. pull every ref from B into a fresh store C, ``get`` each one, and compare the trees with the
   sources byte for byte (content, modes, mtimes, symlinks); ``verify`` B and C.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from demo import tree_fingerprint  # noqa: E402

PY = sys.executable


def tb5(*args: str) -> str:
    out = subprocess.run([PY, "-m", "tb5sync.cli", *args], check=True, capture_output=True, text=True)
    return out.stdout


def jtb5(*args: str) -> object:
    return json.loads(tb5(*args, "--json"))


def main() -> int:
    stdlib = sysconfig.get_paths()["stdlib"]
    corpus = os.environ.get("TB5SYNC_CORPUS") or os.path.join(os.path.dirname(__file__), "..", ".corpus")
    models = os.path.abspath(os.path.join(corpus, "models"))
    work = tempfile.mkdtemp(prefix="tb5sync-store-demo-")
    a, b, c = (os.path.join(work, n) for n in ("storeA", "storeB", "storeC"))
    sources: dict[str, tuple[str, list[str]]] = {"stdlib/3.11": (stdlib, ["site-packages/", "dist-packages/"])}
    ok = True
    proc = None
    try:
        if os.path.isdir(models):
            sources["models/corpus/v1"] = (models, [])
            v2 = os.path.join(work, "models-v2")
            files = [os.path.join(d, n) for d, _, ns in os.walk(models) for n in ns]
            big = max(files, key=os.path.getsize)
            for f in files:  # hard links, except the edited model file
                dst = os.path.join(v2, os.path.relpath(f, models))
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                if f == big:
                    shutil.copy2(f, dst)
                    size = os.path.getsize(dst)
                    with open(dst, "r+b") as fh:
                        fh.seek(size // 2)
                        fh.write(random.Random(1).randbytes(size // 100))
                else:
                    os.link(f, dst)
            with open(os.path.join(v2, "CHANGELOG"), "w") as fh:
                fh.write("v2: one tensor fine-tuned\n")
            sources["models/corpus/v2"] = (v2, [])
        print(f"tb5sync store demo, work dir {work}")
        print(f"\n{'step':<34} {'files':>7} {'MB':>9} {'new MB':>8} {'seconds':>8} {'GB/s':>6}")
        for ref, (path, excl) in sources.items():
            args = ["store", "--store", a, "put", ref, path]
            for e in excl:
                args += ["--exclude", e]
            r = jtb5(*args)
            assert isinstance(r, dict)
            print(f"{'put ' + ref:<34} {r['files']:>7} {r['size'] / 1e6:>9.1f} {r['new_bytes'] / 1e6:>8.1f} "
                  f"{r['seconds']:>8.3f} {r['size'] / r['seconds'] / 1e9:>6.2f}", flush=True)
        s = jtb5("store", "--store", a, "stats")
        assert isinstance(s, dict)
        print(f"\nstore A: {s['refs']} refs, logical {s['logical_bytes'] / 1e6:.1f} MB, unique {s['unique_bytes'] / 1e6:.1f} MB, "
              f"stored {s['stored_bytes'] / 1e6:.1f} MB in {s['packs']} packs, dedup ratio {s['dedup_ratio']:.2f}")
        if "models/corpus/v2" in sources:
            print("diff models/corpus/v1 models/corpus/v2:")
            for line in tb5("store", "--store", a, "diff", "models/corpus/v1", "models/corpus/v2").splitlines():
                print(f"  {line}")
        os.makedirs(os.path.join(work, "root"))
        proc = subprocess.Popen([PY, "-m", "tb5sync.cli", "serve", os.path.join(work, "root"), "--bind", "127.0.0.1:0",
                                 "--store", b], stderr=subprocess.PIPE, text=True)
        assert proc.stderr is not None
        m = re.search(r":(\d+)\s*$", proc.stderr.readline())
        if not m:
            raise SystemExit("server did not start")
        url = f"tb5://127.0.0.1:{m.group(1)}"
        print(f"\nserver with store B on {url}")
        print(f"{'step':<34} {'chunks':>7} {'moved':>7} {'MB moved':>9} {'seconds':>8}")
        for ref in sources:
            r = jtb5("store", "--store", a, "push", ref, url)
            assert isinstance(r, dict)
            print(f"{'push ' + ref:<34} {r['chunks']:>7} {r['chunks_sent']:>7} {r['bytes_sent'] / 1e6:>9.1f} {r['seconds']:>8.3f}", flush=True)
        for ref in sources:
            r = jtb5("store", "--store", c, "pull", ref, url)
            assert isinstance(r, dict)
            print(f"{'pull ' + ref + ' (store C)':<34} {r['chunks']:>7} {r['chunks_fetched']:>7} {r['bytes_fetched'] / 1e6:>9.1f} {r['seconds']:>8.3f}", flush=True)
        for ref, (path, excl) in sources.items():
            out = os.path.join(work, "out", ref)
            t0 = time.perf_counter()
            tb5("store", "--store", c, "get", ref, out)
            dt = time.perf_counter() - t0
            want = tree_fingerprint(path)
            names = [e.strip("/") for e in excl]
            want = {k: v for k, v in want.items() if k.split("/")[0] not in names}
            got = tree_fingerprint(out)
            if got != want:
                print(f"  FAIL: get {ref} differs from its source: {sorted(set(got.items()) ^ set(want.items()))[:3]}")
                ok = False
            else:
                print(f"  verified: get {ref} ({dt:.2f} s): {len(want)} entries byte-identical (content, modes, mtimes, symlinks)")
        for name, st in (("B", b), ("C", c)):
            r = subprocess.run([PY, "-m", "tb5sync.cli", "store", "--store", st, "verify"], capture_output=True, text=True)
            last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr.strip()
            print(f"  verify store {name}: {last}")
            ok = ok and r.returncode == 0
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
            if proc.stderr is not None:
                proc.stderr.close()
        shutil.rmtree(work, ignore_errors=True)
    print("\nstore demo", "passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
