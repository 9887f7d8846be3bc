"""Glue to datatrove's executors: the stages' tasks run as `PipelineStep`s on Local, Slurm or Ray
(Ray through this module's rank runners, actors that live as long as the command).

Parallelism is the executor's job: a step only knows `run(data, rank, world_size)`. Whatever the
executor, `run_steps` finishes a pass only when every rank carries datatrove's completion marker,
so the next pass (and the manifest) can rely on all outputs of this one. A rerun skips marked ranks.

Paths: the stages write local files (O_DIRECT, os.replace). `file://` URLs are local paths under
another name. An output at another fsspec URL (s3://, ...) is written to a local folder and sent
to the store shard by shard as each is committed (a BucketOutput over a tokpack.formats.io.Outbox);
shuffle's URL sources are downloaded first (`stage_in`, through fsspec's `url_to_fs`), pack's inputs
are read in place (tokpack.formats.io).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import xxhash
from loguru import logger

from tokpack.formats.errors import TokpackError, task_failed
from tokpack.formats.guard import OutputLock, holder_name, lock_holder
from tokpack.formats.io.writes import Outbox
from tokpack.formats.io.paths import RemotePath, is_url, local_path
from tokpack.formats.io.gate import open_new
from tokpack.formats.io.progress_log import progress
from tokpack.formats.outputs import BucketOutput, LocalOutput
from tokpack.formats.constants import MANIFEST
from tokpack.shuffle.sinks import app_sinks_kept

# Importing datatrove's logging module removes every loguru sink; the application's must stay.
with app_sinks_kept():
    import datatrove.utils.logging  # noqa: F401
    from datatrove.pipeline.base import PipelineStep

from tokpack.packer import lifetime
from tokpack.packer.shared import ExecutorConfig

# The folder holding packer/, shuffle/, formats/: Slurm jobs and Ray workers import the steps from here.
PROJECT_ROOT = str(Path(__file__).resolve().parent.parent)
# Slurm array elements per worker slot. An element starts a Python, datatrove and the pickled
# pass (seconds: BENCHMARKS.md, "Scale model") and then runs its run of ranks in turn, so a pass
# of many small tasks (20,490 order tasks on 48 nodes) pays that start a few times per node, not
# per task, while a slow node still holds only a quarter of its share back at the end.
SLURM_ELEMENTS_PER_WORKER = 4


def runs_in_process(config: ExecutorConfig) -> bool:
    """One local worker and no logging dir asked for: the ranks run in this process. Importing
    datatrove's executor and starting its manager costs most of a 2 GiB pack or shuffle's margin
    over `cp` (BENCHMARKS.md, "Figures cited by the code"); resume needs no completion markers
    there, since every task skips outputs its own checksummed done-files record."""
    return config.in_process and config.executor == "local" and config.workers == 1 and config.logging_dir is None


def run_steps(stages: list[tuple], config: ExecutorConfig) -> None:
    """Runs passes `(step, tasks, job_name, logging_dir)` in order, each to completion before the
    next: a pass returns only when every rank carries datatrove's completion marker in its
    logging dir, and a rerun skips marked ranks. On Slurm the passes are queued at once, chained
    with `depends=` (afterok), so the chain waits in the queue instead of in this process.
    Raises TokpackError naming the unfinished ranks if any task failed."""
    stages = [(step, tasks, job_name, str(logging_dir)) for step, tasks, job_name, logging_dir in stages if tasks >= 1]
    if runs_in_process(config):  # every rank in turn, in this process
        for step, tasks, job_name, _ in stages:
            for rank in range(tasks):
                try:
                    step.run(None, rank, tasks)
                except OSError as e:
                    raise task_failed(job_name, rank, tasks, e) from e
        return
    with lifetime.children_bound():
        if config.executor == "slurm":
            _run_executors(stages, config)
        else:
            for stage in stages:
                _run_executors([stage], config)


def _run_executors(stages: list[tuple], config: ExecutorConfig) -> None:
    runs, previous = [], None  # (executor, tasks, logging_dir, job_name); on Slurm each depends on the one before
    for step, tasks, job_name, logging_dir in stages:
        previous = _executor(step, tasks, config, logging_dir, job_name, depends=previous)
        runs.append((previous, tasks, logging_dir, job_name))
    slurm = config.executor == "slurm"
    failure = None
    try:
        if slurm:
            lifetime.slurm_submitting()
        with datatrove_logs_to_files():
            runs[-1][0].run()  # on Slurm this submits the dependencies first
        if slurm:
            for executor, *_ in runs:
                _wait_slurm(executor, config)
    except TokpackError:
        raise  # bad input found by a task: the task's own message says it best
    except KeyboardInterrupt:
        if slurm:
            for executor, *_ in runs:
                _cancel_slurm(executor)
        raise
    except Exception as e:  # a task crashed (its traceback is in the task log), or sbatch refused the job
        failure = e
    for executor, tasks, logging_dir, job_name in runs:
        _check_complete(executor, tasks, logging_dir, job_name, failure)


EXECUTORS = ("local", "slurm", "ray")  # what --executor takes: _executor's cases


def _executor(step, tasks: int, config: ExecutorConfig, logging_dir: str, job_name: str, depends=None):
    if config.executor == "ray":
        ray_connect(config)
        return RayPass(step, tasks, config, logging_dir, job_name)
    if config.executor not in EXECUTORS:
        raise TokpackError(f"unknown executor {config.executor!r}", expected=" or ".join(EXECUTORS))
    # datatrove's: the step's task logs in files only, a rerun skipping the ranks marked complete
    run = {"pipeline": [FileLoggedStep(step)], "tasks": tasks, "logging_dir": logging_dir, "skip_completed": True}
    if config.executor == "slurm":
        return _slurm_executor(run, config, job_name, depends)
    from datatrove.executor import LocalPipelineExecutor

    return LocalPipelineExecutor(**run, workers=max(1, min(config.workers, tasks)))


def pass_runner(config: ExecutorConfig):
    """The `run_passes([(step, tasks, job_name, logging_dir), ...])` callable that stages below
    `packer` (e.g. shuffle) receive, so they never import the executor layer: it runs dependent
    passes in order (see `run_steps`). A logging dir in `config` holds one subfolder per job."""

    def run_passes(passes: list[tuple]) -> None:
        if config.logging_dir:
            passes = [
                (step, tasks, job_name, join_path(config.logging_dir, job_name)) for step, tasks, job_name, _ in passes
            ]
        run_steps(passes, config)

    return run_passes


# ----------------------------------------------------------------------------------------------
# local


def _file_only_task_logger(logging_dir, rank, local_rank=0, node_rank=-1):
    """datatrove's add_task_logger minus the console sink: task logs stay in the log files
    and the command line shows only tokpack's progress and one-line errors."""
    logger.remove()
    logfile = logging_dir.open(f"logs/task_{rank:05d}.log", "w")
    logger.add(
        logfile,
        colorize=False,
        level="DEBUG",
        format="{time:YYYY-MM-DD HH:mm:ss.SSS} | {level: <8} | {name}:{function}:{line} - {message}",
    )
    logger.info(f"Launching pipeline for {rank=}")
    return logfile


def _route_datatrove_logs_to_files() -> tuple:
    import datatrove.executor.base as dt_base
    from datatrove.utils import logging as dt_logging

    original = dt_base.add_task_logger, dt_logging.setup_default_logger
    dt_base.add_task_logger = _file_only_task_logger
    dt_logging.setup_default_logger = logger.remove
    logger.remove()
    return original


class FileLoggedStep(PipelineStep):
    """Runs `step` unchanged. Unpickled in a worker process (local pool, Slurm job, Ray task),
    it first routes datatrove's task logging to the log files, before datatrove sets it up."""

    type = "tokpack"

    def __init__(self, step):
        super().__init__()
        self.step = step  # the stage's own PipelineStep
        self.name = getattr(step, "name", type(step).__name__)

    def __setstate__(self, state):
        self.__dict__.update(state)
        if os.environ.get("TOKPACK_DATATROVE_LOGS") != "1":
            _route_datatrove_logs_to_files()

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        return self.step.run(data, rank, world_size)


@contextlib.contextmanager
def datatrove_logs_to_files():
    """datatrove logs every task to stderr; under tokpack its logs go to the task log files
    only (TOKPACK_DATATROVE_LOGS=1 keeps them on stderr too, for debugging)."""
    if os.environ.get("TOKPACK_DATATROVE_LOGS") == "1":
        yield
        return
    import datatrove.executor.base as dt_base
    from datatrove.utils import logging as dt_logging

    with app_sinks_kept():  # the task-log sinks come and go; the application's stay
        original = _route_datatrove_logs_to_files()
        try:
            yield
        finally:
            dt_base.add_task_logger, dt_logging.setup_default_logger = original


def _check_complete(executor, tasks: int, logging_dir: str, job_name: str, failure: Exception | None) -> None:
    incomplete = executor.get_incomplete_ranks(range(tasks), skip_completed=True)
    if not incomplete and failure is None:
        return
    if isinstance(failure, subprocess.CalledProcessError) and failure.cmd[0] == "sbatch":
        raise TokpackError(
            f"sbatch refused the {job_name} job (exit status {failure.returncode}; its message is above)",
            file=logging_dir,
            hint="check --partition, --time, --mem and --sbatch-args",
        ) from failure
    first = f"; first error: {type(failure).__name__}: {failure}" if failure is not None else ""
    raise TokpackError(
        f"{len(incomplete)} of {tasks} {job_name} tasks did not complete{first}",
        file=logging_dir,
        where=f"ranks {incomplete[:8]}{' ...' if len(incomplete) > 8 else ''}",
        hint="the task logs are in logs/ (and slurm_logs/ on slurm) of that folder; "
        "rerun the same command to redo only the unfinished tasks",
    ) from failure


# ----------------------------------------------------------------------------------------------
# slurm


def parse_sbatch_args(text: str | None) -> dict:
    """'key=value,key=value' (or '--key=value --flag') -> {"key": "value", "flag": ""}."""
    args = {}
    for item in shlex.split((text or "").replace(",", " ")):
        key, _, value = item.lstrip("-").partition("=")
        if not key:
            raise TokpackError("empty sbatch argument", where=f"--sbatch-args {text!r}", expected="key=value,key=value")
        args[key] = value
    return args


def _slurm_command(*args: str) -> str:
    try:
        return subprocess.run(args, check=True, capture_output=True, text=True).stdout
    except FileNotFoundError:
        raise TokpackError(
            f"{args[0]} not found: --executor slurm needs the Slurm client commands",
            hint="run on a Slurm login node, or start a local cluster with scripts/slurm-local.sh",
        )
    except subprocess.CalledProcessError as e:
        raise TokpackError(
            f"{' '.join(args)} failed: {e.stderr.strip() or e.returncode}", hint="is the Slurm controller up? (sinfo)"
        )


def default_partition() -> str:
    """The partition sinfo marks with '*'; datatrove needs one by name."""
    names = _slurm_command("sinfo", "-h", "-o", "%P").split()
    if not names:
        raise TokpackError("this Slurm cluster has no partition", hint="give --partition")
    return next((name[:-1] for name in names if name.endswith("*")), names[0])


def _slurm_executor(run: dict, config: ExecutorConfig, job_name: str, depends):
    """A SlurmPipelineExecutor of `run` (_executor's common arguments)."""
    from datatrove.executor import SlurmPipelineExecutor

    sbatch = parse_sbatch_args(config.sbatch_args)
    # datatrove writes "--mem-per-cpu={n}G", which sbatch refuses for fractions: give it megabytes.
    sbatch.setdefault("mem-per-cpu", f"{max(1, round(config.mem_per_cpu_gb * 1024))}M")
    # A pass whose dependency failed would otherwise wait in the queue forever.
    sbatch.setdefault("kill-on-invalid-dep", "yes")
    # The watchdog finds this run's jobs by it, even one submitted a moment before tokpack died.
    if lifetime.slurm_comment():
        sbatch.setdefault("comment", lifetime.slurm_comment())
    qos = sbatch.pop("qos", None)  # the user's default QOS unless asked: "normal" does not exist everywhere
    # The job runs this interpreter (its venv's launch_pickled_pipeline) and imports this checkout.
    bin_dir = os.path.dirname(sys.executable)
    env = [
        f"export PATH={shlex.quote(bin_dir)}:$PATH",
        f"export PYTHONPATH={shlex.quote(PROJECT_ROOT)}${{PYTHONPATH:+:$PYTHONPATH}}",
    ]
    if os.environ.get("VIRTUAL_ENV"):
        env.append(f"export VIRTUAL_ENV={shlex.quote(os.environ['VIRTUAL_ENV'])}")
    return SlurmPipelineExecutor(
        **run,
        tasks_per_job=-(-run["tasks"] // (SLURM_ELEMENTS_PER_WORKER * config.workers)) if config.workers > 1 else 1,
        time=config.time_limit,
        partition=config.partition or default_partition(),
        cpus_per_task=config.cpus_per_task,
        mem_per_cpu_gb=config.mem_per_cpu_gb,
        workers=config.workers if config.workers > 1 else -1,
        job_name=f"tokpack-{job_name}",
        qos=qos,
        env_command="; ".join(env),
        sbatch_args=sbatch,
        depends=depends,
        requeue_signals=None,  # a requeue would race this process's wait; a rerun redoes the task
        mail_type=None,
    )


def _slurm_job_ids(executor) -> list[str]:
    job_id = executor.job_id
    return [] if job_id in (None, -1, "-1") else [str(job_id)]


# squeue's states of an array element that will not run again
SLURM_ENDED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "NODE_FAIL",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


def _slurm_active(job_ids: list[str]) -> bool:
    """Whether any array element of these jobs is still pending or running."""
    if not job_ids:
        return False
    out = subprocess.run(["squeue", "-h", "-o", "%T", "-j", ",".join(job_ids)], capture_output=True, text=True)
    if out.returncode != 0:
        # squeue forgets finished jobs after MinJobAge and then says "Invalid job id": not active.
        # Any other failure (controller busy, timeout) says nothing: keep waiting, ask again later.
        return "invalid job id" not in out.stderr.lower()
    return bool(set(out.stdout.split()) - SLURM_ENDED)


def _wait_slurm(executor, config: ExecutorConfig) -> None:
    """datatrove's SlurmPipelineExecutor only submits. Wait until every rank is marked complete,
    or the array job has left the queue (then some tasks failed: the caller reports them)."""
    job_ids = _slurm_job_ids(executor)
    for job_id in job_ids:
        lifetime.register_slurm_job(job_id)
    total, done = executor.world_size, 0
    # the jobs' tasks show nothing here: a log (nohup, a batch job) gets the pass's tasks done
    # every interval, as a pass in this process gives its own phase
    with progress(total, f"{executor.job_name.removeprefix('tokpack-')}: slurm tasks", unit="task", phase=True) as bar:
        pause = 0.5
        while (left := executor.get_incomplete_ranks(skip_completed=True)) and _slurm_active(job_ids):
            bar.update(total - len(left) - done)
            done = total - len(left)
            time.sleep(pause)
            pause = min(pause * 1.5, config.poll_seconds)
        bar.update(total - len(left) - done)
    # Markers are written by the tasks; the queue may still hold the finishing job for a moment.
    while _slurm_active(job_ids):
        time.sleep(0.5)
    for job_id in job_ids:
        lifetime.forget_slurm_job(job_id)


def _cancel_slurm(executor) -> None:
    job_ids = _slurm_job_ids(executor)
    if job_ids:
        subprocess.run(["scancel", *job_ids], capture_output=True)
        print(f"tokpack: cancelled slurm job {', '.join(job_ids)}", file=sys.stderr)


# ----------------------------------------------------------------------------------------------
# ray


def ray_connect(config: ExecutorConfig) -> None:
    """Joins the cluster at `--ray-address`, or starts a local one (one CPU per core, or
    `--workers`) that lives as long as this process. An already initialised Ray is reused."""
    try:
        import ray
    except ImportError:
        raise TokpackError("--executor ray needs ray", hint="pip install 'ray[default]'")
    if ray.is_initialized():
        return
    with lifetime.children_bound():  # a local cluster's processes carry the marker: they end with tokpack
        # Workers import the steps from this checkout even when tokpack is not installed on their path.
        pythonpath = os.pathsep.join(p for p in (PROJECT_ROOT, os.environ.get("PYTHONPATH")) if p)
        runtime_env = {"env_vars": {"PYTHONPATH": pythonpath}}
        if config.ray_address:
            try:
                _gcs_answers(config.ray_address)
                ray.init(address=config.ray_address, runtime_env=runtime_env, log_to_driver=False)
            except ConnectionError as e:
                raise TokpackError(
                    f"cannot connect to the Ray cluster: {e}",
                    where="--ray-address",
                    hint="is the head node up (ray status)? With token authentication (Ray >= 2.59 "
                    "default), export the cluster's RAY_AUTH_TOKEN (ray get-auth-token)",
                ) from None
        else:
            num_cpus = config.workers if config.workers > 1 else os.cpu_count()
            # "local": a cluster of its own, as documented, even where $RAY_ADDRESS names another
            # (ray.init would join that one and refuse num_cpus)
            ray.init(
                address="local",
                num_cpus=num_cpus,
                include_dashboard=False,
                runtime_env=runtime_env,
                log_to_driver=False,
            )


RAY_PROBE_SECONDS = 10.0


def _gcs_answers(address: str) -> None:
    """A ConnectionError when nothing accepts a TCP connection at a HOST:PORT address (a head's
    GCS): ray.init retries such an address for ever, deaf to SIGTERM while it does. Ray Client's
    ray:// has its own timeout; "auto" and "local" name no port."""
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_PROBE_SECONDS).close()
    except OSError as e:
        raise ConnectionError(f"nothing answers at {address} ({e.strerror or e})") from None


# Ray calls per worker slot in a pass: contiguous runs of ranks, so a slow rank holds back a
# quarter of a slot's share at most, as on Slurm (SLURM_ELEMENTS_PER_WORKER).
RAY_CALLS_PER_WORKER = 4
_ray_pool: tuple | None = None  # (key, actors): the rank runners every pass of this process reuses


class RankRunner:
    """A Ray actor that runs ranks of a pass in turn, in one long-lived worker process.
    datatrove's RayPipelineExecutor starts a new actor in a new placement group for every task
    (a fresh Python importing datatrove and the pass: seconds a task, BENCHMARKS.md "Ray");
    these start once per command and serve every pass."""

    def run(self, step, ranks: list[int], tasks: int, logging_dir: str, job_name: str) -> list[tuple[int, Exception]]:
        """Runs each rank of `ranks` not marked complete in `logging_dir`, writing datatrove's
        task log and completion marker; the failures, as (rank, exception), for the caller."""
        from datatrove.io import get_datafolder
        from datatrove.utils.logging import close_task_logger

        folder = get_datafolder(logging_dir)
        failures = []
        for rank in ranks:
            if folder.isfile(f"completions/{rank:05d}"):
                continue
            logfile = _file_only_task_logger(folder, rank)
            try:
                step.run(None, rank, tasks)
            except Exception as e:  # reported by the caller, with the ranks left unfinished
                logger.exception(e)
                failures.append((rank, task_failed(job_name, rank, tasks, e) if isinstance(e, OSError) else e))
                continue
            finally:
                close_task_logger(logfile)
            with folder.open(f"completions/{rank:05d}", "w") as marker:
                marker.write(str(os.getpid()))  # which runner ran it (datatrove's markers are empty)
        return failures


def _ray_runners(config: ExecutorConfig) -> list:
    """The rank runners of this process: one per worker slot (`--workers`, else as many as the
    cluster's CPUs hold), created at the first pass and reused; new ones if the cluster or the
    reservation changed (the old ones are ended first: they hold the cluster's CPUs)."""
    import ray

    global _ray_pool
    options = {
        "num_cpus": config.cpus_per_task,
        "memory": int(config.mem_per_cpu_gb * config.cpus_per_task * (1 << 30)),
    }
    held = ray.cluster_resources()
    # No more runners than the cluster can start at once: a runner left waiting for resources
    # would hold the runs handed to it until the end of the command.
    fit = int(
        min(
            held.get("CPU", 1) // max(options["num_cpus"], 1e-9),
            held.get("memory", float("inf")) // max(options["memory"], 1),
        )
    )
    if fit < 1:
        raise TokpackError(
            "the Ray cluster cannot start one task",
            where="--cpus-per-task, --mem",
            expected=f"{options['num_cpus']} CPUs and {options['memory'] / 2**30:g} GiB a task",
            found=f"{held.get('CPU', 0):g} CPUs and {held.get('memory', 0) / 2**30:.1f} GiB in the cluster",
            hint="lower --mem or --cpus-per-task, or use a larger cluster",
        )
    slots = min(config.workers, fit) if config.workers > 1 else fit
    key = (ray.get_runtime_context().get_job_id(), slots, tuple(sorted(options.items())))
    if _ray_pool is not None and _ray_pool[0] == key:
        return _ray_pool[1]
    _end_ray_runners()
    actors = [ray.remote(RankRunner).options(**options).remote() for _ in range(slots)]
    _ray_pool = (key, actors)
    return actors


def _end_ray_runners() -> None:
    global _ray_pool
    if _ray_pool is not None:
        import ray

        for actor in _ray_pool[1]:
            with contextlib.suppress(Exception):  # the cluster may be gone already
                ray.kill(actor)
        _ray_pool = None


def rank_runs(ranks: list[int], slots: int) -> list[list[int]]:
    """`ranks` cut into contiguous runs, about RAY_CALLS_PER_WORKER a slot; each rank in one run."""
    size = max(1, -(-len(ranks) // (RAY_CALLS_PER_WORKER * slots)))
    return [ranks[i : i + size] for i in range(0, len(ranks), size)]


class RayPass:
    """One pass on Ray: its unfinished ranks in contiguous runs, handed to the process's rank
    runners as each becomes free. Completion markers as datatrove's executors write them."""

    def __init__(self, step, tasks: int, config: ExecutorConfig, logging_dir: str, job_name: str):
        from datatrove.io import get_datafolder

        self.step, self.tasks, self.config, self.logging_dir, self.job_name = step, tasks, config, logging_dir, job_name
        self.folder = get_datafolder(logging_dir)

    def get_incomplete_ranks(self, ranks=None, skip_completed: bool = True) -> list[int]:
        return [
            r for r in (range(self.tasks) if ranks is None else ranks) if not self.folder.isfile(f"completions/{r:05d}")
        ]

    def run(self) -> None:
        import ray
        from ray.util import ActorPool

        todo = self.get_incomplete_ranks()
        if not todo:
            return
        runners = _ray_runners(self.config)
        runs = rank_runs(todo, len(runners))
        step = ray.put(self.step)
        failures = []
        try:
            for failed in ActorPool(runners).map_unordered(
                lambda actor, ranks: actor.run.remote(step, ranks, self.tasks, self.logging_dir, self.job_name), runs
            ):
                failures += failed
        except ray.exceptions.RayError:  # a runner died (killed, out of memory): the next pass starts new ones
            _end_ray_runners()
            raise
        bad_input = [e for _, e in failures if isinstance(e, TokpackError)]
        if bad_input:
            raise bad_input[0]  # the task's own message says it best
        if failures:
            rank, e = failures[0]
            raise RuntimeError(f"rank {rank}: {type(e).__name__}: {e}") from e


# ----------------------------------------------------------------------------------------------
# paths: local files, file:// URLs, other fsspec URLs downloaded through fsspec (stage_in)


def join_path(base: str | Path, name: str) -> str:
    """`base/name` that keeps a URL's `scheme://`."""
    return f"{str(base).rstrip('/')}/{name}" if is_url(base) else str(Path(base) / name)


def stage_in(url: str, workdir: str | Path) -> str:
    """Copies a remote file or folder to a fresh local folder under `workdir`; returns its path."""
    where = RemotePath(url)  # a store that does not answer, or a backend not installed, is one line, not a bug
    fs, remote = where.fs, where.key
    dest = Path(tempfile.mkdtemp(prefix="in-", dir=workdir)) / (Path(remote.rstrip("/")).name or "data")
    if not where.call("exists"):
        raise TokpackError("no such directory", file=url, hint="check the path or URL")  # a local source's line
    if where.call("isdir"):
        from datatrove.io import get_datafolder

        folder = get_datafolder(url)
        for rel in folder.list_files(recursive=True):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            _download(folder.open(rel, "rb"), dest / rel)
    else:
        _download(fs.open(remote, "rb"), dest)
    return str(dest)


def _download(remote, target: Path) -> None:
    with remote as src, open_new(target) as out:
        shutil.copyfileobj(src, out, 1 << 22)


DOWNLOADS_PREFIX = "tokpack-stage-"  # SCRATCH/tokpack-stage-RANDOM: one command's copy of its URL sources


def sweep_killed_downloads(scratch: str) -> None:
    """Removes the download folders under `scratch` of commands on this host that are gone (their
    lock's holder dead: killed before their own cleanup); each rerun of a killed command made a
    new one, a full copy of its sources. A live holder's folder, one on another host (it cannot
    be checked from here) and one with no lock (not made by this version) are left alone."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(scratch):
            if not entry.name.startswith(DOWNLOADS_PREFIX) or not entry.is_dir(follow_symlinks=False):
                continue
            holder = lock_holder(entry.path)
            if holder is not None and not holder[1]:
                print(f"tokpack: removing {entry.path}, the downloads of a command that is gone", file=sys.stderr)
                shutil.rmtree(entry.path, ignore_errors=True)


@contextlib.contextmanager
def local_paths(
    inputs: list[str], output: str, scratch=None, config: ExecutorConfig | None = None, command: str = "shuffle"
):
    """Yields (inputs, output folder, Output): local paths, `file://` URLs made paths, and the
    tokpack.formats.outputs Output the command writes through. Other fsspec URLs: inputs are downloaded
    to a temporary folder; an output is written to a local folder named after the URL under
    `scratch` (a path; default: TOKPACK_STAGE_DIR, else the system temp dir) and goes to the store file
    by file (a BucketOutput over a tokpack.formats.io.Outbox; a LocalOutput for a local output). That
    folder is locked (for `command`) before the store's state is fetched into it, kept when the
    command fails, for its rerun, and removed when it succeeds. `config`: how the tasks run (in
    this process, by default: the tasks send the shards)."""
    scratch = str(scratch or os.environ.get("TOKPACK_STAGE_DIR") or tempfile.gettempdir())
    downloads = None
    try:
        with contextlib.ExitStack() as held:
            if any(local_path(p) is None for p in inputs):
                os.makedirs(scratch, exist_ok=True)  # as the output's folder under it is made
                sweep_killed_downloads(scratch)
                downloads = tempfile.mkdtemp(prefix=DOWNLOADS_PREFIX, dir=scratch)
                # its holder named in it: a command killed before its `finally` (SIGKILL, OOM) leaves
                # a whole copy of its sources, which the next command under this scratch removes
                held.enter_context(OutputLock(downloads, holder_name(command)))
            local_inputs = [local_path(p) or stage_in(p, downloads) for p in inputs]
            # an error names a downloaded source, or the output's local folder, by the URL given
            urls = {here: p for here, p in zip(local_inputs, inputs) if local_path(p) is None}
            outbox = None
            local_output = local_path(output)
            if local_output is None:
                name = f"tokpack-out-{xxhash.xxh3_64_hexdigest(output.rstrip('/').encode())}"
                local_output = os.path.join(scratch, name)
                outbox = Outbox(local_output, output)
                if not runs_in_process(config or ExecutorConfig()) and outbox.in_one_process():
                    raise TokpackError(
                        "this store keeps its objects inside one process",
                        file=output,
                        expected="tasks that run in this process",
                        found="tasks in other processes",
                        hint="use --workers 1, or a store every process reaches (s3://..., a path)",
                    )
                outbox.check_bucket()
                urls[outbox.local] = outbox.remote
                held.enter_context(OutputLock(local_output, holder_name(command)))
                outbox.fetch_state(MANIFEST)
            try:
                yield local_inputs, local_output, LocalOutput() if outbox is None else BucketOutput(outbox)
            except TokpackError as e:
                here = next((h for h in urls if e.file and (e.file + "/").startswith(h + "/")), None)
                if here is not None:
                    e.file = urls[here] + e.file[len(here) :]  # the user's name for it, not ours
                raise
        if outbox is not None:
            shutil.rmtree(local_output, ignore_errors=True)
    finally:
        if downloads:
            shutil.rmtree(downloads, ignore_errors=True)
