"""What an operator sees of the coordinator's requests: Prometheus request metrics for gRPC
and REST, the build-info gauge, and the access log (`refitplane.coordinator.access`)."""
