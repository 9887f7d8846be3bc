"""Pack's tokenizer policy: which tokenizer and vocabulary an input is packed with, its EOS
id, and the rules every packed document follows (ids below the vocabulary, no empty
documents, EOS last)."""

from __future__ import annotations

import os
import weakref
from pathlib import Path

import numpy as np

from tokpack.formats.errors import TokpackError
from tokpack.formats.inputs import Block, InputFile, input_error as _err
from tokpack.formats.io.memory import give_buffers, take_buffer
from tokpack.formats.names import dtype_for_vocab

EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")
# Hub tokenizers whose EOS id and vocabulary are fixed facts: datatrove metadata names them
# (its default is "gpt2") and tokpack never downloads, so without this they could not be used.
KNOWN_TOKENIZERS = {
    name: {"eos_id": 50256, "eos_token": "<|endoftext|>", "vocab_size": 50257}
    for name in ("gpt2", "openai-community/gpt2")
}


def resolve_vocab_eos(
    files: list[InputFile],
    tokenizer: str | None,
    eos_id: int | None,
    vocab_size: int | None,
    say,
    warnings: list,
) -> tuple[int, int, str, str | None, bool]:
    """(vocab_size, eos_id, tokenizer name, eos token text, vocab known) from the options, the
    tokenizer, the inputs' datatrove metadata (a local tokenizer file, else a KNOWN_TOKENIZERS name)
    or, for the vocabulary, the input dtype. Lines the user should read once the pack is done are
    appended to `warnings`; the vocabulary is not known (False) when it is only the input dtype's
    width (an upper bound the ids are checked against, not the tokenizer's)."""
    tok_path = tokenizer
    named = files[0].tokenizer
    if tok_path is None and named:
        # a metadata path is taken as written, then relative to the input's folder
        candidates = (Path(named), Path(files[0].path).parent / named)
        tok_path = next((str(c) for c in candidates if c.is_file()), None)
    tok = load_tokenizer(tok_path) if tok_path else None
    known = KNOWN_TOKENIZERS.get(named) if tok is None and named else None  # only when nothing more specific
    eos_token = None
    if vocab_size is None and tok is not None:
        vocab_size = tok.get_vocab_size(with_added_tokens=True)
    if vocab_size is None and known:
        vocab_size = known["vocab_size"]
    # a name in datatrove's metadata that is neither a local file nor a known tokenizer: a hub
    # name (tokpack never downloads), which the user can look up
    hub = named if named and tok is None and not known else None
    seen = f"; datatrove's metadata names the tokenizer {hub!r}, a hub name tokpack does not download" if hub else ""
    known_vocab = vocab_size is not None
    if vocab_size is None:
        # the vocabulary the input dtype can address, when that bounds it usefully (not 64-bit or float)
        dt = None if files[0].dtype is None else np.dtype(files[0].dtype)
        vocab_size = None if dt is None or dt.kind == "f" or dt.itemsize == 8 else int(np.iinfo(dt).max) + 1
        if vocab_size is not None and dtype_for_vocab(vocab_size).itemsize > 2:
            # every id the input dtype can hold must fit, so a 16-bit vocabulary costs twice the disk
            warnings.append(
                f"tokpack pack: vocabulary size unknown, so tokens are stored as uint32, the width "
                f"of the {files[0].dtype} input, and the manifest records the vocabulary as unknown "
                f"(vocab_known: false){seen}. HINT: pass --vocab-size N (or --tokenizer) to store "
                f"uint16 when the ids fit below 65536"
            )
        elif vocab_size is not None:
            # the id check then means nothing: every id the dtype holds passes it
            warnings.append(
                f"tokpack pack: vocabulary size unknown, so ids are checked only against the width of "
                f"the {files[0].dtype} input ({vocab_size}), and the manifest records the vocabulary as "
                f"unknown (vocab_known: false){seen}. HINT: pass --vocab-size N (or --tokenizer "
                f"tokenizer.json) to check every id against the vocabulary"
            )
    if vocab_size is None:
        raise TokpackError(
            "vocabulary size unknown",
            file=files[0].path,
            where="vocab_size",
            expected="--vocab-size, --tokenizer, or an input dtype narrower than 64 bits",
            found=f"{files[0].dtype or 'JSON integers'} token ids{seen}",
            hint="pass --vocab-size N or --tokenizer tokenizer.json" + (f" (saved locally from {hub})" if hub else ""),
        )
    if vocab_size < 1:
        raise TokpackError("vocabulary size must be positive", where="--vocab-size", expected=">= 1", found=vocab_size)
    if eos_id is None and tok is not None:  # the tokenizer's end-of-document token, by its usual names
        eos_token = next((token for token in EOS_TOKENS if tok.token_to_id(token) is not None), None)
        eos_id = None if eos_token is None else tok.token_to_id(eos_token)
    elif eos_id is not None and tok is not None:
        eos_token = tok.id_to_token(eos_id)
    if eos_id is None and known:
        eos_id, eos_token = known["eos_id"], known["eos_token"]
        say(f"tokpack pack: EOS id {eos_id} from the known tokenizer {named!r}")
    if eos_id is None:
        raise TokpackError(
            "EOS id unknown",
            file=tok_path or files[0].path,
            where="eos_id",
            expected="--eos-id, or a tokenizer with an end-of-text token",
            found=("none" + seen) if tok is None else "no <|endoftext|>, </s>, <|end_of_text|> or <eos> token",
            hint=(
                f"pass --eos-id N, the end-of-document id of {hub} (and --vocab-size N), or "
                f"--tokenizer with a tokenizer.json saved locally from {hub}"
            )
            if hub
            else "pass --eos-id N (or --tokenizer with a local tokenizer.json)",
        )
    if not 0 <= eos_id < vocab_size:
        raise TokpackError(
            "EOS id outside the vocabulary",
            where="eos_id",
            expected=f"0 <= eos_id < {vocab_size}",
            found=eos_id,
            hint="check --eos-id and --vocab-size",
        )
    name = tokenizer or named or "unknown"
    return int(vocab_size), int(eos_id), str(name), eos_token, known_vocab


def load_tokenizer(path: str):
    """A local tokenizer.json; nothing is ever downloaded."""
    if not os.path.isfile(path):
        raise TokpackError(
            "tokenizer is not a local file",
            file=path,
            where="--tokenizer",
            expected="a path to a tokenizer.json",
            found="no such file",
            hint="tokpack never downloads; save the tokenizer with tokenizer.save('tokenizer.json')",
        )
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises plain Exceptions for bad files
        raise TokpackError(
            "unreadable tokenizer",
            file=path,
            where="--tokenizer",
            expected="a tokenizers JSON file",
            found=str(e).splitlines()[0][:120],
            hint="give the tokenizer.json the corpus was tokenized with (saved by tokenizer.save('tokenizer.json'))",
        ) from None


class Normalizer:
    """Turns a reader's blocks into packed-source blocks: checks ids, drops empty documents,
    appends missing EOS and casts to the output dtype. Vectorised over the block; the EOS
    present case costs one max/min pass and a gather at the document ends."""

    def __init__(self, f: InputFile, vocab_size: int, eos_id: int, out_dtype: np.dtype):
        self.f = f  # the input, for messages
        self.vocab_size = vocab_size  # ids must be below it
        self.eos_id = eos_id  # every output document ends with it
        self.out_dtype = np.dtype(out_dtype).newbyteorder("<")  # uint16 or uint32
        self.out = take_buffer(self.out_dtype)  # reused cast target, this normalizer's own
        weakref.finalize(self, give_buffers, [self.out])
        self.eos_appended = 0  # documents that lacked EOS
        self.empty_dropped = 0  # documents with no tokens
        # The one id every document that lacked EOS ended with (None: none lacked it, or they
        # ended with several): when all documents lack EOS, that id is likely the input's EOS.
        self.end_id: int | None = None
        self._ends_mixed = False

    def __call__(self, b: Block) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        tokens, ends, loss = b.tokens, b.ends, b.loss
        if len(tokens):
            self._check_ids(b)
        keep = np.diff(ends, prepend=0) > 0
        if not keep.all():
            self.empty_dropped += int(len(ends) - keep.sum())
            ends = ends[keep]
        if len(ends) == 0:
            return tokens[:0].astype(self.out_dtype), ends, None if loss is None else loss[:0]
        last = tokens[ends - 1]
        missing = last != self.eos_id
        if missing.any():
            at = ends[missing]
            self.eos_appended += len(at)
            if not self._ends_mixed:
                lacking = last[missing]
                lo, hi = int(lacking.min()), int(lacking.max())
                if lo != hi or self.end_id not in (None, lo):
                    self._ends_mixed, self.end_id = True, None
                else:
                    self.end_id = lo
            tokens = np.insert(tokens.astype(self.out_dtype, copy=False), at, self.eos_id)
            if loss is not None:
                loss = np.insert(loss, at, 1)
            ends = ends + np.cumsum(missing)
        if tokens.dtype != self.out_dtype:
            out = self.out.ensure(len(tokens))[: len(tokens)]
            np.copyto(out, tokens, casting="unsafe")
            tokens = out
        return tokens, ends, loss

    def _check_ids(self, b: Block) -> None:
        t = b.tokens
        if t.dtype.kind == "f":
            bad = np.flatnonzero(~np.isfinite(t) | (t != np.floor(t)))
            if len(bad):
                self._fail("token id is not an integer", b, int(bad[0]), "integer values", t[bad[0]])
        if t.dtype.kind != "u" and t.min() < 0:
            i = int(np.argmax(t < 0))
            self._fail(
                "negative token id",
                b,
                i,
                f"ids in [0, {self.vocab_size})",
                int(t[i]),
                "the input holds negative ids; check --dtype or the input's dtype",
            )
        if t.max() >= self.vocab_size:
            i = int(np.argmax(t >= self.vocab_size))
            self._fail(
                "token id at or above vocab_size",
                b,
                i,
                f"< {self.vocab_size}",
                int(t[i]),
                "pass the right --vocab-size or --tokenizer, or fix the input",
            )

    def _fail(self, message, b: Block, pos: int, expected, found, hint=None):
        doc = b.first_doc + int(np.searchsorted(b.ends, pos, side="right"))
        raise _err(
            message,
            self.f.path,
            where=f"document {doc}, token offset {b.offset + pos}",
            expected=expected,
            found=found,
            hint=hint,
        )


def sample_text(tokenizer, tokens: np.ndarray, eos_id: int | None, padding: int = 0) -> str:
    """A sample's tokens as text, for `tokpack read --tokenizer`: each document piece decoded on
    its own (so an EOS shows whether or not the tokenizer marks it special), an EOS as the
    tokenizer's own token for it (`<|endoftext|>`; `<eos>` if it has none), and a best-fit row's
    trailing `padding` tokens as one `[padding: N tokens]`, never as text a model would learn."""
    real = tokens[: len(tokens) - padding] if padding else tokens
    ids = real.tolist()
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    beyond = next((t for t in ids if t >= size), None)
    if beyond is not None:  # tokenizers would drop it silently: the text would lie
        raise TokpackError(
            "token id is beyond the tokenizer's vocabulary",
            where="--tokenizer",
            expected=f"ids below {size}",
            found=beyond,
            hint="pass the tokenizer the source was packed with (its manifest's `tokenizer`)",
        )
    marker = (tokenizer.id_to_token(eos_id) or "<eos>") if eos_id is not None else None
    pieces, start = [], 0
    ends = [i for i, t in enumerate(ids) if t == eos_id] if eos_id is not None else []
    for end in ends:
        pieces.append(tokenizer.decode(ids[start:end], skip_special_tokens=False) + marker)
        start = end + 1
    pieces.append(tokenizer.decode(ids[start:], skip_special_tokens=False))
    if padding:
        pieces.append(f"[padding: {padding} tokens]")
    return "".join(pieces)
