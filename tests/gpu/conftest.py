"""Shared fixtures for the engine tests: tiny Hugging Face model directories, built once per session."""

from __future__ import annotations

import json

import pytest

from hf_models import make_hf_model


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    """``hf_model_dir(arch, seed=0, **config_overrides) -> str``: a cached tiny model directory.

    Built with ``hf_models.make_hf_model``; the same arguments give the same directory,
    so tests must not modify it (copy it first).
    """
    built: dict[str, str] = {}

    def get(arch: str, seed: int = 0, **config_overrides) -> str:
        key = json.dumps([arch, seed, config_overrides], sort_keys=True)
        if key not in built:
            built[key] = make_hf_model(arch, tmp_path_factory.mktemp(arch), seed=seed, **config_overrides)
        return built[key]

    return get
