"""The parts of bench/fast_path.py: shared helpers (common), inputs and engines (workloads), the kernel sweeps
(gemm_sweep, attention_sweep), the sections that run our engines (model_sections), the outside references
(references) and the table, plot and tuning proposal (report)."""
