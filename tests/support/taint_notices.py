"""Taint notices of every shape, for property tests of whatever reads `meshca-taints.json`.

One Hypothesis strategy, `any_notice(active)`, for the bytes a file beside the root file can
hold: near-valid notices (any time of Python's range with any UTC offset, each written in the
ways ISO 8601 allows or bent by a character; random, malformed or the given authority IDs;
wrong versions, missing and unknown keys), random JSON, a valid notice with bytes flipped,
random bytes and deep nesting.

Why most of the shape comes from a seeded `random.Random` and not from one Hypothesis draw per
choice: a draw costs about half a millisecond on a loaded test machine, and the property runs
10,000 examples within seconds. Hypothesis still draws the numbers that decide the hard cases
(the time and the offset, where its bias to the ends of a range finds the overflows) and the
seed, so every example is reproducible from the one Hypothesis prints.
"""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta, timezone

from hypothesis import strategies as st

from meshca.taint_notice import MAX_NOTICE_BYTES, encode_taint_notice

_SPAN_US = (datetime.max - datetime.min) // timedelta(microseconds=1)
_OFFSET_US = 24 * 3600 * 10**6 - 1  # the largest UTC offset Python holds, in microseconds
_SEEDS = st.integers(0, 2**32 - 1)
_TIMESPECS = ("auto", "hours", "minutes", "seconds", "milliseconds", "microseconds")


def any_notice(active: str) -> st.SearchStrategy[bytes]:
    """Anything a taint notice file can hold; `active` is an authority ID that signs the
    reader's leaves, so some notices name it."""
    near_valid = st.builds(
        _near_valid_notice,
        st.just(active),
        _SEEDS,
        st.integers(0, _SPAN_US),
        st.integers(-_OFFSET_US, _OFFSET_US),
    )
    valid = encode_taint_notice({active: datetime(2030, 1, 1, tzinfo=UTC)}).encode()
    return st.one_of(
        near_valid,
        _SEEDS.map(lambda seed: json.dumps(_json_value(random.Random(seed), 4)).encode()),
        _SEEDS.map(lambda seed: _flipped(valid, random.Random(seed))),
        st.binary(max_size=256),
        st.integers(1, MAX_NOTICE_BYTES + 1).map(lambda depth: b"[" * depth),
    )


def _near_valid_notice(active: str, seed: int, at_us: int, offset_us: int) -> bytes:
    rng = random.Random(seed)
    document: dict[str, object] = {
        "version": 1 if rng.random() < 0.9 else rng.choice([0, 2, -1, "1", 1.0, True, None]),
        "tainted": [
            _entry(rng, active, at_us, offset_us) for _ in range(rng.choice([0, 1, 1, 1, 2, 3]))
        ],
    }
    if rng.random() < 0.05:
        document["tainted"] = _json_value(rng, 2)
    if rng.random() < 0.05:
        document[rng.choice(["extra", "tainted_at", "Version"])] = _json_value(rng, 1)
    if rng.random() < 0.05:
        del document[rng.choice(["version", "tainted"])]
    return json.dumps(document).encode()


def _entry(rng: random.Random, active: str, at_us: int, offset_us: int) -> object:
    if rng.random() < 0.03:
        return _json_value(rng, 2)
    entry: dict[str, object] = {
        "authority": _authority(rng, active),
        "tainted_at": _stamp(rng, at_us, offset_us),
    }
    if rng.random() < 0.05:
        entry[rng.choice(["by", "Authority", "tainted"])] = _json_value(rng, 1)
    if rng.random() < 0.05:
        del entry[rng.choice(["authority", "tainted_at"])]
    return entry


def _authority(rng: random.Random, active: str) -> object:
    pick = rng.random()
    if pick < 0.4:
        return active
    if pick < 0.8:
        return rng.randbytes(rng.choice([1, 2, 20, 32, 64, 65])).hex()
    return rng.choice([active.upper(), active[:-1], "", "ab cd", 12, None, ["ab"], "é" * 20])


def _stamp(rng: random.Random, at_us: int, offset_us: int) -> object:
    """An ISO 8601 text of that instant and offset, mostly; sometimes bent or not a string."""
    if rng.random() < 0.03:
        return _json_value(rng, 1)
    offset = timedelta(microseconds=offset_us)
    if rng.random() < 0.5:  # the whole minutes most writers use, up to ±23:59
        offset = timedelta(minutes=round(offset / timedelta(minutes=1)))
        offset = max(min(offset, timedelta(hours=23, minutes=59)), -timedelta(hours=23, minutes=59))
    zone = None if rng.random() < 0.05 else timezone(offset)
    at = (datetime.min + timedelta(microseconds=at_us)).replace(tzinfo=zone)
    text = at.isoformat(sep=rng.choice("T t"), timespec=rng.choice(_TIMESPECS))
    bend = rng.random()
    if bend < 0.15:
        text = text.replace("+00:00", "Z")
    elif bend < 0.3:  # a character changed, dropped or added somewhere
        spot = rng.randrange(len(text) + 1)
        text = (
            text[:spot]
            + rng.choice(["", "0", "9", "+", "-", ":", ".", "Z", " ", "٣"])
            + text[spot + rng.choice([0, 1]) :]
        )
    return text


def _json_value(rng: random.Random, depth: int) -> object:
    kind = rng.randrange(9 if depth > 0 else 7)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice([0, 1, -1, 2**63, -(2**70), rng.randrange(-(10**6), 10**6)])
    if kind == 3:
        return rng.choice([0.5, -0.0, 1e308, float("nan"), float("inf"), rng.random()])
    if kind in (4, 5, 6):
        return "".join(rng.choice('ab01:-+TZ "\\é\x00') for _ in range(rng.randrange(12)))
    if kind == 7:
        return [_json_value(rng, depth - 1) for _ in range(rng.randrange(4))]
    keys = ["version", "tainted", "authority", "tainted_at", "x", ""]
    return {rng.choice(keys): _json_value(rng, depth - 1) for _ in range(rng.randrange(4))}


def _flipped(valid: bytes, rng: random.Random) -> bytes:
    data = bytearray(valid)
    for _ in range(rng.randint(1, 4)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    return bytes(data)
