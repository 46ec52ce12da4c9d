"""Sizing a training run: GPUs, days, GPU-hours, cost and energy per cluster size, with the
time lost to failures priced (`piper size`, planner/SIZING.md).

request (what is asked, cited defaults) -> sweep (a plan per cluster and size) -> goodput
(failures and checkpoints) -> rows (flags, Pareto set) -> report and plots (the files).
"""
