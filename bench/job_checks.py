"""The offline job's checks (`prepare_job`: questions, inputs, columns, the checkpoint's tokenizer) in a fresh
process, with the node-local tokenizer record absent (transformers builds the tokenizer) and present (the
`tokenizers` library reads the record), side by side; each a median of `--repeats` fresh processes. Prints a
table, writes JSON and a PNG beside it.

    python3 bench/job_checks.py --checkpoint checkpoints/tiny --out bench/results/job_checks_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = """
import sys, time
t0 = time.perf_counter()
sys.path[:0] = [{bench!r}, {root!r}]
from offline import QUESTIONS, make_data
from serve_app import offline
files = make_data({data!r}, {rows}, {files})
t1 = time.perf_counter()
offline.prepare_job(offline.OfflineConfig(input=[{data!r}], output={out!r}, questions=QUESTIONS, state_column="text",
                                          id_column="id", checkpoint={ckpt!r}))
t2 = time.perf_counter()
print("TIMES", t1 - t0, t2 - t1, "transformers" in sys.modules)
"""


def run_child(ckpt: str, data: str, rows: int, files: int, local: str) -> tuple[float, float, bool]:
    code = CHILD.format(bench=os.path.join(ROOT, "bench"), root=ROOT, data=data, rows=rows, files=files,
                        out=os.path.join(data, "out"), ckpt=os.path.abspath(ckpt))
    env = dict(os.environ, LAYA_FLEET_LOCAL_CACHE_DIR=local)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    if r.returncode != 0:
        raise SystemExit("child failed:\n" + r.stderr[-3000:])
    line = [x for x in r.stdout.splitlines() if x.startswith("TIMES")][-1].split()
    return float(line[1]), float(line[2]), line[3] == "True"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default=os.path.join(ROOT, "checkpoints", "tiny"))
    p.add_argument("--rows", type=int, default=100000)
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "job_checks_cpu.json"))
    a = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="job-checks-")
    data, local = os.path.join(work, "data"), os.path.join(work, "local")
    try:
        run_child(a.checkpoint, data, a.rows, a.files, local)   # writes the data once (not timed)
        res = {"checkpoint": a.checkpoint, "rows": a.rows, "files": a.files, "cpus": os.cpu_count(),
               "commit": os.environ.get("LAYA_FLEET_COMMIT") or subprocess.run(
                   ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
               "modes": {}}
        for mode in ("no tokenizer record", "tokenizer record"):
            runs = []
            for _ in range(a.repeats):
                if mode == "no tokenizer record":
                    shutil.rmtree(os.path.join(local, "tokenizers"), ignore_errors=True)
                else:
                    run_child(a.checkpoint, data, a.rows, a.files, local)   # makes sure the record exists
                runs.append(run_child(a.checkpoint, data, a.rows, a.files, local))
            res["modes"][mode] = {"prepare_job_s": statistics.median(r[1] for r in runs),
                                  "runs_s": [round(r[1], 3) for r in runs], "transformers_imported": runs[-1][2]}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = ["| tokenizer | job checks (median of %d fresh processes) | transformers imported |" % a.repeats,
             "|---|---|---|"]
    for mode, m in res["modes"].items():
        lines.append("| %s | %.2f s | %s |" % (mode, m["prepare_job_s"], "yes" if m["transformers_imported"] else "no"))
    print("\n".join(lines))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as fh:
        json.dump(res, fh, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.5))
        names = list(res["modes"])
        ax.bar(names, [res["modes"][n]["prepare_job_s"] for n in names])
        ax.set_ylabel("offline job checks, s")
        fig.tight_layout()
        fig.savefig(os.path.splitext(a.out)[0] + ".png", dpi=120)
    except ImportError:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
