"""Old module paths, from before the package was laid out in layer folders (0.1.0).

Until then every module sat directly under ``tb5sync/`` (``tb5sync.destination``,
``tb5sync.storeclient``, ...). Code that imported those paths keeps working: a finder on
``sys.meta_path`` answers an old name with the module at its new place, the same module object
(so ``monkeypatch.setattr("tb5sync.destination.X", ...)`` patches the real one). ``tb5sync.fs``
and ``tb5sync.cli`` are folders now and re-export their public names; ``tb5sync.sync`` is the
function, and its module ``tb5sync.api.sync``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

__all__ = ["MOVED", "new_name"]

#: old module name under ``tb5sync.`` -> its place now
MOVED: dict[str, str] = {
    "_paths": "_os.paths",
    "_io": "_os.io",
    "_fsmeta": "_os.fsmeta",
    "_sparse": "_os.sparse",
    "_diskbench": "_os.diskbench",
    "_buffers": "_os.buffers",
    "netif": "_os.netif",
    "protocol": "wire.protocol",
    "messages": "wire.messages",
    "urls": "wire.urls",
    "transport": "wire.transport",
    "rpc": "wire.rpc",
    "_replies": "wire.replies",
    "_parts": "wire.parts",
    "_skim_py": "wire.skim_py",
    "entry": "tree.entry",
    "excludes": "tree.excludes",
    "scan": "tree.scan",
    "plan": "tree.plan",
    "state": "tree.state",
    "options": "tree.options",
    "quota": "tree.quota",
    "chunking": "engine.chunking",
    "hashing": "engine.hashing",
    "_basis": "engine.basis",
    "refine": "engine.refine",
    "_gear": "engine.gear",
    "_params": "engine.params",
    "sender": "roles.sender",
    "generator": "roles.generator",
    "receiver": "roles.receiver",
    "destination": "roles.destination",
    "largefile": "roles.largefile",
    "inodes": "roles.inodes",
    "client": "remote.client",
    "links": "remote.links",
    "storeclient": "remote.storeclient",
    "fanout": "remote.fanout",
    "tiers": "remote.tiers",
    "fsfile": "fs.file",
    "storefs": "fs.storefs",
    "httpcache": "cache.httpcache",
    "reapi": "cache.reapi",
    "server": "daemon.server",
    "admission": "daemon.admission",
    "fsops": "daemon.fsops",
    "sync": "api.sync",
    "bench": "api.bench",
    "storecli": "cli.store",
}


def new_name(old: str) -> str | None:
    """The module path that replaced ``old`` (``"tb5sync.destination"`` -> ``"tb5sync.roles.destination"``),
    ``None`` when ``old`` did not move. Submodules of a moved module are not mapped (none had any)."""
    if not old.startswith("tb5sync."):
        return None
    new = MOVED.get(old[len("tb5sync."):])
    return None if new is None else f"tb5sync.{new}"


class _Alias:  # an importlib.abc.Loader (importlib.abc, ~4 ms at start-up, is not needed for one)
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec):  # noqa: ANN001 - importlib's signature
        module = importlib.import_module(self.target)
        self._own_spec = module.__spec__  # importlib sets __spec__ on what this returns
        return module

    def exec_module(self, module) -> None:  # noqa: ANN001 - the target ran its own code
        module.__spec__ = self._own_spec


class _MovedFinder:  # an importlib.abc.MetaPathFinder by its protocol
    """Finds ``tb5sync.<old>`` for every name in :data:`MOVED`; nothing else."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 - importlib's signature
        new = new_name(fullname)
        if new is None:
            return None
        spec = importlib.util.spec_from_loader(fullname, _Alias(new))
        return spec


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (idempotent)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
