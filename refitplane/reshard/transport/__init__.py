"""Point-to-point transports: Gloo (CPU) and nccl4py (GPU) behind one interface."""

from refitplane.reshard.transport.base import Handle, P2POp, Transport

__all__ = ["Handle", "P2POp", "Transport"]
