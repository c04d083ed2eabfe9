"""Tensor- and expert-parallel engines: rank 0 in the engine's process, ranks 1..N-1 in worker processes, each
running one rank's shard of either backend (reference_backend/ or kernels_backend/).

    workers.py            TensorParallelExecutor (the StepExecutor over every rank) and the worker's main
    persistent_batch.py   the per-step delta the driver sends and the persistent batch each worker rebuilds from
"""
