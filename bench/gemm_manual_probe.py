"""Probe of the hand-warp-specialised GEMM (kernels/gemm_manual.py) against torch.matmul and our TileLang
auto-warp-specialised GEMM (kernels/gemm.py), bf16, C = A @ W^T, on one H200.

    . bench/gpu_env.sh    # on the GPU machine: tilelang from the carried bundle, cache dir /tmp/lfc
    python bench/gemm_manual_probe.py --out $OUT/gemm_manual_probe.json
    python bench/gemm_manual_probe.py --dry-run        # no GPU: only builds (compiles) every kernel

For each shape (N, K) and M it fills the output with NaN, runs every kernel once and compares every row with
torch.matmul(a, w.t()) (max |err| in units of the reference's RMS, and NaNs: a row the kernel did not write
stays NaN; also the error against the fp32 product), then times each kernel and torch.matmul with CUDA events
(median of --iters calls, taken in --rounds interleaved rounds after --warmup calls each). Prints a table last
and writes JSON to --out. Kernels compile before anything runs (in --jobs threads); a kernel that fails to
compile or run is recorded and skipped, not fatal. Manual configs are 'bm,bn,bk,stages[,persistent[,inflight]]'
(kernels.gemm_manual.GemmWSConfig); the default set runs in ~20 s on an H200 once the kernels are in the cache.
"""

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SHAPES = [(3072, 1024), (1024, 1024), (1024, 2624), (4096, 1024), (1024, 4096)]
MS = (65536, 15360, 4099)
# manual configs: bm,bn,bk,stages[,persistent[,inflight]]; 128x256x64s4p132 was the best on the H200
CONFIGS = ("128,256,64,4", "128,256,64,4,132", "128,256,64,4,132,0", "256,128,64,3,132")
TOL = 0.05   # max |err| / rms(ref): bf16 rounding of the output alone gives ~0.01-0.02


def log(msg: str) -> None:
    print("[%7.1fs] %s" % (time.perf_counter() - T0, msg), file=sys.stderr, flush=True)


T0 = time.perf_counter()


def parse_cfg(text: str):
    from kernels.gemm_manual import GemmWSConfig

    v = [int(x) for x in text.split(",")]
    return GemmWSConfig(*v)


def source_checks(kernel) -> dict:
    """What the generated CUDA shows: one wgmma batch in flight (wait<1>) and the stage release after it,
    setmaxnreg rebalancing, TMA loads and stores, no wait<0> inside the k-loop."""
    try:
        src = kernel.get_kernel_source()
    except Exception as e:  # noqa: BLE001
        return {"error": repr(e)}
    i1 = src.find("wait_wgmma<1>")
    rel = src.find(".arrive()", i1) if i1 >= 0 else -1
    return {"wait1": i1 >= 0,
            "release_after_wait1": i1 >= 0 and 0 <= rel - i1 < 300,
            "setmaxnreg": "warpgroup_reg_alloc" in src and "warpgroup_reg_dealloc" in src,
            "tma_load": "tma_load(" in src, "tma_store": "tma_store(" in src,
            "wait0_count": src.count("wait_wgmma<0>") + src.count("warpgroup_wait<0>")}


def build_all(shapes, cfgs, auto_cfg, jobs: int):
    """Compile every kernel (threads: the nvcc runs overlap); returns {(kind, N, K, tag): kernel or error str}."""
    from kernels.gemm import gemm_kernel
    from kernels.gemm_manual import check_config, gemm_manual_kernel

    tasks = []
    for N, K in shapes:
        if auto_cfg is not None:
            tasks.append((("auto", N, K, auto_cfg.tag()), lambda N=N, K=K: gemm_kernel(N, K, False, "none", auto_cfg)))
        for cfg in cfgs:
            tasks.append((("manual", N, K, cfg.tag()),
                          lambda N=N, K=K, cfg=cfg: (check_config(cfg), gemm_manual_kernel(N, K, cfg))[1]))
    out = {}

    def one(item):
        key, fn = item
        t = time.perf_counter()
        try:
            k = fn()
            log("built %s in %.1fs" % (key, time.perf_counter() - t))
            return key, k
        except Exception as e:  # noqa: BLE001
            log("FAILED to build %s: %s" % (key, "".join(traceback.format_exception_only(type(e), e)).strip()[-800:]))
            return key, "build error: %s" % str(e).strip().splitlines()[-1][:300] if str(e).strip() else repr(e)

    with ThreadPoolExecutor(max(1, jobs)) as ex:
        for key, k in ex.map(one, tasks):
            out[key] = k
    return out


def samples(fn, iters: int, warmup: int) -> list[float]:
    """Milliseconds of `iters` calls, each between its own pair of CUDA events, after `warmup` calls."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for s, e in evs:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in evs]


def bench_interleaved(fns: dict, iters: int, warmup: int, rounds: int) -> dict:
    """{label: median ms}: `iters` calls of each function in total, taken in `rounds` interleaved rounds
    (so clock and thermal drift over the run hits every kernel alike)."""
    per = max(1, -(-iters // rounds))
    got = {lbl: [] for lbl in fns}
    for _ in range(rounds):
        for lbl, fn in fns.items():
            got[lbl] += samples(fn, per, warmup)
    return {lbl: statistics.median(v) for lbl, v in got.items()}


def check(out, ref, ref32) -> dict:
    """Every row of `out` against `ref` (torch.matmul in bf16): max |err|, that over rms(ref), NaN count, rows
    with a NaN; and max |err| / rms against the fp32 product `ref32` (what bf16 rounding alone costs)."""
    import torch

    d = out.float() - ref.float()
    nan_mask = torch.isnan(d)
    nans = int(nan_mask.sum())
    rows_nan = int(nan_mask.any(dim=1).sum())
    d = torch.nan_to_num(d, nan=0.0)
    mx = float(d.abs().max())
    rms = float(ref.float().pow(2).mean().sqrt())
    rel = mx / max(rms, 1e-30)
    return {"max_abs": mx, "rel_rms": rel, "nans": nans, "rows_with_nan": rows_nan,
            "rel_rms_fp32": err32(out, ref32), "ok": nans == 0 and rel < TOL}


def err32(out, ref32) -> float:
    """max |out - ref32| / rms(ref32), NaNs ignored."""
    import torch

    d = torch.nan_to_num(out.float() - ref32, nan=0.0)
    return float(d.abs().max()) / max(float(ref32.pow(2).mean().sqrt()), 1e-30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="", help="JSON output path")
    ap.add_argument("--dry-run", action="store_true", help="only build the kernels (no GPU needed)")
    ap.add_argument("--configs", default=";".join(CONFIGS),
                    help="manual configs 'bm,bn,bk,stages[,persistent[,inflight]]' separated by ';' "
                         "(default %(default)s)")
    ap.add_argument("--shapes", default="", help="N,K pairs separated by ';' (default: the five model shapes)")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="row counts M (default %(default)s)")
    ap.add_argument("--no-auto", action="store_true", help="skip our auto-warp-specialised GEMM")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (iters split among them)")
    ap.add_argument("--jobs", type=int, default=8, help="compile threads")
    args = ap.parse_args()

    import torch

    if args.dry_run or not torch.cuda.is_available():
        os.environ.setdefault("LAYA_FLEET_TL_ARCH", "sm_90a")
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: use --dry-run to only build the kernels", file=sys.stderr)
        return 2

    from kernels.gemm import GemmConfig, gemm_flops

    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")] if args.shapes else SHAPES
    ms = [int(x) for x in args.ms.split(",")]
    cfgs = [parse_cfg(c) for c in args.configs.split(";") if c.strip()]
    auto_cfg = None if args.no_auto else GemmConfig(bm=128, bn=256, bk=64, stages=4, threads=256)
    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (dry run)",
              "torch": torch.__version__, "iters": args.iters, "warmup": args.warmup, "rounds": args.rounds,
              "tol_rel_rms": TOL,
              "configs": [c.tag() for c in cfgs], "auto": auto_cfg.tag() if auto_cfg else None,
              "builds": {}, "sources": {}, "rows": []}
    try:
        import tilelang

        result["tilelang"] = tilelang.__version__
    except Exception:  # noqa: BLE001
        pass

    t = time.perf_counter()
    kernels = build_all(shapes, cfgs, auto_cfg, args.jobs)
    result["build_s"] = round(time.perf_counter() - t, 1)
    for key, k in kernels.items():
        name = "%s n%d k%d %s" % key
        result["builds"][name] = "ok" if not isinstance(k, str) else k
        if key[0] == "manual" and not isinstance(k, str):
            result["sources"][name] = source_checks(k)
    log("built %d kernels in %.1fs (%d failed)" % (len(kernels), result["build_s"],
                                                   sum(isinstance(k, str) for k in kernels.values())))
    if args.dry_run:
        print(json.dumps({"builds": result["builds"], "sources": result["sources"]}, indent=1))
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(result, fh, indent=1)
        return 0 if not any(isinstance(k, str) for k in kernels.values()) else 1

    dev = "cuda"
    torch.manual_seed(0)
    for N, K in shapes:
        w = (torch.randn(N, K, device=dev) / K ** 0.5).to(torch.bfloat16)
        bias = torch.zeros(N, device=dev, dtype=torch.float32)
        for M in ms:
            a = torch.randn(M, K, device=dev).to(torch.bfloat16)
            ref = torch.matmul(a, w.t())
            ref32 = a.float() @ w.float().t()
            flops = gemm_flops(M, N, K)
            row = {"N": N, "K": K, "M": M, "kernels": {}}
            row["kernels"]["torch"] = {"rel_rms_fp32": err32(ref, ref32)}
            timed = {"torch": lambda a=a, w=w: torch.matmul(a, w.t())}
            entries = []
            if auto_cfg is not None:
                entries.append(("auto " + auto_cfg.tag(), kernels[("auto", N, K, auto_cfg.tag())]))
            entries += [("manual " + c.tag(), kernels[("manual", N, K, c.tag())]) for c in cfgs]
            out = torch.empty((M, N), device=dev, dtype=torch.bfloat16)
            for label, k in entries:
                if isinstance(k, str):
                    row["kernels"][label] = {"error": k}
                    continue
                out.fill_(float("nan"))   # rows a kernel does not write stay NaN
                try:
                    k(a, w, bias, out)
                    torch.cuda.synchronize()
                    row["kernels"][label] = check(out, ref, ref32)
                    timed[label] = lambda k=k, a=a, w=w, bias=bias, out=out: k(a, w, bias, out)
                except Exception as e:  # noqa: BLE001 - a launch failure (likely fatal for the context)
                    row["kernels"][label] = {"error": "%s: %s" % (type(e).__name__, str(e)[:300])}
                    log("FAILED %s N=%d K=%d M=%d: %s" % (label, N, K, M, e))
            for label, ms_k in bench_interleaved(timed, args.iters, args.warmup, args.rounds).items():
                row["kernels"][label].update({"ms": ms_k, "tflops": flops / ms_k / 1e9})
            del out
            result["rows"].append(row)
            log("N=%d K=%d M=%d: %s" % (N, K, M, ", ".join(
                "%s %.0f" % (lbl, v["tflops"]) if "tflops" in v else "%s ERR" % lbl
                for lbl, v in row["kernels"].items())))
            del a, ref, ref32, timed
        del w
        torch.cuda.empty_cache()

    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
        log("wrote %s" % args.out)

    # the table, last: TF/s per kernel; err = worst max|err|/rms(ref) of the manual kernels, ! when a check failed
    labels = ["torch"] + (["auto " + auto_cfg.tag()] if auto_cfg else []) + ["manual " + c.tag() for c in cfgs]
    short = ["torch"] + (["auto"] if auto_cfg else []) + [c.tag() for c in cfgs]
    print()
    print("%-11s %6s " % ("N x K", "M") + " ".join("%*s" % (max(8, len(s)), s) for s in short) +
          "  max_err  err32_torch  err32_manual")
    for row in result["rows"]:
        cells = []
        for lbl, s in zip(labels, short):
            v = row["kernels"].get(lbl, {})
            txt = "%.0f" % v["tflops"] if "tflops" in v else "ERR"
            if v.get("ok") is False:
                txt += "!"
            cells.append("%*s" % (max(8, len(s)), txt))
        man = [v for lbl, v in row["kernels"].items() if lbl.startswith("manual") and "rel_rms" in v]
        errs = [v["rel_rms"] for v in man]
        e32 = [v["rel_rms_fp32"] for v in man]
        print("%-11s %6d " % ("%dx%d" % (row["N"], row["K"]), row["M"]) + " ".join(cells) +
              "  %7s  %11.4f  %12s" % ("%.4f" % max(errs) if errs else "-", row["kernels"]["torch"]["rel_rms_fp32"],
                                       "%.4f" % max(e32) if e32 else "-"))
    print("(TF/s; '!' = a NaN or max|err|/rms(ref) >= %.2f. max_err: worst manual config against torch.matmul (bf16); "
          "err32_*: max|err|/rms against the fp32 product, torch's and the worst manual config's)" % TOL)
    bad = [(r["N"], r["K"], r["M"], lbl) for r in result["rows"] for lbl, v in r["kernels"].items()
           if lbl != "torch" and (v.get("ok") is False or "error" in v)]
    if bad:
        print("FAILED checks: %s" % bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
