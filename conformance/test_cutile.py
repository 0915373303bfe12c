"""cutile-specific cases: every kernel specialisation exports to cubins for sm_80, sm_90 and
sm_100 (also without a GPU), the launcher's parameter packing matches the exported kernels,
the backend refuses clearly what it cannot run, and (on a GPU) each kernel family against
PyTorch in fp64, and the ahead-of-time and JIT paths give identical outputs."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from layerbench.backends.cutile import CutileBackend, launch, manifest, ops, specs
from layerbench.common.config import LayerConfig
from layerbench.common.cuda_host import key_info, split_fp16, weight_pair
from layerbench.common.errors import Unsupported
from layerbench.reference import packed_attention

import background

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="session")
def cutile_compiles():
    """Skip where cuda.tile cannot compile (no cuda.tile, or no usable tileiras)."""
    why = launch.jit_unavailable_reason()
    if why is not None:
        pytest.skip(why)


@pytest.fixture(scope="session")
def cutile_build(cutile_compiles, tmp_path_factory):
    """Every specialisation exported for every architecture into one folder per session
    (started in the background at collection where this session needs it)."""
    from layerbench.backends.cutile.export import export

    def export_here():
        root = tmp_path_factory.mktemp("cutile-build")
        export(manifest.ARCHS, root, progress=False)
        return root
    return background.result(background.CUTILE_EXPORT, export_here)


def expected_sizes(name: str) -> list[int]:
    """Parameter sizes the launcher packs for a kernel: 8 per address, 4 per int32/float."""
    sizes = []
    for _, param in specs.KERNELS[name].params:
        sizes += [4] if isinstance(param, specs.Scalar) else [8] + [4] * (2 * param.ndim)
    return sizes


@pytest.mark.parametrize("arch", manifest.ARCHS)
def test_every_specialisation_exports(cutile_selected, cutile_build, arch):
    """The build has every (kernel, constants) of specs.py for arch, each symbol in its cubin
    with exactly the parameters the launcher packs (TMA's tensor maps are hidden parameters
    the driver fills at launch) and a required block size (cuobjdump -elf of the cubin,
    recorded in the manifest)."""
    found, why = manifest.load(arch, cutile_build)
    assert found is not None, why
    wanted = {specs.symbol(n, c) for n, c in specs.specialisations()}
    assert {e["symbol"] for e in found["entries"]} == wanted
    for entry in found["entries"]:
        assert entry["param_sizes"] == expected_sizes(entry["kernel"]), entry
        assert entry["threads"][0] % 32 == 0 and entry["threads"][1:] == [1, 1], entry
    assert launch.manifest_problem(found, arch) is None  # what AotKernels checks on opening


def test_variants_compile_their_hints(cutile_selected, cutile_compiles, tmp_path):
    """A variant is its kernel's source under its own symbol with its ct.kernel hints: eight
    worker warps give linear_half at 128x128 a third warp group (sm_90, cuobjdump -elf)."""
    from cuda.tile.compilation import export_kernel

    from layerbench.backends.cutile.export import kernel_function, signature
    from layerbench.common.cuda_host import cubin_kernels

    tile = {"TM": 128, "TN": 128, "TK": 64, "PRODUCTS": 1}
    threads = {}
    for name in ("linear_half", "linear_half_w8"):
        export_kernel(kernel_function(name), [signature(name, tile)], tmp_path / f"{name}.cubin",
                      gpu_code="sm_90", output_format="cubin")
        info = cubin_kernels(tmp_path / f"{name}.cubin")
        assert list(info) == [specs.symbol(name, tile)]
        threads[name] = info[specs.symbol(name, tile)]["threads"][0]
    assert threads == {"linear_half": 256, "linear_half_w8": 384}
    assert kernel_function("linear_half_w8") is kernel_function("linear_half_w8")


def test_whole_block_kernel_compiles_without_spills(cutile_selected, cutile_compiles,
                                                   tmp_path):
    """The whole-block kernel at 128 rows, d_model 128, head dim 32 (shapes 1-6) on sm_90:
    HGMMA, no local memory, and the wait programmatic launches rely on."""
    from cuda.tile.compilation import export_kernel

    from bench.sass import kernels as sass_kernels
    from layerbench.backends.cutile.export import kernel_function, signature

    constants = specs.block_constants(128, 128, 4, 128, 3)
    name = specs.block_kernel(constants)
    export_kernel(kernel_function(name), [signature(name, constants)], tmp_path / "b.cubin",
                  gpu_code="sm_90", output_format="cubin")
    row = sass_kernels(tmp_path / "b.cubin")[specs.symbol(name, constants)]
    assert row["HGMMA"] > 0 and row["dependency_wait"] >= 1, row
    assert row["spill_stores"] == 0 and row["stack_bytes"] == 0, row


def test_sm90_sass(cutile_selected, cutile_build):
    """The sm_90 SASS of every exported kernel: no local memory (beyond the spills measured
    and accepted in specs), no 2-byte global loads, HGMMA in the GEMM and attention kernels
    (HMMA in the whole-block kernel over 32 rows),
    and the wait for the kernel before it that programmatic launches rely on (ACQBULK)
    (cuobjdump -sass)."""
    from bench.sass import kernels as sass_kernels

    found, why = manifest.load("sm_90", cutile_build)
    assert found is not None, why
    folder = manifest.build_dir("sm_90", cutile_build)
    for cubin in {e["cubin"] for e in found["entries"]}:
        for name, row in sass_kernels(folder / cubin).items():
            accepted = specs.SPILLS_ACCEPTED.get(name, 0)
            assert row["spill_stores"] <= accepted, (name, row)
            assert row["stack_bytes"] == 0 or accepted, (name, row)
            assert row["load16"] == 0, (name, row)
            assert row["dependency_wait"] >= 1 and row["dependents_launch"] >= 1, (name, row)
            if name.startswith("block_narrow_w8_SP32"):  # 32 rows: below wgmma's 64
                assert row["HMMA"] > 0, (name, row)
            elif not name.startswith("layer_norm"):
                assert row["HGMMA"] > 0, (name, row)


def test_stale_build_is_refused(cutile_selected, tmp_path):
    """A missing manifest, one from other kernel sources or another calling convention, and
    one whose cubins are gone each give a reason, not a build."""
    import json

    assert "no cubins" in manifest.load("sm_90", tmp_path)[1]
    folder = manifest.build_dir("sm_90", tmp_path)
    folder.mkdir(parents=True)
    good = {"source_hash": specs.source_hash(), "calling_convention": "cutile_python_v1",
            "index_bits": 32, "entries": [{"cubin": "norm.cubin"}]}
    for change, reason in (({"source_hash": "0"}, "other kernel sources"),
                           ({"index_bits": 64}, "calling convention"),
                           ({}, "lacks")):
        (folder / "manifest.json").write_text(json.dumps({**good, **change}))
        found, why = manifest.load("sm_90", tmp_path)
        assert found is None and reason in why, why
    (folder / "norm.cubin").write_bytes(b"")
    assert manifest.load("sm_90", tmp_path)[0] is not None


def test_packing_follows_the_calling_convention(cutile_selected):
    """Per array: address, shape, strides (int32); per scalar: its value, in order."""
    x = torch.zeros(40, 24)
    w, b = torch.zeros(24), torch.zeros(24)
    hi, lo = torch.zeros(2, 40, 24, dtype=torch.float16)
    values = launch.pack("layer_norm_split", (x, w, b, hi, lo))
    assert len(values) == sum(1 + 2 * p.ndim for _, p in specs.KERNELS["layer_norm_split"].params)
    assert values[0] == x.data_ptr() and values[0].dtype == np.uint64
    assert [int(v) for v in values[1:5]] == [40, 24, 24, 1]
    mask = torch.ones(40, dtype=torch.uint8)
    values = launch.pack("layer_norm_out", (x, w, b, mask, torch.zeros_like(x), 1))
    assert values[-1].dtype == np.int32 and values[-1] == 1


def test_packing_refuses_overlapping_outputs(cutile_selected):
    """Arrays the kernel writes must not overlap its other arrays (the kernels are compiled
    to assume so), except a residual written in place."""
    x, w, b = torch.zeros(40, 32), torch.zeros(32), torch.zeros(32)
    halves = torch.zeros(80, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match="OUT_HI and OUT_LO overlap"):
        launch.pack("layer_norm_split", (x, w, b, halves[:40], halves[39:79]))
    launch.pack("layer_norm_split", (x, w, b, halves[:40], halves[40:]))
    with pytest.raises(ValueError, match="X and OUT overlap"):
        launch.pack("layer_norm_out", (x, w, b, torch.ones(40, dtype=torch.uint8), x, 0))
    a = torch.zeros(40, 32, dtype=torch.float16)
    weight = torch.zeros(32, 32, dtype=torch.float16)
    mask = torch.ones(40, dtype=torch.uint8)
    launch.pack("linear_residual", (a, a, weight, weight, b, x, mask, x, 0, 0))
    rows = torch.zeros(41, 32)
    with pytest.raises(ValueError, match="RES and OUT overlap.*same view"):
        launch.pack("linear_residual", (a, a, weight, weight, b, rows[:40], mask, rows[1:], 0, 0))
    with pytest.raises(ValueError, match="A_HI and OUT overlap"):
        launch.pack("linear_half", (halves[:40], a, weight, weight, b, halves[:40]))
    empty = halves[:0]
    assert launch.byte_range(empty)[0] == launch.byte_range(empty)[1]
    launch.pack("layer_norm_split", (x[:0], w, b, halves[:0], halves[40:40]))


@pytest.mark.parametrize("case", ["dtype", "rank", "width", "stride", "address", "count"])
def test_packing_refuses_what_the_build_assumes_otherwise(cutile_selected, case):
    """A tensor off the compiled assumptions raises, naming the kernel and parameter."""
    x = torch.zeros(40, 32)
    w, b = torch.zeros(32), torch.zeros(32)
    hi, lo = torch.zeros(2, 40, 32, dtype=torch.float16)
    args = {"dtype": (x.double(), w, b, hi, lo), "rank": (x, w, b, hi.view(-1), lo),
            "width": (x, w, b, hi[:, :28], lo),
            "stride": (x, w, b, torch.zeros(40, 36, dtype=torch.float16)[:, :32], lo),
            "address": (torch.zeros(40 * 32 + 1)[1:].view(40, 32), w, b, hi, lo),
            "count": (x, w, b, hi)}[case]
    with pytest.raises(ValueError, match="layer_norm_split|zip"):
        launch.pack("layer_norm_split", args)


def test_manifest_entries_must_match_the_launcher(cutile_selected):
    """A build is refused where it was exported for another architecture, or where an entry
    names a kernel, constants, symbol or parameter sizes other than the launcher's own
    (launch.manifest_problem, checked when the build is opened, before any launch)."""
    def entry(name, constants, change=None):
        found = {"kernel": name, "symbol": specs.symbol(name, constants),
                 "constants": constants, "cubin": f"{name}.cubin", "threads": [128, 1, 1],
                 "param_sizes": launch.param_sizes(name)}
        return {**found, **(change or {})}
    norm = ("layer_norm_out_occ4", {"BM": 32, "BD": 128})
    attention = ("flash_attention", {"TM": 64, "TN": 64, "HP": 8})
    good = {"arch": "sm_90", "entries": [entry(*norm), entry(*attention)]}
    assert launch.manifest_problem(good, "sm_90") is None
    assert "exported for sm_90" in launch.manifest_problem(good, "sm_100")
    for change, reason in (({"param_sizes": launch.param_sizes("flash_attention")[:-1]},
                            "launcher packs"),
                           ({"kernel": "flash_attention_v2"}, "not one the launcher knows"),
                           ({"constants": {"BM": 32}}, "constants"),
                           ({"symbol": "layer_norm_out_occ4_BM64_BD128"}, "not the symbol")):
        stale = {"arch": "sm_90", "entries": [entry(*norm, change), entry(*attention)]}
        assert reason in launch.manifest_problem(stale, "sm_90"), change
    for name in specs.KERNELS:
        assert launch.param_sizes(name) == expected_sizes(name)


def test_launch_refuses_tensors_on_another_device(cutile_selected):
    """Every array argument must lie on the launcher's device (its context and current
    stream are the launch's): a tensor elsewhere raises, naming the kernel and parameter."""
    x, w, b = torch.zeros(40, 32), torch.zeros(32), torch.zeros(32)
    hi, lo = torch.zeros(2, 40, 32, dtype=torch.float16)
    launch.check_device("layer_norm_split", (x, w, b, hi, lo), torch.device("cpu"))
    with pytest.raises(ValueError, match="layer_norm_split: X is on cpu"):
        launch.check_device("layer_norm_split", (x, w, b, hi, lo), torch.device("cuda", 1))


class _FakeCore:
    """A stand-in for cuda.core whose load or launch fails as the driver would."""

    class CUDAError(Exception):
        """cuda.core's error type: an Exception, not a RuntimeError."""

    def __init__(self, fail_load=False, pdl=True):
        self.fail_load, self.pdl, self.launched = fail_load, pdl, []
        fake = self

        class Device:
            def __init__(self, index):
                self.index = index

            def set_current(self):
                return None

        class ObjectCode:
            @staticmethod
            def from_cubin(data):
                if fake.fail_load:
                    raise fake.CUDAError("CUDA_ERROR_NO_BINARY_FOR_GPU: no kernel image")
                return ObjectCode()

            def get_kernel(self, symbol):
                return symbol

        class LaunchConfig:
            def __init__(self, grid, block, **extra):
                if extra and not fake.pdl:
                    raise TypeError("unexpected keyword programmatic_stream_serialization")
                self.grid, self.block, self.extra = grid, block, extra

        def launch_kernel(stream, config, kernel, *values):
            fake.launched.append((kernel, config.extra))
            raise fake.CUDAError("CUDA_ERROR_INVALID_VALUE: invalid argument")

        self.Device, self.ObjectCode, self.LaunchConfig = Device, ObjectCode, LaunchConfig
        self.launch, self.__version__ = launch_kernel, "0.0"


def _fake_aot(monkeypatch, tmp_path, core):
    """An AotKernels on the CPU over a one-kernel build in tmp_path, cuda.core faked."""
    import contextlib
    import sys
    import types

    module = types.ModuleType("cuda.core")
    module.__dict__.update({k: getattr(core, k) for k in
                            ("Device", "ObjectCode", "LaunchConfig", "launch", "__version__")})
    monkeypatch.setitem(sys.modules, "cuda.core", module)
    monkeypatch.setattr(launch, "on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(launch, "stream_handle", lambda device: 0)
    monkeypatch.setattr(launch, "core_stream", lambda handle: handle)
    constants = {"BM": 32, "BD": 32}
    kernels = launch.AotKernels.__new__(launch.AotKernels)
    kernels.device, kernels.folder = torch.device("cpu"), tmp_path
    (tmp_path / "norm.cubin").write_bytes(b"")
    symbol = specs.symbol("layer_norm_split", constants)
    kernels.entries = {symbol: {"cubin": "norm.cubin", "threads": [128, 1, 1]}}
    kernels.modules, kernels.kernels = {}, {}
    x, w, b = torch.zeros(40, 32), torch.zeros(32), torch.zeros(32)
    hi, lo = torch.zeros(2, 40, 32, dtype=torch.float16)
    return kernels, constants, symbol, (x, w, b, hi, lo)


@pytest.mark.parametrize("failure", ["load", "launch"])
def test_driver_errors_name_the_kernel(cutile_selected, monkeypatch, tmp_path, failure):
    """A cubin that does not load and a launch the driver refuses each raise LaunchError (a
    RuntimeError, so a broken graph capture is recognised) naming the kernel's symbol, with
    the driver's error as its cause; nothing is swallowed."""
    core = _FakeCore(fail_load=failure == "load")
    kernels, constants, symbol, args = _fake_aot(monkeypatch, tmp_path, core)
    with pytest.raises(launch.LaunchError, match=symbol) as info:
        kernels.launch("layer_norm_split", constants, (2, 1, 1), args)
    assert isinstance(info.value, RuntimeError)
    assert isinstance(info.value.__cause__, _FakeCore.CUDAError)
    assert ("cannot load" in str(info.value)) == (failure == "load")
    assert core.launched == ([] if failure == "load" else [(symbol, {})])


def test_programmatic_launch_needs_a_capable_launcher(cutile_selected, monkeypatch, tmp_path):
    """pdl needs sm_90 and a cuda.core whose LaunchConfig takes programmatic stream
    serialization: an older one is reported by name (and the layer's default turns pdl off
    there) instead of failing at the first launch."""
    from layerbench.backends.cutile import programmatic_refusal

    old = _FakeCore(pdl=False)
    _fake_aot(monkeypatch, tmp_path, old)
    assert "no LaunchConfig.programmatic_stream_serialization" in (
        launch.programmatic_launch_problem.__wrapped__())
    _fake_aot(monkeypatch, tmp_path, _FakeCore())
    assert launch.programmatic_launch_problem.__wrapped__() is None

    class Launcher:
        mode, programmatic_problem = "aot", None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    cuda = torch.device("cuda", 0)
    assert programmatic_refusal(cuda, Launcher()) is None
    Launcher.programmatic_problem = "cuda.core 0.0 has no it"
    assert "cuda.core 0.0" in programmatic_refusal(cuda, Launcher())
    assert launch.ProgrammaticLaunches(Launcher()).programmatic_problem == "cuda.core 0.0 has no it"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    assert "sm_90" in programmatic_refusal(cuda, Launcher())
    assert "sm_90" in programmatic_refusal(torch.device("cpu"), Launcher())


def test_every_choice_is_a_registered_and_exported_kernel():
    """Each tile and variant the layer may choose names a registered kernel, and the default
    build (and the sweep build) has it; every sweep specialisation is registered too."""
    default = {specs.symbol(n, c) for n, c in specs.specialisations()}
    for n, c in specs.specialisations(sweep=True):
        assert specs.KERNELS[n].constants == tuple(c), (n, c)
    for name, choices in specs.GEMM_CHOICES.items():
        for (tm, tn, tk), variant in choices:
            for p in specs.GEMM_PRODUCTS[name]:
                constants = {"TM": tm, "TN": tn, "TK": tk, "PRODUCTS": p}
                assert specs.symbol(specs.variant_name(name, variant), constants) in default
    for hp, choices in specs.ATTENTION_CHOICES.items():
        for (tm, tn), variant in choices:
            constants = {"TM": tm, "TN": tn, "HP": hp}
            assert specs.symbol(specs.variant_name("flash_attention", variant),
                                constants) in default
    for width, variant in specs.NORM_GEMM_VARIANT.items():
        assert specs.KERNELS[specs.variant_name("linear_residual_norm", variant)].function
    assert specs.KERNELS[specs.variant_name("layer_norm_out", specs.NORM_VARIANT)].hints


def test_a_variant_needs_its_tile():
    """A variant without its tile is refused before anything launches."""
    a = torch.zeros(8, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="needs its tile"):
        ops.linear_half(None, (a, a), (a, a), torch.zeros(8), a, variant="w8")


def test_key_info():
    """Key end and the read-mask flag per sequence: prefix, holed, empty and full masks."""
    valid = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]],
                         dtype=torch.uint8)
    info = key_info(valid)
    assert info.shape == (4, 4) and info.dtype == torch.int32
    assert info[:, 0].tolist() == [2, 3, 0, 4] and info[:, 1].tolist() == [0, 1, 0, 0]


def test_weight_pair_layout():
    """Weights [N, K] become an fp16 pair [N8, K8], zero-padded to multiples of 8."""
    w = torch.randn(20, 12)
    hi, lo = weight_pair(w)
    assert hi.shape == lo.shape == (24, 16) and hi.is_contiguous()
    assert torch.allclose(hi[:20, :12].float() + lo[:20, :12].float(), w, atol=1e-6, rtol=0)
    assert not hi[20:].any() and not hi[:, 12:].any() and not lo[:, 12:].any()


def test_refuses_without_cuda_device(cutile_selected):
    """Without a CUDA device the backend raises Unsupported; wide rows, sequences past 32-bit
    strides and product counts that were not built are refused by name."""
    cfg = LayerConfig(1, 16, 32, 4, 32, 1)
    with pytest.raises(Unsupported, match="cuda"):
        CutileBackend().build(cfg, {}, device="cpu")
    wide = LayerConfig(1, 16, specs.MAX_ROW_WIDTH + 64, 4, 32, 1)
    with pytest.raises(Unsupported, match="d_model up to"):
        CutileBackend().check(wide, "cuda", torch.float32)
    with pytest.raises(ValueError, match="mode"):
        launch.kernels_for(torch.device("cuda", 0), "fast")
    long = LayerConfig(1, 700_000, 1024, 16, 1024, 1)
    with pytest.raises(Unsupported, match="32 bits"):
        CutileBackend().check(long, "cuda", torch.float32)
    with pytest.raises(ValueError, match="linear_products"):
        CutileBackend(linear_products=4)


# GPU: each kernel family against fp64 PyTorch, outputs poisoned with NaN first.

@pytest.fixture
def kernels(cutile_selected):
    """The backend's launcher on the current device."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = torch.device("cuda", torch.cuda.current_device())
    backend = CutileBackend()
    why = backend.unavailable_reason(device)
    if why:
        pytest.skip(why)
    return backend.kernels(device)


def _norm64(x, w, b):
    x = x.double()
    mean = x.mean(1, keepdim=True)
    var = ((x - mean) ** 2).mean(1, keepdim=True)
    return (x - mean) / torch.sqrt(var + 1e-5) * w.double() + b.double()


@pytest.mark.parametrize("width", [8, 24, 128, 200, 1024, 4096])
def test_layer_norm_kernels(kernels, width):
    """The LayerNorm kernels on 77 rows of any width: the pair sums to the fp32 norm, the
    fp16 form is it rounded once, the fp32 form zeroes invalid rows."""
    g = torch.Generator(device="cuda").manual_seed(width)
    x = torch.randn(77, width, device="cuda", generator=g) * 3 + 1
    w = torch.rand(width, device="cuda", generator=g) + 0.5
    b = torch.randn(width, device="cuda", generator=g)
    hi = torch.full_like(x, math.nan, dtype=torch.float16)
    lo = torch.full_like(hi, math.nan)
    ops.layer_norm_split(kernels, x, w, b, hi, lo)
    want = _norm64(x, w, b)
    assert ((hi.double() + lo.double()) - want).abs().max().item() < 2e-5
    half = torch.full_like(hi, math.nan)
    ops.layer_norm_half(kernels, x, w, b, half)
    assert torch.equal(half, hi)
    out = torch.full_like(x, math.nan)
    valid = (torch.rand(77, device="cuda", generator=g) > 0.3).to(torch.uint8)
    ops.layer_norm_out(kernels, x, w, b, valid, out)
    want = torch.where(valid.bool()[:, None], want, 0)
    assert (out.double() - want).abs().max().item() < 2e-5


@pytest.mark.parametrize("m,k,n", [(77, 40, 24), (300, 128, 384), (1000, 1032, 136),
                                   (8192, 1024, 1024)])
@pytest.mark.parametrize("kind", ["half", "gelu", "gelu_half", "residual_update",
                                  "residual_sum"])
def test_linear_kernels(kernels, kind, m, k, n):
    """Each GEMM epilogue on odd and large sizes, with every product count and every tile and
    variant (specs.GEMM_CHOICES) compiled for it."""
    g = torch.Generator(device="cuda").manual_seed(m + n)
    a = torch.randn(m, k, device="cuda", generator=g)
    w = torch.randn(n, k, device="cuda", generator=g) / math.sqrt(k)
    bias = torch.randn(n, device="cuda", generator=g)
    a_pair = tuple(torch.zeros(m, -(-k // 8) * 8, device="cuda", dtype=torch.float16)[:, :k]
                   for _ in range(2))
    a_pair[0].copy_(a)
    a_pair[1].copy_(a - a_pair[0].float())
    w_pair = weight_pair(w)  # k and n are multiples of 8 here: no padding
    exact = a.double() @ w.double().t() + bias.double()
    res = torch.randn(m, n, device="cuda", generator=g)
    valid = (torch.rand(m, device="cuda", generator=g) > 0.25).to(torch.uint8)
    name = {"half": "linear_half", "gelu": "linear_gelu",
            "gelu_half": "linear_gelu_half"}.get(kind, "linear_residual")
    for products, (tile, variant) in itertools.product(specs.GEMM_PRODUCTS[name],
                                                       specs.GEMM_CHOICES[name]):
        if kind == "half":
            out = torch.full((m, n), math.nan, device="cuda", dtype=torch.float16)
            ops.linear_half(kernels, a_pair, w_pair, bias, out, tile, variant)
            # one product: activations and weights rounded to fp16
            exact1 = (a_pair[0].double() @ w_pair[0].double().t() + bias.double())
            got, want, tol = out.double(), exact1, 2e-3
        elif kind == "gelu":
            pair = tuple(torch.full((m, n), math.nan, device="cuda", dtype=torch.float16)
                         for _ in range(2))
            ops.linear_gelu(kernels, a_pair, w_pair, bias, pair, products, tile, variant)
            got = pair[0].double() + pair[1].double()
            want, tol = torch.nn.functional.gelu(exact), 1e-4 if products == 3 else 2e-3
        elif kind == "gelu_half":  # one product, rounded once to fp16
            out = torch.full((m, n), math.nan, device="cuda", dtype=torch.float16)
            ops.linear_gelu_half(kernels, a_pair, w_pair, bias, out, products, tile, variant)
            exact1 = (a_pair[0].double() @ w_pair[0].double().t() + bias.double())
            got, want, tol = out.double(), torch.nn.functional.gelu(exact1), 2e-3
        else:
            out = torch.full((m, n), math.nan, device="cuda")
            zero_sum = kind == "residual_sum"
            ops.linear_residual(kernels, a_pair, w_pair, bias, res, valid, out, products,
                                zero_sum=zero_sum, tile=tile, variant=variant)
            keep = valid.bool()[:, None]
            want = (torch.where(keep, res.double() + exact, 0) if zero_sum
                    else res.double() + torch.where(keep, exact, 0))
            got, tol = out.double(), 1e-4 if products == 3 else 2e-3
        err = ((got - want).abs() / want.abs().clamp_min(1.0)).nan_to_num(nan=math.inf)
        assert err.max().item() < tol, \
            f"{kind} {products} products, {tile} {variant}: {err.max().item():.3g}"
    if kind.startswith("residual"):  # in place (OUT is RES, as ffn_out runs) and without mask
        out = res.clone()
        ops.linear_residual(kernels, a_pair, w_pair, bias, out, None, out, 3, zero_sum=True)
        err = ((out.double() - res.double() - exact).abs() / exact.abs().clamp_min(1.0))
        assert err.max().item() < 1e-4


@pytest.mark.parametrize("n", [8, 16, 40, 72, 128])
@pytest.mark.parametrize("final", [False, True], ids=["pair", "final"])
@pytest.mark.parametrize("zero_sum", [False, True], ids=["update", "sum"])
def test_linear_residual_norm_kernel(kernels, n, final, zero_sum):
    """The residual GEMM with the LayerNorm of its new rows in the epilogue, every padded
    width, product count and zeroing mode, with and without a mask: the rows and the normed
    pair, or the final fp32 norm with invalid rows 0, against fp64; wider rows than its
    tiles are refused."""
    m, k = 300, 136
    g = torch.Generator(device="cuda").manual_seed(n)
    a = torch.randn(m, k, device="cuda", generator=g)
    a_pair = split_fp16(a)
    w = torch.randn(n, k, device="cuda", generator=g) / math.sqrt(k)
    bias = torch.randn(n, device="cuda", generator=g)
    res = torch.randn(m, n, device="cuda", generator=g)
    nw = torch.rand(n, device="cuda", generator=g) + 0.5
    nb = torch.randn(n, device="cuda", generator=g)
    exact = a.double() @ w.double().t() + bias.double()
    for products in specs.GEMM_PRODUCTS["linear_residual"]:
        for valid in (None, (torch.rand(m, device="cuda", generator=g) > 0.25).byte()):
            keep = (torch.ones(m, 1, dtype=torch.bool, device="cuda") if valid is None
                    else valid.bool()[:, None])
            rows = (torch.where(keep, res.double() + exact, 0) if zero_sum
                    else res.double() + torch.where(keep, exact, 0))
            want = _norm64(rows, nw, nb)
            out = torch.full((m, n), math.nan, device="cuda")
            tol = 1e-4 if products == 3 else 2e-3
            if final:
                normed = torch.full((m, n), math.nan, device="cuda")
                ops.linear_residual_norm(kernels, a_pair, weight_pair(w), bias, res, valid,
                                         out, (nw, nb), products=products, zero_sum=zero_sum,
                                         final=normed)
                got, want = normed.double(), torch.where(keep, want, 0)
            else:
                pair = tuple(torch.full((m, n), math.nan, device="cuda", dtype=torch.float16)
                             for _ in range(2))
                ops.linear_residual_norm(kernels, a_pair, weight_pair(w), bias, res, valid,
                                         out, (nw, nb), products=products, zero_sum=zero_sum,
                                         pair=pair)
                got = pair[0].double() + pair[1].double()
                err = ((out.double() - rows).abs() / rows.abs().clamp_min(1.0)).max().item()
                assert err < tol, f"rows, {products} products: {err:.3g}"
            # the norm divides by the rows' spread: compare in units of the output
            err = (got - want).abs().max().item()
            assert err < 20 * tol, f"norm, {products} products, mask {valid is not None}: {err}"
    wide = torch.zeros(m, 200, device="cuda")
    with pytest.raises(ValueError, match="one tile"):
        ops.linear_residual_norm(kernels, a_pair, weight_pair(w), bias, wide, None, wide,
                                 (nw, nb), products=3, zero_sum=True, final=wide)


@pytest.mark.parametrize("n, f", [(8, 36), (40, 100), (128, 128), (128, 520)])
@pytest.mark.parametrize("final", [False, True], ids=["pair", "final"])
def test_ffn_residual_norm_kernel(kernels, n, f, final):
    """The whole FFN in one kernel, every product count, with and without a mask: residual
    plus ffn_out(GELU(ffn_in(a))) with invalid rows zeroed, and the LayerNorm of the new rows
    (a pair, or the final fp32 norm), against fp64; hidden widths off the chunk size."""
    m = 300
    g = torch.Generator(device="cuda").manual_seed(n + f)
    a = torch.randn(m, n, device="cuda", generator=g)
    a_pair = split_fp16(a)
    w1 = torch.randn(f, n, device="cuda", generator=g) / math.sqrt(n)
    b1 = torch.randn(f, device="cuda", generator=g)
    w2 = torch.randn(n, f, device="cuda", generator=g) / math.sqrt(f)
    b2 = torch.randn(n, device="cuda", generator=g)
    res = torch.randn(m, n, device="cuda", generator=g)
    nw = torch.rand(n, device="cuda", generator=g) + 0.5
    nb = torch.randn(n, device="cuda", generator=g)
    hidden = torch.nn.functional.gelu(a.double() @ w1.double().t() + b1.double())
    exact = hidden @ w2.double().t() + b2.double()
    b1_padded = torch.zeros(-(-f // 8) * 8, device="cuda")
    b1_padded[:f] = b1
    ffn_in, ffn_out = (weight_pair(w1), b1_padded), (weight_pair(w2), b2)
    for products in specs.GEMM_PRODUCTS["linear_residual"]:
        for valid in (None, (torch.rand(m, device="cuda", generator=g) > 0.25).byte()):
            keep = (torch.ones(m, 1, dtype=torch.bool, device="cuda") if valid is None
                    else valid.bool()[:, None])
            rows = torch.where(keep, res.double() + exact, 0)
            want = _norm64(rows, nw, nb)
            out = torch.full((m, n), math.nan, device="cuda")
            # one product rounds the hidden rows as well as the input: twice two's bound
            tol = {3: 1e-4, 2: 2e-3, 1: 4e-3}[products]
            if final:
                normed = torch.full((m, n), math.nan, device="cuda")
                ops.ffn_residual_norm(kernels, a_pair, ffn_in, ffn_out, res, valid, out,
                                      (nw, nb), products=products, final=normed)
                got, want = normed.double(), torch.where(keep, want, 0)
            else:
                pair = tuple(torch.full((m, n), math.nan, device="cuda", dtype=torch.float16)
                             for _ in range(2))
                ops.ffn_residual_norm(kernels, a_pair, ffn_in, ffn_out, res, valid, out,
                                      (nw, nb), products=products, pair=pair)
                got = pair[0].double() + pair[1].double()
                err = ((out.double() - rows).abs() / rows.abs().clamp_min(1.0)).max().item()
                assert err < tol, f"rows, {products} products: {err:.3g}"
            err = (got - want).abs().max().item()
            assert err < 20 * tol, f"norm, {products} products, mask {valid is not None}: {err}"


@pytest.mark.parametrize("number", [1, 7, 13, 0], ids=["d128", "d32", "seq", "one-layer"])
def test_fused_ffn_keeps_the_contract(kernels, number):
    """fuse_ffn=True (four launches per block) keeps the contract on CI shapes with padding
    and on a one-block stack, agrees with the two FFN kernels to rounding, and needs no
    hidden-row workspace."""
    from layerbench.common.contract import compare

    cfg = _ci_config(number)
    model, x, mask, expected = _layer_case(cfg, 0.25, 43)
    outs, plans = [], []
    for fuse in (True, False):
        backend = CutileBackend(fuse_ffn=fuse)
        layer = backend.build(cfg, model.state_dict(), device="cuda")
        assert layer.fuse_ffn == fuse
        plans.append(backend.memory_plan(cfg, torch.float32).total)
        with torch.no_grad():
            outs.append(layer(x, mask).clone())
        report = compare(outs[-1], expected)
        assert report.passed, f"fuse_ffn={fuse}: {report.summary()}"
    assert (outs[0] - outs[1]).abs().max().item() < 1e-3
    assert plans[0] < plans[1]


@pytest.mark.parametrize("number", [1, 7, 11, 0], ids=["d128", "d32", "h16", "one-layer"])
def test_fused_norms_keep_the_contract(kernels, number):
    """fuse_norms=True (five launches per block) keeps the contract."""
    _options_keep_the_contract(_ci_config(number), "fuse_norms")


@pytest.mark.parametrize("number", [1, 8, 0], ids=["d128", "d1024", "one-layer"])
def test_lean_pairs_keep_the_contract(kernels, number):
    """lean_pairs=True (hi halves alone where one product reads them) keeps the contract."""
    _options_keep_the_contract(_ci_config(number), "lean_pairs")


@pytest.mark.parametrize("number", [1, 7, 0], ids=["d128", "d32", "one-layer"])
def test_pdl_keeps_the_contract(kernels, number):
    """pdl=True (each kernel launched to overlap the one before it) keeps the contract, in
    eager launches and in the replayed graph."""
    _options_keep_the_contract(_ci_config(number), "pdl")


WHOLE_BLOCK_CASES = {  # sizes a --sweep build exports (specs.SWEEP_BLOCKS)
    "h4-two-chunks": (LayerConfig(2, 128, 128, 4, 128, 2), 0.25),
    "h4-full": (LayerConfig(2, 128, 128, 4, 128, 1, causal=False), 0.25),
    "h4-no-padding": (LayerConfig(2, 128, 128, 4, 128, 1), 0.0),
    "d32": (LayerConfig(2, 128, 32, 4, 32, 2), 0.25),
    "h16": (LayerConfig(2, 128, 128, 16, 128, 1), 0.25),
    "h2": (LayerConfig(2, 128, 128, 2, 128, 1), 0.25),
    "h1": (LayerConfig(2, 128, 128, 1, 128, 1), 0.25),
    "seq32": (LayerConfig(3, 32, 128, 4, 128, 2), 0.25),
}


@pytest.mark.parametrize("case", list(WHOLE_BLOCK_CASES))
def test_whole_block_keeps_the_contract(kernels, case):
    """fuse_block=True runs one kernel per block (both 64-row halves of 128-row sequences,
    head dims 8-128, causal or full, with and without padding) and keeps the contract,
    eager and replayed, agreeing with the separate kernels to rounding; skips where the
    build lacks the kernel."""
    cfg, padding = WHOLE_BLOCK_CASES[case]
    _options_keep_the_contract(cfg, "fuse_block", padding)


def _ci_config(number):
    """The config of CI shape number, or for 0 a one-block stack."""
    from layerbench.common.shapes import CI

    return CI[number].config if number else LayerConfig(2, 40, 32, 4, 36, 1)


def _options_keep_the_contract(cfg, option, padding=0.25):
    """A CutileBackend option on keeps the contract on cfg with padding, eager, captured and
    replayed, and agrees with it off to rounding."""
    from layerbench.common.contract import compare

    model, x, mask, expected = _layer_case(cfg, padding, 41)
    outs = []
    for on in (True, False):
        try:
            layer = CutileBackend(**{option: on}).build(cfg, model.state_dict(),
                                                        device="cuda")
        except Unsupported as exc:
            pytest.skip(str(exc))
        assert getattr(layer, option) == on
        if option == "fuse_block":
            assert layer._whole_blocks(cfg.seq_len) == on
        with torch.no_grad():
            for _ in range(3):  # eager, captured, replayed
                outs.append(layer(x, mask).clone())
                report = compare(outs[-1], expected)
                assert report.passed, f"{option}={on}: {report.summary()}"
        assert layer.graphed.graphs and not layer.graphed.uncapturable
    assert (outs[0] - outs[-1]).abs().max().item() < 1e-3


@pytest.mark.parametrize("tile", ["small", "large"])
@pytest.mark.parametrize("head_dim", [8, 24, 32, 64, 72, 128, 256])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("mask", ["none", "prefix", "holes"])
def test_attention_kernel(kernels, head_dim, causal, mask, tile, monkeypatch):
    """Flash attention at odd lengths against the fp32 oracle: every padded head dim, causal or
    full, no mask, prefix masks (one sequence empty) and holed masks, on the first choice of
    specs.ATTENTION_CHOICES ("small": few blocks) and on the last ("large": chosen as if the
    device had one multiprocessor)."""
    if tile == "large":
        monkeypatch.setattr(ops, "multiprocessor_count", lambda device: 1)
    batch, seq_len, heads = 3, 200, 2
    d = heads * head_dim
    g = torch.Generator(device="cuda").manual_seed(head_dim)
    qkv = torch.randn(batch * seq_len, 3 * d, device="cuda", generator=g).half()
    valid = None
    if mask != "none":
        lengths = torch.tensor([seq_len, 0, 137], device="cuda")
        valid = (torch.arange(seq_len, device="cuda")[None, :] < lengths[:, None])
        if mask == "holes":
            valid &= torch.rand(batch, seq_len, device="cuda", generator=g) > 0.3
        valid = valid.to(torch.uint8)
    everyone = torch.ones(batch, seq_len, dtype=torch.uint8, device="cuda")
    want, blind = packed_attention(qkv, everyone if valid is None else valid, batch=batch,
                                   seq_len=seq_len, heads=heads, causal=causal)
    ctx = tuple(torch.full((batch * seq_len, d), math.nan, device="cuda",
                           dtype=torch.float16) for _ in range(2))
    ops.attention(kernels, qkv.view(batch, seq_len, 3 * heads, head_dim),
                  [t.view(batch, seq_len, heads, head_dim) for t in ctx], valid,
                  None if valid is None else key_info(valid), num_heads=heads,
                  causal=causal)
    got = (ctx[0].float() + ctx[1].float()).view(batch, seq_len, d)
    assert torch.isfinite(got).all()
    err = (got - want).abs().max().item()
    assert err < 2e-2, f"max error {err:.3g}"
    assert torch.equal(got[blind], torch.zeros_like(got[blind]))


@needs_gpu
def test_aot_and_jit_agree(cutile_selected):
    """Both launch paths run the same sources: identical outputs on one layer."""
    from layerbench.common.inputs import make_inputs
    from layerbench.reference import make_reference

    device = torch.device("cuda", torch.cuda.current_device())
    why = launch.jit_unavailable_reason()
    if why:
        pytest.skip(f"no JIT here: {why}")
    try:
        launch.AotKernels(device)
    except Unsupported as exc:
        pytest.skip(f"no ahead-of-time build here: {exc}")
    cfg = LayerConfig(3, 100, 64, 2, 96, 2)
    model = make_reference(cfg, seed=3)
    x, mask = make_inputs(cfg, padding_ratio=0.25, seed=4, device="cuda")
    outs = []
    for mode in ("aot", "jit"):
        layer = CutileBackend(mode).build(cfg, model.state_dict(), device=device)
        with torch.no_grad():
            outs.append(layer(x, mask).clone())
    assert torch.equal(outs[0], outs[1])


def _layer_case(cfg, padding, seed, dtype=torch.float32):
    """(reference model, x, mask, strict fp32 expected output) on the GPU."""
    from layerbench.common.inputs import make_inputs
    from layerbench.reference import make_reference, reference_forward

    model = make_reference(cfg, seed=seed)
    x, mask = make_inputs(cfg, padding_ratio=padding, seed=seed + 1, device="cuda", dtype=dtype)
    expected = reference_forward(model.to("cuda"), x.float(), mask)
    return model, x, mask, expected


@pytest.mark.parametrize("ffn_dim", [100, 36])
def test_ffn_dim_off_multiples_of_8(kernels, ffn_dim):
    """Hidden rows and ffn weights are zero-padded to multiples of 8: the layer keeps the
    contract where ffn_dim is not one."""
    from layerbench.common.contract import compare

    cfg = LayerConfig(2, 40, 64, 2, ffn_dim, 2)
    model, x, mask, expected = _layer_case(cfg, 0.25, 11)
    layer = CutileBackend().build(cfg, model.state_dict(), device="cuda")
    with torch.no_grad():
        report = compare(layer(x, mask), expected)
    assert report.passed, report.summary()


@pytest.mark.parametrize("fuse_norms", [False, True], ids=["separate", "fused"])
def test_chunks_and_misaligned_buffers(kernels, fuse_norms):
    """One sequence per chunk gives the same output as the whole batch at once, and fp32 x and
    out that start off 16 bytes go through the staging rows to the same result."""
    cfg = LayerConfig(5, 48, 64, 4, 64, 2)
    model, x, mask, _ = _layer_case(cfg, 0.25, 21)
    layer = CutileBackend(fuse_norms=fuse_norms).build(cfg, model.state_dict(), device="cuda")
    with torch.no_grad():
        whole = layer.forward(x, mask).clone()
        layer.chunks.chunks[(cfg.batch_size, cfg.seq_len)] = 1
        chunked = layer.graphed.forward(x, mask).clone()
        store = torch.empty(x.numel() + 1, device="cuda")
        x_off = store[1:].view_as(x)
        x_off.copy_(x)
        out_off = torch.empty(x.numel() + 1, device="cuda")[1:].view_as(x)
        layer.graphed.forward(x_off, mask, out_off)
    assert x_off.data_ptr() % 16 and out_off.data_ptr() % 16
    assert torch.equal(whole, chunked)
    assert torch.equal(whole, out_off)


def test_graph_replay_follows_the_mask(kernels):
    """A replayed graph reads the mask anew: switching the same buffer from a prefix mask to a
    holed one (which needs the mask read inside attention) changes the output as the
    reference does."""
    from layerbench.common.contract import compare
    from layerbench.reference import reference_forward

    cfg = LayerConfig(3, 64, 64, 2, 64, 2)
    model, x, mask, expected = _layer_case(cfg, 0.25, 31)
    layer = CutileBackend().build(cfg, model.state_dict(), device="cuda")
    with torch.no_grad():
        for _ in range(3):  # eager, capture, replay
            out = layer(x, mask)
        assert compare(out, expected).passed
        mask[:, 5] = False
        mask[:, 0] = True
        holed = reference_forward(model.to("cuda"), x, mask)
        out = layer(x, mask)
    report = compare(out, holed)
    assert report.passed, report.summary()


def _half_case(m, k, n, tile, seed):
    """(launch, output, expected) of one linear_half on fresh operands."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(m, k, device="cuda", generator=gen).half()
    w = torch.randn(n, k, device="cuda", generator=gen) / math.sqrt(k)
    bias = torch.randn(n, device="cuda", generator=gen)
    pair = weight_pair(w)
    out = torch.empty(m, n, device="cuda", dtype=torch.float16)
    expected = a.double() @ pair[0][:n, :k].double().t() + bias.double()

    def launch_it(kernels):
        ops.linear_half(kernels, (a, torch.zeros_like(a)), pair, bias, out, tile)
    return launch_it, out, expected


@pytest.mark.parametrize("later", ["same-kernel", "other-tile", "both", "many"])
def test_graph_replay_is_independent_of_later_launches(kernels, later):
    """A captured graph keeps its own arguments (TMA's tensor maps included): launches of the
    same kernel on other arrays, or of another tile of it, after the capture leave its
    replay correct."""
    tile = (128, 128, 64)
    first, out, expected = _half_case(1000, 256, 384, tile, 41)
    first(kernels)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        first(kernels)
    others = []
    if later in ("same-kernel", "both"):
        others.append(_half_case(3000, 512, 136, tile, 42))
    if later in ("other-tile", "both"):
        others.append(_half_case(500, 128, 256, (64, 64, 32), 43))
    if later == "many":  # more argument sets than a small cache of tensor maps would hold
        others += [_half_case(200 + 8 * i, 128, 128, tile, 50 + i) for i in range(40)]
    keep = []
    for launch_it, *_ in others:
        launch_it(kernels)
        g = torch.cuda.CUDAGraph()  # a second graph of it, captured after the first
        with torch.cuda.graph(g, stream=stream):
            launch_it(kernels)
        keep.append(g)
    for g in keep:
        g.replay()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert (out.double() - expected).abs().max().item() < 2e-2


def _launcher_on(device):
    """The backend's launcher for device, or a skip with the reason it has none."""
    backend = CutileBackend()
    why = backend.unavailable_reason(device)
    if why:
        pytest.skip(why)
    return backend.kernels(device)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("stream", ["default", "side"])
def test_kernels_run_on_their_tensors_device(cutile_selected, stream):
    """The launcher of cuda:1 called while cuda:0 is current runs its kernels on cuda:1, on
    cuda:1's current stream: the legacy default stream (whose launches take the current
    context, so the launcher makes its device current) and a side stream with pending work
    (a long sleep, then the copy of the input)."""
    device = torch.device("cuda", 1)
    kernels = _launcher_on(device)
    gen = torch.Generator(device=device).manual_seed(5)
    x = torch.randn(77, 64, generator=gen, device=device)
    w = torch.rand(64, generator=gen, device=device) + 0.5
    b = torch.randn(64, generator=gen, device=device)
    side = torch.cuda.Stream(device) if stream == "side" else torch.cuda.default_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.no_grad(), torch.cuda.device(device), torch.cuda.stream(side):
        rows = torch.zeros_like(x)
        torch.cuda._sleep(50_000_000)
        rows.copy_(x)
        out = torch.full_like(x, math.nan)
        with torch.cuda.device(0):
            assert torch.cuda.current_device() == 0
            assert torch.cuda.current_stream(device) == side
            ops.layer_norm_out(kernels, rows, w, b, None, out)
    side.synchronize()
    assert (out.double() - _norm64(x, w, b)).abs().max().item() < 2e-5

