"""A JWT-SVID key rotation under load: is any token refused that should not be?

Run: `.venv/bin/python -m bench.jwt_rotation [--seconds 60] [--rate 1000] [--workloads 50]
[--audiences 20] [--max-age 15]`

A real `meshca ca` (`--oidc-listen`, `--jwks-max-age MAX_AGE`, `--no-root-rotation`: the
operator drives the rotation) and a real sidecar `meshca agent` serving the Workload API on a
Unix socket. `--workloads` x `--audiences` distinct (workload, audience) pairs ask
`FetchJWTSVID` (grpc over the socket, the security header) at `--rate` per second in all, for
`--seconds`; a relying party outside the mesh validates **every** token from the discovery
document alone, with a strict cache: it fetches the JWKS once and keeps it for the
`Cache-Control: max-age` it was given, never refetching early on an unknown `kid` (the harshest
honest client; pyjwt's `PyJWKClient` would refetch).

The operator's rotation (`meshca authority … --jwt`): prepare just after the relying party's
second JWKS fetch (MAX_AGE + 1 s: it will not look again for MAX_AGE); an activation attempted
at once (must be refused: the key has not been published for MAX_AGE yet); activation again
once it has; taint of the old key 6 s later; revoke 6 s after that. Tokens live `--svid-ttl`
(30 s): the agent asks for new ones every 15 s, so the new key's first tokens come within
seconds of the activation. `--force-early` is the control: the activation forced right after
the prepare, as a clock-only rotation could do it, to show what the publication rule saves.

Prints the request rate achieved per phase with its ratio to the baseline phase (before the
prepare) measured in the same run, the CA's JWT signatures, how long after the taint the agent
stopped serving the tainted key's tokens, and the refusals: tokens refused while their key was
not revoked (must be 0), and tokens of the revoked key seen after the revoke (the agent dropped
them at the taint: must be 0).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import jwt

from meshca_proto import workload_pb2
from tests.support.agent_process import AgentProcess
from tests.support.authority_cli import data_dir_target, meshca_authority
from tests.support.ca_process import CaProcess
from tests.support.processes import free_port

HEADER = (("workload.spiffe.io", "true"),)
THREADS = 8


class StrictRelyingParty:
    """Validates tokens from the discovery document alone, caching the JWKS for exactly the
    max-age it was served with (no early refetch on an unknown kid)."""

    def __init__(self, discovery: str) -> None:
        with urllib.request.urlopen(discovery, timeout=5) as response:
            self.document = json.loads(response.read())
        self._lock = threading.Lock()
        self._keys: dict[str, Any] = {}
        self._expires = 0.0
        self.fetches = 0

    def _jwks(self) -> dict[str, Any]:
        with self._lock:
            if time.monotonic() >= self._expires:
                with urllib.request.urlopen(self.document["jwks_uri"], timeout=5) as response:
                    body = json.loads(response.read())
                    control = response.headers.get("Cache-Control", "")
                found = re.search(r"max-age=(\d+)", control)
                self._expires = time.monotonic() + (int(found.group(1)) if found else 0)
                self._keys = {k["kid"]: jwt.PyJWK(k) for k in body["keys"]}
                self.fetches += 1
            return self._keys

    def validate(self, token: str, audience: str) -> None:
        kid = jwt.get_unverified_header(token)["kid"]
        key = self._jwks().get(kid)
        if key is None:
            raise jwt.InvalidKeyError(f"kid {kid} not in the cached JWKS")
        jwt.decode(
            token,
            key.key,
            algorithms=self.document["id_token_signing_alg_values_supported"],
            audience=audience,
            issuer=self.document["issuer"],
        )


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    per_phase: Counter[str] = field(default_factory=Counter)
    kids_after: dict[str, float] = field(default_factory=dict)  # kid -> last time it was served
    refused_valid: list[str] = field(default_factory=list)
    revoked_served: int = 0
    errors: Counter[str] = field(default_factory=Counter)


@dataclass
class Timeline:
    phase: str = "baseline"
    revoked: set[str] = field(default_factory=set)
    revoked_at: float | None = None


def load(
    socket: Path,
    relying: StrictRelyingParty,
    pairs: list[str],
    rate: float,
    until: float,
    timeline: Timeline,
    tally: Tally,
    offset: int,
) -> None:
    interval = THREADS / rate
    next_at = time.monotonic()
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        fetch = channel.unary_unary(
            "/SpiffeWorkloadAPI/FetchJWTSVID",
            request_serializer=workload_pb2.JWTSVIDRequest.SerializeToString,
            response_deserializer=workload_pb2.JWTSVIDResponse.FromString,
        )
        index = offset
        while (now := time.monotonic()) < until:
            if now < next_at:
                time.sleep(next_at - now)
            next_at += interval
            audience = pairs[index % len(pairs)]
            index += THREADS
            phase = timeline.phase
            try:
                answer = fetch(
                    workload_pb2.JWTSVIDRequest(audience=[audience]), metadata=HEADER, timeout=10
                )
            except grpc.RpcError as exc:
                with tally.lock:
                    tally.errors[f"fetch {exc.code().name}"] += 1
                continue
            token = answer.svids[0].svid
            kid = jwt.get_unverified_header(token)["kid"]
            revoked = kid in timeline.revoked
            try:
                relying.validate(token, audience)
                refused = None
            except jwt.PyJWTError as exc:
                refused = f"{type(exc).__name__}: {exc}"
            with tally.lock:
                tally.per_phase[phase] += 1
                tally.kids_after[kid] = time.monotonic()
                if revoked:
                    tally.revoked_served += 1
                elif refused is not None:
                    tally.refused_valid.append(f"{phase} {kid[:12]}: {refused}")


def operator(data_dir: Path, max_age: int, *args: str) -> tuple[int, str]:
    """`meshca authority ARGS --jwt`: its exit status and what it said (the refusal, or the
    audited changes)."""
    result = meshca_authority(
        data_dir_target(data_dir), *args, "--jwt", "--jwks-max-age", f"{max_age}s", "-o", "json"
    )
    said = []
    for line in result.stderr.strip().splitlines():
        try:
            event = json.loads(line)
            said.append(f"{event['outcome']} {event['kid'][:12]}")
        except (ValueError, KeyError):
            said.append(line)
    return result.returncode, "; ".join(said)


def active_kid(data_dir: Path) -> str:
    result = meshca_authority(data_dir_target(data_dir), "show", "--jwt", "-o", "json")
    keys = json.loads(result.stdout)["jwt_keys"]
    return str(next(k["kid"] for k in keys if k["phase"] == "active"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--rate", type=float, default=1000)
    parser.add_argument("--workloads", type=int, default=50)
    parser.add_argument("--audiences", type=int, default=20)
    parser.add_argument("--max-age", type=int, default=20)
    parser.add_argument("--svid-ttl", type=int, default=30, help="--jwt-svid-ttl, seconds")
    parser.add_argument(
        "--force-early",
        action="store_true",
        help="the control: activate with --force right after the prepare, as a clock-only "
        "rotation could; the strict relying party then refuses the new key's tokens",
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="jwtrot-", dir="/tmp"))
    oidc = free_port()
    ca = CaProcess(
        work / "ca",
        "--oidc-listen", f"127.0.0.1:{oidc}",
        "--jwks-max-age", f"{args.max_age}s",
        "--ca-reload-interval", "200ms",
        "--no-root-rotation",
        "--jwt-svid-ttl", f"{args.svid_ttl}s",
    )  # fmt: skip
    socket = work / "spiffe" / "agent.sock"
    agent: AgentProcess | None = None
    try:
        ca.start()
        agent = AgentProcess(
            work, ca, "app", extra_args=("--workload-api-socket", f"unix://{socket}")
        )
        agent.start()
        relying = StrictRelyingParty(f"http://127.0.0.1:{oidc}/.well-known/openid-configuration")
        pairs = [f"wl{w}.aud{a}" for w in range(args.workloads) for a in range(args.audiences)]
        timeline, tally = Timeline(), Tally()
        started = time.monotonic()
        until = started + args.seconds
        threads = [
            threading.Thread(
                target=load,
                args=(socket, relying, pairs, args.rate, until, timeline, tally, i),
                daemon=True,
            )
            for i in range(THREADS)
        ]
        for thread in threads:
            thread.start()
        log: list[str] = []
        phase_start = {"baseline": started}

        def step(name: str, *verb: str) -> int:
            code, said = operator(ca.data_dir, args.max_age, *verb)
            log.append(f"t={time.monotonic() - started:5.1f}s {' '.join(verb)}: exit {code} {said}")
            return code

        old = active_kid(ca.data_dir)
        # Just after the relying party's second JWKS fetch: it will not look again for max-age.
        time.sleep(max(0.0, started + args.max_age + 1 - time.monotonic()))
        timeline.phase = "prepared"
        phase_start["prepared"] = time.monotonic()
        step("prepare", "prepare")
        early = step("activate (early)", "activate")
        if not args.force_early:
            wait = phase_start["prepared"] + args.max_age + 1 - time.monotonic()
            time.sleep(max(0.0, wait))
        timeline.phase = "activated"
        phase_start["activated"] = time.monotonic()
        step("activate", "activate", *(["--force"] if args.force_early else []))
        time.sleep(max(0.0, phase_start["activated"] + 6 - time.monotonic()))
        timeline.phase = "tainted"
        phase_start["tainted"] = tainted_at = time.monotonic()
        step("taint", "taint", old)
        time.sleep(max(0.0, phase_start["tainted"] + 6 - time.monotonic()))
        timeline.revoked.add(old)
        timeline.phase = "revoked"
        phase_start["revoked"] = time.monotonic()
        step("revoke", "revoke", old)
        for thread in threads:
            thread.join()
        ended = time.monotonic()
    finally:
        if agent is not None:
            agent.stop()
        ca.stop()
    signed = sum(
        1 for line in ca.log().splitlines() if '"jwt-svid-issued"' in line and "issued" in line
    )
    order = ["baseline", "prepared", "activated", "tainted", "revoked"]
    bounds = [*(phase_start[p] for p in order), ended]
    rates = {p: tally.per_phase[p] / (bounds[i + 1] - bounds[i]) for i, p in enumerate(order)}
    print(
        f"jwt rotation under load: {args.workloads} workloads x {args.audiences} audiences, "
        f"target {args.rate:.0f}/s for {args.seconds:.0f}s, JWKS max-age {args.max_age}s"
    )
    print("\n".join(log))
    for phase in order:
        ratio = rates[phase] / rates["baseline"] if rates["baseline"] else float("nan")
        print(f"  {phase:<9} {tally.per_phase[phase]:>7} fetched+validated  "
              f"{rates[phase]:7.0f}/s  ({ratio:.2f}x baseline)")  # fmt: skip
    total = sum(tally.per_phase.values())
    drop = tally.kids_after.get(old, 0.0) - tainted_at
    print(f"  total {total} tokens ({total / (ended - started):.0f}/s); CA signed {signed}; "
          f"relying party fetched the JWKS {relying.fetches} times")  # fmt: skip
    print(f"  early activation refused: {'yes' if early == 3 else 'NO'}")
    print(f"  tainted key's tokens last served {drop:+.2f}s from the taint (negative: none since)")
    print(f"  refused while their key was not revoked: {len(tally.refused_valid)}")
    print(f"  revoked key's tokens served after the revoke: {tally.revoked_served}")
    if tally.errors:
        print(f"  fetch errors: {dict(tally.errors)}")
    for line in tally.refused_valid[:5]:
        print(f"    {line}")
    shutil.rmtree(work, ignore_errors=True)
    if args.force_early:
        return 0  # the control: refusals are what it shows
    return 0 if not tally.refused_valid and not tally.revoked_served and early == 3 else 1


if __name__ == "__main__":
    raise SystemExit(main())
