"""One request alone on the GPU host, in process: how idle time between requests changes a lone request's time.

A lone HTTP request spends 2.4-2.8 ms in the replica's forward where `bench/fast_path.py` measures 1.7 ms for
the same 1 state x 3 questions back to back. This runs that workload on the fast engine with a gap before each
request: slept (the CPU idles, as a replica's does between one client's requests), spun (the CPU stays busy,
the GPU idles the same), and through the Scorer's forward thread from an asyncio loop (the replica's path),
each with and without other processes holding CUDA contexts on the GPU (three replicas share one). GPU SM clock
and host CPU frequency are sampled during each mode. Prints a table, writes JSON and a PNG beside it.

    python3 bench/lone_request.py --checkpoint /tmp/ck_large --out $OUT/lone_request.json
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

STATE = ("my order arrived late and the box was broken, I want a refund for the damaged item please help me "
         "with this as soon as possible")
QUESTIONS = os.path.join(ROOT, "configs", "example_questions.json")
CONTEXT_CHILD = "import time, torch; torch.zeros(1, device='cuda'); print('up', flush=True); time.sleep(3600)"


class Sampler:
    """GPU SM clock (nvidia-smi, every 50 ms) and mean host CPU MHz, tagged with the mode running."""

    def __init__(self):
        self.mode = None
        self.gpu: dict[str, list[float]] = {}
        self.cpu: dict[str, list[float]] = {}
        self._stop = False
        try:
            self._smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw",
                                          "--format=csv,noheader,nounits", "-lms", "50"],
                                         stdout=subprocess.PIPE, text=True)
            threading.Thread(target=self._read_gpu, daemon=True).start()
        except OSError:
            self._smi = None
        threading.Thread(target=self._read_cpu, daemon=True).start()

    def _read_gpu(self):
        for line in self._smi.stdout:
            if self.mode:
                try:
                    self.gpu.setdefault(self.mode, []).append(float(line.split(",")[0]))
                except ValueError:
                    pass

    def _read_cpu(self):
        files = glob.glob("/sys/devices/system/cpu/cpu[0-9]*/cpufreq/scaling_cur_freq")
        while not self._stop:
            if self.mode and files:
                vals = []
                for f in files:
                    try:
                        vals.append(int(open(f).read()) / 1e3)
                    except (OSError, ValueError):
                        pass
                if vals:
                    self.cpu.setdefault(self.mode, []).append(statistics.mean(vals))
            time.sleep(0.05)

    def close(self):
        self._stop = True
        if self._smi:
            self._smi.terminate()


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def run_sync(fn, gap_s: float, how: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        if gap_s:
            time.sleep(gap_s) if how == "sleep" else spin(gap_s)
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def run_async(scorer, rows, gap_s: float, n: int) -> list[float]:
    async def go():
        out = []
        for _ in range(n):
            if gap_s:
                await asyncio.sleep(gap_s)
            t = time.perf_counter()
            await scorer.score_rows_async(rows)
            out.append((time.perf_counter() - t) * 1e3)
        return out
    return asyncio.run(go())


def summary(ts: list[float]) -> dict:
    ts = sorted(ts)
    return {"p50_ms": statistics.median(ts), "p90_ms": ts[int(0.9 * (len(ts) - 1))], "n": len(ts)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--gaps-ms", default="0,0.5,2,5,20")
    p.add_argument("--n", type=int, default=150, help="requests per mode")
    p.add_argument("--contexts", default="0,2", help="other CUDA processes on the GPU, per pass")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "lone_request.json"))
    a = p.parse_args(argv)

    from serve_app.scorer import Scorer

    qs = json.load(open(QUESTIONS))
    scorer = Scorer(a.checkpoint, backend="auto", device="auto")
    eng = scorer.engine
    rows = [r for enc in eng.encode_many([STATE], eng.prepare(qs)) for r in enc.rows]
    gaps = [float(g) / 1e3 for g in a.gaps_ms.split(",")]
    res = {"checkpoint": a.checkpoint, "backend": eng.backend_name, "tokens": sum(len(r) for r in rows),
           "rows": len(rows), "commit": os.environ.get("LAYA_FLEET_COMMIT"), "modes": {}}
    sampler = Sampler()
    children: list[subprocess.Popen] = []
    try:
        for k in [int(c) for c in a.contexts.split(",")]:
            while len(children) < k:
                c = subprocess.Popen([sys.executable, "-c", CONTEXT_CHILD], stdout=subprocess.PIPE, text=True)
                c.stdout.readline()
                children.append(c)
            for gap in gaps:
                for how in (("sleep", "spin") if gap else ("none",)):
                    for what in ("predict", "forward", "scorer_thread"):
                        if what == "scorer_thread" and how == "spin":
                            continue
                        mode = "ctx%d/%s/%s/%g" % (k, what, how, gap * 1e3)
                        sampler.mode = mode
                        if what == "predict":
                            ts = run_sync(lambda: eng.predict(STATE, qs), gap, how, a.n)
                        elif what == "forward":
                            ts = run_sync(lambda: eng.backend.forward(rows), gap, how, a.n)
                        else:
                            ts = run_async(scorer, rows, gap, a.n)
                        sampler.mode = None
                        s = summary(ts[5:])
                        s.update(contexts=k, what=what, gap=how, gap_ms=gap * 1e3)
                        res["modes"][mode] = s
                        print("%-36s p50 %6.3f ms  p90 %6.3f ms" % (mode, s["p50_ms"], s["p90_ms"]), flush=True)
    finally:
        sampler.close()
        for c in children:
            c.kill()
        scorer.close()
    for mode, s in res["modes"].items():
        g, c = sampler.gpu.get(mode), sampler.cpu.get(mode)
        s["gpu_sm_mhz"] = statistics.median(g) if g else None
        s["cpu_mhz"] = statistics.mean(c) if c else None
    print(table(res))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
    plot(res, os.path.splitext(a.out)[0] + ".png")
    return 0


def table(res: dict) -> str:
    lines = ["| contexts | path | gap | gap ms | p50 ms | p90 ms | GPU SM MHz | CPU MHz |",
             "|---|---|---|---|---|---|---|---|"]
    for s in res["modes"].values():
        lines.append("| %d | %s | %s | %g | %.3f | %.3f | %s | %s |" % (
            s["contexts"], s["what"], s["gap"], s["gap_ms"], s["p50_ms"], s["p90_ms"],
            "%.0f" % s["gpu_sm_mhz"] if s.get("gpu_sm_mhz") else "-",
            "%.0f" % s["cpu_mhz"] if s.get("cpu_mhz") else "-"))
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    series: dict[str, list[tuple[float, float]]] = {}
    for s in res["modes"].values():
        key = "%s, %s, %d other contexts" % (s["what"], "sleep" if s["gap"] == "none" else s["gap"], s["contexts"])
        series.setdefault(key, []).append((s["gap_ms"], s["p50_ms"]))
        if s["gap"] == "none":  # the back-to-back point belongs to both gap kinds
            series.setdefault(key.replace("sleep", "spin"), []).append((s["gap_ms"], s["p50_ms"]))
    for key, pts in sorted(series.items()):
        pts.sort()
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=key)
    ax.set_xscale("symlog", linthresh=0.5)
    ax.set_xlabel("gap before each request, ms")
    ax.set_ylabel("p50 ms")
    ax.set_title("lone 1 x 3 request, %s backend, %d tokens" % (res["backend"], res["tokens"]))
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
