"""Shared pytest fixtures. Each block below belongs to one module's tests; append new blocks."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import pytest

# --- chunking (tb5sync.chunking / tb5sync._cdc) ----------------------------------------------

from tb5sync import chunking


@dataclass(frozen=True)
class ChunkerImpl:
    """One chunker twin: its ``cut_points`` function and ``Chunker`` class."""

    name: str
    cut_points: Callable[..., list[int]]
    Chunker: type[Any]


def require_cython() -> bool:
    """True when a missing Cython extension must fail the tests (CI sets TB5SYNC_REQUIRE_CYTHON=1)."""
    return os.environ.get("TB5SYNC_REQUIRE_CYTHON") == "1"


def cython_chunker_or_skip() -> ChunkerImpl:
    """The Cython twin; skips the test when it is not built (fails under TB5SYNC_REQUIRE_CYTHON=1)."""
    if chunking.cy_cut_points is None or chunking.CyChunker is None:
        if require_cython():
            pytest.fail("tb5sync._cdc is not built but TB5SYNC_REQUIRE_CYTHON=1")
        pytest.skip("tb5sync._cdc is not built")
    return ChunkerImpl("cy", chunking.cy_cut_points, chunking.CyChunker)


@pytest.fixture(scope="session", params=["cy", "py"])
def chunker_impl(request: pytest.FixtureRequest) -> ChunkerImpl:
    """Each chunker twin in turn (ids ``cy`` and ``py``)."""
    if request.param == "cy":
        return cython_chunker_or_skip()
    return ChunkerImpl("py", chunking.py_cut_points, chunking.PyChunker)


@pytest.fixture(scope="session")
def cy_chunker() -> ChunkerImpl:
    """The Cython twin only (skipped when not built, unless TB5SYNC_REQUIRE_CYTHON=1)."""
    return cython_chunker_or_skip()


@pytest.fixture(scope="session")
def small_chunk_params() -> chunking.ChunkParams:
    """Small chunk sizes (64 B / 256 B / 1 KiB) so that tests see many chunks in little data."""
    return chunking.ChunkParams(version=0, min_size=64, avg_size=256, max_size=1024)
