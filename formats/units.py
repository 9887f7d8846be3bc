"""Token counts and byte sizes as people write them ("100B" tokens, "16GiB" of memory).

The two are different units and are parsed by different functions, so a byte size never
passes for a token count: `token_count("100GB")` is refused, not read as 10^11 tokens.

- Token counts take decimal suffixes, as the field writes "15T tokens": K, M, B, T =
  10^3, 10^6, 10^9, 10^12. Parsed exactly (no float); the result must be a whole count.
- Byte sizes take B, SI units KB, MB, GB, TB (10^3..10^12) and IEC units KiB, MiB, GiB, TiB
  (2^10..2^40). A bare K, M, G, T is binary (as in Slurm's --mem, `sort -S` or -Xmx): 4G is
  4 GiB. A fractional byte count is rounded down (it is a budget).
- Mixture weights (`SOURCE=WEIGHT`, a schedule's `{SOURCE: WEIGHT}`, the API's mapping) are
  exact numbers: 0.3, 2, 1/3, or a percentage, 70% = 0.7. Only their ratios matter.
- Plain numbers (`--seq-len 4096`, `--log-interval 30`, `--disk-mbps 500`, $TOKPACK_PROGRESS):
  `number`, an integer or a finite real within the option's bounds.

This module is the one parser of every number a user gives (an option, an environment variable,
an argument of the Python API): each is bounded, and a refusal is one TokpackError line naming
the option or variable (`where`) and the text as typed (`found`). Text is refused by its length
before any number is built from it, so a pasted megabyte of digits costs nothing.
"""

from __future__ import annotations

import numbers
import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

from .errors import TokpackError

TOKEN_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}

# B and the SI units (KB..TB) count in 1000s; the IEC units (KiB..TiB) and a bare K..T, in 1024s.
BYTE_SUFFIXES = {"": 1, "B": 1} | {
    prefix + unit: base**k
    for k, prefix in enumerate("KMGT", 1)
    for unit, base in (("B", 1000), ("IB", 1024), ("", 1024))
}

_NUMBER = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*")

# The largest count of anything (tokens, bytes, samples, documents): an int64, as numpy indexes
# and the manifests record them. A number past it is no corpus, and arithmetic on it overflows.
MAX_COUNT = 2**63 - 1
# The longest text taken for a number: "9,223,372,036,854,775,807 tokens" spelled in digits is
# 19 characters; int() of a pasted 10^6 digits takes seconds, Fraction('1e99999999') forever.
MAX_NUMBER_TEXT = 40


def typed(value) -> str:
    """What the user typed, as a refusal quotes it: repr, cut to a line's worth."""
    text = repr(value)
    return text if len(text) <= 60 else text[:56] + "...'"


def _refuse(message: str, value, name: str | None, expected: str, hint: str | None = None):
    raise TokpackError(message, where=name, expected=expected, found=typed(value), hint=hint)


def _parse(value: str | int, what: str, name: str | None = None) -> tuple[Fraction, str] | None:
    """(number, SUFFIX) of text, or of an int (no suffix; refused if negative); None if it is not
    a number with a suffix."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise TokpackError(f"a {what} cannot be negative", where=name, found=value)
        return Fraction(value), ""
    if len(str(value)) > MAX_NUMBER_TEXT:
        return None
    m = _NUMBER.fullmatch(str(value))
    if not m:
        return None
    return Fraction(m.group(1)), m.group(2).upper()  # Fraction("1.5") is exact: 3/2


def _bounded(n: int, value, name: str | None, what: str, most: int | None) -> int:
    if most is not None and n > most:
        _refuse(f"{what} out of range", value, name, f"at most {most:,}")
    return n


def token_count(
    value: str | int, *, what: str = "token count", name: str | None = None, most: int | None = None
) -> int:
    """'100B' -> 100_000_000_000; '1.5M' -> 1_500_000; '123456789012345678' stays exact. `name`:
    the option or field the value was given for (a refusal names it); `most`: its bound (a count a
    user types: MAX_COUNT; a virtual corpus's planned size may be larger)."""
    parsed = _parse(value, what, name)
    if parsed is None:
        raise TokpackError(
            f"{typed(value)} is not a {what}",
            where=name,
            hint="write an integer or use K, M, B, T (10^3..10^12), e.g. 100B",
        )
    number, suffix = parsed
    if suffix not in TOKEN_SUFFIXES:
        bytes_like = suffix in BYTE_SUFFIXES or suffix.endswith("B")  # KiB, MiB... end with B too
        raise TokpackError(
            f"{typed(value)} is not a {what}"
            + (": it is a byte size" if bytes_like else f": unknown suffix {suffix!r}"),
            where=name,
            hint="token counts take K/M/B/T (10^3, 10^6, 10^9, 10^12), e.g. 100B for 10^11 tokens; "
            "byte sizes are for --memory",
        )
    count = number * TOKEN_SUFFIXES[suffix]
    if count.denominator != 1:
        raise TokpackError(
            f"{typed(value)} is not a whole number of tokens",
            where=name,
            found=f"{float(count):g}",
            hint="give more digits or a smaller suffix, e.g. 1500K",
        )
    return _bounded(int(count), value, name, what, most)


def byte_size(value: str | int, *, what: str = "byte size", name: str | None = None, most: int | None = None) -> int:
    """'16GiB' -> 17179869184; '2GB' -> 2000000000; '4G' -> 4 GiB (a bare letter is binary)."""
    parsed = _parse(value, what, name)
    if parsed is None or parsed[1] not in BYTE_SUFFIXES:
        raise TokpackError(
            f"{typed(value)} is not a {what}",
            where=name,
            hint="use e.g. 512MiB, 4GiB, 2GB or 1048576 (KB/MB/GB are 10^n, KiB/MiB/GiB and a bare K/M/G are 2^n)",
        )
    number, suffix = parsed
    return _bounded(int(number * BYTE_SUFFIXES[suffix]), value, name, what, most)  # int() rounds down


# A weight's power of ten, at most: Fraction('1e99999999') computes 10**99999999 (minutes, then
# memory), and no mixture needs a weight past 10^30 times another.
MAX_WEIGHT_EXPONENT = 30
_EXPONENT = re.compile(r"[eE]\s*([+-]?\d+)")


def weight_in_range(text: str) -> bool:
    """Whether every power of ten a weight's text spells ('3e5', '1e-2%') is within
    MAX_WEIGHT_EXPONENT: checked on the text, before any number is built from it."""
    return all(len(e.lstrip("+-")) <= 4 and abs(int(e)) <= MAX_WEIGHT_EXPONENT for e in _EXPONENT.findall(str(text)))


def weight_fraction(text: str) -> Fraction:
    """The number a weight's text spells, exactly: '0.3' -> 3/10, '1/3', '2', '70%' -> 7/10.
    The one grammar of weights (the command line, a schedule file and the API's mapping all
    come through it); ValueError if it is not a number, ZeroDivisionError for 1/0."""
    raw = str(text).strip()
    if not weight_in_range(raw):
        raise OverflowError(raw)
    return Fraction(raw[:-1].strip()) / 100 if raw.endswith("%") else Fraction(raw)


def parse_weight(text: str, where: str) -> Fraction:
    """A mixture weight (weight_fraction), or one line saying why it is none."""
    if not weight_in_range(text):
        raise TokpackError(
            "weight out of range",
            where=where,
            expected=f"a power of ten within 1e-{MAX_WEIGHT_EXPONENT}..1e{MAX_WEIGHT_EXPONENT}",
            found=repr(str(text)[:40]),
            hint="weights are relative: write them as shares such as 0.3, 2, 1/3 or 70%",
        )
    try:
        w = weight_fraction(text)
    except (ValueError, ZeroDivisionError):
        raise TokpackError(
            "weight is not a number",
            where=where,
            expected="a non-negative number like 0.3, 2 or 1/3",
            found=repr(text),
            hint="write SOURCE=WEIGHT",
        ) from None
    if w < 0:
        raise TokpackError("weight is negative", where=where, expected=">= 0", found=text)
    return w


def weight_text(text: str) -> str:
    """A weight spelled as the manifests record it: as given, except that a percentage is
    written as the number it is ('70%' -> '0.7', '12.5%' -> '0.125', '1/3%' -> '1/300'), so
    that `70%` and `0.7` make the same run, manifests included. Text that is not a weight is
    returned as it is, for parse_weight to refuse where the weights are checked."""
    raw = str(text).strip()
    if not raw.endswith("%") or not weight_in_range(raw):  # out of range: parse_weight refuses it
        return text
    number = raw[:-1].strip()
    try:
        decimal = Decimal(number)
        if decimal.is_finite():
            return format(decimal.scaleb(-2).normalize(), "f")  # exact: only the point moves
    except InvalidOperation:
        pass
    try:
        return str(Fraction(number) / 100)
    except (ValueError, ZeroDivisionError):
        return text


def at_most(value: int, limit: int, what: str, *, hint: str, where: str | None = None, file=None) -> int:
    """`value`, or one line naming it, its limit and what to do: a count the user typed (or a
    file declares) is checked by arithmetic before anything of its size is allocated."""
    if value > limit:
        raise TokpackError(
            f"{what} is too large", file=file, where=where, expected=f"at most {limit:,}", found=f"{value:,}", hint=hint
        )
    return value


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n noun` with the noun's plural when n is not 1 ("1 shard", "2 shards"): a command's
    lines say so, never "shard(s)". `noun` is the singular; its plural adds "s", or is `plural`."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


_INTEGER = re.compile(r"[+-]?[0-9]+")
_REAL = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")  # no nan, inf, hex, '1_0'


def number(
    value,
    name: str,
    *,
    least: float = 0,
    most: float = MAX_COUNT,
    real: bool = False,
    above: bool = False,
    what: str | None = None,
    hint: str | None = None,
) -> int | float:
    """`value` (text as typed, or an int; a float too when `real`) as an int, or a finite float
    when `real`, within [least, most] ((least, most] when `above`); else one line naming `name`
    (the option, variable or argument) and the text. Never a bool, nan or an infinity; an integer
    option takes no '1.5' and no '1e3' (a count is written in digits, or with units by token_count)."""
    kind = what or ("a number" if real else "an integer")
    bounds = f"{kind} {'>' if above else '>='} {_shown(least)}" + ("" if most == MAX_COUNT else f", <= {_shown(most)}")
    if isinstance(value, bool):
        _refuse(f"not {kind}", value, name, bounds, hint)
    if isinstance(value, str):
        text = value.strip()
        pattern = _REAL if real else _INTEGER
        if len(text) > MAX_NUMBER_TEXT or not pattern.fullmatch(text):
            _refuse(f"not {kind}", value, name, bounds, hint)
        n = float(text) if real else int(text)
    elif isinstance(value, numbers.Integral) or (real and isinstance(value, numbers.Real)):
        n = float(value) if real else int(value)
    else:
        _refuse(f"not {kind}", value, name, bounds, hint)
    if not (n > least if above else n >= least) or not n <= most:  # nan fails both; 1e400 is inf
        _refuse("out of range", value, name, bounds, hint)
    return n


def _shown(bound: float) -> str:
    """A bound as a user reads it: 2,147,483,647, 86,400, 0.5, 1e+09."""
    if isinstance(bound, int) or (float(bound).is_integer() and abs(bound) < 1e15):
        return f"{int(bound):,}"
    return f"{bound:g}"


def digits(text) -> int:
    """A whole number written in ASCII digits, as a part of a larger spelling ('0-3', 'n/N',
    'r/W') is: ValueError for anything else, as int() raises, so a caller's refusal names its
    option. int() alone takes '1_000', Arabic-Indic digits and a 10^4-digit paste (slowly), and
    str.isdigit() passes '²', which int() then refuses."""
    text = str(text).strip()
    if len(text) > MAX_NUMBER_TEXT or not _INTEGER.fullmatch(text):
        raise ValueError(f"not a whole number: {typed(text)}")
    return int(text)


# Seconds between two progress lines, at most: a day (threading's wait overflows past ~292 years).
MAX_SECONDS = 86400.0


def seconds(value, name: str, *, hint: str | None = None) -> float:
    """A number of seconds in [0, MAX_SECONDS] (an interval: 0 for none)."""
    return number(value, name, least=0, most=MAX_SECONDS, real=True, what="a number of seconds", hint=hint)


def holdout_amount(value, name: str = "--holdout") -> tuple[str, Fraction | int]:
    """A held-out split's size: ("fraction", F) for '0.01', '1%' or '1/100' (0 < F < 1), or
    ("tokens", N) for a token count ('5M', '20000': token_count's, N >= 1)."""
    raw = str(value).strip()
    hint = "give a fraction of each source's documents (0.01 or 1%) or a token count per source (5M)"
    expected = "a fraction 0 < F < 1 (0.01, 1%) or a token count >= 1 (5M)"
    if len(raw) > MAX_NUMBER_TEXT or not weight_in_range(raw):
        _refuse("not a fraction or a token count", value, name, expected, hint)
    try:
        if raw.endswith("%") or "." in raw or "/" in raw or "e" in raw.lower():
            fraction = weight_fraction(raw)  # a weight's grammar, range checked above
        else:
            tokens = token_count(raw, name=name, most=MAX_COUNT)
            if tokens < 1:
                _refuse("out of range", value, name, expected, hint)
            return "tokens", tokens
    except (ValueError, ZeroDivisionError):
        _refuse("not a fraction or a token count", value, name, expected, hint)
    except TokpackError as e:
        _refuse(
            "out of range" if "range" in e.message else "not a fraction or a token count", value, name, expected, hint
        )
    if not 0 < fraction < 1:
        _refuse("out of range", value, name, expected, hint)
    return "fraction", fraction
