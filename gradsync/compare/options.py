"""CompareOptions: what one `gradsync compare` is asked to do, as one frozen value (the command line builds it
from its flags: `gradsync.cli.compare_options`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompareOptions:
    """The options of one comparison. Lists given are kept as tuples; `compare` checks the values (the warm-up,
    the straggler's form, the grid, the script, the report directory) before the first run."""

    script: str
    """The training script every run runs."""
    script_args: tuple[str, ...] = ()
    """The script's own arguments."""
    workers: int
    """Worker processes of every run."""
    out_dir: str
    """The report directory (one an earlier compare wrote is moved aside first: `prepare_out_dir`)."""
    strategies: tuple[str, ...]
    servers: tuple[int, ...]
    """Server counts, for ps and hybrid."""
    modes: tuple[str, ...]
    """ps modes: sync, async, ssp."""
    compressions: tuple[str, ...]
    timeout: float
    """Seconds before one run is stopped."""
    warmup: int
    """Each worker's first steps, left out of the per-step figures (at least 1)."""
    straggler: str | None = None
    """'W:F': worker W's compute takes F times as long in every run (`gradsync.runtime.straggler`)."""
    log_dir: str | None = None
    """TensorBoard scalars too, one subdirectory per run."""
    link: str | None = None
    """Every run over an emulated network of this rate (`gradsync.launcher.netem`)."""
    server_link: str | None = None
    """The parameter servers behind links of this rate instead (a slow server link)."""
    predict: bool = False
    """Fit the cost model on the sync runs, predict each paradigm up to W = 1024 and end the report with a
    verdict (`compare.predict`)."""
    force: bool = False
    """Write into a directory that compare did not write (`prepare_out_dir`)."""
    timeline: bool = False
    """Every run records each step's timeline (`gradsync.metrics.timeline`); a run's median step goes into its
    result and timeline.png."""
    copy_limit_mb: float = 500
    """The most the copy of the working directory each run starts from may hold (`workdir`)."""
    command: str
    """The command line as typed, for the report's header."""
    flag_values: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Every option's value by flag, for the report's header."""

    def __post_init__(self):
        for name in ("script_args", "strategies", "servers", "modes", "compressions"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "flag_values", dict(self.flag_values))
