"""What a `tokpack` command prints: its result (emit: one JSON object under --json, else lines),
and its failures (user_errors: one line on stderr, one JSON object on stdout under --json, and
the exit status tokpack.packer.cli documents)."""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import select
import sys
import traceback

import click

from tokpack.formats.errors import TokpackError, UsageError, os_failure, symlink_loop
from tokpack.formats.io.progress_log import logging_every
from tokpack.packer.cli_options import given_log_interval


def emit(result, as_json: bool, report_lines=None, err: bool = False, shown: dict | None = None) -> None:
    """One machine-readable object on stdout with --json; otherwise the `report_lines(result)`
    of a command that has them (on stderr if `err`), or a short human summary (with `shown`'s
    values instead of the summary's, for humans)."""
    global _DONE
    summary = result.to_json()
    # done from here: a stop while this prints lets it finish (tokpack.packer.cli), the status its own
    _DONE = EXIT_DATA if summary.get("ok") is False else 0  # validate's failed checks exit 1
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


def done_status() -> int | None:
    """The exit status of the command whose result is printed or being printed (its work done, its
    lock released), None before: a Ctrl-C or SIGTERM then stops nothing, so it must not turn the
    printed `"ok": true` into 143 and a second, failed JSON object (tokpack.packer.cli)."""
    return _DONE


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that `finally` blocks (the output lock, temporary
    files) run as for Ctrl-C. A BaseException: no `except Exception` swallows it."""


EXIT_DATA, EXIT_USAGE, EXIT_BUG, EXIT_INTERRUPTED, EXIT_TERMINATED = 1, 2, 70, 130, 143
# What stops a command from outside (Ctrl-C, SIGTERM) -> its words and its exit status
STOPPED = {KeyboardInterrupt: ("interrupted", EXIT_INTERRUPTED), Terminated: ("terminated (SIGTERM)", EXIT_TERMINATED)}


def stopped(e: BaseException) -> tuple[str, str, int]:
    """(its --json error name, its words, its exit status) of a command that Ctrl-C or SIGTERM stopped."""
    return next((kind.__name__, *told) for kind, told in STOPPED.items() if isinstance(e, kind))


_DEBUG = False  # --debug: a bug's traceback goes to stderr instead of a log file
_FAILED = False  # a failure was reported already (its JSON object printed): report nothing more
_DONE: int | None = None  # done_status()


def start(debug: bool) -> None:
    """A command line starts (tokpack.packer.cli's group): nothing reported yet."""
    global _DEBUG, _FAILED, _DONE
    _DEBUG, _FAILED, _DONE = debug, False, None


def debug_on(debug: bool) -> None:
    """--debug, as the group's option parsed it."""
    global _DEBUG
    _DEBUG = _DEBUG or debug


def failure_json(error: dict, as_json: bool) -> None:
    """A failure's one JSON object on stdout under --json, unless a failure printed one already."""
    global _FAILED
    if as_json and not _FAILED:
        click.echo(json.dumps({"ok": False, "error": error}))
    _FAILED = True


def _report(line: str, error: dict, status: int, as_json: bool) -> None:
    """The one line on stderr, the one JSON object on stdout under --json, then exit."""
    failure_json(error, as_json)
    click.echo(line, err=True)
    sys.exit(status)


HINT_MARK = ". HINT: "  # how a line says what to do (TokpackError's str, click's message of a quantity)


def error_json(
    kind: str, message: str, file: str | None = None, hint: str | None = None, where: str | None = None
) -> dict:
    """The --json error object of a failure that is no TokpackError, a TokpackError's fields named
    `kind`. A message that says its hint (click's line for a bad TOKENS or BYTES value holds the
    parser's TokpackError line) gives it to `hint`, where a script finds every other failure's."""
    if hint is None and HINT_MARK in message:
        message, hint = message.split(HINT_MARK, 1)
    return {**TokpackError(message, file=file, where=where, hint=hint).to_json(), "error": kind}


def _os_error_line(e: OSError) -> tuple[str, dict]:
    err = os_failure(e)
    return f"tokpack: error: {err}", err.to_json()


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


def internal_error(command: str, exc: BaseException, as_json: bool) -> None:
    summary = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    if _DEBUG:
        traceback.print_exception(exc, file=sys.stderr)
        where = "above"
    else:
        where = _crash_log(command, exc)
    line = f"tokpack {command}: internal error (a bug in tokpack): {summary}; the traceback is {where}"
    _report(line, error_json("InternalError", line), EXIT_BUG, as_json)


RESUME = "rerun the same command to resume"
EXIT_PIPE = 128 + 13  # as a Unix tool killed by SIGPIPE: `tokpack read ... | head` under `set -o pipefail`


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has gone (`| head` took what it wanted): poll says
    POLLERR there. A broken pipe elsewhere (a socket to storage) is an error to report."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poll.poll(0))
    except (OSError, ValueError, AttributeError):  # no real stdout (a test's capture)
        return False


def _quiet_exit_for_closed_stdout() -> None:
    """What the reader of stdout wanted, it read: no line (nobody reads it). stdout points at
    /dev/null, so the interpreter's last flush of what was buffered for it fails on nothing."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    sys.exit(EXIT_PIPE)


def user_errors(fn):
    """Turns every failure of a command into one line on stderr (and one JSON object under
    --json): TokpackError and OSError exit 1, Ctrl-C 130, SIGTERM 143, a bug in tokpack 70; a
    stdout whose reader left (`| head`) 141, with no line."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        as_json = bool(kwargs.get("as_json"))
        ctx = click.get_current_context(silent=True)
        command = ctx.info_name if ctx is not None else "command"
        try:
            with logging_every(given_log_interval(ctx, as_json)):
                return fn(*args, **kwargs)
        except (SystemExit, click.exceptions.Exit, click.ClickException, click.Abort):
            raise  # a status chosen already, or a usage error: main reports those
        except UsageError as e:  # the API's usage checks (tokpack.packer.api): click's usage error
            raise click.UsageError(e.message) from None
        except TokpackError as e:
            _report(f"tokpack: error: {e}", e.to_json(), getattr(e, "exit_status", EXIT_DATA), as_json)
        except ModuleNotFoundError as e:  # an optional dependency this command needs
            message = f"this command needs the module {e.name!r}, which is not installed"
            line = f"tokpack: error: {message}{HINT_MARK}pip install {e.name}"
            _report(line, error_json("ModuleNotFoundError", message, hint=f"pip install {e.name}"), EXIT_DATA, as_json)
        except BrokenPipeError as e:
            if not _stdout_gone():
                _report(*_os_error_line(e), EXIT_DATA, as_json)
            _quiet_exit_for_closed_stdout()
        except OSError as e:  # the environment: a full disk, a read-only output, a symlink loop...
            _report(*_os_error_line(e), EXIT_DATA, as_json)
        except RuntimeError as e:
            loop = symlink_loop(e)
            if loop is None:
                internal_error(command, e, as_json)
            _report(*_os_error_line(loop), EXIT_DATA, as_json)
        except (KeyboardInterrupt, Terminated) as e:
            kind, words, status = stopped(e)
            _report(f"tokpack: {words}; {RESUME}", error_json(kind, words, hint=RESUME), status, as_json)
        except Exception as e:  # noqa: BLE001 - anything else is a bug in tokpack, not bad data
            internal_error(command, e, as_json)

    return wrapper
