"""Piper planner: resources."""
