"""Shared parallelism machinery (not a plugin family): degrees and the one DeviceMesh they build
(`dims`), the one FSDP2 applier (`fsdp`), the one `parallelize` that applies pipeline cut, tensor
parallel, activation checkpointing / compile and FSDP in that order (`parallelize`), gradient
norms and syncs over the mesh (`gradients`), loading full states into DTensor shards
(`state`), and the per-process optimizer states of diloco and hogwild (`replicas`). Importing
this package imports no torch: each module imports it where needed.
"""
