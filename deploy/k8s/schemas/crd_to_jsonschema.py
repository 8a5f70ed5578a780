"""Turn a CustomResourceDefinition's openAPIV3Schema into a strict JSON Schema for check-jsonschema.

    python crd_to_jsonschema.py CRD.yaml VERSION > kind_version.json

What kubeconform's openapi2jsonschema does, in short: objects that list their properties accept no
others (additionalProperties: false, unless x-kubernetes-preserve-unknown-fields), int-or-string
fields take either, `nullable` adds null, and apiVersion and kind must be this CRD's. Descriptions
are left out (they are the CRD's API docs, 90% of its size). The schemas
in this folder were made with it from the CRDs named in SOURCES.md; run it again to update them.
"""

from __future__ import annotations

import json
import sys

import yaml


def strict(node):
    if isinstance(node, list):
        return [strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict(v) for k, v in node.items() if k != "description"}  # the CRD's docs: not needed to validate
    if out.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def main(path: str, version: str) -> None:
    crd = yaml.safe_load(open(path, encoding="utf-8"))
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    ver = next(v for v in crd["spec"]["versions"] if v["name"] == version)
    schema = strict(ver["schema"]["openAPIV3Schema"])
    schema["properties"]["apiVersion"] = {"type": "string", "enum": [f"{group}/{version}"]}
    schema["properties"]["kind"] = {"type": "string", "enum": [kind]}
    schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata", "spec"})
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "title": f"{kind} {group}/{version}", **schema}
    json.dump(schema, sys.stdout, indent=None, separators=(",", ":"), sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
