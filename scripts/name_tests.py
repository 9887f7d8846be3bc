"""How many modules name a packing algorithm, and how many test a manifest's kind by its string,
in the code (not comments or docstrings) of tokpack's packages at a git revision:

    python scripts/name_tests.py [REV]          # default HEAD; BENCHMARKS.md quotes its output

Issue 31's measure of "one home per fact": a packing's name belongs to the registry
(shuffle/packings.py) and its own module, a kind's string to the format (formats/constants.py).
"""

from __future__ import annotations

import ast
import subprocess
import sys

PACKING_NAMES = {"best-fit", "concat", "tokpack-feistel6-splitmix-xxh3-v1", "tokpack-bfd-feistel6-splitmix-xxh3-v1"}
PACKING_CONSTANTS = {"PACKED_ALGORITHM", "PLAN_ALGORITHM", "PACKINGS", "BEST_FIT"}
KINDS = {"source", "run", "epoch", "slice", "slice-epoch"}
KIND_CONSTANTS = {"SOURCE", "RUN", "EPOCH", "SLICE", "SLICE_EPOCH"}
FOLDERS = ("formats", "loader", "shuffle", "packer")


def _docstrings(tree) -> set[int]:
    return {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }


def _is_kind(node) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in KINDS
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_is_kind(e) for e in node.elts)
    return isinstance(node, ast.Name) and node.id in KIND_CONSTANTS


def scan(source: str) -> tuple[set[str], int]:
    """(why this module names a packing, how many comparisons test a kind by its string)."""
    tree = ast.parse(source)
    docs, why, kind_tests = _docstrings(tree), set(), 0
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs and n.value in PACKING_NAMES:
            why.add(repr(n.value))
        if (
            isinstance(n, ast.Name)
            and n.id in PACKING_CONSTANTS
            or isinstance(n, ast.Attribute)
            and n.attr in PACKING_CONSTANTS
        ):
            why.add(getattr(n, "id", None) or n.attr)
        if (
            isinstance(n, ast.Compare)
            and isinstance(n.left, ast.Constant)
            and n.left.value == "pad_xxh3_128"
            and any(isinstance(o, (ast.In, ast.NotIn)) for o in n.ops)
        ):
            why.add('"pad_xxh3_128" in')
        if (
            isinstance(n, ast.Compare)
            and any(isinstance(o, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for o in n.ops)
            and any(_is_kind(x) for x in [n.left, *n.comparators])
        ):
            kind_tests += 1
    return why, kind_tests


def main(rev: str = "HEAD") -> None:
    files = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", rev, *FOLDERS], capture_output=True, text=True, check=True
    ).stdout.split()
    packing, kinds = {}, {}
    for f in (f for f in files if f.endswith(".py")):
        why, n = scan(subprocess.run(["git", "show", f"{rev}:{f}"], capture_output=True, text=True, check=True).stdout)
        if why:
            packing[f] = sorted(why)
        if n:
            kinds[f] = n
    for f, w in sorted(packing.items()):
        print(f"names a packing: {f}: {', '.join(w)}")
    for f, n in sorted(kinds.items()):
        print(f"tests a kind:    {f}: {n}")
    print(
        f"{rev}: {len(packing)} modules name a packing algorithm; {len(kinds)} modules test a manifest's kind "
        f"by its string ({sum(kinds.values())} tests)"
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
