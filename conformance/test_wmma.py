"""wmma-specific cases: every CUDA source compiles cleanly for sm_80 and sm_90 (also without
a GPU), the backend refuses clearly what it cannot run, and (on a GPU) the attention kernel
over every head dim, full attention, masks, and the streamed batch."""
from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from layerbench.backends.wmma import WmmaBackend, build
from layerbench.backends.wmma.tiles import GEMM_TILES, choose_tiles
from layerbench.common.config import LayerConfig
from layerbench.common.contract import compare
from layerbench.common.errors import Unsupported
from layerbench.reference import packed_attention

import background

CUDA_SOURCES = [name for name in build.SOURCES if name.endswith(".cu")]
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="session")
def strict_compiles(wmma_selected, wmma_objects):
    """(source, arch) -> (command, return code, output) of every strict nvcc compile
    (build.compile_strict; started in the background at collection where this session needs
    it); the objects land in wmma_objects for the SASS report. Skips where wmma is not
    selected (every run without --backend selects it, CI's too)."""
    if build.nvcc_path() is None:
        pytest.skip(build.toolkit_missing())
    folder, results = background.result(background.WMMA_STRICT,
                                        lambda: (wmma_objects, build.compile_strict(wmma_objects)))
    for obj in Path(folder).glob("*.o"):
        if obj.parent != Path(wmma_objects):
            shutil.copy(obj, wmma_objects / obj.name)
    return results


@pytest.mark.parametrize("arch", build.ARCHES, ids=[f"sm{a}" for a in build.ARCHES])
@pytest.mark.parametrize("source", CUDA_SOURCES)
def test_source_compiles_without_warnings(source, arch, strict_compiles):
    """nvcc compiles the source with the JIT build's flags, every warning (ptxas spills
    included) an error."""
    command, returncode, output = strict_compiles[(source, arch)]
    assert returncode == 0, f"{' '.join(command)}\n{output}"
    assert "warning" not in output.lower(), output


def test_refuses_without_cuda_device(wmma_selected):
    """Without a CUDA device the backend raises Unsupported (on CPU and on 'cuda')."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    cfg = LayerConfig(1, 16, 32, 4, 32, 1)
    backend = WmmaBackend()
    with pytest.raises(Unsupported, match="cuda"):
        backend.build(cfg, {}, device="cpu")
    with pytest.raises(Unsupported, match="CUDA device"):
        backend.build(cfg, {}, device="cuda")


def test_refuses_an_architecture_nvcc_lacks(wmma_selected, monkeypatch):
    """A device whose architecture the toolkit's nvcc does not list is refused, naming it;
    one it lists (or an nvcc that cannot say) is not."""
    if build.nvcc_path() is None:
        pytest.skip(build.toolkit_missing())
    monkeypatch.setattr(build, "device_arch", lambda device: "999")
    assert "sm_999" in build.arch_unsupported(torch.device("cuda"))
    monkeypatch.setattr(build, "device_arch", lambda device: "90")
    assert build.arch_unsupported(torch.device("cuda")) is None
    monkeypatch.setattr(build, "_gpu_codes", lambda nvcc: None)
    monkeypatch.setattr(build, "device_arch", lambda device: "999")
    assert build.arch_unsupported(torch.device("cuda")) is None


def test_refuses_without_toolkit(wmma_selected, monkeypatch):
    """Without nvcc the backend names the missing toolkit."""
    monkeypatch.setattr(build, "cuda_home", lambda: None)
    with pytest.raises(Unsupported, match="CUDA toolkit"):
        WmmaBackend().check(LayerConfig(1, 16, 32, 4, 32, 1), "cuda", torch.float32)


@pytest.mark.parametrize("d_model,heads,ffn", [(48, 4, 48), (528, 2, 64), (64, 4, 36)],
                         ids=["hd12", "hd264", "ffn36"])
def test_refuses_unsupported_sizes(wmma_selected, d_model, heads, ffn):
    """Head dims off the multiples of 8 in 8..256, and ffn dims off multiples of 8."""
    if build.cuda_home() is None:
        pytest.skip(build.toolkit_missing())
    with pytest.raises(Unsupported):
        WmmaBackend().check(LayerConfig(1, 16, d_model, heads, ffn, 1), "cuda", torch.float32)


def test_products_follow_width_and_depth(wmma_selected):
    """out_proj and the FFN by default: one fp16 product from d_model 512, two below (three
    in forwards of many tokens), and three in every call of a stack deeper than four blocks;
    a fixed linear_products holds in every call. Q/K/V: one, three in those deep stacks."""
    from layerbench.backends.wmma.layer import Plan, plan_products, qkv_products_for
    from layerbench.backends.wmma.tiles import TILED_128x128_BK64_PIPELINED, TILED_128x128_W4

    for d, blocks, want in ((128, 4, (2, 3)), (1024, 4, (1, 1)), (1024, 2, (1, 1)),
                            (128, 5, (3, 3)), (1024, 12, (3, 3)), (512, 5, (3, 3))):
        cfg = LayerConfig(2, 16, d, 4, 64, blocks)
        assert plan_products(cfg, None) == want, (d, blocks)
        assert qkv_products_for(cfg) == (3 if blocks > 4 else 1)
    assert plan_products(LayerConfig(2, 16, 1024, 4, 64, 12), 1) == (1, None)
    # Q/K/V at three products: its tile takes three (not the one-product pipelined form),
    # and neither ffn_block nor norm_qkv (which write norm1 as hi alone) runs
    for count, tile in ((1, TILED_128x128_BK64_PIPELINED), (3, TILED_128x128_W4)):
        assert choose_tiles(8192, 1024, 1024, 256, 132, qkv_products=count).qkv == tile
    deep = Plan(False, True, 1, qkv_products=3)
    assert not deep.runs_ffn_block(8192, 132, 1) and not deep.always_ffn_block()
    assert Plan(False, True, 1).always_ffn_block()


def test_tile_choice(wmma_selected):
    """K > 128: the 4-warp 128x128 tiled variant where it fills the SMs (BK 64 pipelined with
    one or two products, BK 32 plain with three); K <= 128: the persistent stream variants
    when they fill the SMs; few rows: 32x32 tiles. Key blocks shrink past hd 128."""
    big = choose_tiles(8192, 1024, 1024, 256, 132, products=1)
    assert GEMM_TILES[big.qkv].name == "tiled 128x128 bk64 4w pipelined"
    assert big.attention_block_n == 32
    assert GEMM_TILES[big.out_proj].name == "tiled 128x128 bk64 4w pipelined"
    three = choose_tiles(8192, 1024, 1024, 256, 132, products=3)
    assert GEMM_TILES[three.qkv].name == "tiled 128x128 bk64 4w pipelined"  # one product
    assert GEMM_TILES[three.out_proj].name == "tiled 128x128 bk32 4w"
    small = choose_tiles(128, 128, 128, 32, 132)
    assert GEMM_TILES[small.out_proj].name == "tiled 32x32 bk64 4w"
    assert small.attention_block_n == 64
    mid = choose_tiles(8192, 128, 128, 32, 132)
    assert GEMM_TILES[mid.qkv].name == GEMM_TILES[mid.ffn_in].name == "stream 64x64 4w"
    long = choose_tiles(1_280_000, 128, 512, 32, 132)
    # one product (Q/K/V): 64x128 of 8 warps (two CTAs an SM); three: 128x128 of 16 warps
    assert GEMM_TILES[long.qkv].name == "stream 64x128 8w"
    assert {GEMM_TILES[t].name for t in long[1:3]} == {"stream 128x128 16w"}
    two = choose_tiles(1_280_000, 128, 128, 32, 132, fuse_norms=True, products=2)
    assert {GEMM_TILES[t].name for t in two[:4]} == {"stream 64x128 8w"} and two.norm_ffn_out
    assert GEMM_TILES[long.ffn_out].kind == "tiled"  # K = ffn_dim = 512
    # stream_tile replaces the 16-warp 128x128 stream variant, norm epilogues included.
    from layerbench.backends.wmma.tiles import STREAM_128x128_RESIDENT

    resident = choose_tiles(1_280_000, 128, 128, 32, 132, fuse_norms=True, products=2,
                            stream_tile=STREAM_128x128_RESIDENT)
    assert set(resident[:4]) == {STREAM_128x128_RESIDENT} and resident.norm_ffn_out
    assert choose_tiles(8192, 128, 128, 32, 132, stream_tile=STREAM_128x128_RESIDENT) == mid
    assert WmmaBackend(stream_tile="stream 128x128 8w resident").stream_tile == \
        STREAM_128x128_RESIDENT
    # persistent: the persistent form of the pipelined tile, where that tile would run.
    persistent = choose_tiles(8192, 1024, 1024, 256, 132, products=3, persistent=True)
    assert GEMM_TILES[persistent.qkv].name == "tiled 128x128 bk64 4w pipelined persistent"
    assert persistent.out_proj == three.out_proj  # three products: the plain BK 32 tile
    assert choose_tiles(8192, 128, 128, 32, 132, persistent=True) == mid
    with pytest.raises(ValueError, match="stream_tile must be one of"):
        WmmaBackend(stream_tile="stream 64x64 4w")  # does not hold 128 columns
    with pytest.raises(ValueError, match="not a stream variant holding 128 columns"):
        choose_tiles(1_280_000, 128, 128, 32, 132, stream_tile=0)
    for tiles, d, f in ((big, 1024, 1024), (small, 128, 128), (mid, 128, 128), (long, 128, 512)):
        for t, k in zip(tiles[:4], (d, d, d, f)):  # stream variants only where K <= 128
            assert GEMM_TILES[t].kind == "tiled" or k <= 128
    # GEMM_TILES describes the GemmTile values (common.cuh) as linear.cuh instantiates them.
    import re

    source = (build.SOURCE_DIR / "linear.cuh").read_text()
    header = (build.SOURCE_DIR / "common.cuh").read_text()
    enum = re.search(r"enum class GemmTile : int \{(.*?)\};", header, re.S).group(1)
    names = re.findall(r"(k\w+) = (\d+)", enum)
    assert [int(v) for _, v in names] == list(range(len(GEMM_TILES)))
    assert f"kGemmTiles = {len(GEMM_TILES)};" in header
    aliases = dict(re.findall(r"using (\w+) = ((?:Tiled|Stream)Variant<[^>]*>);", source))
    cases = dict(re.findall(r"case GemmTile::(\w+):\s*return launch_\w+<(\w+), PRODUCTS>",
                            source))
    for (name, _), v in zip(names, GEMM_TILES):
        args = [int(x) for x in re.findall(r"\d+", aliases[cases[name]])]
        warps = (v.rows // v.warp_tile[0], v.cols // v.warp_tile[1])
        assert warps[0] * warps[1] == v.warps, v
        expected = [v.rows, v.cols, *warps, *([v.bk] if v.kind == "tiled" else []),
                    *v.stages, *v.ctas_per_sm]
        assert aliases[cases[name]].startswith(v.kind.title()) and args == expected, v
        flags = [f == "true" for f in re.findall(r"\b(true|false)\b", aliases[cases[name]])]
        want = [v.pipelined, v.persistent] if v.kind == "tiled" else [v.resident_weights]
        assert flags == want[:len(flags)] and not any(want[len(flags):]), v


def test_norm_tile_choice(wmma_selected):
    """fuse_norms: out_proj and ffn_out take a stream tile holding whole rows (d_model <= 128,
    K <= 128, two or three products, within the shared-memory limit, enough rows to fill the
    SMs with 64-row tiles); the other linears and every wider layer keep their tiles."""
    from layerbench.backends.wmma.tiles import STREAM_MAX_K, stream_smem_bytes

    for rows in (16384, 1_280_000):
        plain = choose_tiles(rows, 128, 128, 32, 132)
        fused = choose_tiles(rows, 128, 128, 32, 132, fuse_norms=True)
        assert fused.norm_out_proj and fused.norm_ffn_out
        assert (fused.qkv, fused.ffn_in) == (plain.qkv, plain.ffn_in)
        for t in (fused.out_proj, fused.ffn_out):
            assert GEMM_TILES[t].kind == "stream" and GEMM_TILES[t].cols >= 128
    for rows in (128, 2048, 8192):  # few rows: separate norm kernels
        fused = choose_tiles(rows, 128, 128, 32, 132, fuse_norms=True)
        assert not fused.norm_out_proj and not fused.norm_ffn_out
        assert fused == choose_tiles(rows, 128, 128, 32, 132)
    assert GEMM_TILES[choose_tiles(1_280_000, 128, 128, 32, 132,
                                   fuse_norms=True).out_proj].name == "stream 128x128 16w"
    narrow = choose_tiles(8192, 32, 32, 8, 132, fuse_norms=True)
    assert GEMM_TILES[narrow.out_proj].name == GEMM_TILES[narrow.ffn_out].name == \
        "stream 64x64 4w"
    # 128x128 with three products needs 224 KB: an A100 (163 KB) takes 64x128.
    assert stream_smem_bytes(6, 3, 128) == 229_376 and stream_smem_bytes(7, 3, 128) == 149_504
    a100 = choose_tiles(1_280_000, 128, 128, 32, 108, fuse_norms=True, smem_limit=166_912)
    assert GEMM_TILES[a100.out_proj].name == "stream 64x128 8w"
    long = choose_tiles(1_280_000, 128, 512, 32, 132, fuse_norms=True)
    assert long.norm_out_proj and not long.norm_ffn_out and 512 > STREAM_MAX_K
    assert long.ffn_out == choose_tiles(1_280_000, 128, 512, 32, 132).ffn_out
    wide = choose_tiles(8192, 1024, 1024, 256, 132, fuse_norms=True)
    assert not (wide.norm_out_proj or wide.norm_ffn_out)
    assert wide == choose_tiles(8192, 1024, 1024, 256, 132)
    two = choose_tiles(16384, 128, 128, 32, 132, fuse_norms=True, products=2)
    assert two.norm_out_proj and two.norm_ffn_out


NORM_TILES = ("stream 128x128 16w", "stream 64x128 8w", "stream 64x64 4w", "stream 32x128 4w",
              "stream 128x128 8w resident")
# (kind, out dtype, lo part, zero invalid rows): norm2's pair, the next norm1's hi part, the
# final norm in each output dtype.
NORM_MODES = {"pair": (torch.float16, True, False), "hi": (torch.float16, False, False),
              "final32": (torch.float32, False, True), "final16": (torch.float16, False, True),
              "final-bf16": (torch.bfloat16, False, True)}


@needs_gpu
@pytest.mark.parametrize("mode", list(NORM_MODES))
@pytest.mark.parametrize("m,n,k", [(1, 8, 8), (37, 24, 40), (45, 20, 24), (300, 128, 128),
                                   (1000, 64, 96), (4099, 128, 64), (130, 120, 128),
                                   (128 * 300 + 37, 128, 64)])
@pytest.mark.parametrize("tile_name", NORM_TILES)
def test_linear_norm_epilogue(wmma_selected, tile_name, m, n, k, mode):
    """The norm epilogue of every stream tile that holds the rows (N <= its columns): the
    fp32 rows as without it, and their LayerNorm (float64 of the kernel's own rows) in each
    output kind, into NaN-filled outputs; odd M, N and K; invalid rows; two and three
    products; in place over the activations (as the layer writes norm2); more tiles than
    CTAs (weight fragments and partial-sum slots reused across tiles)."""
    from layerbench.backends.wmma.linear import RESIDUAL_SUM, RESIDUAL_UPDATE, RowNorm, linear

    tile = [v.name for v in GEMM_TILES].index(tile_name)
    if n > GEMM_TILES[tile].cols:
        pytest.skip("the tile does not hold whole rows")
    device = torch.device("cuda")
    ext = build.load(device)
    out_dtype, with_lo, zero_invalid = NORM_MODES[mode]
    gen = torch.Generator(device=device).manual_seed(m * 31 + n * 7 + k)
    a = torch.randn(m, k, device=device, generator=gen)
    w = torch.randn(n, k, device=device, generator=gen) / math.sqrt(k)
    bias = torch.randn(n, device=device, generator=gen)
    residual = torch.randn(m, n, device=device, generator=gen) * 3 + 1
    valid = (torch.rand(m, device=device, generator=gen) > 0.25).to(torch.uint8)
    norm_w = torch.randn(n, device=device, generator=gen)
    norm_b = torch.randn(n, device=device, generator=gen)

    def split(t):
        hi = t.half()
        return hi, (t - hi.float()).half()
    for products, epilogue in ((3, RESIDUAL_UPDATE), (2, RESIDUAL_SUM)):
        a_pair, w_pair = split(a), split(w)
        if products == 2:
            w_pair = (w_pair[0], None)
        plain = torch.full((m, n), math.nan, device=device)
        linear(ext, a_pair, w_pair, bias, epilogue=epilogue, tile=tile, out=plain,
               residual=residual, valid_rows=valid)
        in_place = mode == "pair" and n == k  # norm2 over the context's own buffers
        if in_place:
            a_pair = (a_pair[0].clone(), a_pair[1].clone())
            out, lo = a_pair
        else:
            out = torch.full((m, n), math.nan, device=device).to(out_dtype)
            lo = torch.full((m, n), math.nan, device=device).half() if with_lo else None
        rows = torch.full((m, n), math.nan, device=device)
        linear(ext, a_pair, w_pair, bias, epilogue=epilogue, tile=tile,
               out=None if zero_invalid else rows, residual=residual, valid_rows=valid,
               norm=RowNorm(norm_w, norm_b, out, lo, zero_invalid))
        if not zero_invalid:
            assert torch.equal(rows, plain), "the fp32 rows change with the norm epilogue"
        x = plain.double()
        mean = x.mean(1, keepdim=True)
        y = (x - mean) / torch.sqrt(((x - mean) ** 2).mean(1, keepdim=True) + 1e-5)
        y = y * norm_w.double() + norm_b.double()
        if zero_invalid:
            y = torch.where(valid.bool()[:, None], y, 0)
        got = out.double() + (lo.double() if lo is not None else 0)
        # fp32 statistics of rows up to ~15 in magnitude; fp16 / bf16 rounding of the output.
        tol = {"pair": 3e-5, "hi": 1e-3, "final32": 3e-5, "final16": 1e-3,
               "final-bf16": 8e-3}[mode]
        err = ((got - y).abs() / y.abs().clamp_min(1.0)).nan_to_num(nan=math.inf).max().item()
        assert err <= tol, f"{products} products: error {err:.3g} > {tol} (scale max(|y|, 1))"
        if zero_invalid:
            assert torch.equal(got[valid == 0], torch.zeros_like(got[valid == 0]))


NORM_REFUSAL_SCRIPT = """
import torch
from layerbench.backends.wmma import build
from layerbench.backends.wmma.linear import HALF, RESIDUAL_SUM, RowNorm, linear
from layerbench.backends.wmma.tiles import STREAM_64x64, TILED_32x32
ext = build.load(torch.device("cuda"))
a = torch.zeros(32, 16, device="cuda", dtype=torch.float16)
w = torch.zeros(128, 16, device="cuda", dtype=torch.float16)
bias = torch.zeros(128, device="cuda")
res = torch.zeros(32, 128, device="cuda")
norm = RowNorm(bias, bias, torch.zeros(32, 128, device="cuda", dtype=torch.float16))
for tile, epilogue in ((TILED_32x32, RESIDUAL_SUM), (STREAM_64x64, RESIDUAL_SUM),
                       (STREAM_64x64, HALF)):
    try:
        linear(ext, (a, a), (w, w), bias, epilogue=epilogue, tile=tile, out=res,
               out_pair=(norm.out, None), residual=res, norm=norm)
        print("launched")
    except RuntimeError as exc:
        print("RuntimeError:", str(exc).splitlines()[0])
"""


def _child_stdout(script: str) -> str:
    """The stdout of script run by a child Python; fail where it exits nonzero or dies of a
    signal (a refusal whose message streamed a number once crashed in the extension's number
    formatting on the GPU machines: messages stream text only)."""
    import sys

    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, (f"the child exited with {run.returncode} (negative: killed by "
                                 f"that signal): {run.stderr}")
    return run.stdout


@needs_gpu
def test_norm_epilogue_refusals(wmma_selected):
    """The norm epilogue needs a stream tile holding whole rows (N <= its columns) and a
    residual epilogue; anything else raises, naming the reason (in a child process, as
    test_launch_errors_are_raised)."""
    lines = _child_stdout(NORM_REFUSAL_SCRIPT).splitlines()
    assert len(lines) == 3 and all(line.startswith("RuntimeError:") for line in lines), lines
    for line, reason in zip(lines, ("stream tile", "N <= the tile", "residual epilogue")):
        assert reason in line, line


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("number", [1, 7], ids=["d128", "d32"])
def test_fused_norms_match_separate(wmma_selected, number, dtype):
    """fuse_norms (the default) against the separate norm kernels on the same case: both keep
    the contract and agree within the strict preset; the fused plan does fuse here (400
    sequences of 48: enough rows for 64-row tiles to fill up to 300 SMs)."""
    from dataclasses import replace

    from layerbench.common.inputs import make_inputs
    from layerbench.common.shapes import CI
    from layerbench.reference import make_reference, reference_forward

    cfg = replace(CI[number].config, batch_size=400)
    model = make_reference(cfg, seed=5)
    x, mask = make_inputs(cfg, padding_ratio=0.25, seed=6, device="cuda", dtype=dtype)
    expected = reference_forward(model.to("cuda"), x.float(), mask)
    outs = []
    for fuse in (True, False):
        layer = WmmaBackend(fuse_norms=fuse, fuse_ffn=False).build(
            cfg, model.state_dict(), device="cuda", dtype=dtype)
        assert layer.plan.fuse_norms == fuse
        tiles = choose_tiles(cfg.batch_size * cfg.seq_len, cfg.d_model, cfg.ffn_dim,
                             cfg.head_dim, layer.multiprocessors, fuse_norms=fuse,
                             smem_limit=layer.smem_limit)
        assert tiles.norm_out_proj == tiles.norm_ffn_out == fuse
        with torch.no_grad():
            outs.append(layer(x, mask).clone())
        report = compare(outs[-1], expected)
        assert report.passed, f"fuse_norms={fuse}: {report.summary()}"
    report = compare(outs[0], outs[1].double(), preset="strict")
    assert report.passed, report.summary()


def _attention_context(kernel, qkv, valid, *, batch, seq_len, heads, causal):
    """The context [batch, seq_len, D] (hi + lo, fp32) of one attention call of kernel into
    NaN-filled outputs, or a skip where the kernel does not run on this device."""
    from layerbench.backends.wmma import attention as wmma_attention

    device = qkv.device
    ext = build.load(device)
    if kernel not in wmma_attention.kernel_names(ext, device):
        pytest.skip(f"{kernel}: the fragment-layout probe fails on this device")
    d = qkv.shape[1] // 3
    block_n = choose_tiles(1, d, d, d // heads, 1).attention_block_n
    ctx = (torch.full((batch * seq_len, d), math.nan, device=device).half(),
           torch.full((batch * seq_len, d), math.nan, device=device).half())
    wmma_attention.attention(ext, qkv, ctx, valid, batch=batch, seq_len=seq_len,
                             num_heads=heads, causal=causal, block_n=block_n, kernel=kernel)
    return (ctx[0].float() + ctx[1].float()).view(batch, seq_len, d)


def _attention_case(head_dim, causal, kernel, seq_len, batch=3, heads=2):
    """One attention call into NaN-filled outputs against fp32 attention. Sequence 0's first
    5 keys are invalid (causal: its rows 0-4 see no key), sequence 1 has a hole, sequence 2
    has no valid key at all: rows that see no key must be exactly 0."""
    device = torch.device("cuda")
    d = heads * head_dim
    gen = torch.Generator(device=device).manual_seed(head_dim * 1000 + seq_len)
    qkv = torch.randn(batch * seq_len, 3 * d, generator=gen, device=device).half()
    valid = torch.ones(batch, seq_len, dtype=torch.uint8, device=device)
    valid[0, :5] = 0
    valid[1, seq_len // 2:seq_len // 2 + 20] = 0
    valid[2] = 0
    got = _attention_context(kernel, qkv, valid, batch=batch, seq_len=seq_len, heads=heads,
                             causal=causal)
    expected = packed_attention(qkv, valid, batch=batch, seq_len=seq_len, heads=heads,
                                causal=causal)[0]
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-2)
    assert torch.equal(got[2], torch.zeros_like(got[2]))  # no valid key
    if causal:  # rows 0-4 of sequence 0 see only masked keys
        assert torch.equal(got[0, :5], torch.zeros_like(got[0, :5]))


ATTENTION_KERNELS = ("flash", "flash_w8", "flash_m64", "legacy")


@needs_gpu
@pytest.mark.parametrize("kernel", ATTENTION_KERNELS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("head_dim", [8, 24, 32, 40, 64, 72, 128, 136, 200, 256])
def test_attention_kernel(wmma_selected, head_dim, causal, kernel):
    """Every attention kernel against fp32 attention: every head-dim instance, exact and
    padded, causal and full, key masks, rows with no visible key."""
    _attention_case(head_dim, causal, kernel, seq_len=150)


@needs_gpu
@pytest.mark.parametrize("kernel", ATTENTION_KERNELS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("seq_len", [1, 17, 64, 129, 300])
@pytest.mark.parametrize("head_dim", [16, 64, 256])
def test_attention_kernel_lengths(wmma_selected, head_dim, seq_len, causal, kernel):
    """Sequences shorter than a block, exactly one key block, one past a query block, several."""
    _attention_case(head_dim, causal, kernel, seq_len=seq_len)


@needs_gpu
@pytest.mark.parametrize("kernel", ATTENTION_KERNELS)
@pytest.mark.parametrize("head_dim", [32, 64, 256])
def test_attention_rows_without_keys_ignore_masked_values(wmma_selected, head_dim, kernel):
    """A row that sees no key gives exactly 0 even where the masked keys' values are infinite
    (their products with probability 0 are NaN); causal, the first 5 keys masked."""
    device = torch.device("cuda")
    seq_len, heads = 150, 2
    d = heads * head_dim
    gen = torch.Generator(device=device).manual_seed(head_dim)
    qkv = torch.randn(seq_len, 3 * d, generator=gen, device=device).half()
    qkv[:5, 2 * d:] = math.inf  # V of the masked keys
    valid = torch.ones(1, seq_len, dtype=torch.uint8, device=device)
    valid[0, :5] = 0
    got = _attention_context(kernel, qkv, valid, batch=1, seq_len=seq_len, heads=heads,
                             causal=True)[0]
    assert torch.equal(got[:5], torch.zeros_like(got[:5]))


@needs_gpu
def test_attention_layout_probe(wmma_selected):
    """On sm_80 and sm_90 the fragment layout the flash kernels rely on holds, and the default
    kernel is a flash kernel (elsewhere the probe may fail, and legacy runs)."""
    from layerbench.backends.wmma import attention as wmma_attention

    device = torch.device("cuda")
    if torch.cuda.get_device_capability(device) not in ((8, 0), (9, 0)):
        pytest.skip("the layout is only asserted on sm_80 and sm_90")
    ext = build.load(device)
    assert wmma_attention.layout_mismatches(ext, device) == [0, 0, 0, 0]
    assert list(ext.attention_variants()) == list(wmma_attention.FLASH_VARIANTS)
    name = wmma_attention.attention_kernel_name(ext, device, head_dim=64, batch=32,
                                                seq_len=100000, num_heads=16)
    assert name.startswith("flash_attention_kernel<64,"), name


@needs_gpu
def test_mma_peak_computes_its_products(wmma_selected):
    """The ceiling kernel does every product it is timed for: per warp, its threads' sums add
    up to chains x iters x the sum of the 16x16 product of its fixed tile (float64)."""
    device = torch.device("cuda")
    ext = build.load(device)
    blocks, threads, iters = 3, 64, 5
    out = torch.full((blocks * threads,), math.nan, device=device)
    ext.mma_peak(out, blocks, threads, iters)
    tile = torch.tensor([(e % 7) * 1e-3 for e in range(256)]).half().double()
    a, b = tile.view(16, 16), tile.view(16, 16).T  # matrix_a row-major, matrix_b col-major
    expected = ext.mma_peak_chains() * iters * (a @ b).sum().item()
    per_warp = out.view(-1, 32).double().sum(1)
    assert torch.allclose(per_warp, torch.full_like(per_warp, expected), rtol=1e-4), \
        (per_warp.tolist(), expected)


LAUNCH_ERROR_SCRIPT = """
import torch
from layerbench.backends.wmma import build
ext = build.load(torch.device("cuda"))
a = torch.zeros(32, 16, device="cuda", dtype=torch.float16)
bias = torch.zeros(16, device="cuda")
qkv = torch.zeros(32, 48, device="cuda", dtype=torch.float16)
bad_calls = [
    lambda: ext.linear(a, None, a[:16], None, bias, 0, None, None, None, a, None, 99),
    lambda: ext.attention(qkv, a, a, None, 2, 16, 0, True, 0, 0),  # no heads
]
for call in bad_calls:
    try:
        call()
    except RuntimeError as exc:
        print("RuntimeError:", str(exc).splitlines()[0])
"""


@needs_gpu
def test_launch_errors_are_raised(wmma_selected):
    """A bad request raises a RuntimeError that names the problem (TORCH_CHECK), run in a
    child process so that a crash fails this test alone."""
    lines = _child_stdout(LAUNCH_ERROR_SCRIPT).splitlines()
    assert len(lines) == 2 and all(line.startswith("RuntimeError:") for line in lines), lines
    assert "unknown tile 99" in lines[0] and "heads must be" in lines[1], lines


def _layer_and_reference(cfg, seed=3, padding=0.25):
    from layerbench.common.inputs import make_inputs
    from layerbench.reference import make_reference, reference_forward

    model = make_reference(cfg, seed=seed)
    x, mask = make_inputs(cfg, padding_ratio=padding, seed=seed + 1, device="cuda")
    layer = WmmaBackend().build(cfg, model.state_dict(), device="cuda")
    expected = reference_forward(model.to("cuda"), x, mask)
    _layer_and_reference.model = model
    return layer, x, mask, expected


@needs_gpu
def test_streams_the_batch_in_chunks(wmma_selected):
    """One sequence per chunk gives the same output as the whole batch at once."""
    cfg = LayerConfig(3, 70, 64, 2, 96, 2)
    layer, x, mask, expected = _layer_and_reference(cfg)
    with torch.no_grad():
        whole = layer(x, mask).clone()
        layer.chunks.chunks[(3, 70)] = 1
        layer.graphed.graphs.clear()
        layer.graphed.seen.clear()
        streamed = layer(x, mask)
    assert torch.equal(whole, streamed)
    report = compare(streamed, expected)
    assert report.passed, report.summary()


@needs_gpu
@pytest.mark.parametrize("fuse_ffn", [True, False], ids=["ffn-block", "separate"])
def test_misaligned_fp32_input(wmma_selected, fuse_ffn):
    """fp32 input rows that start 4 bytes past a 16-byte boundary (a contiguous view) keep
    the contract with ffn_block and with the separate kernels."""
    cfg = LayerConfig(2, 40, 128, 4, 128, 2)
    _, x, mask, expected = _layer_and_reference(cfg)
    layer = WmmaBackend(fuse_ffn=fuse_ffn).build(cfg, _layer_and_reference.model.state_dict(),
                                                 device="cuda")
    shifted = torch.empty(x.numel() + 1, device="cuda")[1:].view_as(x)
    shifted.copy_(x)
    assert shifted.data_ptr() % 16 == 4
    with torch.no_grad():
        report = compare(layer(shifted, mask), expected)
    assert report.passed, report.summary()


MIXED_DEVICES_SCRIPT = """
import torch
from layerbench.backends.wmma import build
ext = build.load(torch.device("cuda", 0))
x = torch.randn(8, 32, device="cuda:0")
weight, bias = torch.ones(32, device="cuda:0"), torch.zeros(32, device="cuda:0")
hi = torch.empty(8, 32, device="cuda:1", dtype=torch.float16)
try:
    ext.norm_split(x, weight, bias, hi, None, None, 1e-5, False)
except RuntimeError as exc:
    print("RuntimeError:", str(exc).splitlines()[0])
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_bindings_refuse_tensors_on_two_devices(wmma_selected):
    """A binding given tensors on two devices raises, naming the tensor (a kernel would read
    the other device's memory at its address)."""
    lines = _child_stdout(MIXED_DEVICES_SCRIPT).splitlines()
    assert lines and lines[0].startswith("RuntimeError:") and "hi is on cuda:1" in lines[0], \
        lines


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_kernels_run_on_their_tensors_device_and_stream(wmma_selected):
    """The bindings launch on the tensors' device (a device guard) and on that device's
    current stream: norm_out, a linear and every attention kernel with their tensors on
    cuda:1 while cuda:0 is current and cuda:1's current stream is a side stream with pending
    work (a long sleep, then the copy of the input)."""
    from layerbench.backends.wmma import attention as wmma_attention
    from layerbench.backends.wmma.linear import HALF, linear
    from layerbench.backends.wmma.norm import LN_EPS, norm_out
    from layerbench.backends.wmma.tiles import TILED_32x32

    device = torch.device("cuda", 1)
    ext = build.load(device)
    gen = torch.Generator(device=device).manual_seed(11)
    x = torch.randn(37, 64, generator=gen, device=device)
    weight, bias = (torch.randn(64, generator=gen, device=device) for _ in range(2))
    w = torch.randn(48, 64, generator=gen, device=device).half()
    w_bias = torch.randn(48, generator=gen, device=device)
    batch, seq_len, heads, head_dim = 2, 70, 2, 32
    qkv_source = torch.randn(batch * seq_len, 3 * heads * head_dim, generator=gen,
                             device=device).half()
    kernels = wmma_attention.kernel_names(ext, device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.no_grad(), torch.cuda.device(device), torch.cuda.stream(side):
        rows, qkv = torch.zeros_like(x), torch.zeros_like(qkv_source)
        torch.cuda._sleep(50_000_000)
        rows.copy_(x)
        qkv.copy_(qkv_source)
        with torch.cuda.device(0):
            assert torch.cuda.current_device() == 0
            assert torch.cuda.current_stream(device) == side
            normed = torch.full_like(rows, math.nan)
            norm_out(ext, rows, weight, bias, normed, None)
            a = rows.half()
            y = torch.full((37, 48), math.nan, device=device).half()
            linear(ext, (a, None), (w, None), w_bias, epilogue=HALF, tile=TILED_32x32,
                   out_pair=(y, None))
            contexts = {kernel: _attention_context(kernel, qkv, None, batch=batch,
                                                   seq_len=seq_len, heads=heads, causal=True)
                        for kernel in kernels}
    side.synchronize()
    torch.testing.assert_close(
        normed, torch.nn.functional.layer_norm(x, (64,), weight, bias, LN_EPS),
        atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(y.float(), x.half().float() @ w.float().T + w_bias,
                               atol=2e-2, rtol=1e-2)
    expected = packed_attention(qkv_source, None, batch=batch, seq_len=seq_len, heads=heads,
                                causal=True)[0]
    for kernel, got in contexts.items():
        torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-2, msg=kernel)


@needs_gpu
def test_writes_into_out(wmma_selected):
    """With out= every element of out is written (it starts as NaN) and out is returned."""
    cfg = LayerConfig(2, 40, 128, 4, 128, 2)
    layer, x, mask, expected = _layer_and_reference(cfg)
    out = torch.full_like(x, math.nan)
    with torch.no_grad():
        result = layer(x, mask, out=out)
    assert result is out
    report = compare(out, expected)
    assert report.passed, report.summary()


def test_products_and_ffn_block_chosen_per_call():
    """Forwards above LARGE_CALL_TOKENS run large_call_products (and then keep the weights'
    lo parts); ffn_block runs only with one or two products and, by default, from half a wave
    to four waves of its 64-row blocks."""
    from layerbench.backends.wmma.layer import (LARGE_CALL_TOKENS, Plan, ffn_block_pays,
                                                workspace)

    plan = Plan(False, True, 2, ffn_auto=True, large_call_products=3)
    assert plan.products_for(LARGE_CALL_TOKENS) == 2
    assert plan.products_for(LARGE_CALL_TOKENS + 1) == 3
    assert plan.weight_products() == 3
    assert Plan(False, False, 1).products_for(10 ** 7) == 1
    assert Plan(False, False, 1).weight_products() == 1
    assert [ffn_block_pays(rows, 132) for rows in (4160, 4224, 8192, 33792, 33856)] == [
        False, True, True, True, False]
    assert plan.runs_ffn_block(8192, 132, 2)
    assert not plan.runs_ffn_block(8192, 132, 3)
    assert not plan.runs_ffn_block(2048, 132, 2)
    assert Plan(False, True, 2).runs_ffn_block(64, 132, 2)  # fuse_ffn=True: every call
    assert not Plan(False, False, 2).runs_ffn_block(8192, 132, 2)
    # The hidden-row buffers go only where every call runs ffn_block: not where forwards of
    # many tokens run three products through the separate kernels.
    cfg = LayerConfig(2, 16, 128, 4, 128, 1)
    assert "hidden_hi" not in workspace(cfg, Plan(False, True, 2))
    for needs_hidden in (plan, Plan(False, True, 2, large_call_products=3), Plan(False, False, 2)):
        assert "hidden_hi" in workspace(cfg, needs_hidden)


def test_attention_kernel_choice(monkeypatch):
    """flash_m64 where 128-row blocks leave multiprocessors idle, at head dims up to 32, and
    above 128 only where two of its blocks fit one multiprocessor's shared memory (sm_90's
    228 KB, not sm_80's 164 KB); flash otherwise."""
    from layerbench.backends.wmma import attention as wmma_attention

    shared = {("flash", 256): 135_000, ("flash_m64", 256): 101_384}

    class FakeExt:
        def attention_instance(self, variant, head_pad):
            kernel = wmma_attention.FLASH_VARIANTS[variant]
            return (kernel, head_pad, 0, 0, 0, shared.get((kernel, head_pad), 40_000))

    per_sm = {}
    monkeypatch.setattr(wmma_attention, "layout_ok", lambda ext, device: True)
    monkeypatch.setattr(wmma_attention, "multiprocessor_count", lambda device: 132)
    monkeypatch.setattr(wmma_attention, "max_shared_memory_per_block", lambda device: 227 * 1024)
    monkeypatch.setattr(wmma_attention, "shared_memory_per_multiprocessor",
                        lambda device: per_sm["bytes"])

    def choose(head_dim, batch=64, seq_len=1024):
        return wmma_attention.choose_kernel(FakeExt(), torch.device("cuda"), batch=batch,
                                            seq_len=seq_len, num_heads=4, head_dim=head_dim)

    per_sm["bytes"] = 228 * 1024  # sm_90
    assert [choose(hd) for hd in (32, 64, 128, 256)] == ["flash_m64", "flash", "flash",
                                                         "flash_m64"]
    assert choose(64, batch=1, seq_len=128) == "flash_m64"  # 4 blocks: most SMs idle
    per_sm["bytes"] = 164 * 1024  # sm_80
    assert [choose(hd) for hd in (32, 64, 128, 256)] == ["flash_m64", "flash", "flash", "flash"]
    per_sm["bytes"] = None  # unknown: no flash_m64 on the shared-memory argument
    assert choose(256) == "flash"


# Shared memory per block at head_pad 128 (attention.cu's layout and FlashCfg): the legacy
# kernel (key block 64), the 128-row flash variants and flash_m64.
LEGACY_128, FLASH_128, FLASH_M64_128 = 112_896, 104_464, 87_056


def test_attention_kernel_within_99kb_of_shared_memory(monkeypatch):
    """On a device of 99 KB of shared memory per block (sm_86, sm_89) at head_pad 128, where
    neither the 128-row flash blocks nor the legacy kernel fit, choose_kernel takes
    flash_m64, which fits; the build refuses only where the layout probe fails (the legacy
    kernel would then run), naming the bytes."""
    from layerbench.backends.wmma import attention as wmma_attention

    class FakeExt:
        def attention_instance(self, variant, head_pad):
            kernel = wmma_attention.FLASH_VARIANTS[variant]
            return (kernel, head_pad, 0, 0, 0,
                    FLASH_M64_128 if kernel == "flash_m64" else FLASH_128)

        def attention_smem_bytes(self, head_pad, block_n):
            return LEGACY_128

    probe = {"ok": True}
    monkeypatch.setattr(wmma_attention, "layout_ok", lambda ext, device: probe["ok"])
    monkeypatch.setattr(wmma_attention, "multiprocessor_count", lambda device: 128)
    monkeypatch.setattr(wmma_attention, "max_shared_memory_per_block", lambda device: 99 * 1024)
    monkeypatch.setattr(wmma_attention, "shared_memory_per_multiprocessor",
                        lambda device: 100 * 1024)
    device = torch.device("cuda")
    assert wmma_attention.choose_kernel(FakeExt(), device, batch=64, seq_len=1024, num_heads=8,
                                        head_dim=128) == "flash_m64"
    assert wmma_attention.shared_memory_refusal(FakeExt(), device, 128, 64) is None
    probe["ok"] = False
    assert wmma_attention.choose_kernel(FakeExt(), device, batch=64, seq_len=1024, num_heads=8,
                                        head_dim=128) == "legacy"
    refusal = wmma_attention.shared_memory_refusal(FakeExt(), device, 128, 64)
    assert refusal and str(LEGACY_128) in refusal and str(99 * 1024) in refusal
    monkeypatch.setattr(wmma_attention, "max_shared_memory_per_block", lambda device: 227 * 1024)
    assert wmma_attention.shared_memory_refusal(FakeExt(), device, 128, 64) is None


@needs_gpu
def test_attention_shared_bytes_as_the_cpu_tests_assume(wmma_selected):
    """The shared-memory figures test_attention_kernel_within_99kb_of_shared_memory assumes
    are the extension's."""
    from layerbench.backends.wmma import attention as wmma_attention

    ext = build.load(torch.device("cuda"))
    assert wmma_attention.shared_bytes(ext, 128, 64) == LEGACY_128
    for kernel in ("flash", "flash_w8"):
        assert wmma_attention.instance(ext, kernel, 128)[5] == FLASH_128
    assert wmma_attention.instance(ext, "flash_m64", 128)[5] == FLASH_M64_128


PLANS = [(True, False, True, 3), (True, True, True, 2), (False, False, True, None),
         (False, False, False, 2), (False, False, True, 1), (False, True, True, None),
         (False, True, True, 1), (False, True, True, 3)]


@needs_gpu
@pytest.mark.parametrize("fuse_qkv,fuse_ffn,fuse_norms,products", PLANS,
                         ids=["fused-qkv", "fused-qkv-ffn", "default", "separate-norms-2-products",
                              "one-product", "fused-ffn", "fused-ffn-one-product",
                              "fused-ffn-three-products"])
@pytest.mark.parametrize("number", [1, 7, 8], ids=["d128", "d32", "d1024"])
def test_plans_pass(wmma_selected, number, fuse_qkv, fuse_ffn, fuse_norms, products):
    """Every combination of the fused kernels, norm epilogues and linear products keeps the
    contract on the same case (ffn_block only where whole rows fit its tile)."""
    from layerbench.common.shapes import CI

    cfg = CI[number].config
    _, x, mask, expected = _layer_and_reference(cfg)
    layer = WmmaBackend(fuse_qkv, fuse_ffn, products, fuse_norms).build(
        cfg, _layer_and_reference.model.state_dict(), device="cuda")
    # ffn_block computes one or two products; with three the separate kernels run.
    assert layer.plan.fuse_ffn == (fuse_ffn and cfg.d_model <= 128
                                   and layer.plan.linear_products <= 2)
    with torch.no_grad():
        report = compare(layer(x, mask), expected)
    assert report.passed, report.summary()


@needs_gpu
@pytest.mark.parametrize("in_registers", [False, True], ids=["loop", "registers"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("rows,cols,offset", [(5, 8, 0), (37, 132, 0), (64, 1024, 0),
                                              (3, 1000, 0), (9, 1028, 0), (4, 6, 0),
                                              (7, 128, 1), (2, 1024, 2)])
def test_norm_split_kernels(wmma_selected, rows, cols, offset, dtype, in_registers):
    """norm_split (either kernel; the row-in-registers one where D and the alignment allow,
    the loop elsewhere: D not a multiple of 4, above 1024, or x offset by an element) writes
    the fp16 (hi, lo) parts of LayerNorm and the fp32 copy into NaN-filled outputs, and hi
    alone where lo is not asked for."""
    from layerbench.backends.wmma.norm import LN_EPS, norm_split

    device = torch.device("cuda")
    ext = build.load(device)
    gen = torch.Generator(device=device).manual_seed(rows * 7 + cols)
    storage = torch.randn(rows * cols + offset, generator=gen, device=device).to(dtype)
    x = storage[offset:].view(rows, cols)
    weight = torch.randn(cols, generator=gen, device=device)
    bias = torch.randn(cols, generator=gen, device=device)
    xd = x.double()
    mean = xd.mean(1, keepdim=True)
    expected = ((xd - mean) / torch.sqrt(xd.var(1, unbiased=False, keepdim=True) + LN_EPS)
                * weight.double() + bias.double())
    for with_lo in (True, False):
        hi = torch.full((rows, cols), math.nan, device=device).half()
        lo = torch.full((rows, cols), math.nan, device=device).half() if with_lo else None
        copy = torch.full((rows, cols), math.nan, device=device)
        norm_split(ext, x, weight, bias, (hi, lo), copy=copy, in_registers=in_registers)
        assert torch.equal(copy, x.float())
        got = hi.double() + (lo.double() if with_lo else 0)
        tol = 1e-5 if with_lo else 1e-3  # hi alone: fp16 rounding of y
        torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


@needs_gpu
@pytest.mark.parametrize("products", [2, 3])
@pytest.mark.parametrize("stream_tile", ["stream 128x128 8w resident", "stream 64x128 8w",
                                         "stream 32x128 4w"])
def test_stream_tiles_pass(wmma_selected, stream_tile, products):
    """Each stream variant that may replace the 16-warp 128x128 one keeps the contract on a
    layer with enough rows to take it (sequences of 1024 rows, enough for more than two
    128-row tiles an SM): Q/K/V, ffn_in and out_proj with its norm epilogue run on it,
    ffn_out (K = 512) on a tiled variant."""
    from layerbench.common.cuda_host import multiprocessor_count

    sms = multiprocessor_count(torch.device("cuda"))
    cfg = LayerConfig(2 * sms * 128 // 1024 + 2, 1024, 128, 4, 512, 2)
    _, x, mask, expected = _layer_and_reference(cfg)
    layer = WmmaBackend(linear_products=products, stream_tile=stream_tile).build(
        cfg, _layer_and_reference.model.state_dict(), device="cuda")
    tiles = choose_tiles(cfg.batch_size * cfg.seq_len, 128, 512, 32, sms, fuse_norms=True,
                         products=products, stream_tile=layer.plan.stream_tile)
    assert GEMM_TILES[tiles.qkv].name == stream_tile and tiles.norm_out_proj
    assert tiles.out_proj == layer.plan.stream_tile
    with torch.no_grad():
        report = compare(layer(x, mask), expected)
    assert report.passed, report.summary()


@needs_gpu
@pytest.mark.parametrize("products", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("cfg", [LayerConfig(3, 37, 40, 5, 24, 2), LayerConfig(2, 70, 64, 2, 96, 3),
                                 LayerConfig(1, 130, 128, 4, 128, 1),
                                 LayerConfig(5, 29, 128, 8, 72, 2, causal=False)],
                         ids=["d40-f24", "d64-f96", "one-block-130-rows", "full-f72"])
def test_ffn_block_widths_and_rows(wmma_selected, cfg, dtype, products):
    """ffn_block on widths that are not multiples of 16, row counts that are not multiples of
    its 64-row blocks, non-causal attention and fp16 input keeps the contract, and writes
    every output element (out starts as NaN)."""
    layer, report = _contract_into_nan_buffer(
        WmmaBackend(fuse_ffn=True, linear_products=products), cfg, 11, 0.25, dtype)
    assert layer.plan.fuse_ffn
    assert report.passed, report.summary()


def _contract_into_nan_buffer(backend, cfg, seed, padding, dtype=torch.float32):
    """(layer, contract report) of backend's layer for cfg run into a NaN-filled out= buffer
    against the strict reference, on seeded inputs."""
    from layerbench.common.inputs import make_inputs
    from layerbench.reference import make_reference, reference_forward

    model = make_reference(cfg, seed=seed)
    x, mask = make_inputs(cfg, padding_ratio=padding, seed=seed + 1, device="cuda", dtype=dtype)
    layer = backend.build(cfg, model.state_dict(), device="cuda", dtype=dtype)
    expected = reference_forward(model.to("cuda"), x.float(), mask)
    out = torch.full_like(x, math.nan)
    with torch.no_grad():
        layer(x, mask, out=out)
    return layer, compare(out, expected)


@needs_gpu
@pytest.mark.parametrize("fuse_ffn", [True, False], ids=["ffn-block", "separate"])
@pytest.mark.parametrize("cfg", [
    LayerConfig(2, 40, 136, 17, 520, 2), LayerConfig(2, 33, 264, 33, 24, 2),
    LayerConfig(1, 17, 1032, 129, 4104, 1), LayerConfig(2, 17, 8, 1, 8, 2),
    LayerConfig(1, 1, 128, 4, 128, 2), LayerConfig(3, 2, 64, 8, 64, 2),
    LayerConfig(1, 2, 8192, 32, 16384, 1), LayerConfig(2, 200, 512, 2, 1536, 2, causal=False)],
    ids=["d136-h17", "d264-f24", "d1032-f4104", "d8-f8", "one-token", "two-tokens",
         "d8192-f16384", "hd256-full"])
def test_configs_off_the_official_list(wmma_selected, cfg, fuse_ffn):
    """Widths that are multiples of 8 but not of 16 or 64, head dim 8 with many heads, one-
    and two-token sequences, d_model 8 and 8192: the contract holds with and without
    ffn_block, and every output element is written (out starts as NaN)."""
    _, report = _contract_into_nan_buffer(WmmaBackend(fuse_ffn=fuse_ffn), cfg, 21, 0.3)
    assert report.passed, report.summary()


@needs_gpu
def test_deep_stack_on_stream_tiles(wmma_selected):
    """Twelve blocks of 16384 rows at d_model 128: Q/K/V at three products on a stream tile
    and ffn_out's norm epilogue writing the next block's norm1 as a pair keep the contract."""
    from layerbench.common.cuda_host import multiprocessor_count

    cfg = LayerConfig(128, 128, 128, 4, 128, 12)
    sms = multiprocessor_count(torch.device("cuda"))
    layer, report = _contract_into_nan_buffer(WmmaBackend(), cfg, 31, 0.25)
    plan = layer.plan
    tiles = choose_tiles(cfg.tokens, 128, 128, 32, sms, fuse_norms=True,
                         products=plan.linear_products, stream_tile=plan.stream_tile,
                         qkv_products=plan.qkv_products)
    assert plan.qkv_products == 3 and plan.linear_products == 3
    assert GEMM_TILES[tiles.qkv].kind == "stream" and tiles.norm_ffn_out
    assert report.passed, report.summary()


@needs_gpu
@pytest.mark.parametrize("number", [1, 8], ids=["d128", "d1024"])
def test_masks_of_no_and_every_token(wmma_selected, number):
    """A mask with no valid token gives zeros everywhere; an all-true mask gives the output
    of mask=None within the strict preset, and both keep the contract. The rows are drawn
    without padding: a padded row is zero, and a zero row taken as valid leaves a residual
    stream so small that the final norm magnifies every rounding past the contract at one
    product (the README's margin, `bench/depth_study.py --zero-rows-valid`)."""
    from layerbench.common.shapes import CI
    from layerbench.reference import reference_forward

    cfg = CI[number].config
    layer, x, _, _ = _layer_and_reference(cfg, padding=0.0)
    model = _layer_and_reference.model.to("cuda")
    none = torch.zeros(x.shape[:2], dtype=torch.bool, device="cuda")
    every = torch.ones_like(none)
    with torch.no_grad():
        assert torch.equal(layer(x, none), torch.zeros_like(x))
        with_mask, without = layer(x, every).clone(), layer(x, None)
    assert compare(with_mask, without, "strict").passed
    report = compare(with_mask, reference_forward(model, x, every))
    assert report.passed, report.summary()


@needs_gpu
def test_first_call_inside_a_callers_capture(wmma_selected):
    """A layer whose first call is captured into the caller's own CUDA graph (the build asked
    the device what that call would ask) replays it: the contract holds on the replay, and
    again on new input values in the same buffers."""
    cfg = LayerConfig(2, 40, 128, 4, 128, 2)
    layer, x, mask, expected = _layer_and_reference(cfg)
    first = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad():
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            out = layer(x, mask)
        graph.replay()
        report = compare(out, expected)
        assert report.passed, report.summary()
        x.copy_(torch.randn_like(x))
        graph.replay()
        want = WmmaBackend().build(cfg, _layer_and_reference.model.state_dict(),
                                   device="cuda")(x, mask)
    assert torch.equal(out, want)
    assert not torch.equal(x, first)


class _LaunchSettings:
    """The extension, recording each set_programmatic_launches call."""

    def __init__(self, ext):
        self._ext, self.calls = ext, []

    def set_programmatic_launches(self, on):
        self.calls.append(on)
        return self._ext.set_programmatic_launches(on)

    def __getattr__(self, name):
        return getattr(self._ext, name)


@needs_gpu
@pytest.mark.parametrize("number,fuse_ffn", [(1, True), (1, False), (7, True), (8, False)],
                         ids=["d128-ffn-block", "d128-separate", "d32-ffn-block", "d1024"])
def test_programmatic_launches_give_the_same_bits(wmma_selected, number, fuse_ffn):
    """With pdl (each forward kernel a programmatic dependent of the one before it) the layer
    turns the launch setting on around its forward and back after it, and gives the bits of
    ordinary launches, eager, captured and replayed, within the contract. Two inputs take
    turns in the same buffer, so a kernel reading rows before the one before it has written
    them (stale from the previous forward) shows."""
    from layerbench.common.shapes import CI

    if torch.cuda.get_device_capability()[0] < 9:
        with pytest.raises(Unsupported, match="sm_90"):
            WmmaBackend(pdl=True).build(CI[number].config, {}, device="cuda")
        return
    cfg = CI[number].config
    _, x, mask, expected = _layer_and_reference(cfg)
    state = _layer_and_reference.model.state_dict()
    plain = WmmaBackend(fuse_ffn=fuse_ffn, pdl=False).build(cfg, state, device="cuda")
    layer = WmmaBackend(fuse_ffn=fuse_ffn, pdl=True).build(cfg, state, device="cuda")
    assert layer.plan.pdl and not plain.plan.pdl
    assert WmmaBackend(pdl=None).build(cfg, state, device="cuda").plan.pdl
    layer.ext = plain.ext = _LaunchSettings(layer.ext)
    inputs = (x.clone(), torch.randn_like(x))
    with torch.no_grad():
        wants = []
        for data in inputs:
            x.copy_(data)
            wants.append(plain(x, mask).clone())
        # The plain layer (eager, then captured): each forward sets off and restores off.
        plain_calls = len(layer.ext.calls)
        assert plain_calls >= 4 and layer.ext.calls == [False] * plain_calls
        for turn in range(4):  # eager, captured, replayed twice
            x.copy_(inputs[turn % 2])
            got = layer(x, mask)
            assert torch.equal(got, wants[turn % 2]), turn
            if turn % 2 == 0:
                report = compare(got, expected)
                assert report.passed, report.summary()
    assert layer.graphed.graphs
    # eager and the capture set it on and restore off; the replays launch nothing
    calls = layer.ext.calls[plain_calls:]
    assert calls == [True, False] * (len(calls) // 2)
    assert len(calls) >= 4


@needs_gpu
@pytest.mark.parametrize("products", [1, 2, 3])
@pytest.mark.parametrize("m,n,k", [(16500, 1030, 200), (8192, 1024, 1024), (300, 24, 1032)],
                         ids=["odd-many-tiles", "shape8-out-proj", "few-tiles"])
def test_persistent_tile_matches_the_pipelined_one(wmma_selected, m, n, k, products):
    """The persistent pipelined tile (CTAs taking several tiles in turn, the next tile's loads
    under the epilogue) writes the bits of the one-tile-per-CTA pipelined tile, every element
    of NaN-filled outputs, with each epilogue and product count, on sizes that are not
    multiples of the tile and grids of more tiles than resident CTAs."""
    from bench.wmma_sweep import gemm_operands
    from layerbench.backends.wmma.linear import (GELU_PAIR, HALF, RESIDUAL_SUM, RESIDUAL_UPDATE,
                                                 linear)
    from layerbench.backends.wmma.tiles import (TILED_128x128_BK64_PERSISTENT,
                                                TILED_128x128_BK64_PIPELINED)

    device = torch.device("cuda")
    ext = build.load(device)
    gen = torch.Generator(device=device).manual_seed(m + n + k + products)
    a, w, bias, residual, valid = gemm_operands(m, n, k, products, device, gen)

    def run(tile, epilogue):
        nan = torch.full((m, n), math.nan, device=device)
        if epilogue in (HALF, GELU_PAIR):
            pair = (nan.half(), nan.half() if epilogue == GELU_PAIR else None)
            linear(ext, a, w, bias, epilogue=epilogue, tile=tile, out_pair=pair)
            return [t for t in pair if t is not None]
        linear(ext, a, w, bias, epilogue=epilogue, tile=tile, out=nan, residual=residual,
               valid_rows=valid)
        return [nan]

    for epilogue in (HALF, GELU_PAIR, RESIDUAL_UPDATE, RESIDUAL_SUM):
        want = run(TILED_128x128_BK64_PIPELINED, epilogue)
        got = run(TILED_128x128_BK64_PERSISTENT, epilogue)
        for g, e in zip(got, want):
            assert not g.isnan().any(), f"epilogue {epilogue}: unwritten elements"
            assert torch.equal(g, e), f"epilogue {epilogue}: differs from the pipelined tile"


def test_programmatic_launch_setting_is_restored(wmma_selected):
    """The layer's launch-setting context turns the setting on for its block and restores
    the previous one after it, also when the block raises."""
    from layerbench.backends.wmma.layer import programmatic_launches

    class Ext:
        on = False

        def set_programmatic_launches(self, on):
            previous, self.on = self.on, on
            return previous

    ext = Ext()
    with programmatic_launches(ext, True):
        assert ext.on
        with programmatic_launches(ext, False):
            assert not ext.on
        assert ext.on
    assert not ext.on
    with pytest.raises(RuntimeError), programmatic_launches(ext, True):
        raise RuntimeError("a launch failed")
    assert not ext.on
