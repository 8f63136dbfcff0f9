"""The update rule: optimizers and learning-rate schedules (`optim`), the optimizer step of a
rank's stages (`stepping`), mixed precision with fp32 masters (`precision`), data
parallelism across pipeline replicas (`replicas`), the optimizer state on the host
(`offload`) or sharded across the replicas (`zero`)."""
