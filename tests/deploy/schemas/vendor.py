"""How the schemas in this folder were made (run by hand when updating them; the tests only read the outputs).

    pip download --no-deps kubernetes-validate==1.37.0 && unzip kubernetes_validate-1.37.0-py3-none-any.whl -d kv
    git -C training-operator show v1.9.0:manifests/base/crds/kubeflow.org_paddlejobs.yaml > paddlejobs.yaml
    python tests/deploy/schemas/vendor.py kv/kubernetes_validate/kubernetes-json-schema/v1.30.0-local-strict paddlejobs.yaml

Sources and licences (README.md here says the same):
- Kubernetes v1.30.0 "strict" JSON schemas (unknown fields refused, as `kubectl apply --validate=strict`) of
  kubernetes-validate 1.37.0 (PyPI, Apache-2.0), which generates them from Kubernetes' OpenAPI (Apache-2.0).
  For each kind the test needs, the kind's schema with every definition it reaches inlined under `$defs`
  (one standalone file instead of the 1.8 MB `_definitions.json`), descriptions removed.
- Kubeflow training-operator v1.9.0's PaddleJob CRD (`kubeflow.org/v1`, Apache-2.0): its `openAPIV3Schema`
  as JSON schema draft 2020-12, descriptions removed, and `additionalProperties: false` on every object
  that lists its properties and does not say `x-kubernetes-preserve-unknown-fields` (the API server's strict
  field validation: an unknown field is an error, not silently pruned).
"""
from __future__ import annotations

import json
import os
import sys

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
KINDS = {"job-batch-v1": "Job", "service-v1": "Service", "persistentvolumeclaim-v1": "PersistentVolumeClaim"}
DEFS = "/api/_definitions.json#/$defs/"


def _strip(node):
    if isinstance(node, dict):
        return {k: _strip(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


def _refs(node, out: set) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        for prefix in (DEFS, "#/$defs/"):
            if isinstance(ref, str) and ref.startswith(prefix):
                out.add(ref[len(prefix):])
        for v in node.values():
            _refs(v, out)
    elif isinstance(node, list):
        for v in node:
            _refs(v, out)


def _local(node):
    if isinstance(node, dict):
        return {k: ("#/$defs/" + v[len(DEFS):] if k == "$ref" and isinstance(v, str) and v.startswith(DEFS)
                    else _local(v)) for k, v in node.items()}
    if isinstance(node, list):
        return [_local(v) for v in node]
    return node


def kubernetes(src: str) -> None:
    with open(os.path.join(src, "_definitions.json")) as f:
        defs = json.load(f)["$defs"]
    for stem, kind in KINDS.items():
        with open(os.path.join(src, stem + ".json")) as f:
            schema = json.load(f)
        todo, seen = set(), set()
        _refs(schema, todo)
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                _refs(defs[name], todo)
        schema = _local(_strip(schema))
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        schema["$defs"] = {n: _local(_strip(defs[n])) for n in sorted(seen)}
        with open(os.path.join(HERE, f"k8s-v1.30.0-{kind.lower()}.json"), "w") as f:
            json.dump(schema, f, indent=1, sort_keys=True)


def _strict(node):
    if isinstance(node, dict):
        node = {k: _strict(v) for k, v in node.items()}
        if node.get("type") == "object" and "properties" in node and not node.get(
                "x-kubernetes-preserve-unknown-fields") and "additionalProperties" not in node:
            node["additionalProperties"] = False
        return node
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


def paddlejob(crd_path: str) -> None:
    with open(crd_path) as f:
        crd = yaml.safe_load(f)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _strict(_strip(version["schema"]["openAPIV3Schema"]))
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    with open(os.path.join(HERE, "kubeflow-v1.9.0-paddlejob.json"), "w") as f:
        json.dump(schema, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    kubernetes(sys.argv[1])
    paddlejob(sys.argv[2])
