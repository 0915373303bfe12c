// A Transformer block's work after attention in one launch, for rows of at most 128 columns:
// out_proj of the context (an fp16 pair) and its residual, norm2, ffn_in with exact GELU,
// ffn_out and its residual, then the next block's norm1 (its fp16 rows, which Q/K/V reads)
// or the final norm; three fp16 products each, on mma.sync m16n8k16. A block takes ROWS rows
// (16, 32 or 64); each 16-row group is shared by CW warps, each warp taking 1 / CW of every
// product's output columns, so that a warp's chain of dependent products is short. Each
// product's A operand (the context, the normed rows, the hidden rows) comes from shared memory
// as an fp16 pair; a row's LayerNorm sums meet in shared memory. The FFN's hidden rows never
// reach global memory. Uses whole_block.cu's copy and fragment helpers (same module).
#include "common.cuh"

namespace lb {

// Warps that share a 16-row group: each takes at least 16 columns of every product.
__host__ __device__ constexpr int aa_column_warps(int d) { return d >= 64 ? 4 : 2; }
__host__ __device__ constexpr int aa_threads(int d, int rows) {
    return rows / 16 * aa_column_warps(d) * 32;
}
// Shared memory, in halves unless named: the out_proj pair, later ffn_out's ([D] rows of D + 8
// or F + 8); the ffn_in pair ([F] rows of D + 8); the block's A operand pair (the context,
// later the normed rows; [ROWS] rows of D + 8); the hidden pair ([ROWS] rows of F + 8); then
// the rows' partial sums (floats, two per column warp and row).
__host__ __device__ constexpr int aa_weights0(int d, int f) {
    return 2 * d * (d > f ? d + 8 : f + 8);
}
__host__ __device__ constexpr int after_attention_shared_bytes(int d, int f, int rows) {
    return 2 * (aa_weights0(d, f) + 2 * f * (d + 8) + 2 * rows * (d + 8) + 2 * rows * (f + 8)) +
           4 * 2 * aa_column_warps(d) * rows;
}

// acc[j] += A B^T over KC k16 steps by three fp16 products (a_hi w_hi + a_hi w_lo + a_lo w_hi):
// A, a warp's 16 rows of an fp16 pair in shared memory (hi at a, lo a_lo halves after, rows
// of PITCH halves); W, rows [n0, n0 + 8 NT) of a pair in shared memory ([n][k] rows of PITCH
// halves, lo w_lo halves after hi). The cross products sum apart, so that the hi x hi chain
// does not wait on them.
template <int KC, int NT, int PITCH>
__device__ __forceinline__ void aa_products(float (&acc)[NT][4], const __half* a, int a_lo,
                                            const __half* w, int w_lo, int n0, int lane) {
    static_assert(NT % 2 == 0, "n8 tiles in pairs");
    const int w_row = lane % 8 + (lane / 16) * 8, w_k = ((lane / 8) % 2) * 8;
    float small[NT][4];
    wb_zero(small);
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) {
        unsigned x_hi[4], x_lo[4];
        wb_shared_operand<PITCH>(x_hi, a, kc, lane);
        wb_shared_operand<PITCH>(x_lo, a + a_lo, kc, lane);
#pragma unroll
        for (int j = 0; j < NT; j += 2) {
            const __half* wp = w + (n0 + j * 8 + w_row) * PITCH + kc * 16 + w_k;
            unsigned hi[4], lo[4];
            ldmatrix_x4(hi, wp);
            ldmatrix_x4(lo, wp + w_lo);
            mma16816(acc[j], x_hi, hi);
            mma16816(acc[j + 1], x_hi, hi + 2);
            mma16816(small[j], x_hi, lo);
            mma16816(small[j + 1], x_hi, lo + 2);
            mma16816(small[j], x_lo, hi);
            mma16816(small[j + 1], x_lo, hi + 2);
        }
    }
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] += small[j][e];
}

// Each of a warp's two rows' sum of v over the row's D columns, which CW warps hold NT n8
// tiles each of: the quad's sum, then the column warps' through shared memory (red, [CW][ROWS]
// floats; row_in_block of the lane's first row). Ends with every warp past a block barrier.
template <int NT, int CW, int ROWS, typename Value>
__device__ __forceinline__ void aa_row_sums(float (&sum)[2], Value value, float* red, int cw,
                                            int row_in_block, int t) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < NT; ++j) s += value(j, 2 * r) + value(j, 2 * r + 1);
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        if (t == 0) red[cw * ROWS + row_in_block + 8 * r] = s;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < CW; ++w) s += red[w * ROWS + row_in_block + 8 * r];
        sum[r] = s;
    }
}

// LayerNorm (weight w, bias b at the warp's first column c0) of a warp's two rows held as NT
// n8 tiles in v (in place); the mean, then the variance from a second pass, each summed over
// the row's column warps (red: two [CW][ROWS] arrays, so that the second pass needs no barrier
// before its writes).
template <int D, int NT, int CW, int ROWS>
__device__ __forceinline__ void aa_norm(float (&v)[NT][4], const float* __restrict__ w,
                                        const float* __restrict__ b, float eps, float* red,
                                        int cw, int c0, int row_in_block, int t) {
    float mean[2], var[2];
    aa_row_sums<NT, CW, ROWS>(mean, [&](int j, int e) { return v[j][e]; }, red, cw,
                              row_in_block, t);
    mean[0] /= D;
    mean[1] /= D;
    aa_row_sums<NT, CW, ROWS>(var, [&](int j, int e) {
        const float a = v[j][e] - mean[e / 2];
        return a * a;
    }, red + CW * ROWS, cw, row_in_block, t);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        const int col = c0 + 8 * j + 2 * t;
        const float2 w2 = *reinterpret_cast<const float2*>(w + col);
        const float2 b2 = *reinterpret_cast<const float2*>(b + col);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float rstd = rsqrtf(var[r] / D + eps);
            v[j][2 * r] = (v[j][2 * r] - mean[r]) * rstd * w2.x + b2.x;
            v[j][2 * r + 1] = (v[j][2 * r + 1] - mean[r]) * rstd * w2.y + b2.y;
        }
    }
}

// h = residual_value(acc + bias, h, keep, zero_sum) over a warp's NT n8 tiles (columns c0 +
// 8 j + 2 t): out_proj's residual (zero_sum 0) and ffn_out's (1); then stored(r, col, value)
// for each updated pair of row r.
template <int NT, typename Stored>
__device__ __forceinline__ void aa_residual(float (&h)[NT][4], const float (&acc)[NT][4],
                                            const float* __restrict__ bias,
                                            const bool (&keep)[2], int zero_sum, int c0, int t,
                                            Stored stored) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        const int col = c0 + 8 * j + 2 * t;
        const float2 b = *reinterpret_cast<const float2*>(bias + col);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float2 v = residual_value(acc[j][2 * r] + b.x, acc[j][2 * r + 1] + b.y,
                                            make_float2(h[j][2 * r], h[j][2 * r + 1]), keep[r],
                                            zero_sum);
            h[j][2 * r] = v.x;
            h[j][2 * r + 1] = v.y;
            stored(r, col, v);
        }
    }
}

// A warp's NT n8 tiles (columns c0 + 8 j + 2 t) split into an fp16 pair in shared rows (hi at
// dst, lo lo halves after, rows of PITCH halves; the warp's first row at dst).
template <int NT, int PITCH>
__device__ __forceinline__ void aa_store_pair(const float (&v)[NT][4], __half* dst, int lo,
                                              int c0, int g, int t) {
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            __half h0, l0, h1, l1;
            split_half(v[j][2 * r], h0, l0);
            split_half(v[j][2 * r + 1], h1, l1);
            const int o = (g + 8 * r) * PITCH + c0 + 8 * j + 2 * t;
            *reinterpret_cast<unsigned*>(dst + o) = pack_halves(h0, h1);
            *reinterpret_cast<unsigned*>(dst + o + lo) = pack_halves(l0, l1);
        }
}

// Grid (ceil(rows / ROWS)), aa_threads(D, ROWS) threads, after_attention_shared_bytes(D, F,
// ROWS). For rows [0, rows) of the residual stream x (fp32, pitch x_stride) and the attention
// context (ctx_hi, ctx_lo: fp16, pitch ctx_stride): h = x + out_proj(ctx) + out_b (x where
// the row's valid byte is 0), z = h + ffn_out(GELU(ffn_in(norm2(h)) + in_b)) + ffn_b (0 where
// invalid), stored to out (fp32, pitch out_stride; null: not stored). With norm_out, also the
// LayerNorm of z by (norm_w, norm_b) as fp16 (pitch norm_stride: the next block's norm1 rows);
// with final_out, the final LayerNorm of z by (norm_w, norm_b) as fp32 (pitch final_stride), 0
// on invalid rows. out and final_out may be x (each element is read and written by one
// thread), norm_out may be ctx_hi (each block reads its rows before it writes them). Weights:
// fp16 (hi, lo) pairs of [N, K] rows (out [D, D], ffn_in [f8, D], ffn_out [D, f8], f8 the
// FFN's width padded to 8; F is it padded to 16). valid: a byte a row, or null.
template <int D, int F, int ROWS>
__global__ void __launch_bounds__(aa_threads(D, ROWS), 1)
after_attention(const float* x, long long x_stride, const __half* ctx_hi,
                const __half* __restrict__ ctx_lo, long long ctx_stride, float* out,
                long long out_stride, const __half* __restrict__ out_w_hi,
                const __half* __restrict__ out_w_lo, const float* __restrict__ out_b,
                const __half* __restrict__ in_w_hi, const __half* __restrict__ in_w_lo,
                const float* __restrict__ in_b, const __half* __restrict__ ffn_w_hi,
                const __half* __restrict__ ffn_w_lo, const float* __restrict__ ffn_b,
                const float* __restrict__ norm2_w, const float* __restrict__ norm2_b,
                const float* __restrict__ norm_w, const float* __restrict__ norm_b,
                __half* norm_out, long long norm_stride, float* __restrict__ final_out,
                long long final_stride, const unsigned char* __restrict__ valid, int rows,
                int f8, float eps) {
    static_assert(D % 32 == 0 && F % 32 == 0 && D <= 128 && F <= 128, "widths: 32 to 128");
    static_assert(ROWS == 16 || ROWS == 32 || ROWS == 64, "16, 32 or 64 rows a block");
    constexpr int CW = aa_column_warps(D), THREADS = aa_threads(D, ROWS);
    constexpr int PD = D + 8, PF = F + 8;
    constexpr int ND = D / CW / 8, NF = F / CW / 8;  // n8 tiles of a warp's columns
    extern __shared__ __align__(16) unsigned char aa_smem[];
    __half* sW0 = reinterpret_cast<__half*>(aa_smem);  // out_proj's pair, then ffn_out's
    __half* sW1 = sW0 + aa_weights0(D, F);             // ffn_in's pair
    __half* sA = sW1 + 2 * F * PD;                     // the context pair, then norm2's rows
    __half* sH = sA + 2 * ROWS * PD;                   // the hidden pair
    float* red = reinterpret_cast<float*>(sH + 2 * ROWS * PF);

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int grp = warp / CW, cw = warp % CW;
    const int r_block = grp * 16 + g;  // the lane's first row in the block (the second: + 8)
    const long long first = (long long)blockIdx.x * ROWS;
    const int here = (int)(rows - first < ROWS ? rows - first : ROWS);
    const int cd = cw * (D / CW), cf = cw * (F / CW);  // the warp's first column of each width

    // The weights do not depend on the kernel before this one: copy them before waiting.
    wb_copy<PD, THREADS>(sW0, out_w_hi, D, D, D, D, D);
    wb_copy<PD, THREADS>(sW0 + D * PD, out_w_lo, D, D, D, D, D);
    cp_async_commit();
    start_after_previous();
    wb_copy<PD, THREADS>(sA, ctx_hi + first * ctx_stride, ctx_stride, ROWS, D, here, D);
    wb_copy<PD, THREADS>(sA + ROWS * PD, ctx_lo + first * ctx_stride, ctx_stride, ROWS, D, here,
                         D);
    cp_async_commit();
    wb_copy<PD, THREADS>(sW1, in_w_hi, D, F, D, f8, D);
    wb_copy<PD, THREADS>(sW1 + F * PD, in_w_lo, D, F, D, f8, D);
    cp_async_commit();

    // The lane's rows' residuals and valid bytes, read while the copies land.
    bool present[2], keep[2];
    float h[ND][4];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = r_block + 8 * r;
        present[r] = row < here;
        keep[r] = present[r] && (valid == nullptr || valid[first + row] != 0);
        const float* xr = x + (first + row) * x_stride + cd + 2 * t;
#pragma unroll
        for (int j = 0; j < ND; ++j) {
            const float2 v = present[r] ? *reinterpret_cast<const float2*>(xr + 8 * j)
                                        : make_float2(0.0f, 0.0f);
            h[j][2 * r] = v.x;
            h[j][2 * r + 1] = v.y;
        }
    }

    // 1. out_proj and its residual: h = x + ctx W_out^T + out_b on valid rows, x elsewhere.
    cp_async_wait<1>();
    __syncthreads();
    {
        float acc[ND][4];
        wb_zero(acc);
        aa_products<D / 16, ND, PD>(acc, sA + grp * 16 * PD, ROWS * PD, sW0, D * PD, cd, lane);
        aa_residual(h, acc, out_b, keep, 0, cd, t, [](int, int, float2) {});
    }

    // 2. norm2 of h into sA (the context is read: norm2's first barrier follows every warp's
    // out_proj), then ffn_out's pair copied over out_proj's.
    float n[ND][4];
#pragma unroll
    for (int j = 0; j < ND; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) n[j][e] = h[j][e];
    aa_norm<D, ND, CW, ROWS>(n, norm2_w, norm2_b, eps, red, cw, cd, r_block, t);
    wb_copy<PF, THREADS>(sW0, ffn_w_hi, f8, D, F, D, f8);
    wb_copy<PF, THREADS>(sW0 + D * PF, ffn_w_lo, f8, D, F, D, f8);
    cp_async_commit();
    aa_store_pair<ND, PD>(n, sA + grp * 16 * PD, ROWS * PD, cd, g, t);
    cp_async_wait<1>();  // ffn_in's pair
    __syncthreads();

    // 3. ffn_in with GELU: the warp's F / CW hidden columns, as a pair into sH.
    {
        float acc[NF][4];
        wb_zero(acc);
        aa_products<D / 16, NF, PD>(acc, sA + grp * 16 * PD, ROWS * PD, sW1, F * PD, cf, lane);
        wb_bias_gelu(acc, in_b, cf, f8, t);
        aa_store_pair<NF, PF>(acc, sH + grp * 16 * PF, ROWS * PF, cf, g, t);
    }
    cp_async_wait<0>();  // ffn_out's pair
    __syncthreads();

    // 4. ffn_out and its residual: z = h + hidden W_ffn^T + ffn_b on valid rows, 0 elsewhere.
    {
        float acc[ND][4];
        wb_zero(acc);
        aa_products<F / 16, ND, PF>(acc, sH + grp * 16 * PF, ROWS * PF, sW0, D * PF, cd, lane);
        aa_residual(h, acc, ffn_b, keep, 1, cd, t, [&](int r, int col, float2 z) {
            if (present[r] && out != nullptr)
                *reinterpret_cast<float2*>(out + (first + r_block + 8 * r) * out_stride + col) =
                    z;
        });
    }

    // 5. The next block's norm1 (fp16) or the final norm (fp32, 0 on invalid rows).
    if (norm_out == nullptr && final_out == nullptr) return;
    aa_norm<D, ND, CW, ROWS>(h, norm_w, norm_b, eps, red, cw, cd, r_block, t);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (!present[r]) continue;
        const long long row = first + r_block + 8 * r;
#pragma unroll
        for (int j = 0; j < ND; ++j) {
            const int col = cd + 8 * j + 2 * t;
            if (norm_out != nullptr) {
                *reinterpret_cast<__half2*>(norm_out + row * norm_stride + col) =
                    __floats2half2_rn(h[j][2 * r], h[j][2 * r + 1]);
            } else {
                *reinterpret_cast<float2*>(final_out + row * final_stride + col) =
                    keep[r] ? make_float2(h[j][2 * r], h[j][2 * r + 1])
                            : make_float2(0.0f, 0.0f);
            }
        }
    }
}

}  // namespace lb
