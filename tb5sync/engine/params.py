"""Chunking parameters and format constants: the ground both chunker twins stand on.

:class:`ChunkParams` and the versioned parameter sets live here, below
:mod:`tb5sync.engine.chunking` (the pure-Python twin and public API) and ``tb5sync._cdc`` (the
Cython twin), so that neither twin imports the other. The algorithm the parameters drive is
documented in :mod:`tb5sync.engine.chunking`.
"""

from __future__ import annotations

from dataclasses import dataclass

from tb5sync.errors import UsageError

__all__ = ["ChunkParams", "PARAMS_V1", "DEFAULT_PARAMS", "PARAMS_BY_VERSION", "is_int"]


def _mask(bits: int) -> int:
    """``bits`` consecutive set bits ending at bit 62 (bit 63 stays clear)."""
    return ((1 << bits) - 1) << (63 - bits)


def is_int(value: object) -> bool:
    """True for an ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ChunkParams:
    """A versioned set of chunk size parameters.

    Parameters
    ----------
    version : int
        Format version (>= 0). A given version always means the same parameters; version 0 is
        free for tests and experiments and is never written to disk.
    min_size : int
        Minimum chunk size in bytes (inclusive), >= 64. Only the last chunk of a stream may be
        smaller.
    avg_size : int
        Target average chunk size in bytes, a power of two, ``min_size < avg_size``.
    max_size : int
        Maximum chunk size in bytes (inclusive), ``avg_size < max_size``.
    normalization : int, default 2
        Normalized chunking level (FastCDC paper, "NC level"), >= 0: ``mask_s`` has
        ``log2(avg_size) + normalization`` bits and ``mask_l`` has
        ``log2(avg_size) - normalization`` bits. Must leave ``mask_l`` with at least one bit
        and ``mask_s`` with at most 63.

    Raises
    ------
    UsageError
        If a value is not an int or the bounds above do not hold.
    """

    version: int
    min_size: int
    avg_size: int
    max_size: int
    normalization: int = 2

    def __post_init__(self) -> None:
        for name in ("version", "min_size", "avg_size", "max_size", "normalization"):
            if not is_int(getattr(self, name)):
                raise UsageError(f"ChunkParams.{name} must be an int, got {getattr(self, name)!r}")
        if self.version < 0:
            raise UsageError(f"ChunkParams.version must be >= 0, got {self.version}")
        if self.min_size < 64:
            raise UsageError(f"ChunkParams.min_size must be >= 64 bytes, got {self.min_size}")
        if not self.min_size < self.avg_size < self.max_size:
            raise UsageError(
                "ChunkParams needs min_size < avg_size < max_size, got "
                f"{self.min_size}, {self.avg_size}, {self.max_size}"
            )
        if self.avg_size & (self.avg_size - 1):
            raise UsageError(f"ChunkParams.avg_size must be a power of two, got {self.avg_size}")
        bits = self.avg_size.bit_length() - 1
        if self.normalization < 0 or bits - self.normalization < 1 or bits + self.normalization > 63:
            raise UsageError(
                f"ChunkParams.normalization {self.normalization} is out of range for "
                f"avg_size {self.avg_size} (mask bits must stay within 1..63)"
            )

    @property
    def mask_s(self) -> int:
        """The stricter mask, used while a chunk is shorter than ``avg_size`` bytes."""
        return _mask(self.avg_size.bit_length() - 1 + self.normalization)

    @property
    def mask_l(self) -> int:
        """The looser mask, used once a chunk has reached ``avg_size`` bytes."""
        return _mask(self.avg_size.bit_length() - 1 - self.normalization)


PARAMS_V1 = ChunkParams(
    version=1, min_size=256 * 1024, avg_size=1024 * 1024, max_size=4 * 1024 * 1024, normalization=2
)
"""Chunking format v1: 256 KiB min, 1 MiB average, 4 MiB max, normalization level 2."""

DEFAULT_PARAMS = PARAMS_V1
"""The parameter set used when none is given."""

PARAMS_BY_VERSION: dict[int, ChunkParams] = {1: PARAMS_V1}
"""Every parameter set that may appear on disk or on the wire, by version number."""
