"""The callbacks every worker adds to its Trainer by itself, not chosen in the config: the
preemption vote, the world size of an elastic job, learning-rate scaling, and the quiet hooks."""
