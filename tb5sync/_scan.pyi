"""Type stub of the Cython directory lister built from ``ext/_scan.pyx``.

Same name, signature and results as the pure-Python twin
:func:`tb5sync.tree.scan.py_listdir_stat`, whose docstring documents both.
"""

import os

__all__ = ["listdir_stat"]

def listdir_stat(path: str | os.PathLike[str] | int) -> list[tuple[str, int, int, int]]:
    """``[(name, st_mode, st_size, st_mtime_ns), ...]``; see ``tb5sync.tree.scan.py_listdir_stat``."""
