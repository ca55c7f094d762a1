"""The real kube-apiserver, etcd and pilot-agent the tests run, built from pinned Go modules.

Why built and not downloaded: the project's machines reach the Go module proxy (and PyPI, Debian)
but no release download site, and a build from a module pinned in the checkout is reproducible and
reviewable: tests/realbin/<name>/go.mod names the release (its ``tool`` line the main package), and
go.sum pins every byte of it. Each binary lands in a cache outside the checkout, keyed by that
version (``$MESHCA_TEST_BIN_CACHE``, default ~/.cache/meshca-test-binaries/<name>-<version>/), so
a warm machine rebuilds nothing and no binary is ever committed.

``python -m tests.support.real_binaries`` builds what is missing (the Makefile's ``test`` target
runs it before pytest) and prints what it built and how long it took. The fixtures call
:func:`binary` which never builds (a test has a 120 s timeout; a cold kube-apiserver build takes
longer): a missing binary fails the test loudly with the command that builds it.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

_MODULES = pathlib.Path(__file__).resolve().parent.parent / "realbin"


@dataclasses.dataclass(frozen=True)
class GoBinary:
    """One binary: its name, the Go module it comes from, and that module's pinned version."""

    name: str
    module_dir: pathlib.Path
    package: str
    module: str
    version: str

    @property
    def path(self) -> pathlib.Path:
        return cache_dir() / f"{self.name}-{self.version}" / self.name


# (binary name, module directory under tests/realbin, the main package's module path prefix).
# One module directory may give several binaries: its go.mod has one `tool` line per main
# package (the one whose last path element is the binary's name), and they build in one `go build`.
_BINARIES = (
    ("etcd", "etcd", "go.etcd.io/etcd/server/v3"),
    ("kube-apiserver", "kube", "k8s.io/kubernetes"),
    ("pilot-agent", "istio", "istio.io/istio"),
    ("pilot-discovery", "istio", "istio.io/istio"),
    ("helm", "helm", "helm.sh/helm/v4"),
    ("go-spiffe-jwt", "gospiffe", "github.com/spiffe/go-spiffe/v2"),
)


class BinaryMissing(RuntimeError):
    """A test needs a binary that has not been built on this machine."""


def cache_dir() -> pathlib.Path:
    configured = os.environ.get("MESHCA_TEST_BIN_CACHE")
    if configured:
        return pathlib.Path(configured)
    return pathlib.Path.home() / ".cache" / "meshca-test-binaries"


def _read_module(name: str, directory: str, module: str) -> GoBinary:
    module_dir = _MODULES / directory
    text = (module_dir / "go.mod").read_text()
    tools = _tools(text)
    if len(tools) > 1:  # several main packages: the binary is named as its package
        tools = [t for t in tools if t.rsplit("/", 1)[-1] == name]
    pinned = re.search(rf"^\s*(?:require\s+)?{re.escape(module)}\s+(v\S+)", text, re.MULTILINE)
    if len(tools) != 1 or pinned is None:
        raise ValueError(
            f"{module_dir / 'go.mod'}: expected a `tool` line (ending in /{name} if several) "
            f"and a pin of {module}"
        )
    return GoBinary(name, module_dir, tools[0], module, pinned.group(1))


def _tools(go_mod: str) -> list[str]:
    """The packages a go.mod's `tool` directives name: `tool PKG` lines and `tool ( ... )`
    blocks (what `go get -tool` writes once there are two)."""
    found = re.findall(r"^tool\s+([^\s(]\S*)\s*$", go_mod, re.MULTILINE)
    for block in re.findall(r"^tool\s*\((.*?)^\)", go_mod, re.MULTILINE | re.DOTALL):
        found.extend(line.strip() for line in block.splitlines() if line.strip())
    return found


def binaries() -> dict[str, GoBinary]:
    return {name: _read_module(name, directory, module) for name, directory, module in _BINARIES}


def binary(name: str) -> pathlib.Path:
    """The built binary's path; raises BinaryMissing (never skips) when it was not built."""
    wanted = binaries()[name]
    if not wanted.path.is_file():
        raise BinaryMissing(
            f"{wanted.name} {wanted.version} is not built at {wanted.path}: run "
            "`python -m tests.support.real_binaries` (make test does) on a machine with Go"
        )
    return wanted.path


def versions() -> str:
    return ", ".join(f"{b.name} {b.module}@{b.version}" for b in binaries().values())


def _go() -> str:
    found = shutil.which("go")
    if found is None and os.path.exists("/usr/local/go/bin/go"):
        found = "/usr/local/go/bin/go"  # Go's own tarball layout, often not on PATH
    if found is None:
        raise SystemExit("tests/k8s_real needs Go (https://go.dev/dl) on PATH to build binaries")
    return found


def build(wanted: list[GoBinary]) -> float:
    """Builds binaries of one module with one `go build` (its packages compile once for all)
    into their cache directories, atomically: a half-built file never appears."""
    module_dir = wanted[0].module_dir
    staging = cache_dir() / f".partial-{module_dir.name}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    started = time.monotonic()
    packages = [b.package for b in wanted]
    # One package: named by `-o` (etcd's main package path ends in /v3); several: by `go build`,
    # after each package's last path element (the binary names _BINARIES gives them).
    output = f"{staging}/{wanted[0].name}" if len(wanted) == 1 else f"{staging}/"
    command = ["nice", "-n", "15", _go(), "build", "-trimpath", "-o", output, *packages]
    env = {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-mod=readonly -buildvcs=false"}
    result = subprocess.run(command, cwd=module_dir, env=env, check=False)
    if result.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        names = ", ".join(f"{b.name} {b.version}" for b in wanted)
        raise SystemExit(f"building {names} failed: {' '.join(command)}")
    for each in wanted:
        each.path.parent.mkdir(parents=True, exist_ok=True)
        (staging / each.name).replace(each.path)
    shutil.rmtree(staging, ignore_errors=True)
    return time.monotonic() - started


def main() -> int:
    total = time.monotonic()
    missing: dict[pathlib.Path, list[GoBinary]] = {}
    for wanted in binaries().values():
        if wanted.path.is_file():
            print(f"real-binaries: {wanted.name} {wanted.version} already built ({wanted.path})")
            continue
        missing.setdefault(wanted.module_dir, []).append(wanted)
    for group in missing.values():
        names = " and ".join(b.name for b in group)
        print(
            f"real-binaries: building {names} from {group[0].module}@{group[0].version} ...",
            flush=True,
        )
        seconds = build(group)
        print(
            f"real-binaries: built {names} {group[0].version} in {seconds:.0f} s",
            flush=True,
        )
    print(f"real-binaries: ready in {time.monotonic() - total:.1f} s (cache {cache_dir()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
