"""Who is in the job: heartbeats and arrivals (`liveness`), workers that leave an elastic job
(`departures`), workers that join a running one (`newcomers`), and workers that run out of data before
the others (`uneven_data`, `trainer.join()`)."""
