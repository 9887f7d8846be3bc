"""`python -m tokpack ARGS`: the `tokpack` command."""

from tokpack.packer.cli import main

main()
