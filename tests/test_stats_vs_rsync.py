"""The ``--stats`` numbers against rsync's ``--stats`` block, dry runs and real runs, local, push and
pull, on trees built in the test: regular files (``Number of files``' ``reg:``), files transferred,
deleted entries (``Number of deleted files``: a dry run counts a kept non-empty directory it
pretends to delete, as rsync ``-n`` itemizes it), transferred bytes, total bytes, and the exit code.

``bytes_total`` counts regular files only (documented in ``SyncStats``); rsync's "Total file size"
adds the symlinks' target lengths, so those are subtracted from rsync's figure here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable
from typing import Any

import pytest
from test_vs_rsync import T0, cp_a, write

import tb5sync
from tb5sync.errors import PartialTransferError

pytestmark = pytest.mark.usefixtures("need_rsync")


def _src(b: str) -> None:
    write(f"{b}/a", b"1\n", 0o644, T0)
    write(f"{b}/keep/b", b"22\n", 0o644, T0)
    write(f"{b}/keep/c", b"333\n", 0o644, T0)
    os.symlink("a", f"{b}/ln")
    os.symlink("keep/b", f"{b}/keep/ln2")


def _protected(b: str) -> None:  # extraneous directories kept non-empty by an excluded file inside
    for p, data in (("gone/inner/keep.log", b"x"), ("gone/f", b"y"), ("gone/inner/q", b"z"), ("gone/inner/deeper/r.log", b"r"),
                    ("a", b"old"), ("z/z/z.log", b"p"), ("keep/c", b"333\n")):
        write(f"{b}/{p}", data, 0o644, T0 + 5_000_000_000)


def _replacing(b: str) -> None:  # directories where the source has files, one kept by an excluded file
    for p, data in (("a/x.log", b"protected"), ("ln/y", b"q"), ("keep/b/deep/e", b"e"), ("old/f", b"f")):
        write(f"{b}/{p}", data, 0o644, T0 + 5_000_000_000)


SCENARIOS: list[tuple[str, Callable[[str], None], list[str], dict[str, Any]]] = [
    ("protected", _protected, ["--delete", "--exclude=*.log"], {"delete": True, "exclude": ["*.log"]}),
    ("plain-delete", _protected, ["--delete"], {"delete": True}),
    ("max-delete", _protected, ["--delete", "--max-delete=2"], {"delete": True, "max_delete": 2}),
    ("no-delete", _protected, [], {}),
    ("replacing", _replacing, ["--delete", "--exclude=*.log"], {"delete": True, "exclude": ["*.log"]}),
    ("replacing-no-delete", _replacing, [], {}),
    ("delete-excluded", _replacing, ["--delete-excluded", "--exclude=*.log"], {"delete_excluded": True, "exclude": ["*.log"]}),
]


def _rsync_stats(out: str, link_bytes: int) -> dict[str, int]:
    def num(pat: str) -> int:
        m = re.search(pat, out)
        return int(m.group(1).replace(",", "")) if m else 0

    return {"files_total": num(r"Number of files: .*reg: ([\d,]+)"), "files_deleted": num(r"Number of deleted files: ([\d,]+)"),
            "files_transferred": num(r"Number of regular files transferred: ([\d,]+)"),
            "bytes_total": num(r"Total file size: ([\d,]+)") - link_bytes,
            "bytes_transferred": num(r"Total transferred file size: ([\d,]+)")}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dry", [True, False], ids=["dry", "real"])
@pytest.mark.parametrize("name,dest,args,kw", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_stats_block_like_rsync(tmp_path: Any, server: Any, name: str, dest: Callable[[str], None], args: list[str],
                                kw: dict[str, Any], dry: bool) -> None:
    src = str(tmp_path / "src")
    _src(src)
    link_bytes = sum(os.lstat(os.path.join(d, n)).st_size for d, ds, fs in os.walk(src) for n in ds + fs
                     if os.path.islink(os.path.join(d, n)))
    cp_a(src, os.path.join(server.root, "src"))
    ref = str(tmp_path / "ref")
    dest(ref)
    targets = {"local": str(tmp_path / "local"), "push": os.path.join(server.root, "pushed"), "pull": str(tmp_path / "pull")}
    for t in targets.values():
        cp_a(ref, t)
    p = subprocess.run(["rsync", "-a", "--stats", *(["-n"] if dry else []), *args, src + "/", ref + "/"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode in (0, 23, 25), p.stderr
    want = {**_rsync_stats(p.stdout, link_bytes), "exit": p.returncode}
    for route, (a, b) in {"local": (src + "/", targets["local"] + "/"), "push": (src + "/", server.url("pushed/")),
                          "pull": (server.url("src/"), targets["pull"] + "/")}.items():
        try:
            st, code = tb5sync.sync(a, b, dry_run=dry, **kw), 0
        except PartialTransferError as exc:
            st, code = exc.stats, exc.exit_code
        got = {k: getattr(st, k) for k in want if k != "exit"} | {"exit": code}
        assert got == want, (name, route, p.stdout)
    shutil.rmtree(ref)
