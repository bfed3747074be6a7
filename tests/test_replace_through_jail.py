"""Where i10's error model meets main's jail: entries replaced by another type, and large files
assembled in a state directory outside the destination, all through the jail's descriptors.

Expected trees come from ``rsync -a`` run on the same source and destination (rsync replaces an
empty directory by a file or symlink without ``--delete``).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import have_rsync, snapshot, tmp_files

import tb5sync
import tb5sync.roles.destination as destination_mod
from tb5sync.remote.client import default_state_dir

MiB = 1024 * 1024
T0 = 1_600_000_000_000_000_000


def _stage(root: str) -> tuple[str, str]:
    """A source of a large file, a small file and a symlink, and a destination holding an empty
    directory at each of their names (plus one that stays a directory)."""
    src, dst = os.path.join(root, "src"), os.path.join(root, "dst")
    os.makedirs(os.path.join(src, "keep"))
    with open(os.path.join(src, "big"), "wb") as f:
        f.write(os.urandom(6 * MiB))
    with open(os.path.join(src, "small"), "wb") as f:
        f.write(b"small")
    os.symlink("small", os.path.join(src, "link"))
    for name in ("big", "small", "keep"):
        os.utime(os.path.join(src, name), ns=(T0, T0))
    os.utime(os.path.join(src, "link"), ns=(T0, T0), follow_symlinks=False)
    os.utime(src, ns=(T0, T0))
    for name in ("big", "small", "link", "keep"):
        os.makedirs(os.path.join(dst, name))
    return src, dst


@pytest.mark.skipif(not have_rsync(), reason="rsync is not installed")
def test_empty_directories_replaced_like_rsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each empty directory is replaced by its file or symlink (renamed over it, relative to the
    jail's descriptors: no path-based rename), the large file assembled in the state's
    ``partial/`` in the user's cache directory; the result is rsync's."""
    src, dst = _stage(str(tmp_path))
    rdst = str(tmp_path / "rsync-dst")
    for name in ("big", "small", "link", "keep"):
        os.makedirs(os.path.join(rdst, name))
    proc = subprocess.run(["rsync", "-a", src + "/", rdst + "/"], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr

    renames: list[tuple[object, object, dict[str, object]]] = []
    real_rename = os.rename

    def rename(a: object, b: object, *args: object, **kw: object) -> None:
        renames.append((a, b, kw))
        real_rename(a, b, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(destination_mod.os, "rename", rename)
    stats = tb5sync.sync(src + "/", dst)
    assert stats.failures == ()
    assert snapshot(dst) == snapshot(rdst)
    assert tmp_files(dst) == []
    assert renames and all(kw.get("src_dir_fd") is not None and kw.get("dst_dir_fd") is not None for _a, _b, kw in renames)
    assert all("/" not in str(a) and "/" not in str(b) for a, b, _kw in renames)  # names, not paths
    where = default_state_dir(dst)
    assert where is not None and os.listdir(os.path.join(where, "partial")) == []
    assert not os.path.exists(os.path.join(dst, ".tb5sync"))


def test_non_empty_directory_is_not_replaced(tmp_path: Path) -> None:
    """A directory with entries in the way of a file is named as a failure (exit 23) and kept whole, as rsync keeps it."""
    src, dst = _stage(str(tmp_path))
    with open(os.path.join(dst, "big", "precious"), "wb") as f:
        f.write(b"kept")
    with pytest.raises(tb5sync.PartialTransferError) as info:
        tb5sync.sync(src + "/", dst)
    assert [f.path for f in info.value.stats.failures] == ["big"]
    with open(os.path.join(dst, "big", "precious"), "rb") as f:
        assert f.read() == b"kept"
    with open(os.path.join(dst, "small"), "rb") as f:
        assert f.read() == b"small"
    assert tmp_files(dst) == []
