"""Token dtypes (by vocabulary, by name), shard and epoch folder names, and the `.ds.metadata`
text datatrove writes (docs/FORMAT.md, "Shards")."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from .constants import (
    MAX_EPOCHS,
    SHARD_NAME_DIGITS,
    TOKEN_DTYPES,
)
from .errors import TokpackError


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """datatrove's rule: uint16 while every id fits, else uint32."""
    if vocab_size <= 1 << 16:
        return TOKEN_DTYPES["uint16"]
    if vocab_size <= 1 << 32:
        return TOKEN_DTYPES["uint32"]
    raise TokpackError(
        "vocabulary too large for format v1",
        where="vocab_size",
        expected="<= 2**32",
        found=vocab_size,
        hint="token ids must fit in uint32",
    )


def dtype_name(dtype: np.dtype) -> str:
    return {2: "uint16", 4: "uint32"}[np.dtype(dtype).itemsize]


def dtype_from_name(name: str) -> np.dtype:
    try:
        return TOKEN_DTYPES[name]
    except KeyError:
        raise TokpackError("unknown token dtype", where="dtype", expected="uint16 or uint32", found=name) from None


def shard_name(index: int, digits: int = SHARD_NAME_DIGITS) -> str:
    return f"{index:0{digits}d}.ds"


def shard_digits(count: int) -> int:
    """Same width for every shard of a directory, so names sort as plain strings."""
    return max(SHARD_NAME_DIGITS, len(str(max(count - 1, 0))))


EPOCH_DIR_PREFIX = "epoch-"  # a run's epoch folders: epoch-NNNNN (epoch_dir_name)
EPOCH_DIGITS = len(str(MAX_EPOCHS - 1))  # every epoch number's, in its folder's name
# The name epoch_dir_name gives, its epoch the group: what only tokpack writes (not `epoch-1`,
# nor a number past MAX_EPOCHS, which no command would take back)
EPOCH_DIR_PATTERN = rf"{re.escape(EPOCH_DIR_PREFIX)}(\d{{{EPOCH_DIGITS}}})"


def epoch_dir_name(epoch: int) -> str:
    return f"{EPOCH_DIR_PREFIX}{epoch:0{EPOCH_DIGITS}d}"


def metadata_text(tokenizer: str, token_size: int, tokens: int) -> str:
    """datatrove's `.ds.metadata` layout: "{tokenizer}|{token_size}\\n{tokens}\\n{humanized}"."""
    return f"{tokenizer}|{token_size}\n{tokens}\n{metric_tokens(tokens)}"


def metric_tokens(tokens: int) -> str:
    """A token count as datatrove's metadata line writes it, humanize's `metric(tokens, unit="T")`
    ("1.50 kT", "489 kT", "0 T"), made here: humanize is datatrove's dependency, not tokpack's.
    Three significant digits under an SI prefix; the same float steps, so the same digits."""
    exponent = math.floor(math.log10(tokens)) if tokens != 0 else 0  # tokens < 2**64: at most 10**19, prefix E
    old_bucket = exponent // 3 * 3
    value = tokens / 10**old_bucket  # int / int: correctly rounded, as humanize divides
    digits = max(0, 2 - exponent % 3)
    if round(value, digits) >= 10 ** (exponent % 3 + 1):  # 999.6 k -> 1.00 M
        exponent += 1
        value /= 10 ** (exponent // 3 * 3 - old_bucket)
        digits = max(0, 2 - exponent % 3)
    prefix = "kMGTPEZYRQ"[exponent // 3 - 1] if exponent >= 3 else ""
    return f"{value:.{digits}f} {prefix}T"


def parse_metadata_text(text: str, path: str | Path) -> tuple[str, int, int]:
    """Returns (tokenizer, token_size, tokens) from a `.ds.metadata` file's text."""
    lines = text.split("\n")
    head = lines[0].rsplit("|", 1)
    try:
        if len(head) != 2 or len(lines) < 2:
            raise ValueError
        return head[0], int(head[1]), int(lines[1])
    except ValueError:
        raise TokpackError(
            "unreadable datatrove metadata",
            file=path,
            where="line 1-2",
            expected='"{tokenizer}|{token_size}\\n{tokens}"',
            found=repr(text[:80]),
            hint="regenerate the metadata or pass --vocab-size/--eos-id explicitly",
        ) from None
