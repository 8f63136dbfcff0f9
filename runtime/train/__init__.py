"""The update rule: optimizers and learning-rate schedules (`optim`), the optimizer step of a
rank's stages (`stepping`), mixed precision with fp32 masters (`precision`), and data
parallelism across pipeline replicas (`replicas`)."""
