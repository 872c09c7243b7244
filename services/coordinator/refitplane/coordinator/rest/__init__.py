"""The REST transport: a FastAPI app over the core (OpenAPI at /openapi.json)."""
