"""`meshca status`'s drawing: one `Snapshot` (`meshca.commands.status_fetch`) as a table or
JSON.

An agent's document becomes one row per secret (like `istioctl proxy-config secret`, plus the
rotation columns) and what its Workload API serves; a CA's, its chain and roots, the authority
slots and their coverage (`meshca.commands.authority_view` draws them, as for `meshca authority
show`), request and refusal rates and the soonest-expiring leaves; the shared state's, the
slots and coverage alone. Rates (`ca_rates`) are over the interval since the `previous`
snapshot (`--watch`), else since the CA started.

A document was checked only at the top (`kind`): whatever answered may have sent the rest, so
`render_checked` turns a missing or mangled field into one `StatusError` line.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

from certs import format_duration
from meshca.commands import authority_view
from meshca.commands.status_fetch import SHARED_STATE, Snapshot, StatusError, unlike

TYPE_NAMES = {"cert_chain": "Cert Chain", "ca": "CA"}


# -- tables ----------------------------------------------------------------------------------------


def _time(text: str | None) -> str:
    if text is None:
        return "-"
    return datetime.fromisoformat(text).strftime("%Y-%m-%dT%H:%M:%SZ")


def _left(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return "EXPIRED" if seconds <= 0 else format_duration(timedelta(seconds=seconds))


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
             for row in [headers, *rows]]  # fmt: skip
    return "\n".join(lines)


# -- agent -----------------------------------------------------------------------------------------


def render_agent(document: dict[str, Any]) -> str:
    headers = [
        "RESOURCE NAME", "TYPE", "STATUS", "VALID CERT", "SERIAL NUMBER", "NOT BEFORE",
        "NOT AFTER", "TIME LEFT", "NEXT ROTATION", "LAST ERROR",
    ]  # fmt: skip
    rows = [
        [
            entry["resource_name"],
            TYPE_NAMES.get(entry["type"], "-"),
            entry["status"],
            "true" if entry["valid"] else "false",
            entry["serial"] or "-",
            _time(entry["not_before"]),
            _time(entry["not_after"]),
            _left(entry["time_left_seconds"]),
            _time(entry["next_rotation"]),
            _error(entry),
        ]
        for entry in document["secrets"]
    ]
    text = _table(headers, rows) if rows else "the agent serves no secrets yet"
    workload_api = document.get("workload_api")
    if workload_api is not None:
        text += "\n\n" + render_workload_api(workload_api)
    return text


def render_workload_api(summary: dict[str, Any]) -> str:
    """What the agent's SPIFFE Workload API serves (`agent.workload.api` summary)."""
    rows = [
        [rpc, str(summary["streams_open"].get(rpc, 0)), str(responses)]
        for rpc, responses in summary["responses"].items()
    ]
    refusals = summary.get("refusals") or {}
    refused = (
        "refused: " + ", ".join(f"{reason} {count}" for reason, count in sorted(refusals.items()))
        if refusals
        else "no calls refused"
    )
    return "\n".join(
        [
            f"SPIFFE Workload API on unix:{summary['socket']}: {summary['serves']}",
            _table(["WORKLOAD API RPC", "STREAMS OPEN", "RESPONSES SENT"], rows),
            refused,
        ]
    )


def _error(entry: dict[str, Any]) -> str:
    error = entry.get("last_error")
    if not error:
        return "-"
    failures = entry.get("consecutive_failures", 0)
    return f"({failures} in a row) {error}" if failures else error


# -- CA ----------------------------------------------------------------------------------------

ISSUED = "meshca_ca_certificates_issued_total"
REQUESTS = "meshca_ca_csr_requests_total"
DENIALS = "meshca_ca_denials_total"
IN_FLIGHT = "meshca_ca_requests_in_flight"


def ca_rates(current: Snapshot, previous: Snapshot | None) -> dict[str, Any]:
    """Totals and per-second rates, over the last interval (`previous`) or since the CA started."""
    if previous is not None:
        window = max(current.taken_at - previous.taken_at, 1e-9)
        before = previous.counters
        over = "last interval"
    else:
        started = datetime.fromisoformat(current.document["started"])
        now = datetime.fromisoformat(current.document["now"])
        window = max((now - started).total_seconds(), 1e-9)
        before = {}
        over = "since start"

    def total(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        return current.counters.get(name, {}).get(labels, 0.0)

    def rate(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        return (total(name, labels) - before.get(name, {}).get(labels, 0.0)) / window

    refusals = []
    for labels in sorted(current.counters.get(DENIALS, {})):
        label_map = dict(labels)
        refusals.append(
            {
                "reason": label_map.get("reason", ""),
                "code": label_map.get("code", ""),
                "total": total(DENIALS, labels),
                "per_second": rate(DENIALS, labels),
            }
        )
    return {
        "over": over,
        "window_seconds": window,
        "requests": {"total": total(REQUESTS), "per_second": rate(REQUESTS)},
        "issued": {"total": total(ISSUED), "per_second": rate(ISSUED)},
        "in_flight": total(IN_FLIGHT),
        "refusals": refusals,
    }


TRUST_BUNDLE_GAUGES = {
    "wanted": "meshca_ca_trust_bundles_wanted",
    "published": "meshca_ca_trust_bundles_published",
    "in_step": "meshca_ca_trust_bundles_in_step",
}


def trust_bundles(current: Snapshot) -> dict[str, Any] | None:
    """The ClusterTrustBundles as the CA's watch sees them (docs/trust-bundles.md), from its
    gauges; None when it publishes none (no --pod-certificate-signer)."""
    figures = {
        k: current.counters.get(name, {}).get((), 0.0) for k, name in TRUST_BUNDLE_GAUGES.items()
    }
    if not figures["wanted"]:
        return None
    return {
        "wanted": int(figures["wanted"]),
        "published": int(figures["published"]),
        "in_step": figures["in_step"] == 1,
    }


def ca_json(current: Snapshot, previous: Snapshot | None) -> dict[str, Any]:
    return {
        **current.document,
        "rates": ca_rates(current, previous),
        "trust_bundles": trust_bundles(current),
    }


def render_trust_bundles(section: dict[str, Any] | None) -> list[str]:
    if not section:
        return []
    state = (
        "in step"
        if section["in_step"]
        else "NOT in step (being written, or the Lease holder cannot: see its log)"
    )
    return [
        "",
        f"ClusterTrustBundles: {section['published']} of {section['wanted']} published, {state}",
    ]


def render_ca(document: dict[str, Any]) -> str:
    rates = document["rates"]
    parts = [
        f"CA started {_time(document['started'])}; leaves may last until the chain expires "
        f"{_time(document['chain_not_after'])}; "
        f"first root expires {_time(document['root_not_after'])}",
        "",
        _table(
            ["ROLE", "SERIAL NUMBER", "NOT BEFORE", "NOT AFTER", "TIME LEFT", "SUBJECT"],
            [
                [
                    c["role"],
                    c["serial"],
                    _time(c["not_before"]),
                    _time(c["not_after"]),
                    _left(c["time_left_seconds"]),
                    c["subject"],
                ]
                for c in document["certificates"]
            ],
        ),
        "",
        render_slots(document),
        *render_trust_bundles(document.get("trust_bundles")),
        *render_jwt_svid(document.get("jwt_svid")),
        "",
        f"requests {rates['requests']['total']:.0f} ({rates['requests']['per_second']:.2f}/s), "
        f"issued {rates['issued']['total']:.0f} ({rates['issued']['per_second']:.2f}/s), "
        f"in flight {rates['in_flight']:.0f}  [rates {_rates_over(rates)}]",
    ]
    if rates["refusals"]:
        parts += [
            "",
            _table(
                ["REFUSED FOR", "CODE", "TOTAL", "PER SECOND"],
                [
                    [r["reason"], r["code"], f"{r['total']:.0f}", f"{r['per_second']:.2f}"]
                    for r in rates["refusals"]
                ],
            ),
        ]
    else:
        parts += ["no requests refused"]
    leaves = document["soonest_expiring_leaves"]
    parts += ["", f"soonest-expiring leaves ({len(leaves)} of {document['leaves_known']} known):"]
    if leaves:
        parts.append(
            _table(
                ["IDENTITY", "SERIAL NUMBER", "ISSUED", "NOT AFTER", "TIME LEFT"],
                [
                    [
                        leaf["identity"],
                        leaf["serial"],
                        _time(leaf["issued_at"]),
                        _time(leaf["not_after"]),
                        _left(leaf["time_left_seconds"]),
                    ]
                    for leaf in leaves
                ],
            )
        )
    return "\n".join(parts)


def render_jwt_svid(section: dict[str, Any] | None) -> list[str]:
    """The JWT-SVID keys and where discovery is served (nothing when the CA did not say)."""
    if not section:
        return []
    where = section["discovery"] or "off (--oidc-listen)"
    head = (
        f"JWT-SVID keys (issuer {section['issuer'] or 'none'}; discovery {where}; "
        f"JWKS max-age {section['jwks_max_age_seconds']}s):"
    )
    rows = [
        [k["kid"], k["algorithm"], k["phase"], "yes" if k["tainted"] else "no",
         _time(k["expires_at"]), k["agents"]["text"] if k.get("agents") else "-"]
        for k in section["keys"]
    ]  # fmt: skip
    lines = ["", head, _table(["KID", "ALG", "PHASE", "TAINTED", "EXPIRES", "AGENTS"], rows)]
    if section.get("activation_waiting"):
        lines.append(f"activation of the prepared key: {section['activation_waiting']}")
    return lines


def _rates_over(rates: dict[str, Any]) -> str:
    if rates["over"] == "since start":
        return "per second since the CA started; --watch shows the last interval"
    return f"per second over the last {format_duration(timedelta(seconds=rates['window_seconds']))}"


def render_slots(document: dict[str, Any]) -> str:
    """The authority slots and their coverage, or why a CA has none."""
    if document.get("authorities") is None:
        return (
            "authority slots: none (a plugged-in CA: its authorities are rotated through "
            "--cacerts-dir, docs/rotate-the-ca.md)"
        )
    return "\n".join(
        [
            "authorities:",
            authority_view.render_authorities(document),
            "",
            authority_view.render_coverage(document["coverage"]),
        ]
    )


def render_shared_state(document: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"CA shared state: {document['source']} (read without a running CA: rates and "
            "leaves are only in a running CA, `meshca status <its monitoring address>`)",
            "",
            render_slots(document),
        ]
    )


# -- either ----------------------------------------------------------------------------------------


def render(current: Snapshot, previous: Snapshot | None, output: str) -> str:
    if current.kind in ("agent", SHARED_STATE):
        document = current.document
        if output == "json":
            return json.dumps(document, indent=2)
        return render_agent(document) if current.kind == "agent" else render_shared_state(document)
    ca = ca_json(current, previous)
    return json.dumps(ca, indent=2) if output == "json" else render_ca(ca)


def render_checked(current: Snapshot, previous: Snapshot | None, output: str, where: str) -> str:
    """`render`, with a document that lacks or mangles a field it needs said as one line: the
    shape was checked only at the top (`kind`), whatever answered may have sent the rest."""
    try:
        return render(current, previous, output)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        field = f"field {exc}" if isinstance(exc, KeyError) else f"a field ({str(exc)[:80]})"
        raise StatusError(f"{unlike(where)}: its document lacks or mangles {field}") from None
