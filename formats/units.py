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
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

from .errors import TokpackError

TOKEN_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}

BYTE_SUFFIXES = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
    "K": 1 << 10,
    "M": 1 << 20,
    "G": 1 << 30,
    "T": 1 << 40,
}

_NUMBER = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*")


def _parse(value: str | int, what: str) -> int | tuple[Fraction, str] | None:
    """An int as it is (refused if negative); text as (number, SUFFIX), or None if it is not
    a number with a suffix."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise TokpackError(f"a {what} cannot be negative", found=value)
        return value
    m = _NUMBER.fullmatch(str(value))
    if not m:
        return None
    return Fraction(m.group(1)), m.group(2).upper()  # Fraction("1.5") is exact: 3/2


def token_count(value: str | int, *, what: str = "token count") -> int:
    """'100B' -> 100_000_000_000; '1.5M' -> 1_500_000; '123456789012345678' stays exact."""
    parsed = _parse(value, what)
    if isinstance(parsed, int):
        return parsed
    if parsed is None:
        raise TokpackError(
            f"{value!r} is not a {what}", hint="write an integer or use K, M, B, T (10^3..10^12), e.g. 100B"
        )
    number, suffix = parsed
    if suffix not in TOKEN_SUFFIXES:
        bytes_like = suffix in BYTE_SUFFIXES or suffix.endswith("B")  # KiB, MiB... end with B too
        raise TokpackError(
            f"{value!r} is not a {what}" + (": it is a byte size" if bytes_like else f": unknown suffix {suffix!r}"),
            hint="token counts take K/M/B/T (10^3, 10^6, 10^9, 10^12), e.g. 100B for 10^11 tokens; "
            "byte sizes are for --memory",
        )
    count = number * TOKEN_SUFFIXES[suffix]
    if count.denominator != 1:
        raise TokpackError(
            f"{value!r} is not a whole number of tokens",
            found=f"{float(count):g}",
            hint="give more digits or a smaller suffix, e.g. 1500K",
        )
    return int(count)


def byte_size(value: str | int, *, what: str = "byte size") -> int:
    """'16GiB' -> 17179869184; '2GB' -> 2000000000; '4G' -> 4 GiB (a bare letter is binary)."""
    parsed = _parse(value, what)
    if isinstance(parsed, int):
        return parsed
    if parsed is None or parsed[1] not in BYTE_SUFFIXES:
        raise TokpackError(
            f"{value!r} is not a {what}",
            hint="use e.g. 512MiB, 4GiB, 2GB or 1048576 (KB/MB/GB are 10^n, KiB/MiB/GiB and a bare K/M/G are 2^n)",
        )
    number, suffix = parsed
    return int(number * BYTE_SUFFIXES[suffix])  # int() of a Fraction rounds toward zero: down


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


def counted(n: int, noun: str, fmt: str = ",", plural: str | None = None) -> str:
    """`n noun` with the noun's plural when n is not 1 ("1 shard", "2 shards"): a command's
    lines say so, never "shard(s)". `noun` is the singular; its plural adds "s", or is `plural`."""
    return f"{n:{fmt}} {noun if n == 1 else plural or noun + 's'}"
