"""The shared reshard core: layouts, planner, schedule, transports, executor.

The layout, planner and schedule modules are pure Python (no torch) so the coordinator can
plan without a tensor library; the executor, transports and checksums need torch.
"""
