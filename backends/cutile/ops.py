"""Host side of each kernel family: tile choice, grid and arguments of one launch."""
from __future__ import annotations

import functools

import torch

from layerbench.common.cuda_host import cdiv, multiprocessor_count
from layerbench.common.errors import Unsupported

from . import specs


def power_of_two_at_least(n: int, low: int = 8) -> int:
    """The smallest power of two >= max(n, low)."""
    return max(low, 1 << (max(n, 1) - 1).bit_length())


@functools.cache
def placeholders(device: torch.device) -> dict[str, torch.Tensor]:
    """Arrays passed where a kernel's mask or output argument is not used."""
    return {"valid_rows": torch.ones(1, dtype=torch.uint8, device=device),
            "valid": torch.ones(1, 1, dtype=torch.uint8, device=device),
            "key_info": torch.zeros(1, 4, dtype=torch.int32, device=device),
            "half": torch.zeros(1, 8, dtype=torch.float16, device=device),
            "half_lo": torch.zeros(1, 8, dtype=torch.float16, device=device),
            "float": torch.zeros(1, 4, dtype=torch.float32, device=device)}


def row_mask(valid_rows, device) -> tuple[torch.Tensor, int]:
    """(the VALID argument, the has_mask flag) for a row mask or None."""
    if valid_rows is None:
        return placeholders(device)["valid_rows"], 0
    return valid_rows, 1


def _chosen(override, variant: str, choice):
    """(override, variant) where an override is given, else the backend's choice; a variant
    alone is refused (a variant is measured with its tile, not apart from it)."""
    if override is not None:
        return override, variant
    if variant:
        raise ValueError(f"variant {variant!r} needs its tile")
    return choice()


def _norm_launch(kernels, name, x, rows, variant, args) -> None:
    """Launch LayerNorm kernel name over x's rows: rows per block and variant as given, else
    specs.norm_rows and specs.NORM_VARIANT."""
    width = power_of_two_at_least(x.shape[1])
    rows, variant = _chosen(rows, variant, lambda: (specs.norm_rows(width), specs.NORM_VARIANT))
    kernels.launch(specs.variant_name(name, variant), {"BM": rows, "BD": width},
                   (cdiv(x.shape[0], rows), 1, 1), args)


def layer_norm_split(kernels, x, weight, bias, out_hi, out_lo, rows=None,
                     variant="") -> None:
    """out_hi + out_lo = LayerNorm(x) (fp16 pair); rows (per block) and variant override
    specs.norm_rows and specs.NORM_VARIANT."""
    _norm_launch(kernels, "layer_norm_split", x, rows, variant,
                 (x, weight, bias, out_hi, out_lo))


def layer_norm_half(kernels, x, weight, bias, out) -> None:
    """out (fp16) = LayerNorm(x) rounded once: the hi half alone, for a one-product GEMM."""
    _norm_launch(kernels, "layer_norm_half", x, None, "", (x, weight, bias, out))


def layer_norm_out(kernels, x, weight, bias, valid_rows, out) -> None:
    """out = LayerNorm(x) (fp32), rows whose valid byte is 0 set to 0."""
    mask, has_mask = row_mask(valid_rows, x.device)
    _norm_launch(kernels, "layer_norm_out", x, None, "",
                 (x, weight, bias, mask, out, has_mask))


def gemm_choice(name: str, rows: int, cols: int, device: torch.device):
    """((TM, TN, TK), variant) of GEMM kernel name: the first of specs.GEMM_CHOICES whose
    grid has at least half as many blocks as the device has multiprocessors, else the
    last."""
    choices = specs.GEMM_CHOICES[name]
    enough = multiprocessor_count(device) // 2
    for (tm, tn, tk), variant in choices:
        if cdiv(rows, tm) * cdiv(cols, tn) >= enough:
            return (tm, tn, tk), variant
    return choices[-1]


def _gemm(kernels, name, a, weight, out_shape, products, args, tile=None,
          variant="") -> None:
    (tm, tn, tk), variant = _chosen(
        tile, variant, lambda: gemm_choice(name, out_shape[0], out_shape[1], a[0].device))
    grid = (cdiv(out_shape[0], tm) * cdiv(out_shape[1], tn), 1, 1)
    kernels.launch(specs.variant_name(name, variant),
                   {"TM": tm, "TN": tn, "TK": tk, "PRODUCTS": products}, grid,
                   (a[0], a[1], weight[0], weight[1], *args))


def linear_half(kernels, a, weight, bias, out, tile=None, variant="") -> None:
    """out (fp16) = a @ weight^T + bias, one fp16 product (a and weight are (hi, lo) pairs;
    tile (TM, TN, TK) and variant override gemm_choice)."""
    _gemm(kernels, "linear_half", a, weight, out.shape, 1, (bias, out), tile, variant)


def linear_gelu(kernels, a, weight, bias, out, products: int, tile=None,
                variant="") -> None:
    """out (an fp16 pair) = GELU(a @ weight^T + bias)."""
    _gemm(kernels, "linear_gelu", a, weight, out[0].shape, products, (bias, out[0], out[1]),
          tile, variant)


def linear_gelu_half(kernels, a, weight, bias, out, products: int, tile=None,
                     variant="") -> None:
    """out (fp16) = GELU(a @ weight^T + bias) rounded once, for a one-product ffn_out."""
    _gemm(kernels, "linear_gelu_half", a, weight, out.shape, products, (bias, out), tile,
          variant)


def linear_residual(kernels, a, weight, bias, res, valid_rows, out, products: int,
                    zero_sum: bool, tile=None, variant="") -> None:
    """out = res + a @ weight^T + bias; invalid rows get res (zero_sum False) or 0 (True)."""
    mask, has_mask = row_mask(valid_rows, a[0].device)
    _gemm(kernels, "linear_residual", a, weight, out.shape, products,
          (bias, res, mask, out, has_mask, int(zero_sum)), tile, variant)


def norm_gemm_width(n: int) -> int | None:
    """The padded row width of linear_residual_norm for rows of n columns, or None (too wide)."""
    width = power_of_two_at_least(n)
    return width if width in specs.NORM_GEMM_WIDTHS else None


def _rows_with_norm(name, valid_rows, out, pair, final):
    """(padded width, the VALID argument, NORM_HI, NORM_LO, NORM_OUT, has_mask, final flag)
    of a kernel that stores whole rows with their LayerNorm into pair or final; raises
    unless exactly one of them is given and the rows fit one tile (norm_gemm_width)."""
    if (pair is None) == (final is None):
        raise ValueError(f"{name} writes either a pair or a final output")
    width = norm_gemm_width(out.shape[1])
    if width is None:
        raise ValueError(f"{name}: rows of {out.shape[1]} do not fit one tile")
    spare = placeholders(out.device)
    mask, has_mask = row_mask(valid_rows, out.device)
    hi, lo = pair or (spare["half"], spare["half_lo"])
    norm_out = spare["float"] if final is None else final
    return width, mask, hi, lo, norm_out, has_mask, int(final is not None)


def linear_residual_norm(kernels, a, weight, bias, res, valid_rows, out, norm, *,
                         products: int, zero_sum: bool, pair=None, final=None, tile=None,
                         variant="") -> None:
    """linear_residual, then the LayerNorm (norm = (weight, bias)) of the new rows: into pair
    (an fp16 pair; out gets the rows too) or into final (fp32, invalid rows 0; out is not
    written). The rows must fit one tile (norm_gemm_width); tile (TM, TK) and variant
    override specs.NORM_GEMM_TILE and specs.NORM_GEMM_VARIANT."""
    width, mask, hi, lo, norm_out, has_mask, is_final = _rows_with_norm(
        "linear_residual_norm", valid_rows, out, pair, final)
    (tm, tk), variant = _chosen(  # one column tile: the grid covers row tiles only
        tile, variant, lambda: (specs.NORM_GEMM_TILE, specs.NORM_GEMM_VARIANT.get(width, "")))
    _gemm(kernels, "linear_residual_norm", a, weight, out.shape, products,
          (bias, res, mask, out, norm[0], norm[1], hi, lo, norm_out, has_mask, int(zero_sum),
           is_final), tile=(tm, width, tk), variant=variant)


def ffn_residual_norm(kernels, a, ffn_in, ffn_out, res, valid_rows, out, norm, *,
                      products: int, pair=None, final=None) -> None:
    """The whole FFN on rows a (an fp16 pair): out = res + ffn_out(GELU(ffn_in(a))), invalid
    rows zeroed, then the LayerNorm of the new rows into pair or final as
    linear_residual_norm. ffn_in and ffn_out are (weight pair, bias); the rows must fit one
    tile (norm_gemm_width)."""
    width, mask, hi, lo, norm_out, has_mask, is_final = _rows_with_norm(
        "ffn_residual_norm", valid_rows, out, pair, final)
    (w1, b1), (w2, b2) = ffn_in, ffn_out
    tm = specs.NORM_GEMM_TILE[0]
    kernels.launch("ffn_residual_norm",
                   {"TM": tm, "TN": width, "TF": specs.FFN_CHUNK, "PRODUCTS": products},
                   (cdiv(out.shape[0], tm), 1, 1),
                   (a[0], a[1], w1[0], w1[1], b1, w2[0], w2[1], b2, res, mask, out, norm[0],
                    norm[1], hi, lo, norm_out, has_mask, is_final))


def block_narrow(kernels, x, out, valid, params, weights, ffn_in_bias, final, *,
                 num_heads: int, causal: bool, products: int) -> None:
    """out = one whole block (params: the block's LayerParams, weights: its weight pairs,
    ffn_in_bias padded to a multiple of 8) applied to x ([B, S, d_model] fp32; out another
    such array); final = (weight, bias) of the final LayerNorm to apply too, or None.
    Raises Unsupported where the sizes do not fit specs.block_constants."""
    b, s, d = x.shape
    constants = specs.block_constants(s, d, num_heads, params.ffn_in_bias.shape[0], products)
    if constants is None:
        raise Unsupported(f"the whole-block kernel does not fit sequences of {s}, d_model {d},"
                          f" {num_heads} heads, ffn_dim {params.ffn_in_bias.shape[0]}")
    spare = placeholders(x.device)
    norm = final or (params.norm1_weight, params.norm1_bias)  # unused without final
    pairs = [weights[n] for n in ("qkv_weight", "out_weight", "ffn_in_weight",
                                  "ffn_out_weight")]
    kernels.launch(
        specs.block_kernel(constants), constants,
        (b, constants["SP"] // constants["QM"], 1),
        (x, out, spare["valid"] if valid is None else valid, *pairs[0], params.qkv_bias,
         *pairs[1], params.out_bias, params.norm1_weight, params.norm1_bias,
         params.norm2_weight, params.norm2_bias, *pairs[2], ffn_in_bias, *pairs[3],
         params.ffn_out_bias, *norm, (d // num_heads) ** -0.5, num_heads, int(causal),
         int(valid is not None), int(final is not None)))


def attention_choice(batch_heads: int, seq_len: int, head_pad: int, device: torch.device):
    """((TM, TN), variant) of attention: specs.ATTENTION_CHOICES' first where the grid has
    fewer than two 128-query blocks per multiprocessor, its last otherwise."""
    choices = specs.ATTENTION_CHOICES[head_pad]
    if batch_heads * cdiv(seq_len, 128) < 2 * multiprocessor_count(device):
        return choices[0]
    return choices[-1]


def attention(kernels, qkv, ctx, valid, info, *, num_heads: int, causal: bool,
              tile=None, variant="") -> None:
    """ctx (an fp16 pair, [B, S, H, hd] views) = attention of qkv ([B, S, 3H, hd] view);
    tile (TM, TN) and variant override attention_choice."""
    b, s, _, hd = qkv.shape
    hp = power_of_two_at_least(hd)
    (tm, tn), variant = _chosen(
        tile, variant, lambda: attention_choice(b * num_heads, s, hp, qkv.device))
    spare = placeholders(qkv.device)
    kernels.launch(specs.variant_name("flash_attention", variant),
                   {"TM": tm, "TN": tn, "HP": hp},
                   (cdiv(s, tm), b * num_heads, 1),
                   (qkv, ctx[0], ctx[1], spare["valid"] if valid is None else valid,
                    spare["key_info"] if info is None else info, hd ** -0.5, num_heads,
                    int(causal), int(valid is not None)))
