"""Writes the v1 openAPIV3Schema of a KubeRay CRD file, with its source header, for tests/test_kuberay.py:

    python tests/data/kuberay/vendor.py CRD.yaml OUT.yaml "SOURCE LINE"

CRD.yaml is one of KubeRay's helm-chart/kuberay-operator/crds/ray.io_*.yaml; nothing in the schema is changed.
"""

import sys

import yaml


def main(crd_path: str, out_path: str, source: str) -> None:
    with open(crd_path) as f:
        crd = yaml.load(f, Loader=yaml.CSafeLoader)
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    header = ("# The openAPIV3Schema of version v1 of the %s CustomResourceDefinition (%s), unchanged.\n"
              "# Source: %s\n"
              "# License: Apache-2.0 (KubeRay, ray-project/kuberay). Written by tests/data/kuberay/vendor.py.\n"
              % (crd["spec"]["names"]["kind"], crd["metadata"]["name"], source))
    with open(out_path, "w") as f:
        f.write(header)
        yaml.dump(v1["schema"]["openAPIV3Schema"], f, Dumper=yaml.CSafeDumper, sort_keys=False)


if __name__ == "__main__":
    main(*sys.argv[1:])
