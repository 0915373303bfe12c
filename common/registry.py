"""The backend registry: built-in backends, plus out-of-tree ones through entry points.

An out-of-tree package registers a backend in its own pyproject.toml:

    [project.entry-points."layerbench.backends"]
    mybackend = "mypackage.layer:MyBackend"

The entry point names a Backend subclass (or an instance); its name attribute is the key.
"""
from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from .errors import Unsupported  # noqa: F401  (re-exported for users)
from .interface import Backend

ENTRY_POINT_GROUP = "layerbench.backends"

# name -> "module:attribute"; modules are imported only when the backend is asked for.
BUILTIN = {
    "torch-baseline": "layerbench.backends.torch_baseline:TorchBaselineBackend",
    "torch-sdpa": "layerbench.backends.torch_sdpa:TorchSdpaBackend",
    "torch-compile": "layerbench.backends.torch_compile:TorchCompileBackend",
    "torch-fp16": "layerbench.backends.torch_fp16:TorchFp16Backend",
    "triton": "layerbench.backends.triton:TritonBackend",
    "wmma": "layerbench.backends.wmma:WmmaBackend",
    "cutile": "layerbench.backends.cutile:CutileBackend",
    "cupy": "layerbench.backends.cupy:CupyBackend",
}

# The plain-PyTorch forms every table ranks against; torch-baseline is the speedup denominator.
PEERS = ("torch-baseline", "torch-sdpa", "torch-compile", "torch-fp16")

_extra: dict[str, object] = {}
_cache: dict[str, Backend] = {}


def register(backend: Backend | type[Backend], *, replace: bool = False) -> Backend:
    """Register a backend object or class under its name (for backends defined at run time)."""
    instance = backend() if isinstance(backend, type) else backend
    if not instance.name:
        raise ValueError("a backend needs a non-empty name")
    if not replace and (instance.name in BUILTIN or instance.name in _extra):
        raise ValueError(f"backend {instance.name!r} is already registered")
    _extra[instance.name] = instance
    _cache[instance.name] = instance
    return instance


def peers_first(names: list[str]) -> list[str]:
    """names with the peers first, in PEERS order (torch-baseline first), then the others."""
    order = {name: i for i, name in enumerate(PEERS)}
    return sorted(names, key=lambda name: order.get(name, len(PEERS)))


def _entry_point_targets() -> dict[str, object]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def backend_names() -> list[str]:
    """All registered backend names: built-ins first, then entry points and run-time ones."""
    names = list(BUILTIN)
    for name in list(_entry_point_targets()) + list(_extra):
        if name not in names:
            names.append(name)
    return names


def _load(target) -> Backend:
    if isinstance(target, str):
        module_name, _, attr = target.partition(":")
        obj = getattr(importlib.import_module(module_name), attr)
    elif hasattr(target, "load"):
        obj = target.load()
    else:
        obj = target
    instance = obj() if isinstance(obj, type) else obj
    if not isinstance(instance, Backend):
        raise TypeError(f"{target!r} is not a layerbench Backend")
    return instance


def get_backend(name: str) -> Backend:
    """The backend registered as name, e.g. get_backend('triton')."""
    if name in _cache:
        return _cache[name]
    if name in BUILTIN:
        target = BUILTIN[name]
    elif name in _extra:
        target = _extra[name]
    else:
        target = _entry_point_targets().get(name)
        if target is None:
            raise KeyError(f"no backend named {name!r}; registered: {', '.join(backend_names())}")
    backend = _load(target)
    if backend.name != name:
        raise ValueError(f"entry {name!r} loaded a backend named {backend.name!r}")
    _cache[name] = backend
    return backend


def list_backends() -> list[dict]:
    """Name, summary and capabilities of every backend, plus load errors if any."""
    rows = []
    for name in backend_names():
        try:
            rows.append(get_backend(name).describe())
        except Exception as exc:  # a broken plug-in is listed, not fatal
            rows.append({"name": name, "error": f"{type(exc).__name__}: {exc}"})
    return rows


def resolve_backends(spec: list[str] | str) -> list[str]:
    """Expand 'all' / 'peers' / comma lists into backend names, checking each exists."""
    items = [spec] if isinstance(spec, str) else list(spec)
    names: list[str] = []
    for item in items:
        for token in filter(None, (t.strip() for t in item.split(","))):
            expanded = {"all": backend_names(), "peers": list(PEERS)}.get(token, [token])
            for name in expanded:
                if name not in backend_names():
                    raise KeyError(f"no backend named {name!r}; registered: "
                                   f"{', '.join(backend_names())}")
                if name not in names:
                    names.append(name)
    return names
