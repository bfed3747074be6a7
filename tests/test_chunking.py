"""Tests of the FastCDC chunker: both twins (Cython ``cy`` and pure-Python ``py``)."""

from __future__ import annotations

import array
import importlib.util
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import blake3
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tb5sync.engine.gear as _gear
import tb5sync.engine.chunking as chunking
from tb5sync.engine.chunking import PARAMS_V1, ChunkParams
from tb5sync.errors import UsageError

if TYPE_CHECKING:
    from collections.abc import Iterator

    from conftest import ChunkerImpl

SMALL = ChunkParams(version=0, min_size=64, avg_size=256, max_size=1024)
PROPS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ROOT = Path(__file__).resolve().parent.parent

# Golden cut points, computed once with the pure-Python reference. They pin the chunking
# format v1 (gear table, masks, rules): if they change, the on-disk format changed.
GOLDEN_V1_INPUT = blake3.blake3(b"tb5sync-golden-v1").digest(length=8 << 20)
GOLDEN_V1 = [1209813, 2204728, 3383100, 4466385, 5596468, 7236699, 8388608]
GOLDEN_SMALL_INPUT = blake3.blake3(b"tb5sync-golden-small").digest(length=8192)
GOLDEN_SMALL = [
    197, 498, 756, 1020, 1327, 1640, 1973, 2272, 2545, 2819, 2931, 3221, 3543, 3934,
    4191, 4452, 4725, 5133, 5606, 5882, 6212, 6496, 6834, 7179, 7512, 7884, 8068, 8192,
]
GOLDEN_TEXT_INPUT = b"".join(b"line %d of a log file, with some text\n" % i for i in range(200))
GOLDEN_TEXT = [
    272, 566, 883, 1220, 1646, 2033, 2441, 2811, 3173, 3445, 3796, 4147, 4411, 4687,
    5033, 5440, 5698, 6042, 6344, 6546, 6819, 6997, 7444, 7690,
]


def boundary_lengths(p: ChunkParams) -> list[int]:
    """Lengths at and around the size bounds of ``p`` (and their multiples)."""
    out = {0, 1, 2, 3}
    for base in (p.min_size, p.avg_size, p.max_size, 2 * p.max_size, p.min_size + p.max_size):
        out.update(base + d for d in (-2, -1, 0, 1, 2))
    return sorted(n for n in out if n >= 0)


@st.composite
def structured(draw: st.DrawFn) -> bytes:
    """Byte strings with structure that stresses a CDC: zeros, repeats, text, random blocks."""
    parts = []
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["random", "zeros", "byte", "repeat", "boundary"]))
        if kind == "random":
            parts.append(draw(st.binary(max_size=3000)))
        elif kind == "zeros":
            parts.append(bytes(draw(st.integers(0, 3000))))
        elif kind == "byte":
            parts.append(bytes([draw(st.integers(0, 255))]) * draw(st.integers(0, 3000)))
        elif kind == "repeat":
            unit = draw(st.binary(min_size=1, max_size=97))
            parts.append(unit * draw(st.integers(1, 60)))
        else:
            n = draw(st.sampled_from(boundary_lengths(SMALL)))
            seed = draw(st.binary(max_size=8))
            parts.append(blake3.blake3(seed).digest(length=n) if n else b"")
    return b"".join(parts)


inputs = st.one_of(st.binary(max_size=6000), structured())


def check_invariants(data: bytes, cuts: list[int], p: ChunkParams) -> None:
    if not data:
        assert cuts == []
        return
    assert cuts[-1] == len(data)
    starts = [0] + cuts[:-1]
    assert b"".join(data[a:b] for a, b in zip(starts, cuts)) == data
    sizes = [b - a for a, b in zip(starts, cuts)]
    assert all(p.min_size <= s <= p.max_size for s in sizes[:-1]), sizes
    assert 0 < sizes[-1] <= p.max_size


# --- parameters ------------------------------------------------------------------------------


def test_params_v1() -> None:
    assert chunking.DEFAULT_PARAMS is PARAMS_V1
    assert chunking.PARAMS_BY_VERSION == {1: PARAMS_V1}
    assert (PARAMS_V1.version, PARAMS_V1.min_size, PARAMS_V1.avg_size, PARAMS_V1.max_size) == (
        1, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024,
    )
    assert PARAMS_V1.normalization == 2
    # 22 and 18 bits ending at bit 62: part of format v1.
    assert PARAMS_V1.mask_s == ((1 << 22) - 1) << 41
    assert PARAMS_V1.mask_l == ((1 << 18) - 1) << 45


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(min_size=32, avg_size=256, max_size=1024),  # min below 64
        dict(min_size=256, avg_size=256, max_size=1024),  # min == avg
        dict(min_size=512, avg_size=256, max_size=1024),  # min > avg
        dict(min_size=64, avg_size=1024, max_size=1024),  # avg == max
        dict(min_size=64, avg_size=300, max_size=1024),  # avg not a power of two
        dict(min_size=64, avg_size=256, max_size=1024, normalization=-1),
        dict(min_size=64, avg_size=256, max_size=1024, normalization=8),  # mask_l would be empty
        dict(min_size=64.0, avg_size=256, max_size=1024),  # not an int
        dict(min_size=64, avg_size=256, max_size=1024, normalization=True),  # bool is not an int
    ],
)
def test_bad_params_raise(kwargs: dict[str, object]) -> None:
    with pytest.raises(UsageError):
        ChunkParams(version=0, **kwargs)  # type: ignore[arg-type]


def test_bad_version_raises() -> None:
    with pytest.raises(UsageError):
        ChunkParams(version=-1, min_size=64, avg_size=256, max_size=1024)


def test_masks_leave_top_bit_clear() -> None:
    for level in range(0, 4):
        p = ChunkParams(version=0, min_size=64, avg_size=256, max_size=1024, normalization=level)
        assert bin(p.mask_s).count("1") == 8 + level
        assert bin(p.mask_l).count("1") == 8 - level
        assert p.mask_s >> 63 == 0 and p.mask_l >> 63 == 0


def test_bad_arguments_raise(chunker_impl: ChunkerImpl) -> None:
    with pytest.raises(UsageError):
        chunker_impl.cut_points("not bytes")
    with pytest.raises(UsageError):
        chunker_impl.cut_points(b"abc", params=(64, 256, 1024))
    with pytest.raises(UsageError):
        chunker_impl.cut_points(b"abc", None)
    with pytest.raises(UsageError):
        chunker_impl.Chunker({"min_size": 64})
    non_contiguous = memoryview(bytes(range(100)))[::2]
    with pytest.raises(UsageError):
        chunker_impl.cut_points(non_contiguous)
    with pytest.raises(UsageError):
        chunker_impl.Chunker(SMALL).feed(12345)


# --- gear table ------------------------------------------------------------------------------


def test_gear_table_matches_definition() -> None:
    assert len(_gear.GEAR) == len(_gear.GEAR_LS) == 256
    for i in (0, 1, 127, 255):
        expected = int.from_bytes(blake3.blake3(b"tb5sync-gear-v1" + bytes([i])).digest()[:8], "little")
        assert _gear.GEAR[i] == expected
    assert all(ls == (g << 1) % 2**64 for g, ls in zip(_gear.GEAR, _gear.GEAR_LS))


def test_generated_gear_files_up_to_date() -> None:
    spec = importlib.util.spec_from_file_location("gen_gear", ROOT / "scripts" / "gen_gear.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.main(["--check"]) == 0


# --- golden cut points -----------------------------------------------------------------------


def test_golden_v1(chunker_impl: ChunkerImpl) -> None:
    assert chunker_impl.cut_points(GOLDEN_V1_INPUT) == GOLDEN_V1
    assert chunker_impl.cut_points(GOLDEN_V1_INPUT, PARAMS_V1) == GOLDEN_V1


def test_golden_small(chunker_impl: ChunkerImpl) -> None:
    assert chunker_impl.cut_points(GOLDEN_SMALL_INPUT, SMALL) == GOLDEN_SMALL
    assert chunker_impl.cut_points(GOLDEN_TEXT_INPUT, SMALL) == GOLDEN_TEXT


def test_golden_v1_streaming(chunker_impl: ChunkerImpl) -> None:
    ch = chunker_impl.Chunker()
    out: list[int] = []
    step = 1_000_003  # not aligned with anything
    for i in range(0, len(GOLDEN_V1_INPUT), step):
        out += ch.feed(GOLDEN_V1_INPUT[i : i + step])
    out += ch.finish()
    assert out == GOLDEN_V1


def test_zeros_are_cut_at_max(chunker_impl: ChunkerImpl) -> None:
    assert chunker_impl.cut_points(bytes(5000), SMALL) == [1024, 2048, 3072, 4096, 5000]
    assert chunker_impl.cut_points(bytes(5000), SMALL, final=False) == [1024, 2048, 3072, 4096]


# --- edge cases and buffer kinds -------------------------------------------------------------


def test_empty(chunker_impl: ChunkerImpl) -> None:
    assert chunker_impl.cut_points(b"") == []
    assert chunker_impl.cut_points(b"", SMALL, final=False) == []
    ch = chunker_impl.Chunker(SMALL)
    assert ch.feed(b"") == []
    assert ch.finish() == []


@pytest.mark.parametrize("n", boundary_lengths(SMALL))
def test_boundary_lengths(chunker_impl: ChunkerImpl, n: int) -> None:
    data = blake3.blake3(b"boundary").digest(length=n) if n else b""
    cuts = chunker_impl.cut_points(data, SMALL)
    check_invariants(data, cuts, SMALL)
    if 0 < n <= SMALL.min_size:
        assert cuts == [n]
        assert chunker_impl.cut_points(data, SMALL, final=False) == []


def test_buffer_kinds(chunker_impl: ChunkerImpl, tmp_path: Path) -> None:
    data = GOLDEN_SMALL_INPUT
    assert chunker_impl.cut_points(bytearray(data), SMALL) == GOLDEN_SMALL
    assert chunker_impl.cut_points(memoryview(data), SMALL) == GOLDEN_SMALL
    # A memoryview slice: offsets are relative to the slice.
    sliced = memoryview(b"x" * 100 + data)[100:]
    assert chunker_impl.cut_points(sliced, SMALL) == GOLDEN_SMALL
    # Non-byte formats are read as their raw bytes.
    words = array.array("I")
    words.frombytes(data)
    assert chunker_impl.cut_points(words, SMALL) == GOLDEN_SMALL
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        assert chunker_impl.cut_points(mm, SMALL) == GOLDEN_SMALL
        ch = chunker_impl.Chunker(SMALL)
        out = ch.feed(mm) + ch.finish()
        assert out == GOLDEN_SMALL


def test_feed_does_not_keep_caller_buffer(chunker_impl: ChunkerImpl) -> None:
    buf = bytearray(GOLDEN_SMALL_INPUT[:3000])
    ch = chunker_impl.Chunker(SMALL)
    out = ch.feed(buf)
    # Resizing raises BufferError if an export were still held; the undecided tail was copied.
    buf.extend(b"more")
    buf[:] = b"\0" * len(buf)
    out += ch.feed(GOLDEN_SMALL_INPUT[3000:])
    assert out + ch.finish() == GOLDEN_SMALL


def test_chunker_offset_and_reuse(chunker_impl: ChunkerImpl) -> None:
    ch = chunker_impl.Chunker(SMALL)
    assert ch.params is SMALL
    ch.feed(GOLDEN_SMALL_INPUT[:5000])
    assert ch.offset == 5000
    assert ch.feed(GOLDEN_SMALL_INPUT[5000:]) + ch.finish() != []
    # finish() resets to an empty stream
    assert ch.offset == 0
    assert ch.finish() == []
    assert ch.feed(GOLDEN_SMALL_INPUT) + ch.finish() == GOLDEN_SMALL


def test_implementation_choice() -> None:
    assert chunking.IMPLEMENTATION in ("cython", "python")
    forced_python = os.environ.get("TB5SYNC_PUREPYTHON") == "1"
    if chunking.IMPLEMENTATION == "cython":
        assert not forced_python
        assert chunking.cut_points is chunking.cy_cut_points
        assert chunking.Chunker is chunking.CyChunker
    else:
        assert chunking.cut_points is chunking.py_cut_points
        assert chunking.Chunker is chunking.PyChunker
        assert forced_python or chunking.cy_cut_points is None
    if os.environ.get("TB5SYNC_REQUIRE_CYTHON") == "1":
        assert chunking.cy_cut_points is not None and chunking.CyChunker is not None


# --- properties ------------------------------------------------------------------------------


@PROPS
@given(data=inputs)
def test_twins_agree(cy_chunker: ChunkerImpl, data: bytes) -> None:
    for final in (True, False):
        assert cy_chunker.cut_points(data, SMALL, final) == chunking.py_cut_points(data, SMALL, final)


@PROPS
@given(data=st.binary(min_size=0, max_size=20000), level=st.integers(0, 3))
def test_twins_agree_other_params(cy_chunker: ChunkerImpl, data: bytes, level: int) -> None:
    p = ChunkParams(version=0, min_size=100, avg_size=512, max_size=1500, normalization=level)
    assert cy_chunker.cut_points(data, p) == chunking.py_cut_points(data, p)


@PROPS
@given(data=inputs)
def test_chunks_join_and_respect_bounds(chunker_impl: ChunkerImpl, data: bytes) -> None:
    check_invariants(data, chunker_impl.cut_points(data, SMALL), SMALL)


@PROPS
@given(data=inputs, extra=st.binary(max_size=3000))
def test_non_final_cuts_are_definitive(chunker_impl: ChunkerImpl, data: bytes, extra: bytes) -> None:
    partial = chunker_impl.cut_points(data, SMALL, final=False)
    full = chunker_impl.cut_points(data, SMALL, final=True)
    assert full[: len(partial)] == partial
    assert len(data) - (partial[-1] if partial else 0) < SMALL.max_size
    # More data after the buffer never changes them.
    assert chunker_impl.cut_points(data + extra, SMALL)[: len(partial)] == partial


@PROPS
@given(data=inputs, splits=st.lists(st.integers(0, 6000), max_size=12))
def test_streaming_equals_whole(chunker_impl: ChunkerImpl, data: bytes, splits: list[int]) -> None:
    bounds = sorted({min(s, len(data)) for s in splits} | {0, len(data)})
    ch = chunker_impl.Chunker(SMALL)
    out: list[int] = []
    for a, b in zip(bounds, bounds[1:]):
        got = ch.feed(data[a:b])
        assert all(c <= b for c in got)
        out += got
    out += ch.finish()
    assert out == chunker_impl.cut_points(data, SMALL)


@PROPS
@given(data=inputs, step=st.integers(1, 400))
def test_streaming_twins_agree(cy_chunker: ChunkerImpl, data: bytes, step: int) -> None:
    outs = []
    for cls in (cy_chunker.Chunker, chunking.PyChunker):
        ch = cls(SMALL)
        out: list[int] = []
        for i in range(0, len(data), step):
            out += ch.feed(data[i : i + step])
        outs.append(out + ch.finish())
    assert outs[0] == outs[1]


# --- the lane kernels of the Cython core -----------------------------------------------------
# The Cython core rolls several blocks of 4 KiB side by side (a "lane kernel": AVX-512 on x86-64
# CPUs that have it, NEON on arm64, portable interleaved C everywhere) when a search range is at
# least one round long. These tests run every kernel usable on this CPU and compare it with the
# one-lane loop of the same build ("one", the portable path forced) and with the pure-Python
# reference.

MID = ChunkParams(version=0, min_size=4096, avg_size=128 * 1024, max_size=512 * 1024)
LANE_BLOCK = 4096
KERNEL_LANES = {"interleaved": 2, "neon": 4, "avx512": 9}


@pytest.fixture(scope="module", params=sorted(KERNEL_LANES))
def cdc(cy_chunker: ChunkerImpl, request: pytest.FixtureRequest) -> Iterator[ModuleType]:
    """``tb5sync._cdc`` with the lane kernel ``request.param`` (skipped where unusable), restored after."""
    from tb5sync import _cdc

    if request.param not in _cdc.lane_kernels():
        pytest.skip(f"lane kernel {request.param} not usable on this CPU")
    prev = _cdc.set_lane_kernel(request.param)
    yield _cdc
    _cdc.set_lane_kernel(prev)


def scalar_and_lanes(cdc: ModuleType, data: bytes, params: ChunkParams, final: bool = True) -> tuple[list[int], list[int]]:
    kernel = cdc.set_lane_kernel("one")
    try:
        scalar = cdc.cut_points(data, params, final)
    finally:
        cdc.set_lane_kernel(kernel)
    return scalar, cdc.cut_points(data, params, final)


def test_lanes_setting(cdc: ModuleType) -> None:
    kernel = cdc.lane_kernel()
    assert cdc.vector_lanes() == KERNEL_LANES[kernel]
    assert cdc.set_vector_lanes(False) is True
    assert cdc.lane_kernel() == "one" and cdc.vector_lanes() == 1
    assert cdc.set_vector_lanes(True) is False
    assert cdc.lane_kernel() == cdc.default_lane_kernel() != "one"
    assert cdc.set_lane_kernel(kernel) == cdc.default_lane_kernel()
    with pytest.raises(UsageError, match="not available"):
        cdc.set_lane_kernel("sse9")
    assert cdc.lane_kernel() == kernel


@pytest.mark.parametrize("name", ["one", "interleaved", "avx512", "neon", "bogus"])
def test_lane_kernel_from_environment(cy_chunker: ChunkerImpl, name: str) -> None:
    """$TB5SYNC_LANE_KERNEL picks the kernel when usable here; otherwise the first use measures."""
    import subprocess
    import sys

    from tb5sync import _cdc

    code = "from tb5sync import _cdc; print(_cdc.default_lane_kernel(), _cdc.lane_kernel())"
    env = {**os.environ, "TB5SYNC_LANE_KERNEL": name}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=60)
    default, current = out.stdout.split()
    assert default == current
    if name in _cdc.lane_kernels():
        assert default == name
    else:
        assert default in _cdc.lane_kernels() and default != "one"


def test_best_kernel_by_platform(cy_chunker: ChunkerImpl) -> None:
    """The default kernel is the platform's vector one where it exists (NEON is part of arm64)."""
    import platform

    from tb5sync import _cdc

    kernels = _cdc.lane_kernels()
    assert kernels[:2] == ["one", "interleaved"]
    if platform.machine().lower() in ("arm64", "aarch64"):
        assert "neon" in kernels
    else:
        assert "neon" not in kernels


def test_lanes_cut_in_every_lane(cdc: ModuleType) -> None:
    """On 32 MiB the lanes find cuts in each block of a round, all where the scalar loop does."""
    lanes_n = cdc.vector_lanes()
    data = blake3.blake3(b"tb5sync-lanes").digest(length=32 << 20)
    scalar, lanes = scalar_and_lanes(cdc, data, MID)
    assert lanes == scalar
    partial = chunking.py_cut_points(data[: 3 << 20], MID, final=False)
    assert len(partial) > 10 and partial == scalar[: len(partial)]
    seen = set()
    start = 0
    for cut in scalar:
        # A cut's offset from where its search range began, and the lane that holds it.
        first = start + MID.min_size if cut - start <= MID.avg_size else start + MID.avg_size
        range_len = (MID.avg_size - MID.min_size) if first == start + MID.min_size else (MID.max_size - MID.avg_size)
        off = cut - 1 - first
        if off < range_len - range_len % (lanes_n * LANE_BLOCK):
            seen.add(off // LANE_BLOCK % lanes_n)
        start = cut
    assert seen == set(range(lanes_n))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.binary(max_size=8),
    size=st.integers(0, 400_000),
    zeros=st.lists(st.tuples(st.integers(0, 400_000), st.integers(1, 70_000)), max_size=3),
    level=st.integers(0, 3),
    avg_shift=st.integers(15, 17),
)
def test_lanes_agree_with_scalar(
    cdc: ModuleType, seed: bytes, size: int, zeros: list[tuple[int, int]], level: int, avg_shift: int
) -> None:
    data = bytearray(blake3.blake3(seed).digest(length=size) if size else b"")
    for at, n in zeros:  # runs of zeros: no hash cut, forced cuts at max_size
        data[at:at] = bytes(n)
    p = ChunkParams(version=0, min_size=64, avg_size=1 << avg_shift, max_size=4 << avg_shift, normalization=level)
    for final in (True, False):
        scalar, lanes = scalar_and_lanes(cdc, bytes(data), p, final)
        assert lanes == scalar


def test_lanes_match_reference(cdc: ModuleType) -> None:
    data = blake3.blake3(b"tb5sync-lanes-ref").digest(length=1 << 20) + bytes(70_000) + b"x" * 50_000
    p = ChunkParams(version=0, min_size=64, avg_size=64 * 1024, max_size=256 * 1024, normalization=1)
    assert cdc.cut_points(data, p) == chunking.py_cut_points(data, p)


def test_lanes_streaming_equals_whole(cdc: ModuleType) -> None:
    data = blake3.blake3(b"tb5sync-lanes-stream").digest(length=6 << 20)
    ch = cdc.Chunker(MID)
    out: list[int] = []
    step = 777_777
    for i in range(0, len(data), step):
        out += ch.feed(data[i : i + step])
    out += ch.finish()
    assert out == cdc.cut_points(data, MID)


# --- parallel_cut_points: parts cut side by side, then stitched ------------------------------


@pytest.fixture(scope="module")
def cut_pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(5) as pool:
        yield pool


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.one_of(inputs, st.binary(min_size=4000, max_size=30000)), segments=st.integers(1, 6),
       final=st.booleans())
def test_parallel_equals_sequential(cut_pool: ThreadPoolExecutor, data: bytes, segments: int, final: bool) -> None:
    assert chunking.parallel_cut_points(data, SMALL, final, segments, cut_pool) == chunking.cut_points(data, SMALL, final)


@pytest.mark.parametrize("segments", [2, 3, 4, 7])
def test_parallel_equals_sequential_v1(cut_pool: ThreadPoolExecutor, segments: int) -> None:
    if chunking.IMPLEMENTATION != "cython":
        pytest.skip("48 MiB through the pure-Python reference takes minutes; the SMALL cases cover it")
    data = blake3.blake3(b"tb5sync-parallel").digest(length=48 << 20)
    for final in (True, False):
        assert chunking.parallel_cut_points(data, PARAMS_V1, final, segments, cut_pool) == chunking.cut_points(
            data, PARAMS_V1, final
        )


def test_parallel_parts_that_never_resynchronise(cut_pool: ThreadPoolExecutor) -> None:
    """Zeros are cut only at max_size, counted from each part's start: parts never agree."""
    data = bytes(30_001) + os.urandom(5000) + bytes(20_000)
    for segments in (2, 3, 5):
        for final in (True, False):
            got = chunking.parallel_cut_points(data, SMALL, final, segments, cut_pool)
            assert got == chunking.cut_points(data, SMALL, final)


def test_parallel_bad_arguments(cut_pool: ThreadPoolExecutor) -> None:
    with pytest.raises(UsageError, match="segments"):
        chunking.parallel_cut_points(b"x" * 100, SMALL, True, 0, cut_pool)
    with pytest.raises(UsageError):
        chunking.parallel_cut_points("text", SMALL, True, 2, cut_pool)  # type: ignore[arg-type]
    assert chunking.parallel_cut_points(b"", SMALL, True, 3, cut_pool) == []
    assert chunking.parallel_cut_points(b"abc", SMALL, True, 3, None) == [3]


ROOT = Path(__file__).resolve().parent.parent


def kernels_header(directory: Path) -> Path:
    """Write ``kernels.h`` (the gear table and the lane kernels' C, cut from the sources) for
    tests/lane_kernels_check.c; return the directory."""

    def block(text: str, marker: str) -> str:
        start = text.index(marker)
        return text[start : text.index('"""', start)]

    gear = block((ROOT / "ext" / "_gear.pxi").read_text(), "#include <stdint.h>")
    kernels = block((ROOT / "ext" / "_cdc.pyx").read_text(), "    /* Lane kernels of the cut search")
    (directory / "kernels.h").write_text(gear + "\n" + kernels)
    return directory


def run_kernel_check(cc: str, tmp_path: Path, runner: list[str], extra: list[str]) -> str:
    """Build tests/lane_kernels_check.c with ``cc`` and run it (through ``runner``); its output."""
    import subprocess

    exe = tmp_path / "check"
    inc = kernels_header(tmp_path)
    subprocess.run([cc, "-O2", *extra, "-I", str(inc), str(ROOT / "tests" / "lane_kernels_check.c"), "-o", str(exe)],
                   check=True, timeout=240)
    out = subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.timeout(300)
def test_lane_kernels_in_c_agree_with_one_lane(tmp_path: Path) -> None:
    """Every lane kernel usable here, called directly on 4,000 ranges (masks of 8..19 bits, so
    many cuts, some ranges with zero runs), gives the one-lane loop's cut or end state."""
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    out = run_kernel_check(cc, tmp_path, [], [])
    assert "ok 1 4000" in out  # the portable interleaved kernel, always
    from tb5sync import _cdc

    if "avx512" in _cdc.lane_kernels():
        assert "ok 3 4000" in out


@pytest.mark.timeout(300)
def test_neon_kernel_under_arm64_emulation(tmp_path: Path) -> None:
    """The NEON kernel (Apple silicon's path), cross-compiled for aarch64 and run under qemu where
    both are installed (gcc-aarch64-linux-gnu, qemu-user), agrees with the one-lane loop; so do the
    portable kernel built for aarch64, and the generated ext/_cdc.c compiles for aarch64."""
    import shutil
    import subprocess
    import sysconfig

    cc = shutil.which("aarch64-linux-gnu-gcc")
    qemu = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
    if cc is None or qemu is None:
        pytest.skip("needs aarch64-linux-gnu-gcc and qemu-aarch64")
    out = run_kernel_check(cc, tmp_path, [qemu], ["-static"])
    assert "ok 1 4000" in out and "ok 2 4000" in out
    source = ROOT / "ext" / "_cdc.c"  # left by an in-place build
    if source.exists():
        include = sysconfig.get_paths()["include"]
        subprocess.run([cc, "-fsyntax-only", "-O2", "-I", include, str(source)], check=True, timeout=240)
