"""cupy-specific cases: every kernel instantiation compiles with NVRTC for sm_80 and sm_90a
(also without a GPU) to mma.sync and ldmatrix, or wgmma, without spills (attention at head
dim 256 exempt) and within its blocks-per-SM register budget, the host packs exactly the
parameters each compiled kernel takes, the toolkit headers are found or refused clearly, the
wgmma attention and GEMM variants are chosen by name and their schedules (models of the
attention kernels' buffers and of the GEMM's K-tile stages) never overwrite a buffer a pending
wgmma may read, the layer's launch sequence (with and without fused norms, with a GEMM
variant, with the norms in the GEMMs' prologues) computes the layer through PyTorch
stand-ins, and (on a GPU) LayerNorm and the GEMMs (every GEMM variant, the residual_norm
epilogue too) against fp64, the norm-prologue GEMM against layer_norm and the plain GEMM,
attention (every wgmma variant) against the fp32 oracle, and the layer eager and replayed."""
from __future__ import annotations

import itertools
import math
import re
from dataclasses import replace

import numpy as np
import pytest
import torch

from layerbench.backends.cupy import build, ops, tensor_maps
from layerbench.backends.cupy import layer as layer_module
from layerbench.backends.cupy.layer import linear_products_for
from layerbench.common.config import LayerConfig
from layerbench.common.contract import compare
from layerbench.common.cuda_host import cubin_kernels, key_info, split_fp16, weight_pair
from layerbench.common.errors import Unsupported
from layerbench.common.inputs import make_inputs
from layerbench.common.params import pack_params
from layerbench.reference import make_reference, packed_attention, reference_forward

import background
from standins import _norm, _norm_rows, _pair, _products, _residual

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def nvrtc_missing() -> str | None:
    """Why cuda-python's NVRTC cannot run here, or None."""
    try:
        from cuda.bindings import nvrtc
        nvrtc.nvrtcVersion()
    except Exception as exc:  # noqa: BLE001 - any failure to load NVRTC is a reason to skip
        return f"NVRTC is not usable here: {exc}"
    try:
        build.cuda_include()
    except Unsupported as exc:
        return str(exc)
    return None


@pytest.fixture(scope="session")
def compiled(tmp_path_factory):
    """arch -> (cubin path, name expression -> symbol), the module compiled by NVRTC."""
    why = nvrtc_missing()
    if why:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("cupy-cubins")
    out = {}
    # started at collection by conftest.py where the session needs it
    compiled_arches = background.result(background.CUPY_NVRTC,
                                        build.compile_every_arch_with_nvrtc)
    for arch, (cubin, lowered) in compiled_arches.items():
        path = root / f"sm_{arch}.cubin"
        path.write_bytes(cubin)
        out[arch] = (path, lowered)
    return out


@pytest.mark.parametrize("arch", build.ARCHES)
def test_every_kernel_compiles(cupy_selected, compiled, arch):
    """Every name expression of the module is a kernel of the cubin NVRTC made for arch (an
    error or a warning in the sources fails the compile)."""
    path, lowered = compiled[arch]
    symbols = set(cubin_kernels(path))
    assert set(lowered) == set(build.name_expressions(arch))
    assert set(lowered.values()) <= symbols


def test_sources_have_no_generic_lambdas(cupy_selected):
    """No kernel source has a generic lambda (a parameter declared auto): NVRTC 13.0 crashed
    with a segmentation fault compiling them in the wgmma attention kernel, where 13.5 did
    not."""
    generic = re.compile(r"\[[^\]]*\]\s*\([^)]*\bauto\b")
    for path in build.source_files():
        hits = [n for n, line in enumerate(path.read_text().splitlines(), 1)
                if generic.search(line)]
        assert not hits, f"{path.name}: generic lambda on lines {hits}"
    assert generic.search("auto f = [&](auto count, int x) {")


@pytest.fixture(scope="session")
def hopper_sass(compiled):
    """(kernel -> SASS text, kernel -> bench.sass.kernels row) of the sm_90a module, read once
    for the tests below."""
    from bench.sass import functions, kernels

    path, _ = compiled[build.HOPPER]
    bodies = functions(path)
    return bodies, kernels(path, bodies)


def register_budget(name: str) -> int:
    """The most registers a thread of kernel name may hold: 255, or for a wgmma attention
    variant 65536 / (its blocks an SM x its threads): 128 for two blocks of 256 threads,
    170 (ptxas: 168) for the TMA ring's one block of 384; for a GEMM variant of two blocks an
    SM, 65536 / (2 x its threads): 113 (ptxas: 112) for two blocks of 288."""
    for hp, variants in build.ATTENTION_WGMMA.items():
        for v in variants:
            if name == build.attention_wgmma_name(hp, v):
                return min(255, 65536 // (v.min_blocks * v.threads))
    for v in build.GEMM_VARIANTS:
        names = {build.gemm_variant_name(v, build.GEMM_VARIANT_PRODUCTS, e)
                 for e in build.GEMM_VARIANT_EPILOGUES}
        if v.blocks_per_sm > 1 and name in names:
            return 65536 // (v.blocks_per_sm * v.threads)
    return 255


def test_sm90_sass(cupy_selected, compiled, hopper_sass):
    """sm_90a SASS: HGMMA (wgmma) in every Hopper GEMM and attention variant, HMMA (mma.sync)
    and LDSM (ldmatrix) in every other GEMM and attention kernel, no local memory in any but
    attention at head dim 256, no 2-byte global loads, registers within 255 and, for two
    blocks an SM, within 128 a thread."""
    _, lowered = compiled[build.HOPPER]
    rows = hopper_sass[1]
    for name, symbol in lowered.items():
        row = rows[symbol]
        assert row["load16"] == 0, (name, row)
        assert row["registers"] <= register_budget(name), (name, row)
        if "flash_attention<256" not in name:
            assert row["spill_stores"] == 0 and row["stack_bytes"] == 0, (name, row)
        if "wgmma" in name:
            assert row["HGMMA"] > 0, (name, row)
        elif "layer_norm" not in name:
            assert row["HMMA"] > 0 and row["LDSM"] > 0, (name, row)


def test_every_kernel_waits_for_the_one_before_it(cupy_selected, compiled, hopper_sass):
    """Every sm_90a kernel waits for the kernel before it (griddepcontrol.wait: ACQBULK) and
    lets the next one launch (PREEXIT), as programmatic dependent launches need; the sm_80
    module has neither (start_after_previous compiles to nothing there). Only the whole-block
    and after-attention kernels touch global memory before the wait, and only by copying
    weights to shared memory (LDGSTS), which no kernel writes."""
    from bench.sass import functions, global_before_wait, kernels

    _, lowered = compiled[build.HOPPER]
    bodies, rows = hopper_sass
    for name, symbol in lowered.items():
        assert rows[symbol]["dependency_wait"] >= 1, (name, rows[symbol])
        assert rows[symbol]["dependents_launch"] >= 1, (name, rows[symbol])
        weights_first = name.startswith(("lb::whole_block<", "lb::after_attention<"))
        allowed = ("LDGSTS",) if weights_first else ()
        assert global_before_wait(bodies[symbol], allowed) == 0, name  # nothing global first
    path, _ = compiled["80"]
    for symbol, row in kernels(path, functions(path)).items():
        assert row["dependency_wait"] == 0 and row["dependents_launch"] == 0, (symbol, row)


def test_residual_gemms_prefetch_their_residual_tile(cupy_selected, compiled, hopper_sass):
    """The wgmma GEMMs with a residual epilogue (linear_wgmma's RESIDUAL and RESIDUAL_NORM,
    linear_wgmma_tma's RESIDUAL) ask L2 for their residual tile (CCTL.E.PF2:
    prefetch.global.L2); the others do not."""
    _, lowered = compiled[build.HOPPER]
    bodies = hopper_sass[0]
    residual = (build.EPILOGUES["residual"], build.EPILOGUES["residual_norm"])
    checked = 0
    for name, symbol in lowered.items():
        plain = re.fullmatch(r"lb::linear_wgmma<\d+, \d+, \d+, (\d), \d+, \d+>", name)
        tma = re.fullmatch(r"lb::linear_wgmma_tma<\d+, (\d), \d+, \d+>", name)
        if plain or tma:
            prefetches = len(re.findall(r"\bCCTL\.E\.PF2\b", bodies[symbol]))
            assert (prefetches > 0) == (int((plain or tma).group(1)) in residual), (name,
                                                                                 prefetches)
            checked += 1
    assert checked >= 20


def attention_hgmma_widths(body: str) -> tuple[list[str], list[str]]:
    """The N of each SS HGMMA (Q K^T, both operands by descriptor) and each RS one (P V, A in
    registers, V transposed) in an attention kernel's SASS, in order."""
    ss = re.findall(r"\bHGMMA\.64x(\d+)x16\.F32 R\d+, gdesc\[UR\d+\], (?:RZ|R\d+)", body)
    rs = re.findall(r"\bHGMMA\.64x(\d+)x16\.F32 R\d+, R\d+, gdesc\[UR\d+\]\.tnspB", body)
    return ss, rs


def test_attention_wgmma_plain_sass(cupy_selected, compiled, hopper_sass):
    """sm_90a SASS of every flash_attention_wgmma variant on the plain schedule (head dim 256
    among them): S = Q K^T as HP / 16 SS wgmmas (HGMMA.64xBKVx16 on two descriptors) and
    O += P V as BKV / 16 RS ones of n = HP (registers, then V's descriptor, .tnspB: at 256
    HGMMA.64x256x16), no other wgmma; no local memory (no LDL/STL, stack 0)."""
    _, lowered = compiled[build.HOPPER]
    bodies, rows = hopper_sass
    plain = [(hp, v) for hp, vs in build.ATTENTION_WGMMA.items() for v in vs
             if not (v.tma or v.pipelined)]
    assert (256, build.WGMMA_HD256) in plain and (256, build.WGMMA_HD256_ONE_GROUP) in plain
    for hp, v in plain:
        symbol = lowered[build.attention_wgmma_name(hp, v)]
        body, row = bodies[symbol], rows[symbol]
        name = f"{v.name} at {hp}"
        ss, rs = attention_hgmma_widths(body)
        assert ss == [str(v.bkv)] * (hp // 16), (name, ss)
        assert rs == [str(hp)] * (v.bkv // 16), (name, rs)
        assert len(re.findall(r"\bHGMMA\b", body)) == len(ss) + len(rs), name
        assert not re.search(r"\b(LDL|STL)\b", body), name
        assert row["stack_bytes"] == 0 and row["spill_stores"] == 0, (name, row)


def test_gemm_variants_sass(cupy_selected, compiled, hopper_sass):
    """sm_90a SASS of every wgmma GEMM variant's kernels: wgmma of the tile's width
    (HGMMA.64xBNx16), one wgmma fence (WARPGROUP.ARRIVE) per K tile as written, and the
    waits the source has, no more: wait<PENDING> in the loop, wait 0 after it where PENDING
    (ptxas serialising the wgmmas would add fences and waits of 0); no local memory. The
    warp-specialised ones also: setmaxnreg to 40 (producer) and 232 (consumers) registers
    (USETMAXREG), mbarrier waits and arrives (SYNCS), one block barrier (BAR.SYNC, after the
    mbarriers' initialisation); the others none of these. The cp.async ones (linear_wgmma,
    linear_wgmma_ws) copy with LDGSTS and no TMA; the TMA ones (linear_wgmma_tma) with two
    2-D TMA loads (UTMALDG.2D, A and W) and no LDGSTS, prefetch both tensor maps
    (UTMACCTL.PF) and arrive with transaction bytes (SYNCS.ARRIVE.TRANS64 with a byte-count
    register, the consumers' plain arrives A1T0); at two blocks an SM, without setmaxnreg
    (no USETMAXREG) and in at most 112 registers (two blocks of 288 threads)."""
    _, lowered = compiled[build.HOPPER]
    bodies = hopper_sass[0]
    for v in build.GEMM_VARIANTS:
        for epilogue in build.GEMM_VARIANT_EPILOGUES:
            body = bodies[lowered[build.gemm_variant_name(v, 1, epilogue)]]
            name = f"{v.name} {epilogue}"
            hgmma = re.findall(r"\bHGMMA\.(\d+)x(\d+)x16\.F32\b", body)
            assert hgmma and set(hgmma) == {("64", str(v.bn))}, (name, set(hgmma))
            assert len(hgmma) == 4, (name, len(hgmma))  # BK / 16 k16 steps, one loop body
            assert len(re.findall(r"WARPGROUP\.ARRIVE", body)) == 1, name
            waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x\d)", body)
            assert waits == ([f"0x{v.pending}", "0x0"] if v.pending else ["0x0"]), (name, waits)
            assert not re.search(r"\b(LDL|STL)\b", body), name  # no local memory
            if v.tma:  # TMA copies only, issued by one thread
                assert len(re.findall(r"\bUTMALDG\.2D\b", body)) == 2, name
                assert len(re.findall(r"\bUTMACCTL\.PF\b", body)) == 2, name
                assert re.search(r"\bSYNCS\.ARRIVE\.TRANS64 RZ, \[[^\]]+\], R\d+", body), name
                assert "LDGSTS" not in body, name
            else:
                assert "LDGSTS" in body and "UTMA" not in body, name
            if v.warp_specialised or v.tma:  # registers moved between the roles, mbarriers,
                # no block barrier but the one after the barriers' initialisation
                if v.blocks_per_sm == 1:
                    assert re.search(r"\bUSETMAXREG\.DEALLOC\.CTAPOOL 0x28\b", body), name
                    assert re.search(r"\bUSETMAXREG\.TRY_ALLOC\.CTAPOOL \w+, 0xe8\b",
                                     body), name
                else:
                    assert "USETMAXREG" not in body, name
                assert re.search(r"\bSYNCS\.PHASECHK\.TRANS64\.TRYWAIT\b", body), name
                assert re.search(r"\bSYNCS\.ARRIVE\.TRANS64\b", body), name
                # the staged epilogue: two more, around the tile's trip through shared memory
                bars = 3 if v.staged_epilogue else 1
                assert len(re.findall(r"\bBAR\.SYNC\b", body)) == bars, name
            else:
                assert "USETMAXREG" not in body and "SYNCS" not in body, name


def test_gemm_products_sass(cupy_selected, compiled, hopper_sass):
    """sm_90a SASS of the plain-schedule wgmma GEMMs at each product count: BK / 16 k16 wgmmas
    per product in the one loop body, no local memory; at two products more cp.async copies
    than at one (A's lo tile) and fewer than at three (no W lo tile); the staged twins of the
    STAGED_TILE kernels the same wgmmas, two more barriers and 16-byte shared loads; the
    short residual-norm GEMMs BK / 16 wgmmas per product, 16-byte shared loads, no local
    memory."""
    _, lowered = compiled[build.HOPPER]
    bodies = hopper_sass[0]
    tiles = [(t, e) for t in build.WGMMA_TILES for e in ("gelu_pair", "residual")]
    tiles += [(t, build.NORM_EPILOGUE) for t in build.NORM_TILES]
    for tile, epilogue in tiles:
        copies = {}
        for products in build.GEMM_PRODUCTS:
            name = build.wgmma_name(tile, products, epilogue)
            body = bodies[lowered[name]]
            hgmma = re.findall(r"\bHGMMA\.64x(\d+)x16\.F32\b", body)
            assert len(hgmma) == 4 * products and set(hgmma) == {str(tile[1])}, (name, hgmma)
            assert not re.search(r"\b(LDL|STL)\b", body), name
            copies[products] = len(re.findall(r"\bLDGSTS\b", body))
            if tuple(tile) == build.STAGED_TILE:  # its staged twin: the same mainloop, then
                # two barriers around the tile's trip through shared memory, read 16 bytes a lane
                twin = bodies[lowered[build.wgmma_name(tile, products, epilogue, staged=True)]]
                assert re.findall(r"\bHGMMA\.64x(\d+)x16\.F32\b", twin) == hgmma, name
                assert not re.search(r"\b(LDL|STL)\b", twin), name
                bars = len(re.findall(r"\bBAR\.SYNC\b", body))
                assert len(re.findall(r"\bBAR\.SYNC\b", twin)) == bars + 2, name
                assert re.search(r"\bLDS\.128\b", twin), name
        assert copies[1] < copies[2] < copies[3], (tile, epilogue, copies)
    for products in build.GEMM_PRODUCTS:  # the short residual-norm GEMMs
        if not build.gemm_compiled(build.NORM_EPILOGUE, products):
            continue
        name = build.short_norm_name(products)
        body = bodies[lowered[name]]
        hgmma = re.findall(r"\bHGMMA\.64x(\d+)x16\.F32\b", body)
        assert len(hgmma) == 4 * products and set(hgmma) == {"128"}, (name, hgmma)
        assert not re.search(r"\b(LDL|STL)\b", body), name
        assert re.search(r"\bLDS\.128\b", body), name


def test_attention_tma_sass(cupy_selected, compiled, hopper_sass):
    """sm_90a SASS of every TMA-ring attention variant: S = Q K^T as HD / 16 SS wgmmas
    (HGMMA.64xBKVx16 on two descriptors) and O += P V as BKV / 16 RS ones (registers, then V's
    descriptor, .tnspB: N-major), each group waited for to 0 (two WARPGROUP.DEPBAR, two
    fences: no serialisation); three 3-D TMA loads (Q, K, V: UTMALDG.3D), both maps
    prefetched, the expect_tx arrives with a byte-count register and the consumers' plain
    arrive (A1T0), mbarrier waits; setmaxnreg to 40 (producer) and 232 (consumers), launched
    with 168 registers (their pool; three consumers: 24, 160 and 128; two blocks an SM: 24,
    104 and 80); one block barrier; no
    cp.async (LDGSTS) and no local memory (no LDL/STL, stack 0), no register past the
    consumers' (232, or 160). Ping-pong: the same wgmmas
    and waits, and the turns: named barriers of 256 threads (0x100) whose id is a register
    (1 + the consumer), besides the last consumer's first arrive on 1. Overlap: every S and
    P V group as above, issued from several copies of an iteration, one group end (gsb0) a
    group (no serialisation), the waits leaving 0, 1 or 2 groups pending (2: S of the next
    tile and P V of the last stay running), at most one fence a group, the same turns.
    Packed overlap: S issued twice (before and in the loop), P V twice (in the loop, the last
    tile), four group ends, waits 0, 1 (S of the next tile done, P V running), 0 and 0, three
    fences, the same turns. Poly-exp2 variants: one FADD.RM (exp2_poly's floor) for each
    exponential it takes over (one in poly_every of each softmax copy's), and as many MUFU.EX2
    fewer than the variant without it; the others no FADD.RM."""
    _, lowered = compiled[build.HOPPER]
    bodies, rows = hopper_sass
    tma = [(hp, v) for hp, vs in build.ATTENTION_WGMMA.items() for v in vs if v.tma]
    assert tma
    for hp, v in tma:
        symbol = lowered[build.attention_wgmma_name(hp, v)]
        body, row = bodies[symbol], rows[symbol]
        name = f"{v.name} at {hp}"
        ss, rs = attention_hgmma_widths(body)
        waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x\d)", body)
        fences = len(re.findall(r"WARPGROUP\.ARRIVE", body))
        named = re.findall(r"\bBAR\.(SYNC\.DEFER_BLOCKING|ARV) (R\d+|0x\d+), 0x100\b", body)
        if v.schedule == build.TMA_OVERLAP_PACKED:  # S: prologue, loop; P V: loop, last tile
            assert ss == [str(v.bkv)] * (2 * hp // 16), (name, ss)
            assert rs == [str(hp)] * (2 * v.bkv // 16), (name, rs)
            assert len(re.findall(r"\bHGMMA\b", body)) == len(ss) + len(rs), name
            assert len(re.findall(r"\bHGMMA\.[^;]*\bgsb0\b", body)) == 4, name
            assert sorted(waits) == ["0x0", "0x0", "0x0", "0x1"], (name, waits)
            assert fences == 3, name
        elif v.schedule == build.TMA_OVERLAP:
            groups = len(ss) // (hp // 16) + len(rs) // (v.bkv // 16)
            assert set(ss) == {str(v.bkv)} and len(ss) % (hp // 16) == 0, (name, ss)
            assert set(rs) == {str(hp)} and len(rs) % (v.bkv // 16) == 0, (name, rs)
            assert len(re.findall(r"\bHGMMA\b", body)) == len(ss) + len(rs), name
            # one group end (gsb0) a group: serialised wgmmas would each end one
            assert len(re.findall(r"\bHGMMA\.[^;]*\bgsb0\b", body)) == groups, name
            assert set(waits) == {"0x0", "0x1", "0x2"} and len(waits) <= 2 * groups, waits
            assert fences <= groups, name
        else:
            assert ss == [str(v.bkv)] * (hp // 16), (name, ss)
            assert rs == [str(hp)] * (v.bkv // 16), (name, rs)
            assert len(re.findall(r"\bHGMMA\b", body)) == hp // 16 + v.bkv // 16, name
            assert waits == ["0x0"] * 2, name
            assert fences == 2, name
        if v.schedule == build.TMA_PLAIN:
            assert not named and "BAR.ARV" not in body, name
        else:  # warpgroup 1's first arrive on 1, then turns on registers 1 + c and 2 - c
            assert named.count(("ARV", "0x1")) == 1, (name, named)
            assert {op for op, bar in named if bar.startswith("R")} == {
                "SYNC.DEFER_BLOCKING", "ARV"}, (name, named)
            assert all(bar.startswith("R") or bar == "0x1" for op, bar in named), name
            assert len(re.findall(r"\bBAR\.(?:SYNC|ARV)\b", body)) == len(named) + 1, name
        assert len(re.findall(r"\bUTMALDG\.3D\b", body)) == 3, name
        assert "UTMALDG.2D" not in body and "LDGSTS" not in body, name
        assert len(re.findall(r"\bUTMACCTL\.PF\b", body)) == 2, name
        assert len(re.findall(r"\bSYNCS\.ARRIVE\.TRANS64 RZ, \[[^\]]+\], R\d+", body)) == 2, name
        assert re.search(r"\bSYNCS\.ARRIVE\.TRANS64\.A1T0\b", body), name
        assert re.search(r"\bSYNCS\.PHASECHK\.TRANS64\.TRYWAIT\b", body), name
        # two consumers: 40 and 232 registers; three (BQ 192): 24 and 160; two blocks an SM
        # (two consumers): 24 and 104
        producer, consumer = ((24, 104) if v.min_blocks == 2 else
                              (40, 232) if v.bq == 128 else (24, 160))
        assert re.search(rf"\bUSETMAXREG\.DEALLOC\.CTAPOOL {producer:#x}\b", body), name
        assert re.search(rf"\bUSETMAXREG\.TRY_ALLOC\.CTAPOOL \w+, {consumer:#x}\b", body), name
        assert len(re.findall(r"\bBAR\.SYNC\.DEFER_BLOCKING 0x0\b", body)) == 1, name
        assert not re.search(r"\b(LDL|STL)\b", body), name
        assert row["stack_bytes"] == 0 and row["spill_stores"] == 0, (name, row)
        # the consumers' code fits their setmaxnreg budget (three: 160; the packed overlap at
        # BKV 128 keeps S 64, O 32 and P 32 registers a thread live: MASK_IDLE)
        assert max(int(r) for r in re.findall(r"\bR(\d+)\b", body)) < consumer, name
        # exp2_poly rounds floor(x) down (FADD.RM) where poly_exp2, in place of one MUFU.EX2
        rounded = len(re.findall(r"\bFADD(?:\.FTZ)?\.RM\b", body))
        ex2 = len(re.findall(r"\bMUFU\.EX2\b", body))
        if v.poly_exp2:
            twin, = [u for u in build.ATTENTION_WGMMA[hp] if not u.poly_exp2 and u.tma and
                     (u.bq, u.bkv, u.kv_stages, u.schedule) ==
                     (v.bq, v.bkv, v.kv_stages, v.schedule)]
            exact = bodies[lowered[build.attention_wgmma_name(hp, twin)]]
            copies = 1 if v.schedule == build.TMA_PINGPONG else 2  # softmaxes in the source
            assert rounded == copies * v.bkv // 2 // v.poly_every, (name, rounded)
            assert ex2 + rounded == len(re.findall(r"\bMUFU\.EX2\b", exact)), (name, ex2)
        else:
            assert rounded == 0 and ex2 > 0, name
        # launched with all 168 (384 threads, one block an SM; 512: 128; two blocks of 384:
        # 80): the pool setmaxnreg moves 40 x 128 + 232 x 256 registers within; fewer would
        # leave the consumers waiting
        launch = 65536 // (v.min_blocks * v.threads) // 8 * 8
        assert row["registers"] == launch, (name, row)
        assert 128 * producer + (v.threads - 128) * consumer <= v.threads * launch, name


class Recorder:
    """Stands in for ops.Kernels: records each launch, and each tensor map asked for (built by
    tensor_maps.tensor_map with fake_encode for the driver)."""

    def __init__(self):
        self.calls = []
        self.maps = []

    def tensor_map(self, t, box_rows, seq_len=None, box_cols=tensor_maps.BOX_COLS):
        """tensor_maps.tensor_map of t, the encoding recorded (with seq_len, a 3-D view's,
        with its box columns)."""
        self.maps.append((tuple(t.shape), t.stride(), box_rows) +
                         (() if seq_len is None else (seq_len, box_cols)))
        return tensor_maps.tensor_map(t, box_rows, encode=fake_encode, seq_len=seq_len,
                                      box_cols=box_cols)

    def launch(self, name, grid, block, shared, args):
        """Record one launch."""
        self.calls.append((name, grid, block, shared, args))


FAKE_WORDS = [i + (1 << 56) for i in range(16)]  # a tensor map's words, word i = i + 2^56


def fake_encode(t, box_rows, seq_len=None, box_cols=tensor_maps.BOX_COLS):
    """Stands in for tensor_maps.encode_tiled (no driver on CPU): CUDA_SUCCESS and
    FAKE_WORDS."""
    return 0, np.array(FAKE_WORDS, dtype=np.uint64)


def _size(arg) -> int:
    if arg is None or isinstance(arg, torch.Tensor):
        return 8
    if isinstance(arg, np.ndarray):  # passed by value from its data: a tensor map
        assert arg.shape == () and arg.dtype == tensor_maps.TENSOR_MAP_DTYPE, arg
        return arg.dtype.itemsize
    assert isinstance(arg, np.generic), f"untyped scalar {arg!r}"
    return arg.dtype.itemsize


@pytest.mark.parametrize("d_model, blocks, products", [(128, 4, 3), (512, 4, 1), (512, 5, 3),
                                                     (1024, 12, 3)])
def test_default_products_follow_width_and_depth(cupy_selected, monkeypatch, d_model, blocks,
                                                 products):
    """out_proj and the FFN run one fp16 product from d_model 512 and three below, and three
    in stacks deeper than four blocks; a fixed linear_products holds at any depth."""
    from layerbench.backends.cupy import CupyBackend

    class Hopper:  # stands in for ops.Kernels on an sm_90 device
        has_wgmma, wgmma_problem, programmatic_problem, arch = True, None, None, "90"
    monkeypatch.setattr(ops, "kernels_for", lambda device: Hopper())
    cfg = LayerConfig(2, 16, d_model, 4, 64, blocks)
    sd, cpu = make_reference(cfg, seed=3).state_dict(), torch.device("cpu")
    assert CupyBackend()._build(cfg, sd, cpu, torch.float32).products == products
    assert CupyBackend(linear_products=1)._build(cfg, sd, cpu, torch.float32).products == 1


def test_programmatic_launch_follows_the_driver_layout(cupy_selected, monkeypatch):
    """driver.py's cuLaunchKernelEx structures have cuda.h's layout (CUlaunchAttribute: 72
    bytes, its value at 8; CUlaunchConfig: 56, stream at 32), the attribute id is
    cuda.bindings' own, arguments take the bytes the kernels take (_size), and
    CupyBackend(pdl=...) launches programmatically from sm_90 by default, on request, and
    refuses where the device cannot; CupyBackend(staged_epilogue=...) stages by default and
    on request, not with False, and context_hi_only and eight_lane_rows likewise;
    short_norm_gemm only on request; eight_lane_rows asking the GEMMs for staged 2 where
    they stage."""
    import ctypes

    from layerbench.backends.cupy import CupyBackend, driver

    assert ctypes.sizeof(driver.LaunchAttribute) == 72
    assert driver.LaunchAttribute.allowed.offset == 8
    assert ctypes.sizeof(driver.LaunchConfig) == 56
    assert (driver.LaunchConfig.shared.offset, driver.LaunchConfig.stream.offset,
            driver.LaunchConfig.attrs.offset, driver.LaunchConfig.count.offset) == (24, 32, 40,
                                                                                     48)
    bindings = pytest.importorskip("cuda.bindings.driver")
    assert driver.PROGRAMMATIC_STREAM_SERIALIZATION == int(
        bindings.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    x = torch.zeros(4, 8)
    args = (x, None, np.int32(3), np.int64(-2), np.float32(0.5),
            tensor_maps.pack(FAKE_WORDS))
    buffers = driver.argument_buffers(args)
    assert [b.nbytes for b in buffers] == [_size(a) for a in args]
    assert [int(buffers[0]), int(buffers[1]), int(buffers[2]), int(buffers[3])] == [
        x.data_ptr(), 0, 3, -2]
    assert buffers[5].tobytes() == np.array(FAKE_WORDS, dtype=np.uint64).tobytes()
    with pytest.raises(TypeError, match="NumPy scalar"):
        driver.argument_buffers((x, 3))

    class FakeDriver:  # stands in for libcuda: reads back what cuLaunchKernelEx was given
        def cuLaunchKernelEx(self, config, function, params, extra):
            c = config._obj
            attribute = c.attrs[0]
            self.seen = (tuple(c.grid), tuple(c.block), c.shared, c.stream, c.count,
                         attribute.id, attribute.allowed, function, extra)
            pointers = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
            self.params = [ctypes.string_at(pointers[i], _size(a)) for i, a in enumerate(args)]
            return 0
    fake = FakeDriver()
    monkeypatch.setattr(driver, "libcuda", lambda: fake)
    assert driver.launch_programmatic(0x1234, (5, 6, 7), 288, 1024, 0x99, args) == 0
    assert fake.seen == ((5, 6, 7), (288, 1, 1), 1024, 0x99, 1,
                         driver.PROGRAMMATIC_STREAM_SERIALIZATION, 1, 0x1234, None)
    assert fake.params == [b.tobytes() for b in buffers]

    class Hopper:  # stands in for ops.Kernels on an sm_90 device
        has_wgmma, wgmma_problem, programmatic_problem, arch = True, None, None, "90"
        launches = []

        def launch(self, *args, programmatic=False):
            self.launches.append(programmatic)
    monkeypatch.setattr(ops, "kernels_for", lambda device: Hopper())
    cfg = LayerConfig(2, 12, 64, 2, 64, 1)
    sd, cpu = make_reference(cfg, seed=3).state_dict(), torch.device("cpu")
    for pdl, on in ((None, True), (True, True), (False, False)):
        layer = CupyBackend(pdl=pdl)._build(cfg, sd, cpu, torch.float32)
        assert layer.pdl == on and isinstance(layer.kernels, ops.ProgrammaticKernels) == on
    default_on = ((None, True), (True, True), (False, False))
    default_off = ((None, False), (False, False), (True, True))
    for option, choices in (("staged_epilogue", default_on), ("short_norm_gemm", default_off),
                            ("context_hi_only", default_on), ("eight_lane_rows", default_on)):
        for choice, on in choices:
            built = CupyBackend(**{option: choice})._build(cfg, sd, cpu, torch.float32)
            assert getattr(built, option) == on, (option, choice)
    layer.kernels.launch("k", (1, 1, 1), 32, 0, ())
    CupyBackend()._build(cfg, sd, cpu, torch.float32).kernels.launch("k", (1, 1, 1), 32, 0, ())
    assert Hopper.launches == [False, True]
    assert ops.ProgrammaticKernels(Hopper()).arch == "90"  # the rest passes through
    Hopper.programmatic_problem = "needs sm_90"
    assert not CupyBackend()._build(cfg, sd, cpu, torch.float32).pdl
    with pytest.raises(Unsupported, match="pdl: needs sm_90"):
        CupyBackend(pdl=True)._build(cfg, sd, cpu, torch.float32)


def test_layer_norm_holds_the_fewest_registers_that_fit_the_row(cupy_selected):
    """The LayerNorm kernel for rows of d columns holds the fewest float4s a lane that take
    the row (wider rows stream at the most), and each is in the module."""
    widths = (8, 128, 136, 256, 264, 512, 520, 1024, 1032, 4096)
    assert [build.norm_held(d) for d in widths] == [1, 1, 2, 2, 4, 4, 8, 8, 8, 8]
    names = build.name_expressions(build.HOPPER)
    for d in widths:
        k = Recorder()
        ops.layer_norm(k, torch.zeros(3, d), torch.zeros(d), torch.zeros(d),
                       half=torch.zeros(3, d, dtype=torch.float16))
        assert k.calls[0][0] == f"lb::layer_norm<1, {build.norm_held(d)}>" in names


def _launches():
    """Every kind of launch the layer makes, recorded on CPU tensors."""
    k = Recorder()
    m, d, f, heads = 40, 64, 72, 2
    x = torch.zeros(m, d)
    w, b = torch.zeros(d), torch.zeros(d)
    pair = (torch.zeros(m, d, dtype=torch.float16), torch.zeros(m, d, dtype=torch.float16))
    valid = torch.ones(m, dtype=torch.uint8)
    for held in build.NORM_HELD:  # rows of each width the LayerNorm kernels hold
        width = 128 * held
        rows = torch.zeros(m, width)
        ones = torch.zeros(width)
        halves = torch.zeros(m, width, dtype=torch.float16)
        ops.layer_norm(k, rows, ones, ones, pair=(halves, halves))
        ops.layer_norm(k, rows, ones, ones, half=halves)
        ops.layer_norm(k, rows, ones, ones, out=rows, valid_rows=valid)
    for products in build.GEMM_PRODUCTS:
        half = build.gemm_compiled("half", products)  # not at two products
        for tile in build.GEMM_TILES:
            wp = weight_pair(torch.zeros(f, d))
            if half:
                ops.linear(k, pair, wp, torch.zeros(f), "half", products,
                           out_half=torch.zeros(m, f, dtype=torch.float16), tile=tile)
            ops.linear(k, pair, wp, torch.zeros(f), "gelu_pair", products,
                       out_pair=(torch.zeros(m, f, dtype=torch.float16),) * 2, tile=tile)
            ops.linear(k, pair, weight_pair(torch.zeros(d, d)), b, "residual", products,
                       res=x, out=x, valid_rows=valid, zero_sum=True, tile=tile)
        for staged in (0, 1, 2):  # staged: the STAGED_TILE kernels' twins (2: eight lanes)
            tiles = [build.STAGED_TILE] if staged else build.WGMMA_TILES
            for tile in tiles:
                ops.linear(k, pair, weight_pair(torch.zeros(f, d)), torch.zeros(f), "gelu_pair",
                           products, out_pair=(torch.zeros(m, f, dtype=torch.float16), None),
                           tile=tile, wgmma=True, staged=staged)
                if half:
                    ops.linear(k, pair, weight_pair(torch.zeros(f, d)), torch.zeros(f), "half",
                               products, out_half=torch.zeros(m, f, dtype=torch.float16),
                               tile=tile, wgmma=True, staged=staged)
                ops.linear(k, pair, weight_pair(torch.zeros(d, d)), b, "residual", products,
                           res=x, out=x, valid_rows=None, tile=tile, wgmma=True, staged=staged)
            tiles = [build.STAGED_TILE] if staged else build.NORM_TILES
            for tile, norm_out in itertools.product(tiles, (pair, (pair[0], None))):
                ops.linear(k, pair, weight_pair(torch.zeros(d, d)), b, "residual_norm",
                           products, res=x, out=x, valid_rows=valid, zero_sum=True,
                           norm=(w, b), norm_out=norm_out, tile=tile, wgmma=True, staged=staged)
        if build.gemm_compiled(build.NORM_EPILOGUE, products):  # the short residual-norm GEMM
            ops.linear(k, pair, weight_pair(torch.zeros(d, d)), b, "residual_norm", products,
                       res=x, out=x, valid_rows=valid, zero_sum=True, norm=(w, b),
                       norm_out=pair, wgmma=True, short_norm=True)
    for v in build.GEMM_VARIANTS:  # one product, as the layer runs them
        variant = {"wgmma": True, "gemm_variant": v.name}
        wp = weight_pair(torch.zeros(f, d))
        ops.linear(k, pair, wp, torch.zeros(f), "half", 1,
                   out_half=torch.zeros(m, f, dtype=torch.float16), **variant)
        ops.linear(k, pair, wp, torch.zeros(f), "gelu_pair", 1,
                   out_pair=(torch.zeros(m, f, dtype=torch.float16), None), **variant)
        ops.linear(k, pair, weight_pair(torch.zeros(d, d)), b, "residual", 1, res=x, out=x,
                   valid_rows=valid, zero_sum=True, **variant)
    for tile in build.WGMMA_TILES:  # norm prologue: Q/K/V's half, ffn_in's gelu_pair
        for epilogue, counts in build.PROLOGUE_EPILOGUES.items():
            for products in counts:
                out_pair = (torch.zeros(m, f, dtype=torch.float16),
                            torch.zeros(m, f, dtype=torch.float16) if products > 1 else None)
                ops.linear(k, None, weight_pair(torch.zeros(f, d)), torch.zeros(f), epilogue,
                           products, out_half=out_pair[0], out_pair=out_pair, tile=tile,
                           wgmma=True, prologue_norm=(x, w, b))
    for head_dim in (8, 32, 64, 128, 256):
        d = heads * head_dim
        qkv = torch.zeros(m, 3 * d, dtype=torch.float16)
        ctx = (torch.zeros(m, d, dtype=torch.float16),) * 2
        mask = torch.ones(2, m // 2, dtype=torch.uint8)
        wide = ops.wgmma_attention_pad(head_dim)
        variants = [v.name for v in build.ATTENTION_WGMMA[wide]
                    if not v.refusal(head_dim, wide)] if wide else []
        for wgmma, variant in [(False, None), (True, None)] + [(True, v) for v in variants]:
            ops.attention(k, qkv, ctx, mask, key_info(mask), batch=2, seq_len=m // 2,
                          num_heads=heads, head_dim=head_dim, causal=True, wgmma=wgmma,
                          variant=variant)
    for width, ffn in build.WHOLE_BLOCK_WIDTHS:  # with and without the final norm
        cfg = LayerConfig(2, m // 2, width, 2, ffn, 1)
        model = make_reference(cfg, seed=1)
        params = pack_params(cfg, model.state_dict(), device="cpu").layers[0]
        pairs = {n: weight_pair(getattr(params, n)) for n in layer_module.WEIGHTS}
        rows = torch.zeros(m, width)
        mask = torch.ones(2, m // 2, dtype=torch.uint8)
        for final, block_rows in itertools.product((None, (rows[0], rows[0])),
                                                   build.WHOLE_BLOCK_ROWS):
            ops.whole_block(k, rows, torch.zeros(m, width), params, pairs,
                            torch.zeros(ffn), mask, key_info(mask), batch=2, seq_len=m // 2,
                            num_heads=2, causal=True, rows=block_rows, final=final,
                            final_out=None if final is None else torch.zeros(m, width))
        ctx = (torch.zeros(m, width, dtype=torch.float16),) * 2
        for fused_final, block_rows in itertools.product((False, True),
                                                          build.AFTER_ATTENTION_ROWS):
            ops.after_attention(k, ctx, rows, None if fused_final else rows, params, pairs,
                                torch.zeros(ffn), mask.reshape(-1), rows=block_rows,
                                norm=(params.norm1_weight, params.norm1_bias),
                                norm_out=None if fused_final else ctx[0],
                                final_out=rows if fused_final else None)
    return k.calls


def test_parameters_match_the_compiled_kernels(cupy_selected, compiled):
    """Each launch the host makes (every wgmma attention and GEMM variant too) passes as many
    arguments as its kernel takes, each of the size the cubin records (8 for an address or
    64-bit integer, 4 for int32 or float, 128 for a TMA kernel's two tensor maps, its last
    parameters; as for the TMA attention's two), within the kernel's shared-memory limit
    (227 KiB on sm_90) and a whole number of warps."""
    path, lowered = compiled[build.HOPPER]
    info = cubin_kernels(path)
    seen = set()
    for name, grid, block, shared, args in _launches():
        assert name in lowered, name
        assert [_size(a) for a in args] == info[lowered[name]]["params"], name
        if name.startswith(("lb::linear_wgmma_tma<", "lb::flash_attention_wgmma_tma<")):
            assert info[lowered[name]]["params"][-2:] == [128, 128], name
        assert block % 32 == 0 and shared <= 227 * 1024 and all(g >= 1 for g in grid), name
        seen.add(name)
    assert seen >= {n for n in build.name_expressions(build.HOPPER)
                    if not n.startswith("lb::flash_attention<")}


def test_residual_norm_tile_and_refusals(cupy_selected, monkeypatch):
    """residual_norm takes 128 columns a block and 128 rows where that grid has a block per
    multiprocessor, else 64; it refuses rows wider than 128 and the mma.sync GEMMs."""
    monkeypatch.setattr(ops, "multiprocessor_count", lambda device: 132)
    m, d = 132 * 128, 64
    pair = (torch.zeros(m, d, dtype=torch.float16), torch.zeros(m, d, dtype=torch.float16))
    x, w, b = torch.zeros(m, d), torch.zeros(d), torch.zeros(d)
    norm = {"norm": (w, b), "norm_out": pair}
    for rows, tile in ((m, (128, 128)), (m - 128, (64, 128)), (1, (64, 128))):
        k = Recorder()
        a = tuple(t[:rows] for t in pair)
        ops.linear(k, a, weight_pair(torch.zeros(d, d)), b, "residual_norm", 3, res=x[:rows],
                   out=x[:rows], norm=(w, b), norm_out=a, wgmma=True)
        assert k.calls[0][0] == build.wgmma_name(tile, 3, "residual_norm")
        assert k.calls[0][1][1] == 1  # one block along N: each block holds whole rows
    wide = weight_pair(torch.zeros(136, d))
    with pytest.raises(ValueError, match="at most 128"):
        ops.linear(Recorder(), pair, wide, torch.zeros(136), "residual_norm", 3, res=x, out=x,
                   wgmma=True, **norm)
    with pytest.raises(ValueError, match="wgmma"):
        ops.linear(Recorder(), pair, weight_pair(torch.zeros(d, d)), b, "residual_norm", 3,
                   res=x, out=x, **norm)
    with pytest.raises(ValueError, match="tiles"):
        ops.linear(Recorder(), pair, weight_pair(torch.zeros(d, d)), b, "residual_norm", 3,
                   res=x, out=x, tile=(64, 64), wgmma=True, **norm)


def test_headers_are_found_or_refused(cupy_selected, monkeypatch, tmp_path):
    """$CUDA_HOME with the header comes first; with no candidate holding it the reason names
    every folder tried."""
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / build.HEADER).write_text("")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    build.cuda_include.cache_clear()
    try:
        assert build.cuda_include() == str(tmp_path / "include")
        monkeypatch.setattr(build, "include_candidates", lambda: [tmp_path / "none"])
        build.cuda_include.cache_clear()
        with pytest.raises(Unsupported, match="none"):
            build.cuda_include()
    finally:
        build.cuda_include.cache_clear()


def test_attention_variants(cupy_selected, monkeypatch):
    """Every wgmma attention variant: compiled for sm_90a, the default (first) the timed
    fastest (two blocks an SM up to head dim 64, the plain 128x128 kernel at 128; at 256 the
    128x64 one), two blocks' shared memory fit an SM where it asks for two; ops.attention
    launches the named one (None: the default) and refuses a variant the head dim lacks or
    the mma.sync kernel; CupyBackend refuses unknown names, and where the wgmma attention
    does not run or lacks the variant at the config's head dim; the layer passes it to
    attention."""
    from layerbench.backends.cupy import CupyBackend

    sm_shared = 228 * 1024  # per SM on sm_90, 1 KiB of it reserved per block
    names = build.name_expressions(build.HOPPER)
    for hp, variants in build.ATTENTION_WGMMA.items():
        assert variants[0] == {32: build.WGMMA_TWO_PER_SM, 64: build.WGMMA_TWO_PER_SM,
                               128: build.WGMMA_PLAIN, 256: build.WGMMA_HD256}[hp]
        assert len({v.name for v in variants}) == len(variants)
        for v in variants:
            assert build.attention_wgmma_name(hp, v) in names
            shared = ops.attention_variant_shared_bytes(hp, v)
            assert v.min_blocks * (shared + 1024) <= sm_shared, (hp, v)
    assert [hp for hp, vs in build.ATTENTION_WGMMA.items() if build.WGMMA_TMA in vs] == [32, 64]
    assert (build.attention_wgmma_name(64, build.WGMMA_TMA) ==
            "lb::flash_attention_wgmma_tma<64, 128, 64, 3, 0>")
    assert ops.attention_variant_shared_bytes(64, build.WGMMA_TMA) == 66560  # as the .cu says
    assert ops.attention_variant_shared_bytes(32, build.WGMMA_TMA) == 33792
    assert build.WGMMA_TMA.threads == 384 and build.WGMMA_TWO_PER_SM.threads == 256
    # head dim 256: the plain schedule at BKV 64, one block an SM; Q and four K/V tiles of
    # 512-byte rows fit 227 KiB, as the .cu says
    assert build.ATTENTION_WGMMA[256] == (build.WGMMA_HD256, build.WGMMA_HD256_ONE_GROUP)
    assert [(v.bq, v.bkv, v.min_blocks, v.pipelined, v.tma, v.threads)
            for v in build.ATTENTION_WGMMA[256]] == [(128, 64, 1, False, False, 256),
                                                     (64, 64, 1, False, False, 128)]
    assert build.attention_wgmma_name(256, build.WGMMA_HD256) == (
        "lb::flash_attention_wgmma<256, 128, 64, 1, 0>")
    assert ops.attention_variant_shared_bytes(256, build.WGMMA_HD256) == 197632 <= 227 * 1024
    assert ops.attention_variant_shared_bytes(256, build.WGMMA_HD256_ONE_GROUP) == 164864
    for head_dim in (136, 200, 256):
        assert ops.wgmma_attention_pad(head_dim) == 256
    assert ops.wgmma_attention_pad(128) == 128 and ops.wgmma_attention_pad(8) == 32
    assert ops.wgmma_attention_pad(264) is None
    # the FlashAttention-3 steps after the ring, timed separately: after it, at 32 and 64
    for hp in (32, 64):
        assert build.ATTENTION_WGMMA[hp][3:14] == (build.WGMMA_TMA, build.WGMMA_TMA_PINGPONG,
                                                 build.WGMMA_TMA_OVERLAP,
                                                 build.WGMMA_TMA_PINGPONG_128,
                                                 build.WGMMA_TMA_PINGPONG_3WG,
                                                 build.WGMMA_TMA_OVERLAP_128,
                                                 build.WGMMA_TMA_PINGPONG_128_POLY,
                                                 build.WGMMA_TMA_OVERLAP_128_POLY,
                                                 build.WGMMA_TMA_OVERLAP_3WG,
                                                 build.WGMMA_TMA_OVERLAP_3WG_POLY,
                                                 build.WGMMA_TMA_OVERLAP_3WG_POLY4)
    # (head dim, variant) -> its template arguments (FlashAttention-3's overlap order at BKV
    # 128 is SCHEDULE 3; the polynomial exp2 adds 4 at one pair in 8, 8 at one in 4) and
    # shared bytes, as the .cu says
    expected = {(64, build.WGMMA_TMA_PINGPONG): ("128, 64, 3, 1", None),
                (32, build.WGMMA_TMA_OVERLAP): ("128, 64, 5, 2", None),
                (64, build.WGMMA_TMA_OVERLAP): ("128, 64, 5, 2", 99328),
                (64, build.WGMMA_TMA_PINGPONG_128): ("128, 128, 3, 1", 115712),
                (64, build.WGMMA_TMA_PINGPONG_3WG): ("192, 64, 3, 1", 74752),
                (64, build.WGMMA_TMA_OVERLAP_128): ("128, 128, 5, 3", 181248),
                (32, build.WGMMA_TMA_OVERLAP_128): ("128, 128, 5, 3", 91136),
                (32, build.WGMMA_TMA_PINGPONG_128_POLY): ("128, 128, 3, 5", None),
                (64, build.WGMMA_TMA_OVERLAP_128_POLY): ("128, 128, 5, 7", None),
                (64, build.WGMMA_TMA_OVERLAP_3WG): ("192, 128, 6, 3", 222208),
                (64, build.WGMMA_TMA_OVERLAP_3WG_POLY): ("192, 128, 6, 7", 222208),
                (32, build.WGMMA_TMA_OVERLAP_3WG_POLY4): ("192, 128, 6, 11", 111616),
                (32, build.WGMMA_TMA_OVERLAP_3WG): ("192, 128, 6, 3", 111616)}
    for (hp, v), (arguments, shared) in expected.items():
        assert build.attention_wgmma_name(hp, v) == (
            f"lb::flash_attention_wgmma_tma<{hp}, {arguments}>"), (hp, v.name)
        assert shared is None or ops.attention_variant_shared_bytes(hp, v) == shared, v.name
    # ... and at 32 one warpgroup a block, four blocks an SM, then the ring at two blocks an SM
    assert build.ATTENTION_WGMMA[32][14:] == (build.WGMMA_ONE_GROUP_4_PER_SM,
                                              build.WGMMA_TMA_2_PER_SM,
                                              build.WGMMA_TMA_PINGPONG_2_PER_SM)
    assert (build.attention_wgmma_name(32, build.WGMMA_TMA_2_PER_SM) ==
            "lb::flash_attention_wgmma_tma<32, 128, 64, 3, 0, 2>")
    assert (build.attention_wgmma_name(32, build.WGMMA_TMA_PINGPONG_2_PER_SM) ==
            "lb::flash_attention_wgmma_tma<32, 128, 64, 3, 1, 2>")
    assert build.WGMMA_TMA_2_PER_SM.threads == 384
    assert len(build.ATTENTION_WGMMA[64]) == 14
    assert (build.attention_wgmma_name(32, build.WGMMA_ONE_GROUP_4_PER_SM) ==
            "lb::flash_attention_wgmma<32, 64, 64, 4, 0>")
    assert build.WGMMA_ONE_GROUP_4_PER_SM.threads == 128
    assert [v.poly_every for v in build.ATTENTION_WGMMA[64] if v.poly_exp2] == [8, 8, 8, 4]
    with pytest.raises(ValueError, match="polynomial"):
        build.attention_wgmma_name(64, replace(build.WGMMA_TMA_OVERLAP_3WG, poly_every=2))
    assert not any(v.poly_exp2 for v in build.ATTENTION_WGMMA[128])
    assert build.WGMMA_TMA_PINGPONG.threads == build.WGMMA_TMA_OVERLAP.threads == 384
    assert build.WGMMA_TMA_PINGPONG_128.threads == 384
    assert build.WGMMA_TMA_PINGPONG_3WG.threads == 512
    assert build.WGMMA_TMA_OVERLAP_128.threads == build.WGMMA_TMA_OVERLAP_128_POLY.threads == 384
    assert build.WGMMA_TMA_OVERLAP_3WG.threads == 512
    # the packed overlap of three consumers takes as many stages as fit 227 KiB at head dim 64
    v = build.WGMMA_TMA_OVERLAP_3WG
    assert ops.attention_wgmma_tma_shared_bytes(64, v.kv_stages, v.bkv, v.bq) <= 227 * 1024
    assert ops.attention_wgmma_tma_shared_bytes(64, v.kv_stages + 1, v.bkv, v.bq) > 227 * 1024
    heads, seq_len = 2, 20
    for head_dim, wide in ((24, 32), (32, 32), (64, 64), (128, 128), (136, 256), (256, 256)):
        d = heads * head_dim
        qkv = torch.zeros(seq_len, 3 * d, dtype=torch.float16)
        ctx = (torch.zeros(seq_len, d, dtype=torch.float16),) * 2
        shape = dict(batch=1, seq_len=seq_len, num_heads=heads, head_dim=head_dim, causal=True)
        for variant in [None] + [v.name for v in build.ATTENTION_WGMMA[wide]]:
            k = Recorder()
            if variant is None:  # the default: the head dim's first variant
                ops.attention(k, qkv, ctx, None, None, wgmma=True, **shape)
                want = build.attention_wgmma_name(wide, build.ATTENTION_WGMMA[wide][0])
                assert k.calls[0][0] == want, k.calls[0][0]
                continue
            v = build.attention_variant(wide, variant)
            if v.refusal(head_dim, wide):  # the TMA ring below its padded head dim
                with pytest.raises(ValueError, match=f"needs head dim {wide} exactly"):
                    ops.attention(k, qkv, ctx, None, None, wgmma=True, variant=variant,
                                  **shape)
                assert not k.calls and not k.maps and v.tma and head_dim < wide
                continue
            ops.attention(k, qkv, ctx, None, None, wgmma=True, variant=variant, **shape)
            assert k.calls[0][0] == build.attention_wgmma_name(wide, v)
            assert k.calls[0][2] == v.threads
            assert k.calls[0][3] == ops.attention_variant_shared_bytes(wide, v)
            if v.tma:  # the 3-D maps of qkv's rows: Q boxes of BQ rows, K/V of BKV, wide columns
                assert k.maps == [((seq_len, 3 * d), (3 * d, 1), v.bq, seq_len, wide),
                                  ((seq_len, 3 * d), (3 * d, 1), v.bkv, seq_len, wide)], k.maps
                assert [a.dtype for a in k.calls[0][4][-2:]] == [tensor_maps.TENSOR_MAP_DTYPE] * 2
            else:
                assert not k.maps
        with pytest.raises(ValueError, match="has no variant"):
            ops.attention(Recorder(), qkv, ctx, None, None, wgmma=True, variant="wgmma 1x1",
                          **shape)
        with pytest.raises(ValueError, match="needs the wgmma kernel"):
            ops.attention(Recorder(), qkv, ctx, None, None, variant=build.WGMMA_PLAIN.name,
                          **shape)
    with pytest.raises(ValueError, match="attention_variant"):
        CupyBackend(attention_variant="wgmma 1x1")
    # the TMA ring reads boxes of 64 columns: head dims 33-63 are refused, with no launch
    d = heads * 48
    qkv = torch.zeros(seq_len, 3 * d, dtype=torch.float16)
    ctx = (torch.zeros(seq_len, d, dtype=torch.float16),) * 2
    k = Recorder()
    with pytest.raises(ValueError, match="needs head dim 64 exactly"):
        ops.attention(k, qkv, ctx, None, None, wgmma=True, variant=build.WGMMA_TMA.name,
                      batch=1, seq_len=seq_len, num_heads=heads, head_dim=48, causal=True)
    assert not k.calls and not k.maps
    ops.attention(k, qkv, ctx, None, None, wgmma=True, batch=1, seq_len=seq_len,
                  num_heads=heads, head_dim=48, causal=True)  # the default runs it
    assert k.calls[0][0] == build.attention_wgmma_name(64, build.WGMMA_TWO_PER_SM)
    # qkv rows whose stride TMA cannot take (not a multiple of 16 bytes): refused
    odd = torch.zeros(seq_len, 3 * 128 + 4, dtype=torch.float16)[:, :3 * 128]
    with pytest.raises(ValueError, match="cannot run on this qkv"):
        ops.attention(Recorder(), odd, (torch.zeros(seq_len, 128, dtype=torch.float16),) * 2,
                      None, None, wgmma=True, variant=build.WGMMA_TMA.name, batch=1,
                      seq_len=seq_len, num_heads=2, head_dim=64, causal=True)

    class Hopper:  # stands in for ops.Kernels on an sm_90 device
        has_wgmma, wgmma_problem, programmatic_problem, arch = True, None, None, "90"
    monkeypatch.setattr(ops, "kernels_for", lambda device: Hopper())
    cpu, two = torch.device("cpu"), build.WGMMA_TWO_PER_SM.name
    tma = build.WGMMA_TMA.name
    for cfg, variant, ok in ((LayerConfig(2, 12, 128, 2, 64, 1), two, True),
                             (LayerConfig(2, 12, 256, 2, 64, 1), two, False),  # head dim 128
                             (LayerConfig(2, 12, 512, 2, 64, 1), two, False),  # head dim 256
                             (LayerConfig(2, 12, 512, 2, 64, 1), build.WGMMA_HD256.name, True),
                             (LayerConfig(2, 12, 272, 2, 64, 1),  # head dim 136
                              build.WGMMA_HD256_ONE_GROUP.name, True),
                             (LayerConfig(2, 12, 256, 2, 64, 1), build.WGMMA_HD256.name,
                              False),  # head dim 128: no such variant
                             (LayerConfig(2, 12, 128, 2, 64, 1), tma, True),
                             (LayerConfig(2, 12, 96, 2, 64, 1), tma, False),  # head dim 48
                             (LayerConfig(2, 12, 64, 2, 64, 1), tma, True),  # head dim 32
                             (LayerConfig(2, 12, 48, 2, 64, 1), tma, False)):  # head dim 24
        sd = make_reference(cfg, seed=3).state_dict()
        backend = CupyBackend(attention_variant=variant)
        if ok:
            assert backend._build(cfg, sd, cpu, torch.float32).attention_variant == variant
        else:
            with pytest.raises(Unsupported,
                               match="attention_variant|no variant|needs head dim"):
                backend._build(cfg, sd, cpu, torch.float32)
    Hopper.has_wgmma = False  # not sm_90: no wgmma attention to pick a variant of
    cfg = LayerConfig(2, 12, 128, 2, 64, 1)
    with pytest.raises(Unsupported, match="needs the wgmma"):
        CupyBackend(attention_variant=two)._build(cfg, make_reference(cfg, seed=3).state_dict(),
                                                  cpu, torch.float32)
    cfg = LayerConfig(2, 12, 64, 2, 64, 1)
    x, mask = make_inputs(cfg, padding_ratio=0.25, seed=6)
    stand = StandIns()
    _run_stand_ins(cfg, stand, x, mask, monkeypatch, fuse_norms=True,
                   attention_variant=build.WGMMA_PIPELINED.name)
    assert stand.variants == [build.WGMMA_PIPELINED.name] * cfg.num_layers


def test_staged_launch_names(cupy_selected):
    """ops.linear's staged: on the plain schedule's STAGED_TILE the staged twin of each
    epilogue and product count (staged 2: eight lanes a row for the fp32 epilogues, a warp a
    row for the others), never on another tile or without staged; the layer passes its
    staged_epilogue (and eight_lane_rows) to every GEMM."""
    m, d = 300, 128
    x = torch.zeros(m, d)
    pair = (torch.zeros(m, d, dtype=torch.float16),) * 2
    norm = {"norm": (torch.zeros(d), torch.zeros(d)), "norm_out": pair}
    outputs = {"half": {"out_half": pair[0]}, "gelu_pair": {"out_pair": pair},
               "residual": {"res": x, "out": x}, "residual_norm": {"res": x, "out": x, **norm}}
    for epilogue, products in itertools.product(outputs, build.GEMM_PRODUCTS):
        if not build.gemm_compiled(epilogue, products):
            continue
        tiles = build.NORM_TILES if epilogue == "residual_norm" else build.WGMMA_TILES
        for tile, staged in itertools.product(tiles, (False, True, 2)):
            k = Recorder()
            ops.linear(k, pair, weight_pair(torch.zeros(d, d)), torch.zeros(d), epilogue,
                       products, tile=tile, wgmma=True, staged=staged, **outputs[epilogue])
            twin = int(bool(staged) and tuple(tile) == build.STAGED_TILE)
            if twin and staged == 2 and epilogue in build.EIGHT_LANE_EPILOGUES:
                twin = 2
            assert k.calls[0][0] == build.wgmma_name(tile, products, epilogue, staged=twin)
            staged_name = re.search(r", 0, ([12])>$", k.calls[0][0])
            assert (int(staged_name.group(1)) if staged_name else 0) == twin, (epilogue, tile)
    with pytest.raises(ValueError, match="eight lanes"):
        build.wgmma_name(build.STAGED_TILE, 1, "half", staged=2)
    source = (build.SOURCE_DIR / "layer.py").read_text()
    assert "staged = (2 if self.eight_lane_rows else 1) if self.staged_epilogue else 0" in source
    assert '"staged": staged' in source


def test_short_norm_gemm_launch(cupy_selected):
    """ops.linear's short_norm: residual_norm with no tile named and K up to two stages of 64
    columns launches the short residual-norm GEMM (64 x 128 tiles, 128 threads, two stages'
    shared bytes, within half an SM's 228 KiB at every product count); past that K, with a
    tile named, or for another epilogue, the usual kernel."""
    from layerbench.common.cuda_host import cdiv

    m, d = 300, 128
    x = torch.zeros(m, d)
    norm = (torch.zeros(d), torch.zeros(d))
    out = (torch.zeros(m, d, dtype=torch.float16), None)

    def launch(k_cols, epilogue="residual_norm", **kw):
        k = Recorder()
        pair = (torch.zeros(m, k_cols, dtype=torch.float16),) * 2
        extra = {"norm": norm, "norm_out": out} if epilogue == "residual_norm" else {}
        ops.linear(k, pair, weight_pair(torch.zeros(d, k_cols)), torch.zeros(d), epilogue, 3,
                   res=x, out=x, wgmma=True, short_norm=True, **extra, **kw)
        return k.calls[0]
    for products in build.GEMM_PRODUCTS:
        shared = ops.wgmma_shared_bytes(*build.SHORT_NORM_TILE, products,
                                        build.SHORT_NORM_STAGES)
        assert 2 * (shared + 1024) <= 228 * 1024, products
    for k_cols in (8, 64, 128):
        name, grid, block, shared, _ = launch(k_cols)
        assert name == build.short_norm_name(3) == "lb::linear_wgmma<64, 128, 3, 3, 2, 0, 1>"
        assert (grid, block) == ((cdiv(m, 64), 1, 1), 128)
        assert shared == ops.wgmma_shared_bytes(64, 128, 3, build.SHORT_NORM_STAGES)
    assert launch(136)[0] != build.short_norm_name(3)  # three K tiles: the usual kernel
    assert launch(128, tile=(128, 128))[0] == build.wgmma_name((128, 128), 3, "residual_norm")
    assert launch(128, epilogue="residual")[0] != build.short_norm_name(3)


def test_gemm_variants(cupy_selected, monkeypatch):
    """The wgmma GEMM variants: the default first, the plain schedule on the large wgmma
    tile; unique names; every variant's stages fit a block's 227 KiB at one product (the
    others' would not at three, so they have no three-product kernels; two blocks an SM: each
    within half of it); ops.linear launches
    the named variant's kernel (2 BM threads, or 384 for a warp-specialised one's
    linear_wgmma_ws; its shared bytes, a grid of its tiles, or a persistent one's of two
    blocks an SM), the default's where none is
    named, and refuses unknown names, the mma.sync GEMMs, epilogues
    and product counts a variant is not compiled for, and another tile; CupyBackend refuses
    unknown names, and a variant where the wgmma GEMMs do not run; the layer passes the
    variant to each GEMM it fits and None to the others."""
    from layerbench.backends.cupy import CupyBackend
    from layerbench.common.cuda_host import cdiv

    limit = 227 * 1024
    assert build.GEMM_VARIANTS[0] == build.GEMM_PLAIN
    assert build.GEMM_PLAIN.tile == build.WGMMA_TILES[0]
    assert (build.GEMM_PLAIN.stages, build.GEMM_PLAIN.pending) == (3, 0)
    assert len(set(build.gemm_variant_names())) == len(build.GEMM_VARIANTS)
    for v in build.GEMM_VARIANTS:
        blocks = v.blocks_per_sm  # each block's stages within its share of the SM
        assert ops.wgmma_shared_bytes(v.bm, v.bn, 1, v.stages) * blocks <= limit, v
        if v != build.GEMM_PLAIN:
            assert ops.wgmma_shared_bytes(v.bm, v.bn, 3, v.stages) * blocks > limit, v
    m, n, d = 300, 264, 136
    pair = (torch.zeros(m, d, dtype=torch.float16), None)
    wp = weight_pair(torch.zeros(n, d))
    bias, out = torch.zeros(n), torch.zeros(m, n, dtype=torch.float16)
    x = torch.zeros(m, n)
    outputs = {"half": {"out_half": out}, "gelu_pair": {"out_pair": (out, None)},
               "residual": {"res": x, "out": x}}
    for v, epilogue in itertools.product(build.GEMM_VARIANTS, build.GEMM_VARIANT_EPILOGUES):
        k = Recorder()
        ops.linear(k, pair, wp, bias, epilogue, 1, wgmma=True, gemm_variant=v.name,
                   **outputs[epilogue])
        name, grid, block, shared, _ = k.calls[0]
        assert name == build.gemm_variant_name(v, 1, epilogue)
        tiles = (cdiv(m, v.bm), cdiv(n, v.bn), 1)
        if v.persistent:  # blocks_per_sm blocks for each SM (a CPU counts as one SM)
            assert grid == (min(tiles[0] * tiles[1], v.blocks_per_sm), 1, 1) == (2, 1, 1)
        else:
            assert grid == tiles
        assert block == v.threads
        assert block == (build.TMA_TWO_PER_SM_THREADS if v.tma and v.blocks_per_sm == 2
                         else build.WS_THREADS if v.warp_specialised or v.tma else 2 * v.bm)
        if v.tma:  # A's map (boxes of BM rows) and W's (BN rows), appended
            assert k.maps == [((m, d), (d, 1), v.bm), ((n, d), (d, 1), v.bn)], k.maps
            assert [a.dtype for a in k.calls[0][4][-2:]] == [tensor_maps.TENSOR_MAP_DTYPE] * 2
        else:
            assert not k.maps
        assert shared == ops.wgmma_shared_bytes(v.bm, v.bn, 1, v.stages)
    k = Recorder()
    ops.linear(k, pair, wp, bias, "half", 1, wgmma=True, out_half=out, tile=(64, 64))
    assert k.calls[0][0] == build.wgmma_name((64, 64), 1, "half")  # none named: the default
    assert k.calls[0][0].endswith(", 3, 0>")
    wait1 = build.GEMM_WAIT1.name
    for kwargs, match in ((dict(gemm_variant="wgmma 1x1"), "no GEMM variant"),
                          (dict(gemm_variant=wait1, wgmma=False), "needs the wgmma"),
                          (dict(gemm_variant=wait1, products=3), "compiled for"),
                          (dict(gemm_variant=wait1, tile=(64, 64)), "runs tile")):
        args = dict(wgmma=True, products=1) | kwargs
        with pytest.raises(ValueError, match=match):
            ops.linear(Recorder(), pair, wp, bias, "half", args.pop("products"), out_half=out,
                       **args)
    with pytest.raises(ValueError, match="compiled for"):
        ops.linear(Recorder(), pair, weight_pair(torch.zeros(d, d)), torch.zeros(d),
                   "residual_norm", 1, res=x[:, :d], out=x[:, :d], norm=(bias, bias),
                   norm_out=(out, None), wgmma=True, gemm_variant=wait1)
    with pytest.raises(ValueError, match="gemm_variant"):
        CupyBackend(gemm_variant="wgmma 1x1")

    class Hopper:  # stands in for ops.Kernels on an sm_90 device
        has_wgmma, wgmma_problem, programmatic_problem, arch = True, None, None, "90"
    monkeypatch.setattr(ops, "kernels_for", lambda device: Hopper())
    cpu, wide = torch.device("cpu"), build.GEMM_WIDE
    cfg = LayerConfig(2, 12, 512, 4, 64, 1)
    sd = make_reference(cfg, seed=3).state_dict()
    layer = CupyBackend(gemm_variant=wide.name)._build(cfg, sd, cpu, torch.float32)
    assert layer.gemm_variant == wide
    with pytest.raises(Unsupported, match="gemm_variant"):
        CupyBackend(wgmma=False, gemm_variant=wide.name)._build(cfg, sd, cpu, torch.float32)
    # d_model 512 (one product): all but ffn_in (64 columns, narrower than 256) take it
    x_in, mask = make_inputs(cfg, padding_ratio=0.25, seed=6)
    stand = StandIns()
    _, got = _run_stand_ins(cfg, stand, x_in, mask, monkeypatch, gemm_variant=wide.name)
    assert compare(got, reference_forward(make_reference(cfg, seed=5), x_in, mask)).passed
    assert stand.gemm_variants == [("half", 1, 1536, wide.name), ("residual", 1, 512, wide.name),
                                   ("gelu_pair", 1, 64, None), ("residual", 1, 512, wide.name)]
    # a grid with fewer blocks than the device has SMs keeps the default tile
    monkeypatch.setattr(layer_module, "multiprocessor_count", lambda device: 10_000)
    stand = StandIns()
    _run_stand_ins(cfg, stand, x_in, mask, monkeypatch, gemm_variant=wide.name)
    assert all(v is None for *_, v in stand.gemm_variants)
    monkeypatch.setattr(layer_module, "multiprocessor_count", lambda device: 1)
    # d_model 64, three products, fused norms: Q/K/V (one product, 192 columns) alone
    cfg = LayerConfig(2, 20, 64, 2, 64, 2)
    x_in, mask = make_inputs(cfg, padding_ratio=0.25, seed=6)
    stand = StandIns()
    _run_stand_ins(cfg, stand, x_in, mask, monkeypatch, fuse_norms=True, gemm_variant=wait1)
    taken = [(e, v) for e, _, _, v in stand.gemm_variants if v is not None]
    assert taken == [("half", wait1)] * cfg.num_layers, stand.gemm_variants
    stand = StandIns()
    _run_stand_ins(cfg, stand, x_in, mask, monkeypatch, gemm_variant=wide.name)
    assert all(v is None for *_, v in stand.gemm_variants), stand.gemm_variants


def test_two_products(cupy_selected):
    """Two products (a_hi w_hi + a_lo w_hi) are compiled for the epilogues the layer launches
    past one product, on every plain GEMM tile of both families, and not for half (Q/K/V
    runs one product); a stage holds three tiles (A hi and lo, W hi): the shared bytes
    linear_wgmma.cu lists; ops.linear launches them with the weights' lo half unread (None)
    and refuses half; CupyBackend takes linear_products 2 and refuses 4."""
    from layerbench.backends.cupy import CupyBackend

    assert 2 in build.GEMM_PRODUCTS
    for arch in build.ARCHES:
        names = set(build.name_expressions(arch))
        for e in build.EPILOGUES:
            if e != build.NORM_EPILOGUE:
                want = e in build.TWO_PRODUCT_EPILOGUES
                assert all((build.gemm_name(t, 2, e) in names) == want
                           for t in build.GEMM_TILES), (arch, e)
                assert all((build.wgmma_name(t, 2, e) in names) == (want and arch == build.HOPPER)
                           for t in build.WGMMA_TILES), (arch, e)
        assert all((build.wgmma_name(t, 2, build.NORM_EPILOGUE) in names) ==
                   (arch == build.HOPPER) for t in build.NORM_TILES), arch
    assert not build.gemm_compiled("half", 2) and build.gemm_compiled("residual_norm", 2)
    # linear_wgmma.cu's values, and A's lo tile alone added to one product's stages
    assert [ops.wgmma_shared_bytes(bm, bn, 2) for bm, bn in ((128, 128), (64, 128), (64, 64))] \
        == [148480, 99328, 74752]
    for bm, bn in build.WGMMA_TILES + build.NORM_TILES:
        assert (ops.wgmma_shared_bytes(bm, bn, 2) - ops.wgmma_shared_bytes(bm, bn, 1)
                == build.GEMM_PLAIN.stages * bm * 128)
    for bm, bn, _, _ in build.GEMM_TILES:
        assert (ops.linear_shared_bytes(bm, bn, 2) - ops.linear_shared_bytes(bm, bn, 1)
                == ops.STAGES * bm * ops.BK_ROW * 2)
    m, n, d = 300, 136, 128
    pair = (torch.zeros(m, d, dtype=torch.float16), torch.zeros(m, d, dtype=torch.float16))
    w_hi_only = (torch.zeros(n, d, dtype=torch.float16), None)
    out = torch.zeros(m, n, dtype=torch.float16)
    for wgmma, tile in [(False, t) for t in build.GEMM_TILES] + \
            [(True, t) for t in build.WGMMA_TILES]:
        k = Recorder()
        ops.linear(k, pair, w_hi_only, torch.zeros(n), "gelu_pair", 2, out_pair=(out, out),
                   tile=tile, wgmma=wgmma)
        name, _, _, shared, args = k.calls[0]
        want = (build.wgmma_name(tile, 2, "gelu_pair") if wgmma
                else build.gemm_name(tile, 2, "gelu_pair"))
        assert name == want and args[4] is None
        assert shared == (ops.wgmma_shared_bytes(*tile, 2) if wgmma
                          else ops.linear_shared_bytes(*tile[:2], 2))
        with pytest.raises(ValueError, match="not compiled for half at 2"):
            ops.linear(Recorder(), pair, w_hi_only, torch.zeros(n), "half", 2, out_half=out,
                       tile=tile, wgmma=wgmma)
    assert CupyBackend(linear_products=2).linear_products == 2
    with pytest.raises(ValueError, match="1, 2 or 3"):
        CupyBackend(linear_products=4)


# A model of the wgmma attention kernels' schedules (attention_wgmma.cu), in the order every
# thread runs its events: ("copy", buffer, tile) a cp.async of a tile into a buffer
# (("K", 1) is K buffer 1), ("commit",) / ("cp_wait", n) its groups, ("barrier",), ("mma",
# name, registers, buffers read) a wgmma, ("mma_commit",) / ("mma_wait", n) its groups,
# ("touch", registers) other instructions using registers (scores, o, p). Every warpgroup
# runs the same events (warpgroups that skip a tile only read less).
def _cu_constants() -> dict[str, int]:
    """The buffer counts attention_wgmma.cu declares."""
    text = (build.SOURCE_DIR / "attention_wgmma.cu").read_text()
    return {n: int(v) for n, v in
            re.findall(r"constexpr int (K_BUFFERS|V_BUFFERS|PIPELINED_V_BUFFERS) = (\d+);", text)}


def plain_schedule(n_tiles: int, k_buffers: int, v_buffers: int) -> list[tuple]:
    """PIPELINE 0: per tile, S waited for, then P V waited for; two barriers."""
    ev = []
    if n_tiles:
        ev += [("copy", ("Q", 0), 0), ("copy", ("K", 0), 0), ("commit",),
               ("copy", ("V", 0), 0), ("commit",)]
    for it in range(n_tiles):
        ev += [("cp_wait", 1), ("barrier",)]
        if it + 1 < n_tiles:
            ev += [("copy", ("K", (it + 1) % k_buffers), it + 1), ("commit",),
                   ("copy", ("V", (it + 1) % v_buffers), it + 1), ("commit",)]
        else:
            ev += [("commit",), ("commit",)]
        ev += [("mma", f"S{it}", {"s0"}, {(("Q", 0), 0), (("K", it % k_buffers), it)}),
               ("mma_commit",), ("mma_wait", 0), ("touch", {"s0", "o"}),
               ("cp_wait", 2), ("barrier",), ("touch", {"s0", "p", "o"}),
               ("mma", f"PV{it}", {"o", "p"}, {(("V", it % v_buffers), it)}),
               ("mma_commit",), ("mma_wait", 0)]
    return ev + [("cp_wait", 0)]


def pipelined_schedule(n_tiles: int, k_buffers: int, v_buffers: int, top_wait: int = 0,
                       last_wait: int = 0) -> list[tuple]:
    """PIPELINE 1, steps 1-7 of the kernel's comment: S[it + 1] issued before the softmax of
    tile it, P V of it left pending into iteration it + 1 (top_wait, last_wait: the cp.async
    wait of step 1 and the wgmma waits of the last tile, varied by the failing cases)."""
    def scores(j):
        return [("mma", f"S{j}", {f"s{j % 2}"}, {(("Q", 0), 0), (("K", j % k_buffers), j)}),
                ("mma_commit",)]
    if not n_tiles:
        return [("cp_wait", 0)]
    ev = [("copy", ("Q", 0), 0), ("copy", ("K", 0), 0), ("commit",)]
    ev += [("copy", ("K", 1 % k_buffers), 1)] if n_tiles > 1 else []
    ev += [("copy", ("V", 0), 0), ("commit",), ("cp_wait", 1), ("barrier",)]
    ev += scores(0) + [("mma_wait", 0)]
    for it in range(n_tiles):
        last = it == n_tiles - 1
        ev += [("cp_wait", top_wait), ("barrier",)]  # 1
        if it + 2 < n_tiles:  # 2
            ev.append(("copy", ("K", (it + 2) % k_buffers), it + 2))
        if it + 1 < n_tiles:
            ev.append(("copy", ("V", (it + 1) % v_buffers), it + 1))
        ev.append(("commit",))
        ev += [] if last else scores(it + 1)  # 3
        wait = last_wait if last else 1
        ev += [("touch", {f"s{it % 2}"}), ("mma_wait", wait),  # 4, 5
               ("touch", {f"s{it % 2}", "o", "p"}),  # 6
               ("mma", f"PV{it}", {"o", "p"}, {(("V", it % v_buffers), it)}),
               ("mma_commit",), ("mma_wait", wait)]  # 7
    return ev + [("cp_wait", 0)]


def _retire(groups: list, pending: int) -> tuple[list, list]:
    """(groups retired, groups still in flight) by a wait that leaves at most `pending`."""
    n = max(0, len(groups) - pending)
    return groups[:n], groups[n:]


def check_schedule(events: list[tuple], n_tiles: int, expected: list[str] | None = None,
                   chained: frozenset = frozenset()) -> None:
    """Replay events and assert: a wgmma reads a buffer only once it holds the right tile,
    copied, waited for and then past a barrier; no copy lands in a buffer while a wgmma of
    any warpgroup may still read it (retired before the copy's barrier phase: warpgroups are
    not ordered between two barriers); no instruction touches registers of a pending wgmma
    (but a wgmma may accumulate into chained registers behind a pending one: same-shape
    accumulators, ordered by the hardware); every wgmma of expected (default: every S and
    P V) runs once; nothing is left pending."""
    phase = 0
    holds = {}  # buffer -> (tile, phase its copy was waited for, or None while in flight)
    retired_read = {}  # buffer -> last barrier phase in which a wgmma reading it retired
    cp_open, cp_groups = [], []
    mma_open, mma_groups = [], []
    issued = []
    for e in events:
        kind = e[0]
        if kind == "copy":
            _, buf, tile = e
            pending = [m for g in mma_groups + [mma_open] for m in g if buf in m[2]]
            assert not pending, f"{buf} copied while {pending[0][0]} may read it"
            assert retired_read.get(buf, -1) < phase, \
                f"{buf} copied in the barrier phase a wgmma reading it retired"
            holds[buf] = (tile, None)
            cp_open.append(buf)
        elif kind == "commit":
            cp_groups.append(cp_open)
            cp_open = []
        elif kind == "cp_wait":
            done, cp_groups = _retire(cp_groups, e[1])
            for buf in (b for g in done for b in g):
                holds[buf] = (holds[buf][0], phase)
        elif kind == "barrier":
            phase += 1
        elif kind == "mma":
            _, name, regs, reads = e
            for buf, tile in reads:
                held, landed = holds.get(buf, (None, None))
                assert held == tile and landed is not None and landed < phase, \
                    f"{name} reads {buf}: holds tile {held}, waited for in phase {landed}"
            busy = [m for g in mma_groups for m in g if m[1] & regs - chained]
            assert not busy, f"{name} issued on registers of pending {busy[0][0]}"
            mma_open.append((name, regs, {buf for buf, _ in reads}))
            issued.append(name)
        elif kind == "mma_commit":
            mma_groups.append(mma_open)
            mma_open = []
        elif kind == "mma_wait":
            done, mma_groups = _retire(mma_groups, e[1])
            for _, _, bufs in (m for g in done for m in g):
                for buf in bufs:
                    retired_read[buf] = phase
        elif kind == "touch":
            busy = [m for g in mma_groups for m in g if m[1] & e[1]]
            assert not busy, f"registers {sorted(e[1])} touched while {busy[0][0]} is pending"
    assert not cp_open and not cp_groups, "cp.async groups left in flight"
    assert not mma_open and not mma_groups, f"wgmma left pending: {mma_open + mma_groups}"
    if expected is None:
        expected = [f"S{j}" for j in range(n_tiles)] + [f"PV{j}" for j in range(n_tiles)]
    assert sorted(issued) == sorted(expected)


def test_attention_schedules_keep_buffers_safe(cupy_selected):
    """The buffer counts of attention_wgmma.cu are those the host sizes shared memory by, and
    with them both schedules pass check_schedule for 0 to 9 key tiles."""
    assert _cu_constants() == {"K_BUFFERS": ops.K_BUFFERS, "V_BUFFERS": ops.V_BUFFERS,
                               "PIPELINED_V_BUFFERS": ops.PIPELINED_V_BUFFERS}
    for n in range(10):
        check_schedule(plain_schedule(n, ops.K_BUFFERS, ops.V_BUFFERS), n)
        check_schedule(pipelined_schedule(n, ops.K_BUFFERS, ops.PIPELINED_V_BUFFERS), n)


@pytest.mark.parametrize("mistake", [dict(v_buffers=2), dict(top_wait=1), dict(last_wait=1)],
                         ids=["two-V-buffers", "cp-wait-1", "last-wgmma-wait-1"])
def test_attention_schedule_model_catches_mistakes(cupy_selected, mistake):
    """check_schedule fails the pipelined schedule with two V buffers (a copy over the V a
    pending P V reads), a cp.async wait that leaves a needed tile in flight, or a wgmma wait
    on the last tile that leaves P V of the tile before pending."""
    args = dict(k_buffers=ops.K_BUFFERS, v_buffers=ops.PIPELINED_V_BUFFERS) | mistake
    with pytest.raises(AssertionError):
        for n in range(1, 6):
            check_schedule(pipelined_schedule(n, **args), n)


# A model of linear_wgmma's K loop (the schedule above the kernel in linear_wgmma.cu), in
# check_schedule's events: stage s holds the A and W tiles of one K tile, read by that tile's
# wgmma group T<kt>, which accumulates into acc; the epilogue touches acc.
def gemm_schedule(k_tiles: int, stages: int, pending: int, distance: int | None = None,
                  cp_wait: int | None = None, final_wait: bool = True) -> list[tuple]:
    """Steps 1-4 of the kernel's comment for k_tiles K tiles; distance (default STAGES - 1 -
    PENDING, as the kernel), cp_wait (default distance - 1) and the wgmma wait 0 after the
    loop varied by the failing cases."""
    distance = stages - 1 - pending if distance is None else distance
    cp_wait = distance - 1 if cp_wait is None else cp_wait
    ev = []
    for s in range(distance):
        ev += [("copy", ("stage", s % stages), s)] if s < k_tiles else []
        ev.append(("commit",))
    for kt in range(k_tiles):
        ev += [("cp_wait", cp_wait), ("barrier",),  # 1
               ("mma", f"T{kt}", {"acc"}, {(("stage", kt % stages), kt)}), ("mma_commit",)]
        nxt = kt + distance  # 3
        ev += [("copy", ("stage", nxt % stages), nxt)] if nxt < k_tiles else []
        ev += [("commit",), ("mma_wait", pending)]  # 4
    if pending and final_wait:
        ev.append(("mma_wait", 0))
    return ev + [("cp_wait", 0), ("touch", {"acc"})]


def check_gemm_schedule(k_tiles: int, stages: int, pending: int, **mistake) -> None:
    """check_schedule on gemm_schedule: every tile's group once, accumulators chained."""
    check_schedule(gemm_schedule(k_tiles, stages, pending, **mistake), k_tiles,
                   expected=[f"T{kt}" for kt in range(k_tiles)], chained=frozenset({"acc"}))


def test_gemm_schedules_keep_stages_safe(cupy_selected):
    """linear_wgmma's loop is the one gemm_schedule models (prefetch distance STAGES - 1 -
    PENDING, cp.async wait DISTANCE - 1, wgmma wait PENDING, wait 0 after the loop where
    PENDING), and with every variant's stages and pending groups (build.GEMM_VARIANTS, the
    template arguments of its kernels; the warp-specialised ones have their own model) it
    passes check_schedule for 1 to 10 K tiles."""
    text = (build.SOURCE_DIR / "linear_wgmma.cu").read_text()
    for line in ("constexpr int DISTANCE = STAGES - 1 - PENDING;",
                 "for (int s = 0; s < DISTANCE; ++s) {", "cp_async_wait<DISTANCE - 1>();",
                 "int next = kt + DISTANCE;",
                 "if (next < k_tiles) load_stage(next % STAGES, next);",
                 "wd::wgmma_wait<PENDING>();", "if constexpr (PENDING > 0) {"):
        assert line in text, line
    names = build.name_expressions(build.HOPPER)
    for v in build.GEMM_VARIANTS:
        if v.warp_specialised or v.tma:  # their own ring models (test_ws_gemm_ring_...,
            continue  # test_tma_gemm_ring_...)
        assert v.distance == v.stages - 1 - v.pending >= 1
        assert build.gemm_variant_name(v, 1, "half") in names
        assert build.gemm_variant_name(v, 1, "half").endswith(f", {v.stages}, {v.pending}>")
        for k_tiles in range(1, 11):
            check_gemm_schedule(k_tiles, v.stages, v.pending)


@pytest.mark.parametrize("mistake", [dict(distance=3), dict(stages=3), dict(cp_wait=2),
                                     dict(final_wait=False)],
                         ids=["distance-stages-1", "three-stages", "cp-wait-distance",
                              "no-final-wait"])
def test_gemm_schedule_model_catches_mistakes(cupy_selected, mistake):
    """check_schedule fails the wait-1 schedule (4 stages) when it copies STAGES - 1 tiles
    ahead (over the stage the pending group reads), runs on 3 stages at distance 2 (the
    same), waits for one cp.async group too few (the tile read may be in flight), or leaves
    the last group pending into the epilogue."""
    args = dict(stages=build.GEMM_WAIT1.stages, pending=build.GEMM_WAIT1.pending) | mistake
    if "stages" in mistake:
        args["distance"] = build.GEMM_WAIT1.distance
    with pytest.raises(AssertionError):
        for k_tiles in range(1, 11):
            check_gemm_schedule(k_tiles, **args)


# A model of linear_wgmma_ws's mbarrier ring (the schedule above linear_wgmma_ws in
# linear_wgmma.cu): the producer warpgroup and the two consumer warpgroups are generators of
# their events in program order, each standing for its 128 threads (one arrive: 128
# arrivals), run interleaved by a scheduler that may pick any warpgroup not blocked in an
# mbarrier wait. Events: ("wait", barrier, parity) try_wait.parity in a loop; ("arrive",
# barrier); ("copy", stage, tile) / ("commit",) / ("cp_wait", n) / ("fence",) the producer's
# cp.async and proxy fence; ("mma", stage, tile) / ("mma_commit",) / ("mma_wait", n) a
# consumer's wgmma group; ("epilogue",) the accumulators read. Copies land and wgmma groups
# complete as late as allowed (at the wait that retires them), the worst case for the checks.
WS_COUNTS = {"full": 128, "empty": 256}  # the kernel's mbarrier_init counts


def ws_producer(k_tiles: int, stages: int, cp_wait: int = 1, fence: bool = True,
                empty_flip: int = 1):
    """The producer's steps 1-3 and drain (cp_wait: step 3's cp.async wait; fence: the proxy
    fence; empty_flip: the parity of the empty wait is (r & 1) ^ empty_flip)."""
    for kt in range(k_tiles):
        s, r = kt % stages, kt // stages
        yield ("wait", ("empty", s), (r & 1) ^ empty_flip)  # 1
        yield ("copy", s, kt)  # 2
        yield ("commit",)
        if kt > 0:  # 3
            yield ("cp_wait", cp_wait)
            yield from [("fence",)] if fence else []
            yield ("arrive", ("full", (kt - 1) % stages))
    if k_tiles:
        yield ("cp_wait", 0)
        yield from [("fence",)] if fence else []
        yield ("arrive", ("full", (k_tiles - 1) % stages))


def ws_consumer(k_tiles: int, stages: int, release_early: bool = False, full_flip: int = 0,
                first: int = 0):
    """A consumer's steps 1-3 and the end (release_early: arrive on empty of tile kt right
    after its commit, before any wgmma wait; full_flip: the parity of the full wait is
    (r & 1) ^ full_flip; first: the ring's K tiles before these, which are the ring's first
    + 0 .. first + k_tiles - 1)."""
    for kt in range(first, first + k_tiles):
        s, r = kt % stages, kt // stages
        yield ("wait", ("full", s), (r & 1) ^ full_flip)  # 1
        yield ("mma", s, kt)  # 2
        yield ("mma_commit",)
        if release_early:
            yield ("arrive", ("empty", s))
        yield ("mma_wait", 1)  # 3
        if kt > first and not release_early:
            yield ("arrive", ("empty", (kt - 1) % stages))
    yield ("mma_wait", 0)
    if k_tiles and not release_early:
        yield ("arrive", ("empty", (first + k_tiles - 1) % stages))
    yield ("epilogue",)


def check_ws_ring(k_tiles: int, stages: int, pick, **mistake) -> None:
    """Run the three warpgroups, pick(runnable names) choosing who steps next, and assert: a
    wgmma reads a stage only while it holds the tile wanted, its copies landed and then
    fenced; no copy lands in a stage while a wgmma group of either consumer may read it, nor
    before both consumers have read the tile it holds; each consumer reads every tile once,
    in order, and no wgmma is pending at its epilogue; no cp.async group is left in flight;
    every warpgroup finishes (no deadlock)."""
    producer = {k: v for k, v in mistake.items() if k in ("cp_wait", "fence", "empty_flip")}
    consumer = {k: v for k, v in mistake.items() if k in ("release_early", "full_flip")}
    agents = {"P": ws_producer(k_tiles, stages, **producer)}
    agents |= {f"C{c}": ws_consumer(k_tiles, stages, **consumer) for c in range(2)}
    nxt = {name: next(gen, None) for name, gen in agents.items()}
    arrivals = {(kind, s): 0 for kind in WS_COUNTS for s in range(stages)}
    phases = dict.fromkeys(arrivals, 0)  # completed phases of each mbarrier
    stage = {}  # stage -> [tile, "flight" | "landed" | "fenced"]
    cp_open, cp_groups = [], []
    mma_open = {c: [] for c in ("C0", "C1")}  # (stage, tile) of the uncommitted wgmmas
    mma_groups = {c: [] for c in ("C0", "C1")}  # committed groups still running
    read = {c: [] for c in ("C0", "C1")}  # tiles read, in order

    def runnable(name):
        e = nxt[name]
        return e is not None and (e[0] != "wait" or phases[e[1]] % 2 != e[2])

    while any(e is not None for e in nxt.values()):
        ready = [n for n in agents if runnable(n)]
        assert ready, f"deadlock: {nxt}"
        name = pick(ready)
        e = nxt[name]
        kind = e[0]
        if kind == "arrive":
            arrivals[e[1]] += 128
            if arrivals[e[1]] == WS_COUNTS[e[1][0]]:
                arrivals[e[1]], phases[e[1]] = 0, phases[e[1]] + 1
        elif kind == "copy":
            _, s, tile = e
            busy = [c for c in mma_open for g in mma_groups[c] + [mma_open[c]] for m in g
                    if m[0] == s]
            assert not busy, f"tile {tile} copied into stage {s} while {busy[0]} may read it"
            if s in stage:
                unread = [c for c in read if stage[s][0] not in read[c]]
                assert not unread, f"tile {tile} copied over tile {stage[s][0]} unread by {unread}"
            stage[s] = [tile, "flight"]
            cp_open.append(s)
        elif kind == "commit":
            cp_groups.append(cp_open)
            cp_open = []
        elif kind == "cp_wait":
            done, cp_groups = _retire(cp_groups, e[1])
            for s in (s for g in done for s in g):
                stage[s][1] = "landed"
        elif kind == "fence":
            for held in stage.values():
                held[1] = "fenced" if held[1] == "landed" else held[1]
        elif kind == "mma":
            _, s, tile = e
            held = stage.get(s, [None, None])
            assert held == [tile, "fenced"], f"{name} reads tile {tile} from stage {s}: {held}"
            mma_open[name].append((s, tile))
            read[name].append(tile)
        else:
            _wgmma_group_event(name, e, mma_open, mma_groups)
        nxt[name] = next(agents[name], None)
    assert not cp_open and not cp_groups, "cp.async groups left in flight"
    assert all(r == list(range(k_tiles)) for r in read.values()), read


def _wgmma_group_event(name, e, mma_open, mma_groups) -> None:
    """A consumer's wgmma commit, wait or epilogue in the ring models: a commit closes its
    open group, a wait retires all but e[1] groups, the epilogue finds none pending (other
    events, such as barrier waits, change nothing here)."""
    kind = e[0]
    if kind == "mma_commit":
        mma_groups[name].append(mma_open[name])
        mma_open[name] = []
    elif kind == "mma_wait":
        mma_groups[name] = _retire(mma_groups[name], e[1])[1]
    elif kind == "epilogue":
        assert not mma_open[name] and not mma_groups[name], f"{name}: wgmma pending"


def ws_picks(seeds: int = 20):
    """Schedulers: the producer first, the consumers first, the warpgroups first with TMA
    copies landing newest first, and seeded random choices."""
    import random

    yield lambda ready: ready[0]  # P first
    yield lambda ready: ready[-1]  # C1, then C0, then P
    # warpgroups before landings (TMA copies, named L...), those newest first: an early copy
    # lands as late as it can
    yield lambda ready: ([n for n in ready if not n.startswith("L")] or ready)[-1]
    for seed in range(seeds):
        yield random.Random(seed).choice


def assert_in_order(text: str, lines) -> None:
    """Each of lines occurs in text, after the one before it."""
    at = 0
    for line in lines:
        found = text.find(line, at)
        assert found >= 0, line
        at = found + len(line)


def check_consumer_source() -> None:
    """consume_stages (linear_wgmma.cu), the consumers of both ring kernels, is the model's
    ws_consumer: these lines, in this order (first: the ring's K tiles before this call's)."""
    text = (build.SOURCE_DIR / "linear_wgmma.cu").read_text()
    text = text[text.index("void consume_stages("):text.index("}  // namespace wgmma_detail")]
    assert_in_order(text, (
        "const int s = (first + kt) % STAGES;",
        "mbarrier_wait(full0 + 8 * s, ((first + kt) / STAGES) & 1);", "wgmma_fence();",
        "wgmma_commit();", "wgmma_wait<1>();",
        "if (kt > 0) mbarrier_arrive(empty0 + 8 * ((first + kt - 1) % STAGES));",
        "wgmma_wait<0>();",
        "if (k_tiles > 0) mbarrier_arrive(empty0 + 8 * ((first + k_tiles - 1) % STAGES));",
    ))


def test_ws_gemm_ring_keeps_stages_safe(cupy_selected):
    """linear_wgmma_ws is the ring ws_producer and ws_consumer model (the lines below), and
    with every warp-specialised variant's stages (build.GEMM_VARIANTS, the STAGES template
    argument of its kernels) it passes check_ws_ring for 0 to 11 K tiles under every
    scheduler of ws_picks."""
    text = (build.SOURCE_DIR / "linear_wgmma.cu").read_text()
    text = text[text.index("linear_wgmma_ws(const __half*"):
                text.index("// TMA variant of linear_wgmma_ws")]
    for line in ("wd::mbarrier_init(full0 + 8 * s, 128);",
                 "wd::mbarrier_init(empty0 + 8 * s, 256);",
                 "wd::mbarrier_wait(empty0 + 8 * s, ((kt / STAGES) & 1) ^ 1);",
                 "cp_async_wait<1>();", "wd::fence_proxy_async();",
                 "wd::mbarrier_arrive(full0 + 8 * ((kt - 1) % STAGES));",
                 "cp_async_wait<0>();",
                 "wd::mbarrier_arrive(full0 + 8 * ((k_tiles - 1) % STAGES));",
                 "wd::consume_stages<BN, STAGES>(acc, base, full0, empty0, k_tiles, group);"):
        assert line in text, line
    assert text.count("mbarrier_arrive(") == 2 and text.count("__syncthreads()") == 1
    check_consumer_source()
    names = build.name_expressions(build.HOPPER)
    ws = [v for v in build.GEMM_VARIANTS if v.warp_specialised]
    assert ws and build.GEMM_WS_WIDE in ws
    for v in ws:
        assert (v.bm, v.pending, v.threads) == (128, 1, build.WS_THREADS)
        name = build.gemm_variant_name(v, 1, "half")
        assert name in names and name == f"lb::linear_wgmma_ws<{v.bn}, 0, {v.stages}>"
        for k_tiles in range(12):
            for pick in ws_picks():
                check_ws_ring(k_tiles, v.stages, pick)


@pytest.mark.parametrize("mistake", [dict(release_early=True), dict(full_flip=1),
                                     dict(empty_flip=0), dict(fence=False), dict(cp_wait=2),
                                     dict(stages=2)],
                         ids=["release-before-wgmma-wait", "full-parity", "empty-parity",
                              "no-proxy-fence", "cp-wait-2", "two-stages"])
def test_ws_ring_model_catches_mistakes(cupy_selected, mistake):
    """check_ws_ring fails the ring (4 stages, as the 128x256 variant) when a consumer
    releases a stage before its wgmma group is waited for (a copy lands under a running
    wgmma), a consumer waits for the full barrier with the wrong parity (it reads a stage
    before its copies land, or waits forever) or the producer the empty one (deadlock), the
    producer arrives without its proxy fence or with tile kt - 1's copies still in flight, or
    the ring has two stages (deadlock: the producer waits for a release that needs a tile it
    has not announced)."""
    args = dict(stages=build.GEMM_WS_WIDE.stages) | mistake
    with pytest.raises(AssertionError):
        for k_tiles in range(1, 10):
            for pick in ws_picks(5):
                check_ws_ring(k_tiles, pick=pick, **args)


# A model of linear_wgmma_tma's ring (the schedule above linear_wgmma_tma in linear_wgmma.cu):
# agents as in check_ws_ring, the producer one thread. Each mbarrier counts pending arrivals
# and transaction bytes; its phase completes when both reach 0 (the arrivals then re-armed
# to its count). Producer events: ("wait", barrier, parity), ("expect_tx", barrier, bytes) an
# arrive that first adds bytes, ("tma", stage, part, tile, bytes) a TMA copy of part "A" or
# "W" issued, landing later (its bytes then completing on full[stage]) at a moment the
# scheduler picks. Consumer events as ws_consumer's. TMA_COUNTS: the kernel's init counts.
TMA_COUNTS = {"full": 1, "empty": 256}


def tma_tile_bytes(bn: int) -> dict[str, int]:
    """Bytes of the two boxes of one K tile: A 128 x 64 and W BN x 64 halves."""
    return {"A": 128 * 128, "W": bn * 128}


def tma_producer(k_tiles: int, stages: int, bn: int, tx_bytes: int | None = None,
                 wait_empty: bool = True, empty_flip: int = 1, expect_first: bool = True,
                 first: int = 0):
    """The producer thread's steps 1-2 (tx_bytes: the expect_tx count, default both boxes;
    wait_empty: step 1 kept; empty_flip: its parity (r & 1) ^ empty_flip; expect_first: the
    arrive.expect_tx before the copies, else after; first: the ring's K tiles before these)."""
    parts = tma_tile_bytes(bn)
    tx = sum(parts.values()) if tx_bytes is None else tx_bytes
    for kt in range(first, first + k_tiles):
        s, r = kt % stages, kt // stages
        if wait_empty:
            yield ("wait", ("empty", s), (r & 1) ^ empty_flip)  # 1
        copies = [("tma", s, part, kt, size) for part, size in parts.items()]  # 2
        arrive = [("expect_tx", ("full", s), tx)]
        yield from arrive + copies if expect_first else copies + arrive


def check_tma_ring(k_tiles: int, stages: int, bn: int, pick, full_count: int = 1,
                   tiles: int = 1, **mistake) -> None:
    """Run the producer thread, the two consumer warpgroups and the landing of each issued TMA
    copy, pick(runnable names) choosing who steps next, and assert: a wgmma reads a stage
    only while both its boxes hold the tile wanted and have landed; no copy is issued or lands
    in a stage while a wgmma group of either consumer may read it, nor before both consumers
    have read the tile it replaces; each consumer reads every tile once, in order, with no
    wgmma pending at its epilogue; no copy is left in flight; no barrier's transaction bytes
    go below zero at a phase's end; every agent finishes (no deadlock). tiles: output tiles
    of k_tiles K tiles each, one after another (a persistent block), the ring's K tiles
    counted on across them (restart, a mistake: counted from 0 again at each)."""
    restart = mistake.pop("restart", False)
    producer = {k: v for k, v in mistake.items()
                if k in ("tx_bytes", "wait_empty", "empty_flip", "expect_first")}
    consumer = {k: v for k, v in mistake.items() if k in ("release_early", "full_flip")}
    firsts = [0 if restart else t * k_tiles for t in range(tiles)]
    agents = {"P": itertools.chain(*(tma_producer(k_tiles, stages, bn, first=f, **producer)
                                     for f in firsts))}
    agents |= {f"C{c}": itertools.chain(*(ws_consumer(k_tiles, stages, first=f, **consumer)
                                          for f in firsts)) for c in range(2)}
    counts = {(kind, s): full_count if kind == "full" else TMA_COUNTS[kind]
              for kind in TMA_COUNTS for s in range(stages)}
    run_tma_ring(agents, counts, tiles * k_tiles,
                 lambda s, tile: [((s, "A"), tile), ((s, "W"), tile)], pick)


def run_tma_ring(agents: dict, counts: dict, k_tiles: int, reads, pick,
                 trace: list | None = None) -> None:
    """check_tma_ring's scheduler and checks for any TMA ring: agents (name -> generator of
    events; consumers named C0, C1 (and C2)), counts (barrier -> its init count),
    reads(stage, tile) -> the ((stage, part), tile) boxes an ("mma", stage, tile) event
    reads, pick the scheduler. Besides check_tma_ring's events: ("tma", stage, part, tile, bytes, barrier) completes on barrier
    (default ("full", stage)), and ("pass", stage, tile) a consumer's leaving a tile unread
    (it needs none of it) counts as its having read it. The attention ring's also: ("mma",
    stage, tile, gemm) reads reads(stage, tile, gemm) (the tile counts as read at its "PV"),
    and the consumers' named barriers of 256 threads (both warpgroups): ("bar_arrive", id),
    and ("bar_sync", id), an arrive that then waits for the phase to complete; a warpgroup
    arriving twice in one phase, or an arrival left over at the end, fails. trace: where
    given, gets (agent, event) of each agent event as it runs (a sync's wait as ("bar_wait",
    id, phase))."""
    nxt = {name: next(gen, None) for name, gen in agents.items()}
    named = {}  # named barrier id -> {"arrived": warpgroups this phase, "phase": completed}
    bars = {bar: {"pending": count, "tx": 0, "phase": 0} for bar, count in counts.items()}
    stage = {}  # (stage, part) -> [tile, "flight" | "landed"]
    flight = {}  # landing agent name -> (stage, part, tile, bytes, barrier)
    consumers = [name for name in agents if name.startswith("C")]
    mma_open = {c: [] for c in consumers}
    mma_groups = {c: [] for c in consumers}
    read = {c: [] for c in consumers}

    def settle(bar):
        b = bars[bar]
        if b["pending"] == 0 and b["tx"] == 0:
            b["pending"], b["phase"] = counts[bar], b["phase"] + 1

    def runnable(name):
        if name in flight:
            return True
        e = nxt[name]
        if e is not None and e[0] == "bar_wait":
            return named[e[1]]["phase"] > e[2]
        return e is not None and (e[0] != "wait" or bars[e[1]]["phase"] % 2 != e[2])

    def writable(s, part, tile):
        busy = [c for c in mma_open for g in mma_groups[c] + [mma_open[c]] for m in g
                if m[0] == s]
        assert not busy, f"tile {tile} {part} written into stage {s} while {busy[0]} may read it"
        held = stage.get((s, part))
        if held is not None and held[0] != tile:
            unread = [c for c in read if held[0] not in read[c]]
            assert not unread, f"tile {tile} written over tile {held[0]} unread by {unread}"

    while any(e is not None for e in nxt.values()) or flight:
        ready = [n for n in list(agents) + list(flight) if runnable(n)]
        assert ready, f"deadlock: {nxt}, barriers {bars}"
        name = pick(ready)
        if name in flight:  # a TMA copy lands and completes its bytes on its barrier
            s, part, tile, size, bar = flight.pop(name)
            writable(s, part, tile)
            stage[s, part] = [tile, "landed"]
            bars[bar]["tx"] -= size
            settle(bar)
            continue
        e = nxt[name]
        kind = e[0]
        if trace is not None:
            trace.append((name, e))
        if kind in ("bar_arrive", "bar_sync"):
            b = named.setdefault(e[1], {"arrived": set(), "phase": 0})
            assert name not in b["arrived"], f"{name} arrives twice on barrier {e[1]}"
            b["arrived"].add(name)
            phase = b["phase"]
            if len(b["arrived"]) == 2:  # 256 threads
                b["arrived"], b["phase"] = set(), phase + 1
            if kind == "bar_sync":
                nxt[name] = ("bar_wait", e[1], phase)
                continue
        elif kind == "bar_wait":
            pass
        elif kind == "arrive":
            bars[e[1]]["pending"] -= 128
            assert bars[e[1]]["pending"] >= 0, f"too many arrivals on {e[1]}"
            settle(e[1])
        elif kind == "expect_tx":
            b = bars[e[1]]
            b["tx"] += e[2]
            b["pending"] -= 1
            assert b["pending"] >= 0, f"too many arrivals on {e[1]}"
            settle(e[1])
        elif kind == "tma":
            s, part, tile, size = e[1:5]
            bar = e[5] if len(e) > 5 else ("full", s)
            writable(s, part, tile)
            stage[s, part] = [tile, "flight"]
            flight[f"L{s}{part}{tile}"] = (s, part, tile, size, bar)
        elif kind == "mma":
            s, tile = e[1:3]
            for box, want in reads(s, tile, *e[3:]):
                held = stage.get(box)
                assert held == [want, "landed"], f"{name} reads tile {want} from {box}: {held}"
            mma_open[name].append((s, tile))
            if e[3:] in ((), ("PV",)):
                read[name].append(tile)
        elif kind == "pass":
            read[name].append(e[2])
        elif kind == "done":  # registers of tile e[1] used: none of its wgmmas pending
            pending = [m for g in mma_groups[name] + [mma_open[name]] for m in g]
            assert all(m[1] != e[1] for m in pending), f"{name} uses tile {e[1]}: {pending}"
        else:
            _wgmma_group_event(name, e, mma_open, mma_groups)
        nxt[name] = next(agents[name], None)
    assert all(r == list(range(k_tiles)) for r in read.values()), read
    assert all(b["tx"] == 0 for b in bars.values()), bars
    assert all(not b["arrived"] for b in named.values()), f"arrivals left over: {named}"


def test_tma_gemm_ring_keeps_stages_safe(cupy_selected):
    """linear_wgmma_tma is the ring tma_producer and ws_consumer model (the lines below: full
    barriers of one arrival, expect_tx of both boxes' bytes before the two copies, the
    consumers as linear_wgmma_ws's), and with every TMA variant's stages and width it passes
    check_tma_ring for 0 to 11 K tiles under every scheduler of ws_picks."""
    text = (build.SOURCE_DIR / "linear_wgmma.cu").read_text()
    text = text[text.index("linear_wgmma_tma(const __half*"):]
    for line in ("constexpr int STAGE = A_TILE + W_TILE;",
                 "wd::mbarrier_init(full0 + 8 * s, 1);",
                 "wd::mbarrier_init(empty0 + 8 * s, 256);", "wd::fence_mbarrier_init();",
                 "if (threadIdx.x == PRODUCER_THREAD)",
                 "wd::consume_stages<BN, STAGES>(acc, base, full0, empty0, k_tiles, group, done);",
                 "compute_tile(m0, n0, 0);", "compute_tile(at.x, at.y, done);"):
        assert line in text, line
    # both producers copy through produce_tile; the persistent ones walk the tiles in turn
    assert text.count("wd::produce_tile<STAGES, A_TILE, STAGE>(") == 2
    assert text.count("k_tiles, done, at.x, at.y);") == 1
    assert text.count("k_tiles, 0, m0, n0);") == 1
    assert text.count("for (int tile = blockIdx.x; tile < tile_end; tile += gridDim.x, "
                      "done += k_tiles) {") == 2  # producer and consumers
    assert text.count("__syncthreads()") == 1 and "mbarrier_arrive" not in text
    assert "tma_load_2d(" not in text and "cp_async" not in text
    producer = (build.SOURCE_DIR / "linear_wgmma.cu").read_text()
    producer = producer[producer.index("void produce_tile("):]
    producer = producer[:producer.index("\n}\n")]
    assert_in_order(producer, ("for (int k = 0; k < k_tiles; ++k) {",
                               "const int kt = done + k, s = kt % STAGES;",
                               "mbarrier_wait(empty0 + 8 * s, ((kt / STAGES) & 1) ^ 1);",
                               "mbarrier_arrive_expect_tx(full, STAGE);",
                               "tma_load_2d(st, a_map, full, k * BK, m0);",
                               "tma_load_2d(st + A_TILE, w_map, full, k * BK, n0);"))
    assert producer.count("tma_load_2d(") == 2 and producer.count("mbarrier_arrive") == 1
    check_consumer_source()
    # the staged epilogue overwrites the stages: only after every consumer's last full wait
    # and wgmma (consume_stages, then a barrier of both consumers), with no producer copy left
    # (one output tile a block: not persistent)
    assert 'static_assert(!STAGED || (BLOCKS == 2 && !PERSISTENT)' in text
    assert_in_order(text, ("wd::consume_stages<BN, STAGES>(acc, base, full0, empty0, k_tiles, "
                           "group, done);", "if constexpr (STAGED)",
                           "wd::store_tile_staged<EPI>("))
    source = (build.SOURCE_DIR / "linear_wgmma.cu").read_text()

    def body(signature: str) -> str:
        """The text of the function whose definition starts with signature."""
        text = source[source.index(signature):]
        return text[:text.index("\n}\n")]
    staging = body("void stage_accumulators(")
    assert_in_order(staging, ("named_sync<2 * BM>(1);", "*reinterpret_cast<float2*>(mine",
                              "named_sync<2 * BM>(1);"))
    assert staging.count("named_sync<2 * BM>(1);") == 2
    eight = body("void store_tile_staged_eight(")
    for staged, reads in ((body("void store_tile_staged("),
                           "*reinterpret_cast<const float4*>(tile"),
                          (eight, "store_rows_eight<EPI, BM, true>(tile")):
        assert_in_order(staged, ("stage_accumulators<BM>(acc, tile, group, warp, lane);", reads))
        assert "named_sync" not in staged
    assert "store_rows_eight<EPI, BM, false>(tile" in eight
    rows = body("void store_rows_eight(")
    assert "*reinterpret_cast<const float4*>(tile" in rows and "named_sync" not in rows
    names = build.name_expressions(build.HOPPER)
    tma = [v for v in build.GEMM_VARIANTS if v.tma]
    assert {build.GEMM_TMA_WIDE, build.GEMM_TMA, build.GEMM_TMA_TWO_PER_SM} <= set(tma)
    for v in tma:
        two = v.blocks_per_sm == 2
        assert (v.bm, v.pending, v.threads, v.warp_specialised) == (
            128, 1, build.TMA_TWO_PER_SM_THREADS if two else build.WS_THREADS, False)
        name = build.gemm_variant_name(v, 1, "half")
        assert name in names and name == (f"lb::linear_wgmma_tma<{v.bn}, 0, {v.stages}"
                                          f"{', 2' if two else ''}"
                                          f"{', 1' if v.persistent else ''}"
                                          f"{', 0, 1' if v.staged_epilogue else ''}>")
        for k_tiles in range(12):
            for pick in ws_picks():
                check_tma_ring(k_tiles, v.stages, v.bn, pick)
        if v.persistent:  # a block's output tiles one after another, the ring running on
            for tiles, k_tiles in ((2, 1), (3, 2), (2, 5), (4, 3)):
                for pick in ws_picks():
                    check_tma_ring(k_tiles, v.stages, v.bn, pick, tiles=tiles)
    for stages in (2, 3):  # the fewest stages the kernel allows still run
        for pick in ws_picks(5):
            check_tma_ring(7, stages, 256, pick)


@pytest.mark.parametrize("mistake", [dict(tx_bytes=128 * 128), dict(tx_bytes=3 * 128 * 256),
                                     dict(wait_empty=False), dict(empty_flip=0),
                                     dict(full_flip=1), dict(release_early=True),
                                     dict(full_count=2), dict(stages=1),
                                     dict(tiles=3, restart=True)],
                         ids=["expect-tx-A-only", "expect-tx-too-many", "no-empty-wait",
                              "empty-parity", "full-parity", "release-before-wgmma-wait",
                              "full-count-2", "one-stage", "persistent-count-restarts"])
def test_tma_ring_model_catches_mistakes(cupy_selected, mistake):
    """check_tma_ring fails the 128x256 TMA ring (4 stages) when expect_tx announces A's
    bytes alone (the phase completes before W lands: a wgmma reads W in flight) or more than
    land (deadlock), the producer skips or mis-parities its empty wait (a copy lands under
    a wgmma, or deadlock), a consumer mis-parities its full wait or releases a stage before
    its wgmma wait, full barriers count two arrivals (deadlock), the ring has one stage, or a
    persistent block counts its K tiles from 0 again at each output tile."""
    args = dict(stages=build.GEMM_TMA_WIDE.stages, bn=build.GEMM_TMA_WIDE.bn) | mistake
    with pytest.raises(AssertionError):
        for k_tiles in range(1, 10):
            for pick in ws_picks(5):
                check_tma_ring(k_tiles, pick=pick, **args)


# A model of flash_attention_wgmma_tma's ring (the schedule above it in attention_wgmma.cu), run
# by run_tma_ring: the producer thread loads Q once (its own barrier ("q", 0), count 1), then
# each key tile's K and V boxes into stage it % stages; each consumer warpgroup waits for Q,
# then per tile waits full, computes S and P V (one wgmma group here, waited for: it reads Q
# and the stage's K and V) or passes a tile it sees none of, and arrives on empty.
def attention_tma_bytes(hp: int = 64) -> dict[str, int]:
    """Bytes of the Q box (128 rows) and of one K or V box (64 rows) of hp halves a row."""
    return {"Q": 128 * hp * 2, "K": 64 * hp * 2, "V": 64 * hp * 2}


def attention_tma_producer(n_tiles: int, stages: int, kv_tx: int | None = None,
                           wait_empty: bool = True, q_expect: bool = True):
    """The producer thread (kv_tx: a tile's expect_tx count, default both boxes; wait_empty:
    step 1 kept; q_expect: Q's arrive.expect_tx kept)."""
    size = attention_tma_bytes()
    if not n_tiles:
        return
    if q_expect:
        yield ("expect_tx", ("q", 0), size["Q"])
    yield ("tma", "Q", "Q", 0, size["Q"], ("q", 0))
    for it in range(n_tiles):
        s, r = it % stages, it // stages
        if wait_empty:
            yield ("wait", ("empty", s), (r & 1) ^ 1)  # 1
        yield ("expect_tx", ("full", s), size["K"] + size["V"] if kv_tx is None else kv_tx)
        yield ("tma", s, "K", it, size["K"])  # 2
        yield ("tma", s, "V", it, size["V"])


def attention_tma_consumer(n_tiles: int, stages: int, skip=(), wait_q: bool = True,
                           wait_on_skip: bool = True, release_early: bool = False):
    """A consumer warpgroup, skip the tiles it sees none of (wait_q: its wait for Q kept;
    wait_on_skip: its full wait kept on a skipped tile; release_early: arrive on empty
    right after the commit, before the wgmma wait)."""
    if n_tiles and wait_q:
        yield ("wait", ("q", 0), 0)
    for it in range(n_tiles):
        s, r = it % stages, it // stages
        if wait_on_skip or it not in skip:
            yield ("wait", ("full", s), r & 1)  # 1
        if it in skip:
            yield ("pass", s, it)
        else:  # 2
            yield ("mma", s, it)
            yield ("mma_commit",)
            if release_early:
                yield ("arrive", ("empty", s))
            yield ("mma_wait", 0)
        if not (release_early and it not in skip):
            yield ("arrive", ("empty", s))  # 3
    yield ("epilogue",)


def check_attention_tma_ring(n_tiles: int, stages: int, pick, skips=((), ()),
                             **mistake) -> None:
    """run_tma_ring's checks on the attention ring, consumer c skipping the tiles skips[c]:
    a wgmma reads Q and the stage's K and V only once they hold the tiles wanted and have
    landed, no box lands under a wgmma or over a tile a consumer still needs, no deadlock."""
    producer = {k: v for k, v in mistake.items() if k in ("kv_tx", "wait_empty", "q_expect")}
    consumer = {k: v for k, v in mistake.items()
                if k in ("wait_q", "wait_on_skip", "release_early")}
    agents = {"P": attention_tma_producer(n_tiles, stages, **producer)}
    agents |= {f"C{c}": attention_tma_consumer(n_tiles, stages, skips[c], **consumer)
               for c in range(2)}
    run_attention_ring(agents, n_tiles, stages, pick)


def attention_ring_reads(s: int, tile: int, gemm: str | None = None):
    """The boxes a wgmma reads: S Q and K of stage s, P V its V, one group of both all
    three."""
    q, k, v = (("Q", "Q"), 0), ((s, "K"), tile), ((s, "V"), tile)
    return {"S": [q, k], "PV": [v], None: [q, k, v]}[gemm]


def run_attention_ring(agents: dict, n_tiles: int, stages: int, pick,
                       trace: list | None = None) -> None:
    """run_tma_ring with the attention ring's barriers (q, full and empty: 128 arrivals a
    consumer) and reads."""
    consumers = sum(name.startswith("C") for name in agents)
    counts = {("q", 0): 1} | {(kind, s): 1 if kind == "full" else 128 * consumers
                              for kind in TMA_COUNTS for s in range(stages)}
    run_tma_ring(agents, counts, n_tiles, attention_ring_reads, pick, trace)


# The consumers of the ping-pong and overlap schedules (above flash_attention_wgmma_tma, their
# steps numbered as there): of k consumers, warpgroup c's turn is named barrier 1 + c, the
# next one's 1 + (c + 1) % k.
def attention_pingpong_consumer(c: int, n_tiles: int, stages: int, skip=(), k: int = 2,
                                first_turn: bool = True, turn_on_skip: bool = True,
                                last_arrive: tuple | None = None,
                                early_handover: bool = False):
    """Ping-pong consumer c of k, skipping the tiles skip (first_turn: the last consumer's
    first arrive kept; turn_on_skip: a skipped tile's arrive and sync kept; last_arrive: the
    warpgroups arriving after the loop, default all but the last; early_handover: the turn
    handed over before S is issued)."""
    mine, other = 1 + c, 1 + (c + 1) % k
    last_arrive = tuple(range(k - 1)) if last_arrive is None else last_arrive
    if n_tiles:
        yield ("wait", ("q", 0), 0)
    if c == k - 1 and first_turn:
        yield ("bar_arrive", 1)
    yield ("bar_sync", mine)  # 0
    for it in range(n_tiles):
        s, r = it % stages, it // stages
        yield ("wait", ("full", s), r & 1)  # 1
        if it not in skip:
            if early_handover:
                yield ("bar_arrive", other)
            yield from [("mma", s, it, "S"), ("mma_commit",)]  # 2
            if not early_handover:
                yield ("bar_arrive", other)
            yield ("mma_wait", 0)  # 3
            yield ("done", it)
            yield from [("mma", s, it, "PV"), ("mma_commit",)]  # 4
            yield ("bar_sync", mine)
            yield ("mma_wait", 0)  # 5
        else:
            if turn_on_skip:
                yield from [("bar_arrive", other), ("bar_sync", mine)]
            yield ("pass", s, it)
        yield ("arrive", ("empty", s))  # 6
    if c in last_arrive:
        yield ("bar_arrive", other)  # 7
    yield ("epilogue",)


def first_scores_turn(c: int, k: int):
    """The overlap consumers' step 0 (consumer c of k): wait for Q and tile 0, take the first
    turn (the last consumer hands it to warpgroup 0 first), issue S of tile 0, hand the turn
    on and wait for S."""
    yield ("wait", ("q", 0), 0)
    if c == k - 1:
        yield ("bar_arrive", 1)
    yield ("wait", ("full", 0), 0)
    yield ("bar_sync", 1 + c)
    yield from [("mma", 0, 0, "S"), ("mma_commit",), ("bar_arrive", 1 + (c + 1) % k),
                ("mma_wait", 0)]


def attention_overlap_consumer(c: int, n_tiles: int, stages: int, k: int = 2,
                               release_early: bool = False, s_wait: int = 0,
                               last_arrive: tuple | None = None):
    """Overlap consumer c of k, computing every tile (release_early: stage it - 1 released
    before the wait for its P V; s_wait: added to step 3's wait count; last_arrive: the
    warpgroups handing the turn over in the last iteration, default all but the last)."""
    if not n_tiles:
        yield ("epilogue",)
        return
    mine, other = 1 + c, 1 + (c + 1) % k
    last_arrive = tuple(range(k - 1)) if last_arrive is None else last_arrive
    yield from first_scores_turn(c, k)
    for it in range(n_tiles):
        first, ahead = it == 0, it + 1 < n_tiles
        nxt = (it + 1) % stages
        if ahead:
            yield ("wait", ("full", nxt), ((it + 1) // stages) & 1)  # 1
        yield ("bar_sync", mine)  # 2
        if not first:
            yield from [("mma", (it - 1) % stages, it - 1, "PV"), ("mma_commit",)]
        if ahead:
            yield from [("mma", nxt, it + 1, "S"), ("mma_commit",)]
        if ahead or c in last_arrive:
            yield ("bar_arrive", other)
        yield ("mma_wait", (not first) + ahead + s_wait)  # 3
        yield ("done", it)  # 4: the softmax reads S[it]
        if release_early and not first:
            yield ("arrive", ("empty", (it - 1) % stages))
        yield ("mma_wait", int(ahead))  # 5
        if not first:
            yield ("done", it - 1)
            if not release_early:
                yield ("arrive", ("empty", (it - 1) % stages))
    last = (n_tiles - 1) % stages  # 7
    yield from [("mma", last, n_tiles - 1, "PV"), ("mma_commit",), ("mma_wait", 0),
                ("done", n_tiles - 1), ("arrive", ("empty", last)), ("epilogue",)]


def attention_packed_consumer(c: int, n_tiles: int, stages: int, k: int = 2,
                              release_early: bool = False, s_wait: int = 0,
                              last_arrive: tuple | None = None, pack_early: bool = False):
    """Packed-overlap consumer c of k (TMA_OVERLAP_PACKED), computing every tile
    (release_early: stage it released before the wait for its P V; s_wait: added to step 3's
    wait count; last_arrive: the warpgroups handing the turn over in the last iteration,
    default all but the last; pack_early: P[it + 1] packed over P[it] before that wait).
    ("done", t): the softmax reads S[t], or the pack overwrites P[t]."""
    if not n_tiles:
        yield ("epilogue",)
        return
    mine, other = 1 + c, 1 + (c + 1) % k
    last_arrive = tuple(range(k - 1)) if last_arrive is None else last_arrive
    yield from first_scores_turn(c, k)
    yield ("done", 0)
    for it in range(n_tiles):
        ahead, st, nxt = it + 1 < n_tiles, it % stages, (it + 1) % stages
        if ahead:
            yield ("wait", ("full", nxt), ((it + 1) // stages) & 1)  # 1
        yield ("bar_sync", mine)  # 2
        if ahead:
            yield from [("mma", nxt, it + 1, "S"), ("mma_commit",)]
        yield from [("mma", st, it, "PV"), ("mma_commit",)]
        if ahead or c in last_arrive:
            yield ("bar_arrive", other)
        if ahead:
            yield ("mma_wait", 1 + s_wait)  # 3
            yield ("done", it + 1)
        if release_early:
            yield ("arrive", ("empty", st))
        if pack_early and ahead:
            yield ("done", it)
        yield ("mma_wait", 0)  # 4
        if not release_early:
            yield ("arrive", ("empty", st))
        if ahead and not pack_early:
            yield ("done", it)
    yield ("epilogue",)


def check_turns(trace: list, n_tiles: int, overlap: bool, k: int = 2,
                packed: bool = False) -> None:
    """The k consumers' turns (from passing the sync on their own barrier to their next arrive
    on the next one's) never overlap and come in order C0, C1, ..., C0, ...; S of tile t is
    issued in its warpgroup's turn t, with overlap P V of tile t < n_tiles - 1 in turn t + 2,
    with packed P V of every tile t in turn t + 1."""
    owner, turns, order = None, {f"C{c}": -1 for c in range(k)}, 0
    for name, e in trace:
        if name not in turns:
            continue
        c = int(name[1])
        if e[0] == "bar_wait" and e[1] == 1 + c:
            assert owner is None, f"{name}'s turn while {owner}'s is open"
            assert c == order % k, f"{name}'s turn out of order ({order})"
            owner, order = name, order + 1
            turns[name] += 1
        elif e[0] == "bar_arrive" and owner == name:
            owner = None
        elif e[0] == "mma":
            tile, gemm = e[2], e[3]
            if gemm == "S":
                assert owner == name and turns[name] == tile, (name, e, turns)
            elif overlap and tile < n_tiles - 1:
                assert owner == name and turns[name] == tile + 2, (name, e, turns)
            elif packed:
                assert owner == name and turns[name] == tile + 1, (name, e, turns)
    assert len(set(turns.values())) == 1, turns


def check_attention_turns(n_tiles: int, stages: int, pick, overlap: bool = False,
                          skips=((), ()), packed: bool = False, **mistake) -> None:
    """run_tma_ring's checks (check_attention_tma_ring's) on the ping-pong (or, overlap, the
    overlap; packed, the packed overlap) consumers, len(skips) of them, consumer c skipping
    the tiles skips[c] (ping-pong), and check_turns: no deadlock, no arrival left over, no
    warpgroup arriving twice in a phase."""
    k = len(skips)
    agents = {"P": attention_tma_producer(n_tiles, stages)}
    for c in range(k):
        if packed:
            agents[f"C{c}"] = attention_packed_consumer(c, n_tiles, stages, k, **mistake)
        elif overlap:
            agents[f"C{c}"] = attention_overlap_consumer(c, n_tiles, stages, k, **mistake)
        else:
            agents[f"C{c}"] = attention_pingpong_consumer(c, n_tiles, stages, skips[c], k,
                                                          **mistake)
    trace = []
    run_attention_ring(agents, n_tiles, stages, pick, trace)
    check_turns(trace, n_tiles, overlap, k, packed)


def attention_skips(n_tiles: int):
    """Skip patterns of the two consumers: none; causal (the first warpgroup's rows precede
    the block's last tile); the second warpgroup past seq_len (it skips every tile)."""
    yield ((), ())
    if n_tiles:
        yield ((n_tiles - 1,), ())
    yield ((), tuple(range(n_tiles)))


def attention_skips3(n_tiles: int):
    """Skip patterns of three consumers (BQ 192): none; causal (the first warpgroup's rows
    precede the block's last two tiles, the second's its last); the third, and the second
    and third, past seq_len."""
    every = tuple(range(n_tiles))
    yield ((), (), ())
    yield (tuple(range(max(0, n_tiles - 2), n_tiles)), tuple(range(max(0, n_tiles - 1),
                                                                   n_tiles)), ())
    yield ((), (), every)
    yield ((), every, every)


def test_attention_tma_ring_keeps_stages_safe(cupy_selected):
    """flash_attention_wgmma_tma is the ring attention_tma_producer and
    attention_tma_consumer model (the lines below, in the kernel's TMA branch), and with
    every TMA variant's stages (and 1 and 2) it passes check_attention_tma_ring for 0 to 9
    key tiles, every skip pattern, under every scheduler of ws_picks."""
    text = (build.SOURCE_DIR / "attention_wgmma.cu").read_text()
    text = text[text.index("if constexpr (PIPELINE == ad::TMA_RING) {"):
                text.index("} else if constexpr (SCHEDULE == ad::TMA_PINGPONG) {")]
    assert_in_order(text, (
        "ad::mbarrier_init(q_full, 1);", "ad::mbarrier_init(full0 + 8 * st, 1);",
        "ad::mbarrier_init(empty0 + 8 * st, 128 * CONSUMERS);", "ad::fence_mbarrier_init();",
        "__syncthreads();", "if (threadIdx.x == 0 && n_tiles > 0) {",
        "ad::mbarrier_arrive_expect_tx(q_full, Q_BYTES);",
        "ad::tma_load_3d(sQ, q_map, q_full, q_col, qb0, b);",
        "ad::mbarrier_wait(empty0 + 8 * st, ((it / KV_STAGES) & 1) ^ 1);",
        "ad::mbarrier_arrive_expect_tx(full, 2 * KV_BYTES);",
        "ad::tma_load_3d(sK + st * KV_BYTES, kv_map, full, k_col, it * BKV, b);",
        "ad::tma_load_3d(sV + st * KV_BYTES, kv_map, full, v_col, it * BKV, b);",
        "if (n_tiles > 0) ad::mbarrier_wait(q_full, 0);",
        "if constexpr (SCHEDULE == ad::TMA_PLAIN) {",
        "ad::mbarrier_wait(full0 + 8 * st, (it / KV_STAGES) & 1);", "if (work) {",
        "issue_scores(s, st);", "ad::wgmma_wait<0>();", "pv_waited(p, s, st);",
        "ad::mbarrier_arrive(empty0 + 8 * st);",
    ))
    # pv_waited, which the branch calls before releasing the stage, waits for its P V
    source = (build.SOURCE_DIR / "attention_wgmma.cu").read_text()
    pv = source[source.index("auto pv_waited = [&]("):]
    pv = pv[:pv.index("};")]
    assert pv.index("issue_pv(p, buf);") < pv.index("ad::wgmma_wait<0>();"), pv
    assert text.count("mbarrier_arrive(") == 1 and text.count("tma_load_3d(") == 3
    assert text.count("__syncthreads()") == 1 and "cp_async" not in text
    assert attention_tma_bytes()["Q"] == 128 * 128 and attention_tma_bytes()["K"] == 64 * 128
    tma = [v for hp, vs in build.ATTENTION_WGMMA.items() for v in vs
           if v.tma and v.schedule == build.TMA_PLAIN]
    assert tma
    for stages in sorted({v.kv_stages for v in tma} | {1, 2}):
        for n_tiles in range(10):
            for skips in attention_skips(n_tiles):
                for pick in ws_picks(8):
                    check_attention_tma_ring(n_tiles, stages, pick, skips)


@pytest.mark.parametrize("mistake", [dict(kv_tx=64 * 128), dict(kv_tx=3 * 64 * 128),
                                     dict(wait_empty=False), dict(q_expect=False),
                                     dict(wait_q=False), dict(wait_on_skip=False),
                                     dict(release_early=True)],
                         ids=["expect-tx-K-only", "expect-tx-too-many", "no-empty-wait",
                              "no-q-expect-tx", "no-q-wait", "no-full-wait-on-skip",
                              "release-before-wgmma-wait"])
def test_attention_tma_ring_model_catches_mistakes(cupy_selected, mistake):
    """check_attention_tma_ring fails the ring (3 stages) when a tile's expect_tx announces
    K's bytes alone (V read in flight) or more than land (deadlock), the producer skips its
    empty wait (a box lands under a wgmma or over a tile still needed) or Q's expect_tx
    (deadlock), a consumer reads Q without waiting for it, arrives on empty for a tile it
    skips without waiting for its full barrier (its arrivals run a round ahead and complete
    the other consumer's phase), or releases a stage before its wgmma wait."""
    with pytest.raises(AssertionError):
        for n_tiles in range(1, 9):
            for skips in attention_skips(n_tiles):
                for pick in ws_picks(5):
                    check_attention_tma_ring(n_tiles, build.WGMMA_TMA.kv_stages, pick, skips,
                                             **mistake)


def test_attention_turns_keep_ring_safe(cupy_selected):
    """The ping-pong, overlap and packed-overlap consumers of flash_attention_wgmma_tma are
    the models attention_pingpong_consumer, attention_overlap_consumer and
    attention_packed_consumer (the lines below, in order, in their branches), and with two
    and three consumers and every such variant's stages (and more; ping-pong and packed also
    2) they pass check_attention_turns for 0 to 9 key tiles (ping-pong: every skip pattern)
    under every scheduler of ws_picks: the ring stays safe, the turns come in order, no
    deadlock."""
    source = (build.SOURCE_DIR / "attention_wgmma.cu").read_text()
    pingpong = source[source.index("} else if constexpr (SCHEDULE == ad::TMA_PINGPONG) {"):
                      source.index("} else {  // the overlap schedules")]
    first_turn = source[source.index("} else {  // the overlap schedules"):
                        source.index("float s_odd[NS];")]
    overlap = source[source.index("float s_odd[NS];"):
                     source.index("} else {  // TMA_OVERLAP_PACKED")]
    packed = source[source.index("} else {  // TMA_OVERLAP_PACKED"):
                    source.index("} else if constexpr (PIPELINE == 0) {")]
    for text, lines in (
            (pingpong, ("const unsigned mine = 1 + group, other = 1 + (group + 1) % CONSUMERS;",
                        "if (group == CONSUMERS - 1) ad::named_arrive(1);",
                        "ad::named_sync(mine);",
                        "ad::mbarrier_wait(full0 + 8 * st, (it / KV_STAGES) & 1);",
                        "if (work) {", "issue_scores(s, st);", "ad::wgmma_commit();",
                        "ad::named_arrive(other);", "ad::wgmma_wait<0>();",
                        "issue_pv(p, st);", "ad::wgmma_commit();", "ad::named_sync(mine);",
                        "ad::wgmma_wait<0>();", "} else {", "ad::named_arrive(other);",
                        "ad::named_sync(mine);", "ad::mbarrier_arrive(empty0 + 8 * st);",
                        "if (group != CONSUMERS - 1) ad::named_arrive(other);")),
            # both overlap schedules: their turns, wait_full and first turn (the models'
            # first_scores_turn)
            (first_turn, ("const unsigned mine = 1 + group, other = 1 + (group + 1) % CONSUMERS;",
                          "ad::mbarrier_wait(full0 + 8 * (it % KV_STAGES), (it / KV_STAGES) & 1);",
                          "auto first_scores_turn = [&]() {",
                          "if (group == CONSUMERS - 1) ad::named_arrive(1);", "wait_full(0);",
                          "ad::named_sync(mine);", "issue_scores(s, 0);", "ad::wgmma_commit();",
                          "ad::named_arrive(other);", "ad::wgmma_wait<0>();", "fence_scores(s);",
                          "if constexpr (SCHEDULE == ad::TMA_OVERLAP) {")),
            (overlap, ("if (ahead) wait_full(it + 1);", "ad::named_sync(mine);",
                       "if (!first) {", "issue_pv(p, (it - 1) % KV_STAGES);",
                       "ad::wgmma_commit();", "if (ahead) {",
                       "issue_scores(next, (it + 1) % KV_STAGES);", "ad::wgmma_commit();",
                       "ad::named_arrive_if(ahead || group != CONSUMERS - 1, other);",
                       "if (!first && ahead) {", "ad::wgmma_wait<2>();",
                       "} else if (!first || ahead) {", "ad::wgmma_wait<1>();",
                       "ad::wgmma_wait<0>();", "fence_scores(cur);",
                       "const bool rows = softmax(0, cur, it * BKV, alpha);",
                       "if (ahead) ad::wgmma_wait<1>(); else ad::wgmma_wait<0>();",
                       "if (!first) ad::mbarrier_arrive(empty0 + 8 * ((it - 1) % KV_STAGES));",
                       "pack(p, cur);", "if (n_tiles > 0) {", "first_scores_turn();",
                       "iteration(1, 0, 0, s, s_odd);", "iteration(1, 1, 0, s, s_odd);",
                       "iteration(0, 1, it, s_odd, s);", "iteration(0, 1, it + 1, s, s_odd);",
                       "iteration(0, 1, it, s_odd, s);", "iteration(0, 0, it + 1, s, s_odd);",
                       "iteration(0, 0, it, s_odd, s);",
                       "const int st = (n_tiles - 1) % KV_STAGES;", "issue_pv(p, st);",
                       "ad::wgmma_commit();", "ad::wgmma_wait<0>();",
                       "ad::mbarrier_arrive(empty0 + 8 * st);")),
            (packed, ("if (ahead) wait_full(it + 1);", "ad::named_sync(mine);",
                      "if (ahead) {", "issue_scores(s, (it + 1) % KV_STAGES);",
                      "ad::wgmma_commit();", "issue_pv(p, it % KV_STAGES);",
                      "ad::wgmma_commit();",
                      "ad::named_arrive_if(ahead || group != CONSUMERS - 1, other);",
                      "if (ahead) {", "ad::wgmma_wait<1>();", "fence_scores(s);",
                      "rows = softmax(0, s, (it + 1) * BKV, alpha);", "ad::wgmma_wait<0>();",
                      "ad::mbarrier_arrive(empty0 + 8 * (it % KV_STAGES));", "if (ahead) {",
                      "pack(p, s);", "if (n_tiles > 0) {", "first_scores_turn();",
                      "if (softmax(0, s, 0, alpha)) rescale(alpha);", "pack(p, s);",
                      "for (; it + 1 < n_tiles; ++it) iteration(1, it);",
                      "iteration(0, it);"))):
        assert_in_order(text, lines)
        assert "__syncthreads()" not in text and "tma_load" not in text
    assert overlap.count("first_scores_turn();") == packed.count("first_scores_turn();") == 1
    assert pingpong.count("mbarrier_arrive(") == 1 and overlap.count("mbarrier_arrive(") == 2
    assert packed.count("mbarrier_arrive(") == 1 and packed.count("issue_pv(") == 1
    # three consumers in the packed order (160 registers): a warp seeing none of a tile runs
    # the softmax with every score masked (P = 0, no rescale) instead of a branch of its own
    assert_in_order(source, (
        "constexpr bool MASK_IDLE = PIPELINE == ad::TMA_RING && BQ == 192 &&",
        "SCHEDULE == ad::TMA_OVERLAP_PACKED;",
        "const bool idle = !(warp_rows && !(causal && kv0 > q0 + 15));",
        "if constexpr (!MASK_IDLE) {", "if (idle) {",
        "if constexpr (MASK_IDLE) edge = edge || idle;", "if (edge) {",
        "if constexpr (MASK_IDLE) ok = ok && !idle;", "if constexpr (MASK_IDLE) {",
        "return !idle;",
    ))
    turns = [v for hp, vs in build.ATTENTION_WGMMA.items() for v in vs
             if v.tma and v.schedule != build.TMA_PLAIN]
    assert {v.schedule for v in turns} == {build.TMA_PINGPONG, build.TMA_OVERLAP,
                                           build.TMA_OVERLAP_PACKED}
    # the packed order with two consumers (BQ 128) and three (BQ 192), every variant's stages
    assert {v.bq for v in turns if v.schedule == build.TMA_OVERLAP_PACKED} == {128, 192}
    stages = {v.kv_stages for v in turns if v.schedule == build.TMA_OVERLAP_PACKED} | {2, 3}
    for st in sorted(stages):
        for k in (2, 3):
            for n_tiles in range(10):
                for pick in ws_picks(8):
                    check_attention_turns(n_tiles, st, pick, skips=((),) * k, packed=True)
    for overlap_ in (False, True):
        for k in (2, 3):
            stages = {v.kv_stages for v in turns if v.bq == 64 * k and v.schedule == (
                build.TMA_OVERLAP if overlap_ else build.TMA_PINGPONG)}
            stages |= {3, 4} if overlap_ else {2, 3}
            for st in sorted(stages):
                for n_tiles in range(10):
                    if overlap_:
                        patterns = [((),) * k]
                    else:
                        patterns = attention_skips(n_tiles) if k == 2 else attention_skips3(
                            n_tiles)
                    for skips in patterns:
                        for pick in ws_picks(8):
                            check_attention_turns(n_tiles, st, pick, overlap_, skips)


@pytest.mark.parametrize("mistake", [
    dict(first_turn=False), dict(turn_on_skip=False), dict(last_arrive=(0, 1)),
    dict(last_arrive=()), dict(early_handover=True), dict(stages=1),
    dict(overlap=True, stages=2), dict(overlap=True, release_early=True),
    dict(overlap=True, s_wait=1), dict(overlap=True, last_arrive=(0, 1)),
    dict(overlap=True, last_arrive=()), dict(k=3, first_turn=False),
    dict(k=3, turn_on_skip=False), dict(k=3, last_arrive=(0,)), dict(k=3, stages=1),
    dict(packed=True, release_early=True), dict(packed=True, s_wait=1),
    dict(packed=True, pack_early=True), dict(packed=True, last_arrive=(0, 1)),
    dict(packed=True, stages=1)],
    ids=["no-first-turn", "skip-without-turn", "both-arrive-last", "none-arrive-last",
         "hand-over-before-S", "pingpong-one-stage", "overlap-two-stages",
         "overlap-release-before-pv-wait", "overlap-softmax-before-S-wait",
         "overlap-both-arrive-last", "overlap-none-arrive-last", "3wg-no-first-turn",
         "3wg-skip-without-turn", "3wg-second-not-arriving-last", "3wg-one-stage",
         "packed-release-before-pv-wait", "packed-softmax-before-S-wait",
         "packed-pack-before-pv-wait", "packed-both-arrive-last", "packed-one-stage"])
def test_attention_turns_model_catches_mistakes(cupy_selected, mistake):
    """check_attention_turns fails the ping-pong ring (3 stages) when warpgroup 1 does not
    give warpgroup 0 the first turn (deadlock), a skipped tile skips the turn's arrive and
    sync (deadlock, or a warpgroup arriving twice in a phase), both or neither warpgroup
    arrives after the loop (an arrival left over; deadlock), the turn is handed over before
    S is issued (turns overlap), or the ring has one stage (deadlock); and the overlap ring
    (5 stages) with two stages (deadlock), a stage released before its P V's wait, the
    softmax reading S before its wait, or the last handover by both or neither; and the
    ping-pong ring of three consumers with such mistakes (k=3); and the packed overlap ring (5
    stages) with a stage released, or P[it + 1] packed over P[it], before the wait for P V of
    it, the softmax reading S before its wait, the last handover by both, or one stage."""
    overlapped = mistake.get("overlap") or mistake.get("packed")
    args = dict(stages=5 if overlapped else 3) | mistake
    k = args.pop("k", 2)
    with pytest.raises(AssertionError):
        for n_tiles in range(1, 9):
            for skips in attention_skips(n_tiles) if k == 2 else attention_skips3(n_tiles):
                for pick in ws_picks(5):
                    if overlapped:
                        skips = ((), ())
                    check_attention_turns(n_tiles, pick=pick, skips=skips, **args)


def fma32(a, b, c):
    """fp32 fmaf(a, b, c), one rounding (to nearest even), of float32 arrays: the product
    exact in float64, the sum's float64 rounding error kept (TwoSum) to settle the float32
    ties it would otherwise round twice."""
    prod = a.astype(np.float64) * b.astype(np.float64)
    c64 = c.astype(np.float64)
    hi = prod + c64
    bb = hi - prod
    lo = (prod - (hi - bb)) + (c64 - bb)  # hi + lo == prod + c exactly
    r = hi.astype(np.float32)
    rb = r.astype(np.float64)
    toward = np.where(hi > rb, np.float32(np.inf), np.float32(-np.inf)).astype(np.float32)
    nb = np.nextafter(r, toward).astype(np.float64)  # r's neighbour on hi's side
    tie = (hi != rb) & (2 * hi == rb + nb) & (lo != 0) & (np.sign(lo) == np.sign(nb - rb))
    return np.where(tie, nb.astype(np.float32), r)


def exp2_poly_emulated(x, coefficients):
    """attention_wgmma.cu's exp2_poly in numpy, operation by operation in float32:
    fmaxf(x, -127); t = x + 1.5 * 2^23 rounded down (exactly 1.5 * 2^23 + floor(x): an
    integer below 2^24); f = x - (t - 1.5 * 2^23) (round to nearest, as the others); p =
    fmaf(fmaf(fmaf(c3, f, c2), f, c1), f, 1); bits of p + (bits of t << 23), modulo 2^32."""
    c1, c2, c3 = (np.float32(c) for c in coefficients)
    magic = np.float32(12582912.0)
    x = np.maximum(x.astype(np.float32), np.float32(-127.0))
    t = (magic + np.floor(x)).astype(np.float32)
    f = (x - (t - magic)).astype(np.float32)
    one = np.ones_like(f)
    p = fma32(fma32(fma32(np.full_like(f, c3), f, np.full_like(f, c2)), f,
                    np.full_like(f, c1)), f, one)
    return (p.view(np.uint32) + (t.view(np.uint32) << np.uint32(23))).view(np.float32)


def test_attention_poly_exp2(cupy_selected):
    """attention_wgmma.cu's exp2_poly (the poly-exp2 variants' exponential, FlashAttention-4's
    emulation on the FMA units) is the operation sequence exp2_poly_emulated models, with
    the coefficients read from the source; emulated exactly in fp32 over x in [-126, 0]
    (4M points evenly, every fp32 in [-2, -1] (every fraction on a 2^-23 grid), every fp32 in
    [-126, -125], the integers, tiny negatives) its relative error to 2^x stays below 1e-4
    (measured: 8.6e-5, the polynomial's own; fp16 P rounds at 4.9e-4); below -126 it gives
    [0, 2^-126], at -127 and below (-inf: masked scores) exactly 0. The softmax takes it for
    one column pair in POLY_EVERY (8) or in half as many, exp2f for the others."""
    source = (build.SOURCE_DIR / "attention_wgmma.cu").read_text()
    body = source[source.index("float exp2_poly(float x) {"):]
    body = body[:body.index("\n}\n")]
    assert_in_order(body, (
        "x = fmaxf(x, -127.0f);", "const float t = __fadd_rd(x, 12582912.0f);",
        "const float f = __fsub_rn(x, __fsub_rn(t, 12582912.0f));",
        "const float p = fmaf(fmaf(fmaf(",
        "return __uint_as_float(__float_as_uint(p) + (__float_as_uint(t) << 23));",
    ))
    c3, c2, c1 = map(float, re.search(
        r"fmaf\(fmaf\(fmaf\(([0-9.]+)f, f, ([0-9.]+)f\), f,\s*([0-9.]+)f\),\s*f, 1\.0f\)",
        body).groups())
    assert "constexpr int TMA_POLY_EXP2 = 4, POLY_EVERY = 8;" in source
    assert "if (j % EVERY == EVERY - 1) return exp2_poly(x);" in source
    one_two = np.arange(np.float32(-1.0).view(np.uint32), np.float32(-2.0).view(np.uint32) + 1,
                        dtype=np.uint32).view(np.float32)
    low = np.arange(np.float32(-125.0).view(np.uint32), np.float32(-126.0).view(np.uint32) + 1,
                    dtype=np.uint32).view(np.float32)
    xs = np.concatenate([np.linspace(-126.0, 0.0, 2**22 + 1).astype(np.float32), one_two, low,
                         np.arange(-126, 1).astype(np.float32),
                         -np.logspace(-30, 0, 10001).astype(np.float32)])
    worst = 0.0
    for chunk in np.array_split(xs, 8):
        got = exp2_poly_emulated(chunk, (c1, c2, c3)).astype(np.float64)
        want = np.exp2(chunk.astype(np.float64))
        worst = max(worst, float(np.max(np.abs(got - want) / want)))
    assert 1e-5 < worst < 1e-4, worst
    below = np.concatenate([np.linspace(-300.0, -126.0, 100001), [-np.inf]]).astype(np.float32)
    got = exp2_poly_emulated(below, (c1, c2, c3))
    assert np.all((got >= 0) & (got <= 2.0**-126)), got[(got < 0) | (got > 2.0**-126)]
    assert np.all(got[below <= -127] == 0)


def test_tensor_maps(cupy_selected, monkeypatch):
    """tensor_maps.tensor_map passes the driver's cuTensorMapEncodeTiled a 64-byte-aligned map,
    FLOAT16, rank 2, the tensor's base, global dims [K, rows], the row stride in bytes, box
    [64, box_rows], element strides [1, 1], no interleave, the 128-byte swizzle, 256-byte L2
    promotion and zero OOB fill (the enum values cuda.bindings has), and packs the 16 words
    it writes in order into 128 bytes; it refuses a misaligned row stride or base, non-fp16,
    non-contiguous rows, empty tensors and boxes past 256 rows (ValueError) and names the
    shape when the driver fails (RuntimeError). Given seq_len, the 3-D view: rank 3, dims [K,
    seq_len, rows / seq_len], strides [row bytes, seq_len row bytes], box [64, box_rows, 1],
    element strides [1, 1, 1], the same modes; refused where seq_len does not divide the rows;
    boxes of 32 columns take the 64-byte swizzle, other widths are refused.
    ops.linear refuses a TMA variant on such operands, and the layer does not pick it for
    them; the map cache memoises on the tensor's address, shape, strides and sequence
    length."""
    import ctypes
    from types import SimpleNamespace

    from cuda.bindings import driver as d

    assert (tensor_maps.FLOAT16, tensor_maps.INTERLEAVE_NONE, tensor_maps.SWIZZLE_128B,
            tensor_maps.SWIZZLE_64B, tensor_maps.L2_PROMOTION_256B,
            tensor_maps.OOB_FILL_ZEROS) == (
        int(d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16),
        int(d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE),
        int(d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B),
        int(d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B),
        int(d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B),
        int(d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE))
    calls, result = [], [0]

    def encode(out, dtype, rank, base, dims, strides, box, elem, *modes):
        """Records the call (arrays as lists) and writes FAKE_WORDS at out."""
        calls.append((out % 64, dtype, rank, base, list(dims[:2]), list(strides[:1]),
                      list(box[:2]), list(elem[:2]), *modes))
        ctypes.memmove(out, np.array(FAKE_WORDS, dtype=np.uint64).ctypes.data, 128)
        return result[0]
    monkeypatch.setattr(tensor_maps, "_encoder", lambda: encode)
    store = torch.zeros(300, 144, dtype=torch.float16)
    t = store[:, :136]  # rows of 144 halves (288 bytes), 136 columns
    got = tensor_maps.tensor_map(t, 128)
    assert isinstance(got, np.ndarray) and got.shape == () and got.dtype.itemsize == 128
    assert got.dtype == tensor_maps.TENSOR_MAP_DTYPE
    assert got.tobytes() == np.array(FAKE_WORDS, dtype="<u8").tobytes()
    assert calls == [(0, 6, 2, t.data_ptr(), [136, 300], [288], [64, 128], [1, 1], 0, 3, 3, 0)]
    assert tensor_maps.tensor_map(store, 256) is not None and calls[-1][6] == [64, 256]
    # the 3-D view (flash_attention_wgmma_tma): [K, seq_len, sequences], strides [row bytes,
    # seq_len row bytes], boxes [64, box_rows, 1]
    full3 = []

    def encode3(out, dtype, rank, base, dims, strides, box, elem, *modes):
        """Records a rank-3 call in full."""
        full3.append((rank, base, list(dims[:3]), list(strides[:2]), list(box[:3]),
                      list(elem[:3]), *modes))
        return encode(out, dtype, rank, base, dims, strides, box, elem, *modes)
    monkeypatch.setattr(tensor_maps, "_encoder", lambda: encode3)
    got3 = tensor_maps.tensor_map(t, 64, seq_len=100)
    assert got3.tobytes() == got.tobytes()
    assert full3 == [(3, t.data_ptr(), [136, 100, 3], [288, 100 * 288], [64, 64, 1], [1, 1, 1],
                      0, 3, 3, 0)]
    assert tensor_maps.layout(t, 64, 100) == ([136, 100, 3], [288, 28800], [64, 64, 1])
    tensor_maps.tensor_map(t, 128, seq_len=150, box_cols=32)  # 32 columns: the 64B swizzle
    assert full3[-1] == (3, t.data_ptr(), [136, 150, 2], [288, 150 * 288], [32, 128, 1],
                         [1, 1, 1], 0, tensor_maps.SWIZZLE_64B, 3, 0)
    with pytest.raises(ValueError, match="box columns"):
        tensor_maps.tensor_map(t, 128, seq_len=150, box_cols=16)
    assert tensor_maps.layout(t, 64) == ([136, 300], [288], [64, 64])
    with pytest.raises(ValueError, match="multiple of seq_len"):
        tensor_maps.tensor_map(t, 64, seq_len=7)  # 300 rows are not whole sequences of 7
    assert not tensor_maps.describable(t, 64, seq_len=0) and tensor_maps.describable(t, 64, 150)
    monkeypatch.setattr(tensor_maps, "_encoder", lambda: encode)
    bad = {"stride": torch.zeros(8, 140, dtype=torch.float16)[:, :136],
           "base": torch.zeros(8, 144, dtype=torch.float16)[:, 4:],
           "dtype": torch.zeros(8, 64), "columns": store[:, ::2], "empty": store[:0],
           "box": store}
    for why, x in bad.items():
        with pytest.raises(ValueError, match="TMA"):
            tensor_maps.tensor_map(x, 300 if why == "box" else 128)
        assert why == "box" or not tensor_maps.describable(x)
    result[0] = 1  # CUDA_ERROR_INVALID_VALUE
    with pytest.raises(RuntimeError, match=r"\(300, 136\)"):
        tensor_maps.tensor_map(t, 128)
    result[0] = 0
    n_calls = len(calls)
    cache = tensor_maps.TensorMapCache()
    first = cache(t, 128)
    assert cache(t, 128) is first and cache(store[:, :136], 128) is first
    assert cache(store[:200, :136], 128) is not first and cache(t, 64) is not first
    assert cache(t, 128, 100) is not first and cache(t, 128, 100) is cache(t, 128, 100)
    assert cache(t, 128, 100, 32) is not cache(t, 128, 100)
    assert len(calls) == n_calls + 5

    # ops.linear: a TMA variant on a misaligned A is refused, with no launch
    m, n, d = 300, 256, 136
    bias, out = torch.zeros(n), torch.zeros(m, n, dtype=torch.float16)
    wp = weight_pair(torch.zeros(n, d))
    shifted = torch.zeros(m, d + 8, dtype=torch.float16)[:, 4:]  # base off 16 bytes
    for v in (build.GEMM_TMA_WIDE, build.GEMM_TMA):
        k = Recorder()
        with pytest.raises(ValueError, match="cannot run on these operands"):
            ops.linear(k, (shifted, None), wp, bias, "half", 1, out_half=out, wgmma=True,
                       gemm_variant=v.name)
        assert not k.calls
    # the layer picks a TMA variant only where both operands have maps
    from layerbench.backends.cupy.layer import CupyLayer

    monkeypatch.setattr(layer_module, "multiprocessor_count", lambda device: 1)
    layer = SimpleNamespace(gemm_variant=build.GEMM_TMA, wgmma=True, device=None,
                            staged_epilogue=True)
    pick = CupyLayer.gemm_variant_for
    a = (torch.zeros(m, d, dtype=torch.float16), None)
    assert pick(layer, "half", 1, wp, m, a) == build.GEMM_TMA.name
    assert pick(layer, "half", 1, wp, m, (shifted, None)) is None
    assert pick(layer, "half", 1, wp, m) is None  # no operand to describe
    layer.gemm_variant = build.GEMM_WS
    assert pick(layer, "half", 1, wp, m, (shifted, None)) == build.GEMM_WS.name
    # none named: build.LAYER_GEMM_VARIANT from a reduction of LAYER_TMA_MIN_K columns, at
    # one product, where its maps describe both operands; else the plain schedule
    layer.gemm_variant = None
    long_k = build.LAYER_TMA_MIN_K
    wide = weight_pair(torch.zeros(n, long_k))
    a_long = (torch.zeros(m, long_k, dtype=torch.float16), None)
    assert pick(layer, "half", 1, wide, m, a_long) == build.LAYER_GEMM_VARIANT.name
    assert pick(layer, "residual", 1, wide, m, a_long) == build.LAYER_GEMM_VARIANT.name
    layer.staged_epilogue = False  # the unstaged twin
    assert pick(layer, "residual", 1, wide, m, a_long) == build.UNSTAGED_GEMM_VARIANT.name
    layer.staged_epilogue = True
    assert pick(layer, "residual", 3, wide, m, a_long) is None  # compiled at one product
    assert pick(layer, "half", 1, wp, m, a) is None  # d 136: below LAYER_TMA_MIN_K
    misaligned = torch.zeros(m, long_k + 8, dtype=torch.float16)[:, 4:]
    assert pick(layer, "half", 1, wide, m, (misaligned, None)) is None
    layer.wgmma = False
    assert pick(layer, "half", 1, wide, m, a_long) is None


@pytest.fixture
def kernels(cupy_selected):
    """The compiled kernels of the current GPU (skips without one or without CuPy)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("cupy")
    k = ops.kernels_for(torch.device("cuda", torch.cuda.current_device()))
    assert k.wgmma_problem is None, k.wgmma_problem  # an sm_90 device gets real wgmma kernels
    return k


@needs_gpu
@pytest.mark.parametrize("m,d", [(1, 8), (77, 40), (6, 128), (7, 136), (4, 256), (9, 264),
                                 (5, 512), (11, 520), (300, 1024), (3, 1032), (5, 4096)])
def test_layer_norm_kernel(kernels, m, d):
    """Every output form against fp64, rows off the block size, invalid rows zeroed, at
    each width that the registers a lane holds change (build.norm_held) and past them."""
    g = torch.Generator(device="cuda").manual_seed(m + d)
    x = torch.randn(m, d, device="cuda", generator=g) * 3 + 1
    w, b = (torch.randn(d, device="cuda", generator=g) for _ in range(2))
    want = torch.nn.functional.layer_norm(x.double(), (d,), w.double(), b.double(), 1e-5)
    pair = tuple(torch.full((m, d), math.nan, device="cuda", dtype=torch.float16)
                 for _ in range(2))
    ops.layer_norm(kernels, x, w, b, pair=pair)
    assert (pair[0].double() + pair[1].double() - want).abs().max().item() < 1e-5
    half = torch.full((m, d), math.nan, device="cuda", dtype=torch.float16)
    ops.layer_norm(kernels, x, w, b, half=half)
    assert torch.equal(half, pair[0])
    valid = (torch.rand(m, device="cuda", generator=g) > 0.3).to(torch.uint8)
    out = torch.full((m, d), math.nan, device="cuda")
    ops.layer_norm(kernels, x, w, b, out=out, valid_rows=valid)
    want = torch.where(valid.bool()[:, None], want, 0)
    assert (out.double() - want).abs().max().item() < 2e-5


@needs_gpu
@pytest.mark.parametrize("m,k,n", [(77, 40, 24), (300, 128, 384), (1000, 1032, 136),
                                   (333, 584, 520), (8192, 1024, 1024)])
@pytest.mark.parametrize("epilogue", ["half", "gelu_pair", "residual_update", "residual_sum"])
def test_linear_kernel(kernels, epilogue, m, k, n):
    """Each epilogue with each product count and tile, and (wgmma) each GEMM variant at one
    product, against fp64: rows off the tile, N off the tile (also narrower than it), K off
    64 (also below it, and 10 K tiles); the residual in place and with invalid rows. Three
    products against A @ W^T; two against (a_hi + a_lo) @ w_hi, the operands they read
    (their error is the fp32 accumulation's, as three products' is, within the same 1e-4;
    against A @ W^T the weights' fp16 rounding alone would be ~1e-3); one within 2e-3. The
    wait-1 schedule and the warp-specialised and TMA 128x128 kernels are bit-identical to the
    plain one on the same tile, the warp-specialised and TMA 128x256 to the wait-1 128x256
    (the same wgmmas in the same order), and the staged twins to their kernels."""
    g = torch.Generator(device="cuda").manual_seed(m + n)
    a = torch.randn(m, k, device="cuda", generator=g)
    w = torch.randn(n, k, device="cuda", generator=g) / math.sqrt(k)
    bias = torch.randn(n, device="cuda", generator=g)
    a_pair = split_fp16(a)
    w_pair = weight_pair(w)
    exact = a.double() @ w.double().t() + bias.double()
    # two products: the activations' pair times the weights' hi half (w_lo is not read)
    exact_two = ((a_pair[0].double() + a_pair[1].double()) @ w_pair[0].double().t()
                 + bias.double())
    valid = (torch.rand(m, device="cuda", generator=g) > 0.25).to(torch.uint8)
    res = torch.randn(m, n, device="cuda", generator=g)  # the residual epilogues' input
    tiles = [(t, False) for t in build.GEMM_TILES]
    tiles += [(t, True) for t in build.WGMMA_TILES] if kernels.has_wgmma else []
    runs = [(p, {"tile": t, "wgmma": wgmma})
            for p, (t, wgmma) in itertools.product(build.GEMM_PRODUCTS, tiles)]
    if kernels.has_wgmma:
        runs += [(build.GEMM_VARIANT_PRODUCTS, {"wgmma": True, "gemm_variant": v.name})
                 for v in build.GEMM_VARIANTS]
        runs += [(p, {"tile": build.STAGED_TILE, "wgmma": True, "staged": staged})
                 for p in build.GEMM_PRODUCTS for staged in (1, 2)]
    results = {}
    for products, gemm in runs:
        acc = exact_two if products == 2 else exact
        if epilogue == "half":
            if products != 1:
                continue
            out = torch.full((m, n), math.nan, device="cuda", dtype=torch.float16)
            ops.linear(kernels, a_pair, w_pair, bias, "half", 1, out_half=out, **gemm)
            got = out.double()
            want = a_pair[0].double() @ w_pair[0].double().t() + bias.double()
            tol = 2e-3
        elif epilogue == "gelu_pair":
            pair = tuple(torch.full((m, n), math.nan, device="cuda", dtype=torch.float16)
                         for _ in range(2))
            ops.linear(kernels, a_pair, w_pair, bias, "gelu_pair", products, out_pair=pair,
                       **gemm)
            got = pair[0].double() + pair[1].double()
            want, tol = torch.nn.functional.gelu(acc), 1e-4 if products > 1 else 2e-3
        else:
            zero_sum = epilogue == "residual_sum"
            out = res.clone()  # in place, as ffn_out runs
            ops.linear(kernels, a_pair, w_pair, bias, "residual", products, res=out, out=out,
                       valid_rows=valid, zero_sum=zero_sum, **gemm)
            keep = valid.bool()[:, None]
            want = (torch.where(keep, res.double() + acc, 0) if zero_sum
                    else res.double() + torch.where(keep, acc, 0))
            got, tol = out.double(), 1e-4 if products > 1 else 2e-3
        err = ((got - want).abs() / want.abs().clamp_min(1.0)).nan_to_num(nan=math.inf)
        assert err.max().item() < tol, f"{epilogue} {products} products {gemm}: {err.max()}"
        key = (products, gemm.get("gemm_variant") or gemm["tile"])
        results[key + (("staged", gemm["staged"]) if gemm.get("staged") else ())] = got
    if kernels.has_wgmma:
        for products in build.GEMM_PRODUCTS:  # the staged twins: the same values
            if epilogue == "half" and products != 1:
                continue  # half runs at one product only
            for staged in (1, 2):  # 2: eight lanes a row (the fp32 epilogues; else as 1)
                assert torch.equal(results[products, build.STAGED_TILE, "staged", staged],
                                   results[products, build.STAGED_TILE]), (epilogue, products)
        plain = results[1, build.GEMM_PLAIN.name]
        assert torch.equal(results[1, build.GEMM_WAIT1.name], plain), epilogue
        assert torch.equal(results[1, build.WGMMA_TILES[0]], plain), epilogue
        # the warp-specialised kernels run the same wgmmas in the same order as the others
        assert torch.equal(results[1, build.GEMM_WS.name], plain), epilogue
        assert torch.equal(results[1, build.GEMM_WS_WIDE.name],
                           results[1, build.GEMM_WIDE.name]), epilogue
        # ... and so do the TMA kernels (zero-filled boxes as the cp.async zero fill)
        for v in (build.GEMM_TMA, build.GEMM_TMA_TWO_PER_SM, build.GEMM_TMA_PERSISTENT,
                  build.GEMM_TMA_STAGED):
            assert torch.equal(results[1, v.name], plain), (epilogue, v.name)
        assert torch.equal(results[1, build.GEMM_TMA_WIDE.name],
                           results[1, build.GEMM_WIDE.name]), epilogue


@needs_gpu
@pytest.mark.parametrize("width", [3, 4])
@pytest.mark.parametrize("kernel", ["plain", "eight", "tma", "short"])
@pytest.mark.parametrize("epilogue", ["half", "gelu_pair", "residual", "residual_norm"])
def test_staged_epilogue_on_unaligned_rows(kernels, epilogue, kernel, width):
    """The staged epilogue's one-by-one path, in the plain 128 x 128 kernel (a warp a row, or
    eight lanes a row for the fp32 epilogues), the TMA one and the short residual-norm one (64
    rows a block):
    outputs (the residual and the norm's rows too) as views one column into buffers `width`
    columns wider (rows of n + 3, or n + 4 from a base off 16 bytes), bit-identical to the same
    kernel on contiguous outputs, the columns around them untouched (NaN)."""
    if not kernels.has_wgmma:
        pytest.skip("needs the wgmma kernels (sm_90a)")
    if kernel == "tma" and epilogue == "residual_norm":
        pytest.skip("the TMA GEMMs have no residual_norm epilogue")
    if kernel == "short" and epilogue != "residual_norm":
        pytest.skip("the short GEMM is residual_norm's only")
    if kernel == "eight" and epilogue not in build.EIGHT_LANE_EPILOGUES:
        pytest.skip("eight lanes a row: the fp32 epilogues only")
    m, k = 300, 120 if kernel == "short" else 136
    n = 120 if epilogue == "residual_norm" else 200
    g = torch.Generator(device="cuda").manual_seed(7)
    a_pair = split_fp16(torch.randn(m, k, device="cuda", generator=g))
    w_pair = weight_pair(torch.randn(n, k, device="cuda", generator=g) / math.sqrt(k))
    bias = torch.randn(n, device="cuda", generator=g)
    norm = tuple(torch.randn(n, device="cuda", generator=g) for _ in range(2))
    res = torch.randn(m, n, device="cuda", generator=g)
    valid = (torch.rand(m, device="cuda", generator=g) > 0.25).to(torch.uint8)
    gemm = {"tma": {"gemm_variant": build.GEMM_TMA_STAGED.name},
            "plain": {"tile": build.STAGED_TILE, "staged": True},
            "eight": {"tile": build.STAGED_TILE, "staged": 2},
            "short": {"short_norm": True}}[kernel]

    def buffers(dtype, views: bool):
        """Two NaN buffers and the m x n outputs in them."""
        bufs = [torch.full((m, n + (width if views else 0)), math.nan, device="cuda",
                           dtype=dtype) for _ in range(2)]
        return bufs, [b[:, 1:n + 1] if views else b for b in bufs]

    def run(views: bool) -> list:
        fp32, f32_outs = buffers(torch.float32, views)
        fp16, f16_outs = buffers(torch.float16, views)
        outs = {"half": {"out_half": f16_outs[0]},
                "gelu_pair": {"out_pair": tuple(f16_outs)},
                "residual": {"res": f32_outs[0], "out": f32_outs[0], "valid_rows": valid},
                "residual_norm": {"res": f32_outs[0], "out": f32_outs[0], "valid_rows": valid,
                                  "norm": norm, "norm_out": tuple(f16_outs)}}[epilogue]
        f32_outs[0].copy_(res)
        ops.linear(kernels, a_pair, w_pair, bias, epilogue, 1, wgmma=True, **gemm, **outs)
        return fp32[:1] + fp16 if epilogue == "residual_norm" else (
            fp32[:1] if epilogue == "residual" else fp16[:1 if epilogue == "half" else 2])

    contiguous, views = run(False), run(True)
    for i, (want, got) in enumerate(zip(contiguous, views)):
        assert not want.isnan().any(), (epilogue, i)
        assert torch.equal(got[:, 1:n + 1], want), (epilogue, kernel, i)
        assert got[:, 0].isnan().all() and got[:, n + 1:].isnan().all(), (epilogue, kernel, i)


@needs_gpu
@pytest.mark.parametrize("m", [1, 77, 300])
@pytest.mark.parametrize("n", [8, 40, 128])
@pytest.mark.parametrize("k", [8, 128, 136])
def test_linear_residual_norm_kernel(kernels, m, n, k):
    """The wgmma residual_norm epilogue against fp64 (the residual, then LayerNorm of the new
    rows): both tiles (the 128 x 128 one also staged, the norm a warp a row or eight lanes a
    row) and, where K is
    at most 128, the short residual-norm GEMM; one, two and three products, with and without
    a mask, invalid rows
    kept or zeroed, the norm as a pair or its hi half alone; in place, and nothing written
    past the M x N rows of either output."""
    if not kernels.has_wgmma:
        pytest.skip(f"no wgmma on sm_{kernels.arch}")
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    a = torch.randn(m, k, device="cuda", generator=g)
    w = torch.randn(n, k, device="cuda", generator=g) / math.sqrt(k)
    bias = torch.randn(n, device="cuda", generator=g)
    norm_w, norm_b = (torch.randn(n, device="cuda", generator=g) for _ in range(2))
    res = torch.randn(m, n, device="cuda", generator=g)
    a_pair, w_pair = split_fp16(a), weight_pair(w)
    # three products against A @ W^T, one and two against the products of the fp16 operands
    # they read (two: the activations' pair, the weights' hi half)
    exact = {3: a.double() @ w.double().t() + bias.double(),
             2: (a_pair[0].double() + a_pair[1].double()) @ w_pair[0].double().t()
             + bias.double(),
             1: a_pair[0].double() @ w_pair[0].double().t() + bias.double()}
    mask = (torch.rand(m, device="cuda", generator=g) > 0.25).to(torch.uint8)

    def rel_err(got, want):
        err = (got - want).abs() / want.abs().clamp_min(1.0)
        return err.nan_to_num(nan=math.inf).max().item()
    short = ("short",) if k <= build.SHORT_NORM_STAGES * 64 else ()
    cases = itertools.product(build.GEMM_PRODUCTS, build.NORM_TILES + short, (None, mask),
                              (0, 1), ("pair", "hi"), (0, 1, 2))
    for products, tile, valid, zero_sum, form, staged in cases:
        if staged != 1 if tile == "short" else (staged and tile != build.STAGED_TILE):
            continue  # staged: the 128 x 128 tile's twins; the short GEMM is staged only
        case = (f"{products} products {tile} mask={valid is not None} zero_sum={zero_sum} "
                f"{form} staged={staged}")
        # Padded buffers: one row and 8 columns more than written, NaN outside the M x N view
        buffer = torch.full((m + 1, n), math.nan, device="cuda")
        out = buffer[:m]
        out.copy_(res)  # in place, as the layer runs it
        normed = [torch.full((m + 1, n + 8), math.nan, device="cuda", dtype=torch.float16)
                  for _ in range(2)]
        norm_out = (normed[0][:m, :n], normed[1][:m, :n] if form == "pair" else None)
        ops.linear(kernels, a_pair, w_pair, bias, "residual_norm", products, res=out, out=out,
                   valid_rows=valid, zero_sum=bool(zero_sum), norm=(norm_w, norm_b),
                   norm_out=norm_out, tile=None if tile == "short" else tile, wgmma=True,
                   staged=staged, short_norm=tile == "short")
        keep = (torch.ones(m, 1, dtype=torch.bool, device="cuda") if valid is None
                else valid.bool()[:, None])
        acc = exact[products]
        want = (torch.where(keep, res.double() + acc, 0) if zero_sum
                else res.double() + torch.where(keep, acc, 0))
        err = rel_err(out.double(), want)
        assert err < 1e-4, f"residual {case}: {err}"
        got = normed[0][:m, :n].double()
        if form == "pair":
            got = got + normed[1][:m, :n].double()
        rounding = 1e-5 if form == "pair" else 6e-4  # the pair to ~22 bits, hi alone to 11
        # the norm of the kernel's own rows: LayerNorm's arithmetic alone
        own = torch.nn.functional.layer_norm(out.double(), (n,), norm_w.double(),
                                             norm_b.double(), 1e-5)
        err = rel_err(got, own)
        assert err < rounding, f"norm of the written rows {case}: {err}"
        # the norm of the fp64 residual: the GEMM's error through LayerNorm too
        ideal = torch.nn.functional.layer_norm(want, (n,), norm_w.double(), norm_b.double(),
                                               1e-5)
        err = rel_err(got, ideal)
        assert err < 5e-4 + rounding, f"norm against fp64 {case}: {err}"
        assert buffer[m].isnan().all(), f"out past row M {case}"
        for t in normed if form == "pair" else normed[:1]:
            assert t[m].isnan().all() and t[:, n:].isnan().all(), f"norm past M x N {case}"
        if form == "hi":
            assert normed[1].isnan().all(), f"lo written with hi alone {case}"


@needs_gpu
@pytest.mark.parametrize("m", [1, 77, 300])
@pytest.mark.parametrize("k", [8, 40, 64, 72, 128])
def test_linear_norm_prologue_kernel(kernels, m, k):
    """The norm-prologue GEMM (LayerNorm of fp32 rows in its prologue) against layer_norm
    followed by the plain wgmma GEMM on the same tile: bit-identical outputs, each tile, Q/K/V's
    half at one product and ffn_in's gelu_pair at one to three, x a strided view (rows of
    k + 8 floats); its prologue computes each row's statistics and values with layer_norm's
    fp32 operations in layer_norm's order, and the main loop runs the plain kernel's wgmmas in
    the same order over the same zero-padded tiles. With the identity as W (exact in fp16)
    and no bias, its half output is layer_norm's hi half itself. Outputs are NaN-poisoned,
    one row and 8 columns wider than written, and must stay NaN past M x N."""
    if not kernels.has_wgmma:
        pytest.skip(f"no wgmma on sm_{kernels.arch}")
    g = torch.Generator(device="cuda").manual_seed(m + k)
    n = 136
    x = (torch.randn(m, k + 8, device="cuda", generator=g) * 3 + 1)[:, :k]
    norm_w, norm_b = (torch.randn(k, device="cuda", generator=g) for _ in range(2))
    w = torch.randn(n, k, device="cuda", generator=g) / math.sqrt(k)
    bias = torch.randn(n, device="cuda", generator=g)
    w_pair = weight_pair(w)
    hi, lo = (torch.full((m, k), math.nan, device="cuda", dtype=torch.float16)
              for _ in range(2))
    ops.layer_norm(kernels, x, norm_w, norm_b, pair=(hi, lo))

    def poisoned(cols):
        buffer = torch.full((m + 1, cols + 8), math.nan, device="cuda", dtype=torch.float16)
        return buffer, buffer[:m, :cols]
    runs = [(1, "half")] + [(p, "gelu_pair") for p in build.PROLOGUE_EPILOGUES["gelu_pair"]]
    for tile, (products, epilogue) in itertools.product(build.WGMMA_TILES, runs):
        case = f"{tile} {epilogue} {products} products m={m} k={k}"
        got, want = [], []
        for prologue in (True, False):
            outs = [poisoned(n) for _ in range(2)]
            kw = ({"out_half": outs[0][1]} if epilogue == "half"
                  else {"out_pair": (outs[0][1], outs[1][1])})
            if prologue:
                ops.linear(kernels, None, w_pair, bias, epilogue, products, tile=tile,
                           wgmma=True, prologue_norm=(x, norm_w, norm_b), **kw)
            else:
                ops.linear(kernels, (hi, lo), w_pair, bias, epilogue, products, tile=tile,
                           wgmma=True, **kw)
            written = outs[:1] if epilogue == "half" else outs
            for buffer, view in written:
                assert not view.isnan().any(), f"{case} prologue={prologue}: NaN written"
                assert buffer[m].isnan().all() and buffer[:, n:].isnan().all(), (
                    f"{case} prologue={prologue}: written past M x N")
            (got if prologue else want).append([view for _, view in written])
        for a, b in zip(got[0], want[0]):
            assert torch.equal(a, b), f"{case}: {(a.float() - b.float()).abs().max()}"
    eye = weight_pair(torch.eye(k, device="cuda"))
    for tile in build.WGMMA_TILES:
        buffer, out = poisoned(k)
        ops.linear(kernels, None, eye, torch.zeros(k, device="cuda"), "half", 1,
                   out_half=out, tile=tile, wgmma=True, prologue_norm=(x, norm_w, norm_b))
        assert torch.equal(out, hi), f"{tile} m={m} k={k}: normed rows differ from layer_norm"


@needs_gpu
@pytest.mark.parametrize("head_dim", [8, 24, 32, 64, 72, 128, 136, 256])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("mask", ["none", "prefix", "holes"])
@pytest.mark.parametrize("batch", [3, 400], ids=["few", "many"])
@pytest.mark.parametrize("seq_len", [200, 700])
@pytest.mark.parametrize("wgmma", [False, True], ids=["mma", "wgmma"])
def test_attention_kernel(kernels, head_dim, causal, mask, batch, seq_len, wgmma):
    """Flash attention at odd lengths against the fp32 oracle: every padded head dim, causal
    or full, no mask, prefix masks (one sequence empty) and holed masks, on both tiles where
    two are compiled ("many": enough blocks for 128 queries a block), and on the wgmma kernel
    where the device has it, every variant of the head dim (build.ATTENTION_WGMMA, by name;
    one that refuses the head dim must refuse it), variants of one BKV bit-identical (the same
    arithmetic, issued in another order; the TMA ring too: the keys it loads where the others
    zero-fill get P = 0), those with the polynomial exp2 among themselves only (one fraction,
    poly_every, a group), as their P differs. 200 tokens: the
    last block's second warpgroup has 8 rows; 700: 11 key tiles of 64, and the last block's
    second warpgroup has none. With no lo half, the hi half is written alone, bit for bit."""
    if wgmma and not kernels.has_wgmma:
        pytest.skip(f"no wgmma on sm_{kernels.arch}")
    heads = 2
    d = heads * head_dim
    g = torch.Generator(device="cuda").manual_seed(head_dim + batch + seq_len)
    qkv = torch.randn(batch * seq_len, 3 * d, device="cuda", generator=g).half()
    valid = None
    if mask != "none":
        lengths = torch.randint(0, seq_len + 1, (batch,), device="cuda", generator=g)
        lengths[0], lengths[1] = seq_len, 0
        valid = torch.arange(seq_len, device="cuda")[None, :] < lengths[:, None]
        if mask == "holes":
            valid &= torch.rand(batch, seq_len, device="cuda", generator=g) > 0.3
        valid = valid.to(torch.uint8)
    everyone = torch.ones(batch, seq_len, dtype=torch.uint8, device="cuda")
    want, blind = packed_attention(qkv, everyone if valid is None else valid, batch=batch,
                                   seq_len=seq_len, heads=heads, causal=causal)
    wide = ops.wgmma_attention_pad(head_dim)
    variants = build.ATTENTION_WGMMA[wide] if wgmma and wide else (None,)
    by_bkv = {}  # (BKV, poly_every) -> (variant name, output) of the first variant with them
    for variant in variants:
        name = variant.name if variant else None
        ctx = tuple(torch.full((batch * seq_len, d), math.nan, device="cuda",
                               dtype=torch.float16) for _ in range(2))
        call = dict(batch=batch, seq_len=seq_len, num_heads=heads, head_dim=head_dim,
                    causal=causal, wgmma=wgmma, variant=name)
        info = None if valid is None else key_info(valid)
        if variant and variant.refusal(head_dim, wide):  # the TMA ring below its head dim
            with pytest.raises(ValueError, match="needs head dim"):
                ops.attention(kernels, qkv, ctx, valid, info, **call)
            continue
        ops.attention(kernels, qkv, ctx, valid, info, **call)
        hi_alone = torch.full_like(ctx[0], math.nan)
        ops.attention(kernels, qkv, (hi_alone, None), valid, info, **call)
        assert torch.equal(hi_alone, ctx[0]), f"{name}: the hi half written alone differs"
        got = (ctx[0].float() + ctx[1].float()).view(batch, seq_len, d)
        assert torch.isfinite(got).all(), name
        err = (got - want).abs().max().item()
        assert err < 2e-2, f"{name}: max error {err:.3g}"
        assert torch.equal(got[blind], torch.zeros_like(got[blind])), name
        if variant:
            first, same = by_bkv.setdefault((variant.bkv, variant.poly_every), (name, got))
            assert torch.equal(got, same), f"{name} differs from {first}"


def _split(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """y as an fp16 pair (hi, lo), y = hi + lo to about 22 bits."""
    return y.half(), (y - y.half().float()).half()


def _after_attention_rows(ctx, x, p, w, ffn_in_bias, valid_rows):
    """(h, y) as the whole-block and after-attention kernels compute them from the context
    pair ctx and the fp32 rows x: h = x + out_proj(ctx) (x kept on invalid rows), y = h +
    FFN(norm2(h)) (0 on invalid rows); the normed and hidden rows as pairs, three products
    each."""
    d, masked = x.shape[1], valid_rows is not None
    h = _residual(_products(*ctx, *w["out_weight"], d, 3) + p.out_bias, x, valid_rows,
                  masked, 0)
    f8 = w["ffn_in_weight"][0].shape[0]
    hidden = _products(*_split(_norm(h, p.norm2_weight, p.norm2_bias)), *w["ffn_in_weight"],
                       f8, 3) + ffn_in_bias
    acc = _products(*_split(torch.nn.functional.gelu(hidden)), *w["ffn_out_weight"], d, 3)
    return h, _residual(acc + p.ffn_out_bias, h, valid_rows, masked, 1)


class StandIns:
    """PyTorch stand-ins for ops.layer_norm, ops.linear and ops.attention, computing what
    each kernel promises from the operands it reads (one product reads only hi halves).
    mutation breaks residual_norm on purpose: "pre_residual" norms the rows before the
    update, "skip_next_norm1" leaves ffn_out's norm rows (the next block's norm1) unwritten;
    or the norm prologue: "prologue_without_bias" norms the rows without the norm's bias."""

    def __init__(self, mutation: str | None = None):
        self.calls = []
        self.variants = []
        self.context_lo = []  # per attention launch: whether the context's lo half was written
        self.gemm_variants = []  # (epilogue, products, N, gemm_variant) of each GEMM
        self.mutation = mutation
        self.config = None  # the layer's config (_run_stand_ins sets it)

    def layer_norm(self, k, x, weight, bias, *, pair=None, half=None, out=None,
                   valid_rows=None, eps=1e-5):
        """LayerNorm into a pair, hi alone, or fp32 with invalid rows zeroed."""
        self.calls.append("layer_norm")
        y = _norm(x, weight, bias)
        if pair is not None:
            _pair(y, *pair)
        elif half is not None:
            half.copy_(y.half())
        else:
            out.copy_(y if valid_rows is None else torch.where(valid_rows.bool()[:, None], y, 0))

    def linear(self, k, a, weight, bias, epilogue, products, *, out_pair=None, out_half=None,
               res=None, out=None, valid_rows=None, zero_sum=False, norm=None, norm_out=None,
               eps=1e-5, tile=None, wgmma=False, gemm_variant=None, prologue_norm=None,
               staged=False, short_norm=False):
        """The GEMM and its epilogue over products fp16 products (residual_norm: then the
        LayerNorm of the new rows, on the wgmma GEMMs and rows up to 128 wide; prologue_norm
        (x, weight, bias): A is the LayerNorm of x's fp32 rows as layer_norm writes it, hi
        alone at one product, where the module has the norm-prologue GEMM); the GEMM variant
        recorded, and checked to be one the module has for it."""
        n = weight[0].shape[0]
        if prologue_norm is not None:
            self.calls.append(f"linear:{epilogue}:{products}:prologue")
            x, norm_w, norm_b = prologue_norm
            assert a is None and wgmma and gemm_variant is None
            assert build.norm_prologue_compiled(epilogue, products)
            assert x.dtype == torch.float32 and x.shape[1] <= build.MAX_PROLOGUE_K
            if self.mutation == "prologue_without_bias":
                norm_b = torch.zeros_like(norm_b)
            y = _norm(x, norm_w, norm_b)
            a = (y.half(), (y - y.half().float()).half())
        else:
            self.calls.append(f"linear:{epilogue}:{products}")
        self.gemm_variants.append((epilogue, products, n, gemm_variant))
        assert build.gemm_compiled(epilogue, products), (epilogue, products)
        if gemm_variant is not None:
            assert wgmma and build.gemm_variant_compiled(build.gemm_variant(gemm_variant),
                                                         epilogue, products)
        acc = _products(a[0], a[1], weight[0], weight[1], n, products) + bias
        if epilogue == "half":
            out_half.copy_(acc.half())
        elif epilogue == "gelu_pair" and out_pair[1] is None:
            out_pair[0].copy_(torch.nn.functional.gelu(acc).half())
        elif epilogue == "gelu_pair":
            _pair(torch.nn.functional.gelu(acc), *out_pair)
        elif epilogue == "residual":
            out.copy_(_residual(acc, res, valid_rows, valid_rows is not None, int(zero_sum)))
        else:
            assert epilogue == "residual_norm" and wgmma and n <= build.MAX_NORM_WIDTH
            before = res.clone()
            out.copy_(_residual(acc, res, valid_rows, valid_rows is not None, int(zero_sum)))
            if self.mutation == "skip_next_norm1" and zero_sum:
                return
            _norm_rows(before if self.mutation == "pre_residual" else out, *norm, *norm_out)

    def attention(self, k, qkv, ctx, valid, info, *, batch, seq_len, num_heads, head_dim,
                  causal, wgmma=False, variant=None):
        """The fp32 attention oracle, as an fp16 pair or its hi half alone where ctx's lo
        is None (variant and whether lo was written recorded)."""
        self.calls.append("attention")
        self.variants.append(variant)
        self.context_lo.append(ctx[1] is not None)
        everyone = torch.ones(batch, seq_len, dtype=torch.uint8)
        got, _ = packed_attention(qkv, everyone if valid is None else valid, batch=batch,
                                  seq_len=seq_len, heads=num_heads, causal=causal)
        got = got.reshape(batch * seq_len, -1)
        if ctx[1] is None:
            ctx[0].copy_(got.half())
        else:
            _pair(got, *ctx)

    def whole_block(self, k, x, out, p, w, ffn_in_bias, valid, info, *, batch, seq_len,
                    num_heads, causal, rows, final=None, final_out=None, eps=1e-5):
        """One block as whole_block.cu computes it: Q/K/V at one product from norm1's hi
        half, the context, norm2 and the hidden rows as pairs at three products, the
        residuals on valid rows (out_proj keeps x elsewhere, ffn_out writes 0) and the
        block's output in out; with final, out keeps out_proj's residual sum h (x plus the
        attention output) and the final norm of the block's output goes to final_out alone
        (0 on invalid rows). x is only read."""
        self.calls.append("whole_block:final" if final is not None else "whole_block")
        assert ops.whole_block_refusal(self.config, seq_len, 3) is None
        assert rows in build.WHOLE_BLOCK_ROWS
        assert out.data_ptr() != x.data_ptr() and (final_out is None) == (final is None)
        d = x.shape[1]
        valid_rows = None if valid is None else valid.reshape(-1)
        before = x.clone()
        qkv = (_norm(x, p.norm1_weight, p.norm1_bias).half().float()
               @ w["qkv_weight"][0][:3 * d, :d].float().t() + p.qkv_bias).half()
        everyone = torch.ones(batch, seq_len, dtype=torch.uint8)
        ctx, _ = packed_attention(qkv, everyone if valid is None else valid, batch=batch,
                                  seq_len=seq_len, heads=num_heads, causal=causal)
        h, y = _after_attention_rows(_split(ctx.reshape(batch * seq_len, d)), x, p, w,
                                     ffn_in_bias, valid_rows)
        if final is None:
            out.copy_(y)
        else:  # as the kernel: out keeps h, only the final norm of y is stored
            out.copy_(h)
            z = _norm(y, *final)
            final_out.copy_(z if valid_rows is None
                            else torch.where(valid_rows.bool()[:, None], z, 0.0))
        assert torch.equal(x, before), "whole_block wrote its input rows"

    def after_attention(self, k, ctx, x, out, p, w, ffn_in_bias, valid_rows, *, rows,
                        norm=None, norm_out=None, final_out=None, eps=1e-5):
        """A block's work after attention as after_attention.cu computes it: the context,
        norm2's rows and the hidden rows as pairs at three products, the residuals on valid
        rows (out_proj keeps x elsewhere, ffn_out writes 0), the block's output in out
        (unless None); then norm's LayerNorm of it as fp16 into norm_out, or as fp32 into
        final_out (0 on invalid rows)."""
        self.calls.append("after_attention:final" if final_out is not None
                          else "after_attention")
        assert ops.after_attention_refusal(self.config, 3) is None
        assert rows in build.AFTER_ATTENTION_ROWS and norm is not None
        assert (norm_out is None) != (final_out is None)
        _, y = _after_attention_rows(ctx, x, p, w, ffn_in_bias, valid_rows)
        z = _norm(y, *norm)
        if out is not None:
            out.copy_(y)
        if norm_out is not None:
            norm_out.copy_(z.half())
        else:
            final_out.copy_(z if valid_rows is None
                            else torch.where(valid_rows.bool()[:, None], z, 0.0))


def _run_stand_ins(cfg, stand, x, mask, monkeypatch, products=None, fuse_norms=False,
                   attention_variant=None, gemm_variant=None, norm_prologue=False,
                   context_hi_only=False, whole_block=False, after_attention=False):
    """The cupy layer's forward on CPU, its kernels replaced by stand (fuse_norms, a GEMM
    variant or norm_prologue as on the wgmma GEMMs; context_hi_only, whole_block and
    after_attention as CupyLayer's), with a NaN-poisoned workspace; returns the layer and
    its output."""
    from layerbench.backends.cupy.layer import CupyLayer

    model = make_reference(cfg, seed=5)
    for name in ("layer_norm", "linear", "attention", "whole_block", "after_attention"):
        monkeypatch.setattr(ops, name, getattr(stand, name))
    stand.config = cfg
    layer = CupyLayer(None, cfg, model.state_dict(), torch.device("cpu"), torch.float32,
                      None, products or linear_products_for(cfg.d_model),
                      wgmma=fuse_norms or gemm_variant is not None or norm_prologue,
                      fuse_norms=fuse_norms, attention_variant=attention_variant,
                      gemm_variant=gemm_variant, norm_prologue=norm_prologue,
                      context_hi_only=context_hi_only, whole_block=whole_block,
                      after_attention=after_attention)
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(math.nan) if t.is_floating_point() else t
    with monkeypatch.context() as patch, torch.no_grad():
        patch.setattr(torch, "empty", poisoned)
        return layer, layer._forward(x, mask)


@pytest.mark.parametrize("cfg, products", [(LayerConfig(3, 24, 32, 4, 36, 2), None),
                                           (LayerConfig(2, 17, 64, 2, 64, 1), None),
                                           (LayerConfig(2, 20, 64, 2, 64, 3), 1),
                                           (LayerConfig(2, 20, 64, 2, 64, 3), 2),
                                           (LayerConfig(2, 12, 512, 4, 64, 1), None)],
                         ids=["d32-f36", "one-layer", "d64-one-product", "d64-two-products",
                              "d512-one-product"])
@pytest.mark.parametrize("padding", [0.0, 0.4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("plan", ["norms", "fused-norms", "norm-prologue"])
def test_launch_sequence_computes_the_layer(cupy_selected, cfg, products, padding, dtype,
                                            plan, monkeypatch):
    """The layer's launches, run by stand-ins on CPU with a NaN-poisoned workspace, keep the
    contract: seven per block and the final norm, no read of a half left unwritten, staged
    fp16 input and output, one product from d_model 512; with fuse_norms where rows are at
    most 128 wide, five per block (norm2 and the next block's norm1 in the residual GEMMs),
    the first norm1 and the final norm; with norm_prologue where rows are at most 128 wide,
    five per block (norm1 and norm2 in the prologues of Q/K/V and ffn_in) and the final
    norm."""
    fuse_norms, norm_prologue = plan == "fused-norms", plan == "norm-prologue"
    model = make_reference(cfg, seed=5)
    x, mask = make_inputs(cfg, padding_ratio=padding, seed=6)
    expected = reference_forward(model, x, mask)
    stand = StandIns()
    layer, got = _run_stand_ins(cfg, stand, x.to(dtype), mask, monkeypatch, products,
                                fuse_norms, norm_prologue=norm_prologue)
    assert got.dtype == dtype
    if dtype == torch.float32:
        report = compare(got, expected)
        assert report.passed, report.summary()
    else:  # staged in and out: the fp16 input's own rounding is beyond the contract here
        assert torch.isfinite(got).all()
    blocks, products = cfg.num_layers, products or linear_products_for(cfg.d_model)
    assert layer.fuse_norms == (fuse_norms and cfg.d_model <= 128)
    assert layer.norm_prologue == (norm_prologue and cfg.d_model <= 128)
    if layer.fuse_norms:
        assert len(stand.calls) == 5 * blocks + 2, stand.calls
        assert stand.calls.count("layer_norm") == 2, stand.calls
        assert stand.calls.count(f"linear:residual_norm:{products}") == 2 * blocks - 1
        assert stand.calls.count(f"linear:residual:{products}") == 1
    elif layer.norm_prologue:
        assert len(stand.calls) == 5 * blocks + 1, stand.calls
        assert stand.calls.count("layer_norm") == 1, stand.calls
        assert stand.calls.count("linear:half:1:prologue") == blocks, stand.calls
        assert stand.calls.count(f"linear:gelu_pair:{products}:prologue") == blocks
        assert stand.calls.count(f"linear:residual:{products}") == 2 * blocks
    else:
        assert len(stand.calls) == 7 * blocks + 1, stand.calls
        assert stand.calls.count(f"linear:residual:{products}") == 2 * blocks


def _plan_keeps_contract(cfg, padding, dtype, monkeypatch, **option) -> StandIns:
    """The layer with option (stand-ins on CPU, NaN-poisoned workspace) on inputs of dtype
    with padding: the contract kept against the fp32 reference (fp32), a finite output
    (fp16: the input's own rounding is beyond the contract here); returns the stand-ins."""
    model = make_reference(cfg, seed=5)
    x, mask = make_inputs(cfg, padding_ratio=padding, seed=6)
    stand = StandIns()
    _, got = _run_stand_ins(cfg, stand, x.to(dtype), mask, monkeypatch, None, **option)
    if dtype == torch.float32:
        report = compare(got, reference_forward(model, x, mask))
        assert report.passed, report.summary()
    else:
        assert torch.isfinite(got).all()
    return stand


@pytest.mark.parametrize("cfg, launches", [
    (LayerConfig(2, 17, 64, 2, 64, 1), ["whole_block:final"]),
    (LayerConfig(3, 20, 64, 4, 50, 3), ["whole_block"] * 2 + ["whole_block:final"]),
    (LayerConfig(2, 128, 32, 4, 32, 2, causal=False), ["whole_block", "whole_block:final"]),
    (LayerConfig(2, 129, 64, 2, 64, 1), None),  # longer than the kernel holds
    (LayerConfig(2, 12, 48, 4, 48, 1), None),   # a width it is not compiled for
    (LayerConfig(3, 24, 32, 4, 36, 2), None)],  # an FFN width it is not compiled for
    ids=["one-block", "three-blocks", "full-d32", "seq129", "d48", "f36"])
@pytest.mark.parametrize("padding", [0.0, 0.4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_whole_block_plan_computes_the_layer(cupy_selected, cfg, launches, padding, dtype,
                                             monkeypatch):
    """With whole_block, the layer's launches (stand-ins on CPU, NaN-poisoned workspace)
    keep the contract: one whole-block launch a block, each reading one residual buffer and
    writing the other (never its own input), the final norm in the last launch, or after it
    where the output is staged like the input (fp16 in and out, one block); where the kernel
    refuses the call (too long, a width not compiled), the plan without it."""
    stand = _plan_keeps_contract(cfg, padding, dtype, monkeypatch, whole_block=True)
    if launches is None:
        assert "whole_block" not in " ".join(stand.calls) and stand.calls, stand.calls
    elif dtype == torch.float16 and cfg.num_layers == 1:
        assert stand.calls == ["whole_block", "layer_norm"], stand.calls
    else:
        assert stand.calls == launches, stand.calls


@pytest.mark.parametrize("cfg, blocks", [
    (LayerConfig(2, 17, 64, 2, 64, 1), 1), (LayerConfig(3, 20, 128, 4, 120, 3), 3),
    (LayerConfig(2, 128, 32, 4, 32, 2, causal=False), 2),
    (LayerConfig(2, 200, 64, 2, 64, 2), 2),      # longer than the whole-block kernel holds
    (LayerConfig(2, 12, 48, 4, 48, 1), None),    # a width it is not compiled for
    (LayerConfig(3, 24, 32, 4, 36, 2), None)],   # an FFN width it is not compiled for
    ids=["one-block", "three-blocks-f120", "full-d32", "seq200", "d48", "f36"])
@pytest.mark.parametrize("padding", [0.0, 0.4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_after_attention_plan_computes_the_layer(cupy_selected, cfg, blocks, padding, dtype,
                                                 monkeypatch):
    """With after_attention, the layer's launches (stand-ins on CPU, NaN-poisoned workspace)
    keep the contract: the first norm1, then per block Q/K/V, attention and one
    after-attention launch, the last one writing the final norm (also where input and output
    are staged); where the kernel refuses the config (a width not compiled), the plan without
    it."""
    stand = _plan_keeps_contract(cfg, padding, dtype, monkeypatch, after_attention=True)
    if blocks is None:
        assert "after_attention" not in " ".join(stand.calls) and stand.calls, stand.calls
        return
    each = ["linear:half:1", "attention", "after_attention"]
    want = ["layer_norm"] + each * blocks
    assert stand.calls == want[:-1] + ["after_attention:final"], stand.calls


@pytest.mark.parametrize("cfg, products", [(LayerConfig(2, 12, 512, 4, 64, 2), None),
                                           (LayerConfig(2, 20, 64, 2, 64, 3), 1),
                                           (LayerConfig(2, 20, 64, 2, 64, 3), 2),
                                           (LayerConfig(2, 20, 64, 2, 64, 3), None)],
                         ids=["d512", "d64-one-product", "d64-two-products", "d64"])
def test_context_hi_only_where_out_proj_reads_hi_alone(cupy_selected, cfg, products,
                                                       monkeypatch):
    """With context_hi_only, attention writes the context's hi half alone at one product
    (the lo half stays NaN-poisoned, so a read of it breaks the contract) and both halves
    at two and three products, where out_proj reads them."""
    model = make_reference(cfg, seed=5)
    x, mask = make_inputs(cfg, padding_ratio=0.3, seed=6)
    stand = StandIns()
    layer, got = _run_stand_ins(cfg, stand, x, mask, monkeypatch, products,
                                context_hi_only=True)
    report = compare(got, reference_forward(model, x, mask))
    assert report.passed, report.summary()
    assert stand.context_lo == [layer.products > 1] * cfg.num_layers


def test_fused_norms_by_default_only_where_no_parallelism_is_lost(cupy_selected, monkeypatch):
    """By default the norms fuse where the fused grid (whole rows a block) is as large as the
    unfused one or three blocks an SM (an H200 stand-in: shapes 6, 7 and 13), not where it
    halves a grid of under three waves (shapes 1 and 5); True and False override, and
    neither fuses without wgmma or past 128 columns."""
    from layerbench.common.shapes import OFFICIAL

    for module in (ops, layer_module):
        monkeypatch.setattr(module, "multiprocessor_count", lambda device: 132)
    monkeypatch.setattr(ops, "max_shared_memory_per_block", lambda device: 227 * 1024)
    gpu = torch.device("cuda")

    def fused(number, choice=None, wgmma=True):
        cfg = OFFICIAL[number].config
        return layer_module.fuses_norms(cfg, choice, wgmma, linear_products_for(cfg.d_model), gpu)

    assert [n for n in (1, 5, 6, 7, 13) if fused(n)] == [6, 7, 13]
    assert fused(1, True) and not fused(13, False)
    assert not fused(13, wgmma=False) and not fused(13, True, wgmma=False)
    assert not fused(8) and not fused(8, True)


def test_long_sequences_run_the_tma_attention_by_default(cupy_selected):
    """Where no attention variant is named, the layer runs layer.LONG_ATTENTION (a TMA ring
    variant) on the wgmma attention at head dim 64 from LONG_ATTENTION_MIN_KEYS tokens (shape
    14), the head dim's default below that (shape 10), layer.NARROW_ATTENTION (the ring at
    two blocks an SM) at head dim 32 exactly (shape 13), the default at head dims padded to
    32 (shape 11: 8), and a named variant or the mma.sync attention whatever the length."""
    from types import SimpleNamespace

    from layerbench.backends.cupy.layer import CupyLayer
    from layerbench.common.shapes import OFFICIAL

    assert layer_module.LONG_ATTENTION.tma
    pick = CupyLayer.attention_variant_for
    long_keys = layer_module.LONG_ATTENTION_MIN_KEYS

    def layer(number, variant=None, wgmma=True):
        return SimpleNamespace(config=OFFICIAL[number].config, attention_variant=variant,
                               wgmma=wgmma)
    assert pick(layer(14), 100000) == layer_module.LONG_ATTENTION.name
    assert pick(layer(14), long_keys) == layer_module.LONG_ATTENTION.name
    assert pick(layer(14), long_keys - 1) is None
    assert pick(layer(10), 128) is None and pick(layer(11), 128) is None
    narrow = layer_module.NARROW_ATTENTION
    assert narrow.tma and narrow.min_blocks == 2 and layer_module.NARROW_ATTENTION_HEAD_DIM == 32
    assert narrow in build.ATTENTION_WGMMA[32] and narrow.refusal(32, 32) is None
    assert pick(layer(13), 1024) == pick(layer(13), 100000) == narrow.name  # head dim 32
    assert pick(layer(13, build.WGMMA_PLAIN.name), 1024) == build.WGMMA_PLAIN.name
    assert pick(layer(13, wgmma=False), 1024) is None
    assert pick(layer(14, build.WGMMA_PLAIN.name), 100000) == build.WGMMA_PLAIN.name
    assert pick(layer(14, wgmma=False), 100000) is None


@pytest.mark.parametrize("mutation, plan", [
    ("pre_residual", {"fuse_norms": True}), ("skip_next_norm1", {"fuse_norms": True}),
    ("prologue_without_bias", {"norm_prologue": True})])
def test_norm_plan_mutations_fail(cupy_selected, mutation, plan, monkeypatch):
    """The fused-norm launch sequence misses the contract when residual_norm norms the rows
    before the residual update, or leaves the next block's norm1 rows unwritten; the
    norm-prologue one when the prologue norms the rows without the norm's bias."""
    cfg = LayerConfig(2, 20, 32, 2, 48, 3)
    model = make_reference(cfg, seed=5)
    x, mask = make_inputs(cfg, padding_ratio=0.25, seed=6)
    expected = reference_forward(model, x, mask)
    _, good = _run_stand_ins(cfg, StandIns(), x, mask, monkeypatch, **plan)
    assert compare(good, expected).passed
    stand = StandIns(mutation)
    _, bad = _run_stand_ins(cfg, stand, x, mask, monkeypatch, **plan)
    if "norm_prologue" in plan:
        assert "linear:half:1:prologue" in stand.calls
    assert not compare(bad, expected).passed


def test_norm_prologue_plan(cupy_selected, monkeypatch):
    """norm_prologue applies on the wgmma GEMMs at d_model up to 128 where the norms are not
    fused (fuse_norms wins), and on each of Q/K/V and ffn_in only where it runs the plain
    schedule: a GEMM variant that fits Q/K/V keeps its own norm1 launch."""
    small, wide = LayerConfig(2, 20, 64, 2, 48, 2), LayerConfig(2, 12, 256, 4, 64, 1)
    pick = layer_module.uses_norm_prologue
    assert pick(small, True, True, False) and not pick(small, None, True, False)
    assert not pick(small, True, False, False) and not pick(small, True, True, True)
    assert not pick(wide, True, True, False)
    x, mask = make_inputs(small, padding_ratio=0.0, seed=6)
    monkeypatch.setattr(layer_module, "multiprocessor_count", lambda device: 1)
    stand = StandIns()
    layer, _ = _run_stand_ins(small, stand, x, mask, monkeypatch, products=3,
                              gemm_variant=build.GEMM_WAIT1.name, norm_prologue=True)
    assert layer.norm_prologue
    # the wait-1 variant has Q/K/V's half at one product, not ffn_in's gelu_pair at three
    assert stand.calls.count("linear:half:1") == 2 and stand.calls.count("layer_norm") == 3
    assert stand.calls.count("linear:gelu_pair:3:prologue") == 2, stand.calls


def test_norm_prologue_refusals(cupy_selected, monkeypatch):
    """ops.linear's norm prologue launches linear_wgmma_norm_prologue at the tile gemm_tile
    picks, with its shared bytes, and refuses clearly where it does not apply."""
    monkeypatch.setattr(ops, "multiprocessor_count", lambda device: 132)
    d, n = 64, 192
    x, w, b = torch.zeros(300, d), torch.zeros(d), torch.zeros(d)
    wp, bias = weight_pair(torch.zeros(n, d)), torch.zeros(n)
    out = torch.zeros(300, n, dtype=torch.float16)
    k = Recorder()
    ops.linear(k, None, wp, bias, "half", 1, out_half=out, wgmma=True, prologue_norm=(x, w, b))
    name, grid, block, shared, _ = k.calls[0]
    assert name == build.norm_prologue_name(build.WGMMA_TILES[1], 1, "half")
    assert (grid, block) == ((5, 3, 1), 128)
    assert shared == ops.wgmma_shared_bytes(64, 64, 1, build.PROLOGUE_STAGES) == 33792
    pair = (torch.zeros(300, d, dtype=torch.float16),) * 2
    refusals = [
        ({"wgmma": False}, "wgmma GEMMs only"),
        ({"gemm_variant": build.GEMM_WAIT1.name}, "plain schedule"),
        ({"a": pair}, "not an A pair as well"),
        ({"tile": (128, 256)}, "runs on the tiles"),
        ({"res": torch.zeros(300, n)}, "no residual"),
        ({"x": torch.zeros(300, 136)}, "up to 128"),
        ({"x": torch.zeros(300, 60)}, "multiple of 8"),
        ({"x": torch.zeros(300, d + 2)[:, 2:]}, "16-byte-aligned"),
        ({"x": torch.zeros(300, d, dtype=torch.float64)}, "fp32"),
        ({"epilogue": "residual"}, "not residual at 1"),
        ({"epilogue": "half", "products": 3}, "not half at 3"),
    ]
    for change, why in refusals:
        kw = {"a": None, "epilogue": "half", "products": 1, "x": x, "wgmma": True, **change}
        rows = kw.pop("x")
        with pytest.raises(ValueError, match=why):
            ops.linear(Recorder(), kw.pop("a"), wp, bias, kw.pop("epilogue"), kw.pop("products"),
                       out_half=out, prologue_norm=(rows, w, b), **kw)
    with pytest.raises(ValueError, match="needs an A pair or prologue_norm"):
        ops.linear(Recorder(), None, wp, bias, "half", 1, out_half=out, wgmma=True)


def test_norm_prologue_sass(cupy_selected, compiled, hopper_sass):
    """sm_90a SASS of every norm-prologue GEMM: BK / 16 k16 wgmmas per product of the tile's
    width in one loop body, each K tile's group waited for to 0; W copied by cp.async
    (LDGSTS), A stored by the threads (STS.64: four halves a lane), one proxy fence and one
    block barrier between those stores and the wgmmas; the norm's two five-step butterflies
    (SHFL.BFLY); no local memory, stack 0."""
    _, lowered = compiled[build.HOPPER]
    bodies, rows = hopper_sass
    names = [(t, p, e) for t in build.WGMMA_TILES
             for e, counts in build.PROLOGUE_EPILOGUES.items() for p in counts]
    assert len(names) == 8
    for tile, products, epilogue in names:
        name = build.norm_prologue_name(tile, products, epilogue)
        body, row = bodies[lowered[name]], rows[lowered[name]]
        hgmma = re.findall(r"\bHGMMA\.64x(\d+)x16\.F32\b", body)
        assert len(hgmma) == 4 * products and set(hgmma) == {str(tile[1])}, (name, hgmma)
        assert len(re.findall(r"WARPGROUP\.ARRIVE", body)) == 1, name
        assert re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x\d)", body) == ["0x0"], name
        assert "LDGSTS" in body and "UTMA" not in body, name
        assert re.search(r"\bSTS\.64\b", body), name
        assert len(re.findall(r"\bFENCE\.VIEW\.ASYNC\.S\b", body)) == 1, name
        assert len(re.findall(r"\bBAR\.SYNC\b", body)) == 1, name
        assert len(re.findall(r"\bSHFL\.BFLY\b", body)) % 10 == 0, name
        assert not re.search(r"\b(LDL|STL)\b", body), name
        assert row["stack_bytes"] == 0 and row["spill_stores"] == 0, (name, row)


def _layer_case(cfg):
    """(model, x, mask, expected) on the GPU: cfg's reference model (seed 41), inputs padded
    by 0.25 (seed 42) and the reference's output."""
    model = make_reference(cfg, seed=41)
    x, mask = make_inputs(cfg, padding_ratio=0.25, seed=42, device="cuda")
    return model, x, mask, reference_forward(model.cuda(), x, mask)


def _keeps_contract_and_replays(layer, x, mask, expected) -> None:
    """The layer keeps the contract eager, captured and replayed from its CUDA graph."""
    with torch.no_grad():
        for _ in range(3):  # eager, captured, replayed
            report = compare(layer(x, mask), expected)
            assert report.passed, report.summary()
    assert layer.graphed.graphs and not layer.graphed.uncapturable


@needs_gpu
@pytest.mark.parametrize("fuse_norms", [False, True], ids=["norms", "fused-norms"])
@pytest.mark.parametrize("wgmma", [False, True], ids=["mma", "wgmma"])
@pytest.mark.parametrize("number", [1, 7, 8], ids=["d128", "d32", "d1024"])
def test_layer_keeps_the_contract_and_replays(kernels, number, wgmma, fuse_norms):
    """The layer keeps the contract eager, captured and replayed (the launches go on
    PyTorch's stream, so a CUDA graph captures them), with either GEMM family (wgmma where
    the device has it), and with the LayerNorms fused where that applies (wgmma, d_model up
    to 128)."""
    from layerbench.backends.cupy import CupyBackend
    from layerbench.common.shapes import CI

    if wgmma and not kernels.has_wgmma:
        pytest.skip(f"no wgmma on sm_{kernels.arch}")
    if fuse_norms and not wgmma:
        pytest.skip("fuse_norms applies on the wgmma GEMMs only")
    cfg = CI[number].config
    model, x, mask, expected = _layer_case(cfg)
    layer = CupyBackend(wgmma=wgmma, fuse_norms=fuse_norms, whole_block=False,
                        after_attention=False).build(
        cfg, model.state_dict(), device="cuda")
    assert layer.fuse_norms == (fuse_norms and cfg.d_model <= 128)
    _keeps_contract_and_replays(layer, x, mask, expected)


@needs_gpu
@pytest.mark.parametrize("plan", [{"whole_block": False, "after_attention": False},
                                  {"whole_block": True}, {"after_attention": True}],
                         ids=["kernels", "whole-block", "after-attention"])
@pytest.mark.parametrize("number", [1, 7, 8], ids=["d128", "d32", "d1024"])
def test_programmatic_launches_give_the_same_bits(kernels, number, plan):
    """With pdl (each launch a programmatic dependent of the one before it) the layer gives
    the bits of ordinary launches, eager, captured and replayed, and keeps the contract."""
    from layerbench.backends.cupy import CupyBackend
    from layerbench.common.shapes import CI

    if kernels.programmatic_problem:
        pytest.skip(kernels.programmatic_problem)
    cfg = CI[number].config
    model, x, mask, expected = _layer_case(cfg)
    plain = CupyBackend(pdl=False, **plan).build(cfg, model.state_dict(), device="cuda")
    layer = CupyBackend(pdl=True, **plan).build(cfg, model.state_dict(), device="cuda")
    assert layer.pdl and not plain.pdl
    with torch.no_grad():
        want = plain(x, mask).clone()
        for _ in range(3):  # eager, captured, replayed
            got = layer(x, mask)
            assert torch.equal(got, want)
            assert compare(got, expected).passed
    assert layer.graphed.graphs and not layer.graphed.uncapturable


@needs_gpu
@pytest.mark.parametrize("number", [1, 7], ids=["d128", "d32"])
def test_layer_with_norm_prologue_keeps_the_contract_and_replays(kernels, number):
    """The layer with norm_prologue (norms unfused: Q/K/V and ffn_in norm their own rows)
    keeps the contract eager, captured and replayed, and launches five kernels a block and the
    final norm."""
    from layerbench.backends.cupy import CupyBackend
    from layerbench.common.shapes import CI

    if not kernels.has_wgmma:
        pytest.skip(f"no wgmma on sm_{kernels.arch}")
    cfg = CI[number].config
    model, x, mask, expected = _layer_case(cfg)
    layer = CupyBackend(norm_prologue=True, fuse_norms=False, whole_block=False,
                        after_attention=False).build(
        cfg, model.state_dict(), device="cuda")
    assert layer.norm_prologue and not layer.fuse_norms
    _keeps_contract_and_replays(layer, x, mask, expected)


def _layer_runs_variant(cfg, option: str, variant: str, op: str, monkeypatch) -> None:
    """CupyBackend(option=variant) at cfg keeps the contract eager, captured and replayed
    (tensor maps made at capture stay right on replay), every call of ops.<op> asking for
    variant (its variant keyword: gemm_variant or variant)."""
    from layerbench.backends.cupy import CupyBackend

    model, x, mask, expected = _layer_case(cfg)
    layer = CupyBackend(**{option: variant}, whole_block=False,
                        after_attention=False).build(cfg, model.state_dict(), device="cuda")
    names = []
    real = getattr(ops, op)
    keyword = "gemm_variant" if op == "linear" else "variant"

    def recorded(*args, **kwargs):
        names.append(kwargs.get(keyword))
        return real(*args, **kwargs)
    monkeypatch.setattr(ops, op, recorded)
    _keeps_contract_and_replays(layer, x, mask, expected)
    assert names and set(names) == {variant}, names


@needs_gpu
@pytest.mark.parametrize("variant", [v.name for v in build.GEMM_VARIANTS if v.tma])
def test_layer_with_tma_gemms_keeps_the_contract_and_replays(kernels, variant, monkeypatch):
    """The layer at d_model 1024 (CI shape 8) with a TMA GEMM variant on every GEMM (its
    grid thresholds lowered to one SM: 96 rows, partial boxes along M) keeps the contract
    eager, captured and replayed: the tensor maps made at capture stay right on replay."""
    from layerbench.common.shapes import CI

    if not kernels.has_wgmma:
        pytest.skip(f"no wgmma on sm_{kernels.arch}")
    monkeypatch.setattr(layer_module, "multiprocessor_count", lambda device: 1)
    _layer_runs_variant(CI[8].config, "gemm_variant", variant, "linear", monkeypatch)


@needs_gpu
@pytest.mark.parametrize("variant", [v.name for v in build.ATTENTION_WGMMA[64] if v.tma])
@pytest.mark.parametrize("number", [1, 14], ids=["d32", "d64"])
def test_layer_with_tma_attention_keeps_the_contract_and_replays(kernels, number, variant,
                                                                 monkeypatch):
    """The layer at CI shapes 1 (head dim 32, 48 tokens) and 14 (head dim 64, 100 tokens:
    partial query blocks and key tiles) with each TMA-ring attention variant keeps the
    contract eager, captured and replayed (its tensor maps made at capture stay right on
    replay), and runs that variant on every layer."""
    from layerbench.common.shapes import CI

    if not kernels.has_wgmma:
        pytest.skip(f"no wgmma on sm_{kernels.arch}")
    cfg = CI[number].config
    assert cfg.d_model // cfg.num_heads in (32, 64)
    _layer_runs_variant(cfg, "attention_variant", variant, "attention", monkeypatch)


def test_whole_block_rows_and_default_plan(cupy_selected, monkeypatch):
    """whole_block_rows takes 64-row blocks where they make one wave, else whole sequences;
    with whole_block None, the layer runs whole blocks on a CUDA device at d_model 32 on one
    wave of 64-row blocks, and at any width from 64 sequences with heads of 16 columns or
    more, never where the kernel refuses the call, nor where the after-attention plan's
    default takes the call (from d_model 64 where its 64-row blocks make one wave), which
    runs there and nowhere else unless asked for."""
    from types import SimpleNamespace

    assert ops.whole_block_rows(64, 128, 132) == 64
    assert ops.whole_block_rows(66, 128, 132) == 64 and ops.whole_block_rows(67, 128, 132) == 128
    assert ops.whole_block_rows(132, 64, 132) == 64 and ops.whole_block_rows(133, 64, 132) == 128
    assert ops.whole_block_rows(10000, 128, 132) == 128
    assert [ops.after_attention_rows(m, 132) for m in (128, 2112, 2113, 4224, 4225)] == [
        16, 16, 32, 32, 64]
    monkeypatch.setattr(layer_module, "multiprocessor_count", lambda device: 132)
    monkeypatch.setattr(ops, "max_shared_memory_per_block", lambda device: 227 * 1024)

    def layer(cfg, device, option, after):
        return SimpleNamespace(config=cfg, whole_block=option, after_attention=after,
                               products=3, device=torch.device(device))

    def runs(cfg, batch, seq_len, device="cuda", option=None, after=False):
        monkeypatch.setattr(ops, "whole_block_refusal",
                            lambda *a: None if seq_len <= 128 else "too long")
        return layer_module.CupyLayer.runs_whole_blocks(layer(cfg, device, option, after),
                                                        batch, seq_len)

    def after(cfg, batch, seq_len, device="cuda", option=None):
        return layer_module.CupyLayer.runs_after_attention(layer(cfg, device, None, option),
                                                           batch, seq_len)

    wide, narrow = LayerConfig(1, 128, 128, 4, 128, 1), LayerConfig(1, 128, 32, 4, 32, 1)
    assert [runs(wide, b, 128) for b in (1, 16, 63, 64, 128, 10000)] == [False] * 3 + [True] * 3
    assert runs(wide, 64, 32) and not runs(wide, 64, 129)
    assert not runs(LayerConfig(1, 128, 128, 16, 128, 1), 64, 128)  # head dim 8
    assert runs(LayerConfig(1, 128, 128, 8, 128, 1), 64, 128)  # head dim 16
    assert [runs(narrow, b, 128) for b in (1, 66, 67)] == [True, True, False]
    assert runs(narrow, 67, 64) and not runs(narrow, 10000, 128, device="cpu")
    assert not runs(wide, 64, 128, option=False) and runs(wide, 1, 128, option=True)
    # the after-attention default: 8448 rows are one wave of 64-row blocks on 132 SMs
    assert [runs(wide, b, 128, after=None) for b in (64, 66, 67)] == [False, False, True]
    assert [after(wide, b, 128) for b in (1, 64, 66, 67, 10000)] == [True] * 3 + [False] * 2
    assert after(wide, 8, 1000) and not after(wide, 64, 1024)  # any length
    assert runs(narrow, 66, 128, after=None) and not after(narrow, 1, 128)  # d_model 32
    assert not after(wide, 1, 128, device="cpu") and after(wide, 1, 128, device="cpu",
                                                           option=True)
    assert not after(wide, 1, 128, option=False) and after(narrow, 67, 128, option=True)
    assert not runs(wide, 1, 128, option=None, after=True)  # asked for: the default gives way
    assert not after(LayerConfig(1, 128, 48, 4, 48, 1), 1, 128, option=True)  # not compiled


def _masked_gpu_case(cfg, mask: str, seed: int):
    """(model, x, valid, expected) on the GPU: cfg's reference model (seed), inputs padded by
    0.4 (seed + 1), with mask "holes" also keys missing inside the sequences (the first key
    kept), and the reference's output."""
    model = make_reference(cfg, seed=seed)
    x, valid = make_inputs(cfg, padding_ratio=0.4, seed=seed + 1, device="cuda")
    if mask == "holes":
        valid = valid & (torch.rand(valid.shape, device="cuda") > 0.3)
        valid[:, 0] = True
    return model, x, valid, reference_forward(model.cuda(), x, valid)


def _writes_every_row_and_keeps_contract(layer, x, valid, expected) -> None:
    """Eager, captured and replayed, each into a NaN-poisoned output: every element written
    and the contract kept."""
    with torch.no_grad():
        for _ in range(3):  # eager, captured, replayed
            got = layer(x, valid, out=torch.full_like(x, math.nan))
            assert torch.isfinite(got).all(), "an output element left unwritten"
            report = compare(got, expected)
            assert report.passed, report.summary()


@needs_gpu
@pytest.mark.parametrize("cfg", [
    LayerConfig(3, 128, 128, 4, 128, 2), LayerConfig(5, 100, 128, 16, 128, 1),
    LayerConfig(2, 77, 128, 1, 120, 2, causal=False), LayerConfig(4, 33, 64, 2, 64, 2),
    LayerConfig(3, 128, 32, 4, 32, 2), LayerConfig(2, 1, 32, 4, 32, 1),
    LayerConfig(70, 64, 128, 2, 128, 1), LayerConfig(2, 128, 128, 8, 128, 1, causal=False)],
    ids=["s128-h4", "s100-h16", "full-h1-f120", "d64-s33", "d32", "seq1", "b70", "full-h8"])
@pytest.mark.parametrize("mask", ["prefix", "holes"])
@pytest.mark.parametrize("rows", build.WHOLE_BLOCK_ROWS, ids=lambda r: f"rows{r}")
def test_whole_block_kernel_keeps_the_contract(kernels, cfg, mask, rows, monkeypatch):
    """The whole-block layer, at each count of query rows a block, keeps the contract
    against the fp32 reference eager, captured and replayed, with prefix padding or keys
    missing inside the sequence (holes), causal or not, head dims 8 to 128, sequences of one
    token; one launch a block; its output rows are all written (the output poisoned with NaN
    first); and the same call at a length it does not hold (144 tokens) runs the plan
    without it and keeps the contract too."""
    from layerbench.backends.cupy import CupyBackend

    monkeypatch.setattr(ops, "whole_block_rows", lambda batch, seq_len, sms: rows)

    model, x, valid, expected = _masked_gpu_case(cfg, mask, seed=41)
    layer = CupyBackend(whole_block=True).build(cfg, model.state_dict(), device="cuda")
    launched = []
    real = ops.whole_block

    def recorded(*args, **kwargs):
        assert kwargs["rows"] == rows
        launched.append(kwargs["final"] is not None)
        return real(*args, **kwargs)
    monkeypatch.setattr(ops, "whole_block", recorded)
    _writes_every_row_and_keeps_contract(layer, x, valid, expected)
    assert launched[:cfg.num_layers] == [False] * (cfg.num_layers - 1) + [True], launched
    longer = LayerConfig(2, 144, cfg.d_model, cfg.num_heads, cfg.ffn_dim, 1, cfg.causal)
    x2, valid2 = make_inputs(longer, padding_ratio=0.25, seed=43, device="cuda")
    launched.clear()
    with torch.no_grad():
        report = compare(layer(x2, valid2), reference_forward(model.cuda(), x2, valid2))
    assert report.passed, report.summary()
    assert not launched, "the whole-block kernel ran a sequence it cannot hold"


@needs_gpu
@pytest.mark.parametrize("cfg", [
    LayerConfig(3, 128, 128, 4, 128, 2), LayerConfig(5, 100, 128, 16, 128, 1),
    LayerConfig(2, 77, 128, 1, 120, 2, causal=False), LayerConfig(4, 33, 64, 2, 64, 2),
    LayerConfig(3, 128, 32, 4, 32, 2), LayerConfig(2, 1, 32, 4, 32, 1),
    LayerConfig(3, 300, 128, 4, 128, 1), LayerConfig(70, 64, 128, 2, 128, 1)],
    ids=["s128-h4", "s100-h16", "full-h1-f120", "d64-s33", "d32", "seq1", "s300", "b70"])
@pytest.mark.parametrize("mask", ["prefix", "holes"])
@pytest.mark.parametrize("rows", build.AFTER_ATTENTION_ROWS, ids=lambda r: f"rows{r}")
def test_after_attention_kernel_keeps_the_contract(kernels, cfg, mask, rows, monkeypatch):
    """The after-attention layer, at each count of rows a block, keeps the contract against
    the fp32 reference eager, captured and replayed, with prefix padding or keys missing
    inside the sequence (holes), causal or not, head dims 8 to 128, FFN widths not a
    multiple of 16, sequences of one token and past 128; one after-attention launch a block,
    the last with the final norm; every output row written (the output poisoned with NaN
    first); and a call of another batch and length keeps it too."""
    from layerbench.backends.cupy import CupyBackend

    monkeypatch.setattr(ops, "after_attention_rows", lambda m, sms: rows)
    model, x, valid, expected = _masked_gpu_case(cfg, mask, seed=51)
    layer = CupyBackend(after_attention=True).build(cfg, model.state_dict(), device="cuda")
    launched = []
    real = ops.after_attention

    def recorded(*args, **kwargs):
        assert kwargs["rows"] == rows
        launched.append(kwargs.get("final_out") is not None)
        return real(*args, **kwargs)
    monkeypatch.setattr(ops, "after_attention", recorded)
    _writes_every_row_and_keeps_contract(layer, x, valid, expected)
    assert launched[:cfg.num_layers] == [False] * (cfg.num_layers - 1) + [True], launched
    other = LayerConfig(3, cfg.seq_len + 5, cfg.d_model, cfg.num_heads, cfg.ffn_dim, 1,
                        cfg.causal)
    x2, valid2 = make_inputs(other, padding_ratio=0.25, seed=53, device="cuda")
    with torch.no_grad():
        report = compare(layer(x2, valid2), reference_forward(model.cuda(), x2, valid2))
    assert report.passed, report.summary()


@pytest.mark.parametrize("d_model, blocks, refused", [(512, 24, False), (512, 25, True),
                                                      (1024, 32, True), (128, 64, False)])
def test_deep_wide_stacks_are_refused(cupy_selected, d_model, blocks, refused):
    """Past 24 blocks at d_model 512 and above the one-product Q/K/V cannot keep the
    contract: refused, naming the depth; narrower or shallower stacks are not."""
    from layerbench.backends.cupy import CupyBackend

    cfg = LayerConfig(2, 16, d_model, 4, 64, blocks)
    if refused:
        with pytest.raises(Unsupported, match=f"{blocks} blocks"):
            CupyBackend().check(cfg, "cpu", torch.float32)
    else:
        with pytest.raises(Unsupported, match="runs on cuda"):  # the device, not the depth
            CupyBackend().check(cfg, "cpu", torch.float32)


class FakeCupy:
    """Stands in for the cupy module in ops.Kernels: a current device (cupy.cuda.Device sets
    it for its block), a current stream (cupy.cuda.ExternalStream likewise), from_dlpack
    tagging each tensor with both, and a module whose functions record the device they are
    taken on and each launch's device, stream, grid and arguments. fail: the error each
    launch raises (a CUDADriverError), or None."""

    class CUDADriverError(RuntimeError):
        """cupy.cuda.driver.CUDADriverError."""

    class CUDARuntimeError(RuntimeError):
        """cupy.cuda.runtime.CUDARuntimeError."""

    def __init__(self, current_device: int = 0):
        fake = self
        self.current, self.stream, self.taken, self.launches, self.fail = (
            current_device, None, [], [], None)

        class Device:
            def __init__(self, index):
                self.index = index

            def __enter__(self):
                self.before, fake.current = fake.current, self.index

            def __exit__(self, *exc):
                fake.current = self.before

        class ExternalStream:
            def __init__(self, ptr):
                self.ptr = ptr

            def __enter__(self):
                self.before, fake.stream = fake.stream, self.ptr

            def __exit__(self, *exc):
                fake.stream = self.before

        class Kernel:
            num_regs = 100
            max_dynamic_shared_size_bytes = 48 * 1024

            def __init__(self, name):
                self.name, self.kernel = name, type("Function", (), {"ptr": 0x5EED})()

            def __call__(self, grid, block, args, shared_mem=0):
                if fake.fail is not None:
                    raise fake.fail
                fake.launches.append(("cupy", self.name, fake.current, fake.stream, grid,
                                      args))

        class Module:
            def get_function(self, name):
                fake.taken.append((name, fake.current))
                return Kernel(name)

        self.module = Module()
        self.cuda = type("cuda", (), {
            "Device": Device, "ExternalStream": ExternalStream,
            "driver": type("driver", (), {"CUDADriverError": FakeCupy.CUDADriverError}),
            "runtime": type("runtime", (), {"CUDARuntimeError": FakeCupy.CUDARuntimeError})})

    def from_dlpack(self, t):
        """The tensor, with the device and stream current at its export."""
        return ("dlpack", t.data_ptr(), self.current, self.stream)


def test_launches_run_on_torchs_stream_of_the_layers_device(cupy_selected, monkeypatch):
    """Kernels.launch takes PyTorch's current stream of the kernels' device (not the current
    device's, nor CuPy's), launches inside that device (both paths: through CuPy with the
    tensors exported on that stream, and programmatic through the driver), and turns a
    driver or runtime error of either path into a RuntimeError naming the kernel; the
    module is compiled and probed for wgmma on the kernels' device, not the current one."""
    import sys

    from layerbench.backends.cupy import driver

    assert driver.error_name(1).endswith("CUresult 1")  # named where a driver is at hand
    fake = FakeCupy(current_device=0)
    asked = []

    def current_stream(device=None):
        asked.append(device)
        return type("Stream", (), {"cuda_stream": 0x1000 + (device.index if device else 0)})()
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(ops, "device_arch", lambda device: "90")
    monkeypatch.setattr(build, "module_for", lambda arch: fake.module)
    k = ops.Kernels(torch.device("cuda", 1))
    assert k.wgmma_problem is None and fake.taken and all(dev == 1 for _, dev in fake.taken)

    x = torch.zeros(4, 8)
    k.launch("lb::probe<1>", (2, 3, 1), 64, 0, (x, None, np.int32(7)))
    assert asked == [torch.device("cuda", 1)]
    _, name, device, stream, grid, args = fake.launches[-1]
    assert (name, device, stream, grid) == ("lb::probe<1>", 1, 0x1001, (2, 3, 1))
    assert args[0] == ("dlpack", x.data_ptr(), 1, 0x1001)  # exported on that stream
    assert args[1] == ops.NULL and args[2] == np.int32(7)
    assert fake.current == 0 and fake.stream is None  # CuPy's own state left as it was

    seen = []

    def programmatic(function, grid, block, shared, stream, args):
        seen.append((function, stream, fake.current))
        return 0
    monkeypatch.setattr(driver, "launch_programmatic", programmatic)
    ops.ProgrammaticKernels(k).launch("lb::probe<1>", (1, 1, 1), 32, 0, (x,))
    assert seen == [(0x5EED, 0x1001, 1)]

    monkeypatch.setattr(driver, "launch_programmatic", lambda *args: 719)
    monkeypatch.setattr(driver, "error_name", lambda result: f"CUDA_ERROR_{result}")
    with pytest.raises(RuntimeError, match=r"lb::probe<2> failed to launch: CUDA_ERROR_719"):
        ops.ProgrammaticKernels(k).launch("lb::probe<2>", (1, 1, 1), 32, 0, (x,))
    for error in (FakeCupy.CUDADriverError("CUDA_ERROR_INVALID_VALUE"),
                  FakeCupy.CUDARuntimeError("cudaErrorInvalidDevice")):
        fake.fail = error
        with pytest.raises(RuntimeError, match=rf"lb::probe<3> failed to launch: {error}"):
            k.launch("lb::probe<3>", (1, 1, 1), 32, 0, (x,))


def test_parameter_vectors_are_aligned_copies(cupy_selected, monkeypatch):
    """A state_dict whose tensors are views into one buffer at offsets off 16 bytes builds a
    layer whose bias and norm vectors are fresh 16-byte-aligned tensors of the same values,
    none sharing the caller's memory (the kernels read them as float2 and float4)."""
    from layerbench.backends.cupy import CupyBackend

    class Hopper:  # stands in for ops.Kernels on an sm_90 device
        has_wgmma, wgmma_problem, programmatic_problem, arch = True, None, None, "90"
    monkeypatch.setattr(ops, "kernels_for", lambda device: Hopper())
    cfg = LayerConfig(2, 12, 64, 2, 36, 2)
    sd = make_reference(cfg, seed=3).state_dict()
    flat = torch.cat([torch.zeros(1)] + [t.detach().reshape(-1) for t in sd.values()])
    views, offset = {}, 1  # every tensor starts 4 bytes past a 16-byte boundary or more
    for key, t in sd.items():
        views[key] = flat[offset:offset + t.numel()].view(t.shape)
        offset += t.numel()
    assert views["layers.0.norm1.weight"].data_ptr() % 16 == 4
    layer = CupyBackend()._build(cfg, views, torch.device("cpu"), torch.float32)
    vectors = [(f"layers.{i}.", p) for i, p in enumerate(layer.params.layers)]
    names = {"norm1_weight": "norm1.weight", "norm1_bias": "norm1.bias",
             "out_bias": "attention.out_proj.bias", "norm2_weight": "norm2.weight",
             "norm2_bias": "norm2.bias", "ffn_out_bias": "ffn_out.bias"}
    shared = flat.untyped_storage().data_ptr()
    for prefix, p in vectors:
        for attr, key in names.items():
            t = getattr(p, attr)
            assert t.data_ptr() % 16 == 0 and torch.equal(t, sd[prefix + key]), prefix + key
            assert t.untyped_storage().data_ptr() != shared, prefix + key
        assert p.qkv_bias.data_ptr() % 16 == 0
    for t, key in ((layer.params.final_weight, "final_norm.weight"),
                   (layer.params.final_bias, "final_norm.bias")):
        assert t.data_ptr() % 16 == 0 and torch.equal(t, sd[key])
        assert t.untyped_storage().data_ptr() != shared


def test_residual_gemm_needs_matching_row_strides(cupy_selected):
    """The residual GEMMs address res with out's row stride: ops.linear refuses a res whose
    rows lie another distance apart, or a res without out."""
    m, d = 40, 64
    pair = (torch.zeros(m, d, dtype=torch.float16),) * 2
    wide = torch.zeros(m, d + 8)[:, :d]
    with pytest.raises(ValueError, match="row stride"):
        ops.linear(Recorder(), pair, weight_pair(torch.zeros(d, d)), torch.zeros(d), "residual",
                   3, res=wide, out=torch.zeros(m, d))
    with pytest.raises(ValueError, match="row stride"):
        ops.linear(Recorder(), pair, weight_pair(torch.zeros(d, d)), torch.zeros(d), "residual",
                   3, res=torch.zeros(m, d))
    k = Recorder()
    ops.linear(k, pair, weight_pair(torch.zeros(d, d)), torch.zeros(d), "residual", 3,
               res=wide, out=torch.zeros(m, d + 8)[:, :d])
    assert len(k.calls) == 1

