"""GEMM kernels on fp16 operand pairs: OUT = A @ W^T + bias, A given as (hi, lo) fp16 rows and
W (stored [N, K] as nn.Linear keeps it, K contiguous: the layout the tensor cores read
without a transposing copy) as (hi, lo) fp16; PRODUCTS fp16 products per K step (1: A_hi W_hi;
2: + A_lo W_hi; 3: + A_hi W_lo), fp32 accumulation. Each kernel has its own epilogue."""
import cuda.tile as ct

ConstInt = ct.Constant[int]
ZERO = ct.PaddingMode.ZERO

# erf by Abramowitz and Stegun 7.1.26 (absolute error below 1.5e-7), for the exact GELU.
ERF_P = 0.3275911
ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)
SQRT_HALF = 0.7071067811865476


def tile_position(M, N, TM, TN):
    """(row tile, column tile) of this block; the column tiles of one row tile run together."""
    col_tiles = ct.cdiv(N, TN)
    bid = ct.bid(0)
    return bid // col_tiles, bid % col_tiles


def products(A_HI, A_LO, W_HI, W_LO, bm, bn, TM, TN, TK, PRODUCTS):
    """The [TM, TN] fp32 tile of A @ W^T at (bm, bn)."""
    acc = ct.full((TM, TN), 0.0, dtype=ct.float32)
    for k in range(ct.cdiv(A_HI.shape[1], TK)):
        a_hi = ct.load(A_HI, index=(bm, k), shape=(TM, TK), padding_mode=ZERO, allow_tma=False)
        w_hi = ct.transpose(ct.load(W_HI, index=(bn, k), shape=(TN, TK), padding_mode=ZERO,
                                    allow_tma=False))
        if PRODUCTS >= 2:
            a_lo = ct.load(A_LO, index=(bm, k), shape=(TM, TK), padding_mode=ZERO, allow_tma=False)
            acc = ct.mma(a_lo, w_hi, acc)
        if PRODUCTS >= 3:
            w_lo = ct.transpose(ct.load(W_LO, index=(bn, k), shape=(TN, TK), padding_mode=ZERO,
                                        allow_tma=False))
            acc = ct.mma(a_hi, w_lo, acc)
        acc = ct.mma(a_hi, w_hi, acc)
    return acc


def biased(acc, BIAS, bn, TN):
    """acc plus the bias of its columns."""
    return acc + ct.load(BIAS, index=(bn,), shape=(TN,), padding_mode=ZERO, allow_tma=False).reshape((1, TN))


def gelu(x):
    """Exact GELU, 0.5 x (1 + erf(x / sqrt 2))."""
    z = ct.abs(x) * SQRT_HALF
    t = 1.0 / (1.0 + ERF_P * z)
    poly = t * (ERF_A[0] + t * (ERF_A[1] + t * (ERF_A[2] + t * (ERF_A[3] + t * ERF_A[4]))))
    erf_abs = 1.0 - poly * ct.exp(-z * z)
    erf = ct.where(x < 0.0, -erf_abs, erf_abs)
    return 0.5 * x * (1.0 + erf)


@ct.kernel
def linear_half(A_HI, A_LO, W_HI, W_LO, BIAS, OUT,
                TM: ConstInt, TN: ConstInt, TK: ConstInt, PRODUCTS: ConstInt):
    """OUT (fp16) = A @ W^T + bias."""
    bm, bn = tile_position(OUT.shape[0], OUT.shape[1], TM, TN)
    acc = biased(products(A_HI, A_LO, W_HI, W_LO, bm, bn, TM, TN, TK, PRODUCTS), BIAS, bn, TN)
    ct.store(OUT, index=(bm, bn), tile=ct.astype(acc, ct.float16), allow_tma=False)


@ct.kernel
def linear_gelu(A_HI, A_LO, W_HI, W_LO, BIAS, OUT_HI, OUT_LO,
                TM: ConstInt, TN: ConstInt, TK: ConstInt, PRODUCTS: ConstInt):
    """(OUT_HI, OUT_LO) = GELU(A @ W^T + bias) as an fp16 pair."""
    bm, bn = tile_position(OUT_HI.shape[0], OUT_HI.shape[1], TM, TN)
    acc = biased(products(A_HI, A_LO, W_HI, W_LO, bm, bn, TM, TN, TK, PRODUCTS), BIAS, bn, TN)
    y = gelu(acc)
    hi = ct.astype(y, ct.float16)
    ct.store(OUT_HI, index=(bm, bn), tile=hi, allow_tma=False)
    ct.store(OUT_LO, index=(bm, bn), tile=ct.astype(y - ct.astype(hi, ct.float32), ct.float16), allow_tma=False)


@ct.kernel
def linear_residual(A_HI, A_LO, W_HI, W_LO, BIAS, RES, VALID, OUT, has_mask: int,
                    zero_sum: int, TM: ConstInt, TN: ConstInt, TK: ConstInt,
                    PRODUCTS: ConstInt):
    """OUT (fp32) = RES + A @ W^T + bias. With has_mask, rows whose VALID byte is 0 get RES
    (zero_sum 0: the update is zeroed) or 0 (zero_sum 1: the sum is zeroed). OUT may be RES."""
    bm, bn = tile_position(OUT.shape[0], OUT.shape[1], TM, TN)
    acc = biased(products(A_HI, A_LO, W_HI, W_LO, bm, bn, TM, TN, TK, PRODUCTS), BIAS, bn, TN)
    res = ct.load(RES, index=(bm, bn), shape=(TM, TN), padding_mode=ZERO, allow_tma=False)
    if has_mask != 0:
        valid = ct.load(VALID, index=(bm,), shape=(TM,), padding_mode=ZERO, allow_tma=False).reshape((TM, 1)) != 0
        if zero_sum != 0:
            y = ct.where(valid, res + acc, 0.0)
        else:
            y = res + ct.where(valid, acc, 0.0)
    else:
        y = res + acc
    ct.store(OUT, index=(bm, bn), tile=y, allow_tma=False)
