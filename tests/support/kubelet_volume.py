"""What the kubelet does to a ConfigMap volume, for tests of what reads one (the agent's root
file, the taint notice beside it): each update a new hidden directory holding the files,
`..data` swapped to it by one rename, each key a symlink through `..data`.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path


def kubelet_update(mount: Path, name: str, text: str) -> None:
    """What the kubelet does to a ConfigMap volume: a new hidden directory holding the files,
    then `..data` swapped to it by one rename, the old directory removed."""
    kubelet_project(mount, {name: text})


def kubelet_project(mount: Path, files: Mapping[str, str]) -> None:
    """`kubelet_update` for a ConfigMap with several keys: every key's file in one new
    generation, all swapped in at once; a key no longer present loses its file."""
    mount.mkdir(parents=True, exist_ok=True)
    generation = Path(tempfile.mkdtemp(prefix=f"..{time.time_ns()}.", dir=mount))
    for name, text in files.items():
        (generation / name).write_text(text)
    previous = os.readlink(mount / "..data") if (mount / "..data").is_symlink() else None
    os.symlink(generation.name, mount / "..data_tmp")
    os.replace(mount / "..data_tmp", mount / "..data")
    for name in files:
        if not (mount / name).is_symlink():
            os.symlink(f"..data/{name}", mount / name)
    if previous is not None:
        for leftover in (mount / previous).iterdir():
            if leftover.name not in files and (mount / leftover.name).is_symlink():
                (mount / leftover.name).unlink()
            leftover.unlink()
        (mount / previous).rmdir()
