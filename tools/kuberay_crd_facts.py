"""Trim KubeRay's RayCluster CRD to the facts cluster/kuberay-raycluster.yaml is checked against.

The CRD's schema is ~900 KB (every field of a Kubernetes PodSpec, twice). What the test needs is, for every object
the manifest writes, the fields the CRD requires there, the names of all the fields it knows there (any other name
is refused, as `kubectl apply --validate=strict` would), and the types of the values the manifest gives. This keeps
exactly that, as a JSON schema (`jsonschema` validates the manifest with it), with where it came from:

    python tools/kuberay_crd_facts.py KUBERAY/ray-operator/config/crd/bases/ray.io_rayclusters.yaml \\
        --source "ray-project/kuberay@COMMIT" --manifest cluster/kuberay-raycluster.yaml > cluster/kuberay-crd-facts.json

Run it again after the manifest writes a field the facts do not cover yet (the test then names it).
"""
from __future__ import annotations

import argparse
import json

import yaml

KEEP = ("type", "format", "enum", "pattern", "x-kubernetes-int-or-string")


def merged(values: list):
    """The union of a list's dicts (recursively), so one trimmed item schema covers every item the manifest has."""
    dicts = [v for v in values if isinstance(v, dict)]
    if not dicts:
        return values[0] if values else None
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = merged([out[k], v]) if k in out else v
    return out


def trim(schema: dict, used) -> dict:
    """`schema` cut to what `used` (the manifest's value at this place, or None) needs."""
    out = {k: schema[k] for k in KEEP if k in schema}
    if "anyOf" in schema:
        out["anyOf"] = [trim(s, None) for s in schema["anyOf"]]
    if used is None:
        return out
    if "required" in schema:
        out["required"] = schema["required"]
    props = schema.get("properties")
    if props is not None and isinstance(used, dict):
        out["properties"] = {n: trim(s, used.get(n)) for n, s in props.items()}
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if isinstance(schema.get("additionalProperties"), dict) and isinstance(used, dict):
        out["additionalProperties"] = trim(schema["additionalProperties"], merged(list(used.values())))
    if "items" in schema and isinstance(used, list):
        out["items"] = trim(schema["items"], merged(used))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("crd", help="ray.io_rayclusters.yaml from a KubeRay checkout")
    ap.add_argument("--source", required=True, help="where the CRD came from: ray-project/kuberay@COMMIT")
    ap.add_argument("--manifest", default="cluster/kuberay-raycluster.yaml")
    a = ap.parse_args()
    with open(a.crd) as f:
        crd = yaml.safe_load(f)
    with open(a.manifest) as f:
        manifest = yaml.safe_load(f)
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    facts = {"source": {"crd": f"{a.source}:ray-operator/config/crd/bases/ray.io_rayclusters.yaml",
                        "trimmed_by": "tools/kuberay_crd_facts.py"},
             "apiVersion": f"{group}/{version['name']}", "kind": kind,
             "served_versions": [v["name"] for v in crd["spec"]["versions"] if v.get("served")],
             "schema": trim(version["schema"]["openAPIV3Schema"], manifest)}
    print(json.dumps(facts, indent=1))


if __name__ == "__main__":
    main()
