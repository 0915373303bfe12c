"""GEMM kernels on fp16 operand pairs: OUT = A @ W^T + bias, A given as (hi, lo) fp16 rows and
W (stored [N, K] as nn.Linear keeps it, K contiguous: the layout the tensor cores read
without a transposing copy) as (hi, lo) fp16; PRODUCTS fp16 products per K step (1: A_hi W_hi;
2: + A_lo W_hi; 3: + A_hi W_lo), fp32 accumulation. Each kernel has its own epilogue."""
import cuda.tile as ct

from .norm import normalise, split, store_pair
from .order import after_previous_kernel

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


def weight_tile(W, row_tile, col_tile, rows, cols):
    """The [rows, cols] tile of an fp16 weight [N, K] at (row_tile, col_tile), transposed to
    [cols, rows] for a right-hand operand."""
    t = ct.load(W, index=(row_tile, col_tile), shape=(rows, cols), padding_mode=ZERO)
    return ct.transpose(t)


def pair_product(a, W_HI, W_LO, row_tile, col_tile, rows, cols, acc, PRODUCTS):
    """acc + a @ W^T over one weight tile, a = (hi, lo): PRODUCTS fp16 products (1: hi hi,
    2: + lo hi, 3: + hi lo; a's lo is not read below 2)."""
    w_hi = weight_tile(W_HI, row_tile, col_tile, rows, cols)
    if PRODUCTS >= 2:
        acc = ct.mma(a[1], w_hi, acc)
    if PRODUCTS >= 3:
        acc = ct.mma(a[0], weight_tile(W_LO, row_tile, col_tile, rows, cols), acc)
    return ct.mma(a[0], w_hi, acc)


def products(A_HI, A_LO, W_HI, W_LO, bm, bn, TM, TN, TK, PRODUCTS):
    """The [TM, TN] fp32 tile of A @ W^T at (bm, bn). (pair_product's products, written out:
    loading A's lo after W's hi tile, as here, keeps the kernels' measured sm_90 schedule.)"""
    acc = ct.full((TM, TN), 0.0, dtype=ct.float32)
    for k in range(ct.cdiv(A_HI.shape[1], TK)):
        a_hi = ct.load(A_HI, index=(bm, k), shape=(TM, TK), padding_mode=ZERO)
        w_hi = weight_tile(W_HI, bn, k, TN, TK)
        if PRODUCTS >= 2:
            a_lo = ct.load(A_LO, index=(bm, k), shape=(TM, TK), padding_mode=ZERO)
            acc = ct.mma(a_lo, w_hi, acc)
        if PRODUCTS >= 3:
            acc = ct.mma(a_hi, weight_tile(W_LO, bn, k, TN, TK), acc)
        acc = ct.mma(a_hi, w_hi, acc)
    return acc


def biased(acc, BIAS, bn, TN):
    """acc plus the bias of its columns."""
    bias = ct.load(BIAS, index=(bn,), shape=(TN,), padding_mode=ZERO)
    return acc + bias.reshape((1, TN))


def output_tile(A_HI, A_LO, W_HI, W_LO, BIAS, OUT, TM, TN, TK, PRODUCTS):
    """(row tile, column tile, A @ W^T + bias) of this block's [TM, TN] tile of OUT."""
    bm, bn = tile_position(OUT.shape[0], OUT.shape[1], TM, TN)
    return bm, bn, biased(products(A_HI, A_LO, W_HI, W_LO, bm, bn, TM, TN, TK, PRODUCTS),
                          BIAS, bn, TN)


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
    after_previous_kernel()
    bm, bn, acc = output_tile(A_HI, A_LO, W_HI, W_LO, BIAS, OUT, TM, TN, TK, PRODUCTS)
    ct.store(OUT, index=(bm, bn), tile=ct.astype(acc, ct.float16))


@ct.kernel
def linear_gelu(A_HI, A_LO, W_HI, W_LO, BIAS, OUT_HI, OUT_LO,
                TM: ConstInt, TN: ConstInt, TK: ConstInt, PRODUCTS: ConstInt):
    """(OUT_HI, OUT_LO) = GELU(A @ W^T + bias) as an fp16 pair."""
    after_previous_kernel()
    bm, bn, acc = output_tile(A_HI, A_LO, W_HI, W_LO, BIAS, OUT_HI, TM, TN, TK, PRODUCTS)
    store_pair(OUT_HI, OUT_LO, (bm, bn), gelu(acc))


@ct.kernel
def linear_gelu_half(A_HI, A_LO, W_HI, W_LO, BIAS, OUT,
                     TM: ConstInt, TN: ConstInt, TK: ConstInt, PRODUCTS: ConstInt):
    """OUT (fp16) = GELU(A @ W^T + bias), for an ffn_out that reads one fp16 product."""
    after_previous_kernel()
    bm, bn, acc = output_tile(A_HI, A_LO, W_HI, W_LO, BIAS, OUT, TM, TN, TK, PRODUCTS)
    ct.store(OUT, index=(bm, bn), tile=ct.astype(gelu(acc), ct.float16))


def residual_sum(acc, RES, VALID, bm, bn, has_mask, zero_sum, TM, TN):
    """RES + acc on the tile at (bm, bn); with has_mask, rows whose VALID byte is 0 get RES
    (zero_sum 0: the update is zeroed) or 0 (zero_sum 1: the sum is zeroed)."""
    res = ct.load(RES, index=(bm, bn), shape=(TM, TN), padding_mode=ZERO)
    if has_mask != 0:
        valid = ct.load(VALID, index=(bm,), shape=(TM,), padding_mode=ZERO)
        valid = valid.reshape((TM, 1)) != 0
        if zero_sum != 0:
            y = ct.where(valid, res + acc, 0.0)
        else:
            y = res + ct.where(valid, acc, 0.0)
    else:
        y = res + acc
    return y


@ct.kernel
def linear_residual(A_HI, A_LO, W_HI, W_LO, BIAS, RES, VALID, OUT, has_mask: int,
                    zero_sum: int, TM: ConstInt, TN: ConstInt, TK: ConstInt,
                    PRODUCTS: ConstInt):
    """OUT (fp32) = RES + A @ W^T + bias, invalid rows as residual_sum. OUT may be RES."""
    after_previous_kernel()
    bm, bn, acc = output_tile(A_HI, A_LO, W_HI, W_LO, BIAS, OUT, TM, TN, TK, PRODUCTS)
    y = residual_sum(acc, RES, VALID, bm, bn, has_mask, zero_sum, TM, TN)
    ct.store(OUT, index=(bm, bn), tile=y)


@ct.kernel
def linear_residual_norm(A_HI, A_LO, W_HI, W_LO, BIAS, RES, VALID, OUT, NORM_W, NORM_B,
                         NORM_HI, NORM_LO, NORM_OUT, has_mask: int, zero_sum: int,
                         final: int, TM: ConstInt, TN: ConstInt, TK: ConstInt,
                         PRODUCTS: ConstInt):
    """linear_residual where one tile holds whole rows (N <= TN), followed by the LayerNorm
    of the new rows: as an fp16 pair (NORM_HI, NORM_LO), or with final, in fp32 into
    NORM_OUT with invalid rows set to 0 (OUT is then not written)."""
    after_previous_kernel()
    bm = ct.bid(0)
    acc = biased(products(A_HI, A_LO, W_HI, W_LO, bm, 0, TM, TN, TK, PRODUCTS), BIAS, 0, TN)
    y = residual_sum(acc, RES, VALID, bm, 0, has_mask, zero_sum, TM, TN)
    store_rows_and_norm(y, bm, OUT, VALID, NORM_W, NORM_B, NORM_HI, NORM_LO, NORM_OUT,
                        has_mask, final, TM, TN)


def store_rows_and_norm(y, bm, OUT, VALID, NORM_W, NORM_B, NORM_HI, NORM_LO, NORM_OUT,
                        has_mask, final, TM, TN):
    """Whole rows y of row tile bm: y into OUT and its LayerNorm as the pair (NORM_HI,
    NORM_LO), or with final, only the LayerNorm into NORM_OUT (invalid rows 0)."""
    normed = normalise(y, OUT.shape[1], NORM_W, NORM_B, TN)
    if final != 0:
        if has_mask != 0:
            valid = ct.load(VALID, index=(bm,), shape=(TM,), padding_mode=ZERO)
            valid = valid.reshape((TM, 1)) != 0
            normed = ct.where(valid, normed, 0.0)
        ct.store(NORM_OUT, index=(bm, 0), tile=normed)
    else:
        ct.store(OUT, index=(bm, 0), tile=y)
        store_pair(NORM_HI, NORM_LO, (bm, 0), normed)


@ct.kernel
def ffn_residual_norm(A_HI, A_LO, W1_HI, W1_LO, B1, W2_HI, W2_LO, B2, RES, VALID, OUT,
                      NORM_W, NORM_B, NORM_HI, NORM_LO, NORM_OUT, has_mask: int,
                      final: int, TM: ConstInt, TN: ConstInt, TF: ConstInt,
                      PRODUCTS: ConstInt):
    """The whole FFN where one tile holds whole rows (d_model <= TN): RES + W2 GELU(W1 A +
    B1) + B2, the hidden rows made and used TF columns at a time without leaving the chip
    (as an fp16 pair for the second product), invalid rows zeroed after the sum; then
    stored with the next LayerNorm as linear_residual_norm does."""
    after_previous_kernel()
    bm = ct.bid(0)
    acc = ct.full((TM, TN), 0.0, dtype=ct.float32)
    for f in range(ct.cdiv(W1_HI.shape[0], TF)):
        hidden = gelu(biased(products(A_HI, A_LO, W1_HI, W1_LO, bm, f, TM, TF, TN, PRODUCTS),
                             B1, f, TF))
        acc = pair_product(split(hidden), W2_HI, W2_LO, 0, f, TN, TF, acc, PRODUCTS)
    y = residual_sum(biased(acc, B2, 0, TN), RES, VALID, bm, 0, has_mask, 1, TM, TN)
    store_rows_and_norm(y, bm, OUT, VALID, NORM_W, NORM_B, NORM_HI, NORM_LO, NORM_OUT,
                        has_mask, final, TM, TN)
