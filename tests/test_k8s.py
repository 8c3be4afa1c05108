"""deploy/k8s renders (kustomize) and every object validates offline against the Kubernetes
schemas of a pinned version, strictly; the settings the pods get are ones the server reads."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.32.0"  # the oldest minor still supported upstream when this was written
KUSTOMIZATIONS = ["base", "overlays/gpu"]


def render(kustomization: str) -> dict[tuple[str, str], dict]:
    """The objects `kubectl kustomize` renders, by (kind, name)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed: cannot render")
    output = subprocess.run(
        [kubectl, "kustomize", str(K8S / kustomization)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    objects = [document for document in yaml.safe_load_all(output) if document]
    return {(item["kind"], item["metadata"]["name"]): item for item in objects}


@pytest.fixture(params=KUSTOMIZATIONS, scope="module")
def rendered(request):
    return request.param, render(request.param)


def container(objects) -> dict:
    (only,) = objects[("Deployment", "semif-serve")]["spec"]["template"]["spec"]["containers"]
    return only


def environment(objects) -> dict[str, dict]:
    return {variable["name"]: variable for variable in container(objects)["env"]}


def test_every_object_validates_strictly_against_the_pinned_schemas(rendered):
    import kubernetes_validate

    _, objects = rendered
    assert set(objects) >= {
        ("Deployment", "semif-serve"),
        ("Service", "semif-serve"),
        ("PodDisruptionBudget", "semif-serve"),
        ("HorizontalPodAutoscaler", "semif-serve"),
        ("Ingress", "semif-serve"),
    }
    for item in objects.values():
        kubernetes_validate.validate(item, KUBERNETES_VERSION, strict=True)


def test_pods_get_only_variables_the_server_reads(rendered):
    _, objects = rendered
    read = set(re.findall(r'"(SEMIF_[A-Z_]+)"', (ROOT / "semif_serve/config.py").read_text()))
    read |= set(
        re.findall(r'"(SEMIF_[A-Z_]+)"', (ROOT / "semif_serve/kernel_cache.py").read_text())
    )
    given = {name for name in environment(objects) if name.startswith("SEMIF_")}
    assert given <= read, f"unknown variables: {sorted(given - read)}"
    token = environment(objects)["SEMIF_API_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"] == {"name": "semif-serve", "key": "api-token"}


def test_shutdown_fits_the_graceful_timeout_and_the_pod_is_locked_down(rendered):
    _, objects = rendered
    pod = objects[("Deployment", "semif-serve")]["spec"]["template"]["spec"]
    graceful = int(environment(objects)["SEMIF_GRACEFUL_TIMEOUT_S"]["value"])
    pause = container(objects)["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > graceful + pause
    assert pod["securityContext"]["runAsNonRoot"] is True
    security = container(objects)["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container(objects)[probe]["httpGet"]["path"] == "/health"


def test_routing_hashes_on_the_state_key_and_scaling_reads_an_exported_metric(rendered):
    _, objects = rendered
    annotations = objects[("Ingress", "semif-serve")]["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/upstream-hash-by"] == "$http_x_semif_state_key"
    (metric,) = objects[("HorizontalPodAutoscaler", "semif-serve")]["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    assert f'"{name}"' in (ROOT / "semif_serve/metrics.py").read_text()


def test_the_gpu_overlay_takes_one_gpu_and_a_read_only_model_cache():
    objects = render("overlays/gpu")
    limits = container(objects)["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 1
    env = environment(objects)
    assert env["SEMIF_DEVICE"]["value"] == "cuda"
    mounts = {mount["name"]: mount for mount in container(objects)["volumeMounts"]}
    assert mounts["hf-cache"]["readOnly"] is True
    assert env["HF_HUB_CACHE"]["value"].startswith(mounts["hf-cache"]["mountPath"])
    assert ("PersistentVolumeClaim", "semif-serve-hf-cache") in objects
