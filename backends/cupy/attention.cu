// Flash attention forward over packed Q/K/V rows: mma.sync m16n8k16 (fp16 in, fp32 out),
// ldmatrix fragment loads, cp.async copies, online softmax in fp32 with exp2f.
#include "common.cuh"

namespace lb {

// Copy rows [row0, row0 + ROWS) of one head (HP columns from src, a row pitch of stride) into
// shared rows of HP + 8 halves. Rows at or past row_end, rows whose byte in vrow is 0 (when
// vrow is not null) and columns at or past head_dim are zero-filled and not read.
template <int HP, int ROWS, int THREADS>
__device__ __forceinline__ void attn_load_tile(__half* tile, const __half* src, long long stride,
                                               int row0, int row_end,
                                               const unsigned char* vrow, int head_dim,
                                               const __half* base) {
    constexpr int CPR = HP / 8;  // 16-byte chunks per row
    constexpr int CHUNKS = ROWS * CPR;
#pragma unroll 1  // unrolled, the hoisted chunk addresses cost many registers
    for (int i = 0; i < (CHUNKS + THREADS - 1) / THREADS; ++i) {
        const int c = i * THREADS + threadIdx.x;
        if (CHUNKS % THREADS != 0 && c >= CHUNKS) break;
        const int r = c / CPR, col = (c % CPR) * 8;
        const int row = row0 + r;
        bool ok = row < row_end && col < head_dim;
        if (ok && vrow != nullptr) ok = vrow[row] != 0;
        const __half* g = ok ? src + (long long)row * stride + col : base;
        cp_async16(tile + r * (HP + 8) + col, g, ok);
    }
}

// Grid (ceil(seq_len / BQ), batch * num_heads), BQ / 16 warps of 16 query rows each.
// Shared memory (rows of HP + 8 halves): Q [BQ rows], then K [BKV rows], then V [BKV rows].
// K and V tiles are single-buffered: V of a tile loads while Q K^T runs, and K of the next
// tile loads while P V runs.
// shared bytes: (BQ + 2 * BKV) * (HP + 8) * 2
template <int HP, int BQ, int BKV>
__global__ void __launch_bounds__(BQ / 16 * 32)
flash_attention(const __half* __restrict__ qkv, long long qkv_stride,
                __half* __restrict__ ctx_hi, __half* __restrict__ ctx_lo, long long ctx_stride,
                const unsigned char* __restrict__ valid, const int* __restrict__ key_info,
                int seq_len, int num_heads, int head_dim, float scale, int causal) {
    start_after_previous();
    static_assert(HP % 16 == 0 && HP <= 256, "padded head dim: a multiple of 16, at most 256");
    static_assert(BQ % 16 == 0 && BKV % 16 == 0, "tiles: multiples of 16 rows");
    constexpr int THREADS = BQ / 16 * 32;
    constexpr int PITCH = HP + 8;  // shared row in halves: ldmatrix rows hit distinct banks
    constexpr int KD = HP / 16;    // k16 steps over the head dim (Q K^T)
    constexpr int NS = BKV / 8;    // n8 score tiles per key tile
    constexpr int KS = BKV / 16;   // k16 steps over keys (P V)
    constexpr int NO = HP / 8;     // n8 output tiles
    constexpr bool Q_IN_REGS = HP <= 128;  // at HP 256 Q fragments are re-read from shared

    extern __shared__ __align__(16) unsigned char attn_smem[];
    __half* sQ = reinterpret_cast<__half*>(attn_smem);
    __half* sK = sQ + BQ * PITCH;
    __half* sV = sK + BKV * PITCH;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int b = blockIdx.y / num_heads, h = blockIdx.y % num_heads;
    const int qb0 = blockIdx.x * BQ;  // first query row of the block
    const int q0 = qb0 + warp * 16;   // first query row of the warp

    // Keys [0, kv_end) may be visible; holes: some of them are invalid (read valid).
    int kv_end = seq_len;
    bool holes = false;
    if (key_info != nullptr) {
        kv_end = imin(kv_end, key_info[b * 4]);
        holes = key_info[b * 4 + 1] != 0;
    }
    if (kv_end < 0) kv_end = 0;
    const unsigned char* vrow = holes ? valid + (long long)b * seq_len : nullptr;
    const int kv_stop = causal ? imin(kv_end, qb0 + BQ) : kv_end;
    const int n_tiles = (kv_stop + BKV - 1) / BKV;

    const long long row_base = (long long)b * seq_len;
    const __half* gq = qkv + row_base * qkv_stride + (long long)h * head_dim;
    const __half* gk = gq + (long long)num_heads * head_dim;
    const __half* gv = gk + (long long)num_heads * head_dim;

    const float sl = scale * 1.4426950408889634f;  // scores to the log2 domain
    const float NEG_INF = neg_inf();
    const bool warp_rows = q0 < seq_len;  // the warp has a query row to compute

    float o[NO][4];
#pragma unroll
    for (int n = 0; n < NO; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m_run[2] = {NEG_INF, NEG_INF};  // running max (log2 domain) of rows g and g + 8
    float l_run[2] = {0.0f, 0.0f};        // this lane's part of the running row sums
    unsigned qf[Q_IN_REGS ? KD : 1][4];

    // Lane offsets of the ldmatrix row addresses (matrix lane / 8, row lane % 8).
    const int a_row = lane % 16, a_col = (lane / 16) * 8;            // A: Q [query][d]
    const int kb_row = lane % 8 + (lane / 16) * 8, kb_col = ((lane / 8) % 2) * 8;  // K
    const int vb_row = lane % 8 + ((lane / 8) % 2) * 8, vb_col = (lane / 16) * 8;  // V

    if (n_tiles > 0) {
        attn_load_tile<HP, BQ, THREADS>(sQ, gq, qkv_stride, qb0, seq_len, nullptr, head_dim, qkv);
        attn_load_tile<HP, BKV, THREADS>(sK, gk, qkv_stride, 0, kv_end, vrow, head_dim, qkv);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        if constexpr (Q_IN_REGS) {
#pragma unroll
            for (int kk = 0; kk < KD; ++kk)
                ldmatrix_x4(qf[kk], sQ + (warp * 16 + a_row) * PITCH + kk * 16 + a_col);
        }
    }

    for (int it = 0; it < n_tiles; ++it) {
        const int kv0 = it * BKV;
        if (it > 0) {
            cp_async_wait<0>();  // K of this tile
            __syncthreads();     // ...visible to all; every warp is done with the last V
        }
        attn_load_tile<HP, BKV, THREADS>(sV, gv, qkv_stride, kv0, kv_end, vrow, head_dim, qkv);
        cp_async_commit();

        // A warp whose rows all precede the tile's first key (causal) sees none of it.
        const bool work = warp_rows && !(causal && kv0 > q0 + 15);
        float s[NS][4];
        if (work) {
#pragma unroll
            for (int j = 0; j < NS; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
            // S = Q K^T: K rows [key][d] are the column-major B operand.
#pragma unroll
            for (int kk = 0; kk < KD; ++kk) {
                if (kk * 16 >= head_dim) break;  // zero columns
                unsigned a[4];
                if constexpr (Q_IN_REGS) {
                    a[0] = qf[kk][0]; a[1] = qf[kk][1]; a[2] = qf[kk][2]; a[3] = qf[kk][3];
                } else {
                    ldmatrix_x4(a, sQ + (warp * 16 + a_row) * PITCH + kk * 16 + a_col);
                }
#pragma unroll
                for (int nn = 0; nn < NS / 2; ++nn) {
                    unsigned kb[4];  // [0..1]: keys nn*16 + 0..7, [2..3]: keys nn*16 + 8..15
                    ldmatrix_x4(kb, sK + (nn * 16 + kb_row) * PITCH + kk * 16 + kb_col);
                    mma16816(s[2 * nn], a, kb);
                    mma16816(s[2 * nn + 1], a, kb + 2);
                }
            }

            // s[j][e]: row q0 + g + 8 (e / 2), key kv0 + 8 j + 2 t + e % 2.
#pragma unroll
            for (int j = 0; j < NS; ++j) {
                s[j][0] *= sl; s[j][1] *= sl; s[j][2] *= sl; s[j][3] *= sl;
            }
            const bool edge = kv0 + BKV > kv_end || holes || (causal && kv0 + BKV - 1 > q0);
            if (edge) {
                const int row0 = q0 + g, row1 = q0 + g + 8;
#pragma unroll
                for (int j = 0; j < NS; ++j) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int key = kv0 + 8 * j + 2 * t + e;
                        bool ok = key < kv_end;
                        if (ok && holes) ok = vrow[key] != 0;
                        if (!ok || (causal && key > row0)) s[j][e] = NEG_INF;
                        if (!ok || (causal && key > row1)) s[j][e + 2] = NEG_INF;
                    }
                }
            }

            // Online softmax: row max over the quad's 4 lanes, rescale, exponentiate.
            float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
            for (int j = 0; j < NS; ++j) {
                mx[0] = fmaxf(mx[0], fmaxf(s[j][0], s[j][1]));
                mx[1] = fmaxf(mx[1], fmaxf(s[j][2], s[j][3]));
            }
            float base[2], alpha[2];
#pragma unroll
            for (int r = 0; r < 2; ++r)
                alpha[r] = online_softmax_step(mx[r], m_run[r], l_run[r], base[r], NEG_INF);
#pragma unroll
            for (int n = 0; n < NO; ++n) {
                o[n][0] *= alpha[0]; o[n][1] *= alpha[0];
                o[n][2] *= alpha[1]; o[n][3] *= alpha[1];
            }
#pragma unroll
            for (int j = 0; j < NS; ++j) {
                s[j][0] = exp2f(s[j][0] - base[0]);
                s[j][1] = exp2f(s[j][1] - base[0]);
                s[j][2] = exp2f(s[j][2] - base[1]);
                s[j][3] = exp2f(s[j][3] - base[1]);
                l_run[0] += s[j][0] + s[j][1];
                l_run[1] += s[j][2] + s[j][3];
            }
        }

        __syncthreads();  // every warp is done with K
        if (it + 1 < n_tiles) {
            attn_load_tile<HP, BKV, THREADS>(sK, gk, qkv_stride, kv0 + BKV, kv_end, vrow,
                                             head_dim, qkv);
            cp_async_commit();
            cp_async_wait<1>();  // V of this tile (the next K may still be in flight)
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();

        if (work) {
            // O += P V: the C fragments of score tiles 2 kk and 2 kk + 1 form the A fragment
            // of keys kk*16 .. kk*16 + 15; V rows [key][d] are read transposed as B.
#pragma unroll
            for (int kk = 0; kk < KS; ++kk) {
                unsigned a[4];
                a[0] = pack_half2(s[2 * kk][0], s[2 * kk][1]);
                a[1] = pack_half2(s[2 * kk][2], s[2 * kk][3]);
                a[2] = pack_half2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                a[3] = pack_half2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
                for (int nd = 0; nd < HP / 16; ++nd) {
                    if (nd * 16 >= head_dim) break;  // zero columns
                    unsigned vb[4];  // [0..1]: d nd*16 + 0..7, [2..3]: d nd*16 + 8..15
                    ldmatrix_x4_trans(vb, sV + (kk * 16 + vb_row) * PITCH + nd * 16 + vb_col);
                    mma16816(o[2 * nd], a, vb);
                    mma16816(o[2 * nd + 1], a, vb + 2);
                }
            }
        }
    }

    if (!warp_rows) return;
    store_context<NO>(&o[0][0], l_run, q0, g, t, seq_len, row_base, ctx_stride, h, head_dim,
                      ctx_hi, ctx_lo);
}

}  // namespace lb
