"""The committed gRPC stubs (kvd/v1/) are exactly what ``make proto`` generates from proto/."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def test_committed_stubs_are_fresh(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools is not installed (pip install -e '.[dev]')")
    if not (BIN / "protoc-gen-mypy").exists():
        pytest.skip(f"protoc-gen-mypy is not in {BIN} (pip install -e '.[dev]' installs mypy-protobuf)")
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    # The flags of the Makefile's `proto` target, writing into tmp_path instead of the tree.
    r = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-Iproto", f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
         f"--mypy_out={tmp_path}", f"--mypy_grpc_out={tmp_path}", "proto/kvd/v1/kvd.proto"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert [str(p) for p in generated] == [
        "kvd/v1/kvd_pb2.py", "kvd/v1/kvd_pb2.pyi", "kvd/v1/kvd_pb2_grpc.py", "kvd/v1/kvd_pb2_grpc.pyi",
    ]
    stale = [str(p) for p in generated if (tmp_path / p).read_bytes() != (REPO / p).read_bytes()]
    assert not stale, f"committed stubs differ from proto/kvd/v1/kvd.proto: {stale}; run `make proto` and commit"
