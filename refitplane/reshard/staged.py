"""Staged receive in bounded memory: checkpoint tensors that exist a bucket at a time.

A rank that cannot receive into its live weights (a vLLM worker whose kernels repack them)
receives whole-shape checkpoint tensors and hands them to the model's loader. Staging every
such tensor at once costs the whole model again on every rank; `StagedShards` instead gives
those tensors memory only while their *bucket* is being received:

- the executor walks the schedule stage by stage (`stages.py`; a message never spans two
  stages) and, for a rank with staged tensors, cuts the stages it receives in into buckets
  (`StagedShards.plan`): consecutive stages, as many as fit in the largest stage's bytes (a
  stage larger than that alone), and never splitting a set of tensors the owner must apply
  together (`units`: e.g. the tensors feeding one vLLM decoder layer);
- before a bucket's first message the executor completes everything in flight and opens it
  (`open`: its tensors are carved from one arena, allocated once per refit before the first
  byte moves; the regions no registered box covers are zeroed); after its last message it
  completes everything in flight again — every byte of the bucket is in place and was
  checksummed — and closes it (`close`): the owner's `apply` runs (e.g. vLLM's layerwise
  reload of those layers) and the memory goes back to the arena;
- the last bucket stays open after the transfer (`held`): the owner applies it once the
  whole replica verified (`apply_held`), or drops it (`discard`); either frees the arena.

So a rank's staging during a refit is the largest bucket — at most the largest stage, or
the largest set of stages that must be applied together — plus the executor's ring for the
messages that are not one span of their bucket's layout (`probing` tells which before any
arena exists), both within `max_inflight_bytes` (`prepared_plan.staging_room` sizes the ring
and refuses a budget that cannot hold the largest bucket), and nothing between refits. With
`layerwise=False` every stage is one bucket, held until the owner applies it: the whole
staged model at once, outside the budget by choice, and nothing applied before the transfer
verified.

Applying a bucket before the transfer ends changes live weights before the final checksum
comparison (checksums are compared after the last message): `touched` says whether any
`apply` started, so a failure after it is reported as one that modified weights.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from refitplane.errors import InvalidArgument, LayoutError
from refitplane.reshard.boxes import Box, box_numel, format_box, full_box, to_slices
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.shards import LocalShards, torch_dtype
from refitplane.reshard.stages import StageKey, format_stage, stage_of
from refitplane.reshard.staging import aligned

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StagedBucket:
    """Consecutive stages whose staged tensors are received, then applied, together."""

    index: int
    stages: tuple[StageKey, ...]
    # The staged tensors received in these stages, in stage order.
    names: tuple[str, ...]
    # Arena bytes its tensors take (each whole-shape, aligned).
    nbytes: int

    def describe(self) -> str:
        first, last = format_stage(self.stages[0]), format_stage(self.stages[-1])
        where = first if first == last else f"{first} .. {last}"
        return f"bucket {self.index} ({where}: {len(self.names)} tensors, {self.nbytes} bytes)"


# Called with a bucket and its tensors (name → whole-shape tensor holding this rank's boxes).
ApplyFn = Callable[[StagedBucket, Mapping[str, torch.Tensor]], None]


class StagedShards(LocalShards):
    """A shard registry some of whose tensors are staged: registered with `add_staged`,
    given memory only while their bucket is open (see the module docstring). Other tensors
    are registered with `add` as in any `LocalShards` (a live vLLM worker's fast path)."""

    def __init__(
        self,
        device: torch.device | str,
        apply: ApplyFn,
        *,
        layerwise: bool = True,
        units: Iterable[Iterable[str]] = (),
    ) -> None:
        super().__init__()
        self.device = torch.device(device)
        self._apply = apply
        self.layerwise = layerwise
        self._units = [frozenset(u) for u in units]
        self._staged: dict[str, TensorSpec] = {}
        # Whether the registered boxes of a staged tensor cover all of it (else zero-fill).
        self._covered: dict[str, int] = {}
        self._arena: torch.Tensor | None = None
        self._open: dict[str, torch.Tensor] = {}
        self._open_bucket: StagedBucket | None = None
        self.staging_bytes = 0
        self.staging_peak_bytes = 0
        self.buckets_applied = 0
        self.touched = False

    # -- registration ---------------------------------------------------------------------------

    def add_staged(self, spec: TensorSpec, box: Box) -> None:
        """Register `box` of `spec` as staged: received into a whole-shape tensor of the
        checkpoint's dtype that exists only while its bucket is open."""
        placeholder = torch.empty(
            tuple(b - a for a, b in box), dtype=torch_dtype(spec.dtype), device="meta"
        )
        self.add(spec, box, placeholder)
        self._staged[spec.name] = spec
        self._covered[spec.name] = self._covered.get(spec.name, 0) + box_numel(box)

    @property
    def staged_names(self) -> frozenset[str]:
        return frozenset(self._staged)

    def staged_bytes(self, name: str) -> int:
        spec = self._staged[name]
        return box_numel(full_box(spec.shape)) * spec.itemsize

    def view(self, name: str, box: Box) -> torch.Tensor:
        if name not in self._staged:
            return super().view(name, box)
        tensor = self._open.get(name)
        if tensor is None:
            raise LayoutError(
                "staged tensor used while its bucket is not open (stage "
                f"{format_stage(stage_of(name))})",
                tensor=name,
                box=format_box(box),
            )
        return tensor[to_slices(box)]

    def resident(self) -> list[tuple[TensorSpec, Box, torch.Tensor]]:
        """The registered views that are real memory now: every non-staged view, and the
        staged ones of the open bucket."""
        out = []
        for sv in self:
            if sv.spec.name not in self._staged:
                out.append((sv.spec, sv.box, sv.tensor))
            elif sv.spec.name in self._open:
                out.append((sv.spec, sv.box, self.view(sv.spec.name, sv.box)))
        return out

    # -- the executor's side ------------------------------------------------------------------

    def plan(self, stages: Sequence[tuple[StageKey, Sequence[str]]]) -> list[StagedBucket]:
        """Buckets for receiving `stages` (in schedule order, each with the tensors received
        in it); stages without staged tensors belong to no bucket."""
        staged = [(key, [n for n in names if n in self._staged]) for key, names in stages]
        staged = [(key, names) for key, names in staged if names]
        if not staged:
            return []
        received = {n for _, names in staged for n in names}
        missing = sorted(self.staged_names - received)
        if missing:
            raise LayoutError(
                f"staged on this rank but the plan receives nothing of it ({len(missing)} "
                "staged tensor(s) missing)",
                tensor=missing[0],
            )
        position = {n: i for i, (_, names) in enumerate(staged) for n in names}
        # Stages a unit spans must share a bucket: merge the intervals they cover.
        joined_until = list(range(len(staged)))
        for unit in self._units:
            spots = [position[n] for n in unit if n in position]
            if spots:
                for i in range(min(spots), max(spots)):
                    joined_until[i] = max(joined_until[i], max(spots))
        atoms: list[list[int]] = []
        end = -1
        for i in range(len(staged)):
            if i > end:
                atoms.append([])
            atoms[-1].append(i)
            end = max(end, joined_until[i])

        def atom_bytes(atom: list[int]) -> int:
            return sum(aligned(self.staged_bytes(n)) for i in atom for n in staged[i][1])

        cap = max(atom_bytes(a) for a in atoms) if self.layerwise else None
        groups: list[list[int]] = []
        filled = 0
        for atom in atoms:
            size = atom_bytes(atom)
            if groups and (cap is None or filled + size <= cap):
                groups[-1] += atom
                filled += size
            else:
                groups.append(list(atom))
                filled = size
        return [
            StagedBucket(
                index=b,
                stages=tuple(staged[i][0] for i in group),
                names=tuple(n for i in group for n in staged[i][1]),
                nbytes=atom_bytes(group),
            )
            for b, group in enumerate(groups)
        ]

    def begin(self, buckets: Sequence[StagedBucket]) -> None:
        """A transfer starts: allocate the arena its largest bucket needs (before any byte
        moves: nothing may allocate device memory while transfers are in flight)."""
        self.discard()
        self.touched = False
        self.buckets_applied = 0
        self.staging_peak_bytes = 0
        size = max((b.nbytes for b in buckets), default=0)
        if size:
            self._arena = torch.empty(size, dtype=torch.uint8, device=self.device)
            self.staging_bytes = size
            self.staging_peak_bytes = size

    def open(self, bucket: StagedBucket) -> None:
        """Give the bucket's tensors memory (the executor completed everything in flight)."""
        if self._open_bucket is not None:
            raise InvalidArgument(
                f"{bucket.describe()} opened while {self._open_bucket.describe()} is open",
                field="bucket",
            )
        if self._arena is None or self._arena.numel() < bucket.nbytes:
            raise InvalidArgument(
                f"{bucket.describe()} does not fit the staging arena begun for this transfer",
                field="bucket",
            )
        for name, tensor in self._carve(self._arena, bucket).items():
            if self._covered[name] < tensor.numel():
                # The loader reads only this rank's boxes; the rest is zero, never garbage.
                tensor.zero_()
            self._open[name] = tensor
        if self.device.type == "cuda":
            # Receives are posted on the transport's own streams: the fill, and the previous
            # bucket's apply reading this memory, must be done before they write into it.
            torch.cuda.current_stream(self.device).synchronize()
        self._open_bucket = bucket

    def _carve(self, arena: torch.Tensor, bucket: StagedBucket) -> dict[str, torch.Tensor]:
        """The bucket's tensors, whole-shape, back to back (aligned) from the arena's start."""
        tensors: dict[str, torch.Tensor] = {}
        offset = 0
        for name in bucket.names:
            spec = self._staged[name]
            nbytes = self.staged_bytes(name)
            region = arena[offset : offset + nbytes]
            offset += aligned(nbytes)
            tensors[name] = region.view(torch_dtype(spec.dtype)).view(spec.shape)
        return tensors

    @contextmanager
    def probing(self, bucket: StagedBucket) -> Iterator[None]:
        """The bucket open over memory that does not exist (the meta device), laid out as
        `open` lays it: `view` answers with views whose offsets and strides are the real
        ones, so the executor learns, before any arena exists, which of the bucket's
        messages will be one span of it (direct) and which need staging ring space."""
        if self._open_bucket is not None:
            raise InvalidArgument(
                f"{bucket.describe()} probed while {self._open_bucket.describe()} is open",
                field="bucket",
            )
        arena = torch.empty(bucket.nbytes, dtype=torch.uint8, device="meta")
        self._open = self._carve(arena, bucket)
        try:
            yield
        finally:
            self._open = {}

    def close(self, bucket: StagedBucket) -> None:
        """The bucket's bytes are in place (and checksummed): apply them, free them."""
        if self._open_bucket is not bucket:
            raise InvalidArgument(f"{bucket.describe()} closed but not open", field="bucket")
        tensors = dict(self._open)
        self._open.clear()
        self._open_bucket = None
        # Set before: an apply that fails half-way has changed weights.
        self.touched = True
        try:
            self._apply(bucket, tensors)
        finally:
            del tensors
        self.buckets_applied += 1

    @property
    def held(self) -> StagedBucket | None:
        """The bucket left open after a transfer (applied by `apply_held`)."""
        return self._open_bucket

    # -- the owner's side ---------------------------------------------------------------------

    def apply_held(self) -> None:
        """Apply the bucket a completed transfer left open, then free all staging."""
        try:
            bucket = self._open_bucket
            if bucket is not None:
                self.close(bucket)
        finally:
            self.discard()

    def discard(self) -> None:
        """Drop whatever is staged (a failed or discarded refit) and the arena: no staging
        memory is held between refits."""
        had_arena = self._arena is not None
        self._open.clear()
        self._open_bucket = None
        self._arena = None
        self.staging_bytes = 0
        if had_arena and self.device.type == "cuda":
            # Give the arena back to the device, not only to torch's caching allocator.
            torch.cuda.empty_cache()
