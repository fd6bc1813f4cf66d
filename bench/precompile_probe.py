"""Can the compile backend skip dynamo's re-trace on a warm start? torch's experimental precompile, probed.

A warm `compile` start re-traces the model with dynamo even when every FX graph comes from the cache (the
H200 rows spend ~15 s there). torch 2.13 has an experimental way around it: `torch.compile(module,
fullgraph=True)._aot_compile([ModelInput(args, {}, contexts)])` compiles one graph with its guards,
`_save_aot_compiled_module()` serialises graph code + guards, and `_load_aot_compiled_module(bytes)` in a fresh
process installs it with no tracing. With transformers' ModernBertModel the save fails (ID_MATCH guards on its
GELU builtin and decorator code objects cannot be serialised); with our plain-torch encoder (model/native.py)
it works on the CPU (tiny: load 2.3 s, then 5 x 200, 2 x 48 and 64 x 512 batches ran with no compile, max
|diff| vs eager 2.7e-5).

This script runs the two halves in two child processes (save, then load in a fresh process) on the chosen
device, under bf16 autocast on CUDA as the backend runs (entered inside the graph), and prints a table:
whether each step worked, its seconds, the compile counters of the loading process (should be empty) and the
max |diff| against the eager model. The compile backend uses the same API
(`CompileBackend._setup_precompiled`, falling back to tracing on any failure); this probe isolates it, so a
torch build where it fails shows why.

    python3 bench/precompile_probe.py --checkpoint DIR [--device cuda] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHAPES = ((3, 80, 4), (5, 200, 3), (2, 48, 5), (64, 512, 7))  # the first is the compile example


def _setup(checkpoint: str, device: str):

    from model.backends.compiled import ALIGN, _AlignedGraph, _synthetic_rows, padded_batch
    from model.bundle import open_bundle
    from model.native import load_native_model

    bundle = open_bundle(checkpoint)
    model = load_native_model(bundle)
    if model is None:
        raise SystemExit("the checkpoint's encoder config is not one model/native.py describes")
    model = model.to(device).eval()

    def args(n: int, L: int, k: int, mark: bool):
        b, _ = padded_batch(_synthetic_rows(n, min(L, bundle.max_len), k, bundle.tokenizer.cls_token_id),
                            bundle.tokenizer.pad_token_id)
        out = (b["input_ids"].view(n, -1, ALIGN), b["attention_mask"].view(n, -1, ALIGN), b["marker_pos"],
               b["marker_mask"], b["qtype"])
        out = tuple(t.to(device) for t in out)
        if mark:
            for t in out:
                torch._dynamo.maybe_mark_dynamic(t, 0)
            for t in out[:4]:
                torch._dynamo.mark_dynamic(t, 1)
        return out

    def ctx():
        import contextlib

        return torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else contextlib.nullcontext()

    # the backend's own graph module: on CUDA it enters bf16 autocast inside the graph (see _AlignedGraph)
    return model, _AlignedGraph(model, torch.bfloat16 if device == "cuda" else None, device), args, ctx


def child(step: str, checkpoint: str, device: str, path: str) -> dict:
    import torch._dynamo
    from torch._dynamo.aot_compile import ModelInput
    from torch._dynamo.utils import counters

    torch._dynamo.config.enable_aot_compile = True
    model, wrapped, args, ctx = _setup(checkpoint, device)
    compiled = torch.compile(wrapped, fullgraph=True, dynamic=False)
    out: dict = {}
    t = time.perf_counter()
    with torch.no_grad(), torch.fx.experimental._config.patch(use_duck_shape=False):
        if step == "save":
            compiled._aot_compile([ModelInput(args(*SHAPES[0], mark=True), {}, [])])
            out["compile_s"] = round(time.perf_counter() - t, 2)
            compiled._save_aot_compiled_module(path)
            out["bytes"] = os.path.getsize(path)
            return out
        with open(path, "rb") as fh:
            compiled._load_aot_compiled_module(fh.read())
        out["load_s"] = round(time.perf_counter() - t, 2)
        before = dict(counters["stats"])
        worst = 0.0
        t = time.perf_counter()
        for n, L, k in SHAPES:
            a = args(n, L, k, mark=False)
            got = compiled(*a)[0].float()  # no context around the call: the graph's guards check dispatch keys
            with ctx():
                want = model(a[0].flatten(1), a[1].flatten(1), *a[2:])[0].float()
            valid = a[3]
            worst = max(worst, float((got - want).abs()[valid].max()))
        if device == "cuda":
            torch.cuda.synchronize()
        out["calls_s"] = round(time.perf_counter() - t, 2)
        out["max_abs_diff_vs_eager"] = worst
        out["compiles_in_this_process"] = {k: v - before.get(k, 0) for k, v in counters["stats"].items()
                                           if v != before.get(k, 0)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=os.path.join(ROOT, "checkpoints", "tiny"))
    ap.add_argument("--device", default=None)
    ap.add_argument("--work", default="/tmp/precompile_probe")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--child", choices=["save", "load"])
    a = ap.parse_args()
    if a.device is None:
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    path = os.path.join(a.work, "precompiled.bin")
    if a.child:
        print("RESULT " + json.dumps(child(a.child, a.checkpoint, a.device, path)), flush=True)
        return
    os.makedirs(a.work, exist_ok=True)
    os.makedirs(a.out_dir, exist_ok=True)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(a.work, "inductor"),
               TRITON_CACHE_DIR=os.path.join(a.work, "triton"),
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    rows = {}
    for step in ("save", "load"):
        t = time.perf_counter()
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", step, "--checkpoint", a.checkpoint,
                            "--device", a.device, "--work", a.work], capture_output=True, text=True, env=env)
        res = [json.loads(x[7:]) for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        rows[step] = dict(res[-1] if res else {}, rc=r.returncode, process_s=round(time.perf_counter() - t, 1))
        if r.returncode != 0:
            rows[step]["stderr"] = r.stderr[-3000:]
            break
    out = os.path.join(a.out_dir, "precompile_probe_%s.json" % a.device)
    with open(out, "w") as fh:
        json.dump({"checkpoint": a.checkpoint, "device": a.device, "rows": rows}, fh, indent=1)
    print("%-6s %4s %10s  %s" % ("step", "rc", "process s", "result"))
    for step, r in rows.items():
        shown = {k: v for k, v in r.items() if k not in ("rc", "process_s", "stderr")}
        print("%-6s %4s %10s  %s" % (step, r["rc"], r["process_s"], json.dumps(shown)))
        if "stderr" in r:
            print(r["stderr"][-1500:])
    print("wrote", out)


if __name__ == "__main__":
    main()
