"""Fixtures several test folders share (integration, gpu); not shipped.

    vllm_reference   what vLLM's own `load_weights` writes, the ground truth of every check
    vllm_checks      checks of a worker's layout and receive path, inside vLLM workers
    refit_checks     checks of a worker's weights after a refit, inside vLLM workers

Functions that run inside vLLM workers (`llm.collective_rpc(fn)`) travel by reference, so
workers import them from here: run the tests from the repository root.
"""
