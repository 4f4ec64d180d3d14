"""A rank's life: the rendezvous store, `init` (server, worker, or a worker joining a running job), the
server's main loop, bounded shutdown, job checkpoints and resume, the process settings of every rank, and the
emulated straggler of `gradsync compare --straggler` (`straggler`)."""
