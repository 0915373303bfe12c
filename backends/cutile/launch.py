"""The two ways to run the kernels, behind one launch(name, constants, grid, args) call:
ahead of time (cubins from export.py loaded through cuda.core, parameters packed by the
cutile_python_v1 calling convention) and just in time (cuda.tile's own ct.launch)."""
from __future__ import annotations

import functools

import numpy as np
import torch

from layerbench.common.cuda_host import device_arch
from layerbench.common.errors import Unsupported

from . import manifest, specs

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "uint8": torch.uint8,
                "int32": torch.int32}


class LaunchError(RuntimeError):
    """A kernel failed to load or launch; the message names the kernel. A RuntimeError, so
    that a CUDA-graph capture it breaks is handled as a refused capture (common.graphs)."""


def arch_of(device: torch.device) -> str:
    """The device's architecture name, e.g. sm_90."""
    return f"sm_{device_arch(device)}"


def cuda_device(device) -> torch.device:
    """device as a CUDA device with its index (the current device where it has none)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def param_sizes(kernel: str) -> list[int]:
    """Bytes of each parameter the launcher packs for kernel: 8 per address, 4 per int32
    shape or stride entry and per scalar."""
    sizes = []
    for _, param in specs.KERNELS[kernel].params:
        sizes += [4] if isinstance(param, specs.Scalar) else [8] + [4] * (2 * param.ndim)
    return sizes


def manifest_problem(found: dict, arch: str) -> str | None:
    """Why a loaded manifest cannot serve arch with the launcher's packing, or None: it must
    be the build of arch, and every entry must be a registered kernel whose symbol, constants
    and parameter sizes are the ones the launcher derives from specs.py."""
    if found.get("arch") != arch:
        return f"the build under {arch} was exported for {found.get('arch')}"
    for entry in found["entries"]:
        name, constants = entry.get("kernel"), entry.get("constants") or {}
        if name not in specs.KERNELS:
            return f"its kernel {name!r} is not one the launcher knows"
        if set(constants) != set(specs.KERNELS[name].constants):
            return f"{entry.get('symbol')} has constants {sorted(constants)}"
        if entry.get("symbol") != specs.symbol(name, constants):
            return f"{entry.get('symbol')} is not the symbol of {name} {constants}"
        if entry.get("param_sizes") != param_sizes(name):
            return (f"{entry['symbol']} takes parameters of {entry.get('param_sizes')} bytes; "
                    f"the launcher packs {param_sizes(name)}")
    return None


def check_device(kernel: str, args, device: torch.device) -> None:
    """Raise ValueError unless every array argument of kernel lies on device, the device
    whose context and current stream the launch uses."""
    for (name, param), arg in zip(specs.KERNELS[kernel].params, args, strict=True):
        if isinstance(param, specs.Array) and isinstance(arg, torch.Tensor) \
                and arg.device != device:
            raise ValueError(f"cutile {kernel}: {name} is on {arg.device}; this launcher "
                             f"runs its kernels on {device}")


def check_array(name: str, param: specs.Array, t: torch.Tensor, kernel: str) -> None:
    """Raise ValueError unless t meets what the kernel was compiled to assume of param."""
    where = f"cutile {kernel}: {name}"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where} must be a tensor, got {type(t).__name__}")
    if t.dtype != TORCH_DTYPES[param.dtype] or t.dim() != param.ndim:
        raise ValueError(f"{where} must be a {param.ndim}-d {param.dtype} tensor, "
                         f"got {t.dim()}-d {t.dtype}")
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{where} needs unit stride in its last dimension, got {t.stride()}")
    if max(*t.shape, *t.stride()) > specs.INT32_MAX:
        raise ValueError(f"{where} has a size or stride beyond 32-bit indices: {t.shape}")
    if param.aligned:
        step = 16 // t.element_size()
        if t.data_ptr() % 16 or any(s % step for s in t.stride()[:-1]) or t.shape[-1] % step:
            raise ValueError(f"{where} must start on 16 bytes, with rows and strides of 16 "
                             f"bytes; got address {t.data_ptr():#x}, shape {tuple(t.shape)}, "
                             f"strides {t.stride()}")


def byte_range(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) byte addresses of the elements of t (empty for an empty tensor)."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    span = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (span + 1) * t.element_size()


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b are the same elements in the same layout."""
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride())


def check_disjoint(kernel: str, args) -> None:
    """Raise ValueError where an array the kernel writes overlaps another array argument:
    the kernels are compiled to assume such arrays are disjoint, except two of one alias
    group, which may be the very same view (a residual updated in place)."""
    arrays = [(name, param, arg, byte_range(arg))
              for (name, param), arg in zip(specs.KERNELS[kernel].params, args, strict=True)
              if isinstance(param, specs.Array)]
    for i, (name, param, t, (start, end)) in enumerate(arrays):
        for other, other_param, o, (o_start, o_end) in arrays[i + 1:]:
            if (not (param.output or other_param.output) or start == end or o_start == o_end
                    or start >= o_end or o_start >= end):
                continue  # read-only pairs, empty arrays, apart ranges
            grouped = param.alias_group and param.alias_group == other_param.alias_group
            if grouped and same_view(t, o):
                continue
            raise ValueError(f"cutile {kernel}: {name} and {other} overlap in memory; the "
                             f"kernel writes one of them and assumes they are disjoint"
                             + (" or the same view" if grouped else ""))


def check_args(kernel: str, args) -> None:
    """Raise unless every array argument meets what the kernel was compiled to assume
    (check_array) and the arrays it writes overlap nothing else (check_disjoint)."""
    for (name, param), arg in zip(specs.KERNELS[kernel].params, args, strict=True):
        if isinstance(param, specs.Array):
            check_array(name, param, arg, kernel)
    check_disjoint(kernel, args)


def pack(kernel: str, args) -> list:
    """numpy scalars of a call's parameters by the cutile_python_v1 convention: per array its
    address (64 bits), then its shape and its strides as int32; per scalar its value."""
    check_args(kernel, args)
    values = []
    for (_, param), arg in zip(specs.KERNELS[kernel].params, args):
        if isinstance(param, specs.Scalar):
            values.append(np.int32(arg) if param.dtype == "int32" else np.float32(arg))
            continue
        values.append(np.uint64(arg.data_ptr()))
        values += [np.int32(n) for n in arg.shape]
        values += [np.int32(s) for s in arg.stride()]
    return values


@functools.lru_cache(maxsize=64)
def core_stream(handle: int):
    """A cuda.core Stream for a PyTorch stream handle (not owned: PyTorch keeps it alive)."""
    from cuda.core import Stream

    return Stream.from_handle(handle)


def on_device(device: torch.device):
    """A context in which device is the current CUDA device. A launch on the legacy default
    stream (handle 0, PyTorch's default) runs in the current context, not in the stream's:
    without this a kernel would run on whichever device happens to be current."""
    return torch.cuda.device(device)


def stream_handle(device: torch.device) -> int:
    """The handle of PyTorch's current stream on device (a capture stream while a CUDA graph
    is being captured)."""
    return torch.cuda.current_stream(device).cuda_stream


@functools.cache
def programmatic_launch_problem() -> str | None:
    """Why cuda.core cannot launch with programmatic stream serialization here, or None: its
    LaunchConfig must take programmatic_stream_serialization (cuda-python PR 2456)."""
    try:
        from cuda.core import LaunchConfig
    except ImportError as exc:
        return f"cuda.core is not installed ({exc})"
    try:
        LaunchConfig(grid=1, block=1, programmatic_stream_serialization=True)
    except TypeError:
        import cuda.core as core

        return (f"cuda.core {getattr(core, '__version__', '?')} has no "
                f"LaunchConfig.programmatic_stream_serialization")
    return None


class AotKernels:
    """Kernels from an exported build for one device, loaded on first use."""

    mode = "aot"

    def __init__(self, device: torch.device, root=None):
        self.device = cuda_device(device)
        self.arch = arch_of(self.device)
        self.manifest, why = manifest.load(self.arch, root)
        if self.manifest is None:
            raise Unsupported(why)
        self.folder = manifest.build_dir(self.arch, root)
        problem = manifest_problem(self.manifest, self.arch)
        if problem:
            raise Unsupported(f"the cutile build {self.folder} does not match the launcher: "
                              f"{problem}; export it again")
        self.entries = {e["symbol"]: e for e in self.manifest["entries"]}
        self.modules: dict[str, object] = {}
        self.kernels: dict[str, tuple[object, int]] = {}

    @property
    def programmatic_problem(self) -> str | None:
        """Why launches cannot be programmatic here (see programmatic_launch_problem)."""
        return programmatic_launch_problem()

    def _kernel(self, symbol: str):
        """(kernel, required block) of symbol, its cubin loaded on first use; call it with
        the launcher's device current."""
        from cuda.core import Device, ObjectCode

        if symbol not in self.kernels:
            entry = self.entries.get(symbol)
            if entry is None:
                raise Unsupported(f"the cutile build {self.folder} has no kernel {symbol}")
            cubin = entry["cubin"]
            try:
                if cubin not in self.modules:
                    Device(self.device.index).set_current()
                    self.modules[cubin] = ObjectCode.from_cubin(
                        (self.folder / cubin).read_bytes())
                kernel = self.modules[cubin].get_kernel(symbol)
            except Exception as exc:  # cuda.core's CUDAError is no RuntimeError
                raise LaunchError(f"cutile {symbol}: cannot load it from "
                                  f"{self.folder / cubin}: {exc}") from exc
            self.kernels[symbol] = (kernel, tuple(entry["threads"]))  # its required block
        return self.kernels[symbol]

    def has(self, name: str, constants: dict[str, int]) -> bool:
        """Whether the build holds this specialisation."""
        return specs.symbol(name, constants) in self.entries

    def launch(self, name: str, constants: dict[str, int], grid: tuple[int, ...], args,
               programmatic: bool = False):
        """Launch one specialisation on PyTorch's current stream of the launcher's device,
        with that device current (programmatic: it may start while the kernel before it
        finishes, see ProgrammaticLaunches); LaunchError, naming it, where it fails."""
        from cuda.core import LaunchConfig, launch

        symbol = specs.symbol(name, constants)
        check_device(name, args, self.device)
        values = pack(name, args)
        extra = {"programmatic_stream_serialization": True} if programmatic else {}
        with on_device(self.device):
            kernel, threads = self._kernel(symbol)
            try:
                stream = core_stream(stream_handle(self.device))
                config = LaunchConfig(grid=grid, block=threads, **extra)
                launch(stream, config, kernel, *values)
            except Exception as exc:  # cuda.core's CUDAError is no RuntimeError
                raise LaunchError(f"cutile {symbol}: launch of grid {tuple(grid)} and block "
                                  f"{threads} on {self.device} failed: {exc}") from exc


class JitKernels:
    """Kernels compiled by cuda.tile at first launch (needs cuda-tile[tileiras])."""

    mode = "jit"
    programmatic_problem = None  # ct.launch takes programmatic_dependent_launch

    def __init__(self, device: torch.device):
        self.device = cuda_device(device)

    def has(self, name: str, constants: dict[str, int]) -> bool:
        """Every specialisation compiles on first use."""
        return True

    def launch(self, name: str, constants: dict[str, int], grid: tuple[int, ...], args,
               programmatic: bool = False):
        """Launch through ct.launch on PyTorch's current stream of the launcher's device, with
        that device current; LaunchError, naming the kernel, where it fails."""
        import cuda.tile as ct

        from .export import kernel_function

        check_device(name, args, self.device)
        check_args(name, args)
        consts = [constants[c] for c in specs.KERNELS[name].constants]
        with on_device(self.device):
            try:
                ct.launch(torch.cuda.current_stream(self.device), grid, kernel_function(name),
                          (*args, *consts), programmatic_dependent_launch=programmatic)
            except Exception as exc:  # compiler and driver errors alike
                raise LaunchError(f"cutile {specs.symbol(name, constants)} (jit): launch of "
                                  f"grid {tuple(grid)} on {self.device} failed: {exc}") from exc


class ProgrammaticLaunches:
    """A launcher whose launches may each start while the kernel before it on the stream is
    still running (programmatic dependent launch): every kernel first waits for its
    predecessor's writes (kernels/order.py), so only the launch latency overlaps."""

    def __init__(self, kernels):
        self.kernels = kernels
        self.mode = kernels.mode
        self.programmatic_problem = getattr(kernels, "programmatic_problem", None)

    def has(self, name: str, constants: dict[str, int]) -> bool:
        """Whether the launcher underneath has this specialisation."""
        return self.kernels.has(name, constants)

    def launch(self, name: str, constants: dict[str, int], grid: tuple[int, ...], args):
        """Launch one specialisation with programmatic stream serialization."""
        self.kernels.launch(name, constants, grid, args, programmatic=True)


@functools.cache
def jit_unavailable_reason() -> str | None:
    """Why ct.launch cannot compile here (checked once by compiling one small kernel), or None."""
    try:
        from cuda.tile.compilation import export_kernel

        from .export import kernel_function, signature
    except ImportError as exc:
        return f"cuda.tile is not installed ({exc}); pip install '.[cutile]'"
    import io

    try:
        name, constants = "layer_norm_split", {"BM": 32, "BD": 8}
        export_kernel(kernel_function(name), [signature(name, constants)], io.BytesIO(),
                      gpu_code="sm_90", output_format="cubin")
    except Exception as exc:  # noqa: BLE001 - any compiler failure means no JIT here
        return f"cuda.tile cannot compile here: {str(exc).strip().splitlines()[-1]}"
    return None


def kernels_for(device: torch.device, mode: str = "auto"):
    """The launcher for device: "aot", "jit", or "auto" (a matching build, else the JIT)."""
    if mode not in ("auto", "aot", "jit"):
        raise ValueError(f"cutile mode must be auto, aot or jit, not {mode!r}")
    if mode in ("auto", "aot"):
        try:
            return AotKernels(device)
        except Unsupported as exc:
            if mode == "aot":
                raise
            aot_reason = str(exc)
    why = jit_unavailable_reason()
    if why is None:
        return JitKernels(device)
    if mode == "jit":
        raise Unsupported(why)
    raise Unsupported(f"no ahead-of-time build ({aot_reason}) and no JIT ({why})")
