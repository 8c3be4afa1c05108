"""A pure-Python stand-in for `kubectl kustomize`, so deploy/k8s renders where kubectl is missing.

It renders exactly the kustomize v5 features deploy/k8s uses, the way kustomize v5.5 (the one
in kubectl 1.32) renders them: `resources` (files, and folders holding a kustomization,
recursively, in order), `labels` (`pairs`, `includeSelectors`), `images` (`name`, `newName`,
`newTag`) and `patches` given by `path` (strategic-merge patches, merged by Kubernetes' patch
merge keys). Anything else in a kustomization, a label or image entry, a patch entry or a patch
raises `Unsupported` naming it, so it never silently renders something different from kubectl;
tests/test_k8s.py compares the two wherever kubectl exists. One difference is deliberate: objects
come back in resource order, where kustomize sorts them by kind.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED = {
    "kustomization": {"apiVersion", "kind", "resources", "labels", "images", "patches"},
    "labels entry": {"pairs", "includeSelectors"},
    "images entry": {"name", "newName", "newTag"},
    "patches entry": {"path"},
}

# Where kustomize's `labels` with `includeSelectors: true` put the pairs (its commonLabels field
# specs, api/internal/konfig/builtinpluginconsts): (group, version, kind, path, create if
# missing); None matches any group, version or kind; a path walks every item of a list it meets,
# and a list (`[]`) is never created.
# HorizontalPodAutoscaler's scaleTargetRef names a Deployment; it is no selector.
_AFFINITY = tuple(
    f"spec/template/spec/affinity/{affinity}/{term}/labelSelector/matchLabels"
    for affinity in ("podAffinity", "podAntiAffinity")
    for term in (
        "preferredDuringSchedulingIgnoredDuringExecution/podAffinityTerm",
        "requiredDuringSchedulingIgnoredDuringExecution",
    )
) + ("spec/template/spec/topologySpreadConstraints/labelSelector/matchLabels",)
METADATA_LABELS = (None, None, None, "metadata/labels", True)
SELECTOR_LABELS = (
    METADATA_LABELS,
    (None, "v1", "Service", "spec/selector", True),
    (None, "v1", "ReplicationController", "spec/selector", True),
    (None, "v1", "ReplicationController", "spec/template/metadata/labels", True),
    (None, None, "Deployment", "spec/selector/matchLabels", True),
    (None, None, "Deployment", "spec/template/metadata/labels", True),
    *(("apps", None, "Deployment", path, False) for path in _AFFINITY),
    (None, None, "ReplicaSet", "spec/selector/matchLabels", True),
    (None, None, "ReplicaSet", "spec/template/metadata/labels", True),
    (None, None, "DaemonSet", "spec/selector/matchLabels", True),
    (None, None, "DaemonSet", "spec/template/metadata/labels", True),
    ("apps", None, "StatefulSet", "spec/selector/matchLabels", True),
    ("apps", None, "StatefulSet", "spec/template/metadata/labels", True),
    ("apps", None, "StatefulSet", "spec/volumeClaimTemplates[]/metadata/labels", True),
    *(("apps", None, "StatefulSet", path, False) for path in _AFFINITY),
    ("batch", None, "Job", "spec/selector/matchLabels", False),
    ("batch", None, "Job", "spec/template/metadata/labels", True),
    ("batch", None, "CronJob", "spec/jobTemplate/spec/selector/matchLabels", False),
    ("batch", None, "CronJob", "spec/jobTemplate/metadata/labels", True),
    ("batch", None, "CronJob", "spec/jobTemplate/spec/template/metadata/labels", True),
    ("policy", None, "PodDisruptionBudget", "spec/selector/matchLabels", False),
    ("networking.k8s.io", None, "NetworkPolicy", "spec/podSelector/matchLabels", False),
    (
        "networking.k8s.io",
        None,
        "NetworkPolicy",
        "spec/ingress/from/podSelector/matchLabels",
        False,
    ),
    ("networking.k8s.io", None, "NetworkPolicy", "spec/egress/to/podSelector/matchLabels", False),
)

# Strategic merge: the lists Kubernetes merges item by item (patchStrategy "merge"), by their
# patchMergeKey; every other list is replaced whole by the patch's, as Kubernetes does.
POD_SPECS = {
    "Pod": ("spec",),
    "PodTemplate": ("template", "spec"),
    "CronJob": ("spec", "jobTemplate", "spec", "template", "spec"),
    **{
        kind: ("spec", "template", "spec")
        for kind in ("Deployment", "ReplicaSet", "DaemonSet", "StatefulSet", "Job")
    },
    "ReplicationController": ("spec", "template", "spec"),
}
CONTAINER_LISTS = ("containers", "initContainers", "ephemeralContainers")
POD_MERGE_KEYS = {
    **dict.fromkeys(CONTAINER_LISTS, "name"),
    "volumes": "name",
    "imagePullSecrets": "name",
}
CONTAINER_MERGE_KEYS = {"env": "name", "volumeMounts": "mountPath", "ports": "containerPort"}
# Lists Kubernetes merges too, but this renderer does not: patching one raises Unsupported.
POD_MERGED_OTHERWISE = {"hostAliases", "topologySpreadConstraints", "resourceClaims"}
POD_MERGED_OTHERWISE |= {"schedulingGates"}
CONTAINER_MERGED_OTHERWISE = {"volumeDevices"}
METADATA_MERGED_OTHERWISE = {"finalizers", "ownerReferences"}


class Unsupported(ValueError):
    """The kustomization asks for something this renderer does not do (kustomize might)."""


def build(directory: Path) -> list[dict]:
    """The objects the kustomization in `directory` renders, in resource order."""
    directory = Path(directory)
    kustomization = _read_kustomization(directory)
    objects: list[dict] = []
    for resource in kustomization.get("resources") or []:
        objects.extend(_load_resource(directory, resource))
    seen: set[tuple] = set()
    for item in objects:
        if _identity(item) in seen:
            raise Unsupported(f"{directory}: {_describe(item)} is rendered twice")
        seen.add(_identity(item))
    for entry in kustomization.get("patches") or []:
        _refuse_unknown(entry, "patches entry", directory)
        if not isinstance(entry.get("path"), str):
            raise Unsupported(f"{directory}: a patches entry without a path: {entry}")
        for patch in _load_documents(directory / entry["path"]):
            _apply_patch(objects, patch, directory / entry["path"])
    for entry in kustomization.get("labels") or []:
        _refuse_unknown(entry, "labels entry", directory)
        _add_labels(objects, entry, directory)
    for entry in kustomization.get("images") or []:
        _refuse_unknown(entry, "images entry", directory)
        _set_images(objects, entry, directory)
    return objects


def strategic_merge(target: dict, patch: dict, kind: str, path: tuple[str, ...] = ()) -> dict:
    """`patch` merged into a copy of `target` (an object of `kind`, or a part of it at `path`)."""
    _refuse_directives(patch, path)
    merged = copy.deepcopy(target)
    for field, value in patch.items():
        here = (*path, field)
        old = merged.get(field)
        if value is None:
            merged.pop(field, None)
        elif isinstance(value, dict) and isinstance(old, dict):
            merged[field] = strategic_merge(old, value, kind, here)
        elif isinstance(value, list) and isinstance(old, list):
            key = merge_key(kind, here)
            merged[field] = (
                _merge_list(old, value, key, kind, here) if key else copy.deepcopy(value)
            )
        else:
            merged[field] = copy.deepcopy(value)
    return merged


def merge_key(kind: str, path: tuple[str, ...]) -> str | None:
    """The key a list at `path` in an object of `kind` is merged by; None: it is replaced."""
    pod = POD_SPECS.get(kind)
    rest = path[len(pod) :] if pod and path[: len(pod)] == pod else None
    if rest is not None and len(rest) == 1:
        key = POD_MERGE_KEYS.get(rest[0])
        refused = rest[0] in POD_MERGED_OTHERWISE
    elif rest is not None and len(rest) == 2 and rest[0] in CONTAINER_LISTS:
        key = CONTAINER_MERGE_KEYS.get(rest[1])
        refused = rest[1] in CONTAINER_MERGED_OTHERWISE
    elif kind == "Service" and path == ("spec", "ports"):
        key, refused = "port", False
    else:
        key, refused = None, len(path) == 2 and path[0] == "metadata"
        refused = refused and path[1] in METADATA_MERGED_OTHERWISE
    if refused:
        raise Unsupported(f"patching the list {_dotted(path)} of a {kind}")
    return key


def _merge_list(old: list, new: list, key: str, kind: str, path: tuple[str, ...]) -> list:
    """kustomize's order: the patch's items (merged into the matching old ones), then the old
    items the patch does not name, in their order."""
    for item in (*old, *new):
        if not isinstance(item, dict) or item.get(key) is None:
            raise Unsupported(f"an item of {_dotted(path)} without its merge key {key!r}")
        if key in ("port", "containerPort") and "protocol" in item:
            raise Unsupported(f"{_dotted(path)}: items merged by (port, protocol)")
    originals = {item[key]: item for item in old}
    named = {item[key] for item in new}
    merged = [
        strategic_merge(originals[item[key]], item, kind, path)
        if item[key] in originals
        else strategic_merge({}, item, kind, path)
        for item in new
    ]
    return merged + [copy.deepcopy(item) for item in old if item[key] not in named]


def _read_kustomization(directory: Path) -> dict:
    found = [directory / name for name in KUSTOMIZATION_FILES if (directory / name).is_file()]
    if len(found) != 1:
        raise Unsupported(f"{directory}: expected one of {KUSTOMIZATION_FILES}, found {found}")
    kustomization = yaml.safe_load(found[0].read_text()) or {}
    _refuse_unknown(kustomization, "kustomization", found[0])
    if kustomization.get("kind", "Kustomization") != "Kustomization":
        raise Unsupported(f"{found[0]}: kind {kustomization['kind']!r}")
    return kustomization


def _load_resource(directory: Path, resource: str) -> list[dict]:
    if "://" in resource or resource.startswith(("github.com/", "git@")):
        raise Unsupported(f"{directory}: remote resource {resource!r}")
    path = directory / resource
    if path.is_dir():
        return build(path)
    return _load_documents(path)


def _load_documents(path: Path) -> list[dict]:
    documents = [document for document in yaml.safe_load_all(path.read_text()) if document]
    for document in documents:
        if not isinstance(document, dict) or not document.get("kind"):
            raise Unsupported(f"{path}: not a Kubernetes object (a JSON 6902 patch?)")
        if document["kind"].endswith("List"):
            raise Unsupported(f"{path}: a {document['kind']}")
    return documents


def _apply_patch(objects: list[dict], patch: dict, path: Path) -> None:
    for index, item in enumerate(objects):
        if _identity(item) == _identity(patch):
            objects[index] = strategic_merge(item, patch, item["kind"])
            return
    raise Unsupported(f"{path}: no resource matches the patch for {_describe(patch)}")


def _add_labels(objects: list[dict], entry: dict, where: Path) -> None:
    pairs = entry.get("pairs") or {}
    if not isinstance(entry.get("includeSelectors", False), bool):
        raise Unsupported(f"{where}: includeSelectors must be true or false: {entry}")
    if not all(isinstance(value, str) for value in pairs.values()):
        raise Unsupported(f"{where}: label values must be strings (quote them): {pairs}")
    specs = SELECTOR_LABELS if entry.get("includeSelectors") else (METADATA_LABELS,)
    for item in objects:
        group, _, version = item["apiVersion"].rpartition("/")
        for spec_group, spec_version, kind, spec_path, create in specs:
            if spec_group not in (None, group) or spec_version not in (None, version):
                continue
            if kind in (None, item["kind"]):
                _set_labels(item, spec_path.split("/"), pairs, create)


def _set_labels(node: Any, path: list[str], pairs: dict, create: bool) -> None:
    if isinstance(node, list):
        for element in node:
            _set_labels(element, path, pairs, create)
        return
    if not isinstance(node, dict):
        return
    field, rest = path[0].removesuffix("[]"), path[1:]
    if node.get(field) is None:
        if not create or path[0].endswith("[]"):
            return
        node[field] = {}
    if rest:
        _set_labels(node[field], rest, pairs, create)
    else:
        node[field].update(pairs)


def _set_images(objects: list[dict], entry: dict, where: Path) -> None:
    if not isinstance(entry.get("name"), str):
        raise Unsupported(f"{where}: an images entry without a name: {entry}")
    if not all(isinstance(entry.get(field, ""), str) for field in SUPPORTED["images entry"]):
        raise Unsupported(f"{where}: image fields must be strings (quote them): {entry}")
    for item in objects:
        if item["kind"] != "CustomResourceDefinition":
            _set_container_images(item, entry)


def _set_container_images(node: Any, entry: dict) -> None:
    """kustomize's image filter: every `image` of every item of every `containers` or
    `initContainers` list, anywhere in the object."""
    if isinstance(node, list):
        for element in node:
            _set_container_images(element, entry)
        return
    if not isinstance(node, dict):
        return
    for field, value in node.items():
        _set_container_images(value, entry)
        if field in ("containers", "initContainers") and isinstance(value, list):
            for container in value:
                image = container.get("image") if isinstance(container, dict) else None
                if isinstance(image, str) and _split_image(image)[0] == entry["name"]:
                    container["image"] = _new_image(image, entry)


def _split_image(image: str) -> tuple[str, str, str]:
    """(name, tag, digest) as kustomize splits them: a registry's port is part of the name."""
    slash = max(image.find("/"), 0)
    name, _, digest = image.partition("@")
    colon = name.find(":", slash)
    if colon < 0:
        return name, "", digest
    return name[:colon], name[colon + 1 :], digest


def _new_image(image: str, entry: dict) -> str:
    name, tag, digest = _split_image(image)
    name = entry.get("newName") or name
    if entry.get("newTag"):
        tag, digest = entry["newTag"], ""
    return name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")


def _refuse_unknown(entry: Any, what: str, where: Path) -> None:
    if not isinstance(entry, dict):
        raise Unsupported(f"{where}: a {what} that is not a mapping: {entry!r}")
    unknown = sorted(set(entry) - SUPPORTED[what])
    if unknown:
        raise Unsupported(f"{where}: {what} field(s) {unknown} (kustomize_lite does not do them)")


def _refuse_directives(value: Any, path: tuple[str, ...]) -> None:
    if isinstance(value, dict):
        for field, inner in value.items():
            if field.startswith("$"):
                raise Unsupported(f"patch directive {field!r} at {_dotted((*path, field))}")
            _refuse_directives(inner, (*path, field))
    elif isinstance(value, list):
        for inner in value:
            _refuse_directives(inner, path)


def _identity(item: dict) -> tuple:
    metadata = item.get("metadata") or {}
    return item["apiVersion"], item["kind"], metadata.get("namespace"), metadata.get("name")


def _describe(item: dict) -> str:
    return "{1} {3} ({0}, namespace {2})".format(*_identity(item))


def _dotted(path: tuple[str, ...]) -> str:
    return ".".join(path) or "the top"
