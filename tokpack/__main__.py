"""`python -m tokpack ARGS` and the `tokpack` console script: the `tokpack` command."""

import json
import sys


def main() -> None:
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
