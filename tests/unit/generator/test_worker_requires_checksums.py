"""A vLLM worker refuses a refit whose transfer runs with checksums off, at PrepareRefit,
naming the setting: vLLM serves a version only once every rank verified it, so such a
refit would overwrite the live weights and fail only after the sidecar's verification wait
(on 2xH100, ~33 s per refit, the replica left not ready)."""

from __future__ import annotations

import pytest
import torch

from refitplane.errors import FailedPrecondition, InvalidArgument
from refitplane.protocol.messages import PrepareRefitCmd
from refitplane.reshard.config import TransferConfig
from refitplane.reshard.shards import LocalShards

pytestmark = pytest.mark.unit

pytest.importorskip("refitplane.generator.vllm_engine")
from refitplane.generator.vllm_worker_member import WorkerMember  # noqa: E402


def test_a_transfer_without_checksums_is_refused_before_any_byte_moves() -> None:
    member = WorkerMember(LocalShards(), device=torch.device("cpu"), local_host="127.0.0.1")
    cmd = PrepareRefitCmd(
        "r1", 2, 0, config=TransferConfig(verify_checksums=False), plan_digest="d"
    )
    with pytest.raises(InvalidArgument) as caught:
        member.on_prepare_refit(cmd)
    assert caught.value.field == "verify_checksums"
    assert "REFIT_VERIFY_CHECKSUMS=false" in caught.value.message
    assert member._prepared == {}  # nothing held for a transfer


def test_with_checksums_on_the_prepare_goes_on_to_its_usual_checks() -> None:
    member = WorkerMember(LocalShards(), device=torch.device("cpu"), local_host="127.0.0.1")
    cmd = PrepareRefitCmd("r1", 2, 3, config=TransferConfig(), plan_digest="d")
    with pytest.raises(FailedPrecondition) as caught:  # no group formed: the epoch check
        member.on_prepare_refit(cmd)
    assert "epoch 3" in caught.value.message
