"""Progress (`progress`): a bar on a terminal, a line every 30 s (`--log-interval`) in a log."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import weakref


from ..errors import TokpackError


# In a log (stderr not a terminal: sbatch, nohup, CI) a long step writes one line this often, in
# seconds, while it runs; 0: none. `--log-interval` sets it for a command and the worker processes
# it starts, through this variable (its one home).
LOG_INTERVAL_ENV = "TOKPACK_LOG_INTERVAL"
DEFAULT_LOG_INTERVAL = 30.0


def log_interval() -> float:
    """Seconds between two progress lines in a log: $TOKPACK_LOG_INTERVAL, else 30; 0: none."""
    text = os.environ.get(LOG_INTERVAL_ENV, "").strip()
    if not text:
        return DEFAULT_LOG_INTERVAL
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0 or seconds == float("inf"):
        raise TokpackError(
            f"${LOG_INTERVAL_ENV} is not a number of seconds",
            expected="a number >= 0 (0: no lines)",
            found=repr(text),
            hint=f"unset it for a line every {DEFAULT_LOG_INTERVAL:g} s",
        )
    return seconds


@contextlib.contextmanager
def logging_every(seconds: float | None):
    """Progress lines every `seconds` (0: none) inside the block, in this process and the worker
    processes it starts; None leaves the interval as it is."""
    if seconds is None:
        yield
        return
    before = os.environ.get(LOG_INTERVAL_ENV)
    os.environ[LOG_INTERVAL_ENV] = repr(float(seconds))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(LOG_INTERVAL_ENV, None)
        else:
            os.environ[LOG_INTERVAL_ENV] = before


def progress(total: int | None, desc: str, unit: str = "B", enabled: bool | None = None, unit_bytes: int | None = None):
    """The progress of one long step, for whoever watches it: a tqdm bar on a terminal; in a log
    (stderr not a terminal) one line every log_interval() seconds (_LogBar); nothing when
    `enabled` is False (a worker process, --json); True: a bar wherever stderr goes.
    `unit_bytes`: the bytes one unit stands for (a shard's), so that a log line gives MB/s for a
    bar counted in units."""
    if enabled is False:
        return _NoBar()
    if enabled is None and not sys.stderr.isatty():
        interval = log_interval()
        return _LogBar(total, desc, unit, interval, unit_bytes) if interval > 0 else _NoBar()
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=True,
        unit_divisor=1024 if unit == "B" else 1000,
        leave=False,
        file=sys.stderr,
    )


class _NoBar:
    """What a disabled bar does, without importing tqdm (BENCHMARKS.md, "Figures cited by the code": tqdm import)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n: int = 1) -> None:
        pass

    close = update


class _LogBar(_NoBar):
    """A bar for a log: what it is doing, done/total, MB/s and an ETA, as one plain line (no
    carriage return: a Slurm log keeps every line), written by the process's _LogLines."""

    def __init__(
        self,
        total: int | None,
        desc: str,
        unit: str,
        interval: float,
        unit_bytes: int | None = None,
        clock=time.monotonic,
    ):
        self.total, self.desc, self.unit, self.unit_bytes, self.clock = total, desc, unit, unit_bytes, clock
        self.done = 0
        self.started = clock()
        _LOG_LINES.open(self, interval)

    def __exit__(self, *exc):
        self.close()
        return False

    def update(self, n: int = 1) -> None:
        self.done += n

    def close(self) -> None:
        _LOG_LINES.close(self)

    @property
    def finished(self) -> bool:
        return self.total is not None and self.done >= self.total

    def line(self, now: float | None = None) -> str:
        now = self.clock() if now is None else now
        elapsed = max(now - self.started, 1e-9)
        if self.unit == "B":
            scale, name = _byte_scale(self.total or self.done)
            count = (
                f"{self.done / scale:,.1f}" + ("" if self.total is None else f"/{self.total / scale:,.1f}") + f" {name}"
            )
        else:
            plural = self.unit if self.unit.endswith("s") else self.unit + "s"
            count = f"{self.done:,}" + ("" if self.total is None else f"/{self.total:,}") + f" {plural}"
        if self.total:
            count += f" ({100 * min(self.done, self.total) / self.total:.1f}%)"
        per_unit = 1 if self.unit == "B" else self.unit_bytes
        rate = (
            f"{self.done * per_unit / elapsed / 1e6:,.1f} MB/s"
            if per_unit is not None
            else f"{self.done / elapsed:,.2f} {plural}/s"
        )
        left = None if not self.total or not self.done else max(0.0, (self.total - self.done) * elapsed / self.done)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        return f"{stamp} tokpack: {self.desc}: {count}, {rate}, ETA {_duration(left)}"


def _byte_scale(n: int) -> tuple[float, str]:
    """MB, GB or TB (10^n, as the units of README's byte sizes), whichever keeps the total short."""
    for scale, name in ((1e12, "TB"), (1e9, "GB")):
        if n >= 10 * scale:
            return scale, name
    return 1e6, "MB"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    s = int(round(seconds))
    days, s = divmod(s, 86400)
    return (f"{days}d " if days else "") + f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class _LogLines:
    """The one writer of a process's progress lines: every interval, the line of the oldest open
    bar short of its total (a command's outermost step: pack's bar over all its files, not a
    file's; a finished pass's bar may stay open while the next pass runs), else of the newest, so
    a log gets one line per interval however many bars are open. Bars are held weakly: one its
    owner dropped without closing it (as a tqdm bar closes when collected) writes no more lines."""

    def __init__(self):
        self.lock = threading.Lock()
        self.bars: list[weakref.ref] = []
        self.stop: threading.Event | None = None

    def open(self, bar: _LogBar, interval: float) -> None:
        with self.lock:
            self.bars.append(weakref.ref(bar))
            if self.stop is None:
                self.stop = threading.Event()
                threading.Thread(
                    target=self._write, args=(self.stop, interval), name="tokpack-progress-lines", daemon=True
                ).start()

    def close(self, bar: _LogBar | None) -> None:
        with self.lock:
            self.bars = [r for r in self.bars if r() is not None and r() is not bar]
            if not self.bars and self.stop is not None:
                self.stop.set()
                self.stop = None

    def _write(self, stop: threading.Event, interval: float) -> None:
        while not stop.wait(interval):
            self.close(None)  # forget the bars collected unclosed; the last one gone stops this thread
            with self.lock:
                live = [b for b in (r() for r in self.bars) if b is not None]
            bar = next((b for b in live if not b.finished), live[-1] if live else None)
            del live
            if bar is not None:
                try:
                    sys.stderr.write(bar.line() + "\n")
                    sys.stderr.flush()
                except (OSError, ValueError):  # stderr closed (a pipe whose reader left): nothing to tell
                    return
                del bar  # held no longer than its line: a bar dropped unclosed is collected


_LOG_LINES = _LogLines()


# A forked worker has none of its parent's bars, and not its writer thread.
os.register_at_fork(after_in_child=lambda: _LOG_LINES.__init__())
