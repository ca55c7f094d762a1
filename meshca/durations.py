"""Durations as operators write them: `30s`, `10m`, `24h`, `90d`, Go-style `1h30m`, or seconds."""

from __future__ import annotations

import re
from datetime import timedelta

_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")


def parse_duration(text: str) -> timedelta:
    """Parses `90d`, `24h`, `1h30m`, `500ms`, or a bare number of seconds.

    Raises `ValueError` with the accepted forms when the text is anything else.
    """
    value = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", value):
        return _seconds(float(value), text)
    position = 0
    total = 0.0
    for match in _PART.finditer(value):
        if match.start() != position:
            break
        total += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
        position = match.end()
    if position != len(value) or not value:
        raise ValueError(f"invalid duration {text!r}: write it like 30s, 10m, 24h, 90d or 1h30m")
    return _seconds(total, text)


def _seconds(seconds: float, text: str) -> timedelta:
    try:
        return timedelta(seconds=seconds)
    except OverflowError:
        raise ValueError(f"invalid duration {text!r}: too long") from None


def format_duration_short(delta: timedelta) -> str:
    """The inverse for round numbers, largest unit first.

    86400s → `1d`, 7776000s → `90d`, 7200s → `2h`, 90s → `90s`.
    """
    seconds = int(delta.total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"
