"""Process plumbing shared by both commands: worker pools, BLAS threads, memory, watchdog."""
