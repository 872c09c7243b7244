"""`refitctl demo`: a complete refit on one CPU machine (coordinator, trainer ranks, vLLM)."""
