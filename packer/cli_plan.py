"""`tokpack plan pack|shuffle|stage`: every argument and option of the command planned, plus the
machines' speeds; prints what the command would do (tokpack.packer.planning), writing no output."""

from __future__ import annotations

import click

from tokpack.packer.cli_options import MAX_RANKS, Int, Real, executor_config, weighted_sources
from tokpack.packer.cli_report import emit, user_errors
from tokpack.packer.cli_runs import stage, stage_options
from tokpack.packer.cli_write import pack, print_warnings, shuffle


@click.group()
def plan():
    """Print what pack, shuffle or stage would do, writing no output: tasks, files, bytes, free space,
    manifest sizes and a predicted wall time (from a disk probe of up to 256 MiB, written and
    removed, unless --disk-mbps gives the disk's speed).

    \b
    Example:
      tokpack plan shuffle --schedule run.yaml -o /data/runs/r1 --memory 16GiB --workers 4
      tokpack plan pack data.parquet -o packed --eos-id 0 --vocab-size 50304 --disk-mbps 500
    """


DISK_MBPS = click.Option(
    ["--disk-mbps"],
    type=Real(0, 1e9),
    help="Disk throughput in MB/s for the predicted time [default: measured in about 2 s "
    "next to the output, with a temporary file removed at once].",
)


PLAN_HELP = {
    "shuffle": "A SOURCE may be virtual: virtual:tokens=11T,documents=5.5B,dtype=uint16 (a corpus not on this "
    "machine).\n\n\b\nExample:\n  tokpack plan shuffle virtual:tokens=11T,documents=5.5B,dtype=uint16 "
    "-o /data/runs/r1 \\\n      --seq-len 4096 --seed 1 --epochs 1 --memory 64GiB --executor slurm "
    "--workers 48 --disk-mbps 2000",
    "pack": "\b\nExample:\n  tokpack plan pack data.parquet -o packed --eos-id 0 --vocab-size 50304",
    "stage": "\b\nExample:\n  tokpack plan stage /shared/runs/r1 /local_nvme/r1 --epochs 0-1",
}


NODES_OPTIONS = [  # plan shuffle --to-nodes: what the command learns from MPI, and the machines' speeds
    click.Option(
        ["--nodes"],
        type=Int(1, MAX_RANKS),
        help="With --to-nodes: N, the processes (nodes) mpirun would start; plan runs without MPI.",
    ),
    click.Option(
        ["--shared-mbps"],
        type=Real(0, 1e9),
        help="With --to-nodes: the shared filesystem's throughput in MB/s, all nodes together [default: "
        "measured like --disk-mbps, next to RUN, from this machine].",
    ),
    click.Option(
        ["--nic-mbps"],
        type=Real(0, 1e9),
        help="With --to-nodes: a node's network throughput in MB/s, each way [default: 25000].",
    ),
]


def _planned(command: click.Command, extra=()):
    """Registers `tokpack plan COMMAND`: every argument and option of COMMAND, plus --disk-mbps.
    Plans are of local paths (tokpack.packer.planning), so --scratch, which only a URL -o uses, changes
    nothing in a plan, as it changes nothing in the command with a local -o."""

    def register(fn):
        plan.add_command(
            click.Command(
                command.name,
                params=[*command.params, DISK_MBPS, *extra],
                callback=user_errors(fn),
                help=f"Plan `tokpack {command.name}` with the same arguments (every one it takes); writes no output "
                f"(only the disk probe's temporary file, without --disk-mbps). "
                f"Paths are local: a URL -o is refused, so --scratch, used only for one, changes nothing. "
                f"{PLAN_HELP[command.name]}",
            )
        )
        return fn

    return register


def _emit_plan(command: str, as_json: bool, *args, **kw) -> None:
    from tokpack.packer.api import plan as plan_api
    from tokpack.packer.plan_result import report_lines

    result = plan_api(command, *args, **kw)
    emit(result, as_json, report_lines)
    if not as_json:
        print_warnings(result.warnings or [])  # as shuffle gives them


@_planned(shuffle, NODES_OPTIONS)
def plan_shuffle(sources, output, epochs, epoch, as_json, **kw):
    from tokpack.packer.api import shuffle_usage

    epochs = shuffle_usage({**kw, "sources": sources, "output": output, "epochs": epochs, "epoch": epoch}, plan=True)
    sources = weighted_sources(sources) if sources else None
    _emit_plan("shuffle", as_json, sources, output, epochs=epochs, executor=executor_config(kw), **kw)


@_planned(pack)
def plan_pack(inputs, output, as_json, **kw):
    _emit_plan("pack", as_json, list(inputs), output, executor=executor_config(kw), **kw)


@_planned(stage)
def plan_stage(directory, dest, as_json, **kw):
    _emit_plan("stage", as_json, directory, dest, **stage_options(kw))
