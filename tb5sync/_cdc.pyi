"""Type stub of the Cython FastCDC core built from ``ext/_cdc.pyx``.

Same names, signatures and results as the pure-Python reference in :mod:`tb5sync.chunking`
(``py_cut_points`` and ``PyChunker``), whose docstrings document both twins.
"""

from typing_extensions import Buffer

from tb5sync.chunking import ChunkParams

__all__ = ["cut_points", "Chunker", "vector_lanes", "set_vector_lanes"]

def cut_points(buf: Buffer, params: ChunkParams = ..., final: bool = True) -> list[int]:
    """Chunk end offsets (bytes, exclusive) of ``buf``; see ``tb5sync.chunking.py_cut_points``."""

def vector_lanes() -> int:
    """Gear-hash lanes the cut search runs side by side on this CPU: 8 with AVX-512, else 1."""

def set_vector_lanes(enabled: bool) -> bool:
    """Turn the AVX-512 lanes on or off (ignored without AVX-512); return the previous setting."""

class Chunker:
    """Streaming chunker; see ``tb5sync.chunking.PyChunker``."""

    def __init__(self, params: ChunkParams = ...) -> None: ...
    @property
    def params(self) -> ChunkParams: ...
    @property
    def offset(self) -> int: ...
    def feed(self, data: Buffer) -> list[int]: ...
    def finish(self) -> list[int]: ...
