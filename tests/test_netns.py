"""Link faults on a real (virtual) link: a veth pair into a network namespace, shaped with netem.

The server runs in this process, bound to the host end of the pair; the client runs in the
namespace as its own process. Needs root and iproute2; skipped (with the kernel's reason) where
namespaces or veth cannot be made. The expectation for a cut link is the issue's: a clear error
on the client within its timeout (not still waiting after 150 s), and the server's threads and
connections released, also after the link comes back.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import LiveServer, joined, make_tree, snapshot, wait_for

from tb5sync.daemon.server import Server

REPO = str(Path(__file__).resolve().parent.parent)
TOKEN = "netns-token"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


class Link:
    """A veth pair: ``host`` end here (``host_ip``), the other end in namespace ``ns`` (``peer_ip``)."""

    def __init__(self) -> None:
        n = os.getpid() % 10000
        self.ns = f"tb5t{n}"
        self.host = f"tb5h{n}"
        self.peer = f"tb5p{n}"
        octet = 1 + n % 250
        self.host_ip = f"10.213.{octet}.1"
        self.peer_ip = f"10.213.{octet}.2"

    def up(self) -> None:
        _ip("netns", "add", self.ns)
        _ip("link", "add", self.host, "type", "veth", "peer", "name", self.peer)
        _ip("link", "set", self.peer, "netns", self.ns)
        _ip("addr", "add", f"{self.host_ip}/30", "dev", self.host)
        _ip("link", "set", self.host, "up")
        _ip("netns", "exec", self.ns, "ip", "addr", "add", f"{self.peer_ip}/30", "dev", self.peer)
        _ip("netns", "exec", self.ns, "ip", "link", "set", self.peer, "up")
        _ip("netns", "exec", self.ns, "ip", "link", "set", "lo", "up")

    def shape(self, *qdisc: str) -> None:
        """A queueing discipline on the host end (traffic towards the namespace), e.g. ``netem loss 2%``.

        Skips the test when the kernel has no such discipline (netem is a module some kernels lack).
        """
        r = subprocess.run(["tc", "qdisc", "replace", "dev", self.host, "root", *qdisc], capture_output=True, text=True, timeout=30)
        if r.returncode:
            pytest.skip(f"the kernel refused the {qdisc[0]} queueing discipline: {r.stderr.strip()}")

    def set(self, state: str) -> None:
        _ip("link", "set", self.host, state)

    def down(self) -> None:
        _ip("link", "del", self.host, check=False)
        _ip("netns", "del", self.ns, check=False)


@pytest.fixture
def link() -> Iterator[Link]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if not shutil.which("ip") or not shutil.which("tc"):
        pytest.skip("iproute2 (ip, tc) is not installed")
    lk = Link()
    lk.down()  # a leftover of a killed run
    try:
        lk.up()
    except subprocess.CalledProcessError as exc:
        lk.down()
        pytest.skip(f"the kernel refused a namespace, veth or netem: {exc.stderr.strip()}")
    try:
        yield lk
    finally:
        lk.down()


CLIENT = r"""
import json, sys, time
from tb5sync.api.sync import sync
t0 = time.monotonic()
try:
    sync(sys.argv[1], sys.argv[2], token=sys.argv[3], timeout=float(sys.argv[4]), streams=2)
    out = {"ok": True}
except Exception as exc:
    out = {"ok": False, "kind": type(exc).__name__, "message": str(exc), "mro": [c.__name__ for c in type(exc).__mro__]}
out["seconds"] = time.monotonic() - t0
print(json.dumps(out), flush=True)
"""


def start_server(root: str, host: str, **kw: Any) -> LiveServer:
    os.makedirs(root, exist_ok=True)
    srv = Server(root, host=host, port=0, **kw).start()
    return LiveServer(srv, srv.root, kw.get("token"))


def client_in_ns(lk: Link, src: str, dst: str, timeout: float) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.Popen(["ip", "netns", "exec", lk.ns, sys.executable, "-c", CLIENT, src, dst, TOKEN, str(timeout)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout)
    assert out.strip(), err
    return json.loads(out.strip().splitlines()[-1])


def test_link_cut_mid_transfer_fails_clearly_and_frees_the_server(link: Link, tmp_path: Path) -> None:
    live = start_server(str(tmp_path / "root"), link.host_ip, token=TOKEN, io_timeout=3.0, keepalive=1.0)
    try:
        (Path(live.root) / "big.bin").write_bytes(os.urandom(48 * 1024 * 1024))
        link.shape("tbf", "rate", "40mbit", "burst", "64kb", "latency", "400ms")  # ~10 s for the file: time to cut it
        dst = tmp_path / "dst"
        proc = client_in_ns(link, f"tb5://{link.host_ip}:{live.port}/big.bin", str(dst), timeout=3.0)
        wait_for(lambda: live.server.threads >= 2, 15, "the pull started")
        time.sleep(1.5)
        link.set("down")
        cut = time.monotonic()
        res = finish(proc, 60)
        waited = time.monotonic() - cut
        assert not res["ok"], res
        assert "ConnectError" in res["mro"], res  # LinkTimeoutError or a lost connection: exit code 10/30
        assert waited < 15, f"the client waited {waited:.1f} s after the cut"
        # the server lets go of the session's threads (its sends time out), also once the link is back
        wait_for(lambda: live.server.threads == 0 and live.server.connections == 0, 20, "server released the session")
        link.set("up")
        time.sleep(1.0)
        assert live.server.threads == 0 and live.server.connections == 0
        assert not dst.exists() or dst.read_bytes() == (Path(live.root) / "big.bin").read_bytes()  # nothing half-written
        print(f"cut -> client error after {waited:.1f} s: {res['kind']}: {res['message']}")
    finally:
        live.server.stop()


def test_sync_over_a_lossy_delayed_link_is_exact(link: Link, tmp_path: Path) -> None:
    live = start_server(str(tmp_path / "root"), link.host_ip, token=TOKEN)
    try:
        src = make_tree(str(Path(live.root) / "src"), files=15)
        link.shape("netem", "delay", "15ms", "5ms", "loss", "2%")
        res = finish(client_in_ns(link, f"tb5://{link.host_ip}:{live.port}/src/", str(tmp_path / "dst") + "/", 20.0), 110)
        assert res["ok"], res
        assert snapshot(str(tmp_path / "dst")) == snapshot(src)
    finally:
        live.server.stop()


HOLDER = r"""
import sys, time
from tb5sync.wire.rpc import open_session
from tb5sync.wire.transport import connect
chans = []
for port in sys.argv[2:]:
    ch = connect(sys.argv[1], int(port), b"netns-token", keepalive=None, io_timeout=None)
    open_session(ch, {"op": "fs"})
    chans.append(ch)
print("open", flush=True)
time.sleep(60)
"""


def test_keepalive_frees_the_sessions_of_a_vanished_peer(link: Link, tmp_path: Path) -> None:
    """An idle session whose peer vanished (link down, nothing in flight) is ended by keepalive;
    the control server, with keepalive and timeouts off, still holds its session meanwhile."""
    probed = start_server(str(tmp_path / "a"), link.host_ip, token=TOKEN, keepalive=1.0, idle_timeout=None, io_timeout=3.0)
    control = start_server(str(tmp_path / "b"), link.host_ip, token=TOKEN, keepalive=None, idle_timeout=None, io_timeout=None)
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.Popen(["ip", "netns", "exec", link.ns, sys.executable, "-c", HOLDER, link.host_ip,
                             str(probed.port), str(control.port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "open"
        assert probed.server.threads == 1 and control.server.threads == 1
        link.set("down")
        took = wait_for(lambda: probed.server.threads == 0 and probed.server.connections == 0, 20, "keepalive ended the session")
        assert control.server.threads == 1, "the control lost its session too: the link cut, not keepalive, ended it"
        assert took < 10, took
        print(f"keepalive ended the vanished peer's session {took:.1f} s after the cut")
    finally:
        proc.kill()
        proc.communicate()
        probed.server.stop()
        control.server.stop()


WAITER = r"""
import sys, time
from tb5sync.wire.rpc import open_session
from tb5sync.wire.transport import dial
ch = dial(sys.argv[1], int(sys.argv[2]), None, io_timeout=4.0)
open_session(ch, {"op": "fs"})
ch.send_control(__import__("tb5sync.wire.protocol").wire.protocol.FrameType.REQUEST, 1, {"m": "digest", "a": {"path": "x"}})
print("waiting", flush=True)
t0 = time.monotonic()
try:
    ch.recv_frame()
    print("reply", flush=True)
except Exception as exc:
    print(f"{type(exc).__name__} after {time.monotonic() - t0:.1f} s: {exc}", flush=True)
"""


def test_client_waiting_for_a_slow_reply_keeps_waiting_until_the_link_dies(link: Link, tmp_path: Path) -> None:
    """A server computing a reply (alive, silent) is waited for past the I/O timeout; the same wait
    ends with LinkTimeoutError soon after the link goes down (keepalive / TCP_USER_TIMEOUT)."""
    import socket
    import threading

    import tb5sync.wire.protocol as P
    from tb5sync.wire.transport import Channel, server_handshake

    lsock = socket.socket()
    lsock.bind((link.host_ip, 0))
    lsock.listen(1)
    held: list[socket.socket] = []

    def silent_server() -> None:
        conn, _ = lsock.accept()
        held.append(conn)
        ch = Channel(conn, io_timeout=10)
        server_handshake(ch, None)
        ch.max_payload = P.MAX_PAYLOAD
        ch.recv_frame()  # OPEN
        ch.send_control(P.FrameType.RESPONSE, 0, {"read_only": False})
        ch.recv_frame()  # the request, never answered

    t = threading.Thread(target=silent_server, daemon=True)
    t.start()
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.Popen(["ip", "netns", "exec", link.ns, sys.executable, "-c", WAITER, link.host_ip, str(lsock.getsockname()[1])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "waiting"
        time.sleep(7)  # past the 4 s I/O timeout: a silent but live server is not a stall
        assert proc.poll() is None, proc.communicate()
        link.set("down")
        cut = time.monotonic()
        out, err = proc.communicate(timeout=30)
        waited = time.monotonic() - cut
        assert out.startswith("LinkTimeoutError") and "the link is dead" in out, (out, err)
        assert waited < 12, waited
        print(f"client: {out.strip()} ({waited:.1f} s after the cut)")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for c in held:
            c.close()
        lsock.close()
        joined(t, 5)
