"""Shared benchmark plumbing: corpus generation, cold caches, timed child processes with
peak RSS, and the table every bench script prints."""

from __future__ import annotations

import contextlib
import errno
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[0] = str(REPO)  # the repo, not bench/, where shuffle.py would hide the shuffle package


def parse_size(text: str) -> int:
    """A byte size, as --memory takes it (tokpack.formats.units)."""
    from tokpack.formats.units import byte_size

    return byte_size(text)


def can_drop_caches() -> bool:
    return os.geteuid() == 0 and os.path.exists("/proc/sys/vm/drop_caches")


def drop_caches() -> bool:
    """Flush dirty pages and drop the page cache, so the next read comes from the disk."""
    os.sync()
    if not can_drop_caches():
        return False
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


@dataclass
class Measure:
    seconds: float  # wall time
    peak_rss_mb: float  # of the child process tree's largest process
    returncode: int


_CACHE_CGROUP: str | None = None  # cgroup.procs of the memory cgroup every timed command joins, if capped
PROCESS_ALLOWANCE = 160 << 20  # a tokpack process beyond --memory (interpreter, numpy, datatrove, buffers)


def cap_page_cache(limit: int) -> str:
    """From now on every command run_measured times runs in one memory cgroup limited to
    `limit` bytes, page cache included, so data larger than the limit must come from the disk
    and go back to it (the kernel evicts the cgroup's own pages). cgroup v2 (`memory.max`) or
    v1 (`memory.limit_in_bytes`); needs root. Returns what it set up, or raises RuntimeError
    saying why it cannot."""
    global _CACHE_CGROUP
    import atexit

    v2 = Path("/sys/fs/cgroup/cgroup.controllers")
    if v2.exists() and "memory" in v2.read_text().split():
        folder, knob = Path(f"/sys/fs/cgroup/tokpack-bench-{os.getpid()}"), "memory.max"
    elif Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists():
        folder, knob = Path(f"/sys/fs/cgroup/memory/tokpack-bench-{os.getpid()}"), "memory.limit_in_bytes"
    else:
        raise RuntimeError(
            "no memory cgroup controller here (neither cgroup v2 memory.max nor v1 memory.limit_in_bytes)"
        )
    try:
        folder.mkdir(exist_ok=True)
        (folder / knob).write_text(str(int(limit)))
    except OSError as e:
        raise RuntimeError(f"cannot create a memory cgroup at {folder} ({e.strerror}); run as root") from None
    atexit.register(lambda: folder.rmdir() if folder.exists() else None)
    _CACHE_CGROUP = str(folder / "cgroup.procs")
    return f"page cache and memory of each timed command capped at {limit / 2**20:,.0f} MiB ({folder}/{knob})"


def run_measured(
    cmd: list[str] | str, env: dict | None = None, cwd: str | None = None, cold: bool = True, check: bool = True
) -> Measure:
    """Runs a command in a child process, after dropping caches (in the capped cgroup once
    cap_page_cache has run); wall time and peak RSS."""
    for _ in range(2):
        m, err = _run_measured_once(cmd, env, cwd, cold)
        # Open MPI's launcher sometimes fails to start at all (no tokpack process ran): that run
        # measures nothing, so it is launched again, at most twice, as the suite's MPI tests do
        if not (m.returncode == LAUNCHER_EXIT and LAUNCHER_FAILED in err):
            break
    else:
        m, err = _run_measured_once(cmd, env, cwd, cold)
    if check and m.returncode != 0:
        raise RuntimeError(f"{cmd!r} failed with {m.returncode}:\n{err[-3000:]}")
    return m


# Open MPI's exit status and stderr when its launcher did not start (tests/conftest.py's twin)
LAUNCHER_EXIT = 213
LAUNCHER_FAILED = "PMIx server's listener thread failed to start"


def _run_measured_once(cmd: list[str] | str, env: dict | None, cwd: str | None, cold: bool) -> tuple[Measure, str]:
    if cold:
        drop_caches()
    argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
    t0 = time.perf_counter()
    # Linux carries a process's RSS high-water mark across fork+exec, so a command forked
    # straight from this (large) interpreter would report at least our RSS. A tiny launcher
    # forks the command instead and reports the grandchild's own peak on fd 3.
    rfd, wfd = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-S", "-c", _LAUNCHER, str(wfd), _CACHE_CGROUP or "-", *argv],
        env={**os.environ, **(env or {})},
        cwd=cwd,
        pass_fds=(wfd,),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    os.close(wfd)
    err = proc.stderr.read().decode(errors="replace")
    proc.wait()
    seconds = time.perf_counter() - t0
    with os.fdopen(rfd) as r:
        code, maxrss_kb = (int(x) for x in (r.read().split() or ["-1", "0"]))
    return Measure(seconds, maxrss_kb / 1024, code), err


_LAUNCHER = """
import os, sys
fd, cgroup, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
pid = os.fork()
if pid == 0:
    os.close(fd)
    if cgroup != "-":
        with open(cgroup, "w") as f:
            f.write(str(os.getpid()))
    os.execvp(argv[0], argv)
_, status, usage = os.wait4(pid, 0)
os.write(fd, f"{os.waitstatus_to_exitcode(status)} {usage.ru_maxrss}".encode())
"""


def python_cmd(code: str) -> list[str]:
    """A fresh interpreter running `code` with the repo importable."""
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(REPO)!r})\n{code}"]


def cp_sync(src: Path, dst: Path) -> Measure:
    if dst.exists():
        shutil.rmtree(dst)
    return run_measured(f"cp -r '{src}' '{dst}' && sync")


def cp_twice_sync(src: Path, middle: Path, dst: Path) -> Measure:
    """Two reads and two writes of the data, each write synced before the next read: the
    physical floor of a two-pass shuffle (scatter, then order) on this disk."""
    for d in (middle, dst):
        if d.exists():
            shutil.rmtree(d)
    m = run_measured(f"cp -r '{src}' '{middle}' && sync && cp -r '{middle}' '{dst}' && sync")
    shutil.rmtree(middle, ignore_errors=True)
    return m


def cold_read(path: Path) -> Measure:
    """A sequential read of every file under `path`, cache dropped first."""
    return run_measured(f"find '{path}' -type f -print0 | xargs -0 cat > /dev/null")


def median_of(fn, runs: int = 3) -> Measure:
    results = [fn() for _ in range(runs)]
    return Measure(statistics.median(r.seconds for r in results), max(r.peak_rss_mb for r in results), 0)


def alternate(cases: list[tuple[str, object]], runs: int) -> dict[str, list[Measure]]:
    """Runs every case once per round, in a random order, for `runs` rounds. `cases`: (name, a
    callable returning a Measure). On these VMs the same cold read swings 2x within minutes;
    cases run side by side in a round see the same disk, so per-round ratios are far steadier
    than ratios of medians taken minutes apart."""
    results: dict[str, list[Measure]] = {name: [] for name, _ in cases}
    rng = np.random.default_rng(0)
    for _ in range(runs):
        # A new order every round (seeded, so a rerun repeats it): back-to-back cold reads here
        # alternate fast and slow, and a fixed or rotated order keeps neighbours in opposite states.
        for k in rng.permutation(len(cases)):
            name, fn = cases[k]
            results[name].append(fn())
    return results


def paired_ratio(case: list[Measure], baseline: list[Measure]) -> tuple[float, float, float]:
    """(median, lowest, highest) over rounds of case time / baseline time in the same round."""
    ratios = sorted(c.seconds / b.seconds for c, b in zip(case, baseline))
    return statistics.median(ratios), ratios[0], ratios[-1]


def ratio_range(lo: float, hi: float) -> str:
    return f"{lo:.2f}-{hi:.2f}"


def dir_bytes(path: Path, suffix: str = "") -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file() and p.name.endswith(suffix))


def make_datatrove_corpus(
    out: Path,
    total_bytes: int,
    token_size: int = 2,
    files: int = 4,
    mean_doc: int = 1200,
    seed: int = 0,
    vocab_size: int | None = None,
    eos_id: int = 0,
) -> Path:
    """A datatrove-layout tokenized folder (.ds/.ds.index/.ds.metadata) of random documents,
    written in blocks so generation needs little memory. Each document ends with `eos_id` (0),
    not the EOS of the tokenizer its metadata names (gpt2's 50256): pack it with `--eos-id 0`,
    or pack refuses it as documents never separated by their EOS."""
    out.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype("<u2") if token_size == 2 else np.dtype("<u4")
    vocab_size = vocab_size or (50257 if token_size == 2 else 128256)
    rng = np.random.default_rng(seed)
    per_file = total_bytes // token_size // files
    block = 8 << 20
    for fi in range(files):
        name = f"{fi:05d}_00000_doc_shuffled.ds"
        ends, written = [], 0
        with open(out / name, "wb") as f:
            while written < per_file:
                n = min(block, per_file - written)
                toks = rng.integers(1, vocab_size, size=n, dtype=np.int64).astype(dtype)
                lens = rng.geometric(1 / mean_doc, size=n // 8 + 16)
                cuts = np.cumsum(lens)
                cuts = cuts[cuts < n]
                toks[cuts - 1] = eos_id
                toks[-1] = eos_id
                ends.append(cuts + written)
                ends.append(np.array([written + n]))
                f.write(toks.tobytes())
                written += n
        all_ends = np.unique(np.concatenate(ends)).astype("<u8")
        all_ends.tofile(out / f"{name}.index")
        tokenizer = "gpt2" if token_size == 2 else "llama3"  # a 4-byte vocabulary is not gpt2's
        (out / f"{name}.metadata").write_text(f"{tokenizer}|{token_size}\n{written}\n{written / 1e9:.1f}GT")
    return out


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, Python {platform.python_version()}, {time.strftime('%Y-%m-%d')}"


def print_table(title: str, rows: list[dict], columns: list[str]) -> str:
    """A Markdown table, printed and returned (so callers can paste it into BENCHMARKS.md)."""

    def fmt(v):
        if isinstance(v, float):
            return f"{v:,.2f}"
        return "" if v is None else str(v)

    widths = [max(len(c), *(len(fmt(r.get(c))) for r in rows)) for c in columns]
    lines = [
        f"### {title}",
        "",
        "| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths)) + " |",
        "| " + " | ".join("-" * w for w in widths) + " |",
    ]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)) + " |")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


@contextlib.contextmanager
def disk_full_is_one_line(script: str, work):
    """A benchmark's scratch disk filling up ends it with one line, not a traceback: the corpus
    and the runs it writes are the bench's own, so the fix is room or another --work."""
    try:
        yield
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        where = e.filename or work or "the scratch folder"
        sys.exit(
            f"{script}: no space left on the device of {where}; expected room for the corpus and its runs, "
            f"found the disk full (hint: free space there, or pass --work on a larger disk, or a smaller --size)"
        )
