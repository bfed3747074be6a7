"""Optional TLS (``--tls-cert/--tls-key`` on serve, ``tb5s://`` and ``--tls-ca`` on clients).

Certificates come from trustme (a throwaway CA per test session). The expected results are
those of the plain-TCP runs: the same trees, the same bytes; plus the standard library's own
verdicts on certificates (an unknown CA or a wrong host name fails the connection).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import fsspec
import pytest
from conftest import make_tree, snapshot, start_server

trustme = pytest.importorskip("trustme")

from tb5sync.errors import ConnectError, ProtocolError, UsageError  # noqa: E402
from tb5sync.daemon.server import Server  # noqa: E402
from tb5sync.api.sync import sync  # noqa: E402
from tb5sync.wire.transport import connect, dial  # noqa: E402

REPO = str(Path(__file__).resolve().parent.parent)
TOKEN = b"tls-token"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    out = {"ca": str(d / "ca.pem"), "cert": str(d / "cert.pem"), "key": str(d / "key.pem"), "other_ca": str(d / "other.pem")}
    ca.cert_pem.write_to_path(out["ca"])
    cert.private_key_pem.write_to_path(out["key"])
    with open(out["cert"], "wb") as f:
        for blob in cert.cert_chain_pems:
            f.write(blob.bytes())
    trustme.CA().cert_pem.write_to_path(out["other_ca"])
    return out


@pytest.fixture
def tls_server(tmp_path: Path, pki: dict[str, str]) -> Any:
    live = start_server(str(tmp_path / "root"), token=TOKEN, tls_cert=pki["cert"], tls_key=pki["key"])
    yield live
    live.server.stop()


def test_push_and_pull_over_tls(tls_server: Any, pki: dict[str, str], tmp_path: Path) -> None:
    src = make_tree(str(tmp_path / "src"))  # includes a 9 MiB file: ranges sent by pread, not sendfile
    url = f"tb5s://127.0.0.1:{tls_server.port}/"
    sync(src + "/", url + "pushed/", token=TOKEN, tls_ca=pki["ca"])
    assert snapshot(os.path.join(tls_server.root, "pushed")) == snapshot(src)
    sync(url + "pushed/", str(tmp_path / "back") + "/", token=TOKEN, tls_ca=pki["ca"])
    assert snapshot(str(tmp_path / "back")) == snapshot(src)


def test_fsspec_over_tls(tls_server: Any, pki: dict[str, str]) -> None:
    fs = fsspec.filesystem("tb5s", host="127.0.0.1", port=tls_server.port, token=TOKEN, tls_ca=pki["ca"],
                           skip_instance_cache=True)
    data = os.urandom(3 * 1024 * 1024 + 5)
    fs.pipe_file("d/x.bin", data) if fs.auto_mkdir else (fs.mkdir("d"), fs.pipe_file("d/x.bin", data))
    assert fs.cat_file("d/x.bin") == data
    assert fs.unstrip_protocol("d/x.bin") == f"tb5s://127.0.0.1:{tls_server.port}/d/x.bin"
    kw = type(fs)._get_kwargs_from_urls(f"tb5s://127.0.0.1:{tls_server.port}/d")
    assert kw["tls"] is True


def test_unknown_ca_is_refused(tls_server: Any, pki: dict[str, str]) -> None:
    with pytest.raises(ConnectError, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
        dial("127.0.0.1", tls_server.port, TOKEN, tls=True, tls_ca=pki["other_ca"])
    with pytest.raises(ConnectError, match="TLS handshake"):
        dial("127.0.0.1", tls_server.port, TOKEN, tls=True)  # the system's CAs do not know trustme's


def test_wrong_host_name_is_refused(tmp_path: Path) -> None:
    """A certificate for another name, signed by the trusted CA, fails the hostname check."""
    ca = trustme.CA()
    cert = ca.issue_cert("example.org")
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    live = start_server(str(tmp_path / "root"), token=TOKEN, tls_cert=str(tmp_path / "cert.pem"), tls_key=str(tmp_path / "key.pem"))
    try:
        with pytest.raises(ConnectError, match="IP address mismatch|hostname mismatch|doesn't match"):
            dial("127.0.0.1", live.port, TOKEN, tls=True, tls_ca=str(tmp_path / "ca.pem"))
    finally:
        live.server.stop()


def test_plain_client_against_tls_server_and_back(tls_server: Any, tmp_path: Path, pki: dict[str, str]) -> None:
    with pytest.raises((ConnectError, ProtocolError)):
        connect("127.0.0.1", tls_server.port, TOKEN, timeout=5)
    plain = start_server(str(tmp_path / "plain"))
    try:
        with pytest.raises(ConnectError, match="TLS handshake"):
            dial("127.0.0.1", plain.port, None, tls=True, tls_ca=pki["ca"], timeout=5)
    finally:
        plain.server.stop()
    ch = dial("127.0.0.1", tls_server.port, TOKEN, tls=True, tls_ca=pki["ca"])  # still serving
    ch.close()


def test_tls_needs_cert_and_key(tmp_path: Path, pki: dict[str, str]) -> None:
    with pytest.raises(UsageError, match="both"):
        Server(str(tmp_path), port=0, tls_cert=pki["cert"])
    with pytest.raises(UsageError, match="cannot load the TLS certificate"):
        Server(str(tmp_path), port=0, tls_cert=pki["ca"], tls_key=pki["ca"])


def test_cli_serve_and_sync_over_tls(tmp_path: Path, pki: dict[str, str]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TB5SYNC_TOKEN"}
    env["PYTHONPATH"] = REPO
    env["TB5SYNC_TOKEN"] = TOKEN.decode()
    (tmp_path / "root").mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "tb5sync.cli", "serve", str(tmp_path / "root"), "--bind", "127.0.0.1:0",
                             "--tls-cert", pki["cert"], "--tls-key", pki["key"]], stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert "(TLS)" in line, line
        port = int(line.split(":")[-1].split()[0])
        (tmp_path / "f.txt").write_bytes(b"over tls\n")
        r = subprocess.run([sys.executable, "-m", "tb5sync.cli", "sync", "--tls-ca", pki["ca"], str(tmp_path / "f.txt"),
                            f"tb5s://127.0.0.1:{port}/"], capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode == 0, r.stderr
        assert (tmp_path / "root" / "f.txt").read_bytes() == b"over tls\n"
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
        if proc.stderr:
            proc.stderr.close()


def test_idle_tls_channel_is_not_taken_for_closed_and_reconnects(tmp_path: Path, pki: dict[str, str]) -> None:
    """TLS records without data (TLS 1.3 session tickets) do not make an idle channel look closed;
    one the server did close is reopened before the next call."""
    from conftest import wait_for

    live = start_server(str(tmp_path / "root"), token=TOKEN, tls_cert=pki["cert"], tls_key=pki["key"], idle_timeout=0.7)
    try:
        from tb5sync.wire.rpc import open_session

        ch = dial("127.0.0.1", live.port, TOKEN, tls=True, tls_ca=pki["ca"])
        open_session(ch, {"op": "fs"})
        assert not ch.peer_closed()
        wait_for(ch.peer_closed, 5, "the server's idle close is seen")
        ch.close()
        fs = fsspec.filesystem("tb5s", host="127.0.0.1", port=live.port, token=TOKEN, tls_ca=pki["ca"], streams=1,
                               skip_instance_cache=True)
        fs.pipe_file("a", b"1")
        wait_for(lambda: live.server.threads == 0, 5, "idle connections closed by the server")
        fs.pipe_file("b", b"2")
        assert fs.cat_file("b") == b"2" and (Path(live.root) / "a").read_bytes() == b"1"
    finally:
        live.server.stop()
