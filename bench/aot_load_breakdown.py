"""Where an AOTI package's load time goes on this machine: unzip, dlopen of the wrapper .so, and the full
`load_aoti_package` (our loader: libstdc++ made global, no CPU ISA probe), for one .pt2.

    python3 bench/aot_load_breakdown.py PACKAGE.pt2 [--out FILE.json]

Prints a table last.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("package")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not zipfile.is_zipfile(a.package):
        ap.error("%s is not an AOTI package (.pt2 zip archive)" % a.package)
    rows = {}
    t = time.perf_counter()
    import torch

    from model.backends.compiled import _promote_libstdcxx, load_aoti_package

    torch.cuda.init()
    rows["import torch + cuda init"] = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        with zipfile.ZipFile(a.package) as z:
            z.extractall(tmp)
            sizes = {i.filename: i.file_size for i in z.infolist()}
        rows["unzip"] = time.perf_counter() - t
        so = max((os.path.join(dp, f) for dp, _, fs in os.walk(tmp) for f in fs if f.endswith(".so")),
                 key=os.path.getsize)
        _promote_libstdcxx()
        t = time.perf_counter()
        ctypes.CDLL(so)
        rows["dlopen wrapper .so (%.0f MB)" % (os.path.getsize(so) / 1e6)] = time.perf_counter() - t
    t = time.perf_counter()
    load_aoti_package(a.package, 0)
    rows["load_aoti_package"] = time.perf_counter() - t
    big = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
    out = {"package_mb": os.path.getsize(a.package) / 1e6, "largest_files": big, "seconds": rows}
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(out, fh, indent=1)
    for k, v in big:
        print("  %8.1f MB  %s" % (v / 1e6, k))
    for k, v in rows.items():
        print("%-40s %7.2f s" % (k, v))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
