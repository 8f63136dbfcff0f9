"""One torchrun job on this rank: the package's command line (`cli`, `options`), where the rank
runs and how ranks meet (`ranks`, `device`), whether its peers live (`liveness`), the run in
phases (`train`, `prepare`), what it reports and writes at the end (`report`, `runlog`,
`summary`), a package's `--check` (`check`), and the process settings for CPU memory
(`cpu_allocator`)."""
