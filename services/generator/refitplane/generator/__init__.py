"""The generator agent: a vLLM weight-transfer engine that receives refits straight into the
worker's parameters, the layouts that describe those parameters as boxes of the canonical
Hugging Face tensors, and the sidecar that drives vLLM's pause / update / resume verbs."""
