"""A launcher stopped by a signal, as a terminal or a job manager stops one: started in its own session, waited on
until its job writes a file, signalled, then the processes it started watched until they exit; on the way out
any that are left, and the launcher itself, are killed. Its ranks note their pids in files written atomically
(`pid_file_code`), so a file that exists is whole."""
from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import time

from helpers import gone, wait_until


def pid_file_code(pids_dir: pathlib.Path) -> str:
    """Python lines for a rank's script: write its pid to `pids_dir`/RANK as a temporary file renamed into place."""
    return (f"import os\n_pid_file = os.path.join({str(pids_dir)!r}, os.environ['RANK'])\n"
            "with open(_pid_file + '.tmp', 'w') as _f:\n    _f.write(str(os.getpid()))\n"
            "os.replace(_pid_file + '.tmp', _pid_file)\n")


def read_pids(pids_dir: pathlib.Path, ranks: int) -> list[int]:
    """The pids that ranks 0 .. `ranks` - 1 wrote with `pid_file_code`."""
    return [int((pids_dir / str(rank)).read_text()) for rank in range(ranks)]


class Launcher:
    """A started launcher (`process`) and the pids that must not outlive it (`watched`)."""

    def __init__(self, process: subprocess.Popen, stderr: pathlib.Path | None):
        self.process, self.stderr, self.watched = process, stderr, []

    def wait_for(self, condition, what: str, timeout: float = 60.0) -> None:
        """Wait while the launcher runs until `condition()` holds; fails saying `what` did not happen, with the
        launcher's stderr when it goes to a file."""
        try:
            wait_until(lambda: self.process.poll() is not None or condition(), what, timeout)
            assert self.process.poll() is None, f"{what}: the launcher exited with code {self.process.returncode}"
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.stderr.read_text() if self.stderr else ''}") from None

    def stop(self, sig: signal.Signals, timeout: float = 30.0) -> int:
        """Send `sig` to the launcher and wait for it to end; its exit code (-SIG when the signal killed it)."""
        self.process.send_signal(sig)
        return self.process.wait(timeout=timeout)

    def survivors(self, within: float) -> list[int]:
        """The watched pids still running `within` seconds after the call (fewer if they all end sooner)."""
        deadline = time.monotonic() + within
        while [pid for pid in self.watched if not gone(pid)] and time.monotonic() < deadline:
            time.sleep(0.1)
        return [pid for pid in self.watched if not gone(pid)]


@contextlib.contextmanager
def started(command: list[str], stderr: pathlib.Path | None = None, env: dict | None = None):
    """Yields a Launcher running `command` in a session of its own (`stderr`: a file, not a pipe, which a
    surviving rank would hold open; None: discarded); on exit kills the watched pids still running and the
    launcher."""
    with open(stderr or os.devnull, "w") as out:
        process = subprocess.Popen(command, stderr=out, start_new_session=True, env=env)
    launcher = Launcher(process, stderr)
    try:
        yield launcher
    finally:
        for pid in launcher.watched:
            if not gone(pid):
                with contextlib.suppress(ProcessLookupError):  # it ended since
                    os.kill(pid, signal.SIGKILL)
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
