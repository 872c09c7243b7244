"""refitplane: a weight-refit control plane for RL post-training.

`refitplane.reshard` is the shared core (layouts, planner, transports, executor) that the
coordinator (`refitplane.coordinator`), the trainer agent (`refitplane.trainer`) and the
generator agent (`refitplane.generator`) all import.
"""

__version__ = "0.1.0"
