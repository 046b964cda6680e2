"""deploy/k8s and deploy/skypilot recipes against their real schemas, the semantics a
schema cannot see, and each container command run the way the kubelet runs it: PID 1 of
its own PID namespace, sent SIGTERM, must take a final snapshot and exit with the code
the manifest maps."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO

yaml = pytest.importorskip("yaml")
pytestmark = [pytest.mark.deploy]
# The schema packages are large (SkyPilot pulls in cloud SDKs): they are the `deploy` extra,
# not `test`. Without them their schema tests skip; the semantic and PID-1 tests still run.
DEPLOY_EXTRA = "the `deploy` extra: pip install -e '.[deploy]' (docs/deploy.md)"
K8S = REPO / "deploy" / "k8s"
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
ENTRYPOINT = REPO / "deploy" / "docker" / "entrypoint.sh"
K8S_VERSION = "1.30.0"
LAUNCHER_GRACE_S = 90  # launch.shutdown_timeout_s default: SIGTERM -> SIGKILL for workers
def _load(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load((K8S / name).read_text()))


def _pytorchjob_pod() -> dict[str, Any]:
    return dict(_load("pytorchjob.yaml")["spec"]["pytorchReplicaSpecs"]["Worker"]["template"])


def _jobset_job() -> dict[str, Any]:
    return dict(_load("jobset.yaml")["spec"]["replicatedJobs"][0]["template"])


def _container(pod_spec: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod_spec["containers"]
    return dict(container)


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


# -- schemas ---------------------------------------------------------------------------------
def test_pod_templates_validate_strictly_as_kubernetes_objects() -> None:
    kv = pytest.importorskip("kubernetes_validate", reason=DEPLOY_EXTRA)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "t"},
           "spec": _pytorchjob_pod()["spec"]}
    kv.validate(pod, K8S_VERSION, strict=True)
    # The JobSet's Job template as a batch/v1 Job: podFailurePolicy included (an
    # onPodConditions pattern without `status` is rejected here).
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "t"},
           "spec": _jobset_job()["spec"]}
    kv.validate(job, K8S_VERSION, strict=True)


def test_pod_failure_policy_without_status_is_rejected() -> None:
    kv = pytest.importorskip("kubernetes_validate", reason=DEPLOY_EXTRA)
    spec = _jobset_job()["spec"]
    for rule in spec["podFailurePolicy"]["rules"]:
        for cond in rule.get("onPodConditions", []):
            cond.pop("status")
    with pytest.raises(kv.ValidationError):
        kv.validate({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "t"},
                     "spec": spec}, K8S_VERSION, strict=True)


def test_pytorchjob_round_trips_through_the_training_operator_sdk_models() -> None:
    pytest.importorskip("kubeflow.training", reason=DEPLOY_EXTRA)
    from kubeflow.training import models
    from kubeflow.training.api_client import ApiClient

    manifest = _load("pytorchjob.yaml")
    client = ApiClient()
    job = client._ApiClient__deserialize(manifest, "KubeflowOrgV1PyTorchJob")
    assert isinstance(job, models.KubeflowOrgV1PyTorchJob)
    # The models drop fields they do not know: a round trip equal to the file means
    # every field is one the operator's API has.
    assert client.sanitize_for_serialization(job) == manifest
    assert job.spec.elastic_policy.rdzv_id  # else every event says run_id "none"


def test_jobset_matches_the_schema_written_from_the_jobset_api() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((Path(__file__).parent / "jobset_schema.json").read_text())
    jsonschema.validate(_load("jobset.yaml"), schema)
    text = (K8S / "jobset.yaml").read_text()
    assert "jobset.x-k8s.io/v1alpha2" in text and re.search(r"JobSet >= v0\.\d+\.\d+", text)


def test_skypilot_task_validates_with_skypilots_schema() -> None:
    pytest.importorskip("sky", reason=DEPLOY_EXTRA)
    from sky.utils import common_utils, schemas

    task = yaml.safe_load((REPO / "deploy" / "skypilot" / "spot-job.yaml").read_text())
    common_utils.validate_schema(task, schemas.get_task_schema(), "Invalid task YAML: ")
    # Installed from the repository (no such package on the index).
    assert task["workdir"] == "." and "pip install -e" in task["setup"]


# -- semantics -------------------------------------------------------------------------------
def test_exit_code_policies_grace_storage_and_store_fix() -> None:
    jobset_rules = _jobset_job()["spec"]["podFailurePolicy"]["rules"]
    by_code = {code: r["action"] for r in jobset_rules
               for code in r.get("onExitCodes", {}).get("values", [])}
    # 76 (the final snapshot failed) resumes from the snapshot before: retried like 75.
    assert by_code == {75: "Ignore", 76: "Ignore", 78: "FailJob"}
    pt_env = _env(_container(_pytorchjob_pod()["spec"]))
    assert int(pt_env["ELASTICTRAIN_EXIT_PREEMPTED_AS"]) >= 128  # retryable for ExitCode
    sky = yaml.safe_load((REPO / "deploy" / "skypilot" / "spot-job.yaml").read_text())
    assert sorted(sky["resources"]["job_recovery"]["recover_on_exit_codes"]) == [75, 76]
    assert sky["resources"]["job_recovery"]["max_restarts_on_errors"] == 0  # 78 ends it
    assert _load("pytorchjob.yaml")["spec"]["pytorchReplicaSpecs"]["Worker"][
        "restartPolicy"] == "ExitCode"
    for pod_spec in (_pytorchjob_pod()["spec"], _jobset_job()["spec"]["template"]["spec"]):
        container = _container(pod_spec)
        env = _env(container)
        grace = float(env.get("ELASTICTRAIN_PREEMPT__GRACE_PERIOD_S", 30))
        assert pod_spec["terminationGracePeriodSeconds"] >= max(grace, LAUNCHER_GRACE_S)
        assert env["ELASTICTRAIN_STORAGE__URL"].startswith("s3://")
        assert pod_spec.get("serviceAccountName") or container.get("envFrom")  # credentials
        assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
        assert container["command"][0] != "/bin/sh" and "args" not in container
        assert container["image"].split(":")[0].endswith("/train")  # Dockerfile.train


def test_every_recipe_runs_the_users_script_with_node_memory_and_s3() -> None:
    """The cluster page's promise (docs/cluster.md): the user's script, not the demo,
    its storage on S3, node memory on, and on Kubernetes a memory-backed /dev/shm large
    enough for it (a container's default is 64 MiB)."""
    for pod_spec in (_pytorchjob_pod()["spec"], _jobset_job()["spec"]["template"]["spec"]):
        container = _container(pod_spec)
        command = container["command"]
        assert "/app/train.py" in command and "elastictrain.demo.worker" not in command
        assert command[command.index("/app/train.py") + 1].startswith("s3://")
        assert _env(container)["ELASTICTRAIN_SNAPSHOT__MEMORY_EVERY"] == "auto"
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        (volume,) = [v for v in pod_spec["volumes"] if v["name"] == mount["name"]]
        assert volume["emptyDir"]["medium"] == "Memory"
        size = volume["emptyDir"]["sizeLimit"]
        assert size.endswith("Gi") and int(size[:-2]) >= 1
        secrets = [e["secretRef"]["name"] for e in container.get("envFrom", [])]
        assert secrets == ["elastictrain-s3"]
    train = (REPO / "deploy" / "docker" / "Dockerfile.train").read_text()
    assert "FROM ${BASE_IMAGE}" in train and "COPY ${SCRIPT} /app/train.py" in train
    assert (REPO / re.search(r"ARG SCRIPT=(\S+)", train).group(1)).exists()  # type: ignore[union-attr]
    sky = yaml.safe_load((REPO / "deploy" / "skypilot" / "spot-job.yaml").read_text())
    assert "examples/ddp_resumable.py" in sky["run"] and "demo" not in sky["run"]
    assert "ELASTICTRAIN_SNAPSHOT__MEMORY_EVERY=auto" in sky["run"]
    assert sky["envs"]["ELASTICTRAIN_STORAGE__URL"].startswith("s3://")
    sbatch = (REPO / "deploy" / "slurm" / "train.sbatch").read_text()
    assert "ELASTICTRAIN_SNAPSHOT__MEMORY_EVERY:-auto" in sbatch


def test_dockerfile_builds_the_image_the_recipes_name() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG BASE_IMAGE=\S+", text, re.M) and "FROM ${BASE_IMAGE}" in text
    assert "ARG TORCH_INDEX=" in text and "nvidia/cuda" in text
    assert 'ENTRYPOINT ["/usr/local/bin/elastictrain-entrypoint"]' in text
    assert "COPY deploy/docker/entrypoint.sh /usr/local/bin/elastictrain-entrypoint" in text
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text
    assert (REPO / "deploy" / "skypilot" / "spot-job.yaml").exists()
    assert os.access(ENTRYPOINT, os.X_OK)


