"""Extract the openAPIV3Schema of one served version of a CustomResourceDefinition as JSON.

    git --git-dir=<kuberay>/.git show v1.7.0:ray-operator/config/crd/bases/ray.io_rayservices.yaml \
        | python extract_crd_schema.py v1 > rayservice-ray.io-v1.json

The schema is kept as published except that the ``description`` texts are dropped (they
make up most of the file and play no part in validation); see README.md.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import yaml


def strip_descriptions(schema: Any) -> Any:
    """The schema without ``description`` keywords. Keys of ``properties`` are field names
    (a field may be called "description"), so only schema objects lose the keyword."""
    if isinstance(schema, list):
        return [strip_descriptions(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "description":
            continue
        if key in ("properties", "patternProperties", "definitions", "$defs"):
            out[key] = {name: strip_descriptions(sub) for name, sub in value.items()}
        elif key in ("default", "example", "enum", "const"):
            out[key] = value  # values, not schemas
        else:
            out[key] = strip_descriptions(value)
    return out


def served_schema(crd: dict[str, Any], version: str) -> dict[str, Any]:
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            if not v.get("served"):
                raise SystemExit(f"version {version} of {crd['metadata']['name']} is not served")
            return v["schema"]["openAPIV3Schema"]
    raise SystemExit(f"{crd['metadata']['name']} has no version {version}")


def main() -> None:
    version = sys.argv[1]
    crd = next(d for d in yaml.safe_load_all(sys.stdin) if d)
    json.dump(strip_descriptions(served_schema(crd, version)), sys.stdout, indent=0,
              sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
