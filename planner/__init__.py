"""Piper planner: specs -> resource model -> integer programs -> plans. Never imports torch."""

__version__ = "0.1.0"
