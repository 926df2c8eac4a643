"""Validate a rendered object as a cluster would, offline: a built-in kind against the Kubernetes
OpenAPI schemas bundled in ``kubernetes-validate`` (strict: a field the API does not define is an
error, as with ``kubectl apply``'s default field validation), a custom resource (Strimzi, KEDA)
against the JSON Schemas vendored in tests/k8s/schemas (its README says where they come from).
An object of a kind with no schema is an error, never a pass."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jsonschema
import kubernetes_validate

KUBERNETES_VERSION = "1.37.0"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
CUSTOM = {("kafka.strimzi.io/v1beta2", "Kafka"): "kafka.strimzi.io/kafka_v1beta2.json",
          ("kafka.strimzi.io/v1beta2", "KafkaNodePool"): "kafka.strimzi.io/kafkanodepool_v1beta2.json",
          ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh/scaledobject_v1alpha1.json"}


class Invalid(Exception):
    """The object does not validate; the message names the object and each error's path."""


@functools.cache
def _custom_validator(name: str) -> jsonschema.Draft7Validator:
    schema = json.loads((SCHEMAS / name).read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def validate(doc: dict) -> None:
    what = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    custom = CUSTOM.get((doc.get("apiVersion"), doc.get("kind")))
    if custom is not None:
        errors = sorted(_custom_validator(custom).iter_errors(doc), key=lambda e: list(e.absolute_path))
        if errors:
            raise Invalid(f"{what}: " + "; ".join(f"{'/'.join(map(str, e.absolute_path)) or '.'}: {e.message}"
                                                  for e in errors))
        return
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError as exc:
        raise Invalid(f"{what}: no schema for {doc.get('apiVersion')} {doc.get('kind')} ({exc.message})") from None
    except kubernetes_validate.ValidationError as exc:
        raise Invalid(f"{what}: {'/'.join(map(str, exc.absolute_path)) or '.'}: {exc.message}") from None
