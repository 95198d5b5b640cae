"""The Dockerfile and its build context (no Docker needed: the files are read as text)."""
from __future__ import annotations

import fnmatch
import json
import re

from deploy import REPO_ROOT

DOCKERFILE = (REPO_ROOT / "Dockerfile").read_text()
INSTRUCTIONS = [line.strip() for line in re.sub(r"\\\n", " ", DOCKERFILE).splitlines()
                if line.strip() and not line.lstrip().startswith("#")]


def instructions(name: str) -> list[str]:
    return [line.split(None, 1)[1] for line in INSTRUCTIONS if line.split(None, 1)[0].upper() == name]


def build_args() -> dict[str, str]:
    return dict(arg.split("=", 1) for arg in instructions("ARG") if "=" in arg)


def test_base_image_is_pinned_slim_python_311():
    base = build_args()["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+", base), base
    for source in instructions("FROM"):
        assert source.split()[0] in ("${PYTHON_IMAGE}", "models-${BUNDLE_MODELS}"), source


def test_torch_comes_from_the_chosen_pytorch_index():
    args = build_args()
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert args["TORCH_VERSION"] == "2.13.0"
    assert any('--index-url "${TORCH_INDEX_URL}"' in run and "torch==${TORCH_VERSION}" in run
               for run in instructions("RUN"))


def test_runs_as_uid_10001_with_python_m_entrypoint():
    assert instructions("USER")[-1] == "10001:10001"
    assert json.loads(instructions("ENTRYPOINT")[-1]) == ["python", "-m"]
    assert json.loads(instructions("CMD")[-1]) == ["orchestrator"]
    assert any("--uid 10001" in run for run in instructions("RUN"))


def test_gpu_driver_libraries_mounted_by_gke_are_found():
    """GKE's device plugin mounts libcuda.so.1 under /usr/local/nvidia/lib64, which a slim
    Python base image does not search (the nvidia/cuda images set this path)."""
    env = " ".join(instructions("ENV"))
    assert re.search(r"LD_LIBRARY_PATH=\S*/usr/local/nvidia/lib64", env), env


def test_the_image_leaves_out_the_deploy_tooling():
    assert any("deploy\\/requirements\\.txt/d" in run for run in instructions("RUN"))


def dockerignore_allows(path: str) -> bool:
    """Docker's rule: the last matching pattern wins; '!' re-includes."""
    allowed = True
    for raw in (REPO_ROOT / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/") or \
                (pattern.startswith("**/") and fnmatch.fnmatch(path.rsplit("/", 1)[-1], pattern[3:])):
            allowed = negate
    return allowed


def test_build_context_holds_what_the_copies_need_and_little_else():
    sources = [c.split()[0] for c in instructions("COPY") if not c.startswith("--from")]
    assert sources, "no COPY from the context"
    for source in sources:
        assert dockerignore_allows(source), f".dockerignore hides {source}"
    for hidden in (".git", ".venv", "tests", "training", "deploy/base", "specdec/__pycache__"):
        assert not dockerignore_allows(hidden), f"{hidden} should stay out of the build context"


def test_the_cpu_kernels_are_compiled_into_the_image_for_a_compilerless_runtime():
    from specdec import native

    runs = instructions("RUN")
    assert any("g++" in run for run in runs)  # in the build stage only
    assert any("python -m specdec.native --cache /opt/specdec-kernels" in run for run in runs)
    assert "/opt/specdec-kernels /opt/specdec-kernels" in " ".join(instructions("COPY"))
    assert "SPECDEC_KERNEL_CACHE=/opt/specdec-kernels" in " ".join(instructions("ENV"))
    for source in native.SOURCES + native.HEADERS:  # every file the module's name hashes
        assert dockerignore_allows(str(source.relative_to(REPO_ROOT))), source
