"""URL forms behave the same in the CLI, the API and fsspec; a token appears in no message.

The reference for the forms is fsspec's reading of ``tb5://TOKEN@host`` (the user part of an
RFC 3986 authority, percent-decoded) and its refusal of a storage option that contradicts the URL.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest
from conftest import LiveServer, start_server

from tb5sync.errors import AuthError, UsageError
from tb5sync.api.sync import sync
from tb5sync.wire.urls import Remote, parse_url, redact_url, token_of

REPO = str(Path(__file__).resolve().parent.parent)
SECRET = "Zq9-s3cret/x y"  # needs percent-encoding in a URL
QUOTED = "Zq9-s3cret%2Fx%20y"


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "TB5SYNC_TOKEN"}
    full["PYTHONPATH"] = REPO
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "tb5sync.cli", *args], capture_output=True, text=True, env=full, timeout=60)


@pytest.fixture
def secret_server(tmp_path: Path) -> LiveServer:
    live = start_server(str(tmp_path / "root"), token=SECRET)
    (Path(live.root) / "hello.txt").write_bytes(b"hi\n")
    yield live
    live.server.stop()


@pytest.fixture(autouse=True)
def _no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TB5SYNC_TOKEN", raising=False)


@pytest.mark.parametrize(
    ("url", "host", "port", "path", "token", "tls"),
    [
        ("tb5://h/p", "h", 8873, "p", None, False),
        ("tb5s://h:9/p/", "h", 9, "p/", None, True),
        (f"tb5://{QUOTED}@h:10/a", "h", 10, "a", SECRET.encode(), False),
        (f"tb5://user:{QUOTED}@[::1]:11/", "::1", 11, "", SECRET.encode(), False),
        ("tb5s://tok@h/", "h", 8873, "", b"tok", True),
    ],
)
def test_url_forms(url: str, host: str, port: int, path: str, token: bytes | None, tls: bool) -> None:
    r = parse_url(url)
    assert r == Remote(host, port, path, tls=tls)
    assert r is not None and r.token == token
    assert SECRET not in repr(r) and "tok" not in repr(r).replace("Remote", "")


@pytest.mark.parametrize(
    "url",
    [
        f"tb5://{QUOTED}@host:99999/x",      # bad port: the case
        f"tb5://{QUOTED}@host:nope/x",
        f"http://{QUOTED}@host/x",           # other scheme
        f"tb5://u:{QUOTED}@/x",              # no host
        f"tb5:/{QUOTED}@host/x",             # mistyped
        f"tb5://{QUOTED}@[::1/x",            # unclosed IPv6 bracket (urlsplit's ValueError)
        f"tb5://{QUOTED}@::1]/x",
    ],
)
def test_url_errors_never_show_the_token(url: str) -> None:
    with pytest.raises(UsageError) as ei:
        parse_url(url)
    msg = str(ei.value)
    assert QUOTED not in msg and SECRET not in msg and "Zq9" not in msg
    assert "***@" in msg


def test_redact_url() -> None:
    assert redact_url("tb5://a:b@h/p") == "tb5://***@h/p"
    assert redact_url("tb5://h/p@x") == "tb5://h/p@x"  # an @ in the path is not a user part
    assert redact_url("./local@dir") == "./local@dir"


def test_token_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    r = parse_url("tb5://url-tok@h/")
    monkeypatch.setenv("TB5SYNC_TOKEN", "env-tok")
    assert token_of(None, r) == b"url-tok"              # the URL over the environment
    assert token_of("url-tok", r) == b"url-tok"
    assert token_of(None, parse_url("tb5://h/")) == b"env-tok"
    with pytest.raises(UsageError, match="two different tokens") as ei:
        token_of("other", r)
    assert "other" not in str(ei.value) and "url-tok" not in str(ei.value)


# ---- one URL, three faces -----------------------------------------------------------------


def test_token_in_the_url_works_in_the_api_the_cli_and_fsspec(secret_server: LiveServer, tmp_path: Path) -> None:
    url = f"tb5://{QUOTED}@127.0.0.1:{secret_server.port}/"
    # API
    sync(url + "hello.txt", str(tmp_path / "api.txt"))
    assert (tmp_path / "api.txt").read_bytes() == b"hi\n"
    # CLI (it used to ignore the URL's token and fail to authenticate)
    r = cli("sync", url + "hello.txt", str(tmp_path / "cli.txt"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "cli.txt").read_bytes() == b"hi\n"
    r = cli("ls", url)
    assert r.returncode == 0 and "hello.txt" in r.stdout, r.stderr
    # fsspec
    with fsspec.open(url + "hello.txt", "rb", skip_instance_cache=True) as f:
        assert f.read() == b"hi\n"


def test_wrong_token_in_the_url_fails_alike(secret_server: LiveServer, tmp_path: Path) -> None:
    url = f"tb5://wrong@127.0.0.1:{secret_server.port}/hello.txt"
    with pytest.raises(AuthError):
        sync(url, str(tmp_path / "x"))
    r = cli("sync", url, str(tmp_path / "y"))
    assert r.returncode == 5 and "wrong" not in r.stderr.replace("wrong token", ""), r.stderr
    with pytest.raises(AuthError):
        fsspec.filesystem("tb5", **fsspec.get_filesystem_class("tb5")._get_kwargs_from_urls(url),
                          skip_instance_cache=True).cat_file("hello.txt")


def test_cli_token_file_contradicting_the_url_is_refused(secret_server: LiveServer, tmp_path: Path) -> None:
    tf = tmp_path / "tok"
    tf.write_text("another-token")
    r = cli("sync", "--token-file", str(tf), f"tb5://{QUOTED}@127.0.0.1:{secret_server.port}/hello.txt", str(tmp_path / "z"))
    assert r.returncode == 2
    assert "two different tokens" in r.stderr
    assert "another-token" not in r.stderr and "Zq9" not in r.stderr


def test_cli_bad_url_error_does_not_echo_the_token(tmp_path: Path) -> None:
    r = cli("ls", f"tb5://{QUOTED}@127.0.0.1:99999/")
    assert r.returncode == 2
    assert r.stderr.startswith("tb5sync: error: bad port in 'tb5://***@127.0.0.1:99999/'"), r.stderr
    assert "Zq9" not in r.stderr
    r = cli("sync", str(tmp_path), f"tb5://{QUOTED}@127.0.0.1:99999/")
    assert r.returncode == 2 and "Zq9" not in r.stderr


def test_cli_malformed_ipv6_url_is_a_usage_error(tmp_path: Path) -> None:
    r = cli("ls", f"tb5://{QUOTED}@[::1/x")
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("tb5sync: error: malformed URL 'tb5://***@[::1/x'"), r.stderr
    assert "Traceback" not in r.stderr and "Zq9" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_server_logs_no_token(tmp_path: Path) -> None:
    """The daemon's own output (verbose) names no token, in any failure."""
    tf = tmp_path / "tok"
    tf.write_text(SECRET)
    env = {k: v for k, v in os.environ.items() if k != "TB5SYNC_TOKEN"}
    env["PYTHONPATH"] = REPO
    (tmp_path / "root").mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "tb5sync.cli", "-vv", "serve", str(tmp_path / "root"), "--bind", "127.0.0.1:0",
                             "--token-file", str(tf)], stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stderr is not None
    port = int(proc.stderr.readline().rsplit(":", 1)[1].split()[0])
    for tok in ("wrong-one", SECRET):
        cli("ls", f"tb5://{tok.replace('/', '%2F').replace(' ', '%20')}@127.0.0.1:{port}/")
    proc.terminate()
    assert proc.wait(10) == 0
    err = proc.stderr.read()
    proc.stderr.close()
    assert "authentication failed from 127.0.0.1" in err
    assert SECRET not in err and "wrong-one" not in err and "Zq9" not in err
