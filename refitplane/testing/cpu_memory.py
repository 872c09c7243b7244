"""The peak of CPU tensor memory a piece of code allocates, without a GPU.

`torch.cuda.max_memory_allocated()` is what the GPU benchmarks report as a generator's extra
memory; on CPU torch keeps no such counter, but its profiler records every allocation and
free of tensor memory (`profile_memory=True`). `allocation_peak` replays those records in
order: the highest running total above what was allocated when it began, which is what
`max_memory_allocated() - memory_allocated()` at the start says on a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class AllocationPeak:
    """Filled when the `allocation_peak` block ends."""

    # Highest bytes allocated above the start at any moment inside the block.
    peak: int = 0
    # Bytes still allocated at the end (allocated inside, not freed inside).
    held: int = 0


@contextmanager
def allocation_peak() -> Iterator[AllocationPeak]:
    """Measure the CPU tensor memory the block allocates (`AllocationPeak`, filled on exit).
    Profiling slows the block down: measure one call, not a loop."""
    from torch.profiler import ProfilerActivity, profile

    result = AllocationPeak()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield result
    records = [
        (event.start_ns(), event.nbytes())
        for event in prof.profiler.kineto_results.events()
        if event.name() == "[memory]"
    ]
    running = 0
    for _, nbytes in sorted(records):
        running += nbytes
        result.peak = max(result.peak, running)
    result.held = running
