"""Kubernetes deployment of the speculative-decoding stack.

The manifests are kustomize trees under this folder (base/, components/, overlays/);
this package renders them with kubectl's built-in kustomize, validates what comes out,
and applies an overlay to a cluster with the official `kubernetes` client.
"""
from pathlib import Path

DEPLOY_DIR = Path(__file__).resolve().parent
REPO_ROOT = DEPLOY_DIR.parent
OVERLAYS = ("cpu", "gpu", "gpu-keda")
NAMESPACE = "specdec"
# The three rollouts an apply waits for, in dependency order (pools before orchestrator).
DEPLOYMENTS = ("specdec-draft", "specdec-target", "specdec-orchestrator")
STATEFULSETS = ("specdec-redis",)


class DeployError(RuntimeError):
    """A failure to report in one line (missing tool, failed render, stuck rollout)."""


def overlay_dir(overlay: str) -> Path:
    if overlay not in OVERLAYS:
        raise ValueError(f"unknown overlay {overlay!r}; choose one of {', '.join(OVERLAYS)}")
    return DEPLOY_DIR / "overlays" / overlay
