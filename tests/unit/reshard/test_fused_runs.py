"""Fused runs (`runs.py`): MoE experts and q/k/v move in the memory order of fused engine
parameters, and a receiver that holds them fused (vLLM's `w13` [E, 2I, H], `w2` [E, H, I],
`qkv_proj`) gets each run message as one span of its memory, straight from the wire: no
staging, every byte still checksummed. Two ranks in one process over a loopback transport;
the sender holds every tensor on its own (a trainer), the receiver fuses them.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from refitplane.errors import ChecksumMismatch
from refitplane.reshard.boxes import full_box
from refitplane.reshard.config import TransferConfig
from refitplane.reshard.executor import Executor
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.plan import RankPlan
from refitplane.reshard.runs import run_key, run_of
from refitplane.reshard.schedule import link_messages, rank_schedule
from refitplane.reshard.shards import LocalShards, torch_dtype
from refitplane.reshard.transfer_report import TransferReport
from tests.unit.reshard.loopback import Corrupt, LoopbackHub, LoopbackTransport, pair_plans

pytestmark = pytest.mark.unit

LAYERS, EXPERTS, HIDDEN, INTER, KV = 2, 6, 8, 4, 2


def _specs() -> dict[str, TensorSpec]:
    specs = [TensorSpec.create("model.embed_tokens.weight", [16, HIDDEN], "bfloat16")]
    for layer in range(LAYERS):
        p = f"model.layers.{layer}"
        specs += [
            TensorSpec.create(f"{p}.input_layernorm.weight", [HIDDEN], "float32"),
            TensorSpec.create(f"{p}.self_attn.q_proj.weight", [HIDDEN, HIDDEN], "bfloat16"),
            TensorSpec.create(f"{p}.self_attn.k_proj.weight", [KV, HIDDEN], "bfloat16"),
            TensorSpec.create(f"{p}.self_attn.v_proj.weight", [KV, HIDDEN], "bfloat16"),
            TensorSpec.create(f"{p}.mlp.gate.weight", [EXPERTS, HIDDEN], "bfloat16"),
        ]
        for e in range(EXPERTS):
            for proj, shape in (
                ("gate_proj", [INTER, HIDDEN]),
                ("up_proj", [INTER, HIDDEN]),
                ("down_proj", [HIDDEN, INTER]),
            ):
                specs.append(
                    TensorSpec.create(f"{p}.mlp.experts.{e}.{proj}.weight", shape, "bfloat16")
                )
    return {s.name: s for s in specs}


def _value(spec: TensorSpec) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(map(ord, spec.name)) * 7919 + len(spec.name))
    raw = torch.randint(0, 256, (spec.nbytes,), generator=gen, dtype=torch.uint8)
    return raw.view(torch_dtype(spec.dtype)).view(spec.shape)


def _plans(specs: dict[str, TensorSpec]) -> tuple[RankPlan, RankPlan]:
    return pair_plans(specs)


def _sender(specs: dict[str, TensorSpec]) -> LocalShards:
    shards = LocalShards()
    for spec in specs.values():
        shards.add(spec, full_box(spec.shape), _value(spec).clone())
    return shards


def _fused_receiver(specs: dict[str, TensorSpec]) -> tuple[LocalShards, list[torch.Tensor]]:
    """vLLM-like fused parameters, filled with garbage; the checkpoint tensors registered as
    views of them. Returns the registry and the fused parameters."""
    shards = LocalShards()
    params: list[torch.Tensor] = []

    def garbage(*shape: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.bfloat16)
        t.view(torch.uint8).fill_(0xA5)
        params.append(t)
        return t

    for layer in range(LAYERS):
        p = f"model.layers.{layer}"
        w13 = garbage(EXPERTS, 2 * INTER, HIDDEN)
        w2 = garbage(EXPERTS, HIDDEN, INTER)
        qkv = garbage(HIDDEN + 2 * KV, HIDDEN)
        for e in range(EXPERTS):
            experts = f"{p}.mlp.experts.{e}"
            shards.add(
                specs[f"{experts}.gate_proj.weight"], full_box((INTER, HIDDEN)), w13[e, :INTER]
            )
            shards.add(
                specs[f"{experts}.up_proj.weight"], full_box((INTER, HIDDEN)), w13[e, INTER:]
            )
            shards.add(specs[f"{experts}.down_proj.weight"], full_box((HIDDEN, INTER)), w2[e])
        attn = f"{p}.self_attn"
        shards.add(specs[f"{attn}.q_proj.weight"], full_box((HIDDEN, HIDDEN)), qkv[:HIDDEN])
        shards.add(
            specs[f"{attn}.k_proj.weight"], full_box((KV, HIDDEN)), qkv[HIDDEN : HIDDEN + KV]
        )
        shards.add(specs[f"{attn}.v_proj.weight"], full_box((KV, HIDDEN)), qkv[HIDDEN + KV :])
    for name, spec in specs.items():
        if run_of(name) is None:
            t = torch.empty(spec.shape, dtype=torch_dtype(spec.dtype))
            t.view(torch.uint8).fill_(0xA5)
            shards.add(spec, full_box(spec.shape), t)
    return shards, params


def _run_pair(config: TransferConfig, corrupt: Corrupt | None = None) -> dict[str, Any]:
    specs = _specs()
    send_plan, recv_plan = _plans(specs)
    receiver, params = _fused_receiver(specs)
    hub = LoopbackHub(corrupt)
    out: dict[str, Any] = {"specs": specs, "receiver": receiver, "params": params}

    def run(rank: int, plan: RankPlan, shards: LocalShards) -> None:
        executor = Executor(LoopbackTransport(hub, rank, 2, config.num_channels), config)
        try:
            out[f"report{rank}"] = executor.run(plan, shards)
        except Exception as exc:
            out[f"error{rank}"] = exc

    threads = [
        threading.Thread(target=run, args=(0, send_plan, _sender(specs))),
        threading.Thread(target=run, args=(1, recv_plan, receiver)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    out["schedule"] = rank_schedule(recv_plan, config)
    return out


# Buckets of 5 experts' gate+up (64 bytes each): runs take several messages each.
CONFIG = TransferConfig(bucket_bytes=320, max_inflight_bytes=2048, num_channels=2)


def test_run_order_is_the_fused_memory_order() -> None:
    names = [
        "model.layers.0.mlp.experts.10.up_proj.weight",
        "model.layers.0.mlp.experts.2.down_proj.weight",
        "model.layers.0.mlp.experts.2.gate_proj.weight",
        "model.layers.0.mlp.experts.10.gate_proj.weight",
        "model.layers.0.mlp.experts.2.up_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.experts.2.gate_proj.weight_scale_inv",
    ]
    ordered = sorted(names, key=lambda n: (run_key(n), run_of(n)[1]))  # type: ignore[index]
    assert ordered == [
        "model.layers.0.mlp.experts.2.gate_proj.weight",
        "model.layers.0.mlp.experts.2.up_proj.weight",
        "model.layers.0.mlp.experts.10.gate_proj.weight",
        "model.layers.0.mlp.experts.10.up_proj.weight",
        "model.layers.0.mlp.experts.2.gate_proj.weight_scale_inv",
        "model.layers.0.mlp.experts.2.down_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
    ]
    assert run_of("model.layers.0.input_layernorm.weight") is None
    assert run_of("model.layers.0.mlp.gate.weight") is None


def test_packed_messages_hold_one_run_each_in_even_sizes() -> None:
    specs = _specs()
    send_plan, _ = _plans(specs)
    messages = link_messages(send_plan.sends[0], specs, CONFIG)
    for m in messages:
        assert len({run_key(c.tensor) for c in m.chunks}) == 1, [c.tensor for c in m.chunks]
    w13 = [
        m for m in messages if m.chunks[0].tensor.endswith(("gate_proj.weight", "up_proj.weight"))
    ]
    # 12 chunks of 64 bytes per layer, buckets of 320: 3 messages of 4 chunks, not 5 + 5 + 2.
    assert [len(m.chunks) for m in w13] == [4, 4, 4] * LAYERS


def test_fused_runs_arrive_exactly_straight_into_the_fused_parameters() -> None:
    out = _run_pair(CONFIG)
    assert "error0" not in out, out
    assert "error1" not in out, out
    report: TransferReport = out["report1"]
    assert report.tensors_verified == report.tensors_total == len(out["specs"])
    receiver: LocalShards = out["receiver"]
    for name, spec in out["specs"].items():
        got = receiver.view(name, full_box(spec.shape))
        assert torch.equal(got.view(torch.uint8), _value(spec).view(torch.uint8)), name
    # Every multi-chunk run message went straight into the receiver's memory: only the
    # messages of tensors outside runs (norms, the router) were staged.
    runs = [m for m in out["schedule"].messages if run_key(m.chunks[0].tensor)]
    assert any(len(m.chunks) > 1 for m in runs)
    staged = [m for m in out["schedule"].messages if m.dst == 1 and not run_key(m.chunks[0].tensor)]
    assert report.packed_messages == sum(len(m.chunks) > 1 for m in staged) > 0
    assert report.direct_messages == report.messages - report.packed_messages
    assert report.staging_peak_bytes < CONFIG.bucket_bytes * 2


def test_a_flipped_bit_in_a_run_message_fails_naming_an_expert() -> None:
    specs = _specs()
    send_plan, _ = _plans(specs)
    messages = link_messages(send_plan.sends[0], specs, CONFIG)
    target = next(
        i for i, m in enumerate(messages) if ".experts." in m.chunks[0].tensor and len(m.chunks) > 1
    )
    channel = messages[target].channel
    nth = sum(1 for m in messages[:target] if m.channel == channel)

    def flip(src: int, dst: int, ch: int, n: int, data: torch.Tensor) -> None:
        if ch == channel and n == nth:
            data[data.numel() // 2] ^= 0x01

    out = _run_pair(CONFIG, corrupt=flip)
    error = out.get("error1")
    assert isinstance(error, ChecksumMismatch), out
    assert messages[target].chunks[0].tensor in str(error)


class _RecordingTransport(LoopbackTransport):
    """Records the order of `connect` and `issue` calls."""

    def __init__(self, hub: LoopbackHub, rank: int, world_size: int, num_channels: int) -> None:
        super().__init__(hub, rank, world_size, num_channels)
        self.calls: list[tuple[str, Any]] = []

    def connect(self, peers: Any, deadline: float) -> None:
        self.calls.append(("connect", list(peers)))

    def issue(self, channel: int, ops: Any, deadline: float) -> Any:
        self.calls.append(("issue", channel))
        return super().issue(channel, ops, deadline)


def test_every_peer_is_connected_before_the_first_op() -> None:
    """Two ends may first post different channels (the sender packs a run the receiver
    takes in place, so they fill their groups differently); NCCL connects lazily and blocks
    the first post until the peer posts there too. So the executor asks the transport to
    connect every peer of the plan before its first op."""
    specs = _specs()
    send_plan, recv_plan = _plans(specs)
    receiver, _ = _fused_receiver(specs)
    hub = LoopbackHub()
    transports = [_RecordingTransport(hub, r, 2, CONFIG.num_channels) for r in (0, 1)]
    threads = [
        threading.Thread(
            target=Executor(transports[0], CONFIG).run, args=(send_plan, _sender(specs))
        ),
        threading.Thread(target=Executor(transports[1], CONFIG).run, args=(recv_plan, receiver)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert transports[0].calls[0] == ("connect", [1])
    assert transports[1].calls[0] == ("connect", [0])
    assert all(kind == "issue" for kind, _ in transports[0].calls[1:])
