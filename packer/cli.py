"""`tokpack` command line: a thin layer over the Python API.

Exit status (docs/COMMANDS.md, "Exit status"): 0 success; 1 the data, the input or the
environment is wrong (a full disk, a read-only output, a symlink loop, an output directory
another command holds, a store that cannot be reached); 2 a usage error (click's); 70 a bug in
tokpack (EX_SOFTWARE of sysexits.h); 130 Ctrl-C; 143 SIGTERM. A failure is one line on stderr, never a
traceback (a bug's traceback goes to a log file, or to stderr under `--debug`), and under
`--json` stdout holds exactly one JSON object, `{"ok": false, "error": {...}}` on any failure.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time

import click

from tokpack.packer import cli_report

from tokpack.packer.cli_plan import plan
from tokpack.packer.cli_report import EXIT_INTERRUPTED, HINT_MARK, STOPPED, Terminated, error_json, internal_error
from tokpack.packer.cli_report import stopped
from tokpack.packer.cli_runs import inspect, read, stage, validate
from tokpack.packer.cli_write import pack, shuffle


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


def _raising(stop: type[BaseException]):
    """The signal handler that raises `stop` in the main thread, the process ending soon after whatever happens."""

    def handler(signum, frame):
        done = cli_report.done_status()
        _exit_soon(STOPPED[stop][1] if done is None else done)
        if done is None:
            raise stop()
        # The result is printed (or being printed), the work committed, the lock released: the
        # command ends as it would have, with its own status (was 143, and under --json a second
        # object, "ok": false, after the "ok": true one).

    return handler


@atexit.register  # registered at import: runs after the handlers a command registers (last in, first out)
def _ignore_stops_once_done() -> None:
    """The interpreter's teardown, after atexit, puts back the default action of every signal
    handled in Python: a SIGTERM there killed a command that had printed its result (status 143).
    Its own process, done: ignored from here on (nothing is left that a signal could stop)."""
    if _OWN_PROCESS and cli_report.done_status() is not None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)


class _Tokpack(click.Group):
    """The command group, reporting what click itself refuses (usage errors) as the commands
    report their failures: one line, and one JSON object on stdout under --json."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        global _OWN_PROCESS
        _OWN_PROCESS = args is None and threading.current_thread() is threading.main_thread()
        argv = list(sys.argv[1:] if args is None else args)
        cli_report.start("--debug" in argv)
        as_json = "--json" in argv
        # SIGTERM (a scheduler's kill, `timeout`) unwinds like Ctrl-C: the lock and temporary
        # files are released. An embedding application's own handler is left alone.
        previous = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
        if previous is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _raising(Terminated))
        interrupt = signal.getsignal(signal.SIGINT) if previous is not None else None
        # A background job of a non-interactive shell (`cmd &` in a script, nohup) inherits SIGINT
        # ignored, and Python then installs no handler: tokpack's own process takes Ctrl-C back,
        # so that SIGINT stops it wherever it runs (and its worker processes, started after this).
        catch_interrupt = interrupt is signal.default_int_handler or (interrupt is signal.SIG_IGN and _OWN_PROCESS)
        if catch_interrupt:  # Ctrl-C as Python's, with the same grace
            signal.signal(signal.SIGINT, _raising(KeyboardInterrupt))
        try:
            result = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as e:
            message, ctx = e.format_message(), getattr(e, "ctx", None)
            # what click's "Try '... --help' for help." line says to do, where a script finds every other hint
            hint = f"see `{ctx.command_path} --help`" if ctx is not None and HINT_MARK not in message else None
            param = getattr(e, "param", None)  # the option click refused, as `where` names it in tokpack's errors
            where = max(param.opts, key=len) if isinstance(param, click.Option) else None
            cli_report.failure_json(error_json(type(e).__name__, message, hint=hint, where=where), as_json)
            e.show()
            sys.exit(e.exit_code)
        except click.Abort:
            sys.exit(EXIT_INTERRUPTED)
        except (Terminated, KeyboardInterrupt) as e:
            _, words, status = stopped(e)
            click.echo(f"tokpack: {words}", err=True)
            sys.exit(status)
        except Exception as e:  # noqa: BLE001 - outside any command (option parsing...): a bug too
            internal_error(next((a for a in argv if not a.startswith("-")), "command"), e, as_json)
        finally:
            # The process's own command line, its result printed: a stop while it exits (joining
            # threads, atexit) is the handler's, which lets it end with its status.
            done = _OWN_PROCESS and cli_report.done_status() is not None
            if previous is signal.SIG_DFL and not done:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if catch_interrupt and not done:
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
    cli_report.debug_on(debug)
    from loguru import logger

    # The command line is tokpack's own application: datatrove's messages belong in the task logs.
    logger.remove()


for command in (pack, shuffle, validate, read, inspect, stage, plan):
    main.add_command(command)


if __name__ == "__main__":
    main()
