"""The refitplane trainer engine's init info: defaults from the environment, errors that
name the field (a draft source that cannot be published in place included), and a replica
id every rank derives alike."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("vllm")

from vllm.distributed.weight_transfer import (
    HTTPVLLMWeightSyncClient,
    ModuleSource,
    WeightTransferTrainerFactory,
)
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from refitplane.errors import InvalidArgument
from refitplane.trainer import vllm_sync_settings
from refitplane.trainer.vllm_engine import RefitplaneTrainerInitInfo

pytestmark = pytest.mark.unit


def test_the_backend_is_in_vllms_trainer_registry() -> None:
    assert "refitplane" in WeightTransferTrainerFactory._registry
    assert RefitplaneTrainerInitInfo(rank=0).backend == "refitplane"


def test_settings_come_from_the_info_then_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("REFIT_COORDINATOR", "REFIT_JOB", "REFIT_REPLICA_ID", "REFIT_HOST"):
        monkeypatch.delenv(name, raising=False)
    client = HTTPVLLMWeightSyncClient("http://vllm-0:8000")
    with pytest.raises(InvalidArgument) as missing:
        vllm_sync_settings.sync_settings(RefitplaneTrainerInitInfo(rank=0), client)
    assert missing.value.field == "coordinator"
    monkeypatch.setenv("REFIT_COORDINATOR", "coord:50051")
    with pytest.raises(InvalidArgument) as missing:
        vllm_sync_settings.sync_settings(RefitplaneTrainerInitInfo(rank=0), client)
    assert missing.value.field == "job"
    monkeypatch.setenv("REFIT_JOB", "grpo")
    settings = vllm_sync_settings.sync_settings(
        RefitplaneTrainerInitInfo(rank=1, job="ppo"), client
    )
    assert (settings.coordinator, settings.job, settings.world_size) == ("coord:50051", "ppo", 1)
    # Every rank has the same client, so the same replica id.
    again = vllm_sync_settings.sync_settings(RefitplaneTrainerInitInfo(rank=0), client)
    assert settings.replica_id == again.replica_id
    assert settings.replica_id.startswith("vllm-")
    other = vllm_sync_settings.sync_settings(
        RefitplaneTrainerInitInfo(rank=0), HTTPVLLMWeightSyncClient("http://vllm-1:8000")
    )
    assert other.replica_id != settings.replica_id


def test_several_ranks_without_torch_distributed_need_a_run_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("REFIT_COORDINATOR", "coord:50051")
    monkeypatch.setenv("REFIT_JOB", "grpo")
    client = HTTPVLLMWeightSyncClient("http://vllm-0:8000")
    settings = vllm_sync_settings.sync_settings(
        RefitplaneTrainerInitInfo(rank=0, world_size=2), client
    )
    with pytest.raises(InvalidArgument) as missing:
        vllm_sync_settings.shared_run_id(settings, rank=0)
    assert missing.value.field == "run_id"
    named = vllm_sync_settings.sync_settings(
        RefitplaneTrainerInitInfo(rank=1, world_size=2, run_id="run-7"), client
    )
    assert vllm_sync_settings.shared_run_id(named, rank=1) == "run-7"


class _IteratedOnly(WeightSource):
    """A source that can only be iterated (what a Megatron export looks like to vLLM)."""

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta("model.norm.weight", torch.float32, (4,))]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield "model.norm.weight", torch.ones(4)


@pytest.mark.parametrize(
    ("source", "draft_source", "says"),
    [
        ("module", "iterated", "a draft is published in place"),
        ("iterated", "module", "needs the target published in place too"),
    ],
)
def test_a_draft_source_that_cannot_be_published_in_place_is_refused(
    source: str, draft_source: str, says: str
) -> None:
    """`draft_source` publishes the draft's shards where they lie; a source that can only
    be iterated (or a staged target, which rank 0 alone sends) is refused before anything
    registers, naming the field."""
    sources = {"module": ModuleSource(torch.nn.Linear(4, 4)), "iterated": _IteratedOnly()}
    info = RefitplaneTrainerInitInfo(
        rank=0,
        coordinator="127.0.0.1:9",  # never reached: refused first
        job="grpo",
        draft_source=sources[draft_source],
    )
    with pytest.raises(InvalidArgument, match=says) as refused:
        WeightTransferTrainerFactory.trainer_init(
            info, client=HTTPVLLMWeightSyncClient("http://vllm-0:8000"), source=sources[source]
        )
    assert refused.value.field == "draft_source"
