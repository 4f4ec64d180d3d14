"""Spawning a job on this machine (`gradsync run`, `gradsync.launch`, `gradsync compare`): the ranks, their
supervision and run directories, the emulated network behind `--link`, and what a killed launcher left."""
