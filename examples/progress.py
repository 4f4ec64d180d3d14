"""A one-line progress bar on stderr, shown only when stderr is a terminal."""
import sys
import time


class Progress:
    def __init__(self, total: int, label: str, enabled: bool = True):
        self.total, self.label, self.count = total, label, 0
        self.enabled = enabled and sys.stderr.isatty()
        self.start = time.monotonic()

    def update(self, note: str = "") -> None:
        self.count += 1
        if not self.enabled:
            return
        done = int(30 * self.count / self.total)
        rate = self.count / max(time.monotonic() - self.start, 1e-9)
        sys.stderr.write(f"\r{self.label} [{'#' * done}{'.' * (30 - done)}] {self.count}/{self.total} "
                         f"{rate:.0f} it/s {note}")
        if self.count == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()
