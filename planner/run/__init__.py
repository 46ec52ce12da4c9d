"""A training run of a plan: its options (options), what --scale shrinks (scale) and the
RunSpec every process executes (spec). Torch-free, so `piper run` checks a run before it
launches one."""
