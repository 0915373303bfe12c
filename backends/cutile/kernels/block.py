"""One whole Transformer block in one kernel, for short narrow sequences: a block takes QM
query rows of one sequence (its rows padded to SP, a power of two), d_model padded to DP and
the FFN's hidden width padded to FP, and runs norm1, Q/K/V (keys and values from all SP
rows), attention, out_proj, the residual, norm2, the FFN and its residual (and with final,
the final LayerNorm) without its rows leaving the chip. The products and roundings are
those of the separate kernels: Q/K/V with one fp16 product, attention on fp16 Q, K, V and
probabilities, out_proj and the FFN with PRODUCTS products of fp16 pairs. Heads must have a
power-of-two width HP, d_model = heads x HP."""
import cuda.tile as ct

from .linear import gelu, pair_product, weight_tile
from .norm import normalise, split
from .order import after_previous_kernel

ConstInt = ct.Constant[int]
ZERO = ct.PaddingMode.ZERO
LOG2E = 1.4426950408889634


def vector(V, tile, size):
    """A [1, size] row of fp32 vector V at tile index tile (zero past its end)."""
    return ct.load(V, index=(tile,), shape=(size,), padding_mode=ZERO).reshape((1, size))


@ct.kernel
def block_narrow(X, OUT, VALID, WQKV_HI, WQKV_LO, BQKV, WO_HI, WO_LO, BO, N1_W, N1_B, N2_W,
                 N2_B, W1_HI, W1_LO, B1, W2_HI, W2_LO, B2, NF_W, NF_B, scale: float,
                 num_heads: int, causal: int, has_mask: int, final: int, SP: ConstInt,
                 QM: ConstInt, DP: ConstInt, HP: ConstInt, FP: ConstInt, PRODUCTS: ConstInt):
    """OUT[b] = the block applied to X[b] (X, OUT: [B, S, d_model] fp32), for the QM query
    rows of chunk bid(1) of sequence bid(0); keys and values come from all SP rows. VALID
    [B, S] bytes: with has_mask, keys whose byte is 0 are not attended, and their rows keep
    the residual after out_proj and are zeroed after the FFN. With final, OUT gets the final
    LayerNorm (NF_W, NF_B) of the block's output, invalid rows 0. OUT must not be X."""
    after_previous_kernel()
    b = ct.bid(0)
    chunk = ct.bid(1)
    seq_len = X.shape[1]
    width = X.shape[2]
    keys = ct.arange(SP, dtype=ct.int32).reshape((1, SP))
    rows = chunk * QM + ct.arange(QM, dtype=ct.int32).reshape((QM, 1))
    key_valid = keys < seq_len
    row_valid = rows < seq_len
    if has_mask != 0:
        key_valid = key_valid & (ct.load(VALID, index=(b, 0), shape=(1, SP),
                                         padding_mode=ZERO) != 0)
        row_valid = row_valid & (ct.load(VALID, index=(b, chunk), shape=(1, QM),
                                         padding_mode=ZERO).reshape((QM, 1)) != 0)
    visible = key_valid & (rows >= 0)
    if causal != 0:
        visible = visible & (keys <= rows)

    x_all = ct.load(X, index=(b, 0, 0), shape=(1, SP, DP), padding_mode=ZERO)
    h_all = ct.astype(normalise(x_all.reshape((SP, DP)), width, N1_W, N1_B, DP), ct.float16)
    x = ct.load(X, index=(b, chunk, 0), shape=(1, QM, DP), padding_mode=ZERO)
    x = x.reshape((QM, DP))
    h = ct.astype(normalise(x, width, N1_W, N1_B, DP), ct.float16)
    scale2 = scale * LOG2E
    update = ct.full((QM, DP), 0.0, dtype=ct.float32)
    for head in range(num_heads):
        q = ct.mma(h, weight_tile(WQKV_HI, head, 0, HP, DP),
                   ct.full((QM, HP), 0.0, dtype=ct.float32)) + vector(BQKV, head, HP)
        at_keys = ct.full((SP, HP), 0.0, dtype=ct.float32)
        k = ct.mma(h_all, weight_tile(WQKV_HI, num_heads + head, 0, HP, DP), at_keys) \
            + vector(BQKV, num_heads + head, HP)
        v = ct.mma(h_all, weight_tile(WQKV_HI, 2 * num_heads + head, 0, HP, DP), at_keys) \
            + vector(BQKV, 2 * num_heads + head, HP)
        s = ct.mma(ct.astype(q, ct.float16), ct.transpose(ct.astype(k, ct.float16)),
                   ct.full((QM, SP), 0.0, dtype=ct.float32)) * scale2
        s = ct.where(visible, s, -float("inf"))
        m = ct.max(s, axis=1, keepdims=True)
        p = ct.where(visible, ct.exp2(s - m, flush_to_zero=True), 0.0)
        l = ct.sum(p, axis=1, keepdims=True)
        ctx = ct.mma(ct.astype(p, ct.float16), ct.astype(v, ct.float16),
                     ct.full((QM, HP), 0.0, dtype=ct.float32))
        ctx = ct.where(l == 0.0, 0.0, ctx / l)
        update = pair_product(split(ctx), WO_HI, WO_LO, 0, head, DP, HP, update, PRODUCTS)
    y = x + ct.where(row_valid, update + vector(BO, 0, DP), 0.0)

    h2 = split(normalise(y, width, N2_W, N2_B, DP))
    hidden = pair_product(h2, W1_HI, W1_LO, 0, 0, FP, DP,
                          ct.full((QM, FP), 0.0, dtype=ct.float32), PRODUCTS)
    hidden = split(gelu(hidden + vector(B1, 0, FP)))
    ffn = pair_product(hidden, W2_HI, W2_LO, 0, 0, DP, FP,
                       ct.full((QM, DP), 0.0, dtype=ct.float32), PRODUCTS)
    z = ct.where(row_valid, y + ffn + vector(B2, 0, DP), 0.0)
    if final != 0:
        z = ct.where(row_valid, normalise(z, width, NF_W, NF_B, DP), 0.0)
    ct.store(OUT, index=(b, chunk, 0), tile=z.reshape((1, QM, DP)))
