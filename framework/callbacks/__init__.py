"""Callback plugins: each builds one lightning Callback; entries are named in `callbacks.*`."""
