"""Best-fit packing (`tokpack shuffle --packing best-fit`) against concat, and against
OLMo-core's own optimized best-fit decreasing, on documents of real tokenized text.

    python bench/packing.py [--runs 3] [--copies 4] [--quick]
    python bench/packing.py --cap-cache --copies 24 [--runs 3]   # out of core, capped page cache

The corpus is real text that ships with this machine's Python installations, tokenized by
pack with the repo's examples/tokenizer.json, in two sources:
  prose   the long descriptions of every installed package (`*.dist-info/METADATA`, all
          Python versions under the interpreter's prefix's parent, deduplicated), the Python
          language reference topics (`pydoc_data.topics`) and Rust's release notes (one document
          per version), if present: README-like English, a web-like heavy tail
  code    the Python standard library's own `.py` files (one document per file)
`--copies K` repeats each source's documents K times (a new shard each), so timings are not
all interpreter start-up; the length distribution is unchanged.

Tables, at seq_len 2048 and 4096:
  cuts      documents cut (and tokens in cut documents) under concat (a document is cut when
            it crosses a window boundary) and best-fit (only documents longer than a row)
  padding   best-fit's padding per group size (tokpack's packer on the same lengths), next to
            OLMo-core's InstancePacker (ai2-olmo-core 3.0.0, `olmo_core/data/utils.py`: a
            segment-tree OBFD over all documents at once, long documents fragmented); its
            classes are compiled from the installed file (the package's __init__ needs cloud
            clients this bench has no use for), not copied
  speed     one epoch, in memory and out of core (--memory = 1/8 of the sources): concat vs
            best-fit vs cp -r + sync, alternating, cold cache when root; peak RSS against
            --memory; "x concat" compares each best-fit case with concat on the same path.
            --cap-cache (root, a memory cgroup): the out-of-core cases only, against "cp twice +
            sync" (two reads, two writes: the out-of-core floor), each run in a cgroup whose
            memory, page cache included, is capped as bench/shuffle.py --cap-cache caps it
            (a third of the sources, or --memory + the process allowance if more): the
            sources must come from the disk, and the scratch go back to it
Needs ai2-olmo-core (bench only): `pip install --no-deps ai2-olmo-core==3.0.0` (or set
OLMO_CORE_PATH to a folder holding olmo_core/).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections import defaultdict, deque
from pathlib import Path

import numpy as np

sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench import common  # noqa: E402

TOKENIZER = common.REPO / "examples" / "tokenizer.json"


# -------------------------------------------------------------------- the corpus


def prose_documents() -> list[str]:
    root = Path(sys.prefix).parent  # every Python version installed next to this one
    seen, docs = set(), []
    for meta in sorted(root.glob("*/lib/python*/site-packages/*.dist-info/METADATA")):
        text = meta.read_text(errors="replace")
        body = text.split("\n\n", 1)[1] if "\n\n" in text else ""
        if len(body) > 40 and body not in seen:
            seen.add(body)
            docs.append(body)
    try:
        from pydoc_data.topics import topics

        docs.extend(v for v in topics.values() if len(v) > 40)
    except ImportError:
        pass
    for notes in sorted(Path.home().glob(".rustup/toolchains/stable-*/share/doc/rust/html/releases.md"))[:1]:
        parts = notes.read_text(errors="replace").split("\nVersion ")
        docs.extend("Version " + p for p in parts[1:] if len(p) > 40)
    return docs


def code_documents() -> list[str]:
    lib = Path(os.__file__).parent
    docs, seen = [], set()
    for f in sorted(lib.rglob("*.py")):
        rel = f.relative_to(lib).parts
        if rel[0] in ("site-packages", "test", "idlelib", "lib2to3") or "tests" in rel:
            continue
        text = f.read_text(errors="replace")
        if len(text) > 40 and text not in seen:
            seen.add(text)
            docs.append(text)
    return docs


def build_sources(root: Path, copies: int) -> dict[str, Path]:
    from tokpack.packer.api import pack

    out = {}
    for name, docs in (("prose", prose_documents()), ("code", code_documents())):
        raw = root / f"{name}-text"
        raw.mkdir(parents=True, exist_ok=True)
        for c in range(copies):
            with open(raw / f"part-{c:03d}.jsonl", "w") as f:
                for d in docs:
                    f.write(json.dumps({"text": d}) + "\n")
        pack([str(raw)], str(root / name), input_format="text", tokenizer=str(TOKENIZER), shard_tokens=1 << 24)
        shutil.rmtree(raw)
        out[name] = root / name
    return out


# -------------------------------------------------------------------- OLMo-core's packer


def olmo_instance_packer():
    """OLMo-core's InstancePacker class, compiled from the installed olmo_core/data/utils.py."""
    base = os.environ.get("OLMO_CORE_PATH")
    if base:
        path = Path(base) / "olmo_core" / "data" / "utils.py"
    else:
        spec = importlib.util.find_spec("olmo_core")
        if spec is None or not spec.submodule_search_locations:
            return None
        path = Path(list(spec.submodule_search_locations)[0]) / "data" / "utils.py"
    if not path.exists():
        return None
    tree = ast.parse(path.read_text())
    keep = [
        n
        for n in tree.body
        if isinstance(n, ast.ClassDef) and n.name in ("SegmentTreeNode", "SegmentTree", "InstancePacker")
    ]
    from typing import Dict, List, Optional, Tuple

    from dataclasses import dataclass

    import types

    module = types.ModuleType("olmo_core_data_utils_bench")  # dataclass needs its class's module
    sys.modules[module.__name__] = module
    module.__dict__.update(
        np=np,
        deque=deque,
        defaultdict=defaultdict,
        dataclass=dataclass,
        Dict=Dict,
        List=List,
        Optional=Optional,
        Tuple=Tuple,
        math=__import__("math"),
    )
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec"), module.__dict__)
    return module.InstancePacker


def olmo_padding(packer_cls, lengths: np.ndarray, row: int) -> tuple[int, int]:
    """(instances, padding tokens) of OLMo-core's OBFD on these documents, long ones fragmented
    into row-sized pieces and a tail (its LongDocStrategy.fragment)."""
    full = lengths // row
    pieces = np.concatenate([np.full(int(full.sum()), row, np.int64), (lengths % row)[lengths % row > 0]])
    ends = np.cumsum(pieces)
    idx = np.stack([ends - pieces, ends], axis=1).astype(np.uint64)
    instances, _, total = packer_cls(row).pack_documents(idx)
    return len(instances), len(instances) * row - int(total)


# -------------------------------------------------------------------- figures


def cut_rows(lengths_by_source: dict[str, np.ndarray], row: int, groups: list[int], packer_cls) -> tuple[list, list]:
    from tokpack.shuffle.packed.passes import pack_pass
    from tokpack.shuffle.permutation import Bijection

    cuts, pads = [], []
    for name, lengths in lengths_by_source.items():
        ends = np.cumsum(lengths)
        starts = ends - lengths
        concat_cut = starts // row != (ends - 1) // row
        long = lengths > row
        total = int(lengths.sum())
        cuts.append(
            {
                "seq_len": row - 1,
                "source": name,
                "documents": len(lengths),
                "tokens": total,
                "concat: cut docs": f"{int(concat_cut.sum()):,} ({concat_cut.mean():.1%})",
                "concat: tokens in cut docs": f"{lengths[concat_cut].sum() / total:.1%}",
                "best-fit: cut docs": f"{int(long.sum()):,} ({long.mean():.1%})",
                "best-fit: tokens in cut docs": f"{lengths[long].sum() / total:.1%}",
            }
        )
        for g in groups:
            import time

            t0 = time.perf_counter()
            pr = pack_pass(lengths, Bijection(len(lengths), "docs", 1, 0, 0), row, g)
            pads.append(
                {
                    "seq_len": row - 1,
                    "source": name,
                    "packer": f"tokpack, group 2^{g.bit_length() - 1}" + (" (default)" if g == DEFAULT_GROUP else ""),
                    "rows": pr.rows,
                    "padding": f"{1 - total / (pr.rows * row):.3%}",
                    "seconds": round(time.perf_counter() - t0, 2),
                }
            )
        if packer_cls is not None:
            import time

            t0 = time.perf_counter()
            n, pad = olmo_padding(packer_cls, lengths, row - 1)  # its instances: a power of 2 tokens
            pads.append(
                {
                    "seq_len": row - 1,
                    "source": name,
                    "packer": f"OLMo-core OBFD, all documents, rows of {row - 1}",
                    "rows": n,
                    "padding": f"{pad / (n * (row - 1)):.3%}",
                    "seconds": round(time.perf_counter() - t0, 2),
                }
            )
    return cuts, pads


def shuffle_cmd(sources: dict[str, Path], out: Path, seq_len: int, packing: str, memory: str) -> list[str]:
    args = dict(seq_len=seq_len, seed=1, epochs=1, memory=common.parse_size(memory), packing=packing, progress=False)
    return common.python_cmd(
        f"from tokpack.packer.api import shuffle\nshuffle({[str(p) for p in sources.values()]!r}, "
        f"{str(out)!r}, **{args!r})"
    )


DEFAULT_GROUP = 1 << 22


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--memory", default="4GiB")
    ap.add_argument("--quick", action="store_true", help="one copy, one run, no speed table")
    ap.add_argument("--cap-cache", action="store_true", help="out of core only, page cache capped (root)")
    args = ap.parse_args()
    from tokpack.formats.shards import PackedSource
    from tokpack.shuffle.packed.packed_plan import DEFAULT_GROUP_TOKENS
    from tokpack.shuffle.packed.passes import documents_of

    assert DEFAULT_GROUP_TOKENS == DEFAULT_GROUP
    work = Path(tempfile.mkdtemp(prefix="tokpack-bench-packing-"))
    try:
        sources = build_sources(work / "src", 1 if args.quick else args.copies)
        lengths = {name: documents_of(PackedSource.open(p))[1] for name, p in sources.items()}
        print(f"machine: {common.machine_line()}")
        for name, ls in lengths.items():
            print(
                f"{name}: {len(ls):,} documents, {int(ls.sum()):,} tokens, median {int(np.median(ls))}, "
                f"mean {ls.mean():.0f}, p90 {int(np.percentile(ls, 90))}, max {int(ls.max())}"
            )
        packer_cls = olmo_instance_packer()
        if packer_cls is None:
            print("OLMo-core not found: pip install --no-deps ai2-olmo-core==3.0.0, or set OLMO_CORE_PATH")
        for seq_len in (2048, 4096):
            cuts, pads = cut_rows(lengths, seq_len + 1, [1 << 18, 1 << 20, DEFAULT_GROUP, 1 << 24], packer_cls)
            common.print_table(f"Cuts at seq_len {seq_len}", cuts, list(cuts[0]))
            common.print_table(f"Padding at seq_len {seq_len}", pads, list(pads[0]))
        if args.quick:
            return
        data = common.dir_bytes(work / "src")
        small = f"{max(1, data // 8 // 2**20)}MiB"  # out of core, as bench/shuffle.py
        base_case, capped = "cp -r + sync", None
        if args.cap_cache:
            base_case = "cp twice + sync"
            capped = common.cap_page_cache(max(data // 3, common.parse_size(small) + common.PROCESS_ALLOWANCE))
            print(capped)
        for seq_len in (2048, 4096):
            cases = [
                (base_case, lambda: common.cp_sync(work / "src", work / "copy"))
                if not capped
                else (base_case, lambda: common.cp_twice_sync(work / "src", work / "copy", work / "copy2"))
            ]
            for packing in ("concat", "best-fit"):
                for where, memory in (("", args.memory), (" (out of core)", small)):
                    if capped and not where:  # the in-memory path holds more than the cap
                        continue
                    out = work / f"run-{packing}"

                    def run(out=out, packing=packing, memory=memory):
                        shutil.rmtree(out, ignore_errors=True)
                        return common.run_measured(shuffle_cmd(sources, out, seq_len, packing, memory))

                    cases.append((f"tokpack {packing}{where}", (run, memory)))
            memories = {name: fn[1] for name, fn in cases[1:]}
            cases = [(name, fn if callable(fn) else fn[0]) for name, fn in cases]
            results = common.alternate(cases, args.runs)
            for junk in ("copy", "copy2"):
                shutil.rmtree(work / junk, ignore_errors=True)
            base = results[base_case]
            rows = []
            for name, ms in results.items():
                med, lo, hi = common.paired_ratio(ms, base)
                rows.append(
                    {
                        "case": name,
                        "median s": sorted(m.seconds for m in ms)[len(ms) // 2],
                        "x cp" if not capped else "x floor": f"{med:.2f} ({common.ratio_range(lo, hi)})",
                        "x concat": ""
                        if name == base_case
                        else f"{common.paired_ratio(ms, results[name.replace('best-fit', 'concat')])[0]:.2f}",
                        "peak RSS MB": round(max(m.peak_rss_mb for m in ms)),
                        "--memory": memories.get(name, ""),
                    }
                )
            common.print_table(
                f"One epoch at seq_len {seq_len} ({sum(int(x.sum()) for x in lengths.values()):,} "
                f"tokens, {args.runs} rounds{'; ' + capped if capped else ''})",
                rows,
                list(rows[0]),
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
