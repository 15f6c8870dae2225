"""Loss and throughput of a training run on stderr, as it goes."""
from __future__ import annotations

import math
import sys
import time


class Progress:
    """Loss and throughput on stderr: a bar redrawn in place on a terminal ("bar"), a line every `every`
    steps otherwise ("lines"), or nothing ("off"). The loss shown is the mean over the steps since the last
    update; samples/s counts the same steps."""

    def __init__(self, total: int, batch: int, mode: str = "auto", every: int | None = None, stream=None):
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if getattr(self.stream, "isatty", lambda: False)() else "lines"
        self.mode, self.total, self.batch = mode, total, batch
        self.every = every or max(1, total // 10)
        self._losses, self._seconds, self._drawn = [], 0.0, 0.0

    def update(self, done: int, loss: float, seconds: float) -> None:
        if self.mode == "off":
            return
        self._losses.append(loss)
        self._seconds += seconds
        now = time.monotonic()
        if self.mode == "bar" and (now - self._drawn >= 0.1 or done == self.total):
            self._drawn = now
            width = 24
            filled = int(width * done / max(self.total, 1))
            left = (self.total - done) * self._seconds / len(self._losses)
            self.stream.write(f"\r{done}/{self.total} [{'#' * filled}{'.' * (width - filled)}] {self._text()}  "
                              f"ETA {int(left) // 60}:{int(left) % 60:02d}\033[K")
            self.stream.flush()
        elif self.mode == "lines" and (done % self.every == 0 or done == self.total):
            self.stream.write(f"step {done}/{self.total}  {self._text()}\n")
            self.stream.flush()
        else:
            return
        self._losses, self._seconds = [], 0.0

    def _text(self) -> str:
        rate = self.batch * len(self._losses) / self._seconds if self._seconds > 0 else math.inf
        return f"loss {sum(self._losses) / len(self._losses):.6g}  {rate:,.0f} samples/s"

    def finish(self) -> None:
        if self.mode == "bar":
            self.stream.write("\n")
            self.stream.flush()
