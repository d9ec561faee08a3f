"""Marks and helpers of the GPU tests (not a test module).

Every GPU test module sets ``pytestmark = GPU`` (plus ``NEEDS_VMM`` / ``NEEDS_TRITON`` where it
needs them), so on a machine without CUDA every one of them is skipped with a reason.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


HAS_CUDA = torch.cuda.is_available()

GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (torch.cuda.is_available() is false)"),
]
NEEDS_VMM = pytest.mark.skipif(not _has("cuda.bindings"), reason="needs the cuda-python package (cuda.bindings.driver)")
NEEDS_TRITON = pytest.mark.skipif(not _has("triton"), reason="needs Triton")



def mooncake_cuda_missing() -> str:
    """Why the Mooncake backend cannot move a CUDA arena here ("" when it can: the CUDA build
    imports). Imports ``mooncake.engine`` through kvd (its log settings first); call it from
    the modules that need it, not at this module's import."""
    from kvd.backends.mooncake import build_info
    from kvd.errors import Unavailable

    try:
        info = build_info()
    except Unavailable as exc:
        return str(exc)
    if not info.cuda:
        return f"needs Mooncake's CUDA build (mooncake-transfer-engine); installed: {info.describe()}"
    return ""
