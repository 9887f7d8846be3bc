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
    _EVENTS = (
        "open",
        "os.mkdir",
        "os.rename",
        "os.remove",
        "os.rmdir",
        "os.link",
        "os.symlink",
        "os.truncate",
        "shutil.rmtree",
        "shutil.move",
        "shutil.copyfile",
    )

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

# What each process hashes, by the module that feeds the hash: active only when
# $TOKPACK_HASH_LOG names the log file; one line per feed, tab-separated: pid, module, bytes
# (tests/probes.py hashed). xxhash's xxh3_128 and xxh3_128_hexdigest are wrapped before any
# tokpack module imports them.
_HASH_LOG = os.environ.get("TOKPACK_HASH_LOG")
if _HASH_LOG:
    import xxhash

    _HASH_FD = os.open(_HASH_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    _xxh3_128, _xxh3_128_hexdigest = xxhash.xxh3_128, xxhash.xxh3_128_hexdigest

    def _fed(data, depth=2, _fd=_HASH_FD, _os=os, _sys=sys):
        n = data.nbytes if hasattr(data, "nbytes") else len(data)
        module = _sys._getframe(depth).f_globals.get("__name__", "?")
        _os.write(_fd, f"{_os.getpid()}\t{module}\t{n}\n".encode())

    class _Counted:
        def __init__(self, data=b"", *args, **kwargs):
            if len(data):
                _fed(data)
            self._h = _xxh3_128(data, *args, **kwargs)

        def update(self, data):
            _fed(data)
            self._h.update(data)

        def __getattr__(self, name):
            return getattr(self._h, name)

    def _hexdigest(data, *args, **kwargs):
        _fed(data)
        return _xxh3_128_hexdigest(data, *args, **kwargs)

    xxhash.xxh3_128, xxhash.xxh3_128_hexdigest = _Counted, _hexdigest
