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
from hostile import HostileServer, LyingStore, dir_entry, file_entry, link_entry, lying_sender, raw_manifest, store_server

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


# ---- store pull, fan-out and store get: a ref manifest from a server is checked ----------------

def _pull(route: str, tmp_path: Path, url: str) -> dict[str, Any]:
    """Pull ref ``r`` from ``url`` into the store ``tmp_path/st`` by ``route``."""
    from tb5sync.store import Store

    st = Store(str(tmp_path / "st"))
    try:
        if route == "pull":
            from tb5sync.remote.storeclient import pull_ref
            from tb5sync.wire.urls import parse_url

            remote = parse_url(url)
            assert remote is not None
            return pull_ref(st, "r", remote, streams=2)
        from tb5sync.remote.fanout import pull_fanout

        return pull_fanout(st, "r", [url])
    finally:
        st.close()


def _refs_in(tmp_path: Path) -> list[str]:
    from tb5sync.store import Store

    st = Store(str(tmp_path / "st"))
    try:
        return [r.name for r in st.refs("")]
    finally:
        st.close()


_UNSAFE_MANIFESTS = {
    "link-then-child": [dir_entry(b""), link_entry(b"a", b"/tmp"), file_entry(b"a/x", b"through the link")],
    "file-then-child": [dir_entry(b""), file_entry(b"a", b"file"), file_entry(b"a/x", b"below a file")],
    "root-link-child": [link_entry(b"", b"/tmp"), file_entry(b"x", b"below the root link")],
    "duplicate": [dir_entry(b""), file_entry(b"a", b"one"), link_entry(b"a", b"/etc")],
    "dotdot": [dir_entry(b""), file_entry(b"../x", b"up")],
    "absolute": [dir_entry(b""), file_entry(b"/abs", b"abs")],
    "long-name": [dir_entry(b""), file_entry(b"n" * 256, b"a name past NAME_MAX")],
    "long-target": [dir_entry(b""), link_entry(b"l", b"t" * 4096)],
    "nul-in-target": [dir_entry(b""), link_entry(b"l", b"ok\x00/etc")],
    "nul-target-only": [dir_entry(b""), link_entry(b"l", b"\x00")],
}


_BLOBS = [b"through the link", b"file", b"below a file", b"below the root link", b"one", b"up", b"abs", b"a name past NAME_MAX"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("route", ["pull", "fanout"])
@pytest.mark.parametrize("kind", sorted(_UNSAFE_MANIFESTS))
def test_store_pull_refuses_an_unsafe_manifest(tmp_path: Path, route: str, kind: str) -> None:
    """A server's ref whose manifest holds an unsafe entry: one-line error, exit 12, no ref."""
    from tb5sync.errors import RemoteProtocolError

    entries = _UNSAFE_MANIFESTS[kind]
    with store_server(LyingStore("r", raw_manifest(entries), _BLOBS)) as hs:
        with pytest.raises(RemoteProtocolError) as ei:
            _pull(route, tmp_path, f"tb5://127.0.0.1:{hs.port}")
    assert ei.value.exit_code == 12
    assert "\n" not in str(ei.value) and "'r'" in str(ei.value), str(ei.value)
    assert _refs_in(tmp_path) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("route", ["pull", "fanout"])
def test_store_pull_bounds_the_manifests_entries(tmp_path: Path, route: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """More entries than the client holds (the bound lowered here to 1000): PeerLimitError."""
    import tb5sync.store.manifest as M
    from tb5sync.errors import PeerLimitError

    monkeypatch.setattr(M, "PEER_MAX_ENTRIES", 1000)
    entries = [dir_entry(b"")] + [dir_entry(b"d%06d" % i) for i in range(1001)]
    with store_server(LyingStore("r", raw_manifest(entries))) as hs:
        with pytest.raises(PeerLimitError) as ei:
            _pull(route, tmp_path, f"tb5://127.0.0.1:{hs.port}")
    assert ei.value.exit_code == 12 and "\n" not in str(ei.value), str(ei.value)
    assert _refs_in(tmp_path) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("route", ["pull", "fanout"])
def test_store_pull_bounds_the_manifests_bytes_before_fetching(tmp_path: Path, route: str) -> None:
    """A ref announcing a manifest of 4096 chunks of 1 MiB (past the client's bound): refused
    before any chunk is asked for."""
    from tb5sync.errors import PeerLimitError

    ops = LyingStore("r", raw_manifest([dir_entry(b"")]), mchunks=[(bytes([i % 256]) * 31 + bytes([i // 256]), 1 << 20) for i in range(4096)])
    with store_server(ops) as hs:
        with pytest.raises(PeerLimitError) as ei:
            _pull(route, tmp_path, f"tb5://127.0.0.1:{hs.port}")
    assert ei.value.exit_code == 12 and "\n" not in str(ei.value), str(ei.value)
    assert ops.asked == []
    assert _refs_in(tmp_path) == []


@pytest.mark.timeout(60)
def test_cli_store_pull_unsafe_manifest_one_line_exit_12(tmp_path: Path) -> None:
    from test_partial_vs_rsync import cli

    entries = _UNSAFE_MANIFESTS["link-then-child"]
    with store_server(LyingStore("r", raw_manifest(entries), [b"through the link"])) as hs:
        p = cli(["store", "pull", "r", f"tb5://127.0.0.1:{hs.port}", "--store", str(tmp_path / "st")])
    assert p.returncode == 12, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["link-then-child", "root-link-child", "file-then-child"])
def test_store_get_never_writes_through_a_link_of_the_manifest(tmp_path: Path, kind: str) -> None:
    """A crafted manifest committed into a local store (as a pull before these checks could):
    ``store get`` writes nothing through the manifest's own links, nothing at the final path."""
    from tb5sync.errors import Tb5syncError
    from tb5sync.store import Store
    from tb5sync.store.manifest import Item
    from tb5sync.store.store import PackWriter
    from tb5sync.engine.hashing import blob_to_refs, chunk_digest, file_digest

    outside = tmp_path / "outside"
    outside.mkdir()
    entries = [e if e[5] != b"/tmp" else [*e[:5], os.fsencode(str(outside)), *e[6:]] for e in _UNSAFE_MANIFESTS[kind]]
    data = raw_manifest(entries)
    st = Store(str(tmp_path / "st"))
    try:
        lease = st.lease()
        w = PackWriter(st, lease)
        d = chunk_digest(data)
        w.add(d, data)
        for payload in _BLOBS:
            w.add(chunk_digest(payload), payload)
        w.flush()
        items = [Item(e[0], e[1], e[2], e[3], e[4], e[5], e[6], blob_to_refs(e[7])) for e in entries]
        st.commit_ref(lease, "r", file_digest([d]), [(d, len(data))], items)
        dest = tmp_path / "out"
        with pytest.raises(Tb5syncError) as ei:
            st.get("r", str(dest))
    finally:
        st.close()
    assert "\n" not in str(ei.value)
    assert not os.path.lexists(dest)
    assert os.listdir(outside) == []
    assert sorted(os.listdir(tmp_path)) == ["outside", "st"]  # no temporary tree left next to dest


# ---- --max-delete on pull: the client plans, so the limit holds whatever the server lists ---------


def _all_below(base: Path) -> set[str]:
    return {os.path.relpath(os.path.join(d, n), base) for d, ds, ns in os.walk(base) for n in ds + ns}


def _dst_with_extras(tmp_path: Path) -> Path:
    """A destination holding the source's ``f`` and ``d/g`` and 10 files the source lacks."""
    dst = tmp_path / "dst"
    write(str(dst / "f"))
    write(str(dst / "d" / "g"))
    for i in range(5):
        write(str(dst / f"x{i}"))
        write(str(dst / "d" / f"y{i}"))
    return dst


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [0, 1, 3])
def test_max_delete_on_pull_from_a_server_listing_empty_directories(tmp_path: Path, n: int) -> None:
    """A server whose ``entries`` pages say every directory is empty (its tree still names them):
    the client deletes at most ``n`` entries and stops with exit 25."""
    src = str(tmp_path / "src")
    _a_tree(src)
    dst = _dst_with_extras(tmp_path)
    before = _all_below(dst)

    def empty(sender: Any, dirs: Any, skip: int = 0) -> dict[str, Any]:
        return {"entries": [], "more": False}

    with HostileServer(lying_sender(src, entries=empty)) as hs:
        with pytest.raises(tb5sync.DeleteLimitError) as ei:
            tb5sync.sync(hs.url("src/"), str(dst), delete=True, max_delete=n)
    assert ei.value.exit_code == 25
    gone = before - _all_below(dst)
    assert len(gone) == n, sorted(gone)
    assert ei.value.stats.deletes_skipped > 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [0, 2])
def test_max_delete_on_pull_counts_what_a_servers_replacement_clears(tmp_path: Path, n: int) -> None:
    """Another input: the server lists the destination's directory ``d`` (6 files) as a symlink,
    so the client must clear it to replace it: what it clears is counted against the limit,
    the directory is not replaced while it is not empty."""
    src = str(tmp_path / "src")
    write(os.path.join(src, "f"))
    os.symlink("f", os.path.join(src, "d"))
    dst = _dst_with_extras(tmp_path)
    before = _all_below(dst)
    with HostileServer(lying_sender(src)) as hs:
        with pytest.raises(tb5sync.Tb5syncError) as ei:
            tb5sync.sync(hs.url("src/"), str(dst), delete=True, max_delete=n)
    assert ei.value.exit_code in (23, 25), ei.value
    gone = before - _all_below(dst)
    assert len(gone) <= n, sorted(gone)
    assert os.path.isdir(dst / "d") and not os.path.islink(dst / "d")


# ---- a link target no system can hold (NUL) ----------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("target", ["ok\x00/etc", "\x00", "a" * 10 + "\x00"])
@pytest.mark.parametrize("safe", [True, False])
def test_pull_of_a_link_target_with_nul_is_one_line_exit_12_before_any_write(tmp_path: Path, target: str, safe: bool) -> None:
    """A server lists a link whose target holds a NUL byte (no file system can store one): the pull
    stops with one protocol line, exit 12, before anything is written at the destination."""
    import subprocess
    import sys

    src = str(tmp_path / "src")
    write(os.path.join(src, "f"), b"data")
    st = os.stat(os.path.join(src, "f"))

    def tree(sender: Any, start: int = 0) -> dict[str, Any]:
        return {"root": ["", "d", 0o755, 0, st.st_mtime_ns, ""], "dirs": [["", os.urandom(32), 1, 4]], "total": 1}

    def entries(sender: Any, dirs: Any, skip: int = 0) -> dict[str, Any]:
        return {"entries": [["f", "f", 0o644, 4, st.st_mtime_ns, ""], ["l", "l", 0o777, 7, st.st_mtime_ns, target]],
                "more": False}

    dst = tmp_path / "dst"
    with HostileServer(lying_sender(src, SyncOptions(), tree=tree, entries=entries)) as hs:
        r = subprocess.run([sys.executable, "-m", "tb5sync.cli", "sync", *(["--safe-links"] if safe else []),
                            hs.url("src/"), str(dst)], capture_output=True, text=True, timeout=50)
    assert r.returncode == 12, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr and "NUL" in r.stderr
    assert not dst.exists() or os.listdir(dst) == []
