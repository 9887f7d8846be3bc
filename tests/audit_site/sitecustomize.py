"""Put on PYTHONPATH by tests/probes.py: every Python process of a tested command (the command,
its forkserver, pool and datatrove workers) records what it opens and changes on disk.

Active only when $TOKPACK_AUDIT_LOG names the log file; one line per event, tab-separated:
pid, event, absolute path, mode, flags. Only paths under $TOKPACK_AUDIT_ROOT (or under /dev)
are recorded, so the interpreter's own imports do not fill the log."""

import os
import sys

_LOG = os.environ.get("TOKPACK_AUDIT_LOG")
if _LOG:
    _ROOT = os.path.abspath(os.environ.get("TOKPACK_AUDIT_ROOT") or "/").rstrip("/") + "/"
    _FD = os.open(_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)  # before the hook
    _EVENTS = ("open", "os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.link", "os.symlink",
               "os.truncate", "shutil.rmtree", "shutil.move", "shutil.copyfile")

    def _hook(event, args, _fd=_FD, _root=_ROOT, _events=_EVENTS, _os=os):
        if event not in _events or not args or not isinstance(args[0], (str, bytes, _os.PathLike)):
            return
        try:
            path = _os.path.abspath(_os.fsdecode(args[0]))
        except (TypeError, ValueError):
            return
        if not (path.startswith(_root) or path + "/" == _root or path.startswith("/dev/")):
            return
        mode = args[1] if event == "open" and len(args) > 1 else ""
        flags = args[2] if event == "open" and len(args) > 2 else 0
        line = f"{_os.getpid()}\t{event}\t{path.replace(chr(10), ' ')}\t{mode or ''}\t{flags or 0}\n"
        _os.write(_fd, line.encode("utf-8", "surrogateescape"))

    sys.addaudithook(_hook)
