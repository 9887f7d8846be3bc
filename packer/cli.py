"""`tokpack` command line: a thin layer over the Python API.

Exit status (docs/COMMANDS.md, "Exit status"): 0 success; 1 the data, the input or the
environment is wrong (a full disk, a read-only output, a symlink loop, an output directory
another command holds, a store that cannot be reached); 2 a usage error (click's); 70 a bug in
tokpack (EX_SOFTWARE of sysexits.h); 130 Ctrl-C; 143 SIGTERM. A failure is one line on stderr, never a
traceback (a bug's traceback goes to a log file, or to stderr under `--debug`), and under
`--json` stdout holds exactly one JSON object, `{"ok": false, "error": {...}}` on any failure.
"""

from __future__ import annotations

import datetime
import errno
import functools
import json
import os
import signal
import sys
import threading
import time
import traceback

import click

from tokpack.formats.errors import TokpackError
from tokpack.formats.constants import DEFAULT_SHARD_TOKENS
from tokpack.formats.io import LOG_INTERVAL_ENV, log_interval, logging_every
from tokpack.formats.units import byte_size, counted, token_count
from tokpack.shuffle.spec import DEFAULT_MEMORY


class Quantity(click.ParamType):
    """A command-line quantity parsed by one function of tokpack.formats.units, so each quantity has its
    own type and its own units: TOKENS (1000000, 100B, 1.5M: K/M/B/T are 10^3..10^12) or BYTES
    (16GiB, 2GB, 4G: a bare K/M/G/T is binary)."""

    def __init__(self, name: str, parse):
        self.name, self.parse = name, parse

    def convert(self, value, param, ctx):
        try:
            return self.parse(value)
        except TokpackError as e:
            self.fail(str(e), param, ctx)


TOKENS, BYTES = Quantity("TOKENS", token_count), Quantity("BYTES", byte_size)


class ListedChoice(click.Choice):
    """A choice among the names a module lists, read when the command line is parsed (or its
    help shown): the module's list is the one list, and a name registered after this module
    was imported (a packing) is a choice. `extra`: choices the CLI adds before them."""

    def __init__(self, module: str, name: str, extra: tuple[str, ...] = ()):
        self._list, self._extra = (module, name), extra
        super().__init__((), case_sensitive=True)

    @property
    def choices(self):
        import importlib

        listed = getattr(importlib.import_module(self._list[0]), self._list[1])
        return (*self._extra, *(listed() if callable(listed) else listed))

    @choices.setter
    def choices(self, value):  # click.Choice.__init__ sets it
        pass


def PackingChoice() -> ListedChoice:
    """`--packing`: the names tokpack.shuffle.packings holds."""
    return ListedChoice("tokpack.shuffle.packings", "names")


def emit(result, as_json: bool, report_lines=None, err: bool = False, shown: dict | None = None) -> None:
    """One machine-readable object on stdout with --json; otherwise the `report_lines(result)`
    of a command that has them (on stderr if `err`), or a short human summary (with `shown`'s
    values instead of the summary's, for humans)."""
    summary = result.to_json()
    if as_json:
        click.echo(json.dumps(summary, default=str))
    elif report_lines is not None:
        for line in report_lines(result):
            click.echo(line, err=err)
    else:
        for key, value in summary.items():
            if value is None or isinstance(value, (list, dict)):
                continue
            click.echo(f"{key:>18}: {(shown or {}).get(key, value)}")


def _real_shard_size(result) -> dict:
    """shuffle's shard_samples for humans: the run's setting (which --json keeps, and adding an
    epoch must repeat) is larger than an epoch by default on a small corpus; say what a shard holds."""
    largest = max(result.epoch_samples or [0])
    if not 0 < largest < result.shard_samples:
        return {}
    return {
        "shard_samples": f"{largest} (one shard an epoch: the run's shard_samples, {result.shard_samples}, "
        "is larger than an epoch)"
    }


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that `finally` blocks (the output lock, temporary
    files) run as for Ctrl-C. A BaseException: no `except Exception` swallows it."""


# After Ctrl-C or SIGTERM the command unwinds in the main thread (its lock, its temporaries),
# but a worker thread blocked in a read (a hung network mount) must not keep the process alive:
# a tokpack process exits this long after the signal whatever its threads do (the lifetime
# watchdog then ends its child processes).
EXIT_GRACE_SECONDS = 5.0
_OWN_PROCESS = False  # main() runs the process's own command line (not a CliRunner or an embedding)


def _exit_soon(code: int) -> None:
    def leave():
        time.sleep(EXIT_GRACE_SECONDS)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed pipe: nothing more to say
                pass
        os._exit(code)

    if _OWN_PROCESS:
        threading.Thread(target=leave, name="tokpack-exit-grace", daemon=True).start()


def _raise_terminated(signum, frame):
    _exit_soon(143)
    raise Terminated()


EXIT_DATA, EXIT_USAGE, EXIT_BUG, EXIT_INTERRUPTED, EXIT_TERMINATED = 1, 2, 70, 130, 143


def _raise_interrupt(signum, frame):
    _exit_soon(130)
    raise KeyboardInterrupt


_DEBUG = False  # --debug: a bug's traceback goes to stderr instead of a log file
_FAILED = False  # a failure was reported already (its JSON object printed): report nothing more

# errno -> what the user can do about it
_OS_HINTS = {
    errno.ELOOP: "a symbolic link points (through others) back to itself: fix or remove the link",
    errno.EROFS: "the filesystem is read-only: write to a writable directory",
    errno.EACCES: "no permission to write there: choose a directory you may write, or fix its permissions",
    errno.EPERM: "the operation is not permitted there (immutable file or directory?): choose another path",
    errno.ENOSPC: "the disk is full: free some space, then rerun the same command to resume",
    errno.EDQUOT: "the disk quota is exhausted: free some space, then rerun the same command to resume",
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "a part of the path is a file, not a directory: check the path",
}


def _report(line: str, error: dict, status: int, as_json: bool) -> None:
    """The one line on stderr, the one JSON object on stdout under --json, then exit."""
    global _FAILED
    if as_json and not _FAILED:
        click.echo(json.dumps({"ok": False, "error": error}))
    _FAILED = True
    click.echo(line, err=True)
    sys.exit(status)


HINT_MARK = ". HINT: "  # how a line says what to do (TokpackError's str, click's message of a quantity)


def _error_json(kind: str, message: str, **fields) -> dict:
    """The --json error object of a failure that is no TokpackError. A message that says its
    hint (click's line for a bad TOKENS or BYTES value holds the parser's TokpackError line)
    gives it to `hint`, where a script finds every other failure's."""
    hint = fields.get("hint")
    if hint is None and HINT_MARK in message:
        message, hint = message.split(HINT_MARK, 1)
    return {
        "error": kind,
        "message": message,
        "file": fields.get("file"),
        "where": None,
        "expected": None,
        "found": None,
        "hint": hint,
    }


def _os_error_line(e: OSError) -> tuple[str, dict]:
    where = e.filename if e.filename is not None else None
    if getattr(e, "filename2", None):
        where = f"{where} -> {e.filename2}"
    name = errno.errorcode.get(e.errno, "") if e.errno else ""
    message = f"{e.strerror or e}" + (f" ({name})" if name else "")
    hint = _OS_HINTS.get(e.errno)
    line = "tokpack: error: " + (f"{where}: " if where else "") + message + (f". HINT: {hint}" if hint else "")
    return line, _error_json(type(e).__name__, message, file=None if where is None else str(where), hint=hint)


def _crash_log(command: str, exc: BaseException) -> str:
    """Writes the traceback of a bug to $TOKPACK_LOG_DIR (default ~/.cache/tokpack); returns
    where, or why it could not."""
    text = "".join(traceback.format_exception(exc))
    folder = os.environ.get("TOKPACK_LOG_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tokpack")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = os.path.join(folder, f"crash-{stamp}-{os.getpid()}.log")
    try:
        os.makedirs(folder, exist_ok=True)
        with open(path, "w") as f:
            f.write(f"tokpack {command}\nargv: {sys.argv}\n\n{text}")
    except OSError as e:
        return f"not saved ({e.strerror or e}: {path}); rerun with --debug to see it"
    return f"in {path}"


def _internal_error(command: str, exc: BaseException, as_json: bool) -> None:
    summary = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    if _DEBUG:
        traceback.print_exception(exc, file=sys.stderr)
        where = "above"
    else:
        where = _crash_log(command, exc)
    line = f"tokpack {command}: internal error (a bug in tokpack): {summary}; the traceback is {where}"
    _report(line, _error_json("InternalError", line), EXIT_BUG, as_json)


RESUME = "rerun the same command to resume"


def user_errors(fn):
    """Turns every failure of a command into one line on stderr (and one JSON object under
    --json): TokpackError and OSError exit 1, Ctrl-C 130, SIGTERM 143, a bug in tokpack 70."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        as_json = bool(kwargs.get("as_json"))
        ctx = click.get_current_context(silent=True)
        command = ctx.info_name if ctx is not None else "command"
        try:
            with logging_every(_log_interval(ctx, as_json)):
                return fn(*args, **kwargs)
        except (SystemExit, click.exceptions.Exit, click.ClickException, click.Abort):
            raise  # a status chosen already, or a usage error: main reports those
        except TokpackError as e:
            _report(f"tokpack: error: {e}", e.to_json(), EXIT_DATA, as_json)
        except ModuleNotFoundError as e:  # an optional dependency this command needs
            message = f"this command needs the module {e.name!r}, which is not installed"
            line = f"tokpack: error: {message}{HINT_MARK}pip install {e.name}"
            _report(line, _error_json("ModuleNotFoundError", message, hint=f"pip install {e.name}"), EXIT_DATA, as_json)
        except OSError as e:  # the environment: a full disk, a read-only output, a symlink loop...
            line, error = _os_error_line(e)
            _report(line, error, EXIT_DATA, as_json)
        except RuntimeError as e:
            if not str(e).startswith("Symlink loop"):  # pathlib's resolve() before Python 3.13
                _internal_error(command, e, as_json)
            line, error = _os_error_line(
                OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(e).split("'")[1] if "'" in str(e) else None)
            )
            _report(line, error, EXIT_DATA, as_json)
        except KeyboardInterrupt:
            line = f"tokpack: interrupted; {RESUME}"
            _report(line, _error_json("KeyboardInterrupt", "interrupted", hint=RESUME), EXIT_INTERRUPTED, as_json)
        except Terminated:
            line = f"tokpack: terminated (SIGTERM); {RESUME}"
            error = _error_json("Terminated", "terminated (SIGTERM)", hint=RESUME)
            _report(line, error, EXIT_TERMINATED, as_json)
        except Exception as e:  # noqa: BLE001 - anything else is a bug in tokpack, not bad data
            _internal_error(command, e, as_json)

    return wrapper


_LOG_INTERVAL = "tokpack.log_interval"  # ctx.meta key: --log-interval as given (None: not given)

LOG_INTERVAL = click.option(
    "--log-interval",
    type=click.FloatRange(min=0),
    default=None,
    metavar="SECONDS",
    expose_value=False,
    callback=lambda ctx, param, value: ctx.meta.__setitem__(_LOG_INTERVAL, value),
    help="When stderr is not a terminal (a Slurm log, nohup): one progress line every SECONDS, saying what it "
    "does, done/total, MB/s and an ETA; 0: none [default: $TOKPACK_LOG_INTERVAL, else 30; under --json, 0].",
)


def _log_interval(ctx, as_json: bool) -> float | None:
    """The progress-line interval a command runs with (None: $TOKPACK_LOG_INTERVAL or 30 s, as
    tokpack.formats.io.log_interval reads it): --log-interval, else none under --json (stderr
    holds a failure only) unless $TOKPACK_LOG_INTERVAL asks for lines."""
    given = ctx.meta.get(_LOG_INTERVAL) if ctx is not None else None
    if given is None and as_json and LOG_INTERVAL_ENV not in os.environ:
        return 0.0
    return given


SHUFFLE_TASKS_HELP = (
    "Out of core: scatter tasks, each reading one input range (a run of whole source shards, "
    "so at most one task per source shard) [default: --workers]; the order pass runs one task "
    "per output shard."
)


def executor_options(
    fn=None, *, tasks_help: str = "Number of tasks to split the work into (default: one per input file / output shard)."
):
    """Where the tasks run (an ExecutorConfig). Local is the default; slurm and ray go through
    datatrove's executors."""
    if fn is None:
        return functools.partial(executor_options, tasks_help=tasks_help)
    options = [
        click.option(
            "--workers",
            type=click.IntRange(min=1),
            default=1,
            show_default=True,
            help="Local worker processes; on slurm/ray a cap on concurrent tasks (1: no cap).",
        ),
        click.option(
            "--executor",
            type=ListedChoice("tokpack.packer.executors", "EXECUTORS"),
            default="local",
            show_default=True,
            help="datatrove executor that runs the tasks.",
        ),
        click.option("--tasks", type=click.IntRange(min=1), default=None, help=tasks_help),
        click.option("--logging-dir", default=None, help="datatrove logging dir (default: inside OUT's work folder)."),
        click.option("--partition", default=None, help="slurm: partition."),
        click.option("--time", "time_limit", default="24:00:00", show_default=True, help="slurm: time limit."),
        click.option("--cpus-per-task", type=int, default=1, show_default=True, help="slurm/ray: CPUs per task."),
        click.option(
            "--mem-per-cpu-gb",
            "mem_per_cpu_gb",
            type=float,
            default=2,
            show_default=True,
            help="slurm/ray: memory reserved per CPU of a task, in GB (sbatch --mem-per-cpu); "
            "not a budget tokpack keeps (that is shuffle's --memory).",
        ),
        click.option(
            "--mem",
            "deprecated_mem",
            type=float,
            default=None,
            hidden=True,
            help="Deprecated spelling of --mem-per-cpu-gb.",
        ),
        click.option("--sbatch-args", default=None, help="slurm: extra sbatch arguments as 'key=value,key=value'."),
        click.option("--ray-address", default=None, help="ray: cluster address (default: start a local cluster)."),
    ]
    for opt in reversed(options):
        fn = opt(fn)
    return fn


def _executor_config(kw: dict):
    """The ExecutorConfig of the options `executor_options` added (each named as its field)."""
    from dataclasses import fields

    from tokpack.packer.api import ExecutorConfig

    deprecated = kw.pop("deprecated_mem", None)
    if deprecated is not None:  # --mem, GB per CPU, read next to --memory, bytes, as one option: renamed
        ctx = click.get_current_context()
        if ctx.get_parameter_source("mem_per_cpu_gb") is click.core.ParameterSource.COMMANDLINE:
            raise click.UsageError("give --mem-per-cpu-gb only (--mem is its deprecated spelling)")
        click.echo(
            "tokpack: warning: --mem is deprecated (it is easily taken for --memory); "
            "use --mem-per-cpu-gb, GB of memory per CPU of a slurm/ray task",
            err=True,
        )
        kw["mem_per_cpu_gb"] = deprecated
    return ExecutorConfig(**{f.name: kw.pop(f.name) for f in fields(ExecutorConfig) if f.name in kw})


def _log(as_json: bool):
    """Where a command's progress lines go: stderr, and nowhere under --json."""
    return None if as_json else lambda msg: click.echo(msg, err=True)


def _weighted_sources(args) -> list[tuple[str, str | None]]:
    """SOURCE[=WEIGHT] -> (SOURCE, WEIGHT or None). An argument naming an existing path is a path
    even if it holds '='; in a URL, a '=' is a weight's only when a number follows it."""
    pairs = []
    for arg in args:
        path, _, weight = arg.rpartition("=")
        if (
            not path
            or os.path.exists(arg)
            or "://" in arg
            and not _is_number(weight)
            or (arg.startswith("virtual:") and arg.rsplit(",", 1)[-1].count("=") < 2)
        ):  # its last key=value, no weight
            path, weight = arg, None
        pairs.append((path, weight))
    return pairs


def _is_number(text: str) -> bool:
    """A number as shuffle takes a weight: 0.3, 2, 1/3, 70% (tokpack.formats.units.weight_fraction;
    1/0 is one, if not a valid one)."""
    from tokpack.formats.units import weight_fraction

    try:
        weight_fraction(text)
    except ZeroDivisionError:
        return True
    except ValueError:
        return False
    return True


class _Tokpack(click.Group):
    """The command group, reporting what click itself refuses (usage errors) as the commands
    report their failures: one line, and one JSON object on stdout under --json."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        global _DEBUG, _FAILED, _OWN_PROCESS
        _OWN_PROCESS = args is None and threading.current_thread() is threading.main_thread()
        argv = list(sys.argv[1:] if args is None else args)
        _DEBUG, _FAILED = "--debug" in argv, False
        as_json = "--json" in argv
        # SIGTERM (a scheduler's kill, `timeout`) unwinds like Ctrl-C: the lock and temporary
        # files are released. An embedding application's own handler is left alone.
        previous = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
        if previous is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _raise_terminated)
        interrupt = signal.getsignal(signal.SIGINT) if previous is not None else None
        # A background job of a non-interactive shell (`cmd &` in a script, nohup) inherits SIGINT
        # ignored, and Python then installs no handler: tokpack's own process takes Ctrl-C back,
        # so that SIGINT stops it wherever it runs (and its worker processes, started after this).
        catch_interrupt = interrupt is signal.default_int_handler or (interrupt is signal.SIG_IGN and _OWN_PROCESS)
        if catch_interrupt:  # Ctrl-C as Python's, with the same grace
            signal.signal(signal.SIGINT, _raise_interrupt)
        try:
            result = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as e:
            if as_json and not _FAILED:
                click.echo(json.dumps({"ok": False, "error": _error_json(type(e).__name__, e.format_message())}))
            e.show()
            sys.exit(e.exit_code)
        except click.Abort:
            sys.exit(EXIT_INTERRUPTED)
        except Terminated:
            click.echo("tokpack: terminated (SIGTERM)", err=True)
            sys.exit(EXIT_TERMINATED)
        except KeyboardInterrupt:
            click.echo("tokpack: interrupted", err=True)
            sys.exit(EXIT_INTERRUPTED)
        except Exception as e:  # noqa: BLE001 - outside any command (option parsing...): a bug too
            _internal_error(next((a for a in argv if not a.startswith("-")), "command"), e, as_json)
        finally:
            if previous is signal.SIG_DFL:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if catch_interrupt:
                signal.signal(signal.SIGINT, interrupt)
        if not standalone_mode:
            return result
        sys.exit(result if isinstance(result, int) else 0)


@click.group(cls=_Tokpack, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option(
    "--debug", is_flag=True, help="Print the traceback of an internal error instead of saving it to a log file."
)
@click.version_option(package_name="tokpack", prog_name="tokpack")
def main(debug):
    """Pack tokenized corpora, shuffle them offline per epoch, validate, stage and stream them.

    \b
    Example:
      tokpack pack corpus.jsonl -o packed --tokenizer tokenizer.json
      tokpack shuffle packed -o run --seq-len 2048 --seed 1 --epochs 2
      tokpack validate run --against packed
      tokpack COMMAND --help
    """
    global _DEBUG
    _DEBUG = _DEBUG or debug
    from loguru import logger

    # The command line is tokpack's own application: datatrove's messages belong in the task logs.
    logger.remove()


SCRATCH = click.option(
    "--scratch",
    type=click.Path(file_okay=False),
    default=None,
    help="With an -o URL (s3://...): the local or shared folder where shards are written before each is sent, "
    "and out-of-core buckets [default: $TOKPACK_STAGE_DIR, else the system temp dir].",
)


@main.command()
@click.argument("inputs", nargs=-1, required=True)
@click.option("-o", "--output", required=True, help="Output directory for the packed source.")
@click.option(
    "--format",
    "input_format",
    type=ListedChoice("tokpack.formats.inputs.discover", "FORMATS", extra=("auto",)),
    default="auto",
    show_default=True,
    help="Input format; auto detects it and says what it found.",
)
@click.option(
    "--column",
    default=None,
    help="Parquet/Arrow column or JSONL key holding token lists [default: input_ids]; "
    "for --format text, the text column/key [default: text].",
)
@click.option(
    "--dtype",
    default=None,
    help="Token dtype of raw token files (uint16, uint32, int32, ...); "
    "inputs that record their own dtype must agree with it.",
)
@click.option("--tokenizer", default=None, help="Local tokenizer.json: for raw text, and to learn EOS and vocab size.")
@click.option(
    "--eos-id", type=int, default=None, help="EOS token id (default: from the tokenizer or datatrove metadata)."
)
@click.option(
    "--vocab-size", type=int, default=None, help="Vocabulary size (default: from the tokenizer or the input dtype)."
)
@click.option("--overwrite", is_flag=True, help="Replace an output directory that holds a different packed source.")
@click.option(
    "--shard-tokens",
    type=TOKENS,
    default=DEFAULT_SHARD_TOKENS,
    help="Target tokens per output shard (documents never span shards) [default: 2^30 = 1Gi tokens].",
)
@click.option(
    "--link",
    is_flag=True,
    help="Hard-link (else reflink) a datatrove input that already is its shard's bytes, once verified, "
    "instead of copying it; the input must then not be edited in place (docs/COMMANDS.md).",
)
@executor_options
@SCRATCH
@LOG_INTERVAL
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary on stdout.")
@user_errors
def pack(inputs, output, as_json, **kw):
    """Pack tokenized INPUTs into one packed source.

    \b
    Example:
      tokpack pack /data/tokenized/web/ -o /data/packed/web --workers 8
      tokpack pack data.parquet -o packed --column input_ids --eos-id 0 --vocab-size 50304
    """
    from tokpack.packer.api import pack as pack_api

    executor = _executor_config(kw)
    emit(pack_api(list(inputs), output, executor=executor, log=_log(as_json), **kw), as_json)


# What --like reads from the run, as its usage line names it (the sources aside).
TAKEN_BY_LIKE = (
    "--seq-len",
    "--seed",
    "--samples/--tokens",
    "--shard-samples",
    "--jitter",
    "--schedule",
    "--packing",
    "--pad-id",
    "--holdout",
)


def _epochs_asked(sources, epochs, epoch, kw) -> list[int] | int | None:
    """shuffle's --epochs N / --epoch E (None: every epoch of --schedule), with the usage checks
    of its arguments."""
    if kw.get("like") is not None:
        from tokpack.shuffle.like import given_with_like

        twice = given_with_like({**kw, "sources": sources}, cli=True)
        if twice:
            raise click.UsageError(
                f"--like takes the sources and {', '.join(TAKEN_BY_LIKE)} from the run; drop {' '.join(twice)}"
            )
        if epochs is not None and epoch is not None:
            raise click.UsageError("give at most one of --epochs N and --epoch E")
        return [epoch] if epoch is not None else epochs
    if kw["output"] is None:
        raise click.UsageError("give -o OUT (or --like RUN to add epochs to RUN with its own settings)")
    if kw["schedule"] is not None:
        given = [f"--{k.replace('_', '-')}" for k in ("seq_len", "seed", "samples", "tokens") if kw[k] is not None]
        if sources or given or kw["jitter"]:
            raise click.UsageError(
                "--schedule declares the sources, --seq-len, --seed, --samples/--tokens and "
                f"--jitter; drop {' '.join(given + ['--jitter'] * kw['jitter']) or 'the SOURCEs'}"
            )
        if epochs is not None and epoch is not None:
            raise click.UsageError("give at most one of --epochs N and --epoch E")
    elif not sources or kw["seq_len"] is None or kw["seed"] is None:
        raise click.UsageError("give SOURCE[=WEIGHT]..., --seq-len and --seed (or --schedule FILE)")
    elif (epochs is None) == (epoch is None):
        raise click.UsageError("give exactly one of --epochs N or --epoch E")
    if kw["samples"] is not None and kw["tokens"] is not None:
        raise click.UsageError("give at most one of --samples and --tokens")
    return [epoch] if epoch is not None else epochs


@main.command()
@click.argument("sources", nargs=-1, metavar="SOURCE[=WEIGHT]...")
@click.option(
    "-o", "--output", default=None, help="Run directory; one epoch-NNNNN/ per epoch inside [with --like: RUN]."
)
@click.option(
    "--like",
    default=None,
    metavar="RUN",
    help="Add epochs to the run RUN with its own settings, read from its manifests (sources, weights, "
    "--seq-len, --seed, --samples, --shard-samples, --jitter, --packing, --pad-id or its "
    "--schedule); give only --epoch E or --epochs N, and how to run (--memory, --workers...).",
)
@click.option(
    "--schedule",
    type=click.Path(dir_okay=False),
    default=None,
    help="A schedule YAML (seq_len, seed, stages of sources and weights) instead of SOURCEs, "
    "--seq-len, --seed, --samples/--tokens and --jitter; without --epoch(s), every epoch.",
)
@click.option("--seq-len", type=click.IntRange(min=1), default=None, help="Tokens per sample is seq_len + 1.")
@click.option("--seed", type=int, default=None, help="Shuffle seed.")
@click.option("--epochs", type=click.IntRange(min=1), default=None, help="Write epochs 0..N-1.")
@click.option("--epoch", type=click.IntRange(min=0), default=None, help="Write only epoch E (adds to an existing run).")
@click.option("--samples", type=click.IntRange(min=1), default=None, help="Samples per epoch (with weights).")
@click.option(
    "--tokens",
    type=TOKENS,
    default=None,
    help="Trained tokens per epoch: samples = T // seq_len. K/M/B/T are 10^3..10^12 (100B).",
)
@click.option(
    "--shard-samples",
    type=click.IntRange(min=1),
    default=None,
    help="Samples per output shard [default: 1 GiB // ((seq_len+1) * token_size), about 1 GiB].",
)
@click.option(
    "--memory",
    type=BYTES,
    default=f"{DEFAULT_MEMORY >> 30}GiB",  # tokpack.shuffle.spec's, as the help shows it
    show_default=True,
    help="Total memory budget in bytes (KB/MB/GB are 10^n; KiB/MiB/GiB and a bare K/M/G are 2^n). An epoch whose windows fit runs in memory (one read, one write); "
    "otherwise out of core, each of --workers tasks using memory/workers.",
)
@click.option("--jitter", is_flag=True, help="Shift window starts by a seeded per-epoch offset.")
@click.option(
    "--packing",
    type=PackingChoice(),
    default=None,
    show_default="concat",
    help="concat: windows of the concatenated documents; best-fit: whole documents packed into samples "
    "by best-fit decreasing, per epoch (only documents longer than a sample are cut).",
)
@click.option(
    "--pad-id",
    type=click.IntRange(min=0),
    default=None,
    help="best-fit: the token that fills a sample's tail [default: the EOS id].",
)
@click.option(
    "--to-nodes",
    "to_nodes",
    default=None,
    metavar="DEST",
    help="Under MPI (mpirun/srun, one process per node; pip install 'tokpack[mpi]'): process n writes "
    "node n's slice (as `stage RUN DEST --node n/N`) into its local DEST ({node} is replaced by n); "
    "-o RUN gets only the manifests and row hashes.",
)
@click.option("--ranks-per-node", type=click.IntRange(min=1), default=None, help="With --to-nodes: K ranks a node.")
@click.option(
    "--micro-batch", type=click.IntRange(min=1), default=None, help="With --to-nodes: m samples a rank a step."
)
@click.option(
    "--keep-sources",
    "keep_sources",
    default=None,
    metavar="DIR",
    help="With --to-nodes: each process keeps the source shards it reads, verified, in its local DIR "
    "({node} is replaced by n) and reads them there in later epochs, not on the shared filesystem.",
)
@click.option(
    "--holdout",
    default=None,
    metavar="F",
    help="Set whole documents of each source aside from every epoch, chosen from --seed, and write "
    "them once to RUN/holdout/: a fraction of its documents (0.01, 1%) or a token count (5M).",
)
@executor_options(tasks_help=SHUFFLE_TASKS_HELP)
@SCRATCH
@LOG_INTERVAL
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary on stdout.")
@user_errors
def shuffle(sources, output, epochs, epoch, as_json, **kw):
    """Write globally shuffled epochs of fixed-length samples from packed SOURCEs.

    \b
    Example:
      tokpack shuffle /data/packed/web=0.7 /data/packed/code=0.3 -o /data/runs/r1 \\
          --seq-len 4096 --seed 1234 --epochs 3 --tokens 100B --memory 16GiB --workers 4
      tokpack shuffle --schedule run.yaml -o /data/runs/r2
      tokpack shuffle --like /data/runs/r1 --epoch 3
    """
    from tokpack.packer.api import shuffle as shuffle_api

    epochs = _epochs_asked(sources, epochs, epoch, {**kw, "output": output})
    if kw["to_nodes"] is not None:
        return _shuffle_to_nodes(sources, output, epochs, as_json, kw)
    if kw.pop("ranks_per_node") is not None or kw.pop("micro_batch") is not None or kw.pop("keep_sources") is not None:
        raise click.UsageError("--ranks-per-node, --micro-batch and --keep-sources go with --to-nodes DEST")
    kw.pop("to_nodes")
    executor = _executor_config(kw)
    quiet = as_json and log_interval() == 0  # --json asked for no lines: no bar on a terminal either
    result = shuffle_api(
        _weighted_sources(sources) if sources else None,
        output,
        epochs=epochs,
        executor=executor,
        log=_log(as_json),
        progress=False if quiet else None,
        **kw,
    )
    emit(result, as_json, shown=_real_shard_size(result))
    if not as_json:
        from tokpack.shuffle.packings import shown_line

        for detail in result.epochs_detail:
            stage = "" if detail["stage"] is None else f" (stage {detail['stage']})"
            reused = f" ({detail['shards_reused']} reused from an earlier attempt)" if detail["shards_reused"] else ""
            click.echo(
                f"epoch {detail['epoch']}{stage}: {detail['samples']} samples, {detail['shards']} "
                f"shard{'s' * (detail['shards'] != 1)}{reused}, {detail['path']}; {shown_line(detail['packing'])}"
            )
            unit = detail["packing"]["unit"]  # a source's "windows" are a best-fit pass's rows
            for r in detail["sources"]:
                if not r["samples"] and r["weight"] is None:
                    continue  # a source of the schedule that this epoch's stage does not use
                click.echo(
                    f'epoch {detail["epoch"]}, source "{r["name"]}": {r["samples"]} samples of {r["windows"]} '
                    f"{unit}{' a pass' * (unit != 'windows')}, {counted(r['passes'], 'pass', plural='passes')}, {r['repeats']} {_repeated(r)}"
                    f"{'' if r['weight'] is None else ', weight ' + r['weight']} ({r['path']}, "
                    f"fingerprint {r['fingerprint'][:16]})"
                )
        if result.holdout is not None:  # written by this command (once a run)
            click.echo(
                f"holdout: {result.holdout['samples']} samples of held-out documents in "
                f"{result.holdout['path']} (read it as an epoch; no training epoch holds them)"
            )
        for line in result.warnings:
            click.echo(f"tokpack: warning: {line}", err=True)


def _shuffle_to_nodes(sources, output, epochs, as_json, kw):
    """shuffle --to-nodes (tokpack.packer.api.shuffle, to_nodes=): this process's node slice; one
    JSON line per process. The usage checks are the command line's; the API runs it."""
    from tokpack.packer.api import shuffle as shuffle_api
    from tokpack.shuffle.like import run_settings

    if kw["ranks_per_node"] is None or kw["micro_batch"] is None:
        raise click.UsageError("--to-nodes needs --ranks-per-node K and --micro-batch M")
    if kw.get("scratch") is not None:
        raise click.UsageError("--to-nodes writes no scratch to the shared filesystem; drop --scratch")
    if kw.get("holdout") is not None or (kw.get("like") is not None and run_settings(kw["like"]).get("holdout")):
        raise click.UsageError(
            "--to-nodes does not write a held-out split (--holdout) yet; shuffle the run without "
            "--to-nodes, then `tokpack stage` it to the nodes"
        )
    kw.pop("deprecated_mem", None)  # how tasks run is not --to-nodes' business: one process a node
    _executor_config(kw)
    result = shuffle_api(
        _weighted_sources(sources) if sources else None, output, epochs=epochs, log=_log(as_json), **kw
    )
    if as_json:
        click.echo(json.dumps(result))
    else:
        click.echo(
            f"node {result['node']} of {result['nodes']}: slice of ranks {result['ranks'][0]}-"
            f"{result['ranks'][-1]} at {result['dest']}: epochs {result['epochs']}"
        )


def _repeated(r: dict) -> str:
    """'repeated' for a count of samples; a count in another unit names it (best-fit: pieces)."""
    unit = r.get("repeat_unit", "samples")
    return "repeated" if unit == "samples" else f"{unit} repeated"


@main.command()
@click.argument("dirs", nargs=-1, required=True)
@click.option("--quick", is_flag=True, help="Structure and sizes only; skip checksums and token scans.")
@click.option("--against", multiple=True, help="Packed SOURCE(s) the epoch was shuffled from: recompute its content.")
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=min(4, os.cpu_count() or 1),
    show_default="min(4, cores)",
    help="Files checked in parallel (more reads in flight keep the disk busy).",
)
@LOG_INTERVAL
@click.option("--json", "as_json", is_flag=True, help="Print one JSON report on stdout.")
@user_errors
def validate(dirs, quick, against, workers, as_json):
    """Check the integrity of tokpack directories (sources, runs, epochs). Exit 1 on any problem.

    \b
    Example:
      tokpack validate /data/packed/web /data/runs/r1
      tokpack validate /data/runs/r1/epoch-00000 --against /data/packed/web --json
    """
    from tokpack.packer.api import validate as validate_api
    from tokpack.packer.validation import report_lines

    result = validate_api(list(dirs), quick=quick, against=list(against), workers=workers)
    emit(result, as_json, report_lines, err=not result.ok)
    sys.exit(0 if result.ok else 1)


@main.command()
@click.argument("directory")
@click.option(
    "--rank",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="The data-parallel rank whose samples to print (below --world-size).",
)
@click.option(
    "--world-size",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Data-parallel ranks sharing each global batch of world-size x micro-batch samples.",
)
@click.option(
    "--micro-batch", type=click.IntRange(min=1), default=1, show_default=True, help="Samples per rank per step."
)
@click.option(
    "--start-sample",
    type=click.IntRange(min=0),
    default=None,
    help="Consumed samples so far (Megatron's consumed_samples).",
)
@click.option(
    "--consumed-tokens",
    type=TOKENS,
    default=None,
    help="Consumed tokens: start = T // seq_len. K/M/B/T are 10^3..10^12.",
)
@click.option("--count", type=click.IntRange(min=0), default=10, show_default=True, help="Samples this rank prints.")
@click.option("--verify", is_flag=True, help="Checksum each shard when it is first read.")
@click.option(
    "--tokenizer",
    default=None,
    help="Local tokenizer.json: print each sample as text (EOS as its token, a best-fit row's padding as "
    '[padding: N tokens]); with --json, adds "text" and "padding".',
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per sample.")
@user_errors
def read(directory, rank, world_size, micro_batch, start_sample, consumed_tokens, count, verify, tokenizer, as_json):
    """Print what rank R of W is fed from DIRECTORY (a run or an epoch), for debugging.

    \b
    Example:
      tokpack read /data/runs/r1 --rank 3 --world-size 8 --micro-batch 4 --start-sample 1024 --count 4
      tokpack read /data/runs/r1 --count 2 --tokenizer tokenizer.json
    """
    from tokpack.loader.reader import SampleReader

    if start_sample is not None and consumed_tokens is not None:
        raise click.UsageError("give at most one of --start-sample and --consumed-tokens")
    if rank >= world_size:
        raise click.UsageError(f"--rank {rank} must be below --world-size {world_size}")
    reader = SampleReader.open(directory, verify=verify)
    start = reader.start_from(start_sample=start_sample, consumed_tokens=consumed_tokens)
    reader.require_batch(world_size, micro_batch, start)  # else the command would print nothing and exit 0
    samples = reader.rank_samples(rank, world_size, micro_batch, start=start, count=count)
    if tokenizer is not None:
        return _read_text(reader, samples, rank, tokenizer, as_json)
    for item in samples:
        if as_json:
            click.echo(
                json.dumps({"epoch": item.epoch, "sample": item.sample, "rank": rank, "tokens": item.tokens.tolist()})
            )
        else:
            head = " ".join(map(str, item.tokens[:16].tolist()))
            click.echo(
                f"epoch {item.epoch} sample {item.sample} rank {rank}: [{head}{' ...' if len(item.tokens) > 16 else ''}]"
            )


def _read_text(reader, samples, rank: int, tokenizer: str, as_json: bool) -> None:
    """`read --tokenizer`: each sample decoded (packer.vocab.sample_text), under a header line
    and indented, so a line that starts a sample is never one of the text's own lines."""
    import textwrap

    from tokpack.packer.vocab import load_tokenizer, sample_text

    tok = load_tokenizer(tokenizer)
    for item in samples:
        pad = int(reader.padding(item.index, 1)[0]) if reader.packed else 0
        text = sample_text(tok, item.tokens, reader.eos_id, pad)
        if as_json:
            fields = {"epoch": item.epoch, "sample": item.sample, "rank": rank, "tokens": item.tokens.tolist()}
            click.echo(json.dumps({**fields, "text": text, "padding": pad}))
        else:
            click.echo(f"epoch {item.epoch} sample {item.sample} rank {rank}:")
            click.echo(textwrap.indent(text, "    "))


@main.command()
@click.argument("directory")
@click.option(
    "--batch-size", type=click.IntRange(min=1), default=None, help="Global batch size in samples [default: 64]."
)
@click.option("--batches", type=click.IntRange(min=1), default=64, show_default=True, help="Global batches to analyse.")
@click.option(
    "--plot", type=click.Path(dir_okay=False), default=None, help="Write the figures to FILE.png (needs matplotlib)."
)
@click.option(
    "--epoch",
    type=click.IntRange(min=0),
    default=None,
    help="Run: the epoch whose batches to analyse [default: first].",
)
@click.option(
    "--seq-len", type=click.IntRange(min=1), default=None, help="Packed source: window length for the batch analysis."
)
@click.option(
    "--memory",
    type=BYTES,
    default=None,
    help="Memory budget in bytes of a best-fit epoch's plan and row table, built on disk and read "
    "in parts [default: 256MiB].",
)
@click.option(
    "--documents-per-row",
    is_flag=True,
    help="Also find the largest document count of a row of the epoch: the max_documents to train "
    "with. Reads the epoch's tokens once.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON report on stdout.")
@user_errors
def inspect(directory, as_json, **kw):
    """Report what a directory holds and what the shuffle did to batch diversity.

    \b
    Example:
      tokpack inspect /data/runs/r1 --epoch 0 --batch-size 512
      tokpack inspect /data/runs/r1 --epoch 0 --documents-per-row
      tokpack inspect /data/packed/web --seq-len 4096 --plot web.png
    """
    from tokpack.packer.api import inspect as inspect_api
    from tokpack.packer.inspection import report_lines

    emit(inspect_api(directory, **kw), as_json, report_lines)


@main.command()
@click.argument("directory")
@click.argument("dest")
@click.option("--workers", type=click.IntRange(min=1), default=4, show_default=True, help="Files copied in parallel.")
@click.option("--epochs", default=None, help="Only these epochs of a run, e.g. '0,1' or '0-3'.")
@click.option(
    "--shards-of",
    default=None,
    help="'r/W' (also 'r1,r2/W', 'a-b/W'): only the whole epoch shards ranks r of W read, manifests unchanged.",
)
@click.option(
    "--ranks",
    default=None,
    help="With --world-size: the node slice of consecutive ranks 'A-B' (only their rows, one file per rank).",
)
@click.option(
    "--world-size", type=click.IntRange(min=1), default=None, help="W: data-parallel ranks; makes a node slice."
)
@click.option(
    "--node",
    default=None,
    help="'n/N': the node slice of node n of N, 0-based: n is 0 to N-1, "
    "as SLURM_NODEID (with --ranks-per-node K; W = N*K; its ranks are n*K to n*K+K-1).",
)
@click.option("--ranks-per-node", type=click.IntRange(min=1), default=None, help="K: ranks on each node, with --node.")
@click.option(
    "--micro-batch",
    type=click.IntRange(min=1),
    default=None,
    help="m: samples each rank reads per step, as training reads them; required for a node slice "
    "(--node, or --ranks with --world-size), whose rows depend on it; with --shards-of r/W [default: 1].",
)
@click.option(
    "--start-sample",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Node slice: global batches start at this sample mod W*m (a run resumed off that grid).",
)
@click.option(
    "--memory",
    type=BYTES,
    default=None,
    help="A replacement node (--node on a RUN of shuffle --to-nodes): memory budget in bytes of the "
    "rows it rebuilds at a time, and of a best-fit epoch's row table [default: 256MiB].",
)
@LOG_INTERVAL
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary on stdout.")
@user_errors
def stage(directory, dest, as_json, **kw):
    """Copy a tokpack DIRECTORY to DEST (e.g. local NVMe), verifying every file's checksum.

    \b
    Example:
      tokpack stage s3://bucket/runs/r1 /local_nvme/r1 --epochs 0-1 --workers 8
      tokpack stage /shared/runs/r1 /local_nvme/r1 --shards-of 0-7/64 --micro-batch 4
      tokpack stage /shared/runs/r1 /local_nvme/slice --ranks 0-7 --world-size 64 --micro-batch 4
      tokpack stage /shared/runs/r1 /local_nvme/slice --node "$SLURM_NODEID/8" --ranks-per-node 8 --micro-batch 4
    """
    from tokpack.packer.api import stage as stage_api

    _stage_selection(kw)
    emit(stage_api(directory, dest, log=_log(as_json), **_micro_batch_of(kw)), as_json)


def _micro_batch_of(kw: dict) -> dict:
    """stage's options with --micro-batch checked: a node slice holds the rows of one micro-batch,
    and one forgotten (it was 1 by default) showed only when training started, on another node."""
    if kw["micro_batch"] is None:
        if kw["node"] is not None or kw["world_size"] is not None:
            raise click.UsageError(
                "a node slice (--node, or --ranks with --world-size) needs --micro-batch M, the "
                "samples each rank reads per step: its rows depend on it"
            )
        kw["micro_batch"] = 1
    return kw


def _stage_selection(kw: dict) -> None:
    """stage's --ranks names a node slice's ranks A-B (with --world-size or --node); its older
    shard-level form, `--ranks r/W` alone, still works with one warning and means --shards-of r/W
    (docs/COMMANDS.md, "Words"). It reaches the stage as before, so it behaves as it did."""
    sliced = kw["world_size"] is not None or kw["node"] is not None
    if kw["shards_of"] is not None and (sliced or kw["ranks"] is not None):
        raise click.UsageError(
            "--shards-of copies whole shards; a node slice is --ranks A-B --world-size W "
            "(or --node): give one of the two"
        )
    if kw["ranks"] is not None and not sliced and "/" in str(kw["ranks"]):
        click.echo(
            "tokpack: warning: --ranks r/W without --world-size is deprecated (it reads like a node "
            "slice's --ranks A-B); use --shards-of r/W, the whole shards ranks r of W read",
            err=True,
        )


@main.group()
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
    type=click.FloatRange(min=0, min_open=True),
    default=None,
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
        type=click.IntRange(min=1),
        default=None,
        help="With --to-nodes: N, the processes (nodes) mpirun would start; plan runs without MPI.",
    ),
    click.Option(
        ["--shared-mbps"],
        type=click.FloatRange(min=0, min_open=True),
        default=None,
        help="With --to-nodes: the shared filesystem's throughput in MB/s, all nodes together [default: "
        "measured like --disk-mbps, next to RUN, from this machine].",
    ),
    click.Option(
        ["--nic-mbps"],
        type=click.FloatRange(min=0, min_open=True),
        default=None,
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
    from tokpack.packer.planning import report_lines

    result = plan_api(command, *args, **kw)
    emit(result, as_json, report_lines)
    if not as_json:
        for line in result.warnings or []:  # as shuffle gives them
            click.echo(f"tokpack: warning: {line}", err=True)


@_planned(shuffle, NODES_OPTIONS)
def plan_shuffle(sources, output, epochs, epoch, as_json, **kw):
    to_nodes = {
        k: kw.pop(k)
        for k in ("to_nodes", "ranks_per_node", "micro_batch", "keep_sources", "nodes", "shared_mbps", "nic_mbps")
    }
    epochs = _epochs_asked(sources, epochs, epoch, {**kw, "output": output})
    if to_nodes["to_nodes"] is not None:  # issue 33, item 7: as shuffle --to-nodes, on --nodes N
        if None in (to_nodes["ranks_per_node"], to_nodes["micro_batch"], to_nodes["nodes"]):
            raise click.UsageError("plan shuffle --to-nodes needs --nodes N, --ranks-per-node K and --micro-batch M")
        if kw.get("scratch") is not None:
            raise click.UsageError("--to-nodes writes no scratch to the shared filesystem; drop --scratch")
        if kw.get("like") is not None or kw.get("holdout") is not None:
            raise click.UsageError("--to-nodes takes its SOURCEs (or --schedule) and settings; drop --like/--holdout")
    elif any(v is not None for v in to_nodes.values()):
        raise click.UsageError(
            "--ranks-per-node, --micro-batch, --keep-sources, --nodes, --shared-mbps and "
            "--nic-mbps go with --to-nodes DEST"
        )
    else:
        to_nodes = {}
    _emit_plan(
        "shuffle",
        as_json,
        _weighted_sources(sources) if sources else None,
        output,
        epochs=epochs,
        executor=_executor_config(kw),
        **kw,
        **to_nodes,
    )


@_planned(pack)
def plan_pack(inputs, output, as_json, **kw):
    _emit_plan("pack", as_json, list(inputs), output, executor=_executor_config(kw), **kw)


@_planned(stage)
def plan_stage(directory, dest, as_json, **kw):
    _stage_selection(kw)
    _emit_plan("stage", as_json, directory, dest, **_micro_batch_of(kw))


if __name__ == "__main__":
    main()
