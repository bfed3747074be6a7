"""Where options go, and rsync's ``-4``/``-6``.

- ``store``'s options (``--store``, ``--storage-option``, ``--timeout``) and the global ones are taken
  before or after every ``store`` subcommand; one in a place no parser takes is one line naming
  where it goes.
- ``-4``/``-6`` (sync, ls, bench, store ls/push/pull): a host without an address of the asked family
  fails with exit 10, as rsync's (run here on the same addresses), in one line saying what was
  asked and what the name has; the family that does resolve works.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from typing import Any

import pytest
from conftest import LiveServer, make_tree

import tb5sync
from tb5sync.cli.command import build_parser
from tb5sync.daemon.server import Server


def _cli(*args: str, cwd: Any = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tb5sync.cli", *args], capture_output=True, text=True, timeout=60,
                          check=False, cwd=cwd)


# ---- store: options before or after the subcommand ------------------------------------------------

#: Each store subcommand with the positionals it needs.
_SUBCOMMANDS = {"put": ["r", "src"], "get": ["r", "dest"], "cat": ["r"], "ls": [], "rm": ["r"], "diff": ["a", "b"],
                "pin": ["r"], "unpin": ["r"], "verify": [], "gc": [], "stats": [], "reindex": [], "upgrade": [], "quota": [],
                "push": ["r", "tb5://h"], "pull": ["r", "tb5://h"]}


@pytest.mark.timeout(30)
def test_every_store_subcommand_takes_the_store_options_after_it() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    store_sub = next(a for a in sub.choices["store"]._actions if a.dest == "store_command")
    assert set(store_sub.choices) == set(_SUBCOMMANDS)  # a new subcommand is added here too
    for name, pos in _SUBCOMMANDS.items():
        before = parser.parse_args(["store", "--store", "D", "--storage-option", "a=1", name, *pos])
        after = parser.parse_args(["store", name, *pos, "--store", "D", "--storage-option", "a=1", "--timeout", "5",
                                   "-v", "--hash-threads", "2"])
        assert before.store == after.store == "D", name
        assert before.storage_options + getattr(before, "storage_options_after", []) == ["a=1"]
        assert after.storage_options + after.storage_options_after == ["a=1"], name
        assert (after.timeout, after.verbose, after.hash_threads) == (5.0, 1, 2), name
        middle = parser.parse_args(["store", "-v", "--chunk-threads", "3", name, *pos])
        assert (middle.verbose, middle.chunk_threads) == (1, 3), name
        both = parser.parse_args(["store", "--store", "A", "--storage-option", "a=1", name, *pos, "--store", "B",
                                  "--storage-option", "b=2"])
        assert both.store == "B" and both.storage_options + both.storage_options_after == ["a=1", "b=2"], name


@pytest.mark.timeout(60)
def test_store_options_work_where_users_put_them(tmp_path: Any) -> None:
    src, st = str(tmp_path / "src"), str(tmp_path / "st")
    make_tree(src, files=5)
    put = _cli("store", "put", "r1", src, "--store", st)
    assert put.returncode == 0, put.stderr
    listings = [_cli(*args) for args in (["store", "ls", "--json", "--store", st], ["store", "--store", st, "ls", "--json"],
                                         ["-v", "store", "ls", "--store", st, "--json"])]
    for r in listings:
        assert r.returncode == 0, r.stderr
        assert [x["name"] for x in json.loads(r.stdout)] == ["r1"]
    # in a place no parser takes: one line naming the right place, exit 2, as argparse's errors
    for args, want in ((["--store", st, "store", "ls"], "--store is not an option of tb5sync itself: put it after the command (tb5sync store --store ...)"),
                       (["store", "--json", "ls", "--store", st], "--json is an option of tb5sync store ls: put it after ls (tb5sync store ls ... --json)"),
                       (["store", "--force", "ls", "--store", st], "--force is an option of tb5sync store put/get/rm/push/pull, not of store ls"),
                       (["--delete", "sync", src + "/", str(tmp_path / "d")], "--delete is not an option of tb5sync itself: put it after the command (tb5sync sync --delete ...)")):
        r = _cli(*args)
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [f"tb5sync: error: {want}"], (args, r.stderr)
    assert not os.path.exists(tmp_path / "d")


# ---- -4 / -6 ----------------------------------------------------------------------------------


def _rsync_code(flag: str, host: str) -> int:
    """rsync's exit code for ``rsync FLAG`` to a daemon URL on ``host`` (nothing listens: the
    address family decides first)."""
    r = subprocess.run(["rsync", flag, "-a", "/dev/null", f"rsync://{host}:1/x"], capture_output=True, text=True,
                       timeout=30, check=False)
    assert "Address family for hostname not supported" in r.stderr, r.stderr
    return r.returncode


@pytest.fixture
def v6_server(tmp_path: Any) -> Any:
    """A live server on [::1] (skipped where this host has no IPv6 loopback)."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    root = str(tmp_path / "v6root")
    os.makedirs(root)
    srv = Server(root, host="::1", port=0).start()
    try:
        yield LiveServer(srv, srv.root, None)
    finally:
        srv.stop()


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("need_rsync")
def test_address_family_asked_and_missing(tmp_path: Any, server: Any, v6_server: Any) -> None:
    src = str(tmp_path / "src")
    make_tree(src, files=3)
    p4, p6 = server.port, v6_server.port
    cases = [("-6", "127.0.0.1", p4, "over IPv6 (-6 asked): 127.0.0.1 has only IPv4 addresses"),
             ("-4", "::1", p6, "over IPv4 (-4 asked): ::1 has only IPv6 addresses")]
    for flag, host, port, why in cases:
        code = _rsync_code(flag, f"[{host}]" if ":" in host else host)
        url = f"tb5://{'[' + host + ']' if ':' in host else host}:{port}"
        where = f"{'[' + host + ']' if ':' in host else host}:{port}"
        for args in (["sync", flag, src + "/", url + "/x"], ["sync", flag, url + "/", str(tmp_path / "pulled")],
                     ["ls", flag, url + "/"], ["bench", flag, url],
                     ["store", "--store", str(tmp_path / "st"), "ls", flag, "--url", url],
                     ["store", "--store", str(tmp_path / "st"), "pull", flag, "r", url]):
            r = _cli(*args)
            assert r.returncode == code == 10, (args, r.stderr)
            assert r.stderr.strip().splitlines() == [f"tb5sync: error: cannot connect to {where} {why}"], (args, r.stderr)
    assert not os.path.exists(tmp_path / "pulled")
    # the family that resolves works, both ways
    for flag, url in (("-4", server.url("x4")), ("-6", f"tb5://[::1]:{p6}/x6"), ("--ipv6", f"tb5://[::1]:{p6}/y6")):
        r = _cli("sync", flag, src + "/", url)
        assert r.returncode == 0, r.stderr
    assert os.path.isdir(os.path.join(v6_server.root, "x6")) and os.path.isdir(os.path.join(server.root, "x4"))


@pytest.mark.timeout(60)
def test_a_name_with_one_family(tmp_path: Any, server: Any, v6_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A name that resolves to one family only (the resolver replaced for two test names): the other
    family fails naming what the name has; ``ip_version`` of the Python API; a name that does not
    resolve at all says so."""
    real = socket.getaddrinfo
    names = {"v4only.test": ("127.0.0.1", socket.AF_INET), "v6only.test": ("::1", socket.AF_INET6)}

    def fake(host: Any, port: Any, family: int = 0, type: int = 0, proto: int = 0, flags: int = 0) -> Any:
        if host in names:
            addr, fam = names[host]
            if family not in (0, fam):
                raise socket.gaierror(socket.EAI_ADDRFAMILY if hasattr(socket, "EAI_ADDRFAMILY") else socket.EAI_NONAME,
                                      "Address family for hostname not supported")
            return real(addr, port, fam, type, proto, flags)
        return real(host, port, family, type, proto, flags)

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    src = str(tmp_path / "src")
    make_tree(src, files=3)
    with pytest.raises(tb5sync.ConnectError, match=r"^cannot connect to v6only\.test:\d+ over IPv4 \(-4 asked\): "
                                                   r"v6only\.test has only IPv6 addresses$") as ei:
        tb5sync.sync(src + "/", f"tb5://v6only.test:{v6_server.port}/a", ip_version=4)
    assert ei.value.exit_code == 10
    with pytest.raises(tb5sync.ConnectError, match=r"over IPv6 \(-6 asked\): v4only\.test has only IPv4 addresses$"):
        tb5sync.sync(f"tb5://v4only.test:{server.port}/", str(tmp_path / "p"), ip_version=6)
    st = tb5sync.sync(src + "/", f"tb5://v6only.test:{v6_server.port}/a", ip_version=6)
    n = st.files_total
    assert st.files_transferred == n > 0
    cp = subprocess.run(["cp", "-a", src, os.path.join(server.root, "s")], check=True, timeout=30)
    assert cp.returncode == 0
    assert tb5sync.sync(f"tb5://v4only.test:{server.port}/s/", str(tmp_path / "p"), ip_version=4).files_transferred == n
    with pytest.raises(tb5sync.ConnectError, match=r"over IPv6 \(-6 asked\): nothing\.invalid does not resolve"):
        tb5sync.sync(src + "/", "tb5://nothing.invalid/a", ip_version=6)
    with pytest.raises(tb5sync.UsageError, match="ip_version must be 4, 6 or None"):
        tb5sync.sync(src + "/", f"tb5://v6only.test:{v6_server.port}/a", ip_version=5)


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("need_rsync")
def test_negative_option_values_as_rsync_takes_them(tmp_path: Any) -> None:
    """``-4``/``-6`` make argparse read ``-1`` as an option; ``--max-delete -1`` is still a value,
    which rsync takes as 0 (no deletion, exit 25)."""
    src = str(tmp_path / "src")
    make_tree(src, files=3)
    for d in ("ref", "mine"):
        os.makedirs(tmp_path / d)
        (tmp_path / d / "extra").write_bytes(b"x")
    ref = subprocess.run(["rsync", "-a", "--delete", "--max-delete", "-1", src + "/", str(tmp_path / "ref")],
                         capture_output=True, text=True, timeout=60, check=False)
    got = _cli("sync", "--delete", "--max-delete", "-1", src + "/", str(tmp_path / "mine"))
    assert got.returncode == ref.returncode == 25, (got.stderr, ref.stderr)
    assert (tmp_path / "mine" / "extra").exists() and (tmp_path / "ref" / "extra").exists()
    bad = _cli("sync", "--streams", "-3", src + "/", str(tmp_path / "mine"))
    assert bad.returncode == 2 and "streams must be an integer from 1 to 64, not -3" in bad.stderr


@pytest.mark.timeout(60)
def test_every_subcommand_option_misplaced_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Every option of every store subcommand, flag or valued (``-m d``, ``--url URL``, ``-6``), given
    between ``store`` and its subcommand, or after a subcommand that does not take it: one line saying
    where it goes, exit 2 (never argparse's usage and "invalid choice")."""
    import tb5sync.cli.command as cli
    from tb5sync.cli.store import _store_parsers

    store, subs = _store_parsers(build_parser())
    shared = set(store._option_string_actions)  # store's own and the global ones go anywhere
    tried = 0
    for name, q in subs.items():
        for act in q._actions:
            for opt in act.option_strings:
                if opt in shared:
                    continue
                value = [] if act.nargs == 0 else [str(act.choices[0]) if act.choices else "1"]
                takers = [n for n, p in subs.items() if opt in p._option_string_actions]
                others = [n for n in subs if n not in takers]
                cases = [(["store", "--store", "S", opt, *value, name, *_SUBCOMMANDS[name]],
                          f"{opt} is an option of tb5sync store {name}: put it after {name} (tb5sync store {name} ... {opt})")]
                if others:
                    cases.append((["store", "--store", "S", others[0], *_SUBCOMMANDS[others[0]], opt, *value],
                                  f"{opt} is an option of tb5sync store {'/'.join(takers)}, not of store {others[0]}"))
                    cases.append((["store", "--store", "S", others[0], opt, *value, *_SUBCOMMANDS[others[0]]],
                                  f"{opt} is an option of tb5sync store {'/'.join(takers)}, not of store {others[0]}"))
                for argv, want in cases:
                    with pytest.raises(SystemExit) as ei:
                        cli.main(argv)
                    err = capsys.readouterr().err
                    assert ei.value.code == 2 and err.strip().splitlines() == [f"tb5sync: error: {want}"], (argv, err)
                    tried += 1
    assert tried > 100


@pytest.mark.timeout(60)
def test_store_timeout_on_a_local_store_is_accepted_and_ignored(tmp_path: Any) -> None:
    """``--timeout`` (an object store's request timeout) on a local store: accepted and ignored, as
    rclone's ``--timeout`` on a local remote, before or after the subcommand (a script giving it for
    both kinds of store works); ``-v`` says it was ignored."""
    src, st = str(tmp_path / "src"), str(tmp_path / "st")
    make_tree(src, files=3)
    put = _cli("store", "--store", st, "--timeout", "5", "put", "r", src)
    assert put.returncode == 0 and put.stderr == "", put.stderr
    got = _cli("-v", "store", "get", "r", str(tmp_path / "out"), "--store", st, "--timeout", "5")
    assert got.returncode == 0, got.stderr
    assert "store --timeout 5 ignored: a local store makes no network requests" in got.stderr
    ls = _cli("store", "--timeout", "5", "ls", "--json", "--store", st)
    assert ls.returncode == 0 and [x["name"] for x in json.loads(ls.stdout)] == ["r"], ls.stderr
    from conftest import digest_snapshot

    assert digest_snapshot(str(tmp_path / "out")) == digest_snapshot(src)
