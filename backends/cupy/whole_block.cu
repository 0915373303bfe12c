// One Transformer block of short sequences in one launch: norm1, Q/K/V, attention, out_proj
// and the residual, norm2, the FFN and its residual (and, after the last block, the final
// norm), on mma.sync m16n8k16. A block takes ROWS query rows of one sequence (64: four
// warps; 128: eight warps, a whole sequence, its keys and values computed once); each warp
// holds its 16 rows in registers where a product's output is the next one's operand (the
// accumulator layout of one mma is the operand layout of the next). The keys and values of
// every row a block's queries may see are computed by the block itself, so blocks never
// wait for each other. Each product runs as a rolled loop over column chunks, so that the
// code a block runs stays small: out_proj is summed chunk by chunk of the attention's
// output, and the FFN's second product chunk by chunk of its hidden columns.
#include "common.cuh"

namespace lb {

constexpr int WB_MAX_KEYS = 128;            // the longest sequence it runs
constexpr int WB_MAX_ROWS = WB_MAX_KEYS;    // query rows of a block: 64 or 128, 16 a warp

// Shared memory, in halves, at widths D and F (d_model and the FFN's width, multiples of
// 32), rows of width + 8 halves (ldmatrix rows on distinct banks). Buffer 0 holds the K and V
// weights, then out_proj's pair; buffer 1 Q's weights (rows [0, D)) and the block's Q rows
// (from row wb_q_row), then ffn_in's pair (its hi half once Q's weights are free, its lo
// half once attention is done); then the keys and the values of up to WB_MAX_KEYS rows, and
// after attention ffn_out's pair.
__host__ __device__ constexpr int wb_max(int a, int b) { return a > b ? a : b; }
__host__ __device__ constexpr int wb_q_row(int d, int f) { return wb_max(d, f); }
__host__ __device__ constexpr int wb_buffer0(int d) { return 2 * d * (d + 8); }
__host__ __device__ constexpr int wb_buffer1(int d, int f) {
    return wb_max(wb_q_row(d, f) + WB_MAX_ROWS, 2 * f) * (d + 8);
}
__host__ __device__ constexpr int wb_keys(int d, int f) {
    return wb_max(2 * WB_MAX_KEYS * (d + 8), 2 * d * (f + 8));
}
__host__ __device__ constexpr int whole_block_shared_bytes(int d, int f) {
    return 2 * (wb_buffer0(d) + wb_buffer1(d, f) + wb_keys(d, f));
}

// Copy rows [0, rows) x halves [0, cols) of a row-major fp16 matrix (row pitch stride) into
// shared rows of PITCH halves, asynchronously, zero-filling rows at or past valid_rows and
// columns at or past valid_cols (multiples of 8); every one of the block's THREADS threads
// takes part.
template <int PITCH, int THREADS>
__device__ __forceinline__ void wb_copy(__half* dst, const __half* src, long long stride,
                                        int rows, int cols, int valid_rows, int valid_cols) {
    const int per_row = cols / 8;
    for (int c = threadIdx.x; c < rows * per_row; c += THREADS) {
        const int r = c / per_row, k = (c % per_row) * 8;
        const bool ok = r < valid_rows && k < valid_cols;
        cp_async16(dst + r * PITCH + k, ok ? src + (long long)r * stride + k : src, ok);
    }
}

// Rows r0 + g and r0 + g + 8 of a sequence's fp32 rows x (row pitch stride) in a warp's
// accumulator layout: v[j][e] is row r0 + g + 8 (e / 2), column 8 j + 2 t + e % 2 (g = lane
// / 4, t = lane % 4); rows at or past rows read as 0.
template <int D>
__device__ __forceinline__ void wb_load_rows(float (&v)[D / 8][4], const float* x,
                                             long long stride, int r0, int rows, int g, int t) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = r0 + g + 8 * r;
        const float* p = x + (long long)row * stride + 2 * t;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            const float2 val = row < rows ? *reinterpret_cast<const float2*>(p + 8 * j)
                                          : make_float2(0.0f, 0.0f);
            v[j][2 * r] = val.x;
            v[j][2 * r + 1] = val.y;
        }
    }
}

// The A operand of k16 step kc from accumulator tiles 2 kc and 2 kc + 1 (rows g and g + 8),
// as fp16 (hi) and, with lo, the rounding errors (lo): x = hi + lo to about 22 bits.
__device__ __forceinline__ void wb_operand(const float (&c0)[4], const float (&c1)[4],
                                           unsigned (&hi)[4], unsigned* lo) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        __half h[4], l[4];
        split_half(c0[2 * r], h[0], l[0]);
        split_half(c0[2 * r + 1], h[1], l[1]);
        split_half(c1[2 * r], h[2], l[2]);
        split_half(c1[2 * r + 1], h[3], l[3]);
        hi[r] = pack_halves(h[0], h[1]);
        hi[r + 2] = pack_halves(h[2], h[3]);
        if (lo != nullptr) {
            lo[r] = pack_halves(l[0], l[1]);
            lo[r + 2] = pack_halves(l[2], l[3]);
        }
    }
}

// LayerNorm of a warp's 16 rows of D columns held in the accumulator layout (v, in place):
// each row's sums over its quad's 4 lanes, the variance from a second pass.
template <int D>
__device__ __forceinline__ void wb_norm(float (&v)[D / 8][4], const float* __restrict__ w,
                                        const float* __restrict__ b, float eps, int t) {
    float mean[2], rstd[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) s += v[j][2 * r] + v[j][2 * r + 1];
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        mean[r] = s / D;
        float q = 0.0f;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            const float a = v[j][2 * r] - mean[r], c = v[j][2 * r + 1] - mean[r];
            q += a * a + c * c;
        }
        q += __shfl_xor_sync(0xffffffffu, q, 1);
        q += __shfl_xor_sync(0xffffffffu, q, 2);
        rstd[r] = rsqrtf(q / D + eps);
    }
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
        const float2 w2 = *reinterpret_cast<const float2*>(w + 8 * j + 2 * t);
        const float2 b2 = *reinterpret_cast<const float2*>(b + 8 * j + 2 * t);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            v[j][2 * r] = (v[j][2 * r] - mean[r]) * rstd[r] * w2.x + b2.x;
            v[j][2 * r + 1] = (v[j][2 * r + 1] - mean[r]) * rstd[r] * w2.y + b2.y;
        }
    }
}

// acc[j] += A (16 x 16 KC, operand fragments a) times rows [n0, n0 + 8 NT) of W (shared,
// [n][k] rows of PITCH halves) transposed: NT n8 tiles.
template <int KC, int NT, int PITCH>
__device__ __forceinline__ void wb_product(float (&acc)[NT][4], const unsigned (&a)[KC][4],
                                           const __half* w, int n0, int lane) {
    static_assert(NT % 2 == 0, "n8 tiles in pairs");
    const int w_row = lane % 8 + (lane / 16) * 8, w_k = ((lane / 8) % 2) * 8;
#pragma unroll
    for (int kc = 0; kc < KC; ++kc)
#pragma unroll
        for (int j = 0; j < NT; j += 2) {
            unsigned r[4];
            ldmatrix_x4(r, w + (n0 + j * 8 + w_row) * PITCH + kc * 16 + w_k);
            mma16816(acc[j], a[kc], r);
            mma16816(acc[j + 1], a[kc], r + 2);
        }
}

// The three fp16 products of a hi/lo pair, acc[j] += a_hi w_hi + (a_hi w_lo + a_lo w_hi)
// over rows [n0, n0 + 8 NT) of W (w_lo at w_hi + lo_offset halves). With CROSS, the two small
// products go to an accumulator of their own, so that the hi x hi chain does not wait on
// them; without, every product adds to acc (the NT tiles' chains run side by side).
template <int KC, int NT, int PITCH, bool CROSS = true>
__device__ __forceinline__ void wb_three_products(float (&acc)[NT][4],
                                                  const unsigned (&a_hi)[KC][4],
                                                  const unsigned (&a_lo)[KC][4],
                                                  const __half* w_hi, int lo_offset, int n0,
                                                  int lane) {
    static_assert(NT % 2 == 0, "n8 tiles in pairs");
    const int w_row = lane % 8 + (lane / 16) * 8, w_k = ((lane / 8) % 2) * 8;
    float cross[NT][4];  // unused without CROSS
    float (&small)[NT][4] = CROSS ? cross : acc;
    if (CROSS) {
#pragma unroll
        for (int j = 0; j < NT; ++j) small[j][0] = small[j][1] = small[j][2] = small[j][3] = 0.0f;
    }
#pragma unroll
    for (int kc = 0; kc < KC; ++kc)
#pragma unroll
        for (int j = 0; j < NT; j += 2) {
            const __half* w = w_hi + (n0 + j * 8 + w_row) * PITCH + kc * 16 + w_k;
            unsigned hi[4], lo[4];
            ldmatrix_x4(hi, w);
            ldmatrix_x4(lo, w + lo_offset);
            mma16816(acc[j], a_hi[kc], hi);
            mma16816(acc[j + 1], a_hi[kc], hi + 2);
            mma16816(small[j], a_hi[kc], lo);
            mma16816(small[j + 1], a_hi[kc], lo + 2);
            mma16816(small[j], a_lo[kc], hi);
            mma16816(small[j + 1], a_lo[kc], hi + 2);
        }
    if (CROSS) {
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[j][e] += small[j][e];
    }
}

// A warp's A operand of k16 step kc from 16 fp16 rows in shared memory (pitch PITCH).
template <int PITCH>
__device__ __forceinline__ void wb_shared_operand(unsigned (&a)[4], const __half* rows, int kc,
                                                  int lane) {
    ldmatrix_x4(a, rows + (lane % 16) * PITCH + kc * 16 + (lane / 16) * 8);
}

// Which halves of k16 step kc lie in columns [c0, c1) (heads are 8-column multiples).
__device__ __forceinline__ void wb_halves(int kc, int c0, int c1, bool& lo_in, bool& hi_in) {
    lo_in = kc * 16 >= c0 && kc * 16 + 8 <= c1;
    hi_in = kc * 16 + 8 >= c0 && kc * 16 + 16 <= c1;
}

// Stores columns [c0, c0 + 8 NT) of a warp's accumulator tiles (bias added, at bias + c0)
// as fp16 into shared rows dst (pitch PITCH); rows whose flag is false get zeros.
template <int NT, int PITCH>
__device__ __forceinline__ void wb_store_half(const float (&acc)[NT][4], const float* bias,
                                              __half* dst, int c0, const bool (&flag)[2],
                                              int g, int t) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        const int col = c0 + 8 * j + 2 * t;
        const float2 b2 = *reinterpret_cast<const float2*>(bias + col);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const __half2 val = flag[r] ? __floats2half2_rn(acc[j][2 * r] + b2.x,
                                                            acc[j][2 * r + 1] + b2.y)
                                        : __floats2half2_rn(0.0f, 0.0f);
            *reinterpret_cast<__half2*>(dst + (g + 8 * r) * PITCH + col) = val;
        }
    }
}

// acc[j] = GELU(acc[j] + bias) over NT n8 tiles of hidden columns c0 + 8 j + 2 t (the bias
// 0 at and past f8, the FFN's width padded to 8).
template <int NT>
__device__ __forceinline__ void wb_bias_gelu(float (&acc)[NT][4], const float* bias, int c0,
                                             int f8, int t) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        const int col = c0 + 8 * j + 2 * t;
        const float2 b = col < f8 ? *reinterpret_cast<const float2*>(bias + col)
                                  : make_float2(0.0f, 0.0f);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            acc[j][2 * r] = gelu(acc[j][2 * r] + b.x);
            acc[j][2 * r + 1] = gelu(acc[j][2 * r + 1] + b.y);
        }
    }
}

template <int ROWS, int COLS>
__device__ __forceinline__ void wb_zero(float (&a)[ROWS][COLS]) {
#pragma unroll
    for (int i = 0; i < ROWS; ++i)
#pragma unroll
        for (int j = 0; j < COLS; ++j) a[i][j] = 0.0f;
}

// Grid (ceil(seq_len / ROWS), batch), 2 ROWS threads, whole_block_shared_bytes(D, F).
// x: the block's input rows (fp32, pitch x_stride), never written; out: its output rows
// (pitch out_stride). Without final_w, out gets the block's output; with it, out holds the
// sum after out_proj's residual (h = x + attention's output), and the final LayerNorm of the
// block's output goes to final_out (fp32, pitch final_stride; rows whose valid byte is 0 set
// to 0). Weights: fp16 (hi, lo) pairs of [N, K] rows, K padded to a multiple of 8 (qkv
// [3 D, D] hi only, out [D, D], ffn_in [f8, D], ffn_out [D, f8], f8 the FFN's width padded to
// 8; F is it padded to 16, a multiple of 32 at the compiled widths). valid/key_info: the key mask and its per-sequence extents
// (cuda_host.key_info), or null. Rows past seq_len are neither read nor written; seq_len at
// most WB_MAX_KEYS.
template <int D, int F, int ROWS>
__global__ void __launch_bounds__(2 * ROWS, 1)
whole_block(const float* __restrict__ x, long long x_stride, float* out, long long out_stride,
            const __half* __restrict__ qkv_w, const float* __restrict__ qkv_b,
            const __half* __restrict__ out_w_hi, const __half* __restrict__ out_w_lo,
            const float* __restrict__ out_b,
            const __half* __restrict__ in_w_hi, const __half* __restrict__ in_w_lo,
            const float* __restrict__ in_b,
            const __half* __restrict__ ffn_w_hi, const __half* __restrict__ ffn_w_lo,
            const float* __restrict__ ffn_b,
            const float* __restrict__ norm1_w, const float* __restrict__ norm1_b,
            const float* __restrict__ norm2_w, const float* __restrict__ norm2_b,
            const float* __restrict__ final_w, const float* __restrict__ final_b,
            float* __restrict__ final_out, long long final_stride,
            const unsigned char* __restrict__ valid, const int* __restrict__ key_info,
            int seq_len, int f8, int num_heads, int head_dim, float scale, int causal,
            float eps) {
    static_assert(D % 32 == 0 && F % 32 == 0 && D <= 128 && F <= 128, "widths: 32 to 128");
    static_assert(ROWS == 64 || ROWS == WB_MAX_ROWS, "64 rows a block or a whole sequence");
    constexpr int WARPS = ROWS / 16, THREADS = 32 * WARPS;
    constexpr int KD = D / 16;                 // k16 steps over D
    constexpr int PD = D + 8, PF = F + 8;      // shared row pitches (halves)
    constexpr int NS = WB_MAX_KEYS / 8;        // n8 score tiles of a row's keys
    constexpr int NC = D % 64 == 0 ? 64 : 32;  // K, V and Q columns a loop step
    constexpr int HC = 32;                     // the FFN's hidden columns a loop step
    extern __shared__ __align__(16) unsigned char wb_smem[];
    __half* buf0 = reinterpret_cast<__half*>(wb_smem);
    __half* buf1 = buf0 + wb_buffer0(D);
    __half* sK = buf1 + wb_buffer1(D, F);
    __half* sV = sK + WB_MAX_KEYS * PD;
    __half* sW2 = sK;                          // ffn_out's pair, once attention is done
    __half* sQ = buf1 + wb_q_row(D, F) * PD;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int b = blockIdx.y;
    const long long row_base = (long long)b * seq_len;
    const float* xs = x + row_base * x_stride;
    float* outs = out + row_base * out_stride;

    // The weights do not depend on the kernel before this one: copy them before waiting.
    wb_copy<PD, THREADS>(buf0, qkv_w + (long long)D * D, D, 2 * D, D, 2 * D, D);  // K and V
    cp_async_commit();
    wb_copy<PD, THREADS>(buf1, qkv_w, D, D, D, D, D);  // Q
    cp_async_commit();
    start_after_previous();

    // Keys [0, kv_end) may be visible; with holes, some of them are invalid (read valid).
    const KeyExtent keys = visible_keys(key_info, b, seq_len);
    const int kv_end = keys.end;
    const bool holes = keys.holes;
    const unsigned char* vrow = valid != nullptr ? valid + row_base : nullptr;
    const int q_block = blockIdx.x * ROWS;
    const int kv_stop = causal ? imin(kv_end, q_block + ROWS) : kv_end;

    // 1. Keys and values of rows [0, kv_stop), 16 rows a warp at a time: norm1, one fp16
    // product, NC columns a step; rows that are not visible keys are stored as zeros.
    cp_async_wait<1>();
    __syncthreads();
    for (int grp = warp; grp * 16 < kv_stop; grp += WARPS) {
        float v[D / 8][4];
        wb_load_rows<D>(v, xs, x_stride, grp * 16, seq_len, g, t);
        wb_norm<D>(v, norm1_w, norm1_b, eps, t);
        unsigned a[KD][4];
#pragma unroll
        for (int kc = 0; kc < KD; ++kc) wb_operand(v[2 * kc], v[2 * kc + 1], a[kc], nullptr);
        bool visible[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int key = grp * 16 + g + 8 * r;
            visible[r] = key < kv_end && (!holes || vrow[key] != 0);
        }
#pragma unroll 1
        for (int n0 = 0; n0 < 2 * D; n0 += NC) {  // K's columns, then V's
            float acc[NC / 8][4];
            wb_zero(acc);
            wb_product<KD, NC / 8, PD>(acc, a, buf0, n0, lane);
            __half* dst = (n0 < D ? sK : sV) + grp * 16 * PD;
            wb_store_half<NC / 8, PD>(acc, qkv_b + D + (n0 < D ? 0 : D), dst, n0 % D, visible,
                                      g, t);
        }
    }
    __syncthreads();  // K and V stored; buffer 0 free
    wb_copy<PD, THREADS>(buf0, out_w_hi, D, D, D, D, D);
    wb_copy<PD, THREADS>(buf0 + D * PD, out_w_lo, D, D, D, D, D);
    cp_async_commit();

    // 2. Q of the warp's rows (norm1 again, one product), stored in fp16 (as the layer's
    // fp16 Q/K/V rows) to the warp's 16 rows of sQ.
    const int q0 = q_block + warp * 16;
    const bool rows = q0 < seq_len;
    __half* sQw = sQ + warp * 16 * PD;
    cp_async_wait<1>();
    __syncthreads();
    if (rows) {
        float v[D / 8][4];
        wb_load_rows<D>(v, xs, x_stride, q0, seq_len, g, t);
        wb_norm<D>(v, norm1_w, norm1_b, eps, t);
        unsigned a[KD][4];
#pragma unroll
        for (int kc = 0; kc < KD; ++kc) wb_operand(v[2 * kc], v[2 * kc + 1], a[kc], nullptr);
        const bool all[2] = {true, true};
#pragma unroll 1
        for (int n0 = 0; n0 < D; n0 += NC) {
            float acc[NC / 8][4];
            wb_zero(acc);
            wb_product<KD, NC / 8, PD>(acc, a, buf1, n0, lane);
            wb_store_half<NC / 8, PD>(acc, qkv_b, sQw, n0, all, g, t);
        }
    }
    __syncthreads();  // Q's weights read: ffn_in's hi half takes their rows
    wb_copy<PD, THREADS>(buf1, in_w_hi, D, F, D, f8, D);
    cp_async_commit();

    // 3. Attention head by head with every score of a row in registers (a plain softmax: at
    // most WB_MAX_KEYS keys); each 16 columns of a head's output, as a hi/lo pair, go
    // straight into out_proj's three products (y, all D columns).
    float y[D / 8][4];
    wb_zero(y);
    cp_async_wait<1>();
    __syncthreads();
    if (rows) {
        const int kb_row = lane % 8 + (lane / 16) * 8, kb_col = ((lane / 8) % 2) * 8;
        const int vb_row = lane % 8 + ((lane / 8) % 2) * 8, vb_col = (lane / 16) * 8;
        const float sl = scale * 1.4426950408889634f;  // scores to the log2 domain
        const float NEG_INF = neg_inf();
        const int n_keys = causal ? imin(kv_end, q0 + 16) : kv_end;
        const int chunks = (n_keys + 15) / 16;  // 16-key steps that hold a visible key
#pragma unroll 1
        for (int h = 0; h < num_heads; ++h) {
            const int c0 = h * head_dim, c1 = c0 + head_dim;  // the head's columns
            float s[NS][4];
            wb_zero(s);
#pragma unroll 1
            for (int kc = c0 / 16; kc * 16 < c1; ++kc) {
                bool lo_in, hi_in;
                wb_halves(kc, c0, c1, lo_in, hi_in);
                unsigned aq[4];
                wb_shared_operand<PD>(aq, sQw, kc, lane);
                if (!lo_in) aq[0] = aq[1] = 0u;
                if (!hi_in) aq[2] = aq[3] = 0u;
#pragma unroll
                for (int nn = 0; nn < NS / 2; ++nn) {
                    if (nn >= chunks) break;
                    unsigned kb[4];
                    ldmatrix_x4(kb, sK + (nn * 16 + kb_row) * PD + kc * 16 + kb_col);
                    mma16816(s[2 * nn], aq, kb);
                    mma16816(s[2 * nn + 1], aq, kb + 2);
                }
            }
            // s[j][e]: row q0 + g + 8 (e / 2), key 8 j + 2 t + e % 2.
            float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
            for (int j = 0; j < NS; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = 8 * j + 2 * t + e % 2, row = q0 + g + 8 * (e / 2);
                    bool ok = j < 2 * chunks && key < kv_end && !(causal && key > row);
                    if (ok && holes) ok = vrow[key] != 0;
                    s[j][e] = ok ? s[j][e] * sl : NEG_INF;
                    mx[e / 2] = fmaxf(mx[e / 2], s[j][e]);
                }
            }
            float l[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                if (mx[r] == NEG_INF) mx[r] = 0.0f;  // no visible key: every P is 0
                l[r] = 0.0f;
            }
            unsigned p[NS / 2][4];  // P as fp16 A operands, 16 keys a step
#pragma unroll
            for (int kk = 0; kk < NS / 2; ++kk) {
                if (kk >= chunks) break;
#pragma unroll
                for (int j = 2 * kk; j < 2 * kk + 2; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        s[j][e] = exp2f(s[j][e] - mx[e / 2]);
                        l[e / 2] += s[j][e];
                    }
                p[kk][0] = pack_half2(s[2 * kk][0], s[2 * kk][1]);
                p[kk][1] = pack_half2(s[2 * kk][2], s[2 * kk][3]);
                p[kk][2] = pack_half2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                p[kk][3] = pack_half2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            }
            float inv[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
                l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
                inv[r] = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
            }
            // The head's output 16 columns a step (P V), then out_proj over those columns.
#pragma unroll 1
            for (int nd = c0 / 16; nd * 16 < c1; ++nd) {
                bool lo_in, hi_in;
                wb_halves(nd, c0, c1, lo_in, hi_in);
                float o[2][4];
                wb_zero(o);
#pragma unroll
                for (int kk = 0; kk < NS / 2; ++kk) {
                    if (kk >= chunks) break;
                    unsigned vb[4];
                    ldmatrix_x4_trans(vb, sV + (kk * 16 + vb_row) * PD + nd * 16 + vb_col);
                    if (lo_in) mma16816(o[0], p[kk], vb);
                    if (hi_in) mma16816(o[1], p[kk], vb + 2);
                }
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    o[j][0] *= inv[0]; o[j][1] *= inv[0];
                    o[j][2] *= inv[1]; o[j][3] *= inv[1];
                }
                unsigned c_hi[1][4], c_lo[1][4];
                wb_operand(o[0], o[1], c_hi[0], c_lo[0]);
                wb_three_products<1, D / 8, PD, false>(y, c_hi, c_lo, buf0 + nd * 16, D * PD, 0,
                                                       lane);
            }
        }
    }

    // 4. The residual: h = x + y + b on valid rows, x on the others, stored in out (read back
    // by step 5); norm2 of h.
    unsigned n_hi[KD][4], n_lo[KD][4];
    const bool keep[2] = {rows && (vrow == nullptr || q0 + g >= seq_len || vrow[q0 + g] != 0),
                          rows && (vrow == nullptr || q0 + g + 8 >= seq_len ||
                                   vrow[q0 + g + 8] != 0)};
    __syncthreads();  // Q, keys and values read: ffn_in's lo half and ffn_out's pair
    wb_copy<PD, THREADS>(buf1 + F * PD, in_w_lo, D, F, D, f8, D);
    wb_copy<PF, THREADS>(sW2, ffn_w_hi, f8, D, F, D, f8);
    wb_copy<PF, THREADS>(sW2 + D * PF, ffn_w_lo, f8, D, F, D, f8);
    cp_async_commit();
    if (rows) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = q0 + g + 8 * r;
            if (row >= seq_len) continue;
            const float* xr = xs + (long long)row * x_stride + 2 * t;
            float* orow = outs + (long long)row * out_stride + 2 * t;
#pragma unroll
            for (int j = 0; j < D / 8; ++j) {
                const float2 res = *reinterpret_cast<const float2*>(xr + 8 * j);
                const float2 bias = *reinterpret_cast<const float2*>(out_b + 8 * j + 2 * t);
                const float2 h = residual_value(y[j][2 * r] + bias.x, y[j][2 * r + 1] + bias.y,
                                                res, keep[r], 0);
                y[j][2 * r] = h.x;
                y[j][2 * r + 1] = h.y;
                *reinterpret_cast<float2*>(orow + 8 * j) = h;
            }
        }
        wb_norm<D>(y, norm2_w, norm2_b, eps, t);
#pragma unroll
        for (int kc = 0; kc < KD; ++kc) wb_operand(y[2 * kc], y[2 * kc + 1], n_hi[kc], n_lo[kc]);
    }

    // 5. The FFN HC hidden columns a step: ffn_in (three products), exact GELU, the hidden
    // columns as a hi/lo pair into ffn_out's three products (y, all D columns); then the
    // residual: h + y + b on valid rows, 0 on the others; with final_w, the final norm too.
    cp_async_wait<0>();
    __syncthreads();
    if (!rows) return;
    wb_zero(y);
#pragma unroll 1
    for (int c = 0; c < F; c += HC) {
        float acc[HC / 8][4];
        wb_zero(acc);
        wb_three_products<KD, HC / 8, PD>(acc, n_hi, n_lo, buf1, F * PD, c, lane);
        wb_bias_gelu(acc, in_b, c, f8, t);
        unsigned f_hi[HC / 16][4], f_lo[HC / 16][4];
#pragma unroll
        for (int i = 0; i < HC / 16; ++i) wb_operand(acc[2 * i], acc[2 * i + 1], f_hi[i], f_lo[i]);
        wb_three_products<HC / 16, D / 8, PF, false>(y, f_hi, f_lo, sW2 + c, D * PF, 0, lane);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = q0 + g + 8 * r;
        const float* hr = outs + (long long)row * out_stride + 2 * t;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            const float2 res = row < seq_len ? *reinterpret_cast<const float2*>(hr + 8 * j)
                                             : make_float2(0.0f, 0.0f);
            const float2 bias = *reinterpret_cast<const float2*>(ffn_b + 8 * j + 2 * t);
            const float2 z = residual_value(y[j][2 * r] + bias.x, y[j][2 * r + 1] + bias.y,
                                            res, keep[r], 1);
            y[j][2 * r] = z.x;
            y[j][2 * r + 1] = z.y;
        }
    }
    if (final_w != nullptr) wb_norm<D>(y, final_w, final_b, eps, t);
    float* dst = final_w != nullptr ? final_out + row_base * final_stride : outs;
    const long long pitch = final_w != nullptr ? final_stride : out_stride;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = q0 + g + 8 * r;
        if (row >= seq_len) continue;
        float* orow = dst + (long long)row * pitch + 2 * t;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            const float2 z = final_w != nullptr && !keep[r] ? make_float2(0.0f, 0.0f)
                                                            : make_float2(y[j][2 * r],
                                                                          y[j][2 * r + 1]);
            *reinterpret_cast<float2*>(orow + 8 * j) = z;
        }
    }
}

}  // namespace lb
