"""Provenance of a results file: commit, GPU, driver, library versions, date."""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
from importlib import metadata

import torch

PACKAGES = ("torch", "triton", "cupy-cuda13x", "cupy-cuda12x", "cuda-python", "cuda-bindings",
            "cuda-core", "cuda-tile", "pytest-benchmark")


def _run(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20,
                              check=True).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_slug(device=None) -> str:
    """A folder name for the current GPU, e.g. 'h200' (or 'cpu')."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    for key in ("h200", "h100", "a100", "l40s", "a10", "4090"):
        if key in name:
            return key
    return "".join(ch if ch.isalnum() else "-" for ch in name).strip("-")


def collect() -> dict:
    """A dict naming what produced a set of results (LAYERBENCH_COMMIT names the commit where
    the tree has no .git, as on a machine that received a copy of it)."""
    versions = {}
    for pkg in PACKAGES:
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    commit = os.environ.get("LAYERBENCH_COMMIT") or _run(["git", "rev-parse", "HEAD"])
    info = {
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "versions": versions,
        "cuda_runtime": torch.version.cuda,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update({
            "gpu": torch.cuda.get_device_name(0),
            "gpu_memory_gib": round(props.total_memory / 2 ** 30, 1),
            "multiprocessors": props.multi_processor_count,
            "driver": _run(["nvidia-smi", "--query-gpu=driver_version",
                            "--format=csv,noheader"]),
        })
    else:
        info["gpu"] = None
    return info
