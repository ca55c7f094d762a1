"""What the sidecar's imports cost in Python memory, above the grpc + cryptography floor, by the
library that pulled each module in.

Run: `.venv/bin/python -m bench.import_memory`

`bench/agent_footprint.py` shows that the agent's RSS above the minimal gRPC + X.509 program is
anonymous memory, and that it is there once the modules are imported. This says whose: in a
fresh interpreter that has already imported the floor (`asyncio`, `grpc.aio`,
`cryptography.x509`, which every agent needs), it imports what `meshca agent` imports with
tracemalloc on, and charges each module what Python allocated while that module's own code ran
(its code objects, classes, tables; not the modules it imports in turn, which are charged
themselves). A module is attributed to the library nearest the root of its import chain: the
`http.server` that `prometheus_client` imports counts for prometheus_client, the stdlib modules
that only the project imports count as "stdlib (for the project)". Memory that C code allocates
outside Python's allocator (upb's descriptor pool, OpenSSL, gRPC core) is not traced: the
bench's smaps breakdown has it, in malloc's heap.

The hook is CPython's private `importlib._bootstrap._load_unlocked` (the one place every module
executes through); the probe fails loudly if an interpreter no longer has it.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.processes import child_env

FLOOR = ("asyncio", "grpc.aio", "cryptography.x509")
# What `meshca agent ...` imports before it runs (tests/agent/test_lean_imports.py says the same).
AGENT = ("meshca.cli", "meshca.commands.agent", "agent.main")
PROJECT = ("agent", "certs", "meshca", "meshca_proto")
# Top-level packages folded into the distribution a deployer would name.
DISTRIBUTIONS = {
    "google": "protobuf",
    "envoy": "xds-protos",
    "xds": "xds-protos",
    "udpa": "xds-protos",
    "validate": "xds-protos",
}

PROBE = """
import importlib, importlib._bootstrap as bootstrap, json, sys, tracemalloc
for name in {floor!r}:
    importlib.import_module(name)
load = bootstrap._load_unlocked  # AttributeError here: the hook moved, see the docstring
importer, own_bytes, children = {{}}, {{}}, [0]
executing = ["<main>"]

def measured_load(spec):
    importer[spec.name] = executing[-1]
    executing.append(spec.name)
    children.append(0)
    before = tracemalloc.get_traced_memory()[0]
    try:
        return load(spec)
    finally:
        executing.pop()
        spent = tracemalloc.get_traced_memory()[0] - before
        own_bytes[spec.name] = spent - children.pop()
        children[-1] += spent

tracemalloc.start()
bootstrap._load_unlocked = measured_load
for name in {agent!r}:
    importlib.import_module(name)
bootstrap._load_unlocked = load
print(json.dumps({{"importer": importer, "own_bytes": own_bytes,
                  "traced": tracemalloc.get_traced_memory()[0]}}))
"""


def library_of(module: str, importer: dict[str, str]) -> str:
    """The library nearest the root of `module`'s import chain (the project's own packages are
    skipped: they are the reason anything is imported, not a library to blame)."""
    chain = [module]
    while importer.get(chain[-1], "<main>") != "<main>":
        chain.append(importer[chain[-1]])
    for name in reversed(chain):
        top = name.split(".")[0]
        if top in PROJECT:
            continue
        if top in sys.stdlib_module_names:
            return f"stdlib (for the project: {top})"
        return DISTRIBUTIONS.get(top, top)
    return f"project: {module.split('.')[0]}"


def main() -> int:
    probe = PROBE.format(floor=FLOOR, agent=AGENT)
    result = subprocess.run(
        [sys.executable, "-c", probe], env=child_env(), capture_output=True, text=True
    )
    if result.returncode != 0:
        print(result.stderr, file=sys.stderr)
        return 1
    measured = json.loads(result.stdout.splitlines()[-1])
    by_library: dict[str, tuple[int, int]] = {}
    for module, own in measured["own_bytes"].items():
        library = library_of(module, measured["importer"])
        size, count = by_library.get(library, (0, 0))
        by_library[library] = (size + own, count + 1)
    print(
        f"Python memory the sidecar's imports add above `import {', '.join(FLOOR)}`: "
        f"{measured['traced'] / 2**20:.2f} MiB traced, {len(measured['own_bytes'])} modules"
    )
    for library, (size, count) in sorted(by_library.items(), key=lambda item: -item[1][0]):
        print(f"{size / 2**20:8.2f} MiB {count:5} modules  {library}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
