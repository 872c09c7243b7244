"""How the data plane runs. Identical on every rank of a refit: both ends of a link must cut
the same buckets from the same plan, so the coordinator hands one config to everyone."""

from __future__ import annotations

from dataclasses import dataclass

from refitplane.errors import InvalidArgument

MiB = 1 << 20
DIRECT_MIN_BYTES = 16 * MiB
DELTA_MODES = ("off", "auto", "on")
DELTA_MAX_CHANGED = 0.5


@dataclass(frozen=True, slots=True)
class TransferConfig:
    # Largest message; pieces are cut to fit, small pieces are packed together up to it.
    bucket_bytes: int = 64 * MiB
    # Independent channels (a communicator + CUDA stream each on GPU).
    num_channels: int = 2
    # Staging memory a rank may use at once (packing / unpacking buffers).
    max_inflight_bytes: int = 256 * MiB
    # Bound on every wait of one refit's transfer.
    timeout_s: float = 300.0
    # Compare per-chunk checksums of sender and receiver before reporting success.
    verify_checksums: bool = True
    # Chunks at least this large (or half a bucket) travel alone, straight from/to parameter
    # memory where the view is contiguous; smaller ones are packed (two extra copies each,
    # but fewer, larger messages).
    direct_min_bytes: int = DIRECT_MIN_BYTES
    # Delta refits (`delta.py`): "off"; "auto": a message goes as a delta only while at
    # most `delta_max_changed` of its words changed (above that, dense costs no encoding
    # work on either end); "on": always the smallest encoding. A link takes a delta only
    # when the coordinator names it (both ends hold the same base version).
    delta: str = "off"
    delta_max_changed: float = DELTA_MAX_CHANGED

    def __post_init__(self) -> None:
        if self.bucket_bytes < 1:
            raise InvalidArgument("bucket_bytes must be positive", field="bucket_bytes")
        if self.num_channels < 1 or self.num_channels > 64:
            raise InvalidArgument("num_channels must be 1..64", field="num_channels")
        if self.max_inflight_bytes < self.bucket_bytes:
            raise InvalidArgument(
                f"max_inflight_bytes ({self.max_inflight_bytes}) must be at least "
                f"bucket_bytes ({self.bucket_bytes})",
                field="max_inflight_bytes",
            )
        if self.direct_min_bytes < 1:
            raise InvalidArgument("direct_min_bytes must be positive", field="direct_min_bytes")
        if self.delta not in DELTA_MODES:
            raise InvalidArgument(
                f"delta must be one of {', '.join(DELTA_MODES)}, got {self.delta!r}", field="delta"
            )
        if not 0.0 <= self.delta_max_changed <= 1.0:
            raise InvalidArgument(
                f"delta_max_changed must be within [0, 1], got {self.delta_max_changed}",
                field="delta_max_changed",
            )
        if not self.timeout_s > 0:
            raise InvalidArgument("timeout_s must be positive", field="timeout_s")
