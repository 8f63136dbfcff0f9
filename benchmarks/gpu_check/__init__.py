"""`make gpu-check` (`python -m benchmarks.gpu_check`): one command that proves ftpipe on a
GPU and writes GPU_CHECK.md and GPU_CHECK.json (docs/gpu-check.md).

- `bootstrap`: ftpipe importable from a bare checkout (the GPU machine installs nothing).
- `registry`: the parts, their budgets, failure isolation; `parts/`: one module per part.
- `sizes`: the real sizes on a GPU, tiny ones on a CPU; `packages`: compile and run in-process.
- `report`, `calibration`, `apply`: the report, the calibration it proposes, writing it.
"""
