"""Piper planner: outputs."""
