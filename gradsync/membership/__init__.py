"""Who is in the job: every rank's heartbeat and its watch (`heartbeat`), the membership keys in the store
(`member_keys`), the arrival barriers (`arrivals`), dying with the launcher (`launcher_death`), what a rank
leaves for its launcher (`rank_reports`), workers that leave an elastic job (`departures`), workers that join a
running one (`newcomers`), and workers that run out of data before the others (`uneven_data`, `trainer.join()`)."""
