"""LayerNorm kernels: BM whole rows per block, each row padded to BD (a power of two) columns."""
import cuda.tile as ct

from .order import after_previous_kernel

ConstInt = ct.Constant[int]
ZERO = ct.PaddingMode.ZERO
EPS = 1e-5


def normed_rows(X, W, B, BM, BD):
    """The block's BM rows of X, normalised and scaled (fp32, columns past the width are 0)."""
    x = ct.load(X, index=(ct.bid(0), 0), shape=(BM, BD), padding_mode=ZERO)
    return normalise(x, X.shape[1], W, B, BD)


def normalise(x, width, W, B, BD):
    """LayerNorm of the rows of tile x ([rows, BD], zero past width) with weight W, bias B."""
    inside = ct.arange(BD, dtype=ct.int32).reshape((1, BD)) < width
    mean = ct.sum(x, axis=1, keepdims=True) / width
    centred = ct.where(inside, x - mean, 0.0)
    var = ct.sum(centred * centred, axis=1, keepdims=True) / width
    w = ct.load(W, index=(0,), shape=(BD,), padding_mode=ZERO).reshape((1, BD))
    b = ct.load(B, index=(0,), shape=(BD,), padding_mode=ZERO).reshape((1, BD))
    return centred * ct.rsqrt(var + EPS) * w + b


def split(y):
    """fp32 tile y as an fp16 pair: hi = fp16(y), lo = fp16(y - hi) (~22 bits in all)."""
    hi = ct.astype(y, ct.float16)
    return hi, ct.astype(y - ct.astype(hi, ct.float32), ct.float16)


def store_pair(OUT_HI, OUT_LO, index, y):
    """Store fp32 tile y as the fp16 pair split gives (hi stored before lo is computed: the
    kernels' measured sm_90 schedule)."""
    hi = ct.astype(y, ct.float16)
    ct.store(OUT_HI, index=index, tile=hi)
    ct.store(OUT_LO, index=index, tile=ct.astype(y - ct.astype(hi, ct.float32), ct.float16))


@ct.kernel
def layer_norm_split(X, W, B, OUT_HI, OUT_LO, BM: ConstInt, BD: ConstInt):
    """LayerNorm of BM rows, written as an fp16 pair (hi + lo is the fp32 result to ~22 bits)."""
    after_previous_kernel()
    store_pair(OUT_HI, OUT_LO, (ct.bid(0), 0), normed_rows(X, W, B, BM, BD))


@ct.kernel
def layer_norm_half(X, W, B, OUT, BM: ConstInt, BD: ConstInt):
    """LayerNorm of BM rows rounded to fp16 (for a GEMM that reads one fp16 product)."""
    after_previous_kernel()
    ct.store(OUT, index=(ct.bid(0), 0),
             tile=ct.astype(normed_rows(X, W, B, BM, BD), ct.float16))


@ct.kernel
def layer_norm_out(X, W, B, VALID, OUT, has_mask: int, BM: ConstInt, BD: ConstInt):
    """LayerNorm of BM rows into fp32 OUT; with has_mask, rows whose VALID byte is 0 get 0."""
    after_previous_kernel()
    y = normed_rows(X, W, B, BM, BD)
    if has_mask != 0:
        valid = ct.load(VALID, index=(ct.bid(0),), shape=(BM,), padding_mode=ZERO)
        y = ct.where(valid.reshape((BM, 1)) != 0, y, 0.0)
    ct.store(OUT, index=(ct.bid(0), 0), tile=y)
