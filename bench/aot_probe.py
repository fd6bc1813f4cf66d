"""Why does loading an AOTInductor package crash on the GPU? One case per child process, build then load.

Loading this model's AOTI package on the H200 (torch 2.11) died with SIGSEGV inside
`aoti_load_package` -> `_load_aoti`, in a process that had compiled nothing. This script narrows it down:
each case is built in one child and loaded (and run once, compared with the eager module) in another,
both under faulthandler, so a crash is one row of the table and not the end of the run.

Cases: `min-small` (two Linear layers), `min-big` (24 x 4096^2 bf16 Linear, ~800 MB of weights inside the
.so, like the real model), `<shape>-in-so` (our DecisionModel from `make-checkpoint --shape <shape>`, weights
in the .so, the backend's default) and `<shape>-ext` (weights left out of the .so:
`aot_inductor.package_constants_in_so=False`, handed to the loaded runner with `load_constants`).

    python3 bench/aot_probe.py --cases min-small,min-big,tiny-in-so,tiny-ext,mmbert-base-ext --out-dir $OUT

`--preload-libstdcxx` loads with LD_PRELOAD set to the libstdc++ of the C++ compiler that built the package (the
H200 trace ends in std::regex inside the package's device-string parser, reached through a null facet: the
headers the package was compiled against and the libstdc++ the process runs may disagree). The JSON's
`toolchain` records the compiler, the libstdc++ the Python process maps and every libstdc++ on the machine.

`--native-trace` also loads each package under a SIGSEGV handler preloaded into the child (built here with
gcc: backtrace(3) of the native frames, library and symbol per frame) and, where gdb exists, once more
under `gdb -batch` for its backtrace, since faulthandler shows only the Python frames.

Prints a table last; writes aot_probe.json under --out-dir.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

DEVICE = os.environ.get("AOT_PROBE_DEVICE", "cuda")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


# -- children -----------------------------------------------------------------------------------------
def _min_module(kind: str):
    import torch

    torch.manual_seed(0)
    if kind == "min-small":
        m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
        width = 256
    else:
        width = 4096
        m = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(24)])
    return m.to(DEVICE, torch.bfloat16 if DEVICE == "cuda" else torch.float32).eval(), width


def _model_case(case: str, work: str):
    from model.bundle import load_model, open_bundle

    shape = case.rsplit("-", 2)[0] if case.endswith("-in-so") else case.rsplit("-", 1)[0]
    ck = os.path.join(work, "ckpt-" + shape)
    if not os.path.isdir(ck):
        if shape == "tiny":
            ck = os.path.join(ROOT, "checkpoints", "tiny")
        else:
            subprocess.run([sys.executable, "-m", "model.cli", "make-checkpoint", "--shape", shape, "--out", ck],
                           check=True, cwd=ROOT)
    bundle = open_bundle(ck)
    return bundle, load_model(bundle)


def _example(bundle, device):
    from model.backends.compiled import padded_batch
    from model.sequence import Row

    tok = bundle.tokenizer
    rows = [Row([tok.cls_token_id] + [100 + (i * 7 + j) % 500 for j in range(40 + 9 * i)] + [tok.sep_token_id],
                [3, 9, 15], i % 3) for i in range(3)]
    b, _ = padded_batch(rows, tok.pad_token_id)
    return tuple(b[x].to(device) for x in ("input_ids", "attention_mask", "marker_pos", "marker_mask", "qtype"))


def child_build(case: str, work: str) -> dict:
    import torch

    pkg = os.path.join(work, case + ".pt2")
    if case.endswith("-so"):
        return _build_so(case, work)
    ext = case.endswith("-ext")
    cfg = {"shape_padding": False}
    if ext:
        cfg["aot_inductor.package_constants_in_so"] = False
    t = time.perf_counter()
    if case.startswith("min-"):
        m, width = _min_module(case)
        x = torch.randn(4, width, device=DEVICE, dtype=next(m.parameters()).dtype)
        ep = torch.export.export(m, (x,), dynamic_shapes=({0: torch.export.Dim("b", min=1, max=4096)},))
    else:
        from model.backends.compiled import export_model

        bundle, model = _model_case(case, work)
        ep = export_model(model, bundle, torch.device(DEVICE))
    t1 = time.perf_counter()
    torch._inductor.aoti_compile_and_package(ep, package_path=pkg, inductor_configs=cfg)
    return {"export_s": round(t1 - t, 1), "compile_s": round(time.perf_counter() - t1, 1),
            "package_mb": round(os.path.getsize(pkg) / 1e6, 1)}


def _build_so(case: str, work: str) -> dict:
    """The deprecated unpackaged route: `torch._export.aot_compile` -> a bare .so (no .pt2 archive)."""
    import torch

    so = os.path.join(work, case + ".so")
    t = time.perf_counter()
    m, width = _min_module(case[:-3])
    x = torch.randn(4, width, device=DEVICE, dtype=next(m.parameters()).dtype)
    with torch.no_grad():
        path = torch._export.aot_compile(m, (x,), dynamic_shapes=({0: torch.export.Dim("b", min=1, max=4096)},),
                                         options={"aot_inductor.output_path": so})
    return {"compile_s": round(time.perf_counter() - t, 1), "so": str(path),
            "package_mb": round(os.path.getsize(str(path)) / 1e6, 1)}


def _load_so(case: str, work: str) -> dict:
    import torch

    t = time.perf_counter()
    fn = torch._export.aot_load(os.path.join(work, case + ".so"), DEVICE)
    out: dict = {"load_s": round(time.perf_counter() - t, 2)}
    m, width = _min_module(case[:-3])
    x = torch.randn(5, width, device=DEVICE, dtype=next(m.parameters()).dtype)
    with torch.no_grad():
        ref = m(x).float()
    got = fn(x)
    got = (got[0] if isinstance(got, (list, tuple)) else got).float()
    out["max_abs_diff"] = float((got - ref).abs().max())
    return out


def child_load(case: str, work: str, single_threaded: bool) -> dict:
    import torch

    if case.endswith("-so"):
        return _load_so(case, work)

    pkg = os.path.join(work, case + ".pt2")
    if DEVICE == "cuda":
        torch.cuda.init()
    t = time.perf_counter()
    runner = torch._inductor.aoti_load_package(pkg, run_single_threaded=single_threaded,
                                           device_index=int(os.environ.get("AOT_PROBE_DEVICE_INDEX", "0"))
                                           if DEVICE == "cuda" else -1)
    load_s = time.perf_counter() - t
    out: dict = {"load_s": round(load_s, 2)}
    if case.startswith("min-"):
        m, width = _min_module(case)
        x = torch.randn(5, width, device=DEVICE, dtype=next(m.parameters()).dtype)
        with torch.no_grad():
            ref = m(x).float()
        if case.endswith("-ext"):
            runner.load_constants(dict(m.state_dict()), check_full_update=True, user_managed=True)
        got = runner(x)
        got = (got[0] if isinstance(got, (list, tuple)) else got).float()
    else:
        from model.backends.compiled import bf16_copy

        bundle, model = _model_case(case, work)
        m = (bf16_copy(model) if DEVICE == "cuda" else model).to(DEVICE).eval()
        if case.endswith("-ext"):
            fqns = runner.get_constant_fqns()
            tensors = dict(m.named_parameters())
            tensors.update(dict(m.named_buffers()))
            missing = [f for f in fqns if f not in tensors]
            out["constants"] = len(fqns)
            out["missing"] = missing[:8]
            t2 = time.perf_counter()
            runner.load_constants({f: tensors[f] for f in fqns if f in tensors}, check_full_update=not missing,
                                  user_managed=True)
            out["load_constants_s"] = round(time.perf_counter() - t2, 2)
        args = _example(bundle, DEVICE)
        with torch.no_grad():
            ref = m(*args)[0].float()
        got = runner(*args)[0].float()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    out["max_abs_diff"] = float((got - ref).abs().max())
    return out


# -- parent -------------------------------------------------------------------------------------------
SEGV_TRACE_C = r"""
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
static void on_segv(int sig, siginfo_t *si, void *ctx) {
  void *frames[64];
  char msg[96];
  int n = backtrace(frames, 64);
  int len = snprintf(msg, sizeof msg, "\n[segv_trace] signal %d at %p, %d frames:\n", sig, si->si_addr, n);
  write(2, msg, len);
  backtrace_symbols_fd(frames, n, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}
__attribute__((constructor)) static void install(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_segv;
  sa.sa_flags = SA_SIGINFO;
  sigaction(SIGSEGV, &sa, 0);
  sigaction(SIGBUS, &sa, 0);
}
"""


def toolchain_facts() -> dict:
    """The C++ compiler inductor uses, its libstdc++, the libstdc++ this process maps after importing torch,
    and every libstdc++.so.6 found under the usual prefixes with its newest GLIBCXX version."""
    import re

    import torch._inductor.config as icfg

    out: dict = {"cxx": str(icfg.cpp.cxx)}
    for cxx in ("g++", "c++", "clang++"):
        path = shutil.which(cxx)
        if path:
            r = subprocess.run([path, "--version"], capture_output=True, text=True)
            out[cxx] = (path, r.stdout.splitlines()[0] if r.stdout else "")
    if shutil.which("g++"):
        lib = subprocess.run(["g++", "-print-file-name=libstdc++.so.6"], capture_output=True, text=True).stdout.strip()
        out["gxx_libstdcxx"] = os.path.realpath(lib) if lib else None
    with open("/proc/self/maps") as fh:
        out["mapped"] = sorted({ln.split()[-1] for ln in fh if "libstdc++" in ln or "libgcc_s" in ln})
    found = {}
    try:
        roots = [d for d in ("/usr", "/lib", "/lib64", "/opt", "/root", "/tmp/site") if os.path.isdir(d)]
        r = subprocess.run(["find"] + roots + ["-name", "libstdc++.so.6*"],
                           capture_output=True, text=True, timeout=60)
        paths = r.stdout.split()
    except subprocess.TimeoutExpired as e:
        paths = (e.stdout or b"").decode().split() if isinstance(e.stdout, bytes) else []
    for f in paths:
        real = os.path.realpath(f)
        if real in found or not os.path.isfile(real) or real.endswith(".py"):
            continue
        with open(real, "rb") as fh:
            vers = set(re.findall(rb"GLIBCXX_3\.4\.(\d+)", fh.read()))
        found[real] = "GLIBCXX_3.4.%d" % max(int(v) for v in vers) if vers else "?"
    out["libstdcxx"] = found
    return out


def segv_trace_lib(work: str) -> str | None:
    """Build the preloadable SIGSEGV backtrace library with gcc; None when that fails."""
    src, lib = os.path.join(work, "segv_trace.c"), os.path.join(work, "segv_trace.so")
    with open(src, "w") as fh:
        fh.write(SEGV_TRACE_C)
    r = subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", lib, src], capture_output=True, text=True)
    return lib if r.returncode == 0 else None


def run_child(args: list[str], timeout: float, preload: str | None = None,
              gdb: bool = False) -> tuple[int, dict | None, str, float]:
    t = time.perf_counter()
    env = dict(os.environ, PYTHONFAULTHANDLER="1",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-X", "faulthandler", os.path.abspath(__file__)] + args
    if preload:
        env["LD_PRELOAD"] = preload
    if preload and "segv_trace" in preload:
        env.pop("PYTHONFAULTHANDLER")   # our handler reports; faulthandler would take the signal first
        cmd.remove("-X")
        cmd.remove("faulthandler")
    if gdb:
        env.pop("PYTHONFAULTHANDLER")
        cmd = ["gdb", "-batch", "-q", "-ex", "set pagination off", "-ex", "handle SIGSEGV stop",
               "-ex", "run", "-ex", "bt 40", "-ex", "info sharedlibrary", "--args",
               sys.executable, os.path.abspath(__file__)] + args
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        return -9, None, "timeout: " + ((e.stderr or b"")[-1500:].decode("utf-8", "replace")
                                         if isinstance(e.stderr, bytes) else str(e.stderr)[-1500:]), timeout
    res = None
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
    err = r.stderr[-3000:]
    if preload and "segv_trace" in preload and "[segv_trace]" in r.stderr:
        err = r.stderr[r.stderr.index("[segv_trace]"):][:6000]
    if gdb:
        at = r.stdout.find("received signal")
        tail = r.stdout[max(0, at - 200):] if at >= 0 else r.stdout[-3000:]
        err = tail[:10000] + "\n--- stderr ---\n" + r.stderr[-1500:]
    return r.returncode, res, err, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="min-small,min-big,tiny-in-so,tiny-ext,mmbert-base-ext")
    ap.add_argument("--work", default="/tmp/aot_probe")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--deadline", type=float, default=480.0, help="stop starting cases after this many seconds")
    ap.add_argument("--single-threaded", action="store_true", help="load with run_single_threaded=True")
    ap.add_argument("--load-only", action="store_true", help="load packages a previous run built in --work")
    ap.add_argument("--preload-libstdcxx", action="store_true",
                    help="load with LD_PRELOAD of the compiler's libstdc++ (g++ -print-file-name)")
    ap.add_argument("--native-trace", action="store_true",
                    help="load again under a preloaded SIGSEGV backtrace handler and under gdb when present")
    ap.add_argument("--child", choices=["build", "load"])
    ap.add_argument("--case")
    a = ap.parse_args()
    if a.child:
        fn = child_build if a.child == "build" else (lambda c, w: child_load(c, w, a.single_threaded))
        print("RESULT " + json.dumps(fn(a.case, a.work)), flush=True)
        return
    os.makedirs(a.work, exist_ok=True)
    os.makedirs(a.out_dir, exist_ok=True)
    facts = toolchain_facts()
    print("toolchain: " + json.dumps(facts), flush=True)
    preload = facts.get("gxx_libstdcxx") if a.preload_libstdcxx else None
    t0 = time.perf_counter()
    rows = []
    for case in [c for c in a.cases.split(",") if c]:
        left = a.deadline - (time.perf_counter() - t0)
        if left < 30:
            rows.append({"case": case, "skipped": "deadline"})
            continue
        row: dict = {"case": case}
        if a.load_only:
            rc, res, err, s = 0, {}, "", 0.0
        else:
            rc, res, err, s = run_child(["--child", "build", "--case", case, "--work", a.work], left)
        row["build"] = {"rc": rc, "s": round(s, 1), **(res or {})}
        if rc != 0:
            row["build"]["stderr"] = err
        else:
            extra = ["--single-threaded"] if a.single_threaded else []
            rc, res, err, s = run_child(["--child", "load", "--case", case, "--work", a.work] + extra,
                                        max(30.0, a.deadline - (time.perf_counter() - t0)), preload=preload)
            row["load"] = {"rc": rc, "s": round(s, 1), **(res or {})}
            if rc != 0:
                row["load"]["stderr"] = err
            if rc != 0 and a.native_trace:
                lib = segv_trace_lib(a.work)
                args = ["--child", "load", "--case", case, "--work", a.work] + extra
                if lib:
                    rc2, _, err2, s2 = run_child(args, max(30.0, a.deadline - (time.perf_counter() - t0)),
                                                 preload=" ".join(p for p in (preload, lib) if p))
                    row["load_native"] = {"rc": rc2, "s": round(s2, 1), "trace": err2}
                    print(err2[:4000], flush=True)
                if shutil.which("gdb") and a.deadline - (time.perf_counter() - t0) > 60:
                    rc3, _, err3, s3 = run_child(args, max(30.0, a.deadline - (time.perf_counter() - t0)), gdb=True)
                    row["load_gdb"] = {"rc": rc3, "s": round(s3, 1), "trace": err3}
                    print(err3[:6000], flush=True)
        rows.append(row)
        print(json.dumps(row)[:600], flush=True)
    import torch

    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "toolchain": facts, "preload": preload,
           "rows": rows}
    with open(os.path.join(a.out_dir, "aot_probe.json"), "w") as f:
        json.dump(out, f, indent=1)
    print("\n%-18s %-26s %-40s" % ("case", "build", "load"))
    for r in rows:
        b, ld = r.get("build", {}), r.get("load", {})
        bs = "rc %s %.0fs %s MB" % (b.get("rc"), b.get("s", 0), b.get("package_mb", "-")) if b else r.get("skipped")
        ls = ("rc %s load %ss diff %s" % (ld.get("rc"), ld.get("load_s", "-"), ld.get("max_abs_diff", "-"))
              if ld else "-")
        print("%-18s %-26s %-40s" % (r["case"], bs, ls))


if __name__ == "__main__":
    main()
