"""Vendor the parts of KubeRay's CRD schemas that deploy/kuberay/*.yaml use (writes crd_schemas.json).

KubeRay's CRDs are 0.7-1.4 MB of YAML each, mostly the Pod template that
controller-gen expands in full. The manifest test needs, at every object the
manifests touch, the full list of field names (an unknown one is an error:
the API server prunes it without a word) and the full schema of every field
the manifests set. So this keeps exactly that: the `v1` openAPIV3Schema of
`ray.io_rayjobs.yaml` and `ray.io_rayclusters.yaml` of each tag, with the
schema of every field no manifest sets replaced by a stub
(`{"x-pruned": true}`), which the test rejects with a message that says to
run this again. Large subschemas that repeat (the Pod schema of head,
workers and submitter, in every release) are stored once and referenced
with `$ref`. Nothing else is changed: closing the objects
(`additionalProperties: false`) is the test's job, so crd_schemas.json stays
a faithful, smaller copy of the source.

Run it from the repository root after changing a manifest or adding a
KubeRay version, with a clone of https://github.com/ray-project/kuberay (its tags):

    python tests/data/kuberay/vendor_crds.py /path/to/kuberay
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[3]
OUT = Path(__file__).with_name("crd_schemas.json")
# Every release tag from 1.1.0 to 1.7.0; the test says which of them the manifests fit.
TAGS = ("v1.1.0", "v1.1.1", "v1.2.0", "v1.2.1", "v1.2.2", "v1.3.0", "v1.3.1", "v1.3.2", "v1.4.0",
        "v1.4.1", "v1.4.2", "v1.5.0", "v1.5.1", "v1.5.2", "v1.6.0", "v1.6.1", "v1.6.2", "v1.7.0")
CRDS = {"RayJob": "ray-operator/config/crd/bases/ray.io_rayjobs.yaml",
        "RayCluster": "ray-operator/config/crd/bases/ray.io_rayclusters.yaml"}
PRUNED = {"x-pruned": True}
SHARE_MIN_CHARS = 400


def prune(schema: dict, instances: list) -> dict:
    """`schema` with the schema of each field none of `instances` sets replaced by PRUNED."""
    if "x-kubernetes-validations" in schema:
        # jsonschema cannot run CEL rules: a manifest field under one must be checked by hand.
        raise SystemExit(f"a field the manifests set has CEL validations: {schema['x-kubernetes-validations']}")
    out = dict(schema)
    if "properties" in schema:
        objects = [i for i in instances if isinstance(i, dict)]
        out["properties"] = {
            name: prune(sub, [o[name] for o in objects if name in o]) if any(name in o for o in objects) else PRUNED
            for name, sub in schema["properties"].items()
        }
    if isinstance(schema.get("additionalProperties"), dict):
        values = [v for i in instances if isinstance(i, dict) for v in i.values()]
        out["additionalProperties"] = prune(schema["additionalProperties"], values)
    if "items" in schema:
        out["items"] = prune(schema["items"], [v for i in instances if isinstance(i, list) for v in i])
    return out


def share(schema: dict, shared: dict[str, dict], min_chars: int = SHARE_MIN_CHARS) -> dict:
    """`schema` with every large subschema moved to `shared` under its hash, a `$ref` to it left in place.

    Head, worker and submitter pods have the same Pod schema, and most of it is
    the same in every release: stored once, the file is a fraction of the size.
    """
    out = dict(schema)
    if "properties" in schema:
        out["properties"] = {name: share(sub, shared) for name, sub in schema["properties"].items()}
    for keyword in ("items", "additionalProperties"):
        if isinstance(schema.get(keyword), dict):
            out[keyword] = share(schema[keyword], shared)
    for keyword in ("anyOf", "allOf", "oneOf"):
        if keyword in schema:
            out[keyword] = [share(sub, shared) for sub in schema[keyword]]
    text = json.dumps(out, sort_keys=True, separators=(",", ":"))
    if len(text) < min_chars:
        return out
    key = hashlib.sha256(text.encode()).hexdigest()[:12]
    shared[key] = out
    return {"$ref": f"#/$defs/{key}"}


def main(kuberay: Path) -> None:
    manifests: dict[str, list] = {kind: [] for kind in CRDS}
    for path in sorted((ROOT / "deploy" / "kuberay").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") in manifests:
                manifests[doc["kind"]].append(doc)
    shared: dict[str, dict] = {}
    versions: dict[str, dict[str, str]] = {}
    for tag in TAGS:
        versions[tag] = {}
        commit = subprocess.run(["git", "-C", str(kuberay), "rev-list", "-n1", tag],
                                check=True, capture_output=True, text=True).stdout.strip()
        for kind, path in CRDS.items():
            text = subprocess.run(["git", "-C", str(kuberay), "show", f"{tag}:{path}"],
                                  check=True, capture_output=True, text=True).stdout
            crd = yaml.safe_load(text)
            (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
            versions[tag][kind] = share(prune(v1["schema"]["openAPIV3Schema"], manifests[kind]), shared, min_chars=0)["$ref"]
        versions[tag]["commit"] = commit
    OUT.write_text(json.dumps({
        "source": {"repository": "https://github.com/ray-project/kuberay", "paths": CRDS},
        "what": "the v1 openAPIV3Schema of each CRD by tag (a $ref into $defs), fields that deploy/kuberay/*.yaml"
                " do not set replaced by {\"x-pruned\": true}; made by tests/data/kuberay/vendor_crds.py",
        "versions": versions,
        "$defs": shared,
    }, indent=1, sort_keys=True) + "\n")
    print(f"{OUT.relative_to(ROOT)}: {len(TAGS)} tags, {len(shared)} shared subschemas, {OUT.stat().st_size // 1024} KiB")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
