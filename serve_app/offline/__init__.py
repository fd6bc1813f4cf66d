"""Offline scoring: Parquet in, Parquet out, through Ray Data and a pool of the same scorer actors as Serve.

    python -m serve_app.offline --input 'data/*.parquet' --output out/ --questions q.json \\
        --state-column text --id-column id --checkpoint ckpt/

`config` (the typed job config the flags map onto), one module per stage (`tokenize`, `score`, `decode`,
`write`), `io` (inputs, the output directory, markers, atomic writes), `driver` (the pipeline and the run),
`summary`, `cli`. Outputs are one Parquet file per input file; a re-run skips files already done.
See docs/offline.md.
"""

from . import _clock  # noqa: F401 - first, before the modules that import torch (see _clock)
from .cli import main, parser
from .config import JobSpec, OfflineConfig
from .driver import prepare_job, run
from .io import ConfigError
from .summary import format_summary

__all__ = ["ConfigError", "JobSpec", "OfflineConfig", "format_summary", "main", "parser", "prepare_job", "run"]
