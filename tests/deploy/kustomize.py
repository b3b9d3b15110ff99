"""A small kustomize for the subset deploy/kubernetes uses: ``resources``, ``patches`` (strategic-merge
files) and ``images``, so the manifests render without a kustomize binary or network.

Anything else in a kustomization.yaml is refused rather than ignored. Where ``kubectl kustomize`` is
installed, tests/deploy compares this output with it, so the subset stays honest.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

SUPPORTED = {"apiVersion", "kind", "resources", "patches", "images"}
# Kubernetes' patchMergeKey of the keyed lists the patches touch; other lists are replaced.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
}


def render(folder: Path) -> list[dict[str, Any]]:
    """The objects of the kustomization in ``folder``, as ``kubectl kustomize folder`` builds them."""
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(spec) - SUPPORTED
    if unknown:
        raise ValueError(f"{folder}/kustomization.yaml uses {sorted(unknown)}, which this renderer does not implement")
    objects: list[dict[str, Any]] = []
    for entry in spec.get("resources", []):
        path = folder / entry
        objects += render(path) if path.is_dir() else [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for patch in spec.get("patches", []):
        if set(patch) != {"path"}:
            raise ValueError(f"only file patches are implemented, not {patch}")
        doc = yaml.safe_load((folder / patch["path"]).read_text())
        (index,) = [
            i
            for i, o in enumerate(objects)
            if (o["kind"], o["metadata"]["name"]) == (doc["kind"], doc["metadata"]["name"])
        ]
        objects[index] = strategic_merge(objects[index], doc)
    for image in spec.get("images", []):
        for obj in objects:
            for container in _containers(obj):
                if _image_name(container["image"]) == image["name"]:
                    container["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    return objects


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    """Maps merge key by key, keyed lists item by item (patch items first, as kustomize orders them)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = strategic_merge(merged[key], value, key) if key in merged else copy.deepcopy(value)
        return merged
    key = MERGE_KEYS.get(field)
    if key and isinstance(base, list) and isinstance(patch, list):
        by_key = {item[key]: item for item in base}
        merged_items = [
            strategic_merge(by_key[item[key]], item) if item[key] in by_key else copy.deepcopy(item) for item in patch
        ]
        patched = {item[key] for item in patch}
        return merged_items + [copy.deepcopy(item) for item in base if item[key] not in patched]
    return copy.deepcopy(patch)


def _containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    pod = obj.get("spec", {}).get("template", {}).get("spec", {})
    return pod.get("containers", []) + pod.get("initContainers", [])


def _image_name(image: str) -> str:
    """``registry:5000/name:tag`` -> ``registry:5000/name`` (a colon after the last slash starts the tag)."""
    image = image.split("@")[0]
    slash = image.rfind("/")
    colon = image.rfind(":")
    return image[:colon] if colon > slash else image
