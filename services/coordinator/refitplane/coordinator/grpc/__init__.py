"""The gRPC transport: thin servicers over the core, one interceptor for auth, request
decoding and error mapping, plus grpc.health.v1 and server reflection."""
