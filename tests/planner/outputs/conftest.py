"""Fixtures of the export tests: the plans a new user makes first, made once per session."""

from __future__ import annotations

import pytest

from tests.planner.outputs.export_plans import user_plans


@pytest.fixture(scope="session")
def first_plans(tmp_path_factory):
    """name -> Plan for export_plans.USER_PLANS (DeepSeek-V3, Qwen3, Llama-4 Scout, GPT-OSS,
    the default plan)."""
    return user_plans(tmp_path_factory.mktemp("first_plans"))
