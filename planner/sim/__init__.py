"""Flow-level all-to-all simulator internals; the entry point is planner.sim.halo."""
