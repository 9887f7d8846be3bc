"""docs/COMMANDS.md as a reference a user scans (issue 43, item 2): each command's section opens
with its options table and examples, which are what `tokpack COMMAND --help` prints (made here
from click's own help records, so the page cannot drift from the CLI), and every link into the
page lands on a heading.

After changing an option: `PYTHONPATH=. python tests/test_commands_md.py` rewrites the tables."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import click

from conftest import project_files

REPO = Path(__file__).resolve().parents[1]
COMMANDS_MD = REPO / "docs" / "COMMANDS.md"
# Each command section of the page, by its heading, and the commands whose options it shows.
SECTIONS = {
    "## Packing: `tokpack pack`": [("pack",)],
    "## Reading what a rank is fed: `tokpack read`": [("read",)],
    "## Shuffling: `tokpack shuffle`": [("shuffle",)],
    "## Planning a run: `tokpack plan`": [("plan", "shuffle"), ("plan", "pack"), ("plan", "stage")],
    "## Validating: `tokpack validate`": [("validate",)],
    "## Staging to local disk: `tokpack stage`": [("stage",)],
    "## Inspecting a directory: `tokpack inspect`": [("inspect",)],
}
HOW = "**How it works.**"


def _command(path: tuple[str, ...]) -> tuple[click.Command, click.Context]:
    from tokpack.packer.cli import main

    ctx = click.Context(main, info_name="tokpack")
    cmd = main
    for name in path:
        cmd = cmd.commands[name]
        ctx = click.Context(cmd, info_name=name, parent=ctx)
    return cmd, ctx


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _examples(cmd: click.Command) -> list[str]:
    """The lines under "Example:" in the command's help, as --help indents them."""
    lines, taken = (cmd.help or "").splitlines(), []
    for i, line in enumerate(lines):
        if line.strip().startswith("Example"):
            for rest in lines[i + 1 :]:
                if rest.strip() == "\b":
                    continue
                if not rest.strip():
                    break
                taken.append(rest)
            break
    return textwrap.dedent("\n".join(taken)).splitlines() if taken else []


def options_block(path: tuple[str, ...]) -> str:
    """The options table (and examples) of `tokpack PATH`, from click's help records."""
    cmd, ctx = _command(path)
    name = " ".join(path)
    usage = " ".join(["tokpack", *path, *cmd.collect_usage_pieces(ctx)])
    rows = []
    for param in cmd.get_params(ctx):
        record = param.get_help_record(ctx)
        if isinstance(param, click.Option) and record and record[0] != "-h, --help" and "--help" not in record[0]:
            rows.append(f"| `{_cell(record[0])}` | {_cell(record[1])} |")
    block = [
        f"**`tokpack {name}` options** (`{usage}`; `tokpack {name} --help` prints the same):",
        "",
        "| Option | Meaning |",
        "| --- | --- |",
        *rows,
    ]
    if examples := _examples(cmd):
        block += ["", "Examples:", "", "```bash", *examples, "```"]
    return "\n".join(block)


def rewrite(text: str) -> str:
    """text with each section's options blocks made anew (between its synopsis and HOW)."""
    for heading, paths in SECTIONS.items():
        head = text.index(heading + "\n")
        start = text.index("**`tokpack ", head)
        end = text.index(HOW, start)
        text = text[:start] + "\n\n".join(options_block(p) for p in paths) + "\n\n" + text[end:]
    return text


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_each_command_section_opens_with_its_options_as_help_prints_them():
    text = COMMANDS_MD.read_text()
    assert rewrite(text) == text, "docs/COMMANDS.md's options tables differ from --help: run " + __doc__.split("`")[-2]
    for heading, paths in SECTIONS.items():
        section = text.split(heading + "\n", 1)[1].split("\n## ", 1)[0]
        assert section.index("**`tokpack ") < section.index(HOW), heading  # options and examples first
        assert all(f"| `--{o}" not in section.split(HOW)[0] for o in ("help",)), heading
    assert "| `--seq-len INTEGER RANGE` |" in text and "| `--seed INTEGER` |" in text  # the tables are there


def test_every_link_into_commands_md_lands_on_a_heading():
    """The index's links and every COMMANDS.md#anchor in the docs and the README."""
    text = COMMANDS_MD.read_text()
    anchors = {slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}
    links = [(COMMANDS_MD.name, a) for a in re.findall(r"\]\(#([^)]+)\)", text)]
    for doc in [REPO / "README.md", *project_files("docs", pattern="*.md", recursive=False)]:
        links += [(doc.name, a) for a in re.findall(r"COMMANDS\.md#([^)\s]+)", doc.read_text())]
    assert len(links) > 10
    assert [link for link in links if link[1] not in anchors] == []


def test_the_sections_other_files_cite_by_name_are_on_the_page():
    """Code, tests and docs cite `docs/COMMANDS.md, "NAME"`: each NAME is a heading or a bold
    paragraph's name on the page."""
    text = COMMANDS_MD.read_text()
    for name in (
        "Exit status",
        "Packing",
        "Linking instead of copying",
        "Schedules",
        "The shuffle algorithm",
        "Best-fit packing",
        "The table on disk",
        "Straight to the nodes",
        "Planning it",
        "Planning a run",
        "Validating",
        "Words",
        "Progress",
        "Containment",
        "The gate",
    ):
        assert re.search(rf"^#+ {re.escape(name)}|\*\*{re.escape(name)}", text, re.M), name


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    COMMANDS_MD.write_text(rewrite(COMMANDS_MD.read_text()))
