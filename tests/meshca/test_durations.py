from __future__ import annotations

from datetime import timedelta

import pytest

from meshca.durations import format_duration_short, parse_duration


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30s", timedelta(seconds=30)),
        ("10m", timedelta(minutes=10)),
        ("24h", timedelta(hours=24)),
        ("90d", timedelta(days=90)),
        ("1h30m", timedelta(hours=1, minutes=30)),
        ("500ms", timedelta(milliseconds=500)),
        ("1m500ms", timedelta(minutes=1, milliseconds=500)),
        ("1d2h3m4s", timedelta(days=1, hours=2, minutes=3, seconds=4)),
        ("1.5h", timedelta(minutes=90)),
        ("0s", timedelta(0)),
        ("3600", timedelta(hours=1)),
        ("2.5", timedelta(seconds=2.5)),
        (" 24H ", timedelta(hours=24)),
    ],
)
def test_parse_duration(text: str, expected: timedelta) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "abc",
        "h",
        "10x",
        "-5s",
        "+5s",
        "1h 30m",
        "1h30",
        "s30",
        "30 s",
        "1w",
        "1y",
        "1.h",
        ".5h",
        "1e3s",
        "5s!",
        # too long for a timedelta: still a ValueError, not an OverflowError
        "1000000000d",
        "99999999999999999999",
        "9" * 400 + "s",
    ],
)
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("delta", "text"),
    [
        (timedelta(hours=24), "1d"),
        (timedelta(hours=2), "2h"),
        (timedelta(days=90), "90d"),
        (timedelta(seconds=90), "90s"),
        (timedelta(minutes=10), "10m"),
        (timedelta(hours=25), "25h"),
        (timedelta(0), "0s"),
    ],
)
def test_format_duration_short(delta: timedelta, text: str) -> None:
    assert format_duration_short(delta) == text
    assert parse_duration(text) == delta
