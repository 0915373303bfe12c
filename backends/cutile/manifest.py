"""Where ahead-of-time builds live and how a build is found and checked."""
from __future__ import annotations

import json
import os
from pathlib import Path

from . import specs

ARCHS = ("sm_80", "sm_90", "sm_100")
BUILD_ENV = "LAYERBENCH_CUTILE_BUILD"
CALLING_CONVENTION = "cutile_python_v1"  # what launch.pack packs
INDEX_BITS = 32


def default_root() -> Path:
    """The build root: $LAYERBENCH_CUTILE_BUILD, else ~/.cache/layerbench/cutile."""
    return Path(os.environ.get(BUILD_ENV) or Path.home() / ".cache" / "layerbench" / "cutile")


def build_dir(arch: str, root=None) -> Path:
    """The folder of one architecture's build of the current kernel sources."""
    return Path(root or default_root()) / specs.source_hash() / arch


def load(arch: str, root=None) -> tuple[dict | None, str]:
    """(manifest, "") for a complete build of the current sources for arch, else (None, why)."""
    folder = build_dir(arch, root)
    path = folder / "manifest.json"
    if not path.is_file():
        return None, (f"no cubins for {arch} of these kernel sources under {folder.parent} "
                      f"(run `python -m layerbench.backends.cutile.export --arch {arch}`, "
                      f"or set {BUILD_ENV})")
    manifest = json.loads(path.read_text())
    if manifest.get("source_hash") != specs.source_hash():
        return None, f"{path} was built from other kernel sources"
    if (manifest.get("calling_convention"), manifest.get("index_bits")) != (
            CALLING_CONVENTION, INDEX_BITS):
        return None, (f"{path} uses calling convention {manifest.get('calling_convention')} "
                      f"with {manifest.get('index_bits')}-bit indices; the launcher packs "
                      f"{CALLING_CONVENTION} with {INDEX_BITS}-bit indices")
    missing = [c for c in {e["cubin"] for e in manifest["entries"]} if not (folder / c).is_file()]
    if missing:
        return None, f"{folder} lacks {missing}"
    return manifest, ""
