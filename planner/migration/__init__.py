"""Piper planner: migration."""
