// GEMMs with fused epilogues: out = epilogue(A @ W^T + bias), A [M, K] and W [N, K] as fp16
// (hi, lo) pairs, on mma.sync with ldmatrix fragment loads and a cp.async pipeline.
#include "common.cuh"

namespace lb {

constexpr int BK = 32;          // K columns per pipeline stage
constexpr int ROW = BK + 8;     // shared row length in halves: 80 bytes, ldmatrix without conflicts
constexpr int STAGES = 3;

// Shared bytes of one block: STAGES x (A tiles: hi and, past one product, lo; W tiles: hi
// and, at three products, lo). The host sizes the launch with the same formula
// (ops.linear_shared_bytes).
__host__ __device__ constexpr int linear_shared_bytes(int bm, int bn, int products) {
    return STAGES * (a_parts(products) * bm + w_parts(products) * bn) * ROW * 2;
}

// Copy rows [r0, r0 + rows) x columns [k0, k0 + BK) of a row-major fp16 matrix into tile,
// zero-filling rows past row_end and columns past k_end (k_end a multiple of 8).
template <int ROWS, int THREADS>
__device__ __forceinline__ void load_tile(__half* tile, const __half* src, long long stride,
                                          int r0, int row_end, int k0, int k_end) {
    constexpr int CHUNKS = ROWS * BK / 8;
    for (int c = threadIdx.x; c < CHUNKS; c += THREADS) {
        int r = c / (BK / 8), k = (c % (BK / 8)) * 8;
        bool ok = r0 + r < row_end && k0 + k < k_end;
        const __half* g = ok ? src + (long long)(r0 + r) * stride + k0 + k : src;
        cp_async16(tile + r * ROW + k, g, ok);
    }
}

// Block tile BM x BN over WM x WN warps; PRODUCTS 1 (a_hi w_hi), 2 (a_hi w_hi + a_lo w_hi: w_lo
// not read) or 3 (a_hi w_hi + a_hi w_lo + a_lo w_hi).
// HALF: out_hi = fp16(acc + bias). GELU_PAIR: (out_hi, out_lo) = split(GELU(acc + bias)),
// or out_hi alone where out_lo is null.
// RESIDUAL: out_f = res + acc + bias on rows whose valid byte is set (all rows when valid is
// null); other rows get res (zero_sum 0) or 0 (zero_sum 1). res may be out_f (in place).
// M is any size; N and K are multiples of 8 (zero-padded weights and activations).
template <int BM, int BN, int WM, int WN, int PRODUCTS, int EPI>
__global__ void __launch_bounds__(WM * WN * 32)
linear(const __half* __restrict__ a_hi, const __half* __restrict__ a_lo, long long a_stride,
       const __half* __restrict__ w_hi, const __half* __restrict__ w_lo, long long w_stride,
       const float* __restrict__ bias, int M, int N, int K,
       __half* __restrict__ out_hi, __half* __restrict__ out_lo, long long out_stride,
       const float* res, float* out_f, const unsigned char* __restrict__ valid, int zero_sum) {
    start_after_previous();
    constexpr int THREADS = WM * WN * 32;
    constexpr int TM = BM / WM, TN = BN / WN;  // warp tile
    constexpr int MI = TM / 16, NI = TN / 8;
    static_assert(TM % 16 == 0 && TN % 16 == 0, "warp tile must be a multiple of 16x16");
    static_assert(PRODUCTS >= 1 && PRODUCTS <= 3, "one, two or three fp16 products");
    constexpr int A_PARTS = a_parts(PRODUCTS), W_PARTS = w_parts(PRODUCTS);
    constexpr int A_TILE = BM * ROW, W_TILE = BN * ROW;
    constexpr int STAGE = A_PARTS * A_TILE + W_PARTS * W_TILE;
    extern __shared__ __align__(16) unsigned char shared_raw[];
    __half* smem = reinterpret_cast<__half*>(shared_raw);

    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wm = warp / WN, wn = warp % WN;
    const int k_tiles = (K + BK - 1) / BK;

    auto load_stage = [&](int stage, int kt) {
        __half* s = smem + stage * STAGE;
        int k0 = kt * BK;
        load_tile<BM, THREADS>(s, a_hi, a_stride, m0, M, k0, K);
        load_tile<BN, THREADS>(s + A_TILE, w_hi, w_stride, n0, N, k0, K);
        // then A_lo (two or three products), then W_lo (three)
        if (A_PARTS == 2)
            load_tile<BM, THREADS>(s + A_TILE + W_TILE, a_lo, a_stride, m0, M, k0, K);
        if (W_PARTS == 2)
            load_tile<BN, THREADS>(s + 2 * A_TILE + W_TILE, w_lo, w_stride, n0, N, k0, K);
    };

    float acc[MI][NI][4];
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.0f;

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < k_tiles) load_stage(s, s);
        cp_async_commit();
    }

    // ldmatrix lane offsets: A rows (lane % 16), k half (lane / 16); W rows (lane % 8) plus
    // 8 for lanes 16-31, k half ((lane / 8) % 2).
    const int a_row = wm * TM + lane % 16, a_k = (lane / 16) * 8;
    const int w_row = wn * TN + lane % 8 + (lane / 16) * 8, w_k = ((lane / 8) % 2) * 8;

    for (int kt = 0; kt < k_tiles; ++kt) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        int next = kt + STAGES - 1;
        if (next < k_tiles) load_stage(next % STAGES, next);
        cp_async_commit();

        const __half* s = smem + (kt % STAGES) * STAGE;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
#pragma unroll
            for (int part = 0; part < PRODUCTS; ++part) {
                // product 0: a_hi w_hi; 1: a_hi w_lo; 2: a_lo w_hi (two products: 0 and 2)
                const int product = PRODUCTS == 2 && part == 1 ? 2 : part;
                const __half* at = s + (product == 2 ? A_TILE + W_TILE : 0);
                const __half* wt = s + A_TILE + (product == 1 ? A_TILE + W_TILE : 0);
                unsigned af[MI][4], bf[NI][2];
#pragma unroll
                for (int i = 0; i < MI; ++i)
                    ldmatrix_x4(af[i], at + (a_row + i * 16) * ROW + kk + a_k);
#pragma unroll
                for (int j = 0; j < NI; j += 2) {
                    unsigned r[4];
                    ldmatrix_x4(r, wt + (w_row + j * 8) * ROW + kk + w_k);
                    bf[j][0] = r[0]; bf[j][1] = r[1];
                    bf[j + 1][0] = r[2]; bf[j + 1][1] = r[3];
                }
#pragma unroll
                for (int i = 0; i < MI; ++i)
#pragma unroll
                    for (int j = 0; j < NI; ++j) mma16816(acc[i][j], af[i], bf[j]);
            }
        }
    }
    cp_async_wait<0>();

    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int i = 0; i < MI; ++i) {
#pragma unroll
        for (int half_row = 0; half_row < 2; ++half_row) {
            int row = m0 + wm * TM + i * 16 + g + half_row * 8;
            if (row >= M) continue;
            const bool keep = valid == nullptr || valid[row] != 0;  // RESIDUAL
            const long long o_row = (long long)row * out_stride;
            if constexpr (EPI == RESIDUAL) {  // the warp's pairs of this row at once
                store_residuals<NI>(
                    [&](int j) { return n0 + wn * TN + j * 8 + 2 * t; },
                    [&](int j, int col) {
                        return make_float2(acc[i][j][half_row * 2] + bias[col],
                                           acc[i][j][half_row * 2 + 1] + bias[col + 1]);
                    },
                    N, o_row, keep, zero_sum, res, out_f);
            } else {
#pragma unroll
                for (int j = 0; j < NI; ++j) {
                    int col = n0 + wn * TN + j * 8 + 2 * t;
                    if (col >= N) continue;
                    store_pair<EPI>(acc[i][j][half_row * 2] + bias[col],
                                    acc[i][j][half_row * 2 + 1] + bias[col + 1], o_row + col,
                                    out_hi, out_lo);
                }
            }
        }
    }
}

}  // namespace lb
