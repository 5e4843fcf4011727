"""What the launchers share, not a plugin family: the rendezvous where nodes and workers meet,
restarts from the newest checkpoint, elastic generations, how a start ended, signals passed on to
the workers, and the preload of fast restarts."""
