"""python -m deploy: render without a cluster; apply and rollout waiting against fakes."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from deploy import REPO_ROOT, cluster
from deploy.render import parse_objects, render_objects


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)


def test_help_needs_no_cluster():
    for args in ([], ["render"], ["validate"], ["apply"]):
        result = run_cli(*args, "--help")
        assert result.returncode == 0, result.stderr
        assert "usage: python -m deploy" in result.stdout


def test_render_prints_the_overlay():
    result = run_cli("render", "--overlay", "cpu")
    assert result.returncode == 0, result.stderr
    assert parse_objects(result.stdout) == render_objects("cpu")


def test_validate_passes_for_every_overlay():
    result = run_cli("validate")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 problems" in result.stdout


def test_apply_without_a_cluster_fails_in_one_line(tmp_path):
    empty = tmp_path / "kubeconfig"
    empty.write_text("")
    result = run_cli("apply", "--overlay", "cpu", "--kubeconfig", str(empty))
    assert result.returncode == 1
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr


# ---- apply, against a fake dynamic client ----

class FakeResource:
    def __init__(self, log: list, kind: str, fail_with: int | None = None):
        self.log, self.kind, self.fail_with = log, kind, fail_with

    def server_side_apply(self, body, name, namespace, field_manager, force_conflicts, dry_run):
        if self.fail_with:
            raise ApiException(status=self.fail_with)
        self.log.append((self.kind, name, namespace, field_manager, force_conflicts, dry_run))


class FakeDynamicClient:
    log: list = []
    failing_kinds: dict = {}

    def __init__(self, api):
        self.resources = self

    def get(self, api_version, kind):
        return FakeResource(self.log, kind, self.failing_kinds.get(kind))


@pytest.fixture
def fake_dynamic(monkeypatch):
    FakeDynamicClient.log = []
    FakeDynamicClient.failing_kinds = {}
    monkeypatch.setattr(cluster, "DynamicClient", FakeDynamicClient)
    return FakeDynamicClient


def test_apply_is_server_side_and_ordered(fake_dynamic):
    objs = render_objects("cpu")
    cluster.apply_objects(client.ApiClient(), objs, log=lambda _: None)
    kinds = [entry[0] for entry in fake_dynamic.log]
    assert len(kinds) == len(objs) and kinds[0] == "Namespace"
    assert kinds.index("Secret") < kinds.index("StatefulSet") < kinds.index("Deployment")
    assert max(i for i, k in enumerate(kinds) if k == "Deployment") < kinds.index("HorizontalPodAutoscaler")
    assert all(e[3] == cluster.FIELD_MANAGER and e[4] is True and e[5] is None for e in fake_dynamic.log)
    assert all(e[2] == "specdec" for e in fake_dynamic.log if e[0] != "Namespace")


def test_apply_dry_run_changes_nothing(fake_dynamic):
    cluster.apply_objects(client.ApiClient(), render_objects("cpu"), dry_run=True, log=lambda _: None)
    assert {e[5] for e in fake_dynamic.log} == {"All"}


def test_an_immutable_finished_job_is_skipped_not_fatal(fake_dynamic):
    fake_dynamic.failing_kinds = {"Job": 422}
    messages = []
    cluster.apply_objects(client.ApiClient(), render_objects("gpu"), log=messages.append)
    assert any(m.startswith("skipped job/specdec-models-download") for m in messages)
    fake_dynamic.failing_kinds = {"Deployment": 422}
    with pytest.raises(ApiException):
        cluster.apply_objects(client.ApiClient(), render_objects("gpu"), log=lambda _: None)


# ---- rollout rules, as kubectl rollout status ----

def deployment(generation=2, observed=2, replicas=3, updated=3, total=3, available=3, conditions=None):
    return client.V1Deployment(
        metadata=client.V1ObjectMeta(name="specdec-draft", generation=generation),
        spec=client.V1DeploymentSpec(replicas=replicas, selector=client.V1LabelSelector(),
                                     template=client.V1PodTemplateSpec()),
        status=client.V1DeploymentStatus(observed_generation=observed, replicas=total, updated_replicas=updated,
                                         available_replicas=available, conditions=conditions))


@pytest.mark.parametrize("kwargs, expect", [
    (dict(), "rolled out"),
    (dict(observed=1), "observe the new spec"),
    (dict(updated=2), "2 of 3 new replicas updated"),
    (dict(total=4), "1 old replicas pending termination"),
    (dict(available=2), "2 of 3 updated replicas available"),
])
def test_deployment_progress_follows_kubectl(kwargs, expect):
    done, message = cluster.deployment_progress(deployment(**kwargs))
    assert done == (expect == "rolled out") and expect in message


def test_a_stuck_deployment_fails_the_rollout():
    stuck = client.V1DeploymentCondition(type="Progressing", status="False", reason="ProgressDeadlineExceeded")
    with pytest.raises(cluster.RolloutFailed):
        cluster.deployment_progress(deployment(updated=1, conditions=[stuck]))


def test_statefulset_progress_waits_for_ready_and_revision():
    def sts(ready, current="r1", update="r1"):
        return client.V1StatefulSet(
            metadata=client.V1ObjectMeta(name="specdec-redis", generation=1),
            spec=client.V1StatefulSetSpec(replicas=1, selector=client.V1LabelSelector(), service_name="x",
                                          template=client.V1PodTemplateSpec()),
            status=client.V1StatefulSetStatus(replicas=1, observed_generation=1, ready_replicas=ready,
                                              current_revision=current, update_revision=update))
    assert cluster.statefulset_progress(sts(ready=1))[0]
    assert not cluster.statefulset_progress(sts(ready=0))[0]
    assert not cluster.statefulset_progress(sts(ready=1, update="r2"))[0]


def test_wait_for_rollouts_polls_until_done(monkeypatch):
    states = iter([deployment(updated=1), deployment(available=2), deployment()])

    class FakeApps:
        def __init__(self, api):
            pass

        def read_namespaced_deployment_status(self, name, namespace):
            return next(states)

    monkeypatch.setattr(client, "AppsV1Api", FakeApps)
    messages = []
    cluster.wait_for_rollouts(client.ApiClient(), "specdec", ("specdec-draft",), poll_s=0, log=messages.append)
    assert messages[-1].endswith("rolled out (3 replicas)") and len(messages) == 3


def test_wait_for_rollouts_times_out(monkeypatch):
    class FakeApps:
        def __init__(self, api):
            pass

        def read_namespaced_deployment_status(self, name, namespace):
            return deployment(updated=0)

    monkeypatch.setattr(client, "AppsV1Api", FakeApps)
    with pytest.raises(cluster.RolloutFailed, match="timed out"):
        cluster.wait_for_rollouts(client.ApiClient(), "specdec", ("specdec-draft",), timeout_s=0, poll_s=0,
                                  log=lambda _: None)


def test_docs_name_only_files_that_exist():
    text = (REPO_ROOT / "README.md").read_text()
    paths = set(re.findall(r"\bdeploy/[\w./-]+\.(?:json|py|yaml|sh)\b", text))
    paths |= {p.replace("$c", str(c)) for p in re.findall(r"deploy/loadtest/ghz/[\w$-]+\.json", text)
              for c in (1, 4, 16)}
    paths = {p for p in paths if "$" not in p}
    assert paths, "expected file references in README.md"
    for path in sorted(paths):
        assert (REPO_ROOT / path).exists(), path
    for heading in ("## Deploy on Kubernetes", "## Load test with ghz", "## Capacity planning"):
        assert heading in text
    assert "ghz --insecure --call specdec.v1.Orchestrator/Generate" in text
