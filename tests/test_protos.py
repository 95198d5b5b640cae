"""The generated gRPC code in the repository matches the .proto files."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ["specdec/v1/orchestrator.proto", "specdec/internal/v1/replica.proto"]


def test_generated_code_is_fresh(tmp_path):
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'protos'}", f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *PROTOS], check=True)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc produced nothing"
    for rel in generated:
        assert (ROOT / rel).read_text() == (tmp_path / rel).read_text(), f"{rel} is stale: run `make proto`"
