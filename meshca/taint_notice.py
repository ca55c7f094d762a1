"""The taint notice: which authorities the CA has tainted and when, published beside the trust
bundle so agents learn of a taint as fast as they learn of a new root.

Why a sibling document and not text inside `root-cert.pem`: Envoy, pilot-agent and every other
Istio consumer read `root-cert.pem` as a PEM bundle (and some refuse anything that is not a
certificate block), so the bundle stays exactly a bundle. The notice travels the same channel:

- local mode: `--data-dir/meshca-taints.json`, written atomically beside `root-cert.pem` by the
  same call that writes the bundle (`ca_server.authority.root_bundle.publish_root_bundle`);
- Kubernetes mode: key `meshca-taints.json` of the `istio-ca-root-cert` ConfigMap, written in
  the same object update as `root-cert.pem` (`ca_server.kube.root_publisher`), so the kubelet's
  mount shows both files in one `..data` swap beside each other.

The agent (`agent.taint_file`) follows the file beside its `--ca-root`, and feeds what it reads
into the same path as the periodic report's answer (`agent.taints`).

Format, version 1 (compact JSON, UTF-8, at most `MAX_NOTICE_BYTES`)::

    {"version": 1, "tainted": [{"authority": "<SKI hex>", "tainted_at": "<ISO 8601, UTC>"}]}

`tainted` lists every tainted authority still in the bundle (the report answer's list), sorted
by ID, at most `MAX_TAINTED` of them. `decode_taint_notice` is strict: another version, an
unknown or missing key, a duplicate authority, an ID that is not lower-case hex, a time without
a zone or outside years 1 to 9999 in UTC, a document too large or nested: all are
`TaintNoticeError`, and so is anything else that makes the content unreadable (no other
exception leaves the decoder, whatever the bytes). A reader ignores such a document as a whole
(never half of it).

No I/O: the callers read and write.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

log = logging.getLogger(__name__)

TAINT_NOTICE_NAME = "meshca-taints.json"
"""The file name beside `root-cert.pem`, and the ConfigMap key beside key `root-cert.pem`."""

NOTICE_VERSION = 1
MAX_TAINTED = 64
"""A CA holds a handful of authorities (prepared, active, a few old ones); 64 is far beyond."""
MAX_NOTICE_BYTES = 16 * 1024
"""64 entries take about 6 KiB; a larger document is refused before it is parsed."""

_AUTHORITY = re.compile(r"(?:[0-9a-f]{2}){1,64}")  # a Subject Key ID in hex, as `authority_id`
_KEYS = frozenset({"version", "tainted"})
_ENTRY_KEYS = frozenset({"authority", "tainted_at"})


class TaintNoticeError(ValueError):
    """The document is not a version-1 taint notice; the message says what is wrong (quoting
    at most a short, truncated excerpt of the content)."""


def encode_taint_notice(tainted_since: Mapping[str, datetime]) -> str:
    """The notice for `tainted_since` (authority ID -> when it was tainted, aware datetimes),
    as the CA publishes it. Beyond `MAX_TAINTED` it keeps the most recent taints (said in a
    WARNING: the older ones' leaves are the likeliest to be re-signed already, and the report
    answer still names them all). A malformed ID or a naive time is a bug in the caller:
    `TaintNoticeError`, so a CA never publishes a notice its agents would ignore."""
    items = sorted(tainted_since.items(), key=lambda item: item[1], reverse=True)
    if len(items) > MAX_TAINTED:
        log.warning(
            "%d tainted authorities; the taint notice beside root-cert.pem names the %d most "
            "recent (revoke the old ones: `meshca authority revoke`)",
            len(items),
            MAX_TAINTED,
        )
        items = items[:MAX_TAINTED]
    entries = []
    for ident, at in sorted(items):
        if not _AUTHORITY.fullmatch(ident):
            raise TaintNoticeError(f"authority ID {ident[:140]!r} is not lower-case hex")
        if at.tzinfo is None:
            raise TaintNoticeError(f"the taint time of {ident} has no time zone")
        stamp = at.astimezone(UTC).isoformat().replace("+00:00", "Z")
        entries.append({"authority": ident, "tainted_at": stamp})
    return json.dumps({"version": NOTICE_VERSION, "tainted": entries}, separators=(",", ":"))


def decode_taint_notice(data: bytes | str) -> dict[str, datetime]:
    """Authority ID -> when it was tainted (UTC), from a notice; `TaintNoticeError` for anything
    that is not exactly a version-1 notice (see the module docstring), and never another
    exception, whatever the content: the reader follows a file others may write."""
    try:
        return _decode(data)
    except TaintNoticeError:
        raise
    except Exception as exc:  # a case the checks below missed costs the notice, not the reader
        raise TaintNoticeError(f"cannot be read as a taint notice ({type(exc).__name__})") from None


def _decode(data: bytes | str) -> dict[str, datetime]:
    raw = data.encode("utf-8") if isinstance(data, str) else data
    if len(raw) > MAX_NOTICE_BYTES:
        raise TaintNoticeError(f"{len(raw)} bytes; a taint notice is at most {MAX_NOTICE_BYTES}")
    try:
        document = json.loads(
            raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constant
        )
    except UnicodeDecodeError:
        raise TaintNoticeError("not UTF-8 text") from None
    except RecursionError:
        raise TaintNoticeError("nested too deeply to be a taint notice") from None
    except ValueError as exc:  # json.JSONDecodeError, and the hooks' refusals
        raise TaintNoticeError(f"not a JSON document: {exc}") from None
    if not isinstance(document, dict):
        raise TaintNoticeError("not a JSON object")
    version = document.get("version")
    if type(version) is not int or version != NOTICE_VERSION:
        newer = type(version) is int and version > NOTICE_VERSION
        raise TaintNoticeError(
            f"version {version!r:.20} is not understood (this reader knows {NOTICE_VERSION})"
            + ("; the CA is newer than this agent" if newer else "")
        )
    _exact_keys(document, _KEYS, "the notice")
    entries = document["tainted"]
    if not isinstance(entries, list):
        raise TaintNoticeError('"tainted" is not a list')
    if len(entries) > MAX_TAINTED:
        raise TaintNoticeError(
            f'"tainted" lists {len(entries)} authorities; a notice holds at most {MAX_TAINTED}'
        )
    tainted: dict[str, datetime] = {}
    for entry in entries:
        ident, at = _entry(entry)
        if ident in tainted:
            raise TaintNoticeError(f"authority {ident} is listed twice")
        tainted[ident] = at
    return tainted


def _entry(entry: Any) -> tuple[str, datetime]:
    if not isinstance(entry, dict):
        raise TaintNoticeError('an entry of "tainted" is not an object')
    _exact_keys(entry, _ENTRY_KEYS, 'an entry of "tainted"')
    ident, stamp = entry["authority"], entry["tainted_at"]
    if not isinstance(ident, str) or not _AUTHORITY.fullmatch(ident):
        raise TaintNoticeError('an entry\'s "authority" is not a lower-case hex key ID')
    if not isinstance(stamp, str) or len(stamp) > 40:
        raise TaintNoticeError(f'the "tainted_at" of {ident} is not an ISO 8601 time')
    try:
        at = datetime.fromisoformat(stamp)
    except ValueError:
        raise TaintNoticeError(f'the "tainted_at" of {ident} is not an ISO 8601 time') from None
    if at.tzinfo is None:
        raise TaintNoticeError(f'the "tainted_at" of {ident} has no time zone')
    try:
        return ident, at.astimezone(UTC)
    except OverflowError:  # "0001-01-01T00:00:00+14:00" is a valid time before UTC's year 1
        raise TaintNoticeError(
            f'the "tainted_at" of {ident} is outside years 1 to 9999 once in UTC'
        ) from None


def _exact_keys(obj: dict[str, Any], wanted: frozenset[str], what: str) -> None:
    keys = set(obj)
    if keys != wanted:
        missing, extra = sorted(wanted - keys), sorted(keys - wanted)
        parts = [f"missing {missing}" if missing else "", f"unknown {extra}" if extra else ""]
        raise TaintNoticeError(f"{what} has {' and '.join(p for p in parts if p)} key(s)"[:200])


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"key {key[:40]!r} appears twice")
        obj[key] = value
    return obj


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")
