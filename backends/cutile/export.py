"""Ahead-of-time build: every specialisation in specs.py compiled to cubins per architecture,
with a manifest. Run `python -m layerbench.backends.cutile.export [--arch sm_90 ...] [--out DIR]`
on a machine with cuda-tile[tileiras] (no GPU needed); carry DIR to the GPU machine."""
from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from layerbench.common.cuda_host import cubin_kernels

from . import specs
from .manifest import ARCHS, CALLING_CONVENTION, INDEX_BITS, build_dir


def constraint(param):
    """The cuda.tile constraint of one specs.Array or specs.Scalar."""
    import cuda.tile as ct
    from cuda.tile.compilation import ArrayConstraint, ScalarConstraint

    if isinstance(param, specs.Scalar):
        return ScalarConstraint(getattr(ct, param.dtype))
    dtype = getattr(ct, param.dtype)
    itemsize = {"float32": 4, "int32": 4, "float16": 2, "uint8": 1}[param.dtype]
    rest = param.ndim - 1
    return ArrayConstraint(
        dtype, param.ndim, index_dtype=ct.int32, stride_lower_bound_incl=0,
        alias_groups=(param.alias_group,) if param.alias_group else (),
        may_alias_internally=False,
        stride_constant=(None,) * rest + (1,),
        stride_divisible_by=((16 // itemsize) if param.aligned else 1,) * rest + (1,),
        shape_divisible_by=(1,) * rest + ((16 // itemsize) if param.aligned else 1,),
        base_addr_divisible_by=16 if param.aligned else 1)


def signature(name: str, constants: dict[str, int]):
    """The KernelSignature of one specialisation (constants appended after the parameters)."""
    from cuda.tile.compilation import CallingConvention, KernelSignature

    kernel = specs.KERNELS[name]
    params = [constraint(p) for _, p in kernel.params]
    params += [constants[c] for c in kernel.constants]
    return KernelSignature(params, CallingConvention.cutile_python_v1(),
                           symbol=specs.symbol(name, constants))


@functools.cache
def kernel_function(name: str):
    """The ct.kernel object of a kernel name (a variant: its function with its hints; one
    object per name, so the JIT's cache holds)."""
    kernel = specs.KERNELS[name]
    module = importlib.import_module(f"{__package__}.kernels.{kernel.module}")
    function = getattr(module, kernel.function or name)
    return function.replace_hints(**dict(kernel.hints)) if kernel.hints else function


COMPILER_CRASH_RETRIES = 2


def export_group(arch: str, name: str, constant_sets: list[dict[str, int]], folder: str):
    """Compile one kernel's specialisations for arch into folder/<name>.cubin; its entries."""
    from cuda.tile import TileCompilerExecutionError
    from cuda.tile.compilation import export_kernel

    start = time.perf_counter()
    for attempt in range(COMPILER_CRASH_RETRIES + 1):
        try:
            export_kernel(kernel_function(name), [signature(name, c) for c in constant_sets],
                          f"{folder}/{name}.cubin", gpu_code=arch, output_format="cubin")
            break
        except TileCompilerExecutionError as error:
            # tileiras sometimes aborts on heap corruption ("double free"); a compile error
            # exits with a positive code and is raised at once.
            if not str(error).startswith("Return code -") or attempt == COMPILER_CRASH_RETRIES:
                raise
            print(f"{arch} {name}: tileiras crashed, compiling again", file=sys.stderr)
    info = cubin_kernels(f"{folder}/{name}.cubin")
    entries = []
    for c in constant_sets:
        symbol = specs.symbol(name, c)
        found = info.get(symbol)
        if found is None or found["threads"] is None:
            raise RuntimeError(f"{name}.cubin for {arch}: no block size for {c}")
        entries.append({"kernel": name, "symbol": symbol, "constants": c,
                        "cubin": f"{name}.cubin", "threads": found["threads"],
                        "param_sizes": found["params"]})
    return entries, time.perf_counter() - start


def export(archs, out_dir=None, progress=True, jobs: int | None = None,
           sweep: bool = False) -> dict:
    """Compile every specialisation (with sweep, also the sweep tiles) for each arch into
    out_dir/<source hash>/<arch>/ with a manifest, one process per kernel and arch (jobs at
    once, default the CPU count)."""
    from cuda.tile import __version__ as cuda_tile_version

    groups: dict[str, list[dict[str, int]]] = {}
    for name, constants in specs.specialisations(sweep):
        groups.setdefault(name, []).append(constants)
    folders = {arch: build_dir(arch, out_dir) for arch in archs}
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(jobs or os.cpu_count()) as pool:
        futures = {(arch, name): pool.submit(export_group, arch, name, sets, str(folders[arch]))
                   for arch in archs for name, sets in groups.items()}
        results = {key: f.result() for key, f in futures.items()}
    manifests, source_hash = {}, specs.source_hash()
    for arch in archs:
        entries = []
        for name in groups:
            found, seconds = results[(arch, name)]
            entries += found
            if progress:
                print(f"{arch} {name}: {len(found)} specialisations in {seconds:.1f} s",
                      file=sys.stderr)
        manifest = {"arch": arch, "source_hash": source_hash, "entries": entries,
                    "calling_convention": CALLING_CONVENTION, "index_bits": INDEX_BITS,
                    "cuda_tile": cuda_tile_version}
        (folders[arch] / "manifest.json").write_text(json.dumps(manifest, indent=1))
        manifests[arch] = manifest
    return manifests


def main(argv=None) -> int:
    """Command line: export the cubins."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", action="append", choices=ARCHS,
                        help="architecture to build (repeatable; default all)")
    parser.add_argument("--out", help="build root (default: $LAYERBENCH_CUTILE_BUILD or "
                        "~/.cache/layerbench/cutile)")
    parser.add_argument("--jobs", type=int, help="compiler processes at once")
    parser.add_argument("--sweep", action="store_true",
                        help="also the tiles bench/cutile_sweep.py compares")
    args = parser.parse_args(argv)
    export(args.arch or list(ARCHS), args.out, jobs=args.jobs, sweep=args.sweep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
