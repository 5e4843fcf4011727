"""Checkpoints, all in one place: the directories on disk (`disk`: naming, atomic commit,
verification, retention), what a job resumes from (`resume`), reading only data (`safe`), the
one full, name-keyed form every layout converts to and from (`portable`), and `fw export`
(`export`). Importing this package imports no torch."""
