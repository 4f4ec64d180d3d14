"""What a job measures and reports from inside its ranks: a worker's step records (`step_metrics`), the step
timeline (`timeline`), bytes on the wire (`traffic`) and `gradsync.log` (`scalars`, `tensorboard`)."""
