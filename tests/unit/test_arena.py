"""Unit tests for the shared-memory arena (server/store/arena.py), on a private directory."""

import errno
import itertools
import os
import random
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tensorbroker.server.store.arena import Arena, Block
from tensorbroker.server.store.segments import Segment, ShmExhausted

KiB = 2**10
MiB = 2**20


@pytest.fixture
def shm_dir(tmp_path: Path) -> Path:
    d = tmp_path / "shm"
    d.mkdir()
    return d


@pytest.fixture
def make_arena(shm_dir: Path) -> Iterator[Any]:
    made: list[Any] = []

    def make(capacity: int = 16 * MiB, chunk_size: int = 2 * MiB) -> Any:
        arena = Arena(capacity, shm_dir=str(shm_dir), prefix="tb-5eed-", chunk_size=chunk_size)
        made.append(arena)
        return arena

    yield make
    for arena in made:
        arena.close()


def _files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def _segment_size(shm_dir: Path, name: str) -> int:
    return os.stat(shm_dir / name).st_size


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# -- alignment and argument checks ------------------------------------------------------------


def test_nothing_created_until_first_allocate(make_arena: Any, shm_dir: Path) -> None:
    arena = make_arena()
    assert _files(shm_dir) == [] and arena.segments == [] and arena.reserved_bytes == 0
    assert arena.largest_free == 16 * MiB
    arena.allocate(1)
    assert _files(shm_dir) == arena.segments
    assert arena.segments[0].startswith("tb-5eed-")


@pytest.mark.parametrize("align", [64, 4096])
def test_offsets_aligned_and_sizes_rounded(make_arena: Any, align: int) -> None:
    arena = make_arena()
    rng = random.Random(align)
    for _ in range(200):
        size = rng.randint(1, 10_000)
        block = arena.allocate(size, align)
        assert block is not None
        assert block.offset % align == 0
        assert block.size >= size and block.size % 64 == 0 and block.size - size < 64


def test_alignment_padding_returns_to_free_list(make_arena: Any) -> None:
    arena = make_arena()
    small = arena.allocate(64)
    big = arena.allocate(100, align=4096)
    assert small.offset == 0 and big.offset == 4096 and big.size == 128
    assert arena.used_bytes == 64 + 128
    filler = arena.allocate(4096 - 64)  # exactly the padding hole: fits without growing
    assert (filler.segment, filler.offset) == (small.segment, 64)
    assert len(arena.segments) == 1


def test_a_block_taken_high_leaves_the_bottom_whole_and_merges_back(make_arena: Any) -> None:
    """Blocks granted ahead are cut from the top of a free block: a large block after them
    takes the bottom, and once they are freed the room is one block again."""
    arena = make_arena(capacity=2 * MiB, chunk_size=2 * MiB)
    grant = arena.allocate(5000, 4096, high=True)
    assert grant.offset % 4096 == 0 and grant.offset + grant.size <= 2 * MiB
    assert grant.offset == 2 * MiB - 2 * 4096  # at the top (5056 bytes, page aligned)
    big = arena.allocate(MiB)
    assert big.offset == 0
    arena.free(grant)
    assert arena.largest_free == MiB


def test_zero_size_gets_distinct_addresses(make_arena: Any) -> None:
    arena = make_arena()
    a, b = arena.allocate(0), arena.allocate(0)
    assert a.size == b.size == 64 and a != b


@pytest.mark.parametrize("align", [0, 1, 32, 96, 100, -64])
def test_bad_alignment_rejected(make_arena: Any, align: int) -> None:
    with pytest.raises(ValueError, match="align"):
        make_arena().allocate(10, align)


def test_bad_arguments_rejected(make_arena: Any, shm_dir: Path) -> None:
    with pytest.raises(ValueError, match="size"):
        make_arena().allocate(-1)
    with pytest.raises(ValueError, match="capacity"):
        Arena(0, shm_dir=str(shm_dir))
    with pytest.raises(ValueError, match="chunk_size"):
        Arena(MiB, shm_dir=str(shm_dir), chunk_size=0)


# -- best fit and coalescing ------------------------------------------------------------------


def test_best_fit_picks_smallest_fitting_hole(make_arena: Any) -> None:
    arena = make_arena()
    holes = {}
    for name, size in [("1k", KiB), ("4k", 4 * KiB), ("2k", 2 * KiB)]:
        holes[name] = arena.allocate(size)
        arena.allocate(64)  # separator keeps the holes apart
    for block in holes.values():
        arena.free(block)
    mid = arena.allocate(1500)  # 1536 bytes: only the 2k and 4k holes fit; 2k is smaller
    assert mid.offset == holes["2k"].offset
    rest = arena.allocate(512)  # the 512 bytes left of the 2k hole are an exact fit
    assert rest.offset == holes["2k"].offset + 1536
    small = arena.allocate(700)
    assert small.offset == holes["1k"].offset
    large = arena.allocate(3 * KiB)
    assert large.offset == holes["4k"].offset
    assert len(arena.segments) == 1


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_adjacent_frees_coalesce(make_arena: Any, order: tuple[int, ...]) -> None:
    arena = make_arena()
    head = arena.allocate(64)
    trio = [arena.allocate(s) for s in (KiB, 3 * KiB, 2 * KiB)]
    arena.allocate(64)  # guard: the trio must not merge with the segment's tail
    assert [b.offset for b in trio] == [64, 64 + KiB, 64 + 4 * KiB]
    for i in order:
        arena.free(trio[i])
    reserved = arena.reserved_bytes
    merged = arena.allocate(6 * KiB)
    assert (merged.segment, merged.offset) == (head.segment, 64)
    assert arena.reserved_bytes == reserved and len(arena.segments) == 1


def test_free_merges_with_tail_and_head(make_arena: Any, shm_dir: Path) -> None:
    arena = make_arena()
    a, b = arena.allocate(KiB), arena.allocate(KiB)
    arena.free(a)
    arena.free(b)
    whole = _segment_size(shm_dir, arena.segments[0])
    assert arena.largest_free == max(whole, 14 * MiB)
    block = arena.allocate(whole)
    assert block.offset == 0 and len(arena.segments) == 1


# -- growth and capacity ----------------------------------------------------------------------


def test_growth_in_chunks_until_capacity(make_arena: Any, shm_dir: Path) -> None:
    arena = make_arena(capacity=6 * MiB, chunk_size=2 * MiB)
    blocks = [arena.allocate(3 * MiB // 2) for _ in range(3)]
    assert all(b is not None for b in blocks)
    assert len({b.segment for b in blocks}) == 3
    assert [_segment_size(shm_dir, n) for n in arena.segments] == [2 * MiB] * 3
    assert arena.reserved_bytes == 6 * MiB
    used = arena.used_bytes
    assert arena.allocate(3 * MiB // 2) is None
    assert arena.allocate(7 * MiB) is None
    assert arena.used_bytes == used and arena.blocks == 3
    assert arena.reserved_bytes == 6 * MiB and len(_files(shm_dir)) == 3
    assert arena.largest_free == MiB // 2
    assert arena.allocate(MiB // 2) is not None  # the remaining tails still serve


def test_big_request_gets_a_segment_of_its_own(make_arena: Any, shm_dir: Path) -> None:
    arena = make_arena(capacity=64 * MiB, chunk_size=2 * MiB)
    block = arena.allocate(5 * MiB)
    assert block.offset == 0
    assert _segment_size(shm_dir, block.segment) == 6 * MiB  # round_up(5 MiB + 64, 2 MiB)


def test_last_segment_clipped_to_capacity(make_arena: Any, shm_dir: Path) -> None:
    arena = make_arena(capacity=3 * MiB, chunk_size=2 * MiB)
    first = arena.allocate(3 * MiB // 2)
    second = arena.allocate(MiB)
    assert first.segment != second.segment
    assert _segment_size(shm_dir, second.segment) == MiB
    assert arena.reserved_bytes == 3 * MiB
    assert arena.allocate(MiB) is None
    assert len(_files(shm_dir)) == 2


def test_request_beyond_capacity_creates_nothing(make_arena: Any, shm_dir: Path) -> None:
    arena = make_arena(capacity=MiB)
    assert arena.allocate(MiB + 1) is None
    assert _files(shm_dir) == [] and arena.reserved_bytes == 0 and arena.blocks == 0


# -- misuse, files, close ---------------------------------------------------------------------


def test_double_free_and_foreign_blocks_raise(make_arena: Any) -> None:
    arena = make_arena()
    block = arena.allocate(100)
    arena.free(block)
    with pytest.raises(ValueError, match="not allocated"):
        arena.free(block)
    other = arena.allocate(100)
    with pytest.raises(ValueError, match="not allocated"):
        arena.free(Block(other.segment, other.offset, other.size + 64))
    with pytest.raises(ValueError, match="not allocated"):
        arena.free(Block("tb-1-nope", 0, 64))
    assert arena.blocks == 1 and arena.used_bytes == 128


def test_files_are_private_and_unlinked_by_close(make_arena: Any, shm_dir: Path) -> None:
    arena = make_arena(capacity=8 * MiB)
    arena.allocate(MiB)
    arena.allocate(3 * MiB)
    assert len(_files(shm_dir)) == 2
    for name in _files(shm_dir):
        st = os.stat(shm_dir / name)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_uid == os.getuid()
    arena.close()
    assert _files(shm_dir) == []
    assert arena.segments == [] and arena.blocks == 0 and arena.used_bytes == 0
    arena.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        arena.allocate(64)


def test_segment_unlink_idempotent(shm_dir: Path) -> None:
    segment = Segment.create(str(shm_dir), "tb-x-", 4096)
    assert segment.size == 4096 and _files(shm_dir) == [segment.name]
    assert segment.path == str(shm_dir / segment.name)
    segment.unlink()
    segment.unlink()
    assert _files(shm_dir) == []
    Segment().unlink()  # a never-built segment can be cleaned up too


# -- ShmExhausted -----------------------------------------------------------------------------


def _fail_fallocate(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    def fallocate(fd: int, offset: int, length: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "posix_fallocate", fallocate)


def test_enospc_raises_shm_exhausted_and_removes_file(
    monkeypatch: pytest.MonkeyPatch, shm_dir: Path
) -> None:
    _fail_fallocate(monkeypatch, errno.ENOSPC)
    with pytest.raises(ShmExhausted) as info:
        Segment.create(str(shm_dir), "tb-1-", 3 * MiB)
    assert info.value.errno == errno.ENOSPC
    assert str(3 * MiB) in str(info.value) and "shm-size" in str(info.value)
    assert str(shm_dir) in str(info.value) and "emptyDir" in str(info.value)
    assert _files(shm_dir) == []


def test_other_fallocate_errors_propagate_unchanged(
    monkeypatch: pytest.MonkeyPatch, shm_dir: Path
) -> None:
    _fail_fallocate(monkeypatch, errno.EIO)
    with pytest.raises(OSError) as info:
        Segment.create(str(shm_dir), "tb-1-", MiB)
    assert not isinstance(info.value, ShmExhausted) and info.value.errno == errno.EIO
    assert _files(shm_dir) == []


def test_arena_propagates_shm_exhausted_without_leaking(
    monkeypatch: pytest.MonkeyPatch, make_arena: Any, shm_dir: Path
) -> None:
    arena = make_arena()
    _fail_fallocate(monkeypatch, errno.ENOSPC)
    with pytest.raises(ShmExhausted):
        arena.allocate(KiB)
    assert _files(shm_dir) == [] and arena.segments == [] and arena.reserved_bytes == 0
    monkeypatch.undo()
    assert arena.allocate(KiB) is not None


# -- adopting the segments of a broker that died ----------------------------------------------


def test_an_adopted_arena_keeps_the_blocks_in_use_and_frees_the_rest(
    make_arena: Any, shm_dir: Path
) -> None:
    first = make_arena(capacity=8 * MiB, chunk_size=2 * MiB)
    blocks = [first.allocate(100 * KiB) for _ in range(6)]
    assert all(blocks)
    kept = [b for i, b in enumerate(blocks) if i % 2 == 0]  # the objects still live
    segments = [Segment.existing(str(shm_dir), name) for name in first.segments]

    second = Arena(8 * MiB, shm_dir=str(shm_dir), prefix="tb-5eed-", chunk_size=2 * MiB)
    second.adopt(segments, kept)
    assert second.segments == first.segments and second.reserved_bytes == first.reserved_bytes
    assert second.used_bytes == sum(b.size for b in kept) and second.blocks == len(kept)
    new = [second.allocate(100 * KiB) for _ in range(3)]  # the holes of the freed ones
    taken = sorted((b.segment, b.offset, b.offset + b.size) for b in [*kept, *new] if b)
    assert all(a[0] != b[0] or a[2] <= b[1] for a, b in zip(taken, taken[1:], strict=False)), taken
    for b in [*kept, *new]:
        assert b is not None
        second.free(b)
    assert second.used_bytes == 0 and second.largest_free == 6 * MiB  # all coalesced
    second.close(unlink=False)
    assert _files(shm_dir) == sorted(first.segments)  # the state was kept: still there


def test_adopting_blocks_that_overlap_is_refused(make_arena: Any, shm_dir: Path) -> None:
    first = make_arena()
    block = first.allocate(4 * KiB)
    assert block is not None
    second = Arena(16 * MiB, shm_dir=str(shm_dir), prefix="tb-5eed-")
    overlapping = Block(block.segment, block.offset + 64, block.size)
    with pytest.raises(ValueError, match="overlaps"):
        second.adopt([Segment.existing(str(shm_dir), block.segment)], [block, overlapping])


# -- randomized -------------------------------------------------------------------------------


def _check_invariants(arena: Any, live: dict[Any, int]) -> None:
    assert arena.used_bytes == sum(b.size for b in live)
    assert arena.blocks == len(live)
    assert arena.free_bytes == arena.capacity - arena.used_bytes
    by_segment: dict[str, list[Any]] = {}
    for block, align in live.items():
        assert block.offset % align == 0
        by_segment.setdefault(block.segment, []).append(block)
    for blocks in by_segment.values():
        blocks.sort(key=lambda b: b.offset)
        for a, b in itertools.pairwise(blocks):
            assert a.offset + a.size <= b.offset, f"{a} overlaps {b}"


def test_randomized_alloc_free(make_arena: Any, shm_dir: Path) -> None:
    arena = make_arena(capacity=24 * MiB, chunk_size=2 * MiB)
    rng = random.Random(20240521)
    live: dict[Any, int] = {}
    for step in range(4000):
        if live and rng.random() < 0.45:
            block = rng.choice(list(live))
            del live[block]
            arena.free(block)
        else:
            size = rng.choice([rng.randint(0, 2 * KiB), rng.randint(1, 256 * KiB)])
            align = rng.choice([64, 64, 128, 4096, 65536])
            block = arena.allocate(size, align)
            if block is not None:
                assert block.size >= size
                live[block] = align
        if step % 50 == 0:
            _check_invariants(arena, live)
    _check_invariants(arena, live)
    assert 1 < len(arena.segments)
    for block in list(live):
        arena.free(block)
    assert arena.used_bytes == 0 and arena.blocks == 0
    # Every segment must be one free block again: each can be taken whole at offset 0.
    reserved = arena.reserved_bytes
    sizes = sorted((_segment_size(shm_dir, n) for n in arena.segments), reverse=True)
    for size in sizes:
        block = arena.allocate(size)
        assert block is not None and block.offset == 0 and block.size == size
    assert arena.reserved_bytes == reserved and arena.largest_free == arena.capacity - reserved
