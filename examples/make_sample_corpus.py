"""Regenerates examples/tokenizer.json and examples/sample-corpus/ (about 1 MB).

Nothing is downloaded: the text is generated here from a small seeded grammar, the
byte-level BPE tokenizer is trained on it with `tokenizers`, and the corpus is written by
datatrove's own DocumentTokenizer (two ranks, documents shuffled within each file), so the
folder is exactly what a datatrove tokenization job produces. The .ds.metadata files name
the tokenizer as "../tokenizer.json", relative to the corpus, which is how `tokpack pack`
finds the EOS id and the vocabulary without options.

    python examples/make_sample_corpus.py
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
EOS = "<|endoftext|>"
SUBJECTS = "the model|a tokenizer|the shuffle|each epoch|our loader|the cluster|a long document|the manifest|every shard|the team".split(
    "|"
)
VERBS = "reads|writes|packs|checks|streams|counts|splits|verifies|copies|mixes|repeats|skips".split("|")
OBJECTS = (
    "tokens|samples|documents|windows|bytes|checksums|indexes|batches|files|epochs|sequences|boundaries|weights|seeds"
).split("|")
ADVERBS = "quickly|twice|in order|at random|on local disk|without an index|per epoch|in blocks|once".split("|")
TOPICS = ("Training notes|Data report|Incident summary|Design memo|Benchmark log|Release note").split("|")


def sentence(rng: random.Random) -> str:
    s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.randint(2, 9999)} {rng.choice(OBJECTS)}"
    if rng.random() < 0.6:
        s += f" {rng.choice(ADVERBS)}"
    return s[0].upper() + s[1:] + rng.choice(".!.?.")


def document(rng: random.Random) -> str:
    # long-tailed lengths, as in real corpora: a few long documents among many short ones
    n = min(int(rng.paretovariate(1.3) * 4), 400)
    paragraphs = [" ".join(sentence(rng) for _ in range(rng.randint(1, 6))) for _ in range(max(1, n // 4))]
    return f"{rng.choice(TOPICS)} {rng.randint(1, 999)}\n\n" + "\n\n".join(paragraphs)


def main(n_docs: int = 5000, seed: int = 0) -> None:
    from datatrove.data import Document
    from datatrove.pipeline.tokens.tokenizer import DocumentTokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    docs = [document(rng) for _ in range(n_docs)]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        docs, trainer=trainers.BpeTrainer(vocab_size=1024, special_tokens=[EOS], show_progress=False)
    )
    tok.save(str(HERE / "tokenizer.json"))

    out = HERE / "sample-corpus"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    cwd = os.getcwd()
    os.chdir(out)  # so the metadata names the tokenizer relative to the corpus
    try:
        half = len(docs) // 2
        for rank, part in enumerate((docs[:half], docs[half:])):
            stream = (Document(text=t, id=f"{rank}-{i}") for i, t in enumerate(part))
            DocumentTokenizer(".", tokenizer_name_or_path="../tokenizer.json", eos_token=EOS, seed=seed).run(
                stream, rank=rank, world_size=2
            )
    finally:
        os.chdir(cwd)
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {out} ({size / 1e6:.2f} MB, {len(docs)} documents) and {HERE / 'tokenizer.json'}")


if __name__ == "__main__":
    main()
