"""Arguments given through the Python API, checked as the CLI's option types check them.

click refuses `--world-size 0`, `--start-sample 3.5` or `--memory lots` before a command runs;
a caller of tokpack.pack(...) or TokpackDataset(...) gets the same refusal here, as one
TokpackError line naming the argument, instead of a ZeroDivisionError, a silent rounding
(int('5'), int(3.5)) or a raw ValueError deep in a stage. Unit strings go through
formats/units.py, the parser the CLI uses, so `tokens="3M"` means what `--tokens 3M` means.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterable

from .errors import TokpackError
from .units import MAX_COUNT, byte_size, number, token_count


def whole(value, name: str, *, least: int | None = 0, optional: bool = True, most: int = MAX_COUNT) -> int | None:
    """`value` as an int: an integer (numpy's too), not a bool, a float or a digit string; at most
    `most` (an int64: a larger count overflows the arithmetic it goes into)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TokpackError(
            f"{name} must be an integer",
            where=name,
            expected="an int" + ("" if least is None else f" >= {least}"),
            found=repr(value),
        )
    if least is not None and value < least:
        raise TokpackError(f"{name} is out of range", where=name, expected=f">= {least}", found=int(value))
    if value > most:
        raise TokpackError(f"{name} is out of range", where=name, expected=f"<= {most:,}", found=int(value))
    return int(value)


def flag(value, name: str, *, optional: bool = False) -> bool | None:
    if value is None and optional:
        return None
    if not isinstance(value, bool):
        raise TokpackError(f"{name} must be True or False", where=name, expected="a bool", found=repr(value))
    return value


def text(value, name: str, *, optional: bool = True, choices=None):
    if value is None and optional:
        return None
    if not isinstance(value, str) or (choices is not None and value not in choices):
        raise TokpackError(
            f"{name} is not one of its values" if choices else f"{name} must be a string",
            where=name,
            expected=" or ".join(map(repr, choices)) if choices else "a str",
            found=repr(value),
        )
    return value


def _quantity(parse, value, name: str, least: int, optional: bool, what: str) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, numbers.Integral)):
        raise TokpackError(
            f"{name} must be an integer or text such as the CLI takes",
            where=name,
            expected=f"an int or a {what} string",
            found=repr(value),
        )
    try:
        n = parse(value if isinstance(value, str) else int(value), what=what, most=MAX_COUNT)
    except TokpackError as e:  # the parser's line, with the argument it was given for
        raise TokpackError(e.message, where=name, expected=e.expected, found=e.found, hint=e.hint) from None
    if n < least:
        raise TokpackError(f"{name} is out of range", where=name, expected=f">= {least}", found=n)
    return n


def tokens(value, name: str, *, least: int = 0, optional: bool = True) -> int | None:
    """A token count: an int, or text as `--tokens` takes it ("3M", "100B")."""
    return _quantity(token_count, value, name, least, optional, "token count")


def size(value, name: str, *, least: int = 0, optional: bool = True) -> int | None:
    """A byte size: an int, or text as `--memory` takes it ("64MiB", "4G")."""
    return _quantity(byte_size, value, name, least, optional, "byte size")


def positive_number(value, name: str, *, optional: bool = True, most: float = 1e9) -> float | None:
    """A finite real number > 0, at most `most` (a disk speed in MB/s: 1e9 is a petabyte a second)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TokpackError(f"{name} must be a number > 0", where=name, expected="> 0", found=repr(value))
    return number(value, name, least=0, most=most, real=True, above=True)


def path(value, name: str, *, optional: bool = True):
    """A path or URL: a str or an os.PathLike (pathlib.Path), not None where one is needed, an int
    or bytes, which str() would turn into a folder named "None" or "5" in the working directory."""
    if value is None and optional:
        return None
    if not isinstance(value, (str, os.PathLike)) or isinstance(value, str) and not value:
        raise TokpackError(
            f"{name} must be a path",
            where=name,
            expected="a str or pathlib.Path (a local path or an fsspec URL)",
            found=repr(value)[:80],
        )
    return value


def paths(value, name: str) -> list:
    """A path, or an iterable of them (a list, a tuple, a generator: taken once), as a list."""
    if isinstance(value, (str, os.PathLike)):
        items = [value]
    elif isinstance(value, Iterable) and not isinstance(value, (bytes, bytearray, dict)):
        items = list(value)
    else:
        items = None
    if items is None or not all(isinstance(v, (str, os.PathLike)) and v != "" for v in items):
        shown = value if items is None else items
        raise TokpackError(
            "must be a path or a sequence of paths", where=name, expected="str or pathlib.Path", found=repr(shown)[:80]
        )
    return items
