"""Check rendered objects the way an API server would, without one.

Two independent checks per object:
  schema   - the Kubernetes OpenAPI schema of a pinned version, strict (unknown fields are
             errors), through the kubernetes-validate package;
  typed    - the object loads into the `kubernetes` client's typed model (V1Deployment, ...)
             and serialises back to exactly the same dict, so no field was dropped.
Custom resources (KEDA) have neither; they get a small structural check instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import kubernetes.client
import kubernetes_validate

KUBERNETES_VERSION = "1.33"
CUSTOM_KINDS = {("keda.sh/v1alpha1", "ScaledObject")}


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
    problems = []
    if obj["kind"] == "ScaledObject":
        spec = obj.get("spec", {})
        if not spec.get("scaleTargetRef", {}).get("name"):
            problems.append("spec.scaleTargetRef.name is required")
        if not spec.get("triggers"):
            problems.append("spec.triggers must not be empty")
    return [Problem(object_name(obj), "custom", p) for p in problems]


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
