"""The reference generator engine: a generator replica rank without vLLM.

Each rank holds its tensor-parallel share of a Hugging Face checkpoint's tensors (split by
`hf_tensor_parallel`) in plain CPU/GPU tensors, registers them as a generator rank,
receives refits exactly as a vLLM worker does (same plan, executor, checksums), and can
rebuild the full state dict for greedy generation with transformers (rank 0 gathers the
replica's shares over the replica's own Gloo group). Byte-only models (e.g. FP8 with block
scales) work too: nothing here interprets the bytes.

Serving is paused while a transfer writes the weights (`serving` lock), so a generation
never sees half-updated tensors; a failed transfer leaves the replica not ready until a
later refit succeeds.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch

from refitplane.agent.dataplane import DataPlaneMember, Prepared, placement_of
from refitplane.agent.session import AgentSession
from refitplane.agent.settings import AgentSettings
from refitplane.errors import FailedPrecondition
from refitplane.generator.hf_tensor_parallel import tp_boxes
from refitplane.protocol import Role
from refitplane.protocol.messages import MemberInfo, PrepareRefitCmd
from refitplane.reshard.boxes import box_shape, to_slices
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.shards import LocalShards, dtype_name, torch_dtype
from refitplane.reshard.transfer_report import TransferReport
from refitplane.reshard.transport.base import P2POp, Transport


def shard_state(
    specs: Mapping[str, TensorSpec],
    rank: int,
    tp_size: int,
    device: torch.device,
    initial: Mapping[str, torch.Tensor] | None = None,
) -> LocalShards:
    """This rank's TP share of every tensor, as fresh storage (filled from `initial`)."""
    shards = LocalShards()
    for name in sorted(specs):
        spec = specs[name]
        box = tp_boxes(spec, tp_size).get(rank)
        if box is None:
            continue
        local = torch.zeros(box_shape(box), dtype=torch_dtype(spec.dtype), device=device)
        if initial is not None and name in initial:
            local.copy_(initial[name][to_slices(box)])
        shards.add(spec, box, local)
    return shards


def specs_of(state: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    return {n: TensorSpec.create(n, list(t.shape), dtype_name(t.dtype)) for n, t in state.items()}


class _GeneratorMember(DataPlaneMember):
    def __init__(self, engine: ReferenceEngine) -> None:
        super().__init__(lambda: engine.shards, device=engine.device, local_host=engine.host)
        self.engine = engine

    def before_transfer(self, cmd: PrepareRefitCmd) -> None:
        self.engine._pause()

    def after_transfer(
        self, prepared: Prepared, report: TransferReport | None, *, weights_modified: bool
    ) -> None:
        self.engine._resume(report is not None, weights_modified, prepared.version)


class ReferenceEngine:
    """One TP rank of a generator replica."""

    def __init__(
        self,
        *,
        coordinator: str,
        job: str,
        replica_id: str,
        rank: int,
        world_size: int,
        specs: Mapping[str, TensorSpec],
        initial: Mapping[str, torch.Tensor] | None = None,
        device: torch.device | str = "cpu",
        host: str = "127.0.0.1",
        token: str | None = None,
        tls_ca: str | None = None,
        version: int = 0,
        settings: AgentSettings | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.host = host
        self.specs = dict(specs)
        self.shards = shard_state(self.specs, rank, world_size, self.device, initial)
        self.version = version
        self.ready = True
        self._serving = threading.Lock()
        self.member = _GeneratorMember(self)
        env = settings or AgentSettings()
        node, gpu = placement_of(self.device, env.node)
        info = MemberInfo(
            job=job,
            role=Role.GENERATOR,
            rank=rank,
            world_size=world_size,
            replica_id=replica_id,
            host=host,
            device=str(self.device),
            node=node,
            device_uuid=gpu,
            version=version,
            # Its registered views are its weights, kept between refits.
            delta_receive=True,
            labels={"delta_receive": "yes"},
        )
        # Like the trainer agent: the token (REFIT_AUTH_TOKEN_FILE wins over REFIT_AUTH_TOKEN)
        # and a TLS coordinator's CA (REFIT_TLS_CA_FILE) come from the environment if not given.
        token = token if token is not None else env.token()
        tls_ca = tls_ca if tls_ca is not None else env.tls_ca()
        self.session = AgentSession(
            coordinator,
            info,
            self.member,
            token=token,
            tls_ca=tls_ca,
            held_version=lambda: self.version,
            serving=self._serves_held,
        )
        self.member.attach(self.session)

    def start(self) -> None:
        self.session.start()
        self.session.publish_layout(self.shards.layout(self.rank))

    def close(self) -> None:
        self.session.close()
        self.member.close()

    # -- serving ------------------------------------------------------------------------------

    def _serves_held(self) -> bool | None:
        """Whether it serves `version` (None while paused: mid-update, or generating)."""
        return None if self._serving.locked() else self.ready

    def _pause(self) -> None:
        if not self._serving.acquire(timeout=60):
            raise FailedPrecondition("generation did not pause within 60 s")

    def _resume(self, done: bool, weights_modified: bool, version: int) -> None:
        if done:
            self.version = version
            self.ready = True
        elif weights_modified:
            # Some weights were overwritten: never serve them until a refit completes.
            self.ready = False
        if self._serving.locked():
            self._serving.release()

    @contextmanager
    def serving(self) -> Iterator[None]:
        """Hold while generating: refits wait for it, and it waits for refits."""
        with self._serving:
            if not self.ready:
                raise FailedPrecondition("this replica failed a refit and holds incomplete weights")
            yield

    def local_state(self) -> dict[str, torch.Tensor]:
        """Full tensors, for a TP1 replica (no gathering needed)."""
        if self.world_size != 1:
            raise FailedPrecondition(
                "local_state() needs TP1; use gather_state() over the replica group"
            )
        return {sv.spec.name: sv.tensor for sv in self.shards}


def gather_state(
    shards: LocalShards,
    specs: Mapping[str, TensorSpec],
    transport: Transport,
    timeout_s: float = 120.0,
) -> dict[str, torch.Tensor] | None:
    """Rank 0 of a replica group collects every rank's shares into full tensors (others
    return None). For reference generation only: the refit path never gathers."""
    import time

    deadline = time.monotonic() + timeout_s
    rank, world = transport.rank, transport.world_size
    full: dict[str, torch.Tensor] = {}
    if rank == 0:
        for name, spec in specs.items():
            full[name] = torch.empty(
                spec.shape, dtype=torch_dtype(spec.dtype), device=transport.device
            )
    for name in sorted(specs):
        spec = specs[name]
        for src, box in sorted(tp_boxes(spec, world).items()):
            if rank == 0 and src == 0:
                full[name][to_slices(box)] = shards.view(name, box)
            elif rank == src:
                data = shards.view(name, box).contiguous().reshape(-1).view(torch.uint8)
                transport.wait(transport.issue(0, [P2POp(True, 0, data)], deadline), deadline)
            elif rank == 0:
                part = torch.empty(
                    box_shape(box), dtype=torch_dtype(spec.dtype), device=transport.device
                )
                transport.wait(
                    transport.issue(
                        0, [P2POp(False, src, part.reshape(-1).view(torch.uint8))], deadline
                    ),
                    deadline,
                )
                full[name][to_slices(box)] = part
    return full if rank == 0 else None
