"""Type stub of the Cython FastCDC core built from ``ext/_cdc.pyx``.

Same names, signatures and results as the pure-Python reference in :mod:`tb5sync.engine.chunking`
(``py_cut_points`` and ``PyChunker``), whose docstrings document both twins.
"""

from typing_extensions import Buffer

from tb5sync.engine.chunking import ChunkParams

__all__ = ["cut_points", "Chunker", "vector_lanes", "set_vector_lanes", "lane_kernels", "lane_kernel", "set_lane_kernel", "default_lane_kernel"]

def cut_points(buf: Buffer, params: ChunkParams = ..., final: bool = True) -> list[int]:
    """Chunk end offsets (bytes, exclusive) of ``buf``; see ``tb5sync.engine.chunking.py_cut_points``."""

def vector_lanes() -> int:
    """Gear-hash lanes the cut search runs side by side now: 9 (AVX-512), 4 (NEON), 2 (interleaved), 1 ("one")."""

def set_vector_lanes(enabled: bool) -> bool:
    """Use the fastest lane kernel (True) or the one-lane loop (False); return the previous setting."""

def lane_kernels() -> list[str]:
    """Lane kernels usable on this CPU: "one", "interleaved", and "neon" (arm64) or "avx512" (x86-64 with AVX-512)."""

def default_lane_kernel() -> str:
    """The lane kernel chosen on first use: $TB5SYNC_LANE_KERNEL if usable, else the fastest one measured."""

def lane_kernel() -> str:
    """The lane kernel in use."""

def set_lane_kernel(name: str) -> str:
    """Use kernel ``name`` (UsageError if unusable here); return the previous one. Cut points never change."""

class Chunker:
    """Streaming chunker; see ``tb5sync.engine.chunking.PyChunker``."""

    def __init__(self, params: ChunkParams = ...) -> None: ...
    @property
    def params(self) -> ChunkParams: ...
    @property
    def offset(self) -> int: ...
    def feed(self, data: Buffer) -> list[int]: ...
    def finish(self) -> list[int]: ...
