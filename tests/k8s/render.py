"""Render a kustomize overlay offline, for the tests: the subset of kustomize that
deploy/k8s uses, resolved with maintained libraries (PyYAML to read, ``jsonpatch`` for RFC 6902
patches) — no kustomize binary is on PyPI. Supported Kustomization fields: ``resources``
(files, or directories holding a kustomization.yaml), ``namespace`` (set on every namespaced
object that has none), ``images`` (``name`` → ``newName``/``newTag``) and ``patches`` whose file
or inline ``patch`` is a JSON 6902 list, with ``target`` ``kind`` and ``name`` (a regex, as in
kustomize). Anything else in a Kustomization is an error, so this never renders silently
differently from kustomize.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import jsonpatch
import yaml

_KNOWN = {"apiVersion", "kind", "resources", "namespace", "images", "patches"}
_CLUSTER_SCOPED = {"Namespace"}


def render(directory: Path) -> list[dict]:
    kz = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kz) - _KNOWN
    if unknown:
        raise ValueError(f"{directory}: kustomization fields this renderer does not resolve: {sorted(unknown)}")
    docs: list[dict] = []
    for res in kz.get("resources", []):
        path = directory / res
        if path.is_dir():
            docs += render(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    docs = copy.deepcopy(docs)
    for patch in kz.get("patches", []):
        text = (directory / patch["path"]).read_text() if "path" in patch else patch["patch"]
        ops = yaml.safe_load(text)
        if not isinstance(ops, list):
            raise ValueError(f"{directory}: only JSON 6902 patches are resolved here, not {patch}")
        target = patch["target"]
        hits = [i for i, d in enumerate(docs) if d["kind"] == target.get("kind", d["kind"])
                and re.fullmatch(target.get("name", ".*"), d["metadata"]["name"])]
        if not hits:
            raise ValueError(f"{directory}: patch target {target} matches nothing")
        for i in hits:
            docs[i] = jsonpatch.apply_patch(docs[i], ops)
    for image in kz.get("images", []):
        for d in docs:
            for c in _containers(d):
                if c["image"].split(":")[0] == image["name"]:
                    c["image"] = f"{image.get('newName', image['name'])}:{image.get('newTag', 'latest')}"
    if "namespace" in kz:
        for d in docs:
            if d["kind"] not in _CLUSTER_SCOPED:
                d["metadata"].setdefault("namespace", kz["namespace"])
    return docs


def _containers(doc: dict) -> list[dict]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def containers(doc: dict) -> list[dict]:
    return _containers(doc)
