"""Fixtures of the export tests: the plans a new user makes first, made once per test run."""

from __future__ import annotations

import os

import pytest

from tests.planner.outputs.export_plans import user_plans


@pytest.fixture(scope="session")
def first_plans(tmp_path_factory):
    """name -> Plan for export_plans.USER_PLANS (DeepSeek-V3, Qwen3, Llama-4 Scout, GPT-OSS,
    the default plan). pytest-xdist workers share one folder of this run (their base
    temporary folders' parent), so the workers split the searches instead of each making all
    five."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        folder = tmp_path_factory.getbasetemp().parent / "first_plans"
        folder.mkdir(exist_ok=True)
    else:
        folder = tmp_path_factory.mktemp("first_plans")
    return user_plans(folder)
