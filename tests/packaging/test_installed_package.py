"""meshca as users install it: built from a clean export, installed without `-e` into a fresh
virtualenv, run from a directory outside the checkout.

The rest of the suite runs the source tree (an editable install, pytest's `pythonpath`, children
started with the tree on PYTHONPATH), which hides a module the wheel leaves out: once, every
`meshca` command failed with `No module named 'ca_server.kube'` for anyone who ran
`pip install .` or the image. The steps here are the Dockerfile's (`python -m build`, then
`pip install` of the wheel into a new virtualenv), so the image is covered by this file too.

The export is `git archive` of the working tree's tracked files (`git stash create` folds in
uncommitted edits), so an untracked file cannot leak into what is checked.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from certs import describe_certificate, load_cert
from tests.support.processes import REPO_ROOT, free_port, http_status, stop_child, wait_for

pytestmark = pytest.mark.timeout(600)

# Top-level import packages of the distribution, and where each lives in the tree.
PRODUCT_PACKAGES = {
    "meshca": Path("meshca"),
    "certs": Path("certs"),
    "ca_server": Path("ca_server"),
    "agent": Path("agent"),
    "meshca_proto": Path("proto/meshca_proto"),
}
IDENTITY = "spiffe://cluster.local/ns/default/sa/sleep"


@dataclass(frozen=True)
class Installed:
    export: Path  # the clean export the distributions were built from
    wheel: Path
    sdist: Path
    venv: Path
    outside: Path  # a working directory outside the checkout

    @property
    def meshca(self) -> str:
        return str(self.venv / "bin" / "meshca")


def _user_env() -> dict[str, str]:
    """The environment of a user's shell: nothing that points Python at the source tree."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(args: list[str], cwd: Path, timeout: float = 300) -> str:
    done = subprocess.run(
        args, cwd=cwd, env=_user_env(), capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{' '.join(args)} exited {done.returncode}:\n{done.stderr}"
    return done.stdout


def _export_tree(destination: Path) -> None:
    if not (REPO_ROOT / ".git").exists():
        pytest.skip("the packaging test exports the tree with git; this is not a git checkout")
    stash = subprocess.run(
        ["git", "stash", "create"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    archive = subprocess.run(
        ["git", "archive", "--format=tar", stash or "HEAD"],
        cwd=REPO_ROOT,
        capture_output=True,
        check=True,
    ).stdout
    destination.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(destination)], input=archive, check=True)


@pytest.fixture(scope="module")
def installed(
    tmp_path_factory: pytest.TempPathFactory, starts_processes: None
) -> Iterator[Installed]:
    root = tmp_path_factory.mktemp("installed")
    export, dist, venv, outside = root / "src", root / "dist", root / "venv", root / "outside"
    _export_tree(export)
    outside.mkdir()
    # The Dockerfile's steps: build sdist then wheel from it, install the wheel into a new venv.
    _run([sys.executable, "-m", "build", "--outdir", str(dist), str(export)], cwd=outside)
    _run([sys.executable, "-m", "venv", str(venv)], cwd=outside)
    (wheel,) = dist.glob("meshca-*.whl")
    (sdist,) = dist.glob("meshca-*.tar.gz")
    _run([str(venv / "bin" / "pip"), "install", "--quiet", str(wheel)], cwd=outside)
    yield Installed(export, wheel, sdist, venv, outside)
    shutil.rmtree(root, ignore_errors=True)


def _product_modules(tree: Path) -> set[str]:
    """`package/sub/module.py` paths, as installed, of every product module in `tree`."""
    found = set()
    for package, location in PRODUCT_PACKAGES.items():
        for path in (tree / location).rglob("*.py"):
            found.add(f"{package}/{path.relative_to(tree / location).as_posix()}")
    return found


def test_the_wheel_holds_every_product_module_and_no_test_code(installed: Installed):
    with zipfile.ZipFile(installed.wheel) as wheel:
        names = wheel.namelist()
    in_wheel = {name for name in names if name.endswith(".py")}
    expected = _product_modules(installed.export)
    assert "ca_server/kube/__init__.py" in expected  # the subpackage that was once left out
    assert in_wheel - expected == set(), "the wheel ships modules that are not product code"
    assert expected - in_wheel == set(), "the wheel leaves out product modules"
    top_levels = {name.split("/", 1)[0] for name in names}
    assert top_levels == set(PRODUCT_PACKAGES) | {"meshca-0.1.0.dist-info"}
    for package in PRODUCT_PACKAGES:
        assert f"{package}/py.typed" in names, f"{package} is typed but lacks its py.typed marker"
    assert "meshca-0.1.0.dist-info/licenses/LICENSE" in names
    with zipfile.ZipFile(installed.wheel) as wheel:
        metadata = wheel.read("meshca-0.1.0.dist-info/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata
    assert "## Quickstart" in metadata  # the README is the long description


def test_the_installed_metadata_takes_grpcio_releases_after_the_tested_one(installed: Installed):
    """`pip install meshca` works beside a newer grpcio (a security release, another package's
    need): the completion-queue server checks the release at start and the CA falls back to
    grpc.aio (ca_server.serving.cq_server), so the requirement has no upper bound. Read from
    what pip installed, not from pyproject.toml."""
    probe = (
        "import importlib.metadata as m, json; "
        "print(json.dumps([m.requires('meshca'), m.version('grpcio')]))"
    )
    requires, installed_grpcio = json.loads(
        _run([str(installed.venv / "bin" / "python"), "-c", probe], installed.outside)
    )
    grpcio_lines = [req for req in map(Requirement, requires) if req.name == "grpcio"]
    # One requirement for every install (no marker); the `test` extra alone keeps the suite on
    # the releases the completion-queue server is tested with.
    (grpcio,) = [req for req in grpcio_lines if req.marker is None]
    for req in grpcio_lines:  # any other applies to an extra only, never to `pip install meshca`
        assert req.marker is None or not req.marker.evaluate({"extra": ""}), req
    for release in ("1.85.1", "1.85.4", "1.86.0", "1.90.2", "2.0.0"):
        assert grpcio.specifier.contains(release), f"{grpcio} refuses grpcio {release}"
    assert not grpcio.specifier.contains("1.85.0")  # older than the oldest tested
    assert grpcio.specifier.contains(installed_grpcio)


def test_the_sdist_rebuilds_the_same_package(installed: Installed):
    with tarfile.open(installed.sdist) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    for required in ("README.md", "LICENSE", "pyproject.toml", "proto/meshca_proto/ca.proto"):
        assert required in names
    for package, location in PRODUCT_PACKAGES.items():
        assert f"{location.as_posix()}/py.typed" in names, f"{package}'s py.typed"
    shipped = {name for name in names if name.endswith(".py")}
    expected = {
        f"{location.as_posix()}/{path.relative_to(installed.export / location).as_posix()}"
        for location in PRODUCT_PACKAGES.values()
        for path in (installed.export / location).rglob("*.py")
    }
    assert shipped == expected


def test_the_installed_package_imports_from_the_virtualenv_not_the_checkout(
    installed: Installed,
):
    modules = "agent, ca_server.kube, certs, meshca, meshca_proto"
    probe = f"import json, {modules}; print(json.dumps([m.__file__ for m in ({modules})]))"
    files = json.loads(
        _run([str(installed.venv / "bin" / "python"), "-c", probe], installed.outside)
    )
    for file in files:
        assert Path(file).is_relative_to(installed.venv), file


def test_every_command_answers_help_and_version(installed: Installed):
    top = _run([installed.meshca, "--help"], installed.outside)
    choices = re.search(r"\{([a-z,-]+)\}", top)
    assert choices, top
    commands = choices.group(1).split(",")
    assert {"ca", "agent", "token", "inspect", "up"} <= set(commands)
    version = _run([installed.meshca, "--version"], installed.outside)
    assert version.strip() == "meshca 0.1.0"
    for command in commands:
        assert "usage: meshca " + command in _run(
            [installed.meshca, command, "--help"], installed.outside
        )


def _start(args: list[str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            args, cwd=cwd, env=_user_env(), stdout=out, stderr=subprocess.STDOUT
        )


def _up_and(proc: subprocess.Popen[bytes], log: Path, url: str) -> bool:
    """Whether `url` answers 200; fails at once (with the log) if `proc` has exited."""
    if proc.poll() is not None:
        raise AssertionError(f"exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
    return http_status(url) == 200


def test_the_installed_ca_token_and_agent_issue_a_certificate(installed: Installed):
    work = Path(os.path.realpath(installed.outside)) / "ca-agent"
    work.mkdir()
    data_dir, out_dir = work / "ca", work / "certs"
    monitoring, status = free_port(), free_port()
    ca_addr = f"127.0.0.1:{free_port()}"
    ca_log, agent_log = work / "ca.log", work / "agent.log"
    ca = _start(
        [installed.meshca, "ca", "--data-dir", str(data_dir), "--listen", ca_addr,
         "--monitoring-listen", f"127.0.0.1:{monitoring}"],
        work, ca_log,
    )  # fmt: skip
    agent: subprocess.Popen[bytes] | None = None
    try:
        wait_for(
            lambda: _up_and(ca, ca_log, f"http://127.0.0.1:{monitoring}/ready"),
            60,
            "the installed CA's /ready",
        )
        token = _run(
            [installed.meshca, "token", "--data-dir", str(data_dir), "--namespace", "default",
             "--service-account", "sleep"],
            work,
        )  # fmt: skip
        (work / "token").write_text(token.strip())
        agent = started = _start(
            [installed.meshca, "agent", "--ca-addr", ca_addr,
             "--ca-root", str(data_dir / "root-cert.pem"), "--token-file", str(work / "token"),
             "--sds-socket", str(work / "sds.sock"), "--output-dir", str(out_dir),
             "--status-listen", f"127.0.0.1:{status}", "--namespace", "default",
             "--service-account", "sleep"],
            work, agent_log,
        )  # fmt: skip
        wait_for(
            lambda: _up_and(started, agent_log, f"http://127.0.0.1:{status}/healthz/ready"),
            60,
            "the installed agent to hold a certificate",
        )
        leaf = load_cert((out_dir / "cert-chain.pem").read_bytes())
        assert describe_certificate(leaf).identity == IDENTITY
        assert (work / "sds.sock").exists()
    finally:
        codes = [stop_child(proc) for proc in (agent, ca) if proc is not None]
    assert codes == [0, 0], f"agent log:\n{agent_log.read_text()}\nCA log:\n{ca_log.read_text()}"


def test_meshca_up_from_the_installed_package_serves_a_certificate(installed: Installed):
    """The issue's acceptance: `pip install . && cd "$(mktemp -d)" && meshca up`."""
    work = Path(os.path.realpath(installed.outside)) / "up"
    work.mkdir()
    proc = subprocess.Popen(
        [installed.meshca, "up", "--secret-ttl", "30s", "--status-listen", "127.0.0.1:0"],
        cwd=work,
        env=_user_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True)
    reader.start()
    try:
        chain = work / ".meshca" / "certs" / "cert-chain.pem"
        wait_for(lambda: any("Ctrl-C to stop" in line for line in lines), 60, "the banner")
        wait_for(chain.exists, 30, "the certificate files")
        assert describe_certificate(load_cert(chain.read_bytes())).identity == (
            "spiffe://cluster.local/ns/default/sa/default"
        )
    finally:
        code = stop_child(proc, signal.SIGINT, timeout=15)
        reader.join(5)
    assert code == 0, "".join(lines)
