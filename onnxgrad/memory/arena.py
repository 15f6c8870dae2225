"""onnxruntime's BFC arena on paper: how much memory the arena needs to run a schedule, beside the live bytes.

The arena (the CPU provider's when it is on, and CUDA's always) serves each request from its own regions: the
request is rounded up to 256 bytes and taken from the smallest free chunk that fits (best fit, the lower address
on ties), split when the chunk is at least twice the request or the rest is `max_dead_bytes_per_chunk` or more;
a freed chunk merges with free neighbours of its region, never across regions. When no free chunk fits, the arena
adds a region: as large as the request (`kSameAsRequested`), or the next of a doubling series that starts at 1 MiB
(`kNextPowerOfTwo`, onnxruntime's default), cut to what the limit leaves. A request that a new region under the
limit cannot serve fails ("Available memory of ... is smaller than requested bytes"). So the arena needs more than
the peak of live bytes: free chunks too small for the next request, or in another region, are held while a new
region is added.

`least_arena` is the least limit under which the schedule of `simulate.allocations` runs: onnxruntime's own
allocations, as far as they are modelled (a Where's selection buffers before its output, an activation written
over the input it reads last, no buffer for a MatMul fused with its bias or scale). Measured against the CPU
provider's arena (bench/bench_arena.py), with every chunk split it is within -3.6% to +0.5% of the least limit
under which onnxruntime ran plans of ResNet-50, GPT-2 small and BERT-base; bench/trace_memory.py --arena sets it
beside the same emulation of onnxruntime's own traced allocations. With kSameAsRequested, whose many regions make
it depend on every small request: from -12% (GPT-2) to +9%.

By default the arena leaves a chunk whole when it is less than twice the request and the rest is under 128 MiB,
so up to half a chunk lies unused while it is held. onnxgrad's CPU sessions give a plan made for the arena
(`mirror --allocator arena`) an arena that splits every chunk to the request (`SPLIT_ALWAYS`, onnxruntime's
`max_dead_bytes_per_chunk` at 256 bytes): on BERT-base's 0.9x plan it held 754 MiB where the default held 850, and
the emulation of it was 2% low there (BENCHMARKS.md).
"""
from __future__ import annotations

import bisect

from ..ir import Graph
from .simulate import OUTSIDE, allocations, live_peak, sizes

NEXT_POWER_OF_TWO, SAME_AS_REQUESTED = "kNextPowerOfTwo", "kSameAsRequested"
STRATEGIES = (NEXT_POWER_OF_TWO, SAME_AS_REQUESTED)
MIN_ALLOCATION = 256
BINS = 21  # free chunks are binned by size: bin b holds [256 << b, 256 << (b + 1)), the last one the rest
INITIAL_REGION = 1 << 20  # onnxruntime's default initial_chunk_size_bytes
MAX_DEAD_BYTES = 128 << 20  # onnxruntime's default max_dead_bytes_per_chunk
SPLIT_ALWAYS = MIN_ALLOCATION  # a max_dead_bytes_per_chunk that splits off any rest: onnxgrad's CPU arena


class OutOfArena(Exception):
    """A request the arena cannot serve under its limit."""


def _rounded(n: int) -> int:
    return (n + MIN_ALLOCATION - 1) // MIN_ALLOCATION * MIN_ALLOCATION


def _bin(n: int) -> int:
    return min(max(n >> 8, 1).bit_length() - 1, BINS - 1)


class Arena:
    """The arena's chunks: `alloc(bytes) -> address`, `free(address)`; `regions` holds the bytes it reserved."""

    def __init__(self, limit: int, strategy: str = NEXT_POWER_OF_TWO, max_dead_bytes: int = MAX_DEAD_BYTES):
        if strategy not in STRATEGIES:
            raise ValueError(f"arena strategy {strategy!r}: expected one of {', '.join(STRATEGIES)}")
        self.limit, self.strategy, self.max_dead_bytes = limit, strategy, max_dead_bytes
        self.next_region = _rounded(min(limit, INITIAL_REGION))
        self.regions = 0
        self.bins: list[list[tuple[int, int]]] = [[] for _ in range(BINS)]  # (size, address), sorted
        self.chunks: dict[int, list] = {}  # address -> [size, in use, previous address, next address]
        self._top = 1 << 62  # later regions at lower addresses, as mmap places them

    def alloc(self, nbytes: int) -> int | None:
        if nbytes == 0:
            return None
        need = _rounded(nbytes)
        address = self._take(need)
        if address is None:
            self._extend(need)
            address = self._take(need)
        return address

    def free(self, address: int | None) -> None:
        if address is None:
            return
        chunk = self.chunks[address]
        chunk[1] = False
        after = chunk[3]
        if after is not None and not self.chunks[after][1]:
            self._unbin(after)
            merged = self.chunks.pop(after)
            chunk[0] += merged[0]
            chunk[3] = merged[3]
            if merged[3] is not None:
                self.chunks[merged[3]][2] = address
        before = chunk[2]
        if before is not None and not self.chunks[before][1]:
            self._unbin(before)
            self.chunks[before][0] += chunk[0]
            self.chunks[before][3] = chunk[3]
            if chunk[3] is not None:
                self.chunks[chunk[3]][2] = before
            del self.chunks[address]
            address = before
        self._bin(address)

    def _bin(self, address: int) -> None:
        size = self.chunks[address][0]
        bisect.insort(self.bins[_bin(size)], (size, address))

    def _unbin(self, address: int) -> None:
        size = self.chunks[address][0]
        free = self.bins[_bin(size)]
        del free[bisect.bisect_left(free, (size, address))]

    def _take(self, need: int) -> int | None:
        for b in range(_bin(need), BINS):
            free = self.bins[b]
            i = bisect.bisect_left(free, (need, -1))
            if i == len(free):
                continue
            size, address = free.pop(i)
            chunk = self.chunks[address]
            if size >= 2 * need or size - need >= max(self.max_dead_bytes, MIN_ALLOCATION):
                rest = address + need
                self.chunks[rest] = [size - need, False, address, chunk[3]]
                if chunk[3] is not None:
                    self.chunks[chunk[3]][2] = rest
                chunk[0], chunk[3] = need, rest
                self._bin(rest)
            chunk[1] = True
            return address
        return None

    def _extend(self, need: int) -> None:
        available = (self.limit - self.regions) // MIN_ALLOCATION * MIN_ALLOCATION
        if need > available:
            raise OutOfArena(need)
        if self.strategy == NEXT_POWER_OF_TWO:
            grew = False
            while need > self.next_region:
                self.next_region *= 2
                grew = True
            size = min(self.next_region, available)
            if not grew:
                self.next_region *= 2
        else:
            size = need
        self._top -= size + (1 << 32)
        self.regions += size
        self.chunks[self._top] = [size, False, None, None]
        self._bin(self._top)


def _outside(key) -> bool:
    return isinstance(key, tuple) and key[0] == OUTSIDE


def _in_arena(events: list[tuple[object, int]]) -> list[tuple[object, int]]:
    """The events of `events` that onnxruntime's allocator serves (not the kernels' buffers from malloc)."""
    return [e for e in events if not _outside(e[0])]


def outside_peak(events: list[tuple[object, int]]) -> int:
    """The most bytes of `events` alive at once that kernels take from malloc rather than from the arena
    (`simulate.OutsideAllocator`): what a process holds beside the arena's regions. glibc keeps such a buffer's
    memory in its heap once freed (traced: ScatterElements' indices, taken from the heap from the second run on),
    so it adds to the resident set as a whole, wherever the arena peaks."""
    return live_peak([e for e in events if _outside(e[0])])


PAGE = 4096
HANDLE_BYTES = 8  # the arena's index of a region: one chunk handle (a size_t) per MIN_ALLOCATION bytes


def resident(events: list[tuple[object, int]], strategy: str = NEXT_POWER_OF_TWO,
             max_dead_bytes: int = SPLIT_ALWAYS) -> int:
    """What a CPU process holds for `events` with onnxruntime's arena and no limit, as onnxgrad's CPU sessions
    run a plan made for the arena: the pages its tensors were written in (a tensor touches the pages its bytes
    lie in, not the rest of a larger chunk; a region's pages that no tensor reached are never faulted in), the
    arena's index of each region it added (one 8-byte chunk handle per 256 bytes, all written when the region is
    added: 16 MiB beside 512 MiB of regions, traced as an 8 MiB heap block beside the 256 MiB region), and the
    kernels' buffers from malloc (`outside_peak`). On the dynamo ResNet-50's 1.47-pass plan: 274.9 MiB of pages,
    16.0 of index and 12.25 outside, 303.2 MiB, where the process held 303.4 (BENCHMARKS.md)."""
    arena, held = Arena(1 << 62, strategy, max_dead_bytes), {}
    starts: list[int] = []  # the pages written, as disjoint [start, end) ranges
    ends: list[int] = []
    for key, nbytes in _in_arena(events):
        if not nbytes:
            arena.free(held.pop(key))
            continue
        address = held[key] = arena.alloc(nbytes)
        low, high = address // PAGE * PAGE, -(-(address + nbytes) // PAGE) * PAGE
        i = bisect.bisect_left(ends, low)  # the first range that ends at or after `low`
        j = bisect.bisect_right(starts, high)  # past the last range that starts at or before `high`
        if i < j:
            low, high = min(low, starts[i]), max(high, ends[j - 1])
        starts[i:j], ends[i:j] = [low], [high]
    written = sum(e - s for s, e in zip(starts, ends))
    return written + arena.regions // MIN_ALLOCATION * HANDLE_BYTES + outside_peak(events)


def runs_within(events: list[tuple[object, int]], limit: int, strategy: str = NEXT_POWER_OF_TWO,
                max_dead_bytes: int = MAX_DEAD_BYTES) -> bool:
    """Whether an arena limited to `limit` bytes serves every allocation of `events` (`simulate.allocations`)
    that onnxruntime's allocator makes (not the `outside_peak` ones)."""
    return _serves(_in_arena(events), limit, strategy, max_dead_bytes)


def _serves(events: list[tuple[object, int]], limit: int, strategy: str, max_dead_bytes: int) -> bool:
    arena, held = Arena(limit, strategy, max_dead_bytes), {}
    try:
        for key, nbytes in events:
            if nbytes:
                held[key] = arena.alloc(nbytes)
            else:
                arena.free(held.pop(key))
    except OutOfArena:
        return False
    return True


def least_arena(graph: Graph, strategy: str = NEXT_POWER_OF_TWO, nbytes: dict[int, int] | None = None,
                max_dead_bytes: int = MAX_DEAD_BYTES) -> int:
    """The least limit (bytes) under which the arena runs `graph.nodes` as scheduled: the dynamic bytes the
    process needs with the arena, where `simulate` gives the live ones."""
    return least_limit(allocations(graph, nbytes if nbytes is not None else sizes(graph)), strategy,
                       max_dead_bytes=max_dead_bytes)


def least_limit(events: list[tuple[object, int]], strategy: str = NEXT_POWER_OF_TWO, precision: float = 0.002,
                max_dead_bytes: int = MAX_DEAD_BYTES) -> int:
    """The least limit, within `precision` of itself, under which the arena serves `events` (those it makes:
    add `outside_peak` for what the process holds)."""
    events = _in_arena(events)
    live_sizes: dict = {}
    live = peak = 0
    for key, n in events:
        if n:
            live_sizes[key] = _rounded(n)
            live += live_sizes[key]
            peak = max(peak, live)
        else:
            live -= live_sizes.pop(key)
    low, high = peak - 1, max(peak, MIN_ALLOCATION)
    while not _serves(events, high, strategy, max_dead_bytes):
        low, high = high, high * 2
    while high - low > max(precision * high, MIN_ALLOCATION):
        middle = (low + high) // 2
        if _serves(events, middle, strategy, max_dead_bytes):
            high = middle
        else:
            low = middle
    return high
