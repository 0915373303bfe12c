"""Just-in-time build of the wmma extension: toolchain lookup, flags, one build per source hash
and architecture, reused across processes."""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
from pathlib import Path

import torch

from layerbench.common.cuda_host import device_arch
from layerbench.common.errors import Unsupported

SOURCE_DIR = Path(__file__).resolve().parent
SOURCES = ("ops.cpp", "norm.cu", "linear.cu", "linear_two_products.cu",
           "linear_three_products.cu", "attention.cu", "block.cu", "peak.cu")  # compiled and linked
HEADERS = ("common.cuh", "linear.cuh")
ARCHES = ("80", "90")  # compute capabilities the CPU test compiles for
CACHE_ENV = "LAYERBENCH_WMMA_CACHE"


def cuda_home() -> str | None:
    """The CUDA toolkit root: $CUDA_HOME, $CUDA_PATH, the toolkit of nvcc on PATH, or
    /usr/local/cuda; None when none has nvcc and the runtime headers."""
    def complete(root) -> bool:
        root = Path(root)
        return (root / "bin" / "nvcc").exists() and (root / "include" / "cuda_runtime.h").exists()

    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent)
    candidates.append("/usr/local/cuda")
    return next((str(c) for c in candidates if c and complete(c)), None)


def nvcc_path() -> str | None:
    """The nvcc executable, or None when no toolkit is found."""
    home = cuda_home()
    return str(Path(home) / "bin" / "nvcc") if home else None


@functools.cache
def _gpu_codes(nvcc: str) -> frozenset[str] | None:
    """The sm_XX codes nvcc compiles for (nvcc --list-gpu-code), or None if it cannot say."""
    import subprocess

    try:
        run = subprocess.run([nvcc, "--list-gpu-code"], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return frozenset(run.stdout.split()) if run.returncode == 0 else None


def arch_unsupported(device: torch.device) -> str | None:
    """Why the toolkit's nvcc cannot compile for device's architecture, or None."""
    nvcc = nvcc_path()
    codes = _gpu_codes(nvcc) if nvcc else None
    arch = device_arch(device)
    if codes is None or f"sm_{arch}" in codes:
        return None
    return f"{nvcc} cannot compile for sm_{arch} (it lists {' '.join(sorted(codes))})"


def cuda_flags(arch: str) -> list[str]:
    """nvcc flags of the .cu sources for one architecture (besides PyTorch's own, which
    include its C++ standard).

    No --use_fast_math: it flushes denormals and approximates division and square roots
    everywhere; exact GELU needs erff, and exp2f in the softmax is fast without it.
    """
    return ["-O3", "-lineinfo", f"-gencode=arch=compute_{arch},code=sm_{arch}"]


def host_flags() -> list[str]:
    """Host compiler flags of ops.cpp. No -std: ops.cpp includes PyTorch's headers and must
    use the standard PyTorch builds extensions with (another one changes the layout of
    c10::Error, and a failed TORCH_CHECK then crashes instead of raising)."""
    return ["-O3"]


def torch_cxx_standard() -> str:
    """The C++ standard PyTorch's extension builder passes to nvcc (c++20 or c++17)."""
    from torch.utils import cpp_extension

    text = Path(cpp_extension.__file__).read_text()
    return "c++20" if "-std=c++20" in text else "c++17"


def nvcc_command(source: str | Path, arch: str, output: str | Path,
                 strict: bool = False) -> list[str]:
    """The nvcc command compiling one .cu source to an object file, as the JIT build does
    (PyTorch's nvcc flags, cuda_flags, the headers beside it); strict turns every warning of
    nvcc and ptxas (spills included) into an error."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    nvcc = nvcc_path()
    if nvcc is None:
        raise Unsupported(f"wmma: {toolkit_missing()}")
    command = [nvcc, "-c", str(source), "-o", str(output), *COMMON_NVCC_FLAGS,
               *cuda_flags(arch), f"-std={torch_cxx_standard()}", "-Xcompiler", "-fPIC",
               f"-I{SOURCE_DIR}"]
    if strict:
        command += ["-Werror", "all-warnings", "-Xptxas", "-warn-spills,-warn-lmem-usage"]
    return command


def compile_strict(folder: str | Path) -> dict[tuple[str, str], tuple[list[str], int, str]]:
    """(source, arch) -> (command, return code, output) of the strict compile (nvcc_command's
    strict) of every .cu source for every arch in ARCHES into folder/'<source>-sm<arch>.o',
    one nvcc process per CPU at a time."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    def compile_one(key):
        source, arch = key
        command = nvcc_command(SOURCE_DIR / source, arch, Path(folder) / f"{source}-sm{arch}.o",
                               strict=True)
        run = subprocess.run(command, capture_output=True, text=True)
        return command, run.returncode, run.stdout + run.stderr

    keys = [(source, arch) for source in SOURCES if source.endswith(".cu") for arch in ARCHES]
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        return dict(zip(keys, pool.map(compile_one, keys)))


def toolkit_missing() -> str:
    """The reason given when no CUDA toolkit is found."""
    return ("no CUDA toolkit found (nvcc on PATH, $CUDA_HOME or /usr/local/cuda); "
            "the wmma kernels are compiled just in time")


def source_hash(arch: str) -> str:
    """A short hash of the sources, headers, flags and PyTorch version."""
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update(name.encode())
        digest.update((SOURCE_DIR / name).read_bytes())
    digest.update(" ".join(cuda_flags(arch) + host_flags()).encode())
    digest.update(torch.__version__.encode())
    return digest.hexdigest()[:16]


def build_directory(arch: str) -> Path:
    """~/.cache/layerbench/wmma/<hash>-sm<arch> (or under $LAYERBENCH_WMMA_CACHE)."""
    root = Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "layerbench" / "wmma"))
    return root / f"{source_hash(arch)}-sm{arch}"


@functools.cache
def _load(arch: str):
    """Build (or reuse) and import the extension for arch."""
    from torch.utils import cpp_extension

    home = cuda_home()
    if home is None:
        raise Unsupported(f"wmma: {toolkit_missing()}")
    os.environ.setdefault("CUDA_HOME", home)
    if cpp_extension.CUDA_HOME is None:
        cpp_extension.CUDA_HOME = home
    directory = build_directory(arch)
    directory.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=f"layerbench_wmma_{directory.name.replace('-', '_')}",
        sources=[str(SOURCE_DIR / name) for name in SOURCES],
        extra_cflags=host_flags(),
        extra_cuda_cflags=cuda_flags(arch),
        extra_include_paths=[str(SOURCE_DIR)],
        build_directory=str(directory),
        verbose=os.environ.get("LAYERBENCH_WMMA_VERBOSE") == "1",
    )


def load(device: torch.device):
    """The compiled extension for device's architecture (built on first use)."""
    return _load(device_arch(device))
