"""Interface names and IPv6 zones: ``serve --bind lo:0 --allow lo``, ``http-cache`` likewise, and a
link-local address with its zone in ``--bind`` and in ``tb5://[fe80::1%25IFACE]:PORT/path`` URLs
(RFC 6874; a raw ``%`` too), over a veth pair into a network namespace the test creates
(root and iproute2 needed, else skipped)."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import make_tree, snapshot
from test_netns import REPO, TOKEN, Link, _ip, client_in_ns, finish, link, start_server  # noqa: F401 (the fixture)

from tb5sync.cli.command import _parse_bind
from tb5sync.errors import AuthError, UsageError
from tb5sync.cache.httpcache import HttpCache
from tb5sync._os.netif import AllowList, bind_host, interface_networks
from tb5sync.api.sync import sync
from tb5sync.wire.urls import parse_url, url_host


def test_parse_bind_takes_interface_names_and_zones() -> None:
    assert _parse_bind("lo:0") == ("127.0.0.1", 0)
    assert _parse_bind("lo") == ("127.0.0.1", 8873)
    assert _parse_bind("[fe80::1%lo]:5") == ("fe80::1%lo", 5)
    assert _parse_bind("fe80::1%lo") == ("fe80::1%lo", 8873)
    assert _parse_bind("[::1]:7") == ("::1", 7)
    assert _parse_bind("127.0.0.1:9") == ("127.0.0.1", 9)
    assert _parse_bind("localhost:9") == ("localhost", 9)  # not an interface: a host name as before
    with pytest.raises(UsageError, match="bad port"):
        _parse_bind("lo:x")


@pytest.mark.parametrize("url, host, port", [
    ("tb5://[fe80::1%25bridge0]:8873/p", "fe80::1%bridge0", 8873),
    ("tb5://[fe80::1%bridge0]:9/p", "fe80::1%bridge0", 9),  # a raw % is accepted
    ("tb5://tok@[FE80::1%25Br0]/p", "fe80::1%Br0", 8873),  # the zone keeps its case
    ("tb5s://[fe80::a%25en%2D0]/p", "fe80::a%en-0", 8873),  # percent-encoded zone characters
])
def test_urls_with_a_zone(url: str, host: str, port: int) -> None:
    r = parse_url(url)
    assert r is not None and (r.host, r.port, r.path) == (host, port, "p")
    scheme = "tb5s" if r.tls else "tb5"
    assert parse_url(f"{scheme}://{url_host(r.host)}:{r.port}/p") == r  # written back as RFC 6874 has it


def test_bad_zone_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="zone"):
        parse_url("tb5://[fe80::1%25]/p")


def test_allow_list_with_interface_names() -> None:
    lo = AllowList(["lo"])
    assert "127.0.0.1" in lo and "127.9.9.9" in lo and "::1" in lo and "::ffff:127.0.0.1" in lo
    assert "10.0.0.1" not in lo and "fd00::1" not in lo and "junk" not in lo
    both = AllowList(["10.0.0.0/8", "lo"])
    assert "10.1.2.3" in both and "127.0.0.1" in both
    assert not AllowList([])
    with pytest.raises(UsageError, match="bad --allow entry 'nosuch0'.*no network interface named 'nosuch0'"):
        AllowList(["nosuch0"])
    with pytest.raises(UsageError, match="bad --allow network"):
        AllowList(["10.0.0.0/99"])
    assert (interface_networks("lo")[0][0]).network_address.is_loopback
    assert bind_host("127.0.0.1") == "127.0.0.1" and bind_host("") == ""


def _serve_cli(root: Path, *args: str) -> tuple[subprocess.Popen[str], int]:
    env = {k: v for k, v in os.environ.items() if k != "TB5SYNC_TOKEN"}
    env["PYTHONPATH"] = REPO
    proc = subprocess.Popen([sys.executable, "-m", "tb5sync.cli", "-v", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stderr is not None
    line = proc.stderr.readline()
    assert "serving" in line, line
    return proc, int(line.rsplit(":", 1)[1].split()[0].rstrip("/"))


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=20)


def test_serve_binds_and_allows_by_interface_name(tmp_path: Path) -> None:
    """``tb5sync serve --bind lo:0 --allow lo``: listens on lo's address, admits lo's subnets."""
    src = make_tree(str(tmp_path / "src"), files=8)
    (tmp_path / "root").mkdir()
    proc, port = _serve_cli(tmp_path / "root", "serve", str(tmp_path / "root"), "--bind", "lo:0", "--allow", "lo")
    try:
        sync(src + "/", f"tb5://127.0.0.1:{port}/dst/")
        assert snapshot(src) == snapshot(str(tmp_path / "root" / "dst"))
    finally:
        _stop(proc)


def test_serve_refuses_peers_outside_the_interfaces_subnets(tmp_path: Path) -> None:
    """An interface whose subnets do not hold the client (here any interface but lo, else a CIDR)."""
    others = [n for n in _interfaces() if n != "lo"]
    live = start_server(str(tmp_path / "root"), "lo", allow=others[:1] or ["10.213.0.0/16"])
    try:
        assert live.server.host == "127.0.0.1"
        with pytest.raises(AuthError, match="not allowed"):
            sync(make_tree(str(tmp_path / "src"), files=5) + "/", f"tb5://127.0.0.1:{live.port}/dst/")
    finally:
        live.server.stop()


def _interfaces() -> list[str]:
    """Interfaces with an address, but the veths other tests make and remove meanwhile."""
    from tb5sync._os.netif import interfaces

    return [n for n, addrs in interfaces().items() if addrs and not n.startswith("tb5")]


def test_http_cache_binds_and_allows_by_interface_name(tmp_path: Path) -> None:
    cache = HttpCache(str(tmp_path / "store"), "lo", 0, allow=["lo"])
    cache.start()
    try:
        assert cache.host == "127.0.0.1"
        url = f"http://127.0.0.1:{cache.port}/ccache/ab/cd"
        urllib.request.urlopen(urllib.request.Request(url, data=b"x" * 100, method="PUT"), timeout=20).close()
        with urllib.request.urlopen(url, timeout=20) as r:
            assert r.read() == b"x" * 100
    finally:
        cache.stop()
    others = [n for n in _interfaces() if n != "lo"]
    cache = HttpCache(str(tmp_path / "store"), "lo", 0, allow=others[:1] or ["10.213.0.0/16"])
    cache.start()
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{cache.port}/ccache/ab/cd", timeout=20)
        assert err.value.code == 403
        err.value.close()
    finally:
        cache.stop()


def _link_local(lk: Link) -> None:
    """fe80::1 on the host end, fe80::2 on the namespace's end (no duplicate detection wait)."""
    r = _ip("-6", "addr", "add", "fe80::1/64", "dev", lk.host, "nodad", check=False)
    if r.returncode:
        pytest.skip(f"no IPv6 on the veth: {r.stderr.strip()}")
    _ip("netns", "exec", lk.ns, "ip", "-6", "addr", "add", "fe80::2/64", "dev", lk.peer, "nodad")


@pytest.mark.parametrize("written", ["%25", "%"], ids=["rfc6874", "raw"])
def test_link_local_with_zone_over_a_veth(link: Link, tmp_path: Path, written: str) -> None:
    """The server binds ``fe80::1%HOSTEND`` (as ``--bind`` parses it) and admits ``--allow HOSTEND``;
    a client in the namespace pushes to and pulls from ``tb5://[fe80::1%25PEEREND]:PORT/...``."""
    _link_local(link)
    host, _ = _parse_bind(f"[fe80::1%{link.host}]:0")
    live = start_server(str(tmp_path / "root"), host, token=TOKEN, allow=[link.host])
    try:
        src = make_tree(str(tmp_path / "src"), files=6)
        url = f"tb5://[fe80::1{written}{link.peer}]:{live.port}/"
        res = finish(client_in_ns(link, src + "/", url + "pushed/", timeout=20.0), 120)
        assert res["ok"], res
        assert snapshot(src) == snapshot(os.path.join(live.root, "pushed"))
        res = finish(client_in_ns(link, url + "pushed/", str(tmp_path / "pulled"), timeout=20.0), 120)
        assert res["ok"], res
        assert snapshot(src) == snapshot(str(tmp_path / "pulled"))
        # fsspec reads a URL with a zone, from the namespace (written without "::", which
        # fsspec.open takes for its chaining separator: url_host's form)
        code = ("import fsspec, sys; sys.stdout.buffer.write(fsspec.open(sys.argv[1], 'rb', token=sys.argv[2]).open().read())")
        fs_url = f"tb5://{url_host('fe80::1%' + link.peer)}:{live.port}/pushed/big.bin"
        assert "::" not in fs_url.partition("://")[2]
        out = subprocess.run(["ip", "netns", "exec", link.ns, sys.executable, "-c", code, fs_url, TOKEN],
                             capture_output=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})
        assert out.returncode == 0, out.stderr.decode()[-2000:]
        assert out.stdout == (Path(src) / "big.bin").read_bytes()
    finally:
        live.server.stop()
    # the same peer, not in the allowed interface's subnets: refused before authentication
    live = start_server(str(tmp_path / "root"), host, token=TOKEN, allow=["lo"])
    try:
        res = finish(client_in_ns(link, str(tmp_path / "src") + "/", f"tb5://[fe80::1%25{link.peer}]:{live.port}/x/",
                                  timeout=20.0), 120)
        # refused at admission: RefusedError (exit 10), still an AuthError
        assert not res["ok"] and res["kind"] == "RefusedError" and "AuthError" in res["mro"], res
    finally:
        live.server.stop()


def test_allow_by_interface_checks_the_zone(link: Link) -> None:
    """A link-local peer is in ``--allow IFACE`` only when it came in on that interface."""
    _link_local(link)
    allow = AllowList([link.host])
    assert f"fe80::2%{link.host}" in allow
    assert "fe80::2%lo" not in allow and "fe80::2" not in allow

