"""`tokpack read --tokenizer`: the samples a rank is fed, as text (issue 43), over the shipped
sample corpus and its real tokenizer; the default output stays the token ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from tokpack.packer.cli import main

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TOKENIZER = EXAMPLES / "tokenizer.json"


def cli(*args) -> tuple[int, str, str]:
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.stdout, r.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The sample corpus packed, then shuffled into a window run and a best-fit run (seq_len 64)."""
    root = tmp_path_factory.mktemp("read-text")
    assert cli("pack", EXAMPLES / "sample-corpus", "-o", root / "src")[0] == 0
    out = {}
    for packing in ("concat", "best-fit"):
        out[packing] = root / packing
        code, _, err = cli(
            "shuffle",
            root / "src",
            "-o",
            out[packing],
            "--seq-len",
            64,
            "--seed",
            3,
            "--epochs",
            1,
            "--packing",
            packing,
        )
        assert code == 0, err
    return out


@pytest.mark.parametrize("packing", ["concat", "best-fit"])
def test_read_json_text_is_the_tokens_decoded(runs, packing):
    """Each sample's "text" is its real tokens decoded by the tokenizer (EOS as the tokenizer's own
    `<|endoftext|>`), a best-fit row's padding left out of the text and counted in "padding"; the
    tokens are the ones `read --json` prints without a tokenizer."""
    from tokenizers import Tokenizer

    from tokpack.loader.reader import SampleReader

    tok = Tokenizer.from_file(str(TOKENIZER))
    code, plain, _ = cli("read", runs[packing], "--count", 40, "--json")
    assert code == 0
    code, out, err = cli("read", runs[packing], "--count", 40, "--json", "--tokenizer", TOKENIZER)
    assert code == 0, err
    with_text = [json.loads(line) for line in out.splitlines()]
    assert [{k: v for k, v in s.items() if k not in ("text", "padding")} for s in with_text] == [
        json.loads(line) for line in plain.splitlines()
    ]
    reader = SampleReader.open(runs[packing])
    pads = reader.padding(0, 40) if reader.packed else [0] * 40
    assert [s["padding"] for s in with_text] == [int(p) for p in pads]
    if packing == "best-fit":
        assert any(s["padding"] for s in with_text)  # the case is exercised
    assert any("<|endoftext|>" in s["text"] for s in with_text)
    for s in with_text:
        real = s["tokens"][: len(s["tokens"]) - s["padding"]]
        marker = f"[padding: {s['padding']} tokens]" if s["padding"] else ""
        assert s["text"] == tok.decode(real, skip_special_tokens=False) + marker


def test_read_text_lines_and_default_unchanged(runs):
    """Without --tokenizer the ids line is unchanged; with it, a header line a sample and its text
    indented under it, so no line of the text can be taken for a sample's start."""
    code, out, _ = cli("read", runs["concat"], "--count", 2)
    assert code == 0
    assert out.splitlines()[0].startswith("epoch 0 sample 0 rank 0: [")
    code, out, err = cli("read", runs["concat"], "--count", 2, "--tokenizer", TOKENIZER)
    assert code == 0, err
    headers = [line for line in out.splitlines() if not line.startswith("    ") and line]
    assert headers == ["epoch 0 sample 0 rank 0:", "epoch 0 sample 1 rank 0:"]
    assert "epoch" in out.split("\n", 1)[1]  # the corpus's words, not ids


def test_read_with_a_smaller_tokenizer_is_refused(runs, tmp_path):
    """An id the tokenizer does not have is refused in one line (tokenizers would drop it silently)."""
    from tokenizers import Tokenizer, models

    small = tmp_path / "small.json"
    Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[])).save(str(small))
    code, out, err = cli("read", runs["concat"], "--count", 1, "--tokenizer", small)
    assert code == 1 and out == ""
    assert "beyond the tokenizer's vocabulary" in err and "HINT" in err
