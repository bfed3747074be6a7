"""make demo: a real tree synced over loopback through a real `tb5sync serve`, verified, with figures.

Source: the running interpreter's standard library directory (site-packages
left out), plus the real model weights under ``$TB5SYNC_CORPUS/models`` (or
``.corpus/models``) when that corpus has been built. Steps: push to a fresh
server root, pull back into a fresh local directory, verify both copies
byte-for-byte with modes, mtimes and symlinks, then re-run both to show the
no-change case. Prints one row per step.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time

import blake3

import tb5sync


def tree_fingerprint(base: str) -> dict[str, tuple]:
    """Map relative path -> (kind, mode, size, mtime_ns, target or content digest), skipping .tb5sync."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d != ".tb5sync")
        for name in dirnames + sorted(filenames):
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, base)
            st = os.lstat(full)
            if os.path.islink(full):
                out[rel] = ("l", os.readlink(full))
            elif os.path.isdir(full):
                out[rel] = ("d", st.st_mode & 0o7777)
            else:
                with open(full, "rb") as f:
                    digest = blake3.blake3(f.read()).hexdigest()
                out[rel] = ("f", st.st_mode & 0o7777, st.st_size, st.st_mtime_ns, digest)
    return out


def start_server(root: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tb5sync.cli", "serve", root, "--bind", "127.0.0.1:0"],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    line = proc.stderr.readline()
    m = re.search(r":(\d+)\s*$", line)
    if not m:
        proc.kill()
        raise SystemExit(f"server did not start: {line!r}")
    return proc, int(m.group(1))


def row(step: str, s: tb5sync.SyncStats) -> str:
    gbps = s.bytes_transferred / s.seconds / 1e9 if s.seconds else 0.0
    return (
        f"{step:<28} {s.files_transferred:>7} {s.bytes_transferred / 1e6:>10.1f} {s.seconds:>8.3f} "
        f"{gbps:>7.2f} {s.chunks_sent:>7} {s.chunks_reused:>7} {s.wire_bytes / 1e6:>9.1f}"
    )


def main() -> int:
    stdlib = sysconfig.get_paths()["stdlib"]
    corpus = os.environ.get("TB5SYNC_CORPUS") or os.path.join(os.path.dirname(__file__), "..", ".corpus")
    models = os.path.join(corpus, "models")
    work = tempfile.mkdtemp(prefix="tb5sync-demo-")
    src = os.path.join(work, "src")
    os.makedirs(src)
    # the source is the real stdlib tree, linked in (symlink to the directory, synced with a trailing slash)
    parts = [("stdlib/", stdlib, ["site-packages/", "dist-packages/"])]
    if os.path.isdir(models):
        parts.append(("models/", models, []))
    server_root = os.path.join(work, "server")
    pulled = os.path.join(work, "pulled")
    os.makedirs(server_root)
    proc, port = start_server(server_root)
    url = f"tb5://127.0.0.1:{port}"
    print(f"tb5sync demo: server on 127.0.0.1:{port}, work dir {work}")
    for name, path, _ in parts:
        print(f"  source {name:<9} {path}")
    print()
    print(f"{'step':<28} {'files':>7} {'MB':>10} {'seconds':>8} {'GB/s':>7} {'chunks':>7} {'reused':>7} {'wire MB':>9}")
    ok = True
    try:
        for name, path, excludes in parts:
            dst_remote = f"{url}/{name}"
            dst_local = os.path.join(pulled, name)
            steps = [
                (f"push {name} (cold)", path + "/", dst_remote),
                (f"pull {name} (cold)", dst_remote, dst_local),
                (f"push {name} (no change)", path + "/", dst_remote),
                (f"pull {name} (no change)", dst_remote, dst_local),
            ]
            for step, s, d in steps:
                stats = tb5sync.sync(s, d, exclude=excludes)
                print(row(step, stats), flush=True)
                if "no change" in step and stats.chunks_sent:
                    print(f"  FAIL: {step} sent {stats.chunks_sent} chunks", flush=True)
                    ok = False
            want = tree_fingerprint_filtered(path, excludes)
            for label, copy in (("server copy", os.path.join(server_root, name)), ("pulled copy", dst_local)):
                got = tree_fingerprint(copy)
                if got != want:
                    diff = sorted(set(got.items()) ^ set(want.items()))[:5]
                    print(f"  FAIL: {label} of {name} differs from the source: {diff}")
                    ok = False
                else:
                    print(f"  verified: {label} of {name}: {len(want)} entries identical (content, modes, mtimes, symlinks)")
        ok = delta_demo(url, parts, server_root, work) and ok
        ok = fsspec_demo(url, parts, pulled) and ok
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(work, ignore_errors=True)
    print("\ndemo", "passed" if ok else "FAILED")
    return 0 if ok else 1


def delta_demo(url: str, parts: list[tuple[str, str, list[str]]], server_root: str, work: str) -> bool:
    """Edit a copy of the largest source file (64 KiB overwritten, 4 KiB inserted) and push it again."""
    name, path, _ = parts[-1]
    biggest = max(
        (os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if os.path.isfile(os.path.join(d, f))),
        key=os.path.getsize,
    )
    edit = os.path.join(work, "edit")
    os.makedirs(edit)
    local = os.path.join(edit, os.path.basename(biggest))
    shutil.copyfile(biggest, local)
    tb5sync.sync(edit + "/", f"{url}/edit/")
    data = bytearray(read_bytes(local))
    n = len(data)
    data[n // 3 : n // 3 + 65536] = os.urandom(min(65536, n // 3))
    data[2 * n // 3 : 2 * n // 3] = os.urandom(4096)
    with open(local, "wb") as f:
        f.write(data)
    stats = tb5sync.sync(edit + "/", f"{url}/edit/")
    print(row("push 1 edited file (delta)", stats))
    same = read_bytes(os.path.join(server_root, "edit", os.path.basename(biggest))) == bytes(data)
    print(f"  delta: {os.path.relpath(biggest, path)} ({n / 1e6:.1f} MB) with 64 KiB overwritten and 4 KiB inserted: "
          f"{stats.wire_bytes / 1e3:,.0f} kB on the wire, {stats.bytes_matched / 1e6:.1f} MB of the sent chunks "
          f"found in the old version, {stats.chunks_reused} chunks reused; "
          + ("server copy identical" if same else "FAIL: server copy differs"))
    return same


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def fsspec_demo(url: str, parts: list[tuple[str, str, list[str]]], pulled: str) -> bool:
    """The same server through fsspec: a tree listed in one round trip, many small files read in a few, a ranged read."""
    import fsspec

    fs, _ = fsspec.core.url_to_fs(url)
    ok = True
    print("\nfsspec (tb5://)")
    t = time.perf_counter()
    found = fs.find("stdlib", detail=True)
    print(f"  find stdlib/: {len(found):,} files in {time.perf_counter() - t:.3f} s (one round trip)")
    small = sorted(n for n, i in found.items() if i["type"] == "file" and 0 < i["size"] <= 64 * 1024)[:2000]
    t = time.perf_counter()
    got = fs.cat(small)
    dt = time.perf_counter() - t
    bad = [n for n in small if got[n] != read_bytes(os.path.join(pulled, n))]
    print(f"  cat of {len(small):,} small files: {len(small) / dt:,.0f} files/s, {sum(map(len, got.values())) / 1e6:.1f} MB"
          f"{'' if not bad else f'  FAIL: {len(bad)} differ'}")
    ok = ok and not bad
    if len(parts) > 1:
        for name in fs.glob("models/**/*.safetensors"):
            with fs.open(name, "rb", cache_type="none") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
            tensors = [k for k in header if k != "__metadata__"]
            print(f"  {name}: header of {n:,} bytes read by range ({len(tensors)} tensors) from a {fs.size(name) / 1e6:.0f} MB file")
    fs._holder.close()
    return ok


def tree_fingerprint_filtered(path: str, excludes: list[str]) -> dict[str, tuple]:
    fp = tree_fingerprint(path)
    names = [e.strip("/") for e in excludes]
    return {k: v for k, v in fp.items() if k.split("/")[0] not in names}


if __name__ == "__main__":
    sys.exit(main())
