"""Generated gRPC code is committed: it must equal what grpcio-tools makes from protos/ now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GEN = ROOT / "protos" / "academus" / "v1"


def test_generated_code_is_fresh(tmp_path: Path):
    protos = sorted(str(p.relative_to(ROOT / "protos")) for p in GEN.glob("*.proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT / "protos"),
                    f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}", *protos],
                   check=True)
    fresh = sorted((tmp_path / "academus" / "v1").glob("*_pb2*"))
    assert fresh, "protoc produced nothing"
    stale = [p.name for p in fresh if (GEN / p.name).read_text() != p.read_text()]
    missing = [p.name for p in fresh if not (GEN / p.name).exists()]
    assert not stale and not missing, f"run `make protos`: stale {stale}, missing {missing}"


def test_generated_modules_import_under_the_academus_namespace():
    from academus.v1 import inference_pb2, scheduler_pb2_grpc, worker_pb2_grpc

    assert inference_pb2.DESCRIPTOR.package == "academus.v1"
    assert hasattr(scheduler_pb2_grpc, "SchedulerStub") and hasattr(worker_pb2_grpc, "WorkerStub")


def test_no_generic_top_level_packages_installed(tmp_path: Path):
    """From outside the checkout only `academus.*` is importable, never `shared` or `services`."""
    probe = ("import importlib.util as u, sys; "
             "sys.exit(0 if u.find_spec('academus.shared.runtime.config') and "
             "not any(u.find_spec(n) for n in ('shared', 'services', 'loadgen', 'protos')) else 1)")
    assert subprocess.run([sys.executable, "-c", probe], cwd=tmp_path).returncode == 0
