"""The `fast` backend: the DecisionModel over packed tokens with TileLang kernels and CUDA graphs.

packing.py (buckets, staging, chunks), weights.py (the weights-only model and its device copy), graphs.py (static
buffers, CUDA graphs, warm-up), forward.py (layer body, op dispatch, kernel lists), backend.py (`FastForward`,
`FastBackend`, `make_backend`), precompile.py (`laya-fleet precompile`: kernels built ahead of time).
"""

from .backend import FastBackend, FastForward, FastStats, configure_tilelang, flops_per_token, make_backend
from .packing import gather_capacity, row_capacity, token_buckets

__all__ = ["FastBackend", "FastForward", "FastStats", "configure_tilelang", "flops_per_token", "make_backend",
           "gather_capacity", "row_capacity", "token_buckets"]
