"""rsync options, second half, against rsync itself on the same trees, on every route.

``--delete-excluded``, ``--max-delete N``, ``-i``/``--itemize-changes``, ``-u``/``--update``,
``--ignore-existing``, ``--size-only`` and ``--bwlimit``: each scenario runs ``rsync -a OPTION``
(the reference) and ``tb5sync.sync(..., option)`` local, push and pull, from identically
prepared destination parents (the :class:`Harness` of ``test_vs_rsync``), and compares the
resulting trees, the exit codes and, for ``-i``, the itemized lines (as sorted lists: rsync's
order follows its own file-list walk). A push prints ``<f`` where the receiver prints ``>f``:
that too is taken from rsync, run over a remote shell that executes it locally.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import tempfile

import pytest
from conftest import make_tree, slurp, start_server
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_vs_rsync import (T0, Harness, S, _change_types, _tree, _type_tree, assert_same, build_tree, cp_a, digest_snapshot, freeze_dirs, settle,
                           write)

import tb5sync
from tb5sync.errors import PartialTransferError, UsageError

#: One rsync -i line: YX and nine attribute characters, or "*deleting", then a space.
ITEM = re.compile(r"([<>ch.][fdLDS][.+cstpoguaxnb ]{9}|\*deleting  ) ")


@pytest.fixture(autouse=True)
def _need_rsync() -> None:
    if not shutil.which("rsync"):
        pytest.skip("rsync is not installed")


def items_of(stdout: str) -> list[str]:
    """The itemized lines of rsync's output, and its "cannot delete non-empty directory: PATH"
    lines among them (not "created directory ...", nor other messages)."""
    return [ln for ln in stdout.splitlines() if ITEM.match(ln) or ln.startswith("cannot delete non-empty directory: ")]


class Opts(Harness):
    """The rsync harness with arbitrary options: ``rsync -a ARGS`` against ``tb5sync.sync(**kw)``."""

    def go(self, src_spec: str, dst_spec: str, rsync_args: Sequence[str], **kw: Any) -> dict[str, tuple[int, list[str]]]:
        """Run every route; returns route -> (exit code, itemized lines). ``self.stats`` holds
        tb5sync's statistics (from the error, for a run that raised one)."""
        if not self._prepared:
            self.prepare()
        settle(self.sp)
        out: dict[str, tuple[int, list[str]]] = {}
        for r in self.routes:
            local_src = os.path.join(self.sp, src_spec)
            local_dst = os.path.join(self.dp[r], dst_spec)
            if r == "rsync":
                p = subprocess.run(["rsync", "-a", *rsync_args, local_src, local_dst],
                                   capture_output=True, text=True, timeout=100, check=False)
                assert p.returncode in (0, 23, 25), p.stderr
                out[r] = (p.returncode, items_of(p.stdout))
                m = re.search(r"--max-delete limit \((\d+) skipped\)", p.stderr)
                self.rsync_skipped = int(m.group(1)) if m else 0
                continue
            if r == "pull":
                self.stage_pull()
                a, b = self.server.url("pullsrc/" + src_spec), local_dst
            elif r == "push":
                a, b = local_src, self.server.url("push/" + dst_spec)
            else:
                a, b = local_src, local_dst
            try:
                st, code = tb5sync.sync(a, b, **kw), 0
            except PartialTransferError as exc:
                st, code = exc.stats, exc.exit_code
            self.stats[r] = st
            out[r] = (code, list(st.itemized))
        return out


def sent(lines: list[str]) -> list[str]:
    """rsync's lines as its sending side prints them (a push): ``>f`` becomes ``<f``."""
    return ["<" + ln[1:] if ln.startswith(">") else ln for ln in lines]


def same_items(out: dict[str, tuple[int, list[str]]]) -> None:
    """Every route's itemized lines equal rsync's (as the sender shows them for a push)."""
    ref = sorted(out["rsync"][1])
    assert ref, "rsync itemized nothing: the scenario is broken"
    for r in ("local", "pull"):
        assert sorted(out[r][1]) == ref, r
    assert sorted(out["push"][1]) == sorted(sent(ref)), "push"


def same_codes(out: dict[str, tuple[int, list[str]]]) -> None:
    for r in ("local", "push", "pull"):
        assert out[r][0] == out["rsync"][0], (r, out[r][0], out["rsync"][0])


@pytest.fixture
def h(tmp_path: Any, server: Any) -> Opts:
    return Opts(tmp_path, server)


def _template(h: Opts, tmp_path: Any, extras: Any = None) -> None:
    """Each destination parent starts as ``dst`` = a copy of the source (plus ``extras(dst)``)."""
    tpl = str(tmp_path / "tpl")
    os.makedirs(tpl)
    settle(h.src)
    cp_a(h.src, os.path.join(tpl, "dst"))
    if extras is not None:
        extras(os.path.join(tpl, "dst"))
    freeze_dirs(os.path.join(tpl, "dst"), T0 + 7 * S)
    h.prepare(tpl)


def _small_tree(base: str) -> None:
    write(os.path.join(base, "a.txt"), b"alpha", 0o644, T0)
    write(os.path.join(base, "b.txt"), b"bravo", 0o644, T0)
    write(os.path.join(base, "d", "c.txt"), b"charlie", 0o640, T0)
    write(os.path.join(base, "d", "e", "deep.bin"), b"d" * 5000, 0o600, T0)
    write(os.path.join(base, "logs", "x.log"), b"log x", 0o644, T0)
    os.symlink("a.txt", os.path.join(base, "link"))
    os.utime(os.path.join(base, "link"), ns=(T0, T0), follow_symlinks=False)
    freeze_dirs(base, T0)


#: Extra directories that a --max-delete run may keep after deleting some of their entries.
KEPT = ("dst/x1", "dst/x2")


def _extras(dst: str) -> None:
    for p in ("gone1", "gone2", "gone3", "x1/y1", "x1/y2", "x2/z", "d/extra.log", "keep.log"):
        write(os.path.join(dst, p), p.encode(), 0o644, T0)


# ---- --delete-excluded ------------------------------------------------------------------------


@pytest.mark.parametrize("slash", [True, False], ids=["src-slash", "src-noslash"])
def test_delete_excluded(h: Opts, tmp_path: Any, slash: bool) -> None:
    """Excluded entries at the destination are deleted too (and implied --delete removes the rest)."""
    _small_tree(h.src)
    if slash:
        _template(h, tmp_path, _extras)
    else:
        def extras(dst: str) -> None:
            os.rename(dst, dst + ".tmp")
            os.makedirs(dst)
            os.rename(dst + ".tmp", os.path.join(dst, "src"))
            _extras(os.path.join(dst, "src"))
        _template(h, tmp_path, extras)
    out = h.go("src/" if slash else "src", "dst", ["--delete-excluded", "--exclude=*.log", "-i"],
               delete_excluded=True, exclude=["*.log"], itemize_changes=True)
    h.check(ignore_mtime=() if slash else ("dst",))
    same_codes(out)
    same_items(out)
    base = os.path.join(h.dp["local"], "dst" if slash else "dst/src")
    assert not os.path.exists(os.path.join(base, "keep.log"))
    assert not os.path.exists(os.path.join(base, "logs", "x.log"))
    assert not os.path.exists(os.path.join(base, "gone1"))


def test_delete_excluded_dry_run_changes_nothing(h: Opts, tmp_path: Any) -> None:
    _small_tree(h.src)
    _template(h, tmp_path, _extras)
    out = h.go("src/", "dst", ["-n", "-i", "--delete-excluded", "--exclude=*.log"],
               dry_run=True, itemize_changes=True, delete_excluded=True, exclude=["*.log"])
    h.check()  # every destination still equals rsync -n's: untouched
    same_items(out)
    assert os.path.exists(os.path.join(h.dp["push"], "dst", "keep.log"))


# ---- --max-delete -----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 2, 4, 5, 8, 20])
def test_max_delete(h: Opts, tmp_path: Any, n: int) -> None:
    """rsync deletes directory by directory (reverse name order, contents before their
    directory); at the limit it skips and counts the rest, keeps directories left non-empty,
    exits 25; the same entries go and stay here, with the same exit code."""
    _small_tree(h.src)
    _template(h, tmp_path, _extras)
    out = h.go("src/", "dst", ["--delete", f"--max-delete={n}", "-i"], delete=True, max_delete=n, itemize_changes=True)
    h.check(ignore_mtime=KEPT)  # an extra directory kept after deletions in it has "now" as its mtime
    same_codes(out)
    if out["rsync"][1]:
        same_items(out)
    skipped = {r: h.stats[r].deletes_skipped for r in ("local", "push", "pull")}
    assert set(skipped.values()) == {h.rsync_skipped}, skipped  # the number rsync prints


@pytest.mark.parametrize("n", [0, 1, 2, 3])
def test_max_delete_counts_what_a_replacement_clears(h: Opts, tmp_path: Any, n: int) -> None:
    """A symlink or file replacing a destination directory: rsync deletes that directory's
    contents first, counted and limited (the directory itself is not), in its walk's order; a
    directory left non-empty is not replaced ("could not make way", exit 23)."""
    write(os.path.join(h.src, "a", "a"), b"", 0o644, T0)
    os.symlink("a", os.path.join(h.src, "b"))
    write(os.path.join(h.src, "c"), b"now a file", 0o644, T0)
    freeze_dirs(h.src, T0)

    def extras(dst: str) -> None:
        shutil.rmtree(dst)
        for p in ("a/a/a", "b/a", "b/c", "c/x", "a/z"):
            write(os.path.join(dst, p), p.encode(), 0o644, T0)

    _template(h, tmp_path, extras)
    out = h.go("src/", "dst", ["--delete", f"--max-delete={n}", "-i"], delete=True, max_delete=n, itemize_changes=True)
    h.check(ignore_mtime=("dst/a/a", "dst/b", "dst/c"))
    same_codes(out)
    if out["rsync"][0] != 23:
        same_items(out)
    skipped = {r: h.stats[r].deletes_skipped for r in ("local", "push", "pull")}
    assert set(skipped.values()) == {h.rsync_skipped}, skipped


def test_max_delete_message_and_count_match_rsync(h: Opts, tmp_path: Any) -> None:
    """The number rsync prints in "Deletions stopped due to --max-delete limit (N skipped)"."""
    _small_tree(h.src)
    _template(h, tmp_path, _extras)
    ref = subprocess.run(["rsync", "-a", "--delete", "--max-delete=2", h.src + "/", os.path.join(h.dp["rsync"], "dst")],
                         capture_output=True, text=True, timeout=100, check=False)
    want = int(re.search(r"--max-delete limit \((\d+) skipped\)", ref.stderr).group(1))
    got = subprocess.run([sys.executable, "-m", "tb5sync.cli", "sync", "--delete", "--max-delete", "2", h.src + "/",
                          os.path.join(h.dp["local"], "dst")], capture_output=True, text=True, timeout=100, check=False)
    assert got.returncode == ref.returncode == 25, got.stderr
    assert f"--max-delete limit ({want} skipped)" in got.stderr
    assert "(code 25)" in got.stderr
    with pytest.raises(tb5sync.DeleteLimitError) as ei:
        tb5sync.sync(h.src + "/", h.server.url("push/dst"), delete=True, max_delete=2)
    assert ei.value.stats.deletes_skipped == want and ei.value.exit_code == 25


def test_max_delete_dry_run_agrees(h: Opts, tmp_path: Any) -> None:
    _small_tree(h.src)
    _template(h, tmp_path, _extras)
    out = h.go("src/", "dst", ["-n", "-i", "--delete", "--max-delete=3"], dry_run=True, delete=True, max_delete=3,
               itemize_changes=True)
    h.check()
    same_codes(out)
    same_items(out)


def test_max_delete_partial_failure_wins_exit_23(h: Opts, tmp_path: Any) -> None:
    """rsync's precedence: a failed entry (23) over the --max-delete stop (25)."""
    _small_tree(h.src)

    def extras(dst: str) -> None:
        _extras(dst)
        os.unlink(os.path.join(dst, "a.txt"))
        write(os.path.join(dst, "a.txt", "keep.log"), b"protected", 0o644, T0)  # non-empty dir where a file goes

    _template(h, tmp_path, extras)
    out = h.go("src/", "dst", ["--delete", "--max-delete=1", "--exclude=keep.log"], delete=True, max_delete=1,
               exclude=["keep.log"])
    h.check(ignore_mtime=KEPT)
    same_codes(out)
    assert out["rsync"][0] == 23


# ---- -i / --itemize-changes -------------------------------------------------------------------


@pytest.mark.parametrize("slash", [True, False], ids=["src-slash", "src-noslash"])
@pytest.mark.parametrize("dry", [False, True], ids=["run", "dry-run"])
def test_itemize_cold_copy(h: Opts, slash: bool, dry: bool) -> None:
    """Creations: cd+++ for directories (./ or src/), >f+++ files, cL+++ symlinks with their target."""
    _small_tree(h.src)
    out = h.go("src/" if slash else "src", "dst", ["-i", *(["-n"] if dry else [])], itemize_changes=True, dry_run=dry)
    same_items(out)
    if not dry:
        h.check(ignore_mtime=() if slash else ("dst",))


def _changes(base: str) -> None:
    """Content (size), content (same size, new mtime), mtime only, mode only, a directory's mtime
    and mode, a symlink's target and another's mtime, a new file, type changes."""
    write(os.path.join(base, "a.txt"), b"alpha, longer now", 0o644, T0 + 3 * S)
    write(os.path.join(base, "b.txt"), b"BRAVO", 0o644, T0 + 4 * S)
    os.utime(os.path.join(base, "d", "c.txt"), ns=(T0, T0 + 9 * S))
    os.chmod(os.path.join(base, "d", "e", "deep.bin"), 0o644)
    os.chmod(os.path.join(base, "logs"), 0o700)
    os.unlink(os.path.join(base, "link"))
    os.symlink("b.txt", os.path.join(base, "link"))
    write(os.path.join(base, "new.txt"), b"new", 0o644, T0)
    os.unlink(os.path.join(base, "logs", "x.log"))
    write(os.path.join(base, "logs", "x.log", "now-a-dir.txt"), b"x", 0o644, T0)
    freeze_dirs(base, T0 + 20 * S)
    os.utime(os.path.join(base, "link2"), ns=(T0, T0 + 5 * S), follow_symlinks=False)
    os.utime(os.path.join(base, "d"), ns=(T0, T0 + 30 * S))


@pytest.mark.parametrize("dry", [False, True], ids=["run", "dry-run"])
@pytest.mark.parametrize("checksum", [False, True], ids=["quick", "checksum"])
def test_itemize_changes(h: Opts, tmp_path: Any, dry: bool, checksum: bool) -> None:
    _small_tree(h.src)
    os.symlink("d", os.path.join(h.src, "link2"))
    os.utime(os.path.join(h.src, "link2"), ns=(T0, T0), follow_symlinks=False)
    _template(h, tmp_path, lambda dst: write(os.path.join(dst, "extra.txt"), b"x", 0o644, T0))
    _changes(h.src)
    args = ["-i", "--delete", *(["-n"] if dry else []), *(["-c"] if checksum else [])]
    out = h.go("src/", "dst", args, itemize_changes=True, delete=True, dry_run=dry, checksum=checksum)
    same_items(out)
    h.check()
    lines = out["local"][1]
    assert "*deleting   extra.txt" in lines and any(ln.startswith("cL") for ln in lines)


@pytest.mark.parametrize("delete,nonempty", [(False, False), (True, True)], ids=["no-delete", "delete-nonempty"])
def test_itemize_type_changes(h: Opts, tmp_path: Any, delete: bool, nonempty: bool) -> None:
    """file->dir, dir->file, link->file, link->dir, file->link: what rsync -i prints for each."""
    _type_tree(h.src)
    _template(h, tmp_path)
    _change_types(h.src, nonempty_dirs=nonempty)
    out = h.go("src/", "dst", ["-i", *(["--delete"] if delete else [])], itemize_changes=True, delete=delete)
    h.check()
    same_codes(out)
    same_items(out)


def test_itemize_push_over_rsync_remote_shell(tmp_path: Any, server: Any) -> None:
    """rsync itself, pushing through a remote shell (run locally), prints what our push prints."""
    src = str(tmp_path / "src")
    _small_tree(src)
    rsh = tmp_path / "rsh"
    rsh.write_text('#!/bin/sh\nshift\nexec "$@"\n')
    rsh.chmod(0o755)
    settle(src)
    ref = subprocess.run(["rsync", "-a", "-i", "-e", str(rsh), src + "/", f"localhost:{tmp_path}/viarsh/"],
                         capture_output=True, text=True, timeout=100, check=True)
    st = tb5sync.sync(src + "/", server.url("pushed"), itemize_changes=True)
    assert sorted(st.itemized) == sorted(items_of(ref.stdout))
    assert any(ln.startswith("<f+++++++++ ") for ln in st.itemized)


def test_itemize_cli_and_json(tmp_path: Any) -> None:
    """``-i`` prints the lines (as rsync -i does); ``--json`` carries them as a list."""
    src = str(tmp_path / "src")
    _small_tree(src)
    settle(src)
    os.makedirs(tmp_path / "rsync")  # rsync names the destination as given: "t" in both runs
    ref = subprocess.run(["rsync", "-a", "-i", src + "/", "t"], capture_output=True, text=True,
                         timeout=100, check=True, cwd=tmp_path / "rsync")
    created = [ln for ln in ref.stdout.splitlines() if ln.startswith("created directory ")]
    assert created == ["created directory t"]
    cmd = [sys.executable, "-m", "tb5sync.cli", "sync", "-i"]
    got = subprocess.run([*cmd, src + "/", "t"], capture_output=True, text=True, timeout=100, check=True, cwd=tmp_path)
    assert sorted(got.stdout.splitlines()) == sorted(items_of(ref.stdout) + created)
    js = subprocess.run([*cmd, "-n", "--json", src + "/", "t2"], capture_output=True, text=True,
                        timeout=100, check=True, cwd=tmp_path)
    assert sorted(json.loads(js.stdout)["itemized"]) == sorted(items_of(ref.stdout))
    assert json.loads(js.stdout)["created"] == ["created directory t2"]


# ---- -u, --ignore-existing, --size-only -------------------------------------------------------


def _newer_and_older(dst: str) -> None:
    write(os.path.join(dst, "a.txt"), b"newer at the destination", 0o600, T0 + 100 * S)
    write(os.path.join(dst, "b.txt"), b"older", 0o644, T0 - 100 * S)
    write(os.path.join(dst, "d", "c.txt"), b"same time, other size", 0o640, T0)
    os.unlink(os.path.join(dst, "link"))
    os.symlink("elsewhere", os.path.join(dst, "link"))
    os.utime(os.path.join(dst, "link"), ns=(T0, T0 + 100 * S), follow_symlinks=False)  # a newer symlink is still replaced
    shutil.rmtree(os.path.join(dst, "logs"))
    write(os.path.join(dst, "logs"), b"a newer file where the source has a directory", 0o644, T0 + 100 * S)


def test_update(h: Opts, tmp_path: Any) -> None:
    _small_tree(h.src)
    _template(h, tmp_path, _newer_and_older)
    out = h.go("src/", "dst", ["-u", "-i"], update=True, itemize_changes=True)
    h.check()
    same_codes(out)
    same_items(out)
    assert slurp(os.path.join(h.dp["pull"], "dst", "a.txt")) == b"newer at the destination"


def test_ignore_existing(h: Opts, tmp_path: Any) -> None:
    _small_tree(h.src)

    def extras(dst: str) -> None:
        write(os.path.join(dst, "a.txt"), b"other content", 0o600, T0 + 100 * S)
        os.unlink(os.path.join(dst, "b.txt"))
        os.chmod(os.path.join(dst, "d", "c.txt"), 0o600)
        os.unlink(os.path.join(dst, "link"))
        shutil.rmtree(os.path.join(dst, "d", "e"))

    _template(h, tmp_path, extras)
    os.utime(os.path.join(h.src, "d"), ns=(T0, T0 + 50 * S))
    out = h.go("src/", "dst", ["--ignore-existing", "-i"], ignore_existing=True, itemize_changes=True)
    h.check()
    same_codes(out)
    same_items(out)


def test_ignore_existing_file_where_source_has_directory(h: Opts, tmp_path: Any) -> None:
    """A destination file kept where the source has a directory: the directory's entries fail
    ("Not a directory"), exit 23, everything else synced, as rsync does."""
    _small_tree(h.src)

    def extras(dst: str) -> None:
        shutil.rmtree(os.path.join(dst, "logs"))
        write(os.path.join(dst, "logs"), b"a file", 0o644, T0)
        write(os.path.join(dst, "extra"), b"x", 0o644, T0)

    _template(h, tmp_path, extras)
    write(os.path.join(h.src, "added.txt"), b"added", 0o644, T0)
    freeze_dirs(h.src, T0 + 3 * S)
    out = h.go("src/", "dst", ["--ignore-existing", "--delete"], ignore_existing=True, delete=True)
    h.check()  # the kept file gets the source directory's mtime, as rsync gives it
    same_codes(out)
    assert out["rsync"][0] == 23
    for r in ("local", "push", "pull"):
        assert [f.path for f in h.stats[r].failures] == ["logs/x.log"], r


def test_size_only(h: Opts, tmp_path: Any) -> None:
    """Same size, other content and mtime: left (its mode and mtime set); another size: sent."""
    _small_tree(h.src)
    _template(h, tmp_path)
    write(os.path.join(h.src, "a.txt"), b"ALPHA", 0o600, T0 + 10 * S)  # same size
    write(os.path.join(h.src, "b.txt"), b"bravo!", 0o644, T0)  # other size, same mtime
    freeze_dirs(h.src, T0)
    out = h.go("src/", "dst", ["--size-only", "-i"], size_only=True, itemize_changes=True)
    h.check()
    same_items(out)
    assert slurp(os.path.join(h.dp["push"], "dst", "a.txt")) == b"alpha"


# ---- --bwlimit --------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["local", "push", "pull"])
def test_bwlimit_paces_the_sender(tmp_path: Any, server: Any, route: str) -> None:
    """2 MiB of incompressible data (small and large files, 4 streams) at 4 MiB/s take at least
    ~0.5 s, and arrive whole; rsync copies the same tree to the same result."""
    src = os.path.join(server.root, "bw") if route == "pull" else str(tmp_path / "bw")
    os.makedirs(src)
    for i in range(8):
        write(os.path.join(src, f"s{i}.bin"), os.urandom(128 * 1024), 0o644, T0)
    write(os.path.join(src, "big.bin"), os.urandom(1024 * 1024 + 17 * 1024), 0o644, T0)  # not a full 4 MiB chunk
    subprocess.run(["rsync", "-a", "--bwlimit=4M", src + "/", str(tmp_path / "ref")], check=True, timeout=100)
    dst = str(tmp_path / "out")
    a, b = {"local": (src + "/", dst), "push": (src + "/", server.url("bwdst")),
            "pull": (server.url("bw/"), dst)}[route]
    t0 = time.perf_counter()
    st = tb5sync.sync(a, b, bwlimit="4M", compress="none")
    took = time.perf_counter() - t0
    nbytes = 8 * 128 * 1024 + 1024 * 1024 + 17 * 1024
    assert st.bytes_transferred == nbytes
    assert took >= nbytes / (4 * 1024 * 1024) - 0.1, took
    got = os.path.join(server.root, "bwdst") if route == "push" else dst
    for name in os.listdir(src):
        assert slurp(os.path.join(got, name)) == slurp(os.path.join(tmp_path, "ref", name))


def test_bwlimit_units_like_rsync() -> None:
    from tb5sync.tree.options import parse_rate

    assert parse_rate("0") == 0 and parse_rate("") == 0
    assert parse_rate("100") == 100 * 1024
    assert parse_rate("1.5") == 1536
    assert parse_rate("4M") == parse_rate("4m") == parse_rate("4MiB") == 4 * 1024 * 1024
    assert parse_rate("4MB") == 4_000_000
    assert parse_rate("512b") == 512
    for bad in ("2x", "-1", "100b", "1.5.5"):  # rsync: invalid, or too small (min 512 bytes)
        ref = subprocess.run(["rsync", "-n", f"--bwlimit={bad}", "/dev/null", "/dev/null"], capture_output=True,
                             text=True, timeout=30, check=False)
        assert ref.returncode != 0, bad
        with pytest.raises(UsageError):
            parse_rate(bad)


# ---- API boundary, old servers, CLI leftovers -------------------------------------------------


@pytest.mark.parametrize("kw,exc", [
    ({"max_delete": -1}, ValueError), ({"max_delete": "3"}, TypeError), ({"max_delete": True}, TypeError),
    ({"bwlimit": "fast"}, ValueError), ({"bwlimit": [1]}, TypeError), ({"bwlimit": -5}, ValueError),
    ({"update": 1}, TypeError), ({"size_only": "yes"}, TypeError), ({"ignore_existing": None}, TypeError),
    ({"delete_excluded": 0}, TypeError), ({"itemize_changes": "y"}, TypeError),
])
def test_api_checks_arguments(tmp_path: Any, kw: dict[str, Any], exc: type) -> None:
    os.makedirs(tmp_path / "s")
    with pytest.raises(exc) as ei:
        tb5sync.sync(str(tmp_path / "s") + "/", str(tmp_path / "d"), **kw)
    assert next(iter(kw)) in str(ei.value) or "bwlimit" in str(ei.value)
    assert not os.path.exists(tmp_path / "d")


@pytest.mark.parametrize("kw,flag", [
    ({"delete": True, "max_delete": 1}, "--max-delete"), ({"delete_excluded": True}, "--delete-excluded"),
    ({"update": True}, "--update"), ({"ignore_existing": True}, "--ignore-existing"),
    ({"size_only": True}, "--size-only"), ({"itemize_changes": True}, "--itemize-changes"),
    ({"bwlimit": 100}, "--bwlimit"),
])
@pytest.mark.parametrize("route", ["push", "pull"])
def test_old_server_refuses_instead_of_ignoring(tmp_path: Any, monkeypatch: Any, kw: dict[str, Any], flag: str,
                                              route: str) -> None:
    """A server that does not list an option in its OPEN reply (as one from before these options)
    makes the client fail, naming the option, before anything changes."""
    import tb5sync.daemon.sessions as sessions_mod

    monkeypatch.setattr(sessions_mod, "known_options", lambda: ["delete", "excludes", "checksum", "dry_run", "compress",
                                                          "streams", "exclude_root", "fsync"])
    live = start_server(str(tmp_path / "root"))
    try:
        src = str(tmp_path / "src")
        make_tree(src, files=4)
        os.makedirs(os.path.join(live.root, "dst"))
        write(os.path.join(live.root, "dst", "precious"), b"keep", 0o644, T0)
        os.makedirs(os.path.join(live.root, "psrc"))
        local = str(tmp_path / "local")
        os.makedirs(local)
        write(os.path.join(local, "precious"), b"keep", 0o644, T0)
        for streams in (1, 4):
            with pytest.raises(UsageError, match=re.escape(flag)):
                if route == "push":
                    tb5sync.sync(src + "/", live.url("dst"), streams=streams, **kw)
                else:
                    tb5sync.sync(live.url("psrc/"), local, streams=streams, **kw)
        assert sorted(os.listdir(os.path.join(live.root, "dst"))) == ["precious"]
        assert sorted(os.listdir(local)) == ["precious"]
        tb5sync.sync(src + "/", live.url("dst"))  # options it knows still work
    finally:
        live.server.stop()


def test_missing_local_source_says_so(tmp_path: Any, server: Any) -> None:
    """A missing local source is a FileNotFoundError whose class and message name the local
    source (still catchable as the RemoteNotFoundError it used to be), locally and in a push."""
    os.symlink("nowhere", tmp_path / "dangling")
    for dst in (str(tmp_path / "d"), server.url("d")):
        with pytest.raises(tb5sync.SourceNotFoundError, match="local source does not exist") as ei:
            tb5sync.sync(str(tmp_path / "nope"), dst)
        assert isinstance(ei.value, FileNotFoundError) and isinstance(ei.value, tb5sync.RemoteNotFoundError)
        with pytest.raises(tb5sync.SourceNotFoundError, match="local source .* is a symlink to nothing"):
            tb5sync.sync(str(tmp_path / "dangling") + "/", dst)
    r = subprocess.run([sys.executable, "-m", "tb5sync.cli", "sync", str(tmp_path / "nope"), str(tmp_path / "d")],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 23 and "local source does not exist" in r.stderr
    with pytest.raises(tb5sync.RemoteNotFoundError) as ei2:
        tb5sync.sync(server.url("nope"), str(tmp_path / "d"))
    assert not isinstance(ei2.value, tb5sync.SourceNotFoundError)


@pytest.mark.parametrize("slash", [True, False], ids=["src-slash", "src-noslash"])
@pytest.mark.parametrize("exists", [True, False], ids=["dst-exists", "dst-new"])
def test_cli_dry_run_prints_what_rsync_n_v_prints(tmp_path: Any, server: Any, slash: bool, exists: bool) -> None:
    """``-n`` prints the change list rsync -n -v prints (no statistics unless --stats), local and
    in a push."""
    src = str(tmp_path / "src")
    _small_tree(src)
    settle(src)
    dst = str(tmp_path / "dst")
    if exists:
        write(os.path.join(dst, "old.txt"), b"old", 0o644, T0)
        if not slash:
            write(os.path.join(dst, "src", "old.txt"), b"old", 0o644, T0)
        cp_a(dst, os.path.join(server.root, "dst"))
    s = src + "/" if slash else src
    # run in tmp_path with "dst" relative: rsync's "created directory dst" names the destination as
    # given, and a push's is the URL's path
    ref = subprocess.run(["rsync", "-a", "-n", "-v", "--delete", s, "dst"], capture_output=True, text=True,
                         timeout=60, check=True, cwd=tmp_path)
    want = sorted(ln for ln in ref.stdout.splitlines()[1:] if ln and not ln.startswith(("sent ", "total size")))
    assert ("created directory dst" in want) == (not exists)
    for target in ("dst", server.url("dst")):
        cmd = [sys.executable, "-m", "tb5sync.cli", "sync", "-n", "--delete", s, target]
        got = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True, cwd=tmp_path)
        assert sorted(got.stdout.splitlines()) == want, target
        with_stats = subprocess.run([*cmd, "--stats"], capture_output=True, text=True, timeout=60, check=True)
        assert any(ln.startswith("files:") and "would transfer" in ln for ln in with_stats.stdout.splitlines())
    if exists:  # nothing changed
        assert sorted(os.listdir(dst)) == (["old.txt", "src"] if not slash else ["old.txt"])
    else:
        assert not os.path.exists(dst) and not os.path.exists(os.path.join(server.root, "dst"))


# ---- property test: random trees, random options, local -> local ------------------------------

_option = st.sampled_from([
    ("--update", {"update": True}), ("--ignore-existing", {"ignore_existing": True}),
    ("--size-only", {"size_only": True}), ("--checksum", {"checksum": True}),
    ("--delete-excluded --exclude=a", {"delete_excluded": True, "exclude": ["a"]}),
    ("--delete-excluded --exclude=dd/", {"delete_excluded": True, "exclude": ["dd/"]}),
    *((f"--delete --max-delete={n}", {"delete": True, "max_delete": n}) for n in (0, 1, 2, 3)),
    ("--delete --update --size-only", {"delete": True, "update": True, "size_only": True}),
])


@pytest.mark.parametrize("dry", [False, True], ids=["run", "dry-run"])
@pytest.mark.parametrize("file_below", [True, False], ids=["file-below", "no-file-below"])
def test_ignore_existing_entries_below_a_kept_file(h: Opts, tmp_path: Any, dry: bool, file_below: bool) -> None:
    """Below a destination file kept where the source has a directory, rsync's generator fails
    each entry right below it (a file's stat, a link, a directory's mkdir after its ``cd+++`` line)
    and skips a failed directory's contents; ``rsync -n`` fails only the files there and itemizes
    the rest as new, down the whole subtree (exit 0 when no file is right below)."""
    _small_tree(h.src)
    os.unlink(os.path.join(h.src, "logs", "x.log"))
    if file_below:
        write(os.path.join(h.src, "logs", "x.log"), b"log x", 0o644, T0)
    write(os.path.join(h.src, "logs", "sub", "y.log"), b"y", 0o644, T0)
    write(os.path.join(h.src, "logs", "sub", "z", "w.log"), b"w", 0o644, T0)
    os.symlink("elsewhere", os.path.join(h.src, "logs", "l"))
    freeze_dirs(h.src, T0 + 3 * S)

    def extras(dst: str) -> None:
        shutil.rmtree(os.path.join(dst, "logs"))
        write(os.path.join(dst, "logs"), b"a file", 0o644, T0)

    _template(h, tmp_path, extras)
    write(os.path.join(h.src, "added.txt"), b"added", 0o644, T0)
    freeze_dirs(h.src, T0 + 5 * S)
    args = ["--ignore-existing", "-i", *(["-n"] if dry else [])]
    out = h.go("src/", "dst", args, ignore_existing=True, itemize_changes=True, dry_run=dry)
    same_codes(out)
    assert out["rsync"][0] == (0 if dry and not file_below else 23)
    same_items(out)
    if not dry:
        h.check()

def _unescape(text: str) -> str:
    """rsync writes a non-ASCII byte of a name as ``\\#ooo`` (octal)."""
    return re.sub(rb"\\#([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), text.encode()).decode()


@pytest.mark.timeout(600)
@settings(max_examples=int(os.environ.get("TB5SYNC_OPTION_EXAMPLES", "60")), deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(src_items=_tree, dst_items=_tree, option=_option, dry=st.booleans())
def test_property_options_local_equal_rsync(src_items: list[Any], dst_items: list[Any], option: tuple[str, dict[str, Any]],
                                            dry: bool) -> None:
    """The tree, the exit code and the itemized lines of ``rsync -a -i [-n] OPTION`` on random
    trees, against tb5sync's, local to local."""
    args, kw = option
    if kw.get("ignore_existing"):
        # rsync looks for a source directory's entries through a destination symlink in its place
        # (and finds them "existing" there); tb5sync never goes through a destination symlink
        # and names them as failures instead ("Not a directory")
        links = {rel for kind, rel, *_ in dst_items if kind == "l"}
        assume(not any(rel.split("/")[0] in links or any("/".join(rel.split("/")[:k]) in links
                                                          for k in range(1, rel.count("/") + 1))
                       for _, rel, *_ in src_items))
    with tempfile.TemporaryDirectory(prefix="tb5-opts-") as tmp:
        src = os.path.join(tmp, "src")
        build_tree(src, src_items, salt=1)
        ref, mine = os.path.join(tmp, "ref"), os.path.join(tmp, "mine")
        build_tree(ref, dst_items, salt=2)
        cp_a(ref, mine)
        proc = subprocess.run(["rsync", "-a", "-i", *(["-n"] if dry else []), *args.split(), src + "/", ref],
                              capture_output=True, text=True, timeout=100, check=False)
        assert proc.returncode in (0, 23, 25), proc.stderr
        try:
            st_, code = tb5sync.sync(src + "/", mine, itemize_changes=True, dry_run=dry, **kw), 0
        except PartialTransferError as exc:
            st_, code = exc.stats, exc.exit_code
        assert code == proc.returncode, (proc.stdout, proc.stderr, st_.itemized)
        m = re.search(r"--max-delete limit \((\d+) skipped\)", proc.stderr)
        assert st_.deletes_skipped == (int(m.group(1)) if m else 0), proc.stderr
        # a directory kept after some deletions in it (max-delete) has "now" as its mtime on both sides
        kept = {p for p, v in digest_snapshot(ref, ()).items() if v[0] == "d" and not os.path.isdir(os.path.join(src, p))}
        assert_same(digest_snapshot(ref, kept), digest_snapshot(mine, kept), "local")
        if code != 23:  # where an entry failed, rsync may still itemize it
            assert sorted(st_.itemized) == sorted(items_of(_unescape(proc.stdout))), proc.stdout


# ---- -i / -n with --link-dest ------------------------------------------------------------------


def _snapshot_changes(base: str) -> None:
    """Against the previous snapshot: a mode alone (rsync copies it locally: ``cf``), a size, an
    mtime, a new file, a new directory, a directory's mtime; the rest unchanged (linked)."""
    os.chmod(os.path.join(base, "a.txt"), 0o600)
    write(os.path.join(base, "b.txt"), b"BRAVO, longer", 0o644, T0 + 2 * S)
    os.utime(os.path.join(base, "d", "c.txt"), ns=(T0, T0 + 9 * S))
    write(os.path.join(base, "new.txt"), b"new", 0o644, T0)
    write(os.path.join(base, "newdir", "n.txt"), b"n", 0o644, T0)
    freeze_dirs(base, T0 + 7 * S)
    os.utime(os.path.join(base, "d"), ns=(T0, T0 + 30 * S))


@pytest.mark.parametrize("dry", [False, True], ids=["run", "dry-run"])
def test_itemize_link_dest_shows_only_what_changed(h: Opts, dry: bool) -> None:
    """With --link-dest, rsync -i leaves out what it links and shows the rest against the
    snapshot's copy (``>f.s.......``, ``cf...p.....``, ``cd..t......``), not as created."""
    _small_tree(h.src)
    freeze_dirs(h.src, T0 + 7 * S)
    h.go("src/", "snap1", [], link_dest=[])
    _snapshot_changes(h.src)
    out = h.go("src/", "snap2", ["-i", "--link-dest=../snap1", *(["-n"] if dry else [])],
               itemize_changes=True, link_dest=["../snap1"], dry_run=dry)
    same_items(out)
    assert not any(ln.endswith(" e/deep.bin") for ln in out["local"][1])  # linked: not listed
    if not dry:
        st = tb5sync.sync(h.src + "/", os.path.join(h.dp["local"], "snap3"), link_dest=["../snap1"], dry_run=True)
        assert st.extra["changes"]["lines"] == [ln[12:] for ln in out["local"][1]]  # -n lists the same


# ---- rsync's spelling on the command line ------------------------------------------------------


def _cli(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tb5sync.cli", *args], capture_output=True, text=True,
                          timeout=100, check=False, cwd=cwd)


def test_cli_takes_rsync_archive_spellings(tmp_path: Any) -> None:
    """``-av``, ``-rlptgoD``, ``-z``, ``-P``, ``-h``, ``--delete-after``: accepted, and the tree is
    the one ``rsync -a`` makes; ``-v`` lists what rsync -v lists."""
    src = str(tmp_path / "src")
    _small_tree(src)
    settle(src)
    ref = subprocess.run(["rsync", "-av", src + "/", str(tmp_path / "r")], capture_output=True, text=True,
                         timeout=100, check=True)
    got = _cli("sync", "-av", src + "/", str(tmp_path / "t"))
    assert got.returncode == 0, got.stderr
    ref_names = [ln for ln in ref.stdout.splitlines()[1:] if ln and not ln.startswith(("sent ", "total size"))]
    assert f"created directory {tmp_path / 'r'}" in ref_names  # rsync -v names the destination it made
    ref_names = [f"created directory {tmp_path / 't'}" if ln.startswith("created directory ") else ln for ln in ref_names]
    assert sorted(got.stdout.splitlines()) == sorted(ref_names)
    assert digest_snapshot(str(tmp_path / "t")) == digest_snapshot(str(tmp_path / "r"))
    for flags in (["-rlptgoD"], ["-a", "-z", "-P", "-h", "--stats"], ["--archive", "--partial", "--verbose", "--compress"], ["--compress", "none", "-a"],
                  ["-aH", "--delete-after"], ["-a", "--delete-before"], ["--del"], ["--devices", "--specials"]):
        shutil.rmtree(str(tmp_path / "t"))
        p = _cli("sync", *flags, src + "/", str(tmp_path / "t"))
        assert p.returncode == 0, (flags, p.stderr)
        assert digest_snapshot(str(tmp_path / "t")) == digest_snapshot(str(tmp_path / "r")), flags


def test_cli_delete_aliases_delete(tmp_path: Any) -> None:
    """``--delete-after`` (and its kin) delete as rsync's do."""
    src = str(tmp_path / "src")
    _small_tree(src)
    for flag in ("--delete-after", "--delete-before", "--delete-during", "--delete-delay", "--del"):
        for d in ("r", "t"):
            write(str(tmp_path / d / "extra.txt"), b"x", 0o644, T0)
        subprocess.run(["rsync", "-a", flag, src + "/", str(tmp_path / "r")], timeout=100, check=True)
        p = _cli("sync", flag, src + "/", str(tmp_path / "t"))
        assert p.returncode == 0, p.stderr
        assert not os.path.exists(str(tmp_path / "r" / "extra.txt"))
        assert digest_snapshot(str(tmp_path / "t")) == digest_snapshot(str(tmp_path / "r")), flag


@pytest.mark.parametrize("args, named", [(["--hard-links-x"], "--hard-links-x"), (["-aA"], "-A"),
                                         (["--chown=a:b"], "--chown"), (["-avq"], "-q"), (["-e", "ssh"], "-e"),
                                         # a value holding a space: argparse would take it for SRC
                                         (["--filter=- *.bin"], "--filter"), (["--chmod=a b"], "--chmod"),
                                         (["--exclude-from=a b"], "--exclude-from"), (["-f- *.bin"], "-f "),
                                         (["-a", "--filter=- *.bin", "-v"], "--filter")])
def test_cli_unknown_rsync_option_one_line(tmp_path: Any, args: list[str], named: str) -> None:
    """An rsync option tb5sync does not take: one line naming it, exit 2, nothing written."""
    src = str(tmp_path / "src")
    _small_tree(src)
    p = _cli("sync", *args, src + "/", str(tmp_path / "t"))
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and named in p.stderr and "not supported" in p.stderr, p.stderr
    assert "usage" not in p.stderr
    assert not os.path.exists(str(tmp_path / "t"))


@pytest.mark.usefixtures("need_rsync")
def test_cli_known_options_and_operands_with_spaces(tmp_path: Any) -> None:
    """Known options whose value holds a space, and operands with spaces (after ``--`` too, even one
    starting with ``-``), are still taken as rsync takes them: same tree as rsync's."""
    base = tmp_path / "my src"
    _small_tree(str(base))
    write(str(base / "a b"), b"x", 0o644, T0)
    write(str(base / "keep"), b"y", 0o644, T0)
    for opts in (["--exclude=a b"], ["--exclude", "a b"]):
        r, t = str(tmp_path / "r dst"), str(tmp_path / "t dst")
        shutil.rmtree(r, ignore_errors=True)
        shutil.rmtree(t, ignore_errors=True)
        subprocess.run(["rsync", "-a", *opts, str(base) + "/", r], timeout=100, check=True)
        p = _cli("sync", *opts, str(base) + "/", t)
        assert p.returncode == 0, p.stderr
        assert not os.path.exists(os.path.join(r, "a b"))
        assert digest_snapshot(t) == digest_snapshot(r), opts
    odd = tmp_path / "-odd name"
    _small_tree(str(odd))
    subprocess.run(["rsync", "-a", "--", "-odd name/", "r odd"], cwd=str(tmp_path), timeout=100, check=True)
    p = _cli("sync", "--", "-odd name/", "t odd", cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert digest_snapshot(str(tmp_path / "t odd")) == digest_snapshot(str(tmp_path / "r odd"))


def test_cli_h_alone_is_help() -> None:
    p = _cli("sync", "-h")
    assert p.returncode == 0 and "--link-dest" in p.stdout and "--human-readable" in p.stdout


# ---- -i with -H and -X --------------------------------------------------------------------------


@pytest.mark.parametrize("slash", [True, False], ids=["src-slash", "src-noslash"])
@pytest.mark.parametrize("dry", [False, True], ids=["run", "dry-run"])
def test_itemize_hard_links(h: Opts, slash: bool, dry: bool) -> None:
    """-H -i: a group's other paths as rsync shows them, ``hf+++++++++ a => d/e/c`` (linked to the
    group's last path in rsync's file-list order), on a cold copy and a re-run adding a group."""
    from test_link_options_vs_rsync import _hardlink_tree

    _hardlink_tree(h.src)
    spec = "src/" if slash else "src"
    out = h.go(spec, "dst", ["-H", "-i", *(["-n"] if dry else [])], hard_links=True, itemize_changes=True, dry_run=dry)
    same_items(out)
    assert any(ln.startswith("hf+++++++++ ") and " => " in ln for ln in out["local"][1])
    if dry:
        return
    write(os.path.join(h.src, "n1"), b"new group", 0o644, T0)
    os.link(os.path.join(h.src, "n1"), os.path.join(h.src, "d", "e", "n2"))
    os.link(os.path.join(h.src, "n1"), os.path.join(h.src, "n0"))
    freeze_dirs(h.src, T0)
    same_items(h.go(spec, "dst", ["-H", "-i"], hard_links=True, itemize_changes=True))


def _link_groups_tree(src: str) -> None:
    """Hard-link groups of 2, 3 and 5 paths across directories, whose first paths and last paths
    (in rsync's file-list order) sort differently: the order of the ``hf`` lines tells them apart."""
    groups = {"z/z1": ["a", "q/a2"], "c/c1": ["b", "q/b2"], "q/x": ["q/y"],
              "e/z": ["m", "d/y", "e/k", "e/f/g/h"]}
    for first, others in groups.items():
        write(os.path.join(src, first), first.encode() * 50, 0o644, T0)
        for o in others:
            os.makedirs(os.path.dirname(os.path.join(src, o)), exist_ok=True)
            os.link(os.path.join(src, first), os.path.join(src, o))
    write(os.path.join(src, "single"), b"alone", 0o644, T0)
    freeze_dirs(src, T0)


@pytest.mark.parametrize("opts", [["-H"], ["-H", "-X"]], ids=["H", "HX"])
@pytest.mark.parametrize("dry", [False, True], ids=["run", "dry-run"])
def test_itemize_hard_link_lines_in_rsync_order(h: Opts, opts: list[str], dry: bool) -> None:
    """-H -i (with -X too, and -a's -p -o -g): every ``hf`` line names the path it is linked to
    (``=> PATH``), and the lines come in rsync's order, compared as lists: group by group in the
    file-list order of that path, each group's paths in reverse file-list order; then a re-run
    that adds a new group."""
    _link_groups_tree(h.src)
    kw: dict[str, Any] = {"hard_links": True, "itemize_changes": True, "xattrs": "-X" in opts}
    out = h.go("src/", "dst", [*opts, "-i", *(["-n"] if dry else [])], dry_run=dry, **kw)
    same_items(out)
    ref = [ln for ln in out["rsync"][1] if ln.startswith("hf")]
    assert len(ref) == 9 and all(" => " in ln for ln in ref), ref
    for r in ("local", "push", "pull"):
        assert [ln for ln in out[r][1] if ln.startswith("hf")] == ref, r
    if dry:
        return
    os.makedirs(os.path.join(h.src, "n"))
    write(os.path.join(h.src, "n", "p"), b"new group", 0o644, T0)
    os.link(os.path.join(h.src, "n", "p"), os.path.join(h.src, "c", "p0"))
    os.link(os.path.join(h.src, "n", "p"), os.path.join(h.src, "o"))
    freeze_dirs(h.src, T0)
    out = h.go("src/", "dst", [*opts, "-i"], **kw)
    same_items(out)
    ref = [ln for ln in out["rsync"][1] if ln.startswith("hf")]
    assert len(ref) == 2, ref
    for r in ("local", "push", "pull"):
        assert [ln for ln in out[r][1] if ln.startswith("hf")] == ref, r


@pytest.mark.parametrize("dry", [False, True], ids=["run", "dry-run"])
def test_itemize_xattrs(h: Opts, dry: bool) -> None:
    """-X -i: rsync's x column, on a line of its own for an entry changed in nothing else
    (``.f........x f``, ``.d........x ./``) and with the other columns (``>f..t.....x``)."""
    from test_link_options_vs_rsync import _xattr_tree

    _xattr_tree(h.src)
    try:
        os.setxattr(h.sp, "user.probe", b"1")
    except OSError:
        pytest.skip("no user extended attributes on this file system")
    same_items(h.go("src/", "dst", ["-X", "-i"], xattrs=True, itemize_changes=True))
    os.setxattr(os.path.join(h.src, "f"), "user.colour", b"red")  # changed value
    os.removexattr(os.path.join(h.src, "d"), "user.dir")  # removed, on a directory
    os.setxattr(os.path.join(h.src, "plain"), "user.new", b"n")  # added
    os.setxattr(h.src, "user.root", b"top2")  # the base
    write(os.path.join(h.src, "d", "g"), b"other", 0o600, T0 + 3 * S)  # content rewritten, xattr lost
    freeze_dirs(h.src, T0)
    out = h.go("src/", "dst", ["-X", "-i", *(["-n"] if dry else [])], xattrs=True, itemize_changes=True, dry_run=dry)
    same_items(out)
    assert ".f........x f" in out["local"][1] and ".d........x ./" in out["local"][1]


# ---- sub-second mtime differences ---------------------------------------------------------------


@pytest.mark.parametrize("dry", [False, True], ids=["run", "dry-run"])
@pytest.mark.parametrize("delta", [300_000_000, -100_000_000, 900_000_000], ids=["+0.3s", "-0.1s", "next-second"])
def test_sub_second_mtime_differences_as_rsync(h: Opts, tmp_path: Any, dry: bool, delta: int) -> None:
    """rsync (default --modify-window=0) compares mtimes in whole seconds: a directory's or a
    symlink's difference in the fraction alone is not itemized; one crossing a second is.
    (Directories still get the source's mtime to the ns, where rsync leaves one within the same
    second as it was; files are compared to the ns on purpose: test_sub_second_file_rewrite_is_sent.)"""
    base = T0 - T0 % S + 100_000_000  # x.1 s
    write(os.path.join(h.src, "f"), b"file", 0o644, base)
    write(os.path.join(h.src, "d", "g"), b"gee", 0o600, base)
    os.symlink("f", os.path.join(h.src, "lnk"))
    os.utime(os.path.join(h.src, "lnk"), ns=(base, base), follow_symlinks=False)
    freeze_dirs(h.src, base)
    tpl = str(tmp_path / "tpl")
    os.makedirs(tpl)
    cp_a(h.src, os.path.join(tpl, "dst"))  # each destination: the source as it is, to the ns
    h.prepare(tpl)
    for p in ("lnk", "d", ""):
        os.utime(os.path.join(h.src, p), ns=(base + delta, base + delta), follow_symlinks=False)
    out = h.go("src/", "dst", ["-i", *(["-n"] if dry else [])], itemize_changes=True, dry_run=dry)
    for r in ("local", "pull"):
        assert sorted(out[r][1]) == sorted(out["rsync"][1]), r
    assert sorted(out["push"][1]) == sorted(sent(out["rsync"][1]))
    assert bool(out["rsync"][1]) == (delta == 900_000_000)  # the scenario: only a new second shows
    if not dry:
        h.check(ignore_mtime=("dst", "dst/d"))


def test_sub_second_file_rewrite_is_sent(tmp_path: Any) -> None:
    """A deliberate difference from rsync: a same-size file rewritten within the second keeps a
    whole-second mtime rsync cannot tell apart, and rsync leaves the old content; tb5sync
    compares files to the ns and sends it (``>f..t......``)."""
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    base = T0 - T0 % S + 100_000_000
    write(os.path.join(src, "f"), b"old!", 0o644, base)
    tb5sync.sync(src + "/", dst)
    write(os.path.join(src, "f"), b"new!", 0o644, base + 300_000_000)
    st = tb5sync.sync(src + "/", dst, itemize_changes=True)
    assert st.itemized == (">f..t...... f",) and slurp(os.path.join(dst, "f")) == b"new!"


# ---- the order of -i's lines ---------------------------------------------------------------------


def _nested_extras(dst: str) -> None:
    for p in ("a/a1", "a/x/x1", "a/y/y1", "b/b1", "r1", "zz", "a/x/dd/q", "a/x/dd/e/q2", "b/old/o"):
        write(os.path.join(dst, p), b"extra", 0o644, T0)
    os.unlink(os.path.join(dst, "f"))
    os.makedirs(os.path.join(dst, "f", "inside"))  # a directory the source's file replaces
    write(os.path.join(dst, "f", "inside", "k"), b"k", 0o644, T0)


@pytest.mark.parametrize("dry", [False, True], ids=["run", "dry-run"])
def test_itemize_deletions_in_rsync_order(h: Opts, tmp_path: Any, dry: bool) -> None:
    """--delete -i: the ``*deleting`` lines in rsync's order, compared as lists (not sorted):
    directory by directory, depth first; within one, reversed file-list order, contents first."""
    for p in ("f", "a/g", "a/x/h", "a/y/h", "b/i", "c/j"):
        write(os.path.join(h.src, p), b"src", 0o644, T0)
    freeze_dirs(h.src, T0)
    _template(h, tmp_path, _nested_extras)
    out = h.go("src/", "dst", ["-i", "--delete", *(["-n"] if dry else [])], itemize_changes=True, delete=True, dry_run=dry)
    same_items(out)
    ref = [ln for ln in out["rsync"][1] if ln.startswith("*deleting")]
    assert len(ref) >= 12, ref
    for r in ("local", "push", "pull"):
        assert [ln for ln in out[r][1] if ln.startswith("*deleting")] == ref, r


def _kept_extras(dst: str) -> None:
    """Extraneous directories that stay non-empty: an excluded file inside (at two depths), and
    directories whose contents --max-delete may cut short."""
    for p in ("k/keep.o", "k/gone", "k/e/y.o", "k/e/f/z", "m/a/1", "m/a/2", "m/b/3", "m/4", "n/5"):
        write(os.path.join(dst, p), b"extra", 0o644, T0)


@pytest.mark.parametrize("limit", [None, 0, 1, 2, 4, 7], ids=lambda n: f"max-delete={n}")
@pytest.mark.parametrize("dry", [False, True], ids=["run", "dry-run"])
def test_itemize_kept_directories_in_rsync_order(h: Opts, tmp_path: Any, dry: bool, limit: int | None) -> None:
    """--delete -i: an extraneous directory left non-empty (an excluded entry inside, or
    --max-delete reached) is not itemized as deleted: rsync's "cannot delete non-empty
    directory: PATH" lines stand in its place (twice for one inside another being cleared
    when its rmdir is tried), in rsync's order among the deletions, compared as lists."""
    for p in ("f", "a/g"):
        write(os.path.join(h.src, p), b"src", 0o644, T0)
    freeze_dirs(h.src, T0)
    _template(h, tmp_path, _kept_extras)
    lim = [] if limit is None else [f"--max-delete={limit}"]
    out = h.go("src/", "dst", ["-i", "--delete", "--exclude", "*.o", *lim, *(["-n"] if dry else [])],
               itemize_changes=True, delete=True, dry_run=dry, exclude=["*.o"], max_delete=limit)
    same_codes(out)
    ref = [ln for ln in out["rsync"][1] if ln.startswith(("*deleting", "cannot delete"))]
    assert any(ln.startswith("cannot delete") for ln in ref), ref
    for r in ("local", "push", "pull"):
        assert [ln for ln in out[r][1] if ln.startswith(("*deleting", "cannot delete"))] == ref, r
    if not dry:
        h.check(ignore_mtime=("dst/k", "dst/k/e", "dst/m", "dst/m/a", "dst/m/b", "dst/n"))


RSYNC_V_FRAME = re.compile(r"^(sending incremental file list|sent \d.*|total size is .*|)$")


@pytest.mark.parametrize("limit", [None, 3], ids=lambda n: f"max-delete={n}")
def test_cli_verbose_lists_what_rsync_v_lists(h: Opts, tmp_path: Any, limit: int | None) -> None:
    """``tb5sync sync -v`` prints rsync ``-v``'s lines (``deleting PATH`` for a deletion, the
    names sent, "cannot delete non-empty directory: PATH"), in its order, on every route."""
    _small_tree(h.src)
    write(os.path.join(h.src, "new.txt"), b"new", 0o644, T0)
    _template(h, tmp_path, _kept_extras)
    write(os.path.join(h.src, "b.txt"), b"bravo, changed", 0o644, T0 + S)
    lim = [] if limit is None else [f"--max-delete={limit}"]
    args = ["-v", "--delete", "--exclude", "*.o", *lim]
    ref = subprocess.run(["rsync", "-a", *args, h.src + "/", os.path.join(h.dp["rsync"], "dst")],
                         capture_output=True, text=True, timeout=100, check=False)
    want = [ln for ln in ref.stdout.splitlines() if not RSYNC_V_FRAME.match(ln)]
    assert any(ln.startswith("deleting ") for ln in want) and any(ln.startswith("cannot delete") for ln in want)
    h.stage_pull()
    routes = {"local": (h.src + "/", os.path.join(h.dp["local"], "dst")),
              "push": (h.src + "/", h.server.url("push/dst")),
              "pull": (h.server.url("pullsrc/src/"), os.path.join(h.dp["pull"], "dst"))}
    for r, (a, b) in routes.items():
        got = _cli("sync", *args, a, b)
        assert got.returncode == ref.returncode, (r, got.stderr)
        assert got.stdout.splitlines() == want, r
