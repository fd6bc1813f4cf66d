"""The command line of the offline job: `python -m serve_app.offline ...` (flags from `OfflineConfig`'s fields)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from .config import OfflineConfig
from .driver import run
from .io import ConfigError, atomic_write_json
from .summary import format_summary

log = logging.getLogger("serve_app.offline")


def parser() -> argparse.ArgumentParser:
    """The argument parser of `python -m serve_app.offline`: one flag per `OfflineConfig` field, then CLI-only ones."""
    p = argparse.ArgumentParser(prog="python -m serve_app.offline",
                                description="Score Parquet files with a Laya checkpoint on Ray Data.")
    for f in dataclasses.fields(OfflineConfig):
        cli = dict(f.metadata["cli"])
        negative = cli.pop("negative", None)
        kw = {"help": f.metadata["help"], **cli}
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kw["required"] = True
        else:
            kw["default"] = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if negative:
            kw["dest"] = f.name
        p.add_argument("--" + f.name.replace("_", "-"), **kw)
        if negative:
            flag, doc = negative
            p.add_argument(flag, dest=f.name, action="store_false", help=doc)
    p.add_argument("--summary-json", default=None, help="also write the summary to this file")
    p.add_argument("-q", "--quiet", action="store_true", help="log warnings only")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (0 done, 2 bad arguments/inputs, 1 failure)."""
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kw = {k: v for k, v in vars(args).items() if k not in ("quiet", "summary_json")}
    cfg = OfflineConfig(**kw)
    try:
        if args.summary_json and not os.path.isdir(os.path.dirname(os.path.abspath(args.summary_json))):
            raise ConfigError("--summary-json %s: its directory does not exist" % args.summary_json)
        summary = run(cfg)
    except ConfigError as e:
        print("offline: %s" % e, file=sys.stderr)
        return 2
    except Exception as e:  # the traceback goes to the log; the last line says what failed
        log.error("the job failed", exc_info=True)
        print("offline: the job failed: %s: %s" % (type(e).__name__, (str(e).strip().splitlines() or [""])[-1]),
              file=sys.stderr)
        return 1
    print(format_summary(summary))
    if args.summary_json:
        atomic_write_json(os.path.abspath(args.summary_json), summary)
    return 0
