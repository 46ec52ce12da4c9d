"""Piper planner: specs -> resource model -> integer programs -> plans and reports. Never imports torch."""

__version__ = "0.1.0"
