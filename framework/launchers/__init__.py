"""Launcher plugins: how the worker processes of a job are started, one package per plugin.
`KINDS` lists them; what they share is in framework.launch."""

KINDS = ("local", "ray", "slurm")
