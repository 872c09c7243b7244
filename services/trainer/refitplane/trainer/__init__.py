"""The trainer agent: a library imported into each trainer rank (layouts, sends, refit hooks)."""
