"""Check rendered objects the way an API server would, without one.

Two independent checks per object:
  schema   - the Kubernetes OpenAPI schema of a pinned version, strict (unknown fields are
             errors), through the kubernetes-validate package;
  typed    - the object loads into the `kubernetes` client's typed model (V1Deployment, ...)
             and serialises back to exactly the same dict, so no field was dropped.
Custom resources (KEDA, the Prometheus Operator) have neither; they get a small structural
check instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import kubernetes.client
import kubernetes_validate
import promql_parser

KUBERNETES_VERSION = "1.33"
CUSTOM_KINDS = {("keda.sh/v1alpha1", "ScaledObject"), ("monitoring.coreos.com/v1", "PodMonitor"),
                ("monitoring.coreos.com/v1", "PrometheusRule")}


@dataclass(frozen=True)
class Problem:
    object: str  # "Deployment/specdec-draft"
    check: str  # schema | typed | custom
    message: str

    def __str__(self) -> str:
        return f"{self.object}: {self.check}: {self.message}"


def object_name(obj: dict) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


def model_name(obj: dict) -> str:
    """The typed model class of an object: apps/v1 Deployment -> V1Deployment."""
    version = obj["apiVersion"].rsplit("/", 1)[-1]
    return version[0].upper() + version[1:] + obj["kind"]


def to_typed(obj: dict):
    """Load `obj` into its `kubernetes.client` model (raises on unknown kinds or bad fields)."""
    name = model_name(obj)
    if not hasattr(kubernetes.client, name):
        raise LookupError(f"no kubernetes.client model {name}")
    api = kubernetes.client.ApiClient()
    return api._ApiClient__deserialize(obj, name)  # the client's own response decoder


def check_schema(obj: dict, version: str = KUBERNETES_VERSION) -> list[Problem]:
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = ".".join(str(p) for p in e.path)
        return [Problem(object_name(obj), "schema", f"{path}: {e.message}")]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [Problem(object_name(obj), "schema", e.message)]
    return []


def check_typed(obj: dict) -> list[Problem]:
    try:
        model = to_typed(obj)
    except (LookupError, ValueError, TypeError) as e:
        return [Problem(object_name(obj), "typed", str(e))]
    back = kubernetes.client.ApiClient().sanitize_for_serialization(model)
    if back != obj:
        return [Problem(object_name(obj), "typed", f"round trip changed fields: {_diff(obj, back)}")]
    return []


def check_custom(obj: dict) -> list[Problem]:
    spec = obj.get("spec", {})
    check = {"ScaledObject": _scaled_object, "PodMonitor": _pod_monitor, "PrometheusRule": _prometheus_rule}
    return [Problem(object_name(obj), "custom", p) for p in check[obj["kind"]](spec)]


def _scaled_object(spec: dict) -> list[str]:
    problems = []
    if not spec.get("scaleTargetRef", {}).get("name"):
        problems.append("spec.scaleTargetRef.name is required")
    if not spec.get("triggers"):
        problems.append("spec.triggers must not be empty")
    for i, trigger in enumerate(spec.get("triggers") or []):
        query = trigger.get("metadata", {}).get("query") if trigger.get("type") == "prometheus" else None
        if query is not None and (error := promql_error(query)):
            problems.append(f"spec.triggers[{i}].metadata.query: {error}")
    return problems


def promql_error(expr: str) -> str | None:
    """Why Prometheus would refuse `expr`, or None."""
    try:
        promql_parser.parse(expr)
    except ValueError as e:
        return f"not PromQL: {e}"
    return None


def _pod_monitor(spec: dict) -> list[str]:
    problems = []
    if not spec.get("selector", {}).get("matchLabels"):
        problems.append("spec.selector.matchLabels must not be empty (an empty selector scrapes every pod)")
    endpoints = spec.get("podMetricsEndpoints") or []
    if not endpoints:
        problems.append("spec.podMetricsEndpoints must not be empty")
    problems += [f"spec.podMetricsEndpoints[{i}].port is required" for i, e in enumerate(endpoints) if not e.get("port")]
    return problems


def _prometheus_rule(spec: dict) -> list[str]:
    """What the operator's admission webhook would refuse, and what an alert needs to be
    acted on: each rule records or alerts (not both) on an expression; an alert has a
    severity and a summary."""
    problems = []
    groups = spec.get("groups") or []
    if not groups:
        problems.append("spec.groups must not be empty")
    names = [g.get("name") for g in groups]
    if len(set(names)) != len(names) or not all(names):
        problems.append("every group needs a name of its own")
    for g in groups:
        for i, rule in enumerate(g.get("rules") or [None]):
            where = f"group {g.get('name')} rule {i}"
            if not isinstance(rule, dict) or not str(rule.get("expr", "")).strip():
                problems.append(f"{where}: expr is required")
                continue
            if error := promql_error(rule["expr"]):
                problems.append(f"{where}: {error}")
            if bool(rule.get("record")) == bool(rule.get("alert")):
                problems.append(f"{where}: set exactly one of record and alert")
            if rule.get("alert") and not (rule.get("labels", {}).get("severity")
                                          and rule.get("annotations", {}).get("summary")):
                problems.append(f"{where}: an alert needs labels.severity and annotations.summary")
    return problems


def check_object(obj: dict, version: str = KUBERNETES_VERSION) -> list[Problem]:
    if (obj.get("apiVersion"), obj.get("kind")) in CUSTOM_KINDS:
        return check_custom(obj)
    return check_schema(obj, version) + check_typed(obj)


def check_objects(objs: list[dict], version: str = KUBERNETES_VERSION) -> list[Problem]:
    return [p for obj in objs for p in check_object(obj, version)]


def _diff(a, b, path: str = "") -> str:
    """The first path where two JSON-like values differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return _diff(a.get(key), b.get(key), f"{path}.{key}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _diff(x, y, f"{path}[{i}]")
    return f"{path or '.'}: {a!r} != {b!r}"
