"""Logger plugins: each builds a lightning Logger for the run directory."""
