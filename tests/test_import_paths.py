"""Import paths users script against keep working after the layer folders (docs/ARCHITECTURE.md).

Every module that moved answers at its old path with the very module object of its new place,
the public names of the README import, and the folders' contracts are what `lint-imports` checks.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import tb5sync
from tb5sync._moved import MOVED, new_name


@pytest.mark.timeout(60)
@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_module_path_is_the_new_module(old: str) -> None:
    mod = importlib.import_module(f"tb5sync.{old}")
    new = importlib.import_module(f"tb5sync.{MOVED[old]}")
    assert mod is new
    assert mod.__name__ == f"tb5sync.{MOVED[old]}"
    assert mod.__spec__.name == f"tb5sync.{MOVED[old]}"  # the alias leaves the real spec in place
    assert new_name(f"tb5sync.{old}") == f"tb5sync.{MOVED[old]}"


@pytest.mark.timeout(60)
def test_patching_the_old_path_patches_the_module(monkeypatch: pytest.MonkeyPatch) -> None:
    import tb5sync.roles.destination as dest

    monkeypatch.setattr("tb5sync.destination.WRITE_IMPLEMENTATION", "patched")
    assert dest.WRITE_IMPLEMENTATION == "patched"


@pytest.mark.timeout(60)
def test_sync_stays_the_function_whatever_is_imported() -> None:
    import tb5sync.api.sync as api_sync
    from tb5sync.sync import DEFAULT_STREAMS  # the old module path of the API

    assert DEFAULT_STREAMS == api_sync.DEFAULT_STREAMS
    importlib.import_module("tb5sync.sync")
    assert tb5sync.sync is api_sync.sync and callable(tb5sync.sync)


@pytest.mark.timeout(60)
def test_public_names_of_the_readme_import() -> None:
    from tb5sync import Failure, Server, Store, SyncOptions, SyncStats, Tb5syncError, sync  # noqa: F401
    from tb5sync.cli import build_parser, main, run  # noqa: F401
    from tb5sync.errors import Tb5syncError as E
    from tb5sync.fanout import pull_fanout  # noqa: F401
    from tb5sync.fs import TB5File, TB5FileSystem
    from tb5sync.store import Item, RefInfo, Store as S, check_ref_name, default_store_path  # noqa: F401
    from tb5sync.store.objstore import open_store  # noqa: F401
    from tb5sync.storefs import StoreFileSystem

    assert E is Tb5syncError and S is Store
    for name in tb5sync.__all__:
        assert getattr(tb5sync, name) is not None, name
    import fsspec

    assert fsspec.get_filesystem_class("tb5") is TB5FileSystem
    assert fsspec.get_filesystem_class("tb5s") is TB5FileSystem
    assert fsspec.get_filesystem_class("tb5store") is StoreFileSystem
    assert TB5FileSystem.open is not None and TB5File is not None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("form", [["-m", "tb5sync.cli"], ["-m", "tb5sync.cli"]])
def test_python_dash_m_runs_the_command(form: list[str]) -> None:
    r = subprocess.run([sys.executable, *form, "--version"], capture_output=True, text=True, timeout=50)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"tb5sync {tb5sync.__version__}")


@pytest.mark.timeout(60)
def test_a_name_that_never_existed_is_not_found() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("tb5sync.no_such_module")
    assert new_name("tb5sync.no_such_module") is None and new_name("os") is None
