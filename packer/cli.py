"""`tokpack` command line: a thin layer over the Python API.

Exit status: 0 success, 1 the data or the input is wrong, 2 usage error. A user error is
one line on stderr, never a traceback.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys

import click

from formats.errors import TokpackError

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
    "K": 1 << 10,
    "M": 1 << 20,
    "G": 1 << 30,
    "T": 1 << 40,
}


def parse_size(text: str | int) -> int:
    """'4GiB' -> 4294967296; IEC (KiB, MiB, GiB), SI (KB, MB, GB) and plain bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _SIZE_UNITS:
        raise click.BadParameter(f"{text!r} is not a size; use e.g. 512MiB, 4GiB, 2GB or 1048576")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])


class Size(click.ParamType):
    name = "SIZE"

    def convert(self, value, param, ctx):
        try:
            return parse_size(value)
        except click.BadParameter as e:
            self.fail(str(e.message), param, ctx)


def emit(summary: dict, as_json: bool) -> None:
    """One machine-readable object on stdout with --json; a short human summary otherwise."""
    if as_json:
        click.echo(json.dumps(summary, default=str))
    else:
        for key, value in summary.items():
            if isinstance(value, (list, dict)):
                continue
            click.echo(f"{key:>18}: {value}")


def user_errors(fn):
    """Turns TokpackError into one line on stderr and exit status 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TokpackError as e:
            if kwargs.get("as_json"):
                click.echo(json.dumps({"ok": False, "error": e.to_json()}))
            click.echo(f"tokpack: error: {e}", err=True)
            sys.exit(1)
        except ModuleNotFoundError as e:  # an optional dependency this command needs
            click.echo(f"tokpack: error: this command needs the module {e.name!r}, which is not installed. "
                       f"HINT: pip install {e.name}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("tokpack: interrupted; rerun the same command to resume", err=True)
            sys.exit(130)

    return wrapper


def executor_options(fn):
    """Where the tasks run. Local is the default; slurm and ray go through datatrove's executors.
    Also lets INPUTS/SOURCES/-o be fsspec URLs: file:// is a local path, other URLs (s3://,
    memory://, ...) are staged through a local work folder (packer.executors.with_local_paths)."""
    from packer.executors import with_local_paths

    fn = user_errors(with_local_paths(fn))  # staging errors are user errors too
    options = [
        click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Local worker processes; on slurm/ray a cap on concurrent tasks (1: no cap)."),
        click.option("--executor", type=click.Choice(["local", "slurm", "ray"]), default="local", show_default=True,
                     help="datatrove executor that runs the tasks."),
        click.option("--tasks", type=click.IntRange(min=1), default=None,
                     help="Number of tasks to split the work into (default: one per input file / output shard)."),
        click.option("--logging-dir", default=None, help="datatrove logging dir (default: inside OUT's work folder)."),
        click.option("--partition", default=None, help="slurm: partition."),
        click.option("--time", "time_limit", default="24:00:00", show_default=True, help="slurm: time limit."),
        click.option("--cpus-per-task", type=int, default=1, show_default=True, help="slurm/ray: CPUs per task."),
        click.option("--mem", "mem_per_cpu_gb", type=float, default=2, show_default=True,
                     help="slurm/ray: memory per CPU in GB."),
        click.option("--sbatch-args", default=None, help="slurm: extra sbatch arguments as 'key=value,key=value'."),
        click.option("--ray-address", default=None, help="ray: cluster address (default: start a local cluster)."),
    ]
    for opt in reversed(options):
        fn = opt(fn)
    return fn


def _executor_config(kw: dict) -> dict:
    keys = ("workers", "executor", "tasks", "logging_dir", "partition", "time_limit", "cpus_per_task",
            "mem_per_cpu_gb", "sbatch_args", "ray_address")
    return {k: kw.pop(k) for k in keys}


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="tokpack")
def main():
    """Pack tokenized corpora, shuffle them offline per epoch, validate, stage and stream them."""
    from loguru import logger

    # The command line is tokpack's own application: datatrove's messages belong in the task logs.
    logger.remove()


@main.command()
@click.argument("inputs", nargs=-1, required=True)
@click.option("-o", "--output", required=True, help="Output directory for the packed source.")
@click.option("--format", "input_format",
              type=click.Choice(["auto", "datatrove", "megatron", "parquet", "numpy", "jsonl", "text"]),
              default="auto", show_default=True, help="Input format; auto detects it and says what it found.")
@click.option("--column", default=None,
              help="Parquet/Arrow column or JSONL key holding token lists [default: input_ids]; "
                   "for --format text, the text column/key [default: text].")
@click.option("--dtype", default=None,
              help="Token dtype of raw token files (uint16, uint32, int32, ...); "
                   "inputs that record their own dtype must agree with it.")
@click.option("--tokenizer", default=None, help="Local tokenizer.json: for raw text, and to learn EOS and vocab size.")
@click.option("--eos-id", type=int, default=None, help="EOS token id (default: from the tokenizer or datatrove metadata).")
@click.option("--vocab-size", type=int, default=None, help="Vocabulary size (default: from the tokenizer or the input dtype).")
@click.option("--overwrite", is_flag=True, help="Replace an output directory that holds a different packed source.")
@click.option("--shard-tokens", type=Size(), default=str(1 << 30), show_default=True,
              help="Target tokens per output shard (documents never span shards).")
@executor_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary on stdout.")
@user_errors
def pack(inputs, output, input_format, column, dtype, tokenizer, eos_id, vocab_size, overwrite, shard_tokens,
         as_json, **kw):
    """Pack tokenized INPUTs into one packed source."""
    from packer.pack import pack as pack_api

    summary = pack_api(
        list(inputs),
        output,
        input_format=input_format,
        column=column,
        dtype=dtype,
        tokenizer=tokenizer,
        eos_id=eos_id,
        vocab_size=vocab_size,
        overwrite=overwrite,
        shard_tokens=shard_tokens,
        log=None if as_json else lambda msg: click.echo(msg, err=True),
        **_executor_config(kw),
    )
    emit(summary, as_json)


@main.command()
@click.argument("sources", nargs=-1, required=True, metavar="SOURCE[=WEIGHT]...")
@click.option("-o", "--output", required=True, help="Run directory; one epoch-NNNNN/ per epoch inside.")
@click.option("--seq-len", type=click.IntRange(min=1), required=True, help="Tokens per sample is seq_len + 1.")
@click.option("--seed", type=int, required=True, help="Shuffle seed.")
@click.option("--epochs", type=click.IntRange(min=1), default=None, help="Write epochs 0..N-1.")
@click.option("--epoch", type=click.IntRange(min=0), default=None, help="Write only epoch E (adds to an existing run).")
@click.option("--samples", type=click.IntRange(min=1), default=None, help="Samples per epoch (with weights).")
@click.option("--tokens", type=Size(), default=None, help="Trained tokens per epoch: samples = T // seq_len.")
@click.option("--shard-samples", type=click.IntRange(min=1), default=None,
              help="Samples per output shard [default: 1 GiB // ((seq_len+1) * token_size), about 1 GiB].")
@click.option("--memory", type=Size(), default="4GiB", show_default=True,
              help="Total memory budget. An epoch whose windows fit runs in memory (one read, one write); "
                   "otherwise out of core, each of --workers tasks using memory/workers.")
@click.option("--jitter", is_flag=True, help="Shift window starts by a seeded per-epoch offset.")
@executor_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary on stdout.")
@user_errors
def shuffle(sources, output, seq_len, seed, epochs, epoch, samples, tokens, shard_samples, memory, jitter,
            as_json, **kw):
    """Write globally shuffled epochs of fixed-length samples from packed SOURCEs."""
    from packer.executors import ExecutorConfig, step_runner
    from shuffle.engine import shuffle_run

    if (epochs is None) == (epoch is None):
        raise click.UsageError("give exactly one of --epochs N or --epoch E")
    if samples is not None and tokens is not None:
        raise click.UsageError("give at most one of --samples and --tokens")
    config = ExecutorConfig(**_executor_config(kw))
    summary = shuffle_run(
        list(sources),
        output,
        seq_len=seq_len,
        seed=seed,
        epochs=list(range(epochs)) if epochs is not None else [epoch],
        samples=samples,
        tokens=tokens,
        shard_samples=shard_samples,
        memory=memory,
        jitter=jitter,
        log=None if as_json else lambda msg: click.echo(msg, err=True),
        workers=config.workers,
        tasks=config.tasks,
        run_step=step_runner(config),
    )
    emit(summary, as_json)


@main.command()
@click.argument("dirs", nargs=-1, required=True)
@click.option("--quick", is_flag=True, help="Structure and sizes only; skip checksums and token scans.")
@click.option("--against", multiple=True, help="Packed SOURCE(s) the epoch was shuffled from: recompute its content.")
@click.option("--workers", type=click.IntRange(min=1), default=min(4, os.cpu_count() or 1), show_default="min(4, cores)",
              help="Files checked in parallel (more reads in flight keep the disk busy).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON report on stdout.")
@user_errors
def validate(dirs, quick, against, workers, as_json):
    """Check the integrity of tokpack directories (sources, runs, epochs). Exit 1 on any problem."""
    from shuffle.verify import validate_all

    report = validate_all(list(dirs), quick=quick, against=list(against), workers=workers)
    if as_json:
        click.echo(json.dumps(report))
    else:
        for line in report["lines"]:
            click.echo(line, err=not report["ok"])
    sys.exit(0 if report["ok"] else 1)


@main.command()
@click.argument("directory")
@click.option("--rank", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--world-size", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--micro-batch", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--start-sample", type=click.IntRange(min=0), default=None, help="Consumed samples so far (Megatron's consumed_samples).")
@click.option("--consumed-tokens", type=click.IntRange(min=0), default=None, help="Consumed tokens: start = T // seq_len.")
@click.option("--count", type=click.IntRange(min=0), default=10, show_default=True, help="Samples this rank prints.")
@click.option("--verify", is_flag=True, help="Checksum each shard when it is first read.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per sample.")
@user_errors
def read(directory, rank, world_size, micro_batch, start_sample, consumed_tokens, count, verify, as_json):
    """Print what rank R of W is fed from DIRECTORY (a run or an epoch), for debugging."""
    from formats.reader import SampleReader

    if start_sample is not None and consumed_tokens is not None:
        raise click.UsageError("give at most one of --start-sample and --consumed-tokens")
    if rank >= world_size:
        raise click.UsageError(f"--rank {rank} must be below --world-size {world_size}")
    reader = SampleReader.open(directory, verify=verify)
    start = reader.start_from(start_sample=start_sample, consumed_tokens=consumed_tokens)
    for item in reader.rank_samples(rank, world_size, micro_batch, start=start, count=count):
        if as_json:
            click.echo(json.dumps({"epoch": item.epoch, "sample": item.sample, "rank": rank,
                                   "tokens": item.tokens.tolist()}))
        else:
            head = " ".join(map(str, item.tokens[:16].tolist()))
            click.echo(f"epoch {item.epoch} sample {item.sample} rank {rank}: [{head}{' ...' if len(item.tokens) > 16 else ''}]")


@main.command()
@click.argument("directory")
@click.option("--batch-size", type=click.IntRange(min=1), default=None, help="Global batch size in samples [default: 64].")
@click.option("--batches", type=click.IntRange(min=1), default=64, show_default=True, help="Global batches to analyse.")
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="Write the figures to FILE.png (needs matplotlib).")
@click.option("--epoch", type=click.IntRange(min=0), default=None, help="Run: the epoch whose batches to analyse [default: first].")
@click.option("--seq-len", type=click.IntRange(min=1), default=None, help="Packed source: window length for the batch analysis.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON report on stdout.")
@user_errors
def inspect(directory, batch_size, batches, plot, epoch, seq_len, as_json):
    """Report what a directory holds and what the shuffle did to batch diversity."""
    from packer.inspect import inspect as inspect_api

    report = inspect_api(directory, batch_size=batch_size, batches=batches, plot=plot, epoch=epoch, seq_len=seq_len)
    if as_json:
        click.echo(json.dumps(report))
    else:
        for line in report.get("lines", []):
            click.echo(line)


@main.command()
@click.argument("directory")
@click.argument("dest")
@click.option("--workers", type=click.IntRange(min=1), default=4, show_default=True, help="Files copied in parallel.")
@click.option("--epochs", default=None, help="Only these epochs of a run, e.g. '0,1' or '0-3'.")
@click.option("--ranks", default=None, help="Only the shards ranks r/W will read: 'r/W' or 'r1,r2/W'.")
@click.option("--micro-batch", type=click.IntRange(min=1), default=1, show_default=True, help="With --ranks.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary on stdout.")
@user_errors
def stage(directory, dest, workers, epochs, ranks, micro_batch, as_json):
    """Copy a tokpack DIRECTORY to DEST (e.g. local NVMe), verifying every file's checksum."""
    from packer.stage import stage as stage_api

    summary = stage_api(directory, dest, workers=workers, epochs=epochs, ranks=ranks, micro_batch=micro_batch,
                        log=None if as_json else lambda msg: click.echo(msg, err=True))
    emit(summary, as_json)


if __name__ == "__main__":
    main()
