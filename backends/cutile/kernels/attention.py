"""Flash attention: one block per (query tile, sequence and head), online fp32 softmax over
key tiles, fp16 products. QKV is viewed [B, S, 3H, head_dim] (Q heads, then K, then V); the
head dim is padded to HP (a power of two) with zeros."""
import cuda.tile as ct

from .norm import store_pair
from .order import after_previous_kernel

ConstInt = ct.Constant[int]
ZERO = ct.PaddingMode.ZERO
LOG2E = 1.4426950408889634
NO_MAX = -1.0e30  # finite start for the running max: a row with no visible key gives 0


def head_tile(QKV, b, row_tile, head, rows, HP):
    """The [rows, HP] fp16 tile of one head at a row tile."""
    t = ct.load(QKV, index=(b, row_tile, head, 0), shape=(1, rows, 1, HP), padding_mode=ZERO)
    return t.reshape((rows, HP))


@ct.kernel
def flash_attention(QKV, CTX_HI, CTX_LO, VALID, KEY_INFO, scale: float, num_heads: int,
                    causal: int, has_mask: int, TM: ConstInt, TN: ConstInt, HP: ConstInt):
    """Context rows of one query tile and head as an fp16 pair (hi, lo).

    KEY_INFO[b] = (key end, mask needed): keys at or past the end are all invalid; where the
    keys before it are all valid the mask is not read.
    """
    after_previous_kernel()
    seq_len = QKV.shape[1]
    q_tiles = ct.cdiv(seq_len, TM)
    qt = q_tiles - 1 - ct.bid(0)  # longest causal rows first
    bh = ct.bid(1)
    b = bh // num_heads
    h = bh % num_heads
    key_end = seq_len
    read_mask = 0
    if has_mask != 0:
        key_end = ct.load(KEY_INFO, index=(b, 0), shape=(1, 1)).item()
        read_mask = ct.load(KEY_INFO, index=(b, 1), shape=(1, 1)).item()
    q_first = qt * TM
    if causal != 0:
        key_end = min(key_end, q_first + TM)
    key_tiles = ct.cdiv(key_end, TN)
    # Tiles before this one need no per-element test unless the mask must be read.
    clean_tiles = key_end // TN
    if causal != 0:
        clean_tiles = min(clean_tiles, (q_first + 1) // TN)

    q = head_tile(QKV, b, qt, h, TM, HP)
    rows = q_first + ct.arange(TM, dtype=ct.int32).reshape((TM, 1))
    cols = ct.arange(TN, dtype=ct.int32).reshape((1, TN))
    scale2 = scale * LOG2E
    m = ct.full((TM, 1), NO_MAX, dtype=ct.float32)
    l = ct.full((TM, 1), 0.0, dtype=ct.float32)
    acc = ct.full((TM, HP), 0.0, dtype=ct.float32)
    for j in range(key_tiles):
        k = head_tile(QKV, b, j, num_heads + h, TN, HP)
        s = ct.mma(q, ct.transpose(k), ct.full((TM, TN), 0.0, dtype=ct.float32)) * scale2
        if j >= clean_tiles or read_mask != 0:
            keys = j * TN + cols + ct.full((TM, TN), 0, dtype=ct.int32)
            visible = keys < key_end
            if causal != 0:
                visible = visible & (keys <= rows)
            if read_mask != 0:
                valid = ct.load(VALID, index=(b, j), shape=(1, TN), padding_mode=ZERO)
                visible = visible & (valid != 0)
            s = ct.where(visible, s, -float("inf"))
        m_new = ct.maximum(m, ct.max(s, axis=1, keepdims=True))
        p = ct.exp2(s - m_new, flush_to_zero=True)
        alpha = ct.exp2(m - m_new, flush_to_zero=True)
        l = l * alpha + ct.sum(p, axis=1, keepdims=True)
        v = head_tile(QKV, b, j, 2 * num_heads + h, TN, HP)
        acc = ct.mma(ct.astype(p, ct.float16), v, acc * alpha)
        m = m_new
    out = ct.where(l == 0.0, 0.0, acc / l)  # NaN inputs stay NaN, as in the reference
    store_pair(CTX_HI, CTX_LO, (b, qt, h, 0), out.reshape((1, TM, 1, HP)))
