"""Piper planner: ip."""
