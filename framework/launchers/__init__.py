"""Launcher plugins: how the worker processes of a job are started."""
