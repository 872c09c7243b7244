"""The in-world vLLM baseline swaps a replica's weight-transfer engine on the worker itself:
`collective_rpc` hands a one-process replica's functions vLLM's `WorkerWrapperBase`, which
forwards reads to the worker but keeps writes, so a swap set on it never reached the
worker's verbs (on vLLM 0.26 the baseline then waited for a rank that never joined)."""

from __future__ import annotations

import types

import pytest

from refitplane.testing.refit_world.vllm_baseline import swap_transfer_engine, wrapped_worker

worker_base = pytest.importorskip("vllm.v1.worker.worker_base")


def _worker(active: object, nccl: object) -> types.SimpleNamespace:
    config = types.SimpleNamespace(
        weight_transfer_config=types.SimpleNamespace(backend="refitplane")
    )
    # The nccl engine made earlier (the swap creates it through vLLM's factory on first use).
    return types.SimpleNamespace(
        weight_transfer_engine=active, vllm_config=config, _refit_transfer_engines={"nccl": nccl}
    )


def test_swap_reaches_the_worker_behind_vllms_wrapper() -> None:
    refitplane_engine, nccl_engine = object(), object()
    wrapper = worker_base.WorkerWrapperBase(rpc_rank=0)
    wrapper.worker = _worker(refitplane_engine, nccl_engine)

    assert swap_transfer_engine(wrapper, "nccl") == "refitplane"
    # What the worker's own verb (`init_weight_transfer_engine`) reads.
    assert wrapper.worker.weight_transfer_engine is nccl_engine
    assert swap_transfer_engine(wrapper, "refitplane") == "nccl"
    assert wrapper.worker.weight_transfer_engine is refitplane_engine


def test_a_bare_worker_is_its_own_worker() -> None:
    worker = _worker(object(), object())
    assert wrapped_worker(worker) is worker
    swap_transfer_engine(worker, "nccl")
    assert worker.weight_transfer_engine is worker._refit_transfer_engines["nccl"]
