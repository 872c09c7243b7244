"""Model helpers that need no model hub: tiny Hugging Face checkpoints for demos and tests."""
