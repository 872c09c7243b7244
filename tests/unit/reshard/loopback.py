"""An in-process transport for executor unit tests: ranks are threads of one process.

Sends complete at once (their bytes are copied into the hub, as Gloo's do not block on the
receiver); a receive completes when the next message from its peer on its channel is there,
matched in posting order. `corrupt(src, dst, channel, n)` may change the n-th message of a
pair on a channel after the sender checksummed it (a bit flip on the wire).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

import torch

from refitplane.errors import TransferError, TransferTimeout
from refitplane.reshard.boxes import Box, full_box
from refitplane.reshard.config import TransferConfig
from refitplane.reshard.executor import Executor
from refitplane.reshard.layout import LayoutBuilder, TensorSpec
from refitplane.reshard.plan import RankPlan
from refitplane.reshard.planner import build_plan
from refitplane.reshard.shards import LocalShards
from refitplane.reshard.transfer_report import TransferReport
from refitplane.reshard.transport.base import Handle, P2POp, Transport

Corrupt = Callable[[int, int, int, int, torch.Tensor], None]


def pair_plans(
    specs: Mapping[str, TensorSpec], needed: Callable[[TensorSpec], Box] | None = None
) -> tuple[RankPlan, RankPlan]:
    """The plans of a two-rank refit: rank 0 holds every tensor whole, rank 1 needs
    `needed(spec)` of each (all of it by default)."""
    source, target = LayoutBuilder(), LayoutBuilder()
    for spec in specs.values():
        source.add(spec, 0, full_box(spec.shape))
        target.add(spec, 1, needed(spec) if needed is not None else full_box(spec.shape))
    plan = build_plan(source.build(), target.build())
    return plan.rank_plan(0), plan.rank_plan(1)


class LoopbackHub:
    def __init__(self, corrupt: Corrupt | None = None) -> None:
        self.cond = threading.Condition()
        self.mail: dict[tuple[int, int, int], deque[torch.Tensor]] = {}
        self.sent: dict[tuple[int, int, int], int] = {}
        self.aborted: set[int] = set()
        self.corrupt = corrupt


class LoopbackTransport(Transport):
    def __init__(self, hub: LoopbackHub, rank: int, world_size: int, num_channels: int) -> None:
        self.hub = hub
        self.rank = rank
        self.world_size = world_size
        self.num_channels = num_channels
        self.device = torch.device("cpu")
        self.issued = 0

    def issue(self, channel: int, ops: Sequence[P2POp], deadline: float) -> Handle:
        hub = self.hub
        pending: list[P2POp] = []
        with hub.cond:
            for op in ops:
                if op.send:
                    key = (self.rank, op.peer, channel)
                    data = op.buffer.clone()
                    n = hub.sent.get(key, 0)
                    hub.sent[key] = n + 1
                    if hub.corrupt is not None:
                        hub.corrupt(self.rank, op.peer, channel, n, data)
                    hub.mail.setdefault(key, deque()).append(data)
                else:
                    pending.append(op)
            hub.cond.notify_all()
        self.issued += 1
        return Handle(channel, pending)

    def _progress(self, handle: Handle) -> bool:
        """Match what can be matched (caller holds the hub's lock); True when done."""
        pending: list[P2POp] = handle.payload
        blocked: set[int] = set()
        left: list[P2POp] = []
        for op in pending:
            queue = self.hub.mail.get((op.peer, self.rank, handle.channel))
            if op.peer in blocked or not queue:
                blocked.add(op.peer)  # later receives from this peer stay in order
                left.append(op)
                continue
            data = queue.popleft()
            if data.numel() != op.buffer.numel():
                raise TransferError(
                    f"rank {self.rank}: {data.numel()} bytes from rank {op.peer}, "
                    f"{op.buffer.numel()} expected"
                )
            op.buffer.copy_(data)
        handle.payload = left
        return not left

    def poll(self, handle: Handle) -> bool:
        with self.hub.cond:
            return self._progress(handle)

    def wait(self, handle: Handle, deadline: float, cancel: threading.Event | None = None) -> None:
        with self.hub.cond:
            while not self._progress(handle):
                if self.rank in self.hub.aborted:
                    raise TransferError(f"rank {self.rank}: aborted")
                if cancel is not None and cancel.is_set():
                    raise TransferError(f"rank {self.rank}: cancelled")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransferTimeout(f"rank {self.rank}: deadline passed")
                self.hub.cond.wait(min(remaining, 0.05))

    def abort(self) -> None:
        with self.hub.cond:
            self.hub.aborted.add(self.rank)
            self.hub.cond.notify_all()

    def close(self) -> None:
        return None


def run_pair(
    hub: LoopbackHub,
    transports: Sequence[Transport],
    plans: Sequence[RankPlan],
    shards: Sequence[LocalShards],
    config: TransferConfig,
    reports: dict[int, TransferReport] | None = None,
    *,
    executors: Sequence[Executor] | None = None,
    armed: str = "",
) -> dict[int, BaseException]:
    """Ranks 0 and 1 of a pair (`pair_plans`) run one refit each, on a thread of their own
    over `hub` (with `executors` where given, starting the runs they armed for refit
    `armed`); what each raised, by rank (a rank that fails aborts its peer's waits), and
    into `reports` what each that finished reported."""
    errors: dict[int, BaseException] = {}

    def run(rank: int) -> None:
        try:
            executor = executors[rank] if executors else Executor(transports[rank], config)
            report = executor.run(plans[rank], shards[rank], armed=armed)
            if reports is not None:
                reports[rank] = report
        except BaseException as exc:  # returned to the test
            errors[rank] = exc
            hub.aborted.add(1 - rank)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank is still running after 60 s"
    return errors


def bf16_pair_shards(
    specs: Mapping[str, TensorSpec],
) -> tuple[dict[str, torch.Tensor], LocalShards, LocalShards]:
    """Seeded bf16 values of every tensor of `specs`, a source holding them whole and a
    target of zeros of the same shapes."""
    values = {
        name: torch.randn(spec.shape, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        for i, (name, spec) in enumerate(specs.items())
    }
    source, target = LocalShards(), LocalShards()
    for name, spec in specs.items():
        source.add(spec, full_box(spec.shape), values[name].clone())
        target.add(spec, full_box(spec.shape), torch.zeros(spec.shape, dtype=torch.bfloat16))
    return values, source, target


# Messages of 8 KiB and more go alone, straight from/to the tensors; smaller ones are packed.
DIRECT_CONFIG = TransferConfig(
    bucket_bytes=16384,
    max_inflight_bytes=65536,
    num_channels=2,
    timeout_s=30,
    direct_min_bytes=8192,
)


def embedding_then_layers(layers: int = 3) -> dict[str, TensorSpec]:
    """An embedding (16 KiB: one direct message that fills a group under `DIRECT_CONFIG`),
    then per layer a large tensor (direct) and two small ones (packed)."""
    specs = [TensorSpec.create("model.embed_tokens.weight", [128, 64], "bfloat16")]
    for layer in range(layers):
        specs += [
            TensorSpec.create(f"model.layers.{layer}.mlp.up_proj.weight", [96, 64], "bfloat16"),
            TensorSpec.create(f"model.layers.{layer}.input_layernorm.weight", [64], "bfloat16"),
            TensorSpec.create(
                f"model.layers.{layer}.post_attention_layernorm.weight", [64], "bfloat16"
            ),
        ]
    return {s.name: s for s in specs}
