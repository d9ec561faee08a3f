"""Fixtures of the accuracy tests: the models (built once) and colocated references (computed
once per engine configuration and workload)."""

from __future__ import annotations

import pytest
import torch

from kvd.engine.records import Completion, EngineConfig, Request
from kvd.engine.model import Models, build_models
from kvd.engine.reference import run_colocated


@pytest.fixture(scope="session")
def models() -> Models:
    torch.set_num_threads(1)
    return build_models()


@pytest.fixture(scope="session")
def reference(models):
    """``reference(reqs, cfg) -> {rid: Completion}``, memoised for the session."""
    cache: dict[tuple, dict[str, Completion]] = {}

    def get(reqs: list[Request], cfg: EngineConfig) -> dict[str, Completion]:
        key = (tuple(reqs), cfg)
        if key not in cache:
            cache[key] = run_colocated(reqs, models, cfg)
        return cache[key]

    return get
