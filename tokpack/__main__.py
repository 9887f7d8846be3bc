"""`python -m tokpack ARGS` and the `tokpack` console script: the `tokpack` command."""

import json
import os
import sys


def main() -> None:
    # The command does no linear algebra, and numpy's OpenBLAS starts a thread a core at import
    # that polls for work before it sleeps: about 0.1 s of CPU a process for nothing (measured
    # here: `import numpy` 0.22 s of CPU against 0.09 s), times every process of an MPI job. A
    # setting of the user's own stays.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    # Loading the command's modules (numpy, click, datatrove...) takes about 0.2 s, before the
    # command installs its own Ctrl-C handling: a Ctrl-C then is a plain stop, nothing begun.
    try:
        from tokpack.packer.cli import main as command
    except KeyboardInterrupt:
        if "--json" in sys.argv[1:]:
            error = {"error": "KeyboardInterrupt", "message": "interrupted", "file": None}
            error.update(where=None, expected=None, found=None, hint="nothing was begun")
            print(json.dumps({"ok": False, "error": error}))
        sys.stderr.write("tokpack: interrupted before the command began; nothing was written\n")
        sys.exit(130)
    command()


if __name__ == "__main__":
    main()
