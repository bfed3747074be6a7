"""What the client checks on its own against a hostile server (issue 21, the client's half).

Each hostile server here is :class:`hostile.HostileServer`: a hand-made server built from the
product's frames on 127.0.0.1 port 0, serving a real tree through a Sender made with the
options *it* likes, and sending what an honest server never would. The client is not mocked.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hostile import HostileServer, lying_sender

import tb5sync
from tb5sync.tree.entry import FILE, Entry
from tb5sync.tree.options import SyncOptions

pytestmark = pytest.mark.timeout(60)


def write(path: str, data: bytes = b"x") -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def links_tree(src: str) -> None:
    """A tree with safe and unsafe links (judged from ``src`` itself, the transfer's top)."""
    write(os.path.join(src, "f"))
    write(os.path.join(src, "d", "g"))
    os.makedirs(os.path.join(src, "d", "sub"))
    os.symlink("/etc", os.path.join(src, "abs"))
    os.symlink("../../outside", os.path.join(src, "d", "up"))
    os.symlink("f", os.path.join(src, "ok"))
    os.symlink("../f", os.path.join(src, "d", "ok_up"))
    os.symlink("..", os.path.join(src, "d", "sub", "parent"))  # d: safe
    os.symlink("sub/parent/../..", os.path.join(src, "d", "via"))  # d/sub/parent/.. is the top; /.. above it


def links_in(base: str) -> dict[str, str]:
    out = {}
    for d, dirs, names in os.walk(base):
        for n in dirs + names:
            p = os.path.join(d, n)
            if os.path.islink(p):
                out[os.path.relpath(p, base)] = os.readlink(p)
    return out


# ---- --safe-links: the receiving side judges what arrives ------------------------------------


def test_safe_links_on_pull_from_a_server_that_ignores_it(tmp_path: Path) -> None:
    src = str(tmp_path / "src")
    links_tree(src)
    with HostileServer(lying_sender(src, SyncOptions())) as hs:  # the server lists every link
        tb5sync.sync(hs.url("src/"), str(tmp_path / "dst"), safe_links=True)
    got = links_in(str(tmp_path / "dst"))
    assert got == {"ok": "f", "d/ok_up": "../f", "d/sub/parent": ".."}, got


def test_safe_links_on_pull_judges_a_link_named_below_the_top(tmp_path: Path) -> None:
    """Another input of the kind: a hostile server's listing of a source named without a slash
    (the top is the source's parent): ``src/up2 -> ../..`` leaves it, ``src/in -> ../src/f`` not."""
    src = str(tmp_path / "src")
    write(os.path.join(src, "f"))
    os.symlink("../..", os.path.join(src, "up2"))
    os.symlink("../src/f", os.path.join(src, "in"))
    with HostileServer(lying_sender(src, SyncOptions())) as hs:
        tb5sync.sync(hs.url("src"), str(tmp_path / "dst") + "/", safe_links=True)
    assert links_in(str(tmp_path / "dst")) == {"src/in": "../src/f"}


# ---- excluded names: what the sender lists anyway is left out ---------------------------------


def test_excluded_names_from_a_server_that_ignores_the_excludes(tmp_path: Path) -> None:
    src = str(tmp_path / "src")
    write(os.path.join(src, "keep"))
    write(os.path.join(src, "x.log"))
    write(os.path.join(src, "d", "y.log"))
    write(os.path.join(src, "cache", "blob"))
    with HostileServer(lying_sender(src, SyncOptions())) as hs:
        tb5sync.sync(hs.url("src/"), str(tmp_path / "dst"), exclude=["*.log", "cache/"])
    got = sorted(os.path.relpath(os.path.join(d, n), tmp_path / "dst") for d, ds, ns in os.walk(tmp_path / "dst") for n in ds + ns)
    assert got == ["d", "keep"], got


def test_anchored_exclude_and_delete_from_a_server_that_ignores_it(tmp_path: Path) -> None:
    """Another input: an anchored pattern naming a directory of a source named without a slash,
    with --delete: the excluded destination entry is neither replaced nor deleted."""
    src = str(tmp_path / "src")
    write(os.path.join(src, "d", "secret"), b"from the server")
    write(os.path.join(src, "d", "plain"))
    write(str(tmp_path / "dst" / "src" / "d" / "secret"), b"mine")
    with HostileServer(lying_sender(src, SyncOptions())) as hs:
        tb5sync.sync(hs.url("src"), str(tmp_path / "dst") + "/", exclude=["/src/d/secret"], delete=True)
    assert (tmp_path / "dst" / "src" / "d" / "secret").read_bytes() == b"mine"
    assert (tmp_path / "dst" / "src" / "d" / "plain").exists()


# ---- -X: only the namespaces this side copies ------------------------------------------------


def _xattrs_page(sender: Any, dirs: Any, skip: int = 0) -> dict[str, Any]:
    """The sender's real page, with a trusted.* and a security.* attribute on every entry."""
    page = type(sender).entries(sender, dirs, skip)
    page["xa"] = [[i, [[b"trusted.evil", b"1"], [b"security.evil", b"2"], [b"user.ok", b"3"]]] for i in range(len(page["entries"]))]
    return page


@pytest.mark.parametrize("xattrs", [True, False])
def test_xattr_namespaces_from_a_hostile_server(tmp_path: Path, xattrs: bool) -> None:
    """With -X only user.* names are set; without -X none, whatever the server sends."""
    src = str(tmp_path / "src")
    write(os.path.join(src, "f"))
    try:
        os.setxattr(os.path.join(src, "f"), "user.probe", b"1")
    except OSError:
        pytest.skip("no user extended attributes here")
    with HostileServer(lying_sender(src, SyncOptions(xattrs=True), entries=_xattrs_page)) as hs:
        tb5sync.sync(hs.url("src/"), str(tmp_path / "dst"), xattrs=xattrs)
    names = sorted(os.listxattr(tmp_path / "dst" / "f"))
    assert names == (["user.ok"] if xattrs else []), names


# ---- bounds on what a server sends ---------------------------------------------------------


def _endless_pages(sender: Any, dirs: Any, skip: int = 0) -> dict[str, Any]:
    """``entries`` pages of 500 new files each, ``more: true`` forever."""
    d = dirs[0]
    pre = f"{d}/" if d else ""
    return {"entries": [Entry(f"{pre}f{skip + i:09d}", FILE, 0o644, 1, 0, "").to_wire() for i in range(500)], "more": True}


def _a_tree(src: str) -> None:
    write(os.path.join(src, "f"))
    write(os.path.join(src, "d", "g"))


def _final_paths(base: Path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, n), base) for d, ds, ns in os.walk(base) for n in ds + ns) if base.exists() else []


@pytest.mark.parametrize("limit", [{"max_entries": 5000}, {"max_listing_bytes": 4 << 20}])
def test_endless_entries_pages_stop_at_the_clients_bound(tmp_path: Path, limit: dict[str, int]) -> None:
    """A server answering ``entries`` with ``more: true`` forever: the pull stops at the client's
    bound (exit 12, one line naming it and the option that raises it), nothing written."""
    from tb5sync.errors import PeerLimitError

    src = str(tmp_path / "src")
    _a_tree(src)
    with HostileServer(lying_sender(src, entries=_endless_pages)) as hs:
        with pytest.raises(PeerLimitError) as ei:
            tb5sync.sync(hs.url("src/"), str(tmp_path / "dst"), **limit)
    assert ei.value.exit_code == 12
    msg = str(ei.value)
    assert "\n" not in msg and "127.0.0.1" in msg and ("--max-entries" in msg or "--max-listing-bytes" in msg), msg
    assert _final_paths(tmp_path / "dst") == []


def test_client_listing_bound_defaults_to_the_servers(tmp_path: Path) -> None:
    """Without options the client holds what a server would hold of a pushing peer."""
    from tb5sync.errors import PeerLimitError
    from tb5sync.wire.messages import MAX_ENTRIES

    src = str(tmp_path / "src")
    _a_tree(src)

    def announce(sender: Any, start: int = 0) -> dict[str, Any]:  # a tree that claims too many directories
        page = type(sender).tree(sender, start)
        page["total"] = MAX_ENTRIES + 1
        return page

    with HostileServer(lying_sender(src, tree=announce)) as hs:
        with pytest.raises(PeerLimitError, match="--max-entries"):
            tb5sync.sync(hs.url("src/"), str(tmp_path / "dst"))
    assert _final_paths(tmp_path / "dst") == []


def test_cli_sync_max_entries_option(tmp_path: Path) -> None:
    """``tb5sync sync --max-entries N``: exit 12 and one error line past it."""
    from test_partial_vs_rsync import cli

    src = str(tmp_path / "src")
    _a_tree(src)
    with HostileServer(lying_sender(src, entries=_endless_pages)) as hs:
        p = cli(["sync", "--max-entries", "2000", hs.url("src/"), str(tmp_path / "dst")])
    assert p.returncode == 12, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "--max-entries" in p.stderr, p.stderr


# ---- peer strings on the terminal: control characters escaped as rsync does -----------------

ESC_NAME = "a\x1b[31mred\x07"
ESC_SHOWN = "a\\#033[31mred\\#007"  # rsync prints ESC as \#033 (its output_quoted / filtered_fwrite)


def test_escaped_follows_rsyncs_rules() -> None:
    from tb5sync._os.terminal import escaped

    assert escaped(ESC_NAME) == ESC_SHOWN
    assert escaped("tab\tstays") == "tab\tstays"
    assert escaped("nl\nz") == "nl\\#012z"
    assert escaped("caf\u00e9") == "caf\u00e9"  # valid UTF-8 printed as is
    assert escaped("bad\udcffz") == "bad\\#377z"  # a byte that is not UTF-8
    assert escaped("c1\u009bz") == "c1\\#302\\#233z"  # a C1 control (8-bit CSI): further than rsync
    assert escaped(escaped(ESC_NAME)) == ESC_SHOWN  # once escaped, escaping again changes nothing


def _esc_tree(src: str) -> None:
    write(os.path.join(src, ESC_NAME))
    os.symlink("\x1b]0;owned\x07", os.path.join(src, "lnk"))


@pytest.mark.parametrize("flag", ["-v", "-i", "-n"])
def test_sync_lines_escape_a_servers_names(tmp_path: Path, flag: str) -> None:
    from test_partial_vs_rsync import cli

    src = str(tmp_path / "src")
    _esc_tree(src)
    with HostileServer(lying_sender(src)) as hs:
        p = cli(["sync", flag, hs.url("src/"), str(tmp_path / "dst")])
    assert p.returncode == 0, p.stderr
    assert "\x1b" not in p.stdout and "\x07" not in p.stdout, p.stdout
    assert ESC_SHOWN in p.stdout, p.stdout


def test_error_line_escapes_a_servers_message(tmp_path: Path) -> None:
    """An ERROR frame's message holding ESC sequences: one escaped error line."""
    from test_partial_vs_rsync import cli
    from tb5sync.errors import UsageError

    src = str(tmp_path / "src")
    _a_tree(src)

    def refuse(sender: Any, start: int = 0) -> dict[str, Any]:
        raise UsageError("no \x1b[2J\x1b]0;pwned\x07 way")

    with HostileServer(lying_sender(src, tree=refuse)) as hs:
        p = cli(["sync", hs.url("src/"), str(tmp_path / "dst")])
    assert p.returncode != 0
    assert "\x1b" not in p.stderr and "\x07" not in p.stderr, p.stderr
    assert "\\#033[2J" in p.stderr, p.stderr


def test_ls_escapes_names_and_link_targets(tmp_path: Path) -> None:
    from test_partial_vs_rsync import cli
    from tb5sync.tree.entry import LINK

    def ls_session(ch: Any, msg: dict[str, Any]) -> None:
        import tb5sync.wire.protocol as P

        entries = [Entry("", "d", 0o755, 0, 0, ""), Entry(ESC_NAME, FILE, 0o644, 1, 0, ""), Entry("l", LINK, 0o777, 3, 0, "\x1b]0;x\x07")]
        ch.send_control(P.FrameType.RESPONSE, 0, {"entries": [e.to_wire() for e in entries]})

    with HostileServer(lying_sender(str(tmp_path)), other=ls_session) as hs:
        p = cli(["ls", hs.url("d")])
    assert p.returncode == 0, p.stderr
    assert "\x1b" not in p.stdout and "\x07" not in p.stdout, p.stdout
    assert ESC_SHOWN in p.stdout and "-> \\#033]0;x\\#007" in p.stdout, p.stdout
