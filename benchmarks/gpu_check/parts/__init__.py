"""The parts of the GPU check, one module each, registered in the order they run: what ran,
the rates a calibration needs, then the checks from the cheapest up; the child process of
cuda-marked tests last."""

# fmt: off
from . import environment, rates, fused_loss, schedules, resume, llama, offload, eager, measured, moe  # noqa: F401, I001
from . import cuda_tests  # noqa: F401, E402
