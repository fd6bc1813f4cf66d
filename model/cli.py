"""`laya-fleet` command line: make-checkpoint, predict, aot, precompile."""

from __future__ import annotations

import argparse
import json
import logging
import sys


def _read_arg(value: str) -> str:
    if value.startswith("@"):
        with open(value[1:], encoding="utf-8") as fh:
            return fh.read()
    return value


def _cmd_make_checkpoint(args: argparse.Namespace) -> int:
    from .make_checkpoint import make_checkpoint

    out = make_checkpoint(args.out, args.shape, args.seed)
    print(out)
    return 0


def _cmd_predict(args: argparse.Namespace) -> int:
    from . import load

    try:
        with open(args.questions, encoding="utf-8") as fh:
            questions = json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        print("laya-fleet: cannot read questions file %s: %s" % (args.questions, e), file=sys.stderr)
        return 2
    state = _read_arg(args.state)
    if args.json_state:
        try:
            state = json.loads(state)
        except json.JSONDecodeError as e:
            print("laya-fleet: --json-state given but the state is not JSON: %s" % e, file=sys.stderr)
            return 2
    engine = load(args.checkpoint, device=args.device, backend=args.backend)
    try:
        result = engine.predict(state, questions)
    except (ValueError, TypeError) as e:
        print("laya-fleet: %s" % e, file=sys.stderr)
        return 2
    json.dump(result, sys.stdout, ensure_ascii=False, indent=2 if args.pretty else None)
    sys.stdout.write("\n")
    return 0


def _cmd_aot(args: argparse.Namespace) -> int:
    from .backends.aot import build_aot_package

    path = build_aot_package(args.checkpoint, cache_dir=args.cache_dir, device=args.device)
    print(path)
    return 0


def _fold_m(value: str) -> int:
    """--ln-fold-m's value: 0, or a token bucket past the tuning table's small_m (argparse's error otherwise)."""
    from kernels.tuning import TABLE, Tuning

    try:
        return Tuning.from_dict({**TABLE.as_dict(), "ln_fold_m": int(value)}).ln_fold_m
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _cmd_precompile(args: argparse.Namespace) -> int:
    from .backends.fast.precompile import run

    logging.getLogger().setLevel(logging.INFO)   # the kernels it compiles, as they finish
    return run(args)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `laya-fleet` console script; returns the exit status."""
    p = argparse.ArgumentParser(prog="laya-fleet", description="Laya typed-decision models on a Ray fleet.")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    sub = p.add_subparsers(dest="cmd", required=True)

    mk = sub.add_parser("make-checkpoint", help="write a bundle with random weights and a trained BPE tokenizer")
    mk.add_argument("--shape", default="tiny", choices=["tiny", "tiny-multilingual", "mmbert-base", "modernbert-large"])
    mk.add_argument("--out", required=True)
    mk.add_argument("--seed", type=int, default=0)
    mk.set_defaults(fn=_cmd_make_checkpoint)

    pr = sub.add_parser("predict", help="answer questions about one state and print the answer JSON")
    pr.add_argument("--checkpoint", required=True)
    pr.add_argument("--state", required=True, help="the state text, or @FILE to read it")
    pr.add_argument("--json-state", action="store_true", help="parse the state as JSON (dict or list)")
    pr.add_argument("--questions", required=True, help="a JSON file: {id: question}")
    pr.add_argument("--device", default=None)
    pr.add_argument("--backend", default="auto")
    pr.add_argument("--pretty", action="store_true")
    pr.set_defaults(fn=_cmd_predict)

    ao = sub.add_parser("aot", help="export and package the model with AOTInductor")
    ao.add_argument("--checkpoint", required=True)
    ao.add_argument("--cache-dir", default=None)
    ao.add_argument("--device", default="cuda")
    ao.set_defaults(fn=_cmd_aot)

    pc = sub.add_parser("precompile", help="build the fast backend's TileLang kernels into the kernel cache (no GPU "
                                           "needed; sm_90a by default)")
    pc.add_argument("--shapes", nargs="*", default=["tiny", "modernbert-large"])
    pc.add_argument("--tests", action="store_true", help="also the kernels of tests/test_kernels.py (a checkout)")
    pc.add_argument("--sweep", action="store_true", help="also bench/fast_path.py's sweep candidates (a checkout)")
    pc.add_argument("--workers", type=int, default=None)
    pc.add_argument("--fp16", action="store_true", help="also the shapes' fp16 kernels (act_dtype=torch.float16)")
    pc.add_argument("--fp8", action="store_true",
                    help="also the shapes' FP8-precision kernels (LAYA_FLEET_CUDA_AMP=fp8)")
    pc.add_argument("--ln-fold-m", type=_fold_m, default=0, metavar="M",
                    help="also the shapes' kernels with the tuning table's ln_fold_m at M: add+LayerNorm folded into "
                         "the GEMMs from M tokens up (bench/fast_path.py's fold engines: 1024)")
    pc.add_argument("--arch", default=None,
                    help="TileLang target (default $LAYA_FLEET_TL_ARCH, else the visible GPU's, else sm_90a)")
    pc.add_argument("--pack", metavar="FILE.tar.xz", default=None,
                    help="then pack the node-local TileLang cache into FILE (what bench/gpu_env.sh unpacks into "
                         "$LAYA_FLEET_LOCAL_CACHE_DIR on a GPU host, so it compiles nothing)")
    pc.set_defaults(fn=_cmd_precompile)

    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
