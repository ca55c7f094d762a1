"""`meshca.taint_notice`: the document the CA writes beside `root-cert.pem` and the agent reads
strictly — what the CA writes is read back exactly, and anything else is refused as a whole
with a message naming what is wrong."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone

import pytest

from meshca import taint_notice
from meshca.taint_notice import (
    MAX_NOTICE_BYTES,
    MAX_TAINTED,
    TaintNoticeError,
    decode_taint_notice,
    encode_taint_notice,
)

AT = datetime(2026, 12, 3, 14, 0, 5, 250000, tzinfo=UTC)
A, B = "ab" * 20, "0f" * 32


def test_what_the_ca_writes_is_read_back_exactly() -> None:
    tainted = {A: AT, B: AT - timedelta(hours=1)}
    text = encode_taint_notice(tainted)
    assert json.loads(text) == {
        "version": 1,
        "tainted": [
            {"authority": B, "tainted_at": "2026-12-03T13:00:05.250000Z"},
            {"authority": A, "tainted_at": "2026-12-03T14:00:05.250000Z"},
        ],
    }
    assert decode_taint_notice(text.encode()) == tainted
    assert decode_taint_notice(encode_taint_notice({})) == {}


def test_other_time_zones_are_read_as_utc() -> None:
    plus_two = AT.astimezone(timezone(timedelta(hours=2)))
    assert decode_taint_notice(encode_taint_notice({A: plus_two})) == {A: AT}
    text = json.dumps(
        {"version": 1, "tainted": [{"authority": A, "tainted_at": plus_two.isoformat()}]}
    )
    (read,) = decode_taint_notice(text).values()
    assert read == AT and read.tzinfo == UTC


def test_the_largest_notice_the_ca_writes_fits_the_reader_bound() -> None:
    most = {f"{n:040x}": AT for n in range(MAX_TAINTED)}
    text = encode_taint_notice(most)
    assert len(text.encode()) < MAX_NOTICE_BYTES / 2
    assert decode_taint_notice(text) == most


def test_beyond_the_bound_the_ca_names_the_most_recent_taints(
    caplog: pytest.LogCaptureFixture,
) -> None:
    many = {f"{n:040x}": AT + timedelta(seconds=n) for n in range(MAX_TAINTED + 3)}
    read = decode_taint_notice(encode_taint_notice(many))
    assert set(read) == {f"{n:040x}" for n in range(3, MAX_TAINTED + 3)}
    assert "names the 64 most recent" in caplog.text


def entry(authority: object = A, tainted_at: object = "2026-12-03T14:00:00Z") -> dict[str, object]:
    return {"authority": authority, "tainted_at": tainted_at}


def notice(*entries: object, **top: object) -> bytes:
    return json.dumps({"version": 1, "tainted": list(entries), **top}).encode()


@pytest.mark.parametrize(
    ("data", "said"),
    [
        (b"", "not a JSON document"),
        (b"\xff\xfe", "not UTF-8"),
        (b"-----BEGIN CERTIFICATE-----\n", "not a JSON document"),
        (b"[]", "not a JSON object"),
        (b'{"tainted": []}', "version None is not understood"),
        (b'{"version": 2, "tainted": []}', "the CA is newer than this agent"),
        (b'{"version": true, "tainted": []}', "version True is not understood"),
        (b'{"version": 1.0, "tainted": []}', "version 1.0 is not understood"),
        (b'{"version": 1}', "missing ['tainted']"),
        (notice(extra=1), "unknown ['extra']"),
        (b'{"version": 1, "version": 1, "tainted": []}', "'version' appears twice"),
        (b'{"version": 1, "tainted": {}}', '"tainted" is not a list'),
        (notice("ab"), "is not an object"),
        (notice({"authority": A}), "missing ['tainted_at']"),
        (notice({**entry(), "by": "me"}), "unknown ['by']"),
        (notice(entry(authority="AB" * 20)), "not a lower-case hex key ID"),
        (notice(entry(authority="abc")), "not a lower-case hex key ID"),
        (notice(entry(authority="")), "not a lower-case hex key ID"),
        (notice(entry(authority="ab" * 65)), "not a lower-case hex key ID"),
        (notice(entry(authority=12)), "not a lower-case hex key ID"),
        (notice(entry(tainted_at="yesterday")), "not an ISO 8601 time"),
        (notice(entry(tainted_at=1764770400)), "not an ISO 8601 time"),
        (notice(entry(tainted_at="2026-12-03T14:00:00")), "has no time zone"),
        # Valid ISO 8601 times that lie outside Python's range once moved to UTC.
        (notice(entry(tainted_at="0001-01-01T00:00:00+14:00")), "outside years 1 to 9999"),
        (notice(entry(tainted_at="9999-12-31T23:59:59-14:00")), "outside years 1 to 9999"),
        (notice(entry(tainted_at="0001-01-01T00:00:00+23:59:59.999999")), "outside years"),
        (notice(entry(tainted_at="9999-12-31T23:59:59.999-00:00:01")), "outside years 1"),
        (notice(entry(tainted_at="2026-12-03T24:00:00Z")), "not an ISO 8601 time"),
        (notice(entry(tainted_at="2026-12-03T14:00:00+24:00")), "not an ISO 8601 time"),
        (notice(entry(tainted_at="2026-12-03T23:59:60Z")), "not an ISO 8601 time"),
        (notice(entry(tainted_at="2026-12-03T14:00:00Z" + " " * 30)), "not an ISO 8601 time"),
        (notice(entry(), entry()), "listed twice"),
        (notice(*(entry(authority=f"{n:040x}") for n in range(MAX_TAINTED + 1))), "at most 64"),
        (b'{"version": 1, "tainted": [{"authority": NaN}]}', "NaN is not allowed"),
        (b"[" * (MAX_NOTICE_BYTES - 1), "nested too deeply"),
    ],
)
def test_anything_but_a_version_1_notice_is_refused_whole(data: bytes, said: str) -> None:
    with pytest.raises(TaintNoticeError) as refused:
        decode_taint_notice(data)
    assert said in str(refused.value)
    assert len(str(refused.value)) < 300


def test_an_oversized_notice_is_refused_before_it_is_parsed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parsed: list[str] = []
    real_loads = json.loads

    def counting_loads(text: str, **kwargs: object) -> object:
        parsed.append(text)
        return real_loads(text, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(taint_notice.json, "loads", counting_loads)
    padded = notice(entry()) + b" " * MAX_NOTICE_BYTES
    with pytest.raises(TaintNoticeError, match="at most 16384"):
        decode_taint_notice(padded)
    assert parsed == []
    decode_taint_notice(notice(entry()))
    assert len(parsed) == 1  # the counter does see a parse


def test_the_ca_refuses_to_write_what_agents_would_refuse() -> None:
    with pytest.raises(TaintNoticeError, match="lower-case hex"):
        encode_taint_notice({"not-hex": AT})
    with pytest.raises(TaintNoticeError, match="no time zone"):
        encode_taint_notice({A: AT.replace(tzinfo=None)})


def test_the_edges_of_the_range_are_read_when_they_stay_within_it() -> None:
    assert decode_taint_notice(notice(entry(tainted_at="0001-01-01T00:00:00-14:00"))) == {
        A: datetime(1, 1, 1, 14, tzinfo=UTC)
    }
    assert decode_taint_notice(notice(entry(tainted_at="9999-12-31T23:59:59+14:00"))) == {
        A: datetime(9999, 12, 31, 9, 59, 59, tzinfo=UTC)
    }


def test_no_other_exception_leaves_the_decoder(monkeypatch: pytest.MonkeyPatch) -> None:
    """A case the checks miss (here: an entry check that fails with a KeyError) is still a
    refusal of the notice, which its reader logs and survives, never a crash of the reader."""

    def broken_entry(entry: object) -> None:
        raise KeyError("tainted_at")

    monkeypatch.setattr(taint_notice, "_entry", broken_entry)
    with pytest.raises(TaintNoticeError, match=r"cannot be read as a taint notice \(KeyError\)"):
        decode_taint_notice(notice(entry()))
