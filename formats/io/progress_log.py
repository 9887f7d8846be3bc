"""Progress (`progress`): a bar on a terminal, a line every 30 s (`--log-interval`) in a log, each
naming the phase that runs. One environment variable governs it, $TOKPACK_PROGRESS (progress_mode)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import weakref

from .. import units

# How a process shows progress: unset (or "on"), a tqdm bar on a terminal and one line every 30 s
# in a log (stderr not a terminal: sbatch, nohup, CI); SECONDS, lines that often; "off" or 0,
# nothing; "bar", a bar wherever stderr goes; "log", lines even on a terminal. `--log-interval`
# sets it for a command and the worker processes it starts, through this variable (its one home).
PROGRESS_ENV = "TOKPACK_PROGRESS"
OLD_INTERVAL_ENV = "TOKPACK_LOG_INTERVAL"  # its former spelling (lines in a log), read with a warning
DEFAULT_LOG_INTERVAL = 30.0
MODES = ("on", "off", "bar", "log")
_warned_old = False


def progress_mode() -> tuple[str, float]:
    """($TOKPACK_PROGRESS's mode, seconds between two lines in a log): ("on", 30) unset; ("on", S)
    for a number S > 0; ("off", 0) for off or 0; ("bar", 30), ("log", 30). Anything else is one
    line naming the variable and its text ($TOKPACK_LOG_INTERVAL, its former spelling, is read
    when it is unset, with a warning)."""
    text = os.environ.get(PROGRESS_ENV)
    if text is not None or os.environ.get(OLD_INTERVAL_ENV) is None:
        return _parsed(text, PROGRESS_ENV)
    global _warned_old
    text = os.environ[OLD_INTERVAL_ENV]
    if not _warned_old:  # once a process
        _warned_old = True
        sys.stderr.write(
            f"tokpack: warning: ${OLD_INTERVAL_ENV} is deprecated; use {PROGRESS_ENV}=SECONDS (or off, bar, log)\n"
        )
    mode = _parsed(text, OLD_INTERVAL_ENV)
    if text.strip():  # the worker processes read the new variable (a bad value stays the old one's)
        os.environ.setdefault(PROGRESS_ENV, text.strip())
    return mode


def _parsed(text: str | None, name: str) -> tuple[str, float]:
    word = (text or "").strip().lower()
    if word in ("", "on"):
        return "on", DEFAULT_LOG_INTERVAL
    if word in MODES:
        return word, 0.0 if word == "off" else DEFAULT_LOG_INTERVAL
    seconds = units.seconds(
        text,
        f"${name}",
        hint=f"set {PROGRESS_ENV} to off, bar, log or a number of seconds between two lines in a log "
        f"(0: none), or unset it for a bar on a terminal and a line every {DEFAULT_LOG_INTERVAL:g} s in a log",
    )
    return ("on", seconds) if seconds > 0 else ("off", 0.0)


def log_interval() -> float:
    """Seconds between two progress lines in a log (progress_mode); 0: none."""
    return progress_mode()[1]


def progress_on() -> bool:
    """Whether this process shows progress at all ($TOKPACK_PROGRESS is not off or 0)."""
    return progress_mode()[0] != "off"


@contextlib.contextmanager
def logging_every(seconds: float | None):
    """Progress lines every `seconds` (0: no progress) inside the block, in this process and the
    worker processes it starts; None leaves the setting as it is."""
    if seconds is None:
        yield
        return
    before = os.environ.get(PROGRESS_ENV)
    os.environ[PROGRESS_ENV] = repr(float(seconds))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(PROGRESS_ENV, None)
        else:
            os.environ[PROGRESS_ENV] = before


def progress(
    total: int | None,
    desc: str,
    unit: str = "B",
    enabled: bool | None = None,
    unit_bytes: int | None = None,
    phase: bool = False,
):
    """The progress of one long step, for whoever watches it, named by `desc`: a tqdm bar on a
    terminal; in a log (stderr not a terminal) one line every log_interval() seconds (_LogBar);
    nothing when `enabled` is False (a worker process, --json) or $TOKPACK_PROGRESS is off; True:
    a bar wherever stderr goes. `unit_bytes`: the bytes one unit stands for (a shard's), so that
    a log line gives MB/s for a bar counted in units. `phase`: a step of a sequence (a shuffle's
    scatter, then its order pass): opening it ends the lines of the phases before it, which
    their owner may keep open."""
    if enabled is False:
        return _NoBar()
    mode, interval = progress_mode() if enabled is None else ("bar", 0.0)
    if mode == "off":
        return _NoBar()
    if mode == "log" or (mode == "on" and not sys.stderr.isatty()):
        return _LogBar(total, desc, unit, interval, unit_bytes, phase=phase) if interval > 0 else _NoBar()
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
        self.close()
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
        phase: bool = False,
    ):
        self.total, self.desc, self.unit, self.unit_bytes, self.clock = total, desc, unit, unit_bytes, clock
        self.phase, self.ended = phase, False  # ended: a later phase began
        self.done = 0
        self.started = clock()
        _LOG_LINES.open(self, interval)

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
            n = self.total or self.done  # MB, GB or TB (powers of 10, as README's byte sizes), whichever keeps it short
            scale, name = next(((s, u) for s, u in ((1e12, "TB"), (1e9, "GB")) if n >= 10 * s), (1e6, "MB"))
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


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    s = int(round(seconds))
    days, s = divmod(s, 86400)
    return (f"{days}d " if days else "") + f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class _LogLines:
    """The one writer of a process's progress lines: every interval, the line of the oldest open
    bar short of its total (a command's outermost step: pack's bar over all its files, not a
    file's) that no later phase ended (a shuffle's scatter bar, kept open by its pass, gives way to
    the order pass's as soon as that opens), else of the newest, so a log gets one line per
    interval however many bars are open. Bars are held weakly: one its owner dropped without
    closing it (as a tqdm bar closes when collected) writes no more lines. The writer thread never
    raises: a line that cannot be made is skipped, and a stderr that is gone ends the lines."""

    def __init__(self):
        self.lock = threading.Lock()
        self.bars: list[weakref.ref] = []
        self.stop: threading.Event | None = None

    def open(self, bar: _LogBar, interval: float) -> None:
        with self.lock:
            if bar.phase:
                for earlier in (r() for r in self.bars):
                    if earlier is not None and earlier.phase:
                        earlier.ended = True
            self.bars.append(weakref.ref(bar))
            if self.stop is None:
                self.stop = threading.Event()
                # bounded here too: Event.wait overflows past time_t (an interval parsed elsewhere)
                wait = min(max(float(interval), 0.01), units.MAX_SECONDS) if interval == interval else 30.0
                try:
                    threading.Thread(
                        target=self._write, args=(self.stop, wait), name="tokpack-progress-lines", daemon=True
                    ).start()
                except RuntimeError:  # no thread to be had (a process at its limit): no lines, the work goes on
                    pass

    def close(self, bar: _LogBar | None) -> None:
        with self.lock:
            self.bars = [r for r in self.bars if r() is not None and r() is not bar]
            if not self.bars and self.stop is not None:
                self.stop.set()
                self.stop = None

    def _write(self, stop: threading.Event, interval: float) -> None:
        while not stop.wait(interval):
            try:
                if not self._write_one():
                    return
            except Exception:  # noqa: BLE001 - a progress line is never worth a traceback: skip this one
                continue

    def _write_one(self) -> bool:
        """Writes the line of the bar to show, if any; False once stderr is gone."""
        self.close(None)  # forget the bars collected unclosed; the last one gone stops this thread
        with self.lock:
            live = [b for b in (r() for r in self.bars) if b is not None]
        bar = next((b for b in live if not b.finished and not b.ended), live[-1] if live else None)
        del live
        if bar is not None:
            line = bar.line()
            del bar  # held no longer than its line: a bar dropped unclosed is collected
            try:
                sys.stderr.write(line + "\n")
                sys.stderr.flush()
            except (OSError, ValueError):  # stderr closed (a pipe whose reader left): nothing to tell
                return False
        return True


_LOG_LINES = _LogLines()


# A forked worker has none of its parent's bars, and not its writer thread.
os.register_at_fork(after_in_child=lambda: _LOG_LINES.__init__())
