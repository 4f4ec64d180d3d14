"""A rank's life: the rendezvous store, `init` (server, worker, or a worker joining a running job), the
server's main loop, bounded shutdown, job checkpoints and resume, and the process settings of every rank."""
