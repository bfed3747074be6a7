"""Addresses in messages and --bind: IPv6 in brackets everywhere, unknown names said plainly, both
families through ``[::]``.

Expected values: RFC 3986's authority form (``[::1]:PORT``), the README's promise for interface names,
and the interfaces the system lists (``socket.if_nameindex``). Servers run on loopback, port 0, and
stop in teardown.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest

from tb5sync.errors import ConnectError, UsageError
from tb5sync.wire.transport import host_port


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_v6 = pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")


def test_host_port_brackets_ipv6_only() -> None:
    assert host_port("::", 34477) == "[::]:34477"
    assert host_port("fe80::1%bridge0", 8873) == "[fe80::1%bridge0]:8873"
    assert host_port("127.0.0.1", 1) == "127.0.0.1:1" and host_port("mini2.local", 2) == "mini2.local:2"


def test_serve_bind_unknown_name_lists_the_interfaces(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "tb5sync.cli", "serve", str(tmp_path), "--bind", "nosuch0:0"],
                       capture_output=True, text=True, timeout=60)
    names = sorted(n for _, n in socket.if_nameindex())
    assert r.returncode == UsageError.exit_code, r.stderr
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and "no network interface or host named 'nosuch0'" in line, line
    listed = re.search(r"\(interfaces: (.*)\)$", line)
    assert listed and "token" not in line, line
    shown = listed.group(1).split(", ")
    assert "lo" in shown and set(shown) <= set(names), line  # the system's interfaces (those with an address)


@needs_v6
def test_serve_any_v6_prints_brackets_and_takes_both_families(tmp_path: Path) -> None:
    p = subprocess.Popen([sys.executable, "-m", "tb5sync.cli", "serve", str(tmp_path), "--bind", "[::]:0",
                          "--no-auth"],
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stderr is not None
        line = p.stderr.readline()
        m = re.search(r" on \[::\]:(\d+)$", line.strip())
        assert m, line
        port = int(m.group(1))
        for host in ("127.0.0.1", "::1"):  # one socket, both families
            with socket.create_connection((host, port), timeout=5):
                pass
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
        if p.stderr is not None:
            p.stderr.close()


@needs_v6
def test_connect_error_brackets_the_v6_address() -> None:
    from tb5sync.wire.transport import connect

    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
        s.bind(("::1", 0))
        port = s.getsockname()[1]  # bound, not listening: the connection is refused
        with pytest.raises(ConnectError, match=re.escape(f"cannot connect to [::1]:{port}:")):
            connect("::1", port, None)


def test_fsspec_open_of_a_v6_url_names_the_form_that_works() -> None:
    with pytest.raises(UsageError) as ei:
        fsspec.open("tb5://[::1]:9/f").open()
    msg = str(ei.value)
    assert "tb5://[0:0:0:0:0:0:0:1]:8873/PATH" in msg and "'::'" in msg
    assert "tb5://[::1]" not in msg  # not the very form that failed


def test_a_client_outside_allow_is_refused_at_admission(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """README: refusals at admission exit 10 (as "server busy"); the class is still an AuthError."""
    from conftest import start_server

    import tb5sync
    from tb5sync.cli.command import main
    from tb5sync.errors import AuthError, BusyError, RefusedError

    live = start_server(str(tmp_path / "root"), allow=["10.0.0.0/8"])
    try:
        with pytest.raises(RefusedError, match="127.0.0.1 is not allowed") as ei:
            tb5sync.sync(live.url(""), str(tmp_path / "pulled"))
        assert isinstance(ei.value, AuthError) and not isinstance(ei.value, ConnectError)  # never retried
        assert main(["ls", live.url("")]) == RefusedError.exit_code == BusyError.exit_code
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "not allowed" in err and "--allow" in err
        assert not os.path.lexists(tmp_path / "pulled")
    finally:
        live.server.stop()
