"""fsspec filesystems: ``tb5://`` and ``tb5s://`` (:class:`TB5FileSystem`), ``tb5store://``.

`filesystem` (the async filesystem, over `tb5sync.remote.client` connections) with its halves
`reading` and `writing` (mixins it combines), `file` (the buffered file object: ranged reads,
atomic writes), `storefs` (a server's store refs, read-only). May import `remote` and below.
The names users import are re-exported here.
"""

from tb5sync.fs.file import TB5File
from tb5sync.fs.filesystem import TB5FileSystem

__all__ = ["TB5FileSystem", "TB5File"]
