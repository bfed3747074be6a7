"""Type stub of the Cython msgpack skimmer built from ``ext/_skim.pyx``; the pure-Python twin is
:mod:`tb5sync.wire.skim_py` (same results)."""

__all__ = ["skim"]

def skim(data: bytes | bytearray | memoryview) -> tuple[int, int, int | None, int]:
    """``(cost, containers, ext, end)``: an upper bound of the bytes the decoded value holds, its
    arrays plus maps, the first extension type code (or None) and the offset past the value.
    Raises ``ValueError`` when the data ends inside the value or holds 0xC1."""
