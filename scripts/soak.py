#!/usr/bin/env python3
"""Soak test: a randomized loop of faults against a `tb5sync serve` process, for --seconds.

Events (drawn at random each round):

``clients``   2-4 concurrent clients push and pull random trees;
``kill``      the server is killed (SIGKILL) in the middle of a push, then restarted;
``sigterm``   the server is stopped with SIGTERM while clients are connected, then restarted;
``cut``       the link is brought down for 1-3 s in the middle of a pull (veth into a network
              namespace; needs root and iproute2), then up again;
``netem``     loss and delay on the link (``tc netem``) during a sync, or a rate limit with ``tbf``
              where the kernel has no netem;
``full``      a push into a 16 MiB tmpfs mounted inside the server's root (the disk fills).

After every event the invariants below are checked; the script prints each with how often it was
checked and every violation, and exits 1 if there was any.

Usage: ``python scripts/soak.py --seconds 60 [--seed N] [--no-netns]``
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = str(Path(__file__).resolve().parent.parent)
TOKEN = "soak-token"
CLIENT_TIMEOUT = 4.0

INVARIANTS = {
    "alive": "the server answers a client after every event it was not killed in",
    "exact": "every sync that reports success leaves the destination equal to the source",
    "clear-error": "every failed client exits with a tb5sync exit code and a one-line error, no traceback",
    "bounded-wait": "a client fails within its timeout plus 10 s after a cut, kill or stop",
    "whole-files": "no final path holds a partial file (each is absent or equal to its source)",
    "sigterm-exit": "SIGTERM ends the server within 20 s with status 0 and no traceback",
    "released": "after a cut the server holds no connection of the cut session (its thread count drops back)",
    "no-temp-left": "once a session has ended no *.tb5tmp file is left under the destination",
    "rss": "the server's resident memory stays under 1 GiB",
}


class Soak:
    def __init__(self, base: Path, rnd: random.Random, netns: bool) -> None:
        self.base = base
        self.rnd = rnd
        self.root = base / "root"
        self.root.mkdir()
        self.checked: Counter[str] = Counter()
        self.violations: list[str] = []
        self.events: Counter[str] = Counter()
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0
        self.ns: str | None = None
        self.host_ip = "127.0.0.1"
        self.netem = False
        self.n = 0
        if netns:
            self._netns_up()

    # ---- plumbing ---------------------------------------------------------------------------
    def _netns_up(self) -> None:
        n = os.getpid() % 10000
        self.ns, self.veth, peer = f"tb5s{n}", f"tb5v{n}", f"tb5w{n}"
        ip, peer_ip = f"10.214.{1 + n % 250}.1", f"10.214.{1 + n % 250}.2"
        cmds = [
            ["ip", "netns", "add", self.ns],
            ["ip", "link", "add", self.veth, "type", "veth", "peer", "name", peer],
            ["ip", "link", "set", peer, "netns", self.ns],
            ["ip", "addr", "add", f"{ip}/30", "dev", self.veth],
            ["ip", "link", "set", self.veth, "up"],
            ["ip", "netns", "exec", self.ns, "ip", "addr", "add", f"{peer_ip}/30", "dev", peer],
            ["ip", "netns", "exec", self.ns, "ip", "link", "set", peer, "up"],
            ["ip", "netns", "exec", self.ns, "ip", "link", "set", "lo", "up"],
        ]
        try:
            for c in cmds:
                subprocess.run(c, check=True, capture_output=True, text=True, timeout=30)
        except (subprocess.CalledProcessError, FileNotFoundError, PermissionError) as exc:
            print(f"soak: no network namespace ({getattr(exc, 'stderr', exc)!s}".strip() + "); cut and netem events skipped")
            self._netns_down()
            self.ns = None
            return
        self.host_ip = ip
        r = subprocess.run(["tc", "qdisc", "replace", "dev", self.veth, "root", "netem", "delay", "1ms"], capture_output=True, text=True)
        self.netem = r.returncode == 0
        subprocess.run(["tc", "qdisc", "del", "dev", self.veth, "root"], capture_output=True)
        if not self.netem:
            print(f"soak: the kernel has no netem ({r.stderr.strip()}); netem events use a tbf rate limit instead")

    def _netns_down(self) -> None:
        if self.ns:
            subprocess.run(["ip", "link", "del", self.veth], capture_output=True)
            subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.checked[name] += 1
        if not ok:
            self.violations.append(f"{name}: {detail}")
            print(f"soak: VIOLATION {name}: {detail}", flush=True)

    def start_server(self) -> None:
        env = {**os.environ, "PYTHONPATH": REPO, "TB5SYNC_TOKEN": TOKEN}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tb5sync.cli", "serve", str(self.root), "--bind", f"{self.host_ip}:{self.port}",
             "--timeout", "3", "--keepalive", "1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
        )
        assert self.proc.stderr is not None
        line = self.proc.stderr.readline()
        if "serving" not in line:
            raise SystemExit(f"soak: the server did not start: {line}{self.proc.stderr.read()}")
        self.port = int(line.rsplit(":", 1)[1].split()[0])
        os.set_blocking(self.proc.stderr.fileno(), False)

    def server_stderr(self) -> str:
        assert self.proc is not None and self.proc.stderr is not None
        try:
            return self.proc.stderr.read() or ""
        except (OSError, TypeError):
            return ""

    def client(self, *args: str) -> subprocess.Popen[str]:
        env = {**os.environ, "PYTHONPATH": REPO, "TB5SYNC_TOKEN": TOKEN}
        cmd = [sys.executable, "-m", "tb5sync.cli", *args]
        if self.ns:
            cmd = ["ip", "netns", "exec", self.ns, *cmd]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    def url(self, path: str) -> str:
        return f"tb5://{self.host_ip}:{self.port}/{path}"

    def tree(self, name: str, big: int = 0) -> Path:
        d = self.base / "src" / name
        for i in range(self.rnd.randint(3, 30)):
            p = d / f"d{i % 4}" / f"f{i}.bin"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(os.urandom(self.rnd.choice([0, 10, 5000, 200_000])))
        for i in range(big):
            (d / f"big{i}.bin").write_bytes(os.urandom(self.rnd.randint(12, 40) << 20))
        return d

    def wait_client(self, proc: subprocess.Popen[str], limit: float, what: str) -> tuple[int, str]:
        t0 = time.monotonic()
        try:
            out, err = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            self.check("bounded-wait", False, f"{what}: client still running after {limit:.0f} s")
            return -1, err
        if proc.returncode:
            lines = [ln for ln in err.splitlines() if ln.strip()]
            ok = proc.returncode in (2, 3, 5, 10, 11, 12, 13, 14, 23, 24, 30) and len(lines) == 1 and "Traceback" not in err
            self.check("clear-error", ok, f"{what}: exit {proc.returncode}: {err.strip()[-300:]}")
            self.check("bounded-wait", time.monotonic() - t0 < limit, what)
        return proc.returncode, err

    def same(self, src: Path, dst: Path, what: str) -> None:
        a, b = _listing(src), _listing(dst)
        self.check("exact", a == b, f"{what}: {len(set(a.items()) ^ set(b.items()))} paths differ")

    def whole(self, src: Path, dst: Path, what: str) -> None:
        bad = []
        for p, data in _listing(dst).items():
            if p.endswith(".tb5tmp"):
                continue
            if _listing(src).get(p) != data:
                bad.append(p)
        self.check("whole-files", not bad, f"{what}: partial or foreign files {bad[:3]}")

    def no_temp(self, dst: Path, what: str) -> None:
        left = [str(p) for p in dst.rglob("*.tb5tmp")] if dst.exists() else []
        self.check("no-temp-left", not left, f"{what}: {left[:3]}")

    def alive(self, what: str) -> None:
        assert self.proc is not None
        ok = self.proc.poll() is None
        err = ""
        for _ in range(3):  # a link just brought up may take a moment to carry traffic
            if not ok:
                break
            proc = self.client("ls", "--timeout", "5", self.url(""))
            out, err = proc.communicate(timeout=30)
            if proc.returncode == 0:
                break
            time.sleep(1.5)
        else:
            ok = False
        self.check("alive", ok, f"{what}: server exit status {self.proc.poll()}; client: {err.strip()[-200:]}; "
                                f"server: {self.server_stderr()[-300:]}")
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                rss = next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))
            self.check("rss", rss < 1 << 20, f"{what}: RSS {rss} KiB")
        except (OSError, StopIteration):
            pass

    # ---- events -----------------------------------------------------------------------------
    def ev_clients(self) -> None:
        procs = []
        for k in range(self.rnd.randint(2, 4)):
            self.n += 1
            src = self.tree(f"c{self.n}", big=self.rnd.randint(0, 1))
            if self.rnd.random() < 0.5:
                dst = self.root / f"c{self.n}"
                procs.append((self.client("sync", "--timeout", str(CLIENT_TIMEOUT), f"{src}/", self.url(f"c{self.n}/")), src, dst))
            else:
                shutil.copytree(src, self.root / f"p{self.n}", symlinks=True)
                dst = self.base / "pulled" / f"p{self.n}"
                procs.append((self.client("sync", "--timeout", str(CLIENT_TIMEOUT), self.url(f"p{self.n}/"), f"{dst}/"), src, dst))
        for proc, src, dst in procs:
            code, _ = self.wait_client(proc, 120, "concurrent client")
            if code == 0:
                self.same(src, dst, "concurrent client")
            self.whole(src, dst, "concurrent client")
            self.no_temp(dst, "concurrent client")
        self.alive("clients")

    def _push_then(self, fault: str) -> None:
        assert self.proc is not None
        self.n += 1
        src = self.tree(f"k{self.n}", big=2)
        dst = self.root / f"k{self.n}"
        proc = self.client("sync", "--timeout", str(CLIENT_TIMEOUT), f"{src}/", self.url(f"k{self.n}/"))
        time.sleep(self.rnd.uniform(0.2, 1.0))
        if fault == "kill":
            self.proc.kill()
            self.proc.wait(20)
        else:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(20)
                err = self.server_stderr()
                self.check("sigterm-exit", code == 0 and "Traceback" not in err, f"exit {code}: {err[-300:]}")
            except subprocess.TimeoutExpired:
                self.check("sigterm-exit", False, "still running 20 s after SIGTERM")
                self.proc.kill()
                self.proc.wait(10)
        self.wait_client(proc, CLIENT_TIMEOUT + 10, f"client of a {fault}ed server")
        self.whole(src, dst, f"push during {fault}")
        self.start_server()
        code, _ = self.wait_client(self.client("sync", "--timeout", str(CLIENT_TIMEOUT), f"{src}/", self.url(f"k{self.n}/")), 120, "rerun")
        if code == 0:
            self.same(src, dst, f"rerun after {fault}")
        self.no_temp(dst, f"rerun after {fault}")
        self.alive(fault)

    def ev_kill(self) -> None:
        self._push_then("kill")

    def ev_sigterm(self) -> None:
        self._push_then("sigterm")

    def ev_cut(self) -> None:
        if not self.ns:
            return
        self.n += 1
        shutil.copytree(self.tree(f"x{self.n}", big=1), self.root / f"x{self.n}")
        subprocess.run(["tc", "qdisc", "replace", "dev", self.veth, "root", "tbf", "rate", "80mbit", "burst", "64kb",
                        "latency", "400ms"], capture_output=True)
        dst = self.base / "pulled" / f"x{self.n}"
        proc = self.client("sync", "--timeout", str(CLIENT_TIMEOUT), self.url(f"x{self.n}/"), f"{dst}/")
        time.sleep(self.rnd.uniform(0.5, 1.5))
        subprocess.run(["ip", "link", "set", self.veth, "down"], check=True)
        cut = time.monotonic()
        code, _ = self.wait_client(proc, CLIENT_TIMEOUT + 10, "client of a cut link")
        self.check("bounded-wait", time.monotonic() - cut < CLIENT_TIMEOUT + 10, "cut")
        time.sleep(self.rnd.uniform(1, 3))
        subprocess.run(["ip", "link", "set", self.veth, "up"], check=True)
        subprocess.run(["tc", "qdisc", "del", "dev", self.veth, "root"], capture_output=True)
        time.sleep(0.5)
        self.whole(self.root / f"x{self.n}", dst, "pull across a cut")
        self.no_temp(dst, "pull across a cut")
        self.check("released", _established(self.port) == 0, f"{_established(self.port)} connections still open after the cut")
        self.alive("cut")

    def ev_netem(self) -> None:
        if not self.ns:
            return
        if self.netem:
            spec = ["netem", "delay", f"{self.rnd.randint(1, 20)}ms", "loss", f"{self.rnd.choice([0.5, 1, 3])}%"]
        else:
            spec = ["tbf", "rate", f"{self.rnd.choice([50, 200, 800])}mbit", "burst", "64kb", "latency", "400ms"]
        subprocess.run(["tc", "qdisc", "replace", "dev", self.veth, "root", *spec], check=True, capture_output=True)
        try:
            self.n += 1
            src = self.tree(f"n{self.n}")
            code, _ = self.wait_client(self.client("sync", "--timeout", "20", f"{src}/", self.url(f"n{self.n}/")), 120, "lossy link")
            if code == 0:
                self.same(src, self.root / f"n{self.n}", " ".join(spec))
        finally:
            subprocess.run(["tc", "qdisc", "del", "dev", self.veth, "root"], capture_output=True)
        self.alive("netem")

    def ev_full(self) -> None:
        self.n += 1
        mnt = self.root / f"small{self.n}"
        mnt.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True).returncode:
            mnt.rmdir()
            return
        try:
            src = self.tree(f"f{self.n}")
            (src / "over.bin").write_bytes(os.urandom(20 << 20))  # more than the 16 MiB the disk holds
            code, err = self.wait_client(self.client("sync", "--timeout", str(CLIENT_TIMEOUT), f"{src}/", self.url(f"small{self.n}/")), 120, "disk full")
            self.check("clear-error", code == 11, f"a full disk gave exit {code}: {err.strip()[-200:]}")
            self.whole(src, mnt, "full disk")
            self.no_temp(mnt, "full disk")
            self.alive("full")
        finally:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)

    def run(self, seconds: float) -> int:
        self.start_server()
        events = ["clients", "kill", "sigterm", "full"] + (["cut", "netem"] if self.ns else [])
        end = time.monotonic() + seconds
        try:
            while time.monotonic() < end:
                ev = self.rnd.choice(events)
                self.events[ev] += 1
                print(f"soak: {time.monotonic() - end + seconds:6.1f} s  {ev}", flush=True)
                getattr(self, f"ev_{ev}")()
        finally:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(20)
            self._netns_down()
        print("\nsoak: events " + ", ".join(f"{k} x{v}" for k, v in sorted(self.events.items())))
        print("soak: invariants checked")
        for name, text in INVARIANTS.items():
            bad = sum(1 for v in self.violations if v.startswith(name + ":"))
            print(f"  {name:13} {self.checked[name]:5d} checks, {bad} violations  ({text})")
        if self.violations:
            print(f"soak: {len(self.violations)} VIOLATIONS")
            for v in self.violations:
                print("  " + v)
            return 1
        print("soak: no violation")
        return 0


def _listing(base: Path) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    if not base.exists():
        return out
    for dirpath, dirnames, files in os.walk(base):
        dirnames[:] = [d for d in dirnames if d != ".tb5sync"]
        for f in files:
            p = Path(dirpath) / f
            if not p.is_symlink():
                out[str(p.relative_to(base))] = p.read_bytes()
    return out


def _established(port: int) -> int:
    """TCP connections to ``port`` still established on this host (``ss``), or 0 without ss."""
    if not shutil.which("ss"):
        return 0
    r = subprocess.run(["ss", "-Htn", "state", "established", f"( sport = :{port} )"], capture_output=True, text=True)
    return len([ln for ln in r.stdout.splitlines() if ln.strip()])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="how long to run (default 60)")
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: from the clock, printed)")
    ap.add_argument("--no-netns", action="store_true", help="loopback only: no cut or netem events")
    a = ap.parse_args()
    seed = a.seed if a.seed is not None else int(time.time())
    print(f"soak: seed {seed}, {a.seconds:g} s")
    netns = not a.no_netns and os.geteuid() == 0 and shutil.which("ip") is not None
    with tempfile.TemporaryDirectory(prefix="tb5soak-") as d:
        return Soak(Path(d), random.Random(seed), netns).run(a.seconds)


if __name__ == "__main__":
    sys.exit(main())
