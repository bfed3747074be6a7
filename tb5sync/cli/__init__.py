"""The ``tb5sync`` command (argparse): `command` (every command but store), `store` (``tb5sync
store ...``). Imports anything; nothing imports it. ``python -m tb5sync.cli`` runs it.
"""

from tb5sync.cli.command import build_parser, main, run

__all__ = ["main", "run", "build_parser"]
