"""Where the data-only profiles live (profiles/models, profiles/clusters, profiles/traces)."""

from __future__ import annotations

from pathlib import Path

PROFILES_DIR = Path(__file__).resolve().parents[2] / "profiles"
MODELS_DIR = PROFILES_DIR / "models"
CLUSTERS_DIR = PROFILES_DIR / "clusters"
TRACES_DIR = PROFILES_DIR / "traces"
