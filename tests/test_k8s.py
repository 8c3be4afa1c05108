"""deploy/k8s renders (`kubectl kustomize`, or tests/kustomize_lite.py where kubectl is missing)
and every object validates offline against the Kubernetes schemas of a pinned version, strictly;
the settings the pods get are ones the server reads."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import kustomize_lite
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.32.0"  # the oldest minor still supported upstream when this was written
KUSTOMIZATIONS = ["base", "overlays/gpu"]


def render(kustomization: str) -> dict[tuple[str, str], dict]:
    """The objects a kustomization renders, by (kind, name): `kubectl kustomize` where kubectl
    exists, else kustomize_lite (which the comparison test below holds to kubectl's output)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return by_kind_and_name(kustomize_lite.build(K8S / kustomization))
    return by_kind_and_name(kubectl_kustomize(kubectl, kustomization))


def kubectl_kustomize(kubectl: str, kustomization: str) -> list[dict]:
    output = subprocess.run(
        [kubectl, "kustomize", str(K8S / kustomization)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return [document for document in yaml.safe_load_all(output) if document]


def by_kind_and_name(objects: list[dict]) -> dict[tuple[str, str], dict]:
    keyed = {(item["kind"], item["metadata"]["name"]): item for item in objects}
    assert len(keyed) == len(objects), "two objects share a kind and a name"
    return keyed


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
        re.findall(r'"(SEMIF_[A-Z_]+)"', (ROOT / "semif_serve/engine/kernel_cache.py").read_text())
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


def test_routing_hashes_on_the_session_or_state_key_and_scaling_reads_a_metric(rendered):
    _, objects = rendered
    annotations = objects[("Ingress", "semif-serve")]["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/upstream-hash-by"] == (
        "$http_x_semif_session$http_x_semif_state_key"
    )
    (metric,) = objects[("HorizontalPodAutoscaler", "semif-serve")]["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    assert f'"{name}"' in (ROOT / "semif_serve/http/metrics.py").read_text()


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


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_the_python_renderer_renders_exactly_what_kubectl_renders(kustomization):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: nothing to compare kustomize_lite with")
    lite = by_kind_and_name(kustomize_lite.build(K8S / kustomization))
    assert lite == by_kind_and_name(kubectl_kustomize(kubectl, kustomization))


# kustomize_lite on its own, so it can fail where kubectl is missing.

DEPLOYMENT = """\
apiVersion: apps/v1
kind: Deployment
metadata: {name: app}
spec:
  selector: {matchLabels: {}}
  template:
    spec:
      containers:
        - {name: app, image: semif-serve}
"""


def kustomization(tmp_path: Path, text: str) -> Path:
    (tmp_path / "deployment.yaml").write_text(DEPLOYMENT)
    (tmp_path / "kustomization.yaml").write_text("resources: [deployment.yaml]\n" + text)
    return tmp_path


def pod(spec: dict) -> dict:
    return {"spec": {"template": {"spec": spec}}}


def test_kustomize_lite_merges_keyed_lists_by_their_key_patch_items_first():
    target = pod(
        {
            "containers": [
                {
                    "name": "app",
                    "image": "semif-serve",
                    "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
                    "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
                }
            ],
            "volumes": [{"name": "cache", "emptyDir": {}}],
        }
    )
    patch = pod(
        {
            "containers": [
                {
                    "name": "app",
                    "env": [{"name": "B", "value": "3"}, {"name": "C", "value": "4"}],
                    "volumeMounts": [{"name": "models", "mountPath": "/cache", "readOnly": True}],
                }
            ],
            "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "m"}}],
        }
    )
    merged = kustomize_lite.strategic_merge(target, patch, "Deployment")["spec"]["template"]["spec"]
    (app,) = merged["containers"]
    assert app["image"] == "semif-serve"
    assert app["env"] == [
        {"name": "B", "value": "3"},
        {"name": "C", "value": "4"},
        {"name": "A", "value": "1"},
    ]
    # volumeMounts merge by mountPath, not by name
    assert app["volumeMounts"] == [{"name": "models", "mountPath": "/cache", "readOnly": True}]
    assert [volume["name"] for volume in merged["volumes"]] == ["models", "cache"]
    assert target["spec"]["template"]["spec"]["containers"][0]["env"][1]["value"] == "2"
    service = {"spec": {"ports": [{"port": 80, "name": "a"}, {"port": 81, "name": "b"}]}}
    patched = {"spec": {"ports": [{"port": 81, "name": "c"}]}}
    assert kustomize_lite.strategic_merge(service, patched, "Service")["spec"]["ports"] == [
        {"port": 81, "name": "c"},
        {"port": 80, "name": "a"},
    ]


def test_kustomize_lite_replaces_unkeyed_lists_and_deletes_nulls():
    target = pod(
        {
            "tolerations": [{"key": "a", "operator": "Exists"}],
            "containers": [
                {
                    "name": "app",
                    "args": ["serve", "--verbose"],
                    "resources": {"requests": {"cpu": "2"}, "limits": {"memory": "8Gi"}},
                }
            ],
        }
    )
    patch = pod(
        {
            "tolerations": [{"key": "b", "operator": "Exists"}],
            "containers": [{"name": "app", "args": ["score"], "resources": {"requests": None}}],
        }
    )
    merged = kustomize_lite.strategic_merge(target, patch, "Deployment")["spec"]["template"]["spec"]
    assert merged["tolerations"] == [{"key": "b", "operator": "Exists"}]
    (app,) = merged["containers"]
    assert app["args"] == ["score"]
    assert app["resources"] == {"limits": {"memory": "8Gi"}}


def test_kustomize_lite_puts_labels_in_selectors_but_not_in_the_scale_target():
    objects = by_kind_and_name(kustomize_lite.build(K8S / "base"))
    label = {"app.kubernetes.io/name": "semif-serve"}
    for item in objects.values():
        assert item["metadata"]["labels"] == label
    deployment = objects[("Deployment", "semif-serve")]["spec"]
    assert deployment["selector"]["matchLabels"] == label
    assert deployment["template"]["metadata"]["labels"] == label
    assert objects[("Service", "semif-serve")]["spec"]["selector"] == label
    assert (
        objects[("PodDisruptionBudget", "semif-serve")]["spec"]["selector"]["matchLabels"] == label
    )
    assert objects[("HorizontalPodAutoscaler", "semif-serve")]["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "semif-serve",
    }


def test_kustomize_lite_sets_the_tag_of_exactly_the_named_image(tmp_path):
    images = ["semif-serve", "semif-serve:old", "registry:5000/semif-serve:1", "semif-serve-x:1"]
    (tmp_path / "deployment.yaml").write_text(
        DEPLOYMENT.replace(
            "        - {name: app, image: semif-serve}\n",
            "".join(
                f"        - {{name: c{i}, image: '{image}'}}\n" for i, image in enumerate(images)
            ),
        )
    )
    (tmp_path / "kustomization.yaml").write_text(
        "resources: [deployment.yaml]\nimages: [{name: semif-serve, newTag: '2'}]\n"
    )
    (deployment,) = kustomize_lite.build(tmp_path)
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert [container["image"] for container in containers] == [
        "semif-serve:2",
        "semif-serve:2",
        "registry:5000/semif-serve:1",
        "semif-serve-x:1",
    ]


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("namePrefix: x-\n", "namePrefix"),
        ("patches: [{patch: '{}'}]\n", "patch"),
        ("images: [{name: semif-serve, digest: 'sha256:00'}]\n", "digest"),
        ("labels: [{pairs: {a: b}, includeTemplates: true}]\n", "includeTemplates"),
    ],
)
def test_kustomize_lite_refuses_what_it_does_not_render(tmp_path, text, named):
    with pytest.raises(kustomize_lite.Unsupported, match=re.escape(f"[{named!r}]")):
        kustomize_lite.build(kustomization(tmp_path, text))


def test_kustomize_lite_refuses_patch_directives(tmp_path):
    (tmp_path / "patch.yaml").write_text(
        DEPLOYMENT.replace("containers:", "$patch: replace\n      containers:")
    )
    with pytest.raises(kustomize_lite.Unsupported, match=r"\$patch"):
        kustomize_lite.build(kustomization(tmp_path, "patches: [{path: patch.yaml}]\n"))
