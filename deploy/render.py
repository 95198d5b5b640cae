"""Render a kustomize tree with kubectl (or a standalone kustomize) into plain objects."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from deploy import REPO_ROOT, DeployError, overlay_dir

MIN_KUSTOMIZE = (5, 0)  # components, labels.includeTemplates, $patch: delete in components


class ToolNotFound(DeployError):
    pass


def find_kubectl() -> list[str]:
    """The command that renders a kustomization dir: [kubectl, "kustomize"] or [kustomize, "build"].

    Looked up in order: $SPECDEC_KUBECTL, .tools/bin, this Python's bin dir (the venv that
    deploy/install_tools.sh fills), then PATH.
    """
    explicit = os.environ.get("SPECDEC_KUBECTL")
    if explicit:
        if not (Path(explicit).is_file() and os.access(explicit, os.X_OK)):
            raise ToolNotFound(f"SPECDEC_KUBECTL={explicit} is not an executable file")
        return _render_command(Path(explicit))
    candidates = [REPO_ROOT / ".tools" / "bin" / "kubectl", Path(sys.executable).parent / "kubectl"]
    for name in ("kubectl", "kustomize"):
        found = shutil.which(name)
        if found:
            candidates.append(Path(found))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return _render_command(path)
    raise ToolNotFound("kubectl not found: run deploy/install_tools.sh (or set SPECDEC_KUBECTL)")


def _render_command(path: Path) -> list[str]:
    return [str(path), "build"] if path.name.startswith("kustomize") else [str(path), "kustomize"]


def kustomize_version(command: list[str]) -> tuple[int, int]:
    """(major, minor) of the kustomize that `command` runs, e.g. (5, 8)."""
    if command[1] == "kustomize":
        out = subprocess.run([command[0], "version", "--client"], capture_output=True, text=True).stdout
        match = re.search(r"Kustomize Version: v(\d+)\.(\d+)", out)
    else:
        out = subprocess.run([command[0], "version"], capture_output=True, text=True).stdout
        match = re.search(r"v(\d+)\.(\d+)", out)
    if not match:
        raise ToolNotFound(f"cannot read the kustomize version of {command[0]}")
    return int(match[1]), int(match[2])


def render_dir(path: Path, command: list[str] | None = None) -> str:
    """The YAML stream that kustomize builds from the kustomization in `path`."""
    command = command or find_kubectl()
    result = subprocess.run([*command, str(path)], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise DeployError(f"{' '.join(command)} {path} failed:\n{result.stderr}")
    return result.stdout


def render(overlay: str, command: list[str] | None = None) -> str:
    return render_dir(overlay_dir(overlay), command)


def parse_objects(stream: str) -> list[dict]:
    return [obj for obj in yaml.safe_load_all(stream) if obj]


def render_objects(overlay: str, command: list[str] | None = None) -> list[dict]:
    return parse_objects(render(overlay, command))
