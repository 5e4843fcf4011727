"""Recipe: a byte-level GPT whose MLPs are mixtures of experts."""
