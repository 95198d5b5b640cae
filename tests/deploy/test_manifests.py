"""The rendered Kubernetes manifests: valid, and deployable the way issue 6 asks.

Pure and fast: kubectl's built-in kustomize renders each overlay once; no cluster.
"""
from __future__ import annotations

import importlib
import os
import re

import kubernetes.client
import kubernetes_validate
import pytest

from deploy import OVERLAYS
from deploy.cluster import referenced_secrets
from deploy.render import find_kubectl, kustomize_version, render_objects
from deploy.validate import CUSTOM_KINDS, check_custom, check_schema, check_typed, promql_error, to_typed
from specdec.config import parse_args

POOLS = {"draft": 50061, "target": 50071}
FRAME_PORTS = {"draft": 50062, "target": 50072}  # the pools' frame link (specdec/frames.py)
SERVICES = {**POOLS, "orchestrator": 50051}
GPU_OVERLAYS = ("gpu", "gpu-keda")
TLS_PROBE = ["python", "/etc/specdec/probe/grpc_health_tls.py"]
KNOWN_SPECDEC_ENV = {
    "SPECDEC_" + name for name in (
        "MODEL", "TOKENIZER", "HOST", "PORT", "ADVERTISE_ADDRESS", "POOL", "REDIS_URL",
        "REDIS_PASSWORD_FILE", "DEVICE", "DTYPE", "METRICS_PORT", "MAX_SESSIONS", "DRAIN_SECONDS",
        "THREADS", "TLS_CERT_FILE", "TLS_KEY_FILE", "TLS_CA_FILE", "API_TOKEN_FILE",
        "MAX_CACHE_MB", "MAX_BATCH", "LOG_LEVEL", "LOG_FORMAT", "QUANTIZE", "FRAME_PORT",
        "POOL_CA_FILE", "CLIENT_CERT_FILE", "CLIENT_KEY_FILE", "POOL_TLS_SERVER_NAME",
        "MODELS",  # the model download Job's own list
    )
}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    command = find_kubectl()
    return {overlay: render_objects(overlay, command) for overlay in OVERLAYS}


# ---- helpers ----

def find(objs: list[dict], kind: str, name: str) -> dict:
    matches = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def workloads(objs: list[dict]) -> list[dict]:
    return [o for o in objs if o["kind"] in ("Deployment", "StatefulSet", "Job")]


def all_containers(pod_spec: dict) -> list[dict]:
    return pod_spec.get("initContainers", []) + pod_spec["containers"]


def main_container(objs: list[dict], component: str) -> dict:
    return find(objs, "Deployment", f"specdec-{component}")["spec"]["template"]["spec"]["containers"][0]


def container_env(objs: list[dict], container: dict) -> dict[str, str]:
    """Literal env of a container, envFrom ConfigMaps included (later entries win)."""
    env = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        env.update(find(objs, "ConfigMap", name)["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
    return env


def labels_match(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()) and all(
        (labels.get(e["key"]) in e["values"]) == (e["operator"] == "In")
        for e in selector.get("matchExpressions", []))


def pod_labels(objs: list[dict], component: str) -> dict:
    return find(objs, "Deployment", f"specdec-{component}")["spec"]["template"]["metadata"]["labels"]


def prestop_sleep_s(container: dict) -> int:
    command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    return int(command[1]) if command[:1] == ["sleep"] else 0


# ---- rendering and validation ----

def test_kubectl_has_a_recent_kustomize():
    assert kustomize_version(find_kubectl()) >= (5, 0)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_into_one_namespace(rendered, overlay):
    objs = rendered[overlay]
    assert len(objs) > 20
    for obj in objs:
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == "specdec", obj["metadata"]["name"]
    names = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("version", ["1.33", kubernetes_validate.utils.latest_version()])
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_objects_validate_against_the_openapi_schemas(rendered, overlay, version):
    builtin = [o for o in rendered[overlay] if (o["apiVersion"], o["kind"]) not in CUSTOM_KINDS]
    problems = [p for obj in builtin for p in check_schema(obj, version)]
    assert not problems, "\n".join(map(str, problems))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_objects_load_into_the_typed_models(rendered, overlay):
    builtin = [o for o in rendered[overlay] if (o["apiVersion"], o["kind"]) not in CUSTOM_KINDS]
    problems = [p for obj in builtin for p in check_typed(obj)]
    assert not problems, "\n".join(map(str, problems))
    deployment = to_typed(find(rendered[overlay], "Deployment", "specdec-draft"))
    assert isinstance(deployment, kubernetes.client.V1Deployment)
    assert deployment.spec.template.spec.containers[0].args == ["draft_service"]


def test_custom_resources_appear_only_in_the_keda_overlay(rendered):
    for overlay in ("cpu", "gpu"):
        assert all((o["apiVersion"], o["kind"]) not in CUSTOM_KINDS for o in rendered[overlay])
    custom = [o for o in rendered["gpu-keda"] if (o["apiVersion"], o["kind"]) in CUSTOM_KINDS]
    assert sorted(o["kind"] for o in custom) == ["PodMonitor", "PrometheusRule", "ScaledObject", "ScaledObject"]
    assert not [p for o in custom for p in check_custom(o)]
    scaled = [o for o in rendered["gpu-keda"] if o["kind"] == "ScaledObject"]
    assert {o["spec"]["scaleTargetRef"]["name"] for o in scaled} == {"specdec-draft", "specdec-target"}
    for o in scaled:
        query = o["spec"]["triggers"][0]["metadata"]["query"]
        assert "specdec_replica_queue_length" in query


# ---- pools ----

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_pool_has_its_own_deployment_and_autoscaler(rendered, overlay):
    objs = rendered[overlay]
    hpa_targets = [o["spec"]["scaleTargetRef"]["name"] for o in objs if o["kind"] == "HorizontalPodAutoscaler"]
    keda_targets = [o["spec"]["scaleTargetRef"]["name"] for o in objs if o["kind"] == "ScaledObject"]
    for component in SERVICES:
        name = f"specdec-{component}"
        deployment = find(objs, "Deployment", name)
        assert "replicas" not in deployment["spec"], "the autoscaler owns the replica count"
        assert (hpa_targets + keda_targets).count(name) == 1, f"{name} needs exactly one autoscaler"
    assert hpa_targets.count("specdec-orchestrator") == 1
    if overlay == "gpu-keda":
        assert set(keda_targets) == {"specdec-draft", "specdec-target"}
    else:
        assert set(hpa_targets) == {f"specdec-{c}" for c in SERVICES}


def test_hpas_are_autoscaling_v2_with_bounds(rendered):
    for overlay in OVERLAYS:
        for hpa in (o for o in rendered[overlay] if o["kind"] == "HorizontalPodAutoscaler"):
            assert hpa["apiVersion"] == "autoscaling/v2"
            assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
            assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 60


def test_gpu_pools_scale_on_queue_length(rendered):
    for component in POOLS:
        hpa = find(rendered["gpu"], "HorizontalPodAutoscaler", f"specdec-{component}")
        names = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
        assert names == ["specdec_replica_queue_length"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_are_grpc_health_checks_on_the_service_port(rendered, overlay):
    objs = rendered[overlay]
    for component, port in SERVICES.items():
        container = main_container(objs, component)
        assert container["args"] == [component if component == "orchestrator" else f"{component}_service"]
        assert {p["name"]: p["containerPort"] for p in container["ports"]}["grpc"] == port
        assert container_env(objs, container)["SPECDEC_PORT"] == str(port)
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container[kind]
            if overlay == "cpu":
                assert probe["grpc"] == {"port": port}, f"{component} {kind}"
            else:  # TLS on the port: the exec probe checks grpc.health.v1 over mTLS on $SPECDEC_PORT
                assert "grpc" not in probe and probe["exec"]["command"] == TLS_PROBE, f"{component} {kind}"
        service = find(objs, "Service", f"specdec-{component}")
        grpc_port = [p for p in service["spec"]["ports"] if p["name"] == "grpc"][0]
        assert grpc_port["port"] == port and grpc_port["targetPort"] == "grpc"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_replicas_register_their_pod_ip(rendered, overlay):
    for component, port in POOLS.items():
        env = main_container(rendered[overlay], component)["env"]
        names = [e["name"] for e in env]
        pod_ip = env[names.index("POD_IP")]
        assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        advertise = env[names.index("SPECDEC_ADVERTISE_ADDRESS")]
        assert advertise["value"] == f"$(POD_IP):{port}"
        assert names.index("POD_IP") < names.index("SPECDEC_ADVERTISE_ADDRESS"), "$(VAR) needs VAR defined first"
        assert container_env(rendered[overlay], main_container(rendered[overlay], component))["SPECDEC_POOL"] == component


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pools_serve_the_frame_link_on_their_frame_port(rendered, overlay):
    """The replica binds SPECDEC_FRAME_PORT and registers it in Redis; the orchestrator dials
    it on the pod IP it registered, so the container port, the env and the Service agree."""
    objs = rendered[overlay]
    for component, port in FRAME_PORTS.items():
        container = main_container(objs, component)
        ports = {p["name"]: p for p in container["ports"]}
        assert ports["frames"]["containerPort"] == port
        assert ports["frames"].get("protocol", "TCP") == "TCP"
        assert port not in {p["containerPort"] for name, p in ports.items() if name != "frames"}
        assert container_env(objs, container)["SPECDEC_FRAME_PORT"] == str(port)
        service = find(objs, "Service", f"specdec-{component}")
        frames = [p for p in service["spec"]["ports"] if p["name"] == "frames"][0]
        assert frames["port"] == port and frames["targetPort"] == "frames"
    assert "SPECDEC_FRAME_PORT" not in container_env(objs, main_container(objs, "orchestrator"))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pool_services_list_every_container_port(rendered, overlay):
    """The pools' headless Services name every port their pods serve (the API's Service only 50051)."""
    objs = rendered[overlay]
    for component in POOLS:
        container_ports = {p["name"]: p["containerPort"] for p in main_container(objs, component)["ports"]}
        service = find(objs, "Service", f"specdec-{component}")
        assert {p["targetPort"]: p["port"] for p in service["spec"]["ports"]} == container_ports, component


def test_pools_have_headless_services_and_the_api_a_cluster_ip(rendered):
    objs = rendered["cpu"]
    for component in POOLS:
        assert find(objs, "Service", f"specdec-{component}")["spec"]["clusterIP"] == "None"
    assert find(objs, "Service", "specdec-orchestrator")["spec"]["type"] == "ClusterIP"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_pdbs_and_spread_select_their_own_pods(rendered, overlay):
    objs = rendered[overlay]
    for component in SERVICES:
        labels = pod_labels(objs, component)
        others = [pod_labels(objs, c) for c in SERVICES if c != component]
        service = find(objs, "Service", f"specdec-{component}")
        assert labels_match({"matchLabels": service["spec"]["selector"]}, labels)
        assert not any(labels_match({"matchLabels": service["spec"]["selector"]}, o) for o in others)
        pdb = find(objs, "PodDisruptionBudget", f"specdec-{component}")
        assert labels_match(pdb["spec"]["selector"], labels)
        assert pdb["spec"]["maxUnavailable"] == 1
        spread = find(objs, "Deployment", f"specdec-{component}")["spec"]["template"]["spec"]["topologySpreadConstraints"]
        assert {c["topologyKey"] for c in spread} == {"topology.kubernetes.io/zone", "kubernetes.io/hostname"}
        assert all(labels_match(c["labelSelector"], labels) for c in spread)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_requests_and_limits(rendered, overlay):
    for workload in workloads(rendered[overlay]):
        for c in all_containers(workload["spec"]["template"]["spec"]):
            for section in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][section]), f"{workload['metadata']['name']}/{c['name']}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_termination_grace_outlasts_prestop_and_drain(rendered, overlay):
    objs = rendered[overlay]
    for component in SERVICES:
        deployment = find(objs, "Deployment", f"specdec-{component}")
        container = main_container(objs, component)
        drain = int(container_env(objs, container)["SPECDEC_DRAIN_SECONDS"])
        sleep = prestop_sleep_s(container)
        assert sleep > 0, "a preStop sleep lets endpoints and the registry catch up before SIGTERM"
        assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > sleep + drain


# ---- hardware ----

def gpu_count(container: dict) -> dict:
    r = container.get("resources", {})
    return {s: r.get(s, {}).get("nvidia.com/gpu") for s in ("requests", "limits") if "nvidia.com/gpu" in r.get(s, {})}


def test_gpu_requests_appear_in_the_gpu_overlays_only(rendered):
    for overlay in OVERLAYS:
        for workload in workloads(rendered[overlay]):
            for c in all_containers(workload["spec"]["template"]["spec"]):
                name = workload["metadata"]["name"]
                wants_gpu = overlay in GPU_OVERLAYS and name in ("specdec-draft", "specdec-target") \
                    and c["name"] in POOLS
                assert gpu_count(c) == ({"requests": "1", "limits": "1"} if wants_gpu else {}), f"{overlay} {name}/{c['name']}"


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_gpu_pools_land_on_their_node_pools_with_hf_models(rendered, overlay):
    objs = rendered[overlay]
    expected = {"draft": ("small", "meta-llama/Llama-3.2-1B-Instruct"),
                "target": ("large", "meta-llama/Llama-3.1-8B-Instruct")}
    # the draft's small GPUs include T4s, whose default is float16 (specdec.models.cuda_dtype)
    dtypes = {"draft": "auto", "target": "bfloat16"}
    for component, (gpu_class, model) in expected.items():
        spec = find(objs, "Deployment", f"specdec-{component}")["spec"]["template"]["spec"]
        assert spec["nodeSelector"] == {"specdec.io/gpu-class": gpu_class}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        env = container_env(objs, spec["containers"][0])
        assert env["SPECDEC_MODEL"] == model
        assert (env["SPECDEC_DEVICE"], env["SPECDEC_DTYPE"]) == ("cuda", dtypes[component])
        assert env["HF_HUB_OFFLINE"] == "1"
        assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"  # caches regrow: less fragmentation
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "specdec-models", "readOnly": True}
    assert find(objs, "PersistentVolumeClaim", "specdec-models")["spec"]["accessModes"] == ["ReadWriteMany"]
    download = find(objs, "Job", "specdec-models-download")["spec"]["template"]["spec"]["containers"][0]
    assert set(container_env(objs, download)["SPECDEC_MODELS"].split()) == {m for _, m in expected.values()}


def test_cpu_overlay_runs_the_bundled_models_on_cpu(rendered):
    objs = rendered["cpu"]
    for component in POOLS:
        env = container_env(objs, main_container(objs, component))
        assert env["SPECDEC_MODEL"] == f"/app/models/{component}" and env["SPECDEC_DEVICE"] == "cpu"
        spec = find(objs, "Deployment", f"specdec-{component}")["spec"]["template"]["spec"]
        assert "nodeSelector" not in spec and "tolerations" not in spec
    assert container_env(objs, main_container(objs, "orchestrator"))["SPECDEC_TOKENIZER"] == "/app/models/target"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_draft_pool_sets_its_quantisation(rendered, overlay):
    """int8 weights are a draft's option (the target's weights are the output's law): auto on
    a CPU pool, none on a GPU one, where they would only cost precision."""
    objs = rendered[overlay]
    quantize = {c: container_env(objs, main_container(objs, c)).get("SPECDEC_QUANTIZE") for c in POOLS}
    assert quantize == {"draft": "none" if overlay in GPU_OVERLAYS else "auto", "target": None}


# ---- security ----

def rule_ports(rule: dict) -> set[int]:
    return {p["port"] for p in rule.get("ports", [])}


def peers_for_port(policy: dict, port: int) -> list[dict | None]:
    """The `from` peers of every ingress rule admitting `port` (None = any source)."""
    peers = []
    for rule in policy["spec"].get("ingress", []):
        if port in rule_ports(rule) or not rule.get("ports"):
            peers.extend(rule.get("from") or [None])
    return peers


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_isolate_pools_and_redis(rendered, overlay):
    objs = rendered[overlay]
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    deny = find(objs, "NetworkPolicy", "specdec-default-deny-ingress")
    assert deny["spec"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    orchestrator = pod_labels(objs, "orchestrator")

    def policy_for(labels):
        found = [p for p in policies if p["spec"]["podSelector"] and labels_match(p["spec"]["podSelector"], labels)]
        assert len(found) == 1
        return found[0]

    for component in POOLS:
        policy = policy_for(pod_labels(objs, component))
        # every port the pool serves but metrics: gRPC and the frame link alike
        ports = {p["name"]: p["containerPort"] for p in main_container(objs, component)["ports"]}
        assert {ports["grpc"], ports["frames"]} == {POOLS[component], FRAME_PORTS[component]}
        for name, port in ports.items():
            if name == "metrics":
                continue
            peers = peers_for_port(policy, port)
            assert peers and all(p and set(p) == {"podSelector"} and labels_match(p["podSelector"], orchestrator)
                                 for p in peers), f"only the orchestrator may reach the {component} pool's {name} port"
            other_pool = pod_labels(objs, "target" if component == "draft" else "draft")
            assert not any(labels_match(p["podSelector"], other_pool) for p in peers)

    redis = find(objs, "StatefulSet", "specdec-redis")["spec"]["template"]["metadata"]["labels"]
    peers = peers_for_port(policy_for(redis), 6379)
    for component in SERVICES:
        assert any(labels_match(p["podSelector"], pod_labels(objs, component)) for p in peers)
    assert all(p and set(p) == {"podSelector"} for p in peers), "no namespace or ipBlock may reach Redis"
    assert not labels_match(peers[0]["podSelector"], {"app.kubernetes.io/name": "other"})

    assert None in peers_for_port(policy_for(orchestrator), 50051), "the public API is open"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_container_runs_as_root(rendered, overlay):
    for workload in workloads(rendered[overlay]):
        name = workload["metadata"]["name"]
        spec = workload["spec"]["template"]["spec"]
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] > 0, name
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert spec.get("automountServiceAccountToken") is False, name
        for c in all_containers(spec):
            sc = c["securityContext"]
            assert sc.get("runAsUser", pod["runAsUser"]) > 0, f"{name}/{c['name']}"
            assert sc["allowPrivilegeEscalation"] is False, f"{name}/{c['name']}"
            assert sc["readOnlyRootFilesystem"] is True, f"{name}/{c['name']}"
            assert sc["capabilities"] == {"drop": ["ALL"]}, f"{name}/{c['name']}"
            assert not sc.get("privileged"), f"{name}/{c['name']}"
        if "specdec" in spec["containers"][0]["image"]:
            assert pod["runAsUser"] == 10001, "the image's user"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_read_only_root_gets_a_writable_tmp(rendered, overlay):
    for workload in workloads(rendered[overlay]):
        spec = workload["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in spec["containers"]:
            tmp = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert len(tmp) == 1 and "emptyDir" in volumes[tmp[0]["name"]], workload["metadata"]["name"]


def test_namespace_enforces_restricted_pod_security(rendered):
    for overlay in OVERLAYS:
        labels = find(rendered[overlay], "Namespace", "specdec")["metadata"]["labels"]
        assert labels["pod-security.kubernetes.io/enforce"] == "restricted"


def test_cpu_overlay_generates_its_dev_secrets(rendered):
    objs = rendered["cpu"]
    assert referenced_secrets(objs) == set()
    secrets = {o["metadata"]["name"] for o in objs if o["kind"] == "Secret"}
    assert {re.sub(r"-[a-z0-9]{10}$", "", s) for s in secrets} == {"specdec-redis", "specdec-api-token"}
    orchestrator = main_container(objs, "orchestrator")
    assert container_env(objs, orchestrator)["SPECDEC_API_TOKEN_FILE"] == "/var/run/secrets/specdec/api/token"


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_gpu_overlays_take_secrets_from_the_cluster_and_enable_tls(rendered, overlay):
    objs = rendered[overlay]
    assert not [o for o in objs if o["kind"] == "Secret"], "no secret material in git for a real cluster"
    assert referenced_secrets(objs) == {"specdec-redis", "specdec-api-token", "specdec-tls"}
    for component in SERVICES:
        env = container_env(objs, main_container(objs, component))
        assert env["SPECDEC_TLS_CERT_FILE"] == "/var/run/secrets/specdec/tls/tls.crt"
        assert env["SPECDEC_TLS_KEY_FILE"] == "/var/run/secrets/specdec/tls/tls.key"
        assert env["SPECDEC_TLS_CA_FILE"] == "/var/run/secrets/specdec/tls/ca.crt"
    # the orchestrator dials the pools with the same certificate, checking theirs for a
    # Service name (replicas register pod IPs); tests/e2e/test_security.py runs it
    env = container_env(objs, main_container(objs, "orchestrator"))
    assert (env["SPECDEC_POOL_CA_FILE"], env["SPECDEC_CLIENT_CERT_FILE"], env["SPECDEC_CLIENT_KEY_FILE"]) == (
        "/var/run/secrets/specdec/tls/ca.crt", "/var/run/secrets/specdec/tls/tls.crt",
        "/var/run/secrets/specdec/tls/tls.key")
    assert env["SPECDEC_POOL_TLS_SERVER_NAME"] == "specdec-draft.specdec.svc"
    for pool in POOLS:
        assert "SPECDEC_POOL_CA_FILE" not in container_env(objs, main_container(objs, pool))


def _quantity(value: str) -> float:
    """A Kubernetes quantity of CPU or memory → cores or GiB."""
    units = {"m": 1e-3, "Mi": 2**-10, "Gi": 1.0}
    for unit, scale in units.items():
        if value.endswith(unit):
            return float(value[: -len(unit)]) * scale
    return float(value)


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_gpu_rollouts_wait_for_the_models_and_fit_the_gpu_nodes(rendered, overlay):
    """A first install waits for an 18 GB download and then a startup probe of up to 15
    minutes: the default 600 s progress deadline failed it (and `deploy apply` with it). A
    pool replaces pods one at a time without a surge pod that would wait for a spare GPU,
    from at least two replicas. The draft's requests fit a 4-vCPU, 16 GiB GPU node."""
    objs = rendered[overlay]
    for component in SERVICES:
        spec = find(objs, "Deployment", f"specdec-{component}")["spec"]
        probe = spec["template"]["spec"]["containers"][0]["startupProbe"]
        budget = probe["failureThreshold"] * probe.get("periodSeconds", 10) + probe.get("initialDelaySeconds", 0)
        assert spec["progressDeadlineSeconds"] >= budget + 1800, component
    for pool in POOLS:
        spec = find(objs, "Deployment", f"specdec-{pool}")["spec"]
        assert spec["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
        scalers = [o for o in objs if o["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")
                   and o["spec"]["scaleTargetRef"]["name"] == f"specdec-{pool}"]
        assert len(scalers) == 1
        low = scalers[0]["spec"].get("minReplicas", scalers[0]["spec"].get("minReplicaCount"))
        assert low >= 2, f"{pool}: one pod down in a rollout must leave one serving"
    requests = main_container(objs, "draft")["resources"]["requests"]
    assert _quantity(requests["cpu"]) <= 3.5 and _quantity(requests["memory"]) <= 12


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_known_settings_are_set(rendered, overlay):
    for workload in workloads(rendered[overlay]):
        for c in all_containers(workload["spec"]["template"]["spec"]):
            names = {k for k in container_env(rendered[overlay], c) if k.startswith("SPECDEC_")}
            assert names <= KNOWN_SPECDEC_ENV, names - KNOWN_SPECDEC_ENV


SERVER_MODULES = {"draft": "draft_service.server", "target": "target_service.server",
                  "orchestrator": "orchestrator.server"}


@pytest.mark.parametrize("component", SERVER_MODULES)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_server_takes_the_settings_its_container_gets(rendered, overlay, component, monkeypatch):
    """Every SPECDEC_ variable of a server's container names one of that server's own flags,
    and its value parses there (a choice among the choices, a number where a number goes):
    a manifest that the server would refuse at start fails here instead."""
    objs = rendered[overlay]
    settings = {k: v for k, v in container_env(objs, main_container(objs, component)).items() if k.startswith("SPECDEC_")}
    for name in [k for k in os.environ if k.startswith("SPECDEC_")]:
        monkeypatch.delenv(name)
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    parser = importlib.import_module(SERVER_MODULES[component]).build_parser()  # defaults read the variables
    flags = {"SPECDEC_" + action.dest.upper() for action in parser._actions}
    assert set(settings) <= flags, f"{component} has no flag for {sorted(set(settings) - flags)}"
    parse_args(parser, [])  # a usage error exits


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_are_pinned(rendered, overlay):
    for workload in workloads(rendered[overlay]):
        for c in all_containers(workload["spec"]["template"]["spec"]):
            image = c["image"]
            tag = image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else ""
            assert tag and tag != "latest", f"{workload['metadata']['name']}/{c['name']}: {image}"


# ---- Redis ----

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_keeps_an_aof_on_a_persistent_volume_behind_a_password(rendered, overlay):
    objs = rendered[overlay]
    sts = find(objs, "StatefulSet", "specdec-redis")
    claims = {t["metadata"]["name"]: t for t in sts["spec"]["volumeClaimTemplates"]}
    assert claims["data"]["spec"]["accessModes"] == ["ReadWriteOnce"]
    container = sts["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "data", "mountPath": "/data"} in container["volumeMounts"]
    config_volume = [v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "config"][0]
    conf = find(objs, "ConfigMap", config_volume["configMap"]["name"])["data"]["redis.conf"]
    lines = {line.strip() for line in conf.splitlines()}
    assert {"appendonly yes", "appendfsync everysec", "dir /data", "include /tmp/redis-auth.conf"} <= lines
    # requirepass is written from the Secret at start, never from the ConfigMap or argv.
    assert not any(line.startswith("requirepass") for line in lines)
    script = container["args"][0]
    assert "requirepass" in script and "/var/run/secrets/specdec/redis/password" in script
    secret = [v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "redis-password"][0]
    assert secret["secret"]["secretName"].startswith("specdec-redis")
    assert sts["spec"]["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Retain"


def test_services_read_the_redis_password_from_the_same_secret(rendered):
    objs = rendered["cpu"]
    redis_secret = [v for v in find(objs, "StatefulSet", "specdec-redis")["spec"]["template"]["spec"]["volumes"]
                    if v["name"] == "redis-password"][0]["secret"]["secretName"]
    for component in SERVICES:
        spec = find(objs, "Deployment", f"specdec-{component}")["spec"]["template"]["spec"]
        env = container_env(objs, spec["containers"][0])
        assert env["SPECDEC_REDIS_URL"] == "redis://specdec-redis:6379/0"
        mount = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "redis-password"][0]
        assert env["SPECDEC_REDIS_PASSWORD_FILE"] == mount["mountPath"] + "/password"
        volume = [v for v in spec["volumes"] if v["name"] == "redis-password"][0]
        assert volume["secret"]["secretName"] == redis_secret


# ---- monitoring (Prometheus Operator) ----

def _exported_metric_names() -> set[str]:
    """Every sample name the processes can export (specdec/metrics.py and the γ policy's
    table gauge), as PromQL sees them."""
    import importlib

    from prometheus_client import REGISTRY

    importlib.import_module("specdec.metrics")  # registers the collectors

    names = set()
    for family in REGISTRY.collect():
        names |= {family.name + suffix for suffix in ("", "_total", "_bucket", "_count", "_sum", "_created")}
    return names


def metrics_named(exprs: list[str]) -> set[str]:
    """The specdec metrics (not recorded series) that PromQL expressions read."""
    return {m for e in exprs for m in re.findall(r"\bspecdec_[a-z_]+", e)}


def test_the_rules_read_only_metrics_the_code_exports(rendered):
    rule = find(rendered["gpu-keda"], "PrometheusRule", "specdec")
    exprs = [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    used = metrics_named(exprs)
    assert {"specdec_time_to_first_token_seconds_bucket", "specdec_requests_total"} <= used
    exported = _exported_metric_names()
    assert not used - exported, "rules name metrics nobody exports"
    recorded = {r["record"] for g in rule["spec"]["groups"] for r in g["rules"] if "record" in r}
    read = {m for e in exprs for m in re.findall(r"\bspecdec:[a-z_0-9:]+", e)}
    assert read <= recorded, "alerts read recording rules that do not exist"
    queries = [o["spec"]["triggers"][0]["metadata"]["query"] for o in rendered["gpu-keda"] if o["kind"] == "ScaledObject"]
    assert queries and metrics_named(queries) <= exported


def test_the_pod_monitor_scrapes_the_pools_metrics_ports(rendered):
    objs = rendered["gpu-keda"]
    monitor = find(objs, "PodMonitor", "specdec")
    port = monitor["spec"]["podMetricsEndpoints"][0]["port"]
    for component in ("orchestrator", "draft", "target"):
        assert labels_match(monitor["spec"]["selector"], pod_labels(objs, component))
        assert port in {p["name"] for p in main_container(objs, component)["ports"]}


def test_a_rule_without_an_expression_or_a_severity_is_refused():
    bad = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule", "metadata": {"name": "x"},
           "spec": {"groups": [{"name": "g", "rules": [{"record": "a", "alert": "b", "expr": "up"},
                                                         {"alert": "c", "expr": "up"}, {"record": "d"}]}]}}
    bad["spec"]["groups"][0]["rules"].append({"record": "e", "expr": "sum(rate(x[5m])"})
    problems = [p.message for p in check_custom(bad)]
    # rule 0 both kinds and no severity, rule 1 no severity, rule 2 no expr, rule 3 not PromQL
    assert len(problems) == 5
    assert any("rule 3: not PromQL: unclosed left parenthesis" in p for p in problems)
    assert any("exactly one of record and alert" in p for p in problems)
    assert any("labels.severity" in p for p in problems) and any("expr is required" in p for p in problems)
    empty = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": {"name": "y"},
             "spec": {"selector": {}, "podMetricsEndpoints": [{}]}}
    assert len(check_custom(empty)) == 2


def test_the_dashboard_queries_parse_and_read_exported_metrics(rendered):
    import json

    board = json.loads(find(rendered["gpu-keda"], "ConfigMap", "specdec-grafana-dashboard")["data"]["specdec-dashboard.json"])
    exprs = [t["expr"] for panel in board["panels"] for t in panel["targets"]]
    assert len(board["panels"]) >= 10 and len({p["id"] for p in board["panels"]}) == len(board["panels"])
    assert not [err for e in exprs if (err := promql_error(e))]  # what Grafana would show as an error
    used = metrics_named(exprs)
    assert {"specdec_time_to_first_token_seconds_bucket", "specdec_generated_tokens_total"} <= used
    assert not used - _exported_metric_names(), "the dashboard names metrics nobody exports"


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_each_gpu_pod_waits_for_its_own_model_in_the_stores_marker(rendered, overlay, tmp_path):
    """The download Job lists the models it fetched in the marker (the ones there before
    kept), and each pod's init container waits until its own model is listed: a model
    changed later is waited for, not loaded from a store that lacks it. Both scripts run
    here, the store a directory and the download a stand-in (no hub can be reached)."""
    import subprocess
    import sys

    objs = rendered[overlay]
    job = find(objs, "Job", "specdec-models-download")["spec"]["template"]["spec"]["containers"][0]
    fetched = container_env(objs, job)["SPECDEC_MODELS"].split()
    script = job["args"][0].replace("/models/", f"{tmp_path}/")
    (tmp_path / "huggingface_hub.py").write_text("def snapshot_download(repo, **kw):\n    print('stand-in', repo)\n")
    (tmp_path / ".specdec-ready").write_text("some/earlier-model\n")

    def waits(component: str) -> bool:
        spec = find(objs, "Deployment", f"specdec-{component}")["spec"]["template"]["spec"]
        init = next(c for c in spec["initContainers"] if c["name"] == "wait-for-models")
        env = container_env(objs, spec["containers"][0])
        want = init["env"][0]["value"]
        assert want == env.get("SPECDEC_MODEL", env.get("SPECDEC_TOKENIZER")) and want in fetched, component
        command = [part.replace("/models/", f"{tmp_path}/") for part in init["command"]]
        try:
            subprocess.run(command, env={"WANT": want, "PATH": os.environ["PATH"]}, timeout=1, capture_output=True)
        except subprocess.TimeoutExpired:
            return True
        return False

    assert all(waits(c) for c in SERVICES)  # nothing fetched yet
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "SPECDEC_MODELS": " ".join(fetched), "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert (tmp_path / ".specdec-ready").read_text().split() == sorted(fetched + ["some/earlier-model"])
    assert not any(waits(c) for c in SERVICES)
