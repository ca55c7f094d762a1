"""A JWT-SVID key rotation under load: is any token refused that should not be?

Run: `.venv/bin/python -m bench.jwt_rotation [--seconds 60] [--rate 1000] [--workloads 50]
[--audiences 20] [--max-age 10]`

A real `meshca ca` (`--oidc-listen`, `--jwks-max-age MAX_AGE`, automatic key rotation with its
coverage gate) and a real sidecar `meshca agent` serving the Workload API on a Unix socket and
reporting every second (the JWT kids it holds among what it reports). `--workloads` x
`--audiences` distinct (workload, audience) pairs ask `FetchJWTSVID` (grpc over the socket, the
security header) at `--rate` per second in all, for `--seconds`; a relying party outside the
mesh validates **every** token from the discovery document alone, with a strict cache: it
fetches the JWKS once and keeps it for the `Cache-Control: max-age` it was given, never
refetching early on an unknown `kid` (the harshest honest client; pyjwt's `PyJWKClient` would
refetch).

The rotation: the operator prepares (`meshca authority prepare --jwt`) just after the relying
party's second JWKS fetch (MAX_AGE + 1 s: it will not look again for MAX_AGE); an operator
activation attempted at once must be refused (not published for MAX_AGE yet); then the active
key's clock is moved past its 5/6 point (its times rewritten in the shared key file, as if it had
aged: a 60 s run cannot wait for a real key's 5/6) and **the CA activates by itself** once the
key has been published for MAX_AGE (plus the replicas' convergence, 15 s) and the agent reports
holding it (its bundle poll is 15 s); the operator taints the old key 6 s after the activation
and revokes it 6 s after that. Tokens live `--svid-ttl` (30 s): the agent asks for new ones
every 15 s, so the new key's first tokens come within seconds of the activation. The run prints
when the activation happened against when the JWKS cache lifetime had passed and when the
agents' coverage was reached (watched from the shared reports every 0.2 s), and fails if the
activation came before either. `--force-early` is the control: the activation forced by the
operator right after the prepare, as a clock-only rotation could do it, to show what the
publication rule saves.

Prints the request rate achieved per phase with its ratio to the baseline phase (before the
prepare) measured in the same run, the CA's JWT signatures, how long after the taint the agent
stopped serving the tainted key's tokens, and the refusals: tokens refused while their key was
not revoked (must be 0), and tokens of the revoked key seen after the revoke (the agent dropped
them at the taint: must be 0).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import jwt

from ca_server.fleet import DirectoryLedgerSink, jwt_coverage
from ca_server.jwt_svid import JwtKeyFactory, JwtKeyState, LocalJwtKeyStore
from meshca.clock import SystemClock
from meshca_proto import workload_pb2
from tests.support.agent_process import AgentProcess
from tests.support.authority_cli import data_dir_target, meshca_authority
from tests.support.ca_process import CaProcess
from tests.support.processes import free_port

HEADER = (("workload.spiffe.io", "true"),)
THREADS = 8
KEY_TTL = timedelta(hours=1)
CONVERGENCE = 15.0  # JwtKeyPolicy.convergence: the publication wait's margin for replicas


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


def key_store(data_dir: Path) -> LocalJwtKeyStore:
    return LocalJwtKeyStore(data_dir, JwtKeyFactory("ES256", KEY_TTL), SystemClock())


def past_five_sixths(state: JwtKeyState) -> JwtKeyState:
    """The active key as if it had lived 5/6 of its life and 5 s more (the coverage gate's
    deadline is then 5 minutes away, far beyond the run)."""
    born = datetime.now(UTC) - KEY_TTL * 5 / 6 - timedelta(seconds=5)
    aged = dataclasses.replace(state.active, created_at=born, not_after=born + KEY_TTL)
    return JwtKeyState(tuple(aged if k is state.active else k for k in state.keys), state.history)


@dataclass
class GateWatch:
    """When the agents' coverage of `kid` was first complete, as the shared reports say (the
    same merge the CA's gate reads), polled every 0.2 s until `stop`."""

    data_dir: Path
    kid: str
    covered_at: float | None = None  # unix seconds
    figure: str = ""
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        sink = DirectoryLedgerSink(self.data_dir, "bench")
        while not self.stop.wait(0.2):
            now = datetime.now(UTC)
            counted = jwt_coverage(self.kid, sink.agents(now))
            self.figure = counted.said("hold")
            if self.covered_at is None and counted.reporting and counted.reaches(1.0):
                self.covered_at = now.timestamp()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--rate", type=float, default=1000)
    parser.add_argument("--workloads", type=int, default=50)
    parser.add_argument("--audiences", type=int, default=20)
    parser.add_argument("--max-age", type=int, default=10)
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
        "--jwt-key-ttl", "1h",
        "--jwt-svid-ttl", f"{args.svid_ttl}s",
    )  # fmt: skip
    socket = work / "spiffe" / "agent.sock"
    agent: AgentProcess | None = None
    watch: GateWatch | None = None
    try:
        ca.start()
        agent = AgentProcess(
            work,
            ca,
            "app",
            extra_args=("--workload-api-socket", f"unix://{socket}", "--report-interval", "1s"),
        )
        agent.start()
        relying = StrictRelyingParty(f"http://127.0.0.1:{oidc}/.well-known/openid-configuration")
        pairs = [f"wl{w}.aud{a}" for w in range(args.workloads) for a in range(args.audiences)]
        timeline, tally = Timeline(), Tally()
        started = time.monotonic()
        wall = time.time() - started  # unix seconds = monotonic + wall
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
        store = key_store(ca.data_dir)
        prepared = store.read().prepared
        assert prepared is not None
        watch = GateWatch(ca.data_dir, prepared.kid)
        threading.Thread(target=watch.run, daemon=True).start()
        early = step("activate (early)", "activate")
        if args.force_early:
            step("activate", "activate", "--force")
        else:
            store.transact(past_five_sixths)
            log.append(f"t={time.monotonic() - started:5.1f}s the active key moved past 5/6")
        deadline = time.monotonic() + args.max_age + CONVERGENCE + 30
        while store.read().active.kid != prepared.kid and time.monotonic() < deadline:
            time.sleep(0.1)
        timeline.phase = "activated"
        phase_start["activated"] = time.monotonic()
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
        history = store.read().history
    finally:
        if watch is not None:
            watch.stop.set()
        if agent is not None:
            agent.stop()
        ca.stop()
    signed = sum(
        1 for line in ca.log().splitlines() if '"jwt-svid-issued"' in line and "issued" in line
    )
    order = ["baseline", "prepared", "activated", "tainted", "revoked"]
    bounds = [*(phase_start[p] for p in order), ended]
    rates = {
        p: tally.per_phase[p] / max(1e-9, bounds[i + 1] - bounds[i]) for i, p in enumerate(order)
    }
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
    gate_ok = gate_report(history, prepared, watch, args.max_age, wall + started, args.force_early)
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
    clean = not tally.refused_valid and not tally.revoked_served and early == 3
    return 0 if clean and gate_ok else 1


def gate_report(
    history: tuple[Any, ...],
    prepared: Any,
    watch: GateWatch | None,
    max_age: int,
    origin: float,
    forced: bool,
) -> bool:
    """Prints when the prepared key was activated against when the JWKS cache lifetime had
    passed and when the agents' coverage was first complete (seconds from the run's start);
    whether the activation waited for both."""
    activated = next((e for e in history if e.event == "activated" and e.kid == prepared.kid), None)
    cache_passed = prepared.created_at.timestamp() + max_age + CONVERGENCE
    covered = watch.covered_at if watch is not None else None

    def at(unix: float | None) -> str:
        return "never" if unix is None else f"t={unix - origin:5.1f}s"

    print(f"  prepared {at(prepared.created_at.timestamp())}; JWKS cache lifetime + convergence "
          f"passed {at(cache_passed)}; agents' coverage complete {at(covered)} (seen every 0.2 s)"
          )  # fmt: skip
    if activated is None:
        print("  activation: NEVER")
        return False
    when = activated.at.timestamp()
    print(f"  activated {at(when)} by {'the operator' if forced else 'the CA'}: "
          f"{activated.reason}")  # fmt: skip
    waited = when >= cache_passed and covered is not None and when >= covered - 0.5
    print(f"  activation waited for the cache lifetime ({when - cache_passed:+.1f}s) and the "
          f"coverage ({when - (covered or when):+.1f}s): {'yes' if waited else 'NO'}")  # fmt: skip
    return waited or forced


if __name__ == "__main__":
    raise SystemExit(main())
