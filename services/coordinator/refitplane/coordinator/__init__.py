"""The refit coordinator service: one core (`core/`) behind a gRPC transport (`grpc/`) and a
REST transport (`rest/`) in one process and one event loop, with state in a store (`store/`:
Redis, or embedded in-process). Entry point: `refit-coordinator` (`__main__.py`)."""
