"""Render a kustomize overlay for the tests. ``kustomize_binary`` finds the real kustomize
(``kubectl kustomize``, or a ``kustomize`` binary) where one is on PATH, and ``render_kustomize``
renders with it; ``render`` is the subset of kustomize that deploy/k8s uses, resolved offline
with maintained libraries (PyYAML to read, ``jsonpatch`` for RFC 6902 patches), so the tests
run where no kustomize is installed (none is on PyPI); where one is, the tests check that both
render the same objects. Supported Kustomization fields: ``resources`` (files, or directories
holding a kustomization.yaml), ``namespace`` (set on every namespaced object that has none),
``images`` (``name`` → ``newName``/``newTag``) and ``patches`` whose file or inline ``patch`` is
a JSON 6902 list, with ``target`` ``kind`` and ``name`` (a regex, as in kustomize). Anything
else in a Kustomization is an error, so this never renders silently differently from kustomize.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
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


def kustomize_binary() -> list[str] | None:
    """The command that runs kustomize's ``build`` here, or None."""
    kubectl = shutil.which("kubectl")
    if kubectl and subprocess.run([kubectl, "kustomize", "--help"], capture_output=True, timeout=60).returncode == 0:
        return [kubectl, "kustomize"]
    kustomize = shutil.which("kustomize")
    return [kustomize, "build"] if kustomize else None


def render_kustomize(command: list[str], directory: Path) -> list[dict]:
    out = subprocess.run([*command, str(directory)], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} {directory}: {out.stderr}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]
