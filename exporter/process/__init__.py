"""The worker process as every stage sees it: progress lines, Ctrl-C held to safe points, peak
memory per stage, quieted loggers, and why a signal (Slurm's, or Ctrl-C) stopped it."""
