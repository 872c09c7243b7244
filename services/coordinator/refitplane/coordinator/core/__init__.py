"""The coordinator's core: membership, layouts and planning, group epochs, the refit state
machine, progress and versions. Transports (`grpc/`, `rest/`) are thin wrappers over
`Coordinator`; nothing in here knows about protobuf or HTTP."""
