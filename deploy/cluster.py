"""Apply rendered objects to a cluster and wait for the rollouts (official `kubernetes` client).

Objects are applied with server-side apply through the dynamic client, so re-applying an
overlay is idempotent and fields owned by others (the HPA's replica count) are left alone.
"""
from __future__ import annotations

import os
import time
from typing import Callable

from kubernetes import client, config
from kubernetes.client.rest import ApiException
from kubernetes.dynamic import DynamicClient

from deploy import DeployError

FIELD_MANAGER = "specdec-deploy"
# Namespaces and identities first, workloads after what they mount, autoscalers last.
KIND_ORDER = [
    "Namespace", "ServiceAccount", "Secret", "ConfigMap", "PersistentVolumeClaim",
    "Service", "NetworkPolicy", "StatefulSet", "Job", "Deployment",
    "PodDisruptionBudget", "HorizontalPodAutoscaler", "ScaledObject",
]


class RolloutFailed(DeployError):
    pass


def load_api_client(kubeconfig: str | None = None, context: str | None = None) -> client.ApiClient:
    """An ApiClient from the kubeconfig (or the in-cluster service account)."""
    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST") and not (kubeconfig or context):
            config.load_incluster_config()
        else:
            config.load_kube_config(config_file=kubeconfig, context=context)
    except config.ConfigException as e:
        raise DeployError(f"no cluster configured: {e}") from e
    return client.ApiClient()


def apply_order(objs: list[dict]) -> list[dict]:
    rank = {kind: i for i, kind in enumerate(KIND_ORDER)}
    return sorted(objs, key=lambda o: rank.get(o["kind"], len(KIND_ORDER)))


def referenced_secrets(objs: list[dict]) -> set[str]:
    """Secrets that pod templates need (volumes, required env refs) but the objects lack."""
    pod_specs = [o["spec"]["template"]["spec"] for o in objs
                 if o["kind"] in ("Deployment", "StatefulSet", "Job")]
    needed = set()
    for spec in pod_specs:
        for vol in spec.get("volumes", []):
            if "secret" in vol and not vol["secret"].get("optional"):
                needed.add(vol["secret"]["secretName"])
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref and not ref.get("optional"):
                    needed.add(ref["name"])
    present = {o["metadata"]["name"] for o in objs if o["kind"] == "Secret"}
    return needed - present


def missing_secrets(api: client.ApiClient, namespace: str, names: set[str]) -> list[str]:
    core = client.CoreV1Api(api)
    missing = []
    for name in sorted(names):
        try:
            core.read_namespaced_secret(name, namespace)
        except ApiException as e:
            if e.status != 404:
                raise
            missing.append(name)
    return missing


def apply_objects(api: client.ApiClient, objs: list[dict], dry_run: bool = False,
                  log: Callable[[str], None] = print) -> None:
    """Server-side apply of every object, the kinds others need first (namespace, accounts,
    secrets, config, then workloads: `apply_order`), taking over fields another manager set
    (`force_conflicts`): re-applying an overlay converges it. A Job whose template changed is skipped, since a Job's pod
    template cannot change and a finished download needs no re-run."""
    dynamic = DynamicClient(api)
    for obj in apply_order(objs):
        meta = obj["metadata"]
        resource = dynamic.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
        try:
            resource.server_side_apply(
                body=obj, name=meta["name"], namespace=meta.get("namespace"),
                field_manager=FIELD_MANAGER, force_conflicts=True,
                dry_run="All" if dry_run else None,
            )
        except ApiException as e:
            if obj["kind"] == "Job" and e.status == 422:
                # A Job's pod template is immutable; a finished download needs no re-run.
                log(f"skipped job/{meta['name']}: exists with another template (delete it to re-run)")
                continue
            raise
        log(f"applied {obj['kind'].lower()}/{meta['name']}" + (" (dry run)" if dry_run else ""))


def deployment_progress(dep: client.V1Deployment) -> tuple[bool, str]:
    """(done, message), the same rules as `kubectl rollout status deployment/...`."""
    name, status = dep.metadata.name, dep.status
    if (status.observed_generation or 0) < (dep.metadata.generation or 0):
        return False, f"{name}: waiting for the controller to observe the new spec"
    for cond in status.conditions or []:
        if cond.type == "Progressing" and cond.reason == "ProgressDeadlineExceeded":
            raise RolloutFailed(f"{name}: exceeded its progress deadline")
    want = dep.spec.replicas or 0
    updated = status.updated_replicas or 0
    if updated < want:
        return False, f"{name}: {updated} of {want} new replicas updated"
    if (status.replicas or 0) > updated:
        return False, f"{name}: {status.replicas - updated} old replicas pending termination"
    if (status.available_replicas or 0) < updated:
        return False, f"{name}: {status.available_replicas or 0} of {updated} updated replicas available"
    return True, f"{name}: rolled out ({updated} replicas)"


def statefulset_progress(sts: client.V1StatefulSet) -> tuple[bool, str]:
    name, status = sts.metadata.name, sts.status
    if (status.observed_generation or 0) < (sts.metadata.generation or 0):
        return False, f"{name}: waiting for the controller to observe the new spec"
    want = sts.spec.replicas or 0
    if (status.ready_replicas or 0) < want:
        return False, f"{name}: {status.ready_replicas or 0} of {want} replicas ready"
    if status.update_revision and status.current_revision != status.update_revision:
        return False, f"{name}: waiting for the rolling update to finish"
    return True, f"{name}: rolled out ({want} replicas)"


def wait_for_rollouts(api: client.ApiClient, namespace: str, deployments: tuple[str, ...],
                      statefulsets: tuple[str, ...] = (), timeout_s: float = 900.0,
                      poll_s: float = 3.0, log: Callable[[str], None] = print) -> None:
    """Polls the workloads until each has rolled out, logging each one's progress line when
    it changes; RolloutFailed naming those still pending after `timeout_s` (a model download
    on a first GPU apply wants a long one)."""
    apps = client.AppsV1Api(api)
    pending = [("sts", n) for n in statefulsets] + [("deploy", n) for n in deployments]
    deadline = time.monotonic() + timeout_s
    last = {}
    while pending:
        still = []
        for kind, name in pending:
            if kind == "sts":
                done, msg = statefulset_progress(apps.read_namespaced_stateful_set_status(name, namespace))
            else:
                done, msg = deployment_progress(apps.read_namespaced_deployment_status(name, namespace))
            if last.get(name) != msg:
                log(msg)
                last[name] = msg
            if not done:
                still.append((kind, name))
        pending = still
        if pending and time.monotonic() > deadline:
            raise RolloutFailed(f"timed out after {timeout_s:.0f} s waiting for " + ", ".join(n for _, n in pending))
        if pending:
            time.sleep(poll_s)
