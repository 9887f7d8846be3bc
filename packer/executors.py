"""Glue to datatrove's executors: the stages' tasks run as `PipelineStep`s on Local, Slurm or Ray.

Parallelism is the executor's job: a step only knows `run(data, rank, world_size)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class ExecutorConfig:
    """How and where tasks run. Mirrors the CLI's executor options."""

    workers: int = 1  # concurrent tasks
    executor: str = "local"  # local | slurm | ray
    tasks: int | None = None  # override of the natural task count
    logging_dir: str | None = None  # datatrove logging dir; default inside the output's work folder
    partition: str | None = None  # slurm partition
    time_limit: str = "24:00:00"  # slurm time limit
    cpus_per_task: int = 1  # slurm
    mem_per_cpu_gb: float = 2  # slurm
    sbatch_args: str | None = None  # slurm: "key=value,key=value"
    ray_address: str | None = None  # ray: existing cluster, or None for a local one



def run_step(step, tasks: int, config: ExecutorConfig, logging_dir: str | Path, job_name: str) -> None:
    """Runs `tasks` ranks of `step` to completion. Completed ranks (datatrove's completion
    markers in `logging_dir`) are skipped, so a rerun only redoes what did not finish."""
    if config.executor == "local":
        from datatrove.executor import LocalPipelineExecutor

        executor = LocalPipelineExecutor(
            pipeline=[step],
            tasks=tasks,
            workers=min(config.workers, tasks),
            logging_dir=str(logging_dir),
            skip_completed=True,
        )
        executor.run()
        incomplete = executor.get_incomplete_ranks(skip_completed=True)
        if incomplete:
            from formats.errors import TokpackError

            raise TokpackError(
                f"{len(incomplete)} of {tasks} {job_name} tasks did not complete",
                file=logging_dir,
                where=f"ranks {incomplete[:8]}",
                hint="see the task logs in that folder; rerun the same command to redo only those tasks",
            )
        return
    raise NotImplementedError(f"executor {config.executor!r}")


def step_runner(config: ExecutorConfig):
    """The `run_step(step, tasks, job_name, logging_dir)` callable that stages below `packer`
    (e.g. shuffle) receive, so they never import the executor layer."""

    def run(step, tasks: int, job_name: str, logging_dir: str | Path) -> None:
        run_step(step, tasks, config, config.logging_dir and Path(config.logging_dir) / job_name or logging_dir, job_name)

    return run
