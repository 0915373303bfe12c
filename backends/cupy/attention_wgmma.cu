// Flash attention forward on Hopper wgmma.mma_async (FlashAttention-3 basics; warp
// specialisation and TMA in lb::flash_attention_wgmma_tma only): the same interface and
// semantics as lb::flash_attention (attention.cu), with
// S = Q K^T as wgmma m64nBKVk16 reading Q and K from 128- (or, at HP 32, 64-) byte-swizzled
// shared memory, P = exp2(...) converted to fp16 in registers and O += P V as wgmma m64nHPk16
// with A = P from registers and B = V from shared memory, N-major (imm-trans-b 1).
//
// MUST BE COMPILED FOR sm_90a (NVRTC --gpu-architecture=sm_90a, nvcc -arch=sm_90a): wgmma exists
// only there. For any other target the kernel still compiles, so that this file can share a
// module with the sm_80 kernels, but its body is a trap.
//
// Launch: block BQ * 2 threads (one warpgroup of 128 threads per 64 query rows), grid
// (ceil(seq_len / BQ), batch * num_heads) as lb::flash_attention (causal: block x computes
// query tile gridDim.x - 1 - x, the longest first), dynamic shared memory
// lb::attention_wgmma_shared_bytes(HP, BQ, BKV, PIPELINE) bytes, above 48 KB only after the
// kernel's max dynamic shared memory attribute has been raised to it. Variants
// (template parameters): MINB blocks an SM, and the plain or the pipelined schedule (below).
// lb::flash_attention_wgmma_tma<HP, BQ, BKV, KV_STAGES, SCHEDULE> (at the end: a TMA producer
// warpgroup and BQ / 64 consumers, 384 threads at BQ 128 and 512 at 192, two tensor maps
// appended to the parameters) runs the per-tile math of the same source,
// flash_attention_body, in the consumer schedule SCHEDULE picks (plain, ping-pong, overlap or
// packed overlap; + TMA_POLY_EXP2 or twice it).
//
// Shared tiles. A tile of ROWS rows x HP halves is stored as HP * 2 / SW panels, SW (the swizzle
// width) = 128 bytes, or 64 bytes at HP 32; panel p holds columns [p SW/2, (p+1) SW/2) of every
// row, row r at byte r SW of the panel (panels ROWS SW bytes apart). Each tile starts at a
// multiple of 1024 bytes, so the swizzle the tensor cores apply to absolute shared addresses,
// bits [4, 4 + log2(SW/16)) ^= bits [7, 7 + log2(SW/16)) (CUTLASS Swizzle<3,4,3> / <2,4,3>),
// is applied by the copies: 16-byte chunk c of row r lands in chunk slot c ^ (r % 8) (128B)
// or c ^ ((r / 2) % 4) (64B).
// - Q [query][d] and K [key][d] are K-major operands (the reduction dim d is contiguous): a k16
//   step reads 32 bytes of each row, starting kk * 32 bytes into the rows, in panel kk * 32 / SW;
//   descriptor SBO = 8 SW (from one group of 8 rows to the next), LBO unused (1).
// - V [key][d] is the B operand of P V with K = key, N = d and N contiguous: N-major ("MN-major",
//   imm-trans-b 1). Its canonical layout (PTX ISA, CUTLASS make_gmma_desc<Major::MN>) is
//   ((T, SW/16, n), (8, k)) : ((1, T, LBO), (SW/2, SBO)) in halves (T = 8): swizzle atoms of
//   SW/2 N-elements x 8 K-rows; SBO = 8 SW (the next 8 keys, the next 8 rows of the panel), LBO =
//   BKV SW (the next SW/2 values of d: the next panel). A k16 step starts 16 SW bytes further.
#include "common.cuh"
#include "wgmma.cuh"

namespace lb {

namespace attn_wgmma_detail {

using namespace lb::wgmma;  // descriptors, fences and the wgmma instructions

constexpr int ALIGN = 1024;  // a 128B-swizzle pattern repeats every 1024 bytes (64B: 512)

// Swizzle width in bytes (one row of a panel) for the padded head dim hp.
__host__ __device__ constexpr int swizzle_bytes(int hp) { return hp * 2 >= 128 ? 128 : 64; }

// Byte offset within a 1024-aligned tile of the logical offset off, swizzled (SW 128 or 64).
template <int SW>
__device__ __forceinline__ unsigned swizzle(unsigned off) {
    constexpr unsigned MASK = (SW / 16 - 1) << 4;  // 0x70 (128B) or 0x30 (64B)
    return off ^ ((off >> 3) & MASK);
}

// Copy rows [row0, row0 + ROWS) of one head (HP columns from src, a row pitch of stride) into the
// swizzled panels of the tile at tile (1024-byte aligned). Rows at or past row_end, rows whose
// byte in vrow is 0 (when vrow is not null) and columns at or past head_dim are zero-filled and
// not read.
template <int HP, int ROWS, int THREADS>
__device__ __forceinline__ void load_tile(unsigned char* tile, const __half* src,
                                          long long stride, int row0, int row_end,
                                          const unsigned char* vrow, int head_dim,
                                          const __half* base) {
    constexpr int SW = swizzle_bytes(HP);
    constexpr int CPR = HP / 8;   // 16-byte chunks per row
    constexpr int CPP = SW / 16;  // 16-byte chunks per panel row
    constexpr int CHUNKS = ROWS * CPR;
#pragma unroll 1  // unrolled, the hoisted chunk addresses cost registers
    for (int i = 0; i < (CHUNKS + THREADS - 1) / THREADS; ++i) {
        const int c = i * THREADS + threadIdx.x;
        if (CHUNKS % THREADS != 0 && c >= CHUNKS) break;
        const int r = c / CPR, cc = c % CPR;
        const int row = row0 + r;
        bool ok = row < row_end && cc * 8 < head_dim;
        if (ok && vrow != nullptr) ok = vrow[row] != 0;
        const __half* g = ok ? src + (long long)row * stride + cc * 8 : base;
        const unsigned off = (cc / CPP) * (ROWS * SW) + r * SW + (cc % CPP) * 16;
        cp_async16(tile + swizzle<SW>(off), g, ok);
    }
}

// Shared buffers of each kind: the plain schedule double-buffers K and V; the pipelined one
// keeps V three deep, as a pending P V may still read tile it - 1 while tile it + 1 is loaded.
// (ops.py sizes shared memory by them; conformance/test_cupy.py models both schedules with them.)
constexpr int K_BUFFERS = 2;
constexpr int V_BUFFERS = 2;
constexpr int PIPELINED_V_BUFFERS = 3;
constexpr int TMA_RING = 2;  // the PIPELINE value of flash_attention_wgmma_tma's schedule
// flash_attention_wgmma_tma's consumer schedules (its SCHEDULE; see above the kernel).
constexpr int TMA_PLAIN = 0, TMA_PINGPONG = 1, TMA_OVERLAP = 2, TMA_OVERLAP_PACKED = 3;
// TMA_POLY_EXP2 times k (1 or 2) added to SCHEDULE: the softmax computes one column pair in
// POLY_EVERY / k (s[4 j ..] where j % (POLY_EVERY / k) == POLY_EVERY / k - 1) with exp2_poly
// instead of exp2f (MUFU.EX2).
constexpr int TMA_POLY_EXP2 = 4, POLY_EVERY = 8;

// 2^x on the FMA units (FlashAttention-4's emulation), x <= 0: 2^floor(x) * p(x - floor(x)),
// p a degree-3 polynomial (p(0) = 1, relative error of p below 8.6e-5 on [0, 1), of the result
// below 1e-4 for x in [-126, 0]: conformance/test_cupy.py emulates these operations), the
// exponent added to p's bits with integer ops. floor by the 1.5 * 2^23 trick rounding down:
// t's low bits hold floor(x). x below -126 gives [0, 2^-126] (-127 and below, -inf too: 0).
__device__ __forceinline__ float exp2_poly(float x) {
    x = fmaxf(x, -127.0f);
    const float t = __fadd_rd(x, 12582912.0f);                // 1.5 * 2^23 + floor(x)
    const float f = __fsub_rn(x, __fsub_rn(t, 12582912.0f));  // x - floor(x), in [0, 1]
    const float p = fmaf(fmaf(fmaf(0.07706519961357117f, f, 0.22764700651168823f), f,
                              0.6951163411140442f),
                         f, 1.0f);  // 2^f, in [1, 2)
    return __uint_as_float(__float_as_uint(p) + (__float_as_uint(t) << 23));
}

// exp2f(x), or where EVERY > 0 and j % EVERY == EVERY - 1, exp2_poly(x).
template <int EVERY>
__device__ __forceinline__ float softmax_exp2(float x, int j) {
    if constexpr (EVERY > 0) {
        if (j % EVERY == EVERY - 1) return exp2_poly(x);
    }
    return exp2f(x);
}

// named_arrive where on, predicated (no branch: a pending wgmma may cross it).
__device__ __forceinline__ void named_arrive_if(bool on, unsigned id) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.u32 p, %0, 0;\n@p bar.arrive %1, 256;\n}" ::"r"(
            static_cast<unsigned>(on)),
        "r"(id)
        : "memory");
}

}  // namespace attn_wgmma_detail

// Dynamic shared bytes of one block of lb::flash_attention_wgmma<hp, bq, bkv, *, pipelined>: Q
// (bq rows), the K and V buffers (bkv rows each) of hp halves a row, plus 1024 bytes of slack
// for aligning the first tile to 1024 bytes. Plain <32, 128, 128>: 41984, <64, 128, 128>: 82944,
// <64, 128, 64>: 50176, <128, 128, 128>: 164864, <256, 128, 64>: 197632, <256, 64, 64>:
// 164864; pipelined <64, 128, 64>: 58368.
__host__ __device__ constexpr int attention_wgmma_shared_bytes(int hp, int bq, int bkv,
                                                               int pipelined) {
    namespace ad = attn_wgmma_detail;
    const int v_buffers = pipelined ? ad::PIPELINED_V_BUFFERS : ad::V_BUFFERS;
    return (bq + (ad::K_BUFFERS + v_buffers) * bkv) * hp * 2 + ad::ALIGN;
}

// lb::flash_attention_wgmma (its body: attn_wgmma_detail::flash_attention_body, below).
// Grid (ceil(seq_len / BQ), batch * num_heads), BQ / 64 warpgroups of 64 query rows each; the
// same semantics as lb::flash_attention in every detail (see attention.cu). MINB: the blocks an
// SM should hold (__launch_bounds__; 2 caps a thread at 65536 / (2 * 2 BQ) registers, so that
// one block's softmax overlaps the other's wgmma; 4 at BQ 64 caps it at 128). Shared bytes:
// lb::attention_wgmma_shared_bytes(HP, BQ, BKV, PIPELINE).
//
// PIPELINE 0, per key tile: wait for its K (and, on the first, Q), start the copies of the next
// tile's K and V into the other buffers, S = Q K^T (wgmma, waited for), online softmax in
// registers, wait for this tile's V, O += P V (wgmma, waited for). Both barriers of a tile are
// reached by every thread, also by a warpgroup that skips the tile (causal, or no query row).
//
// PIPELINE 1 (FlashAttention-3's intra-warpgroup overlap): the softmax of tile it runs while
// the tensor cores compute S of tile it + 1 and O += P V of tile it - 1. K[j] lives in K buffer
// j % 2, V[j] in V buffer j % 3 (P V of it - 1 may still read V[it - 1] while V[it + 1] lands);
// one cp.async group and one barrier per tile; two score register sets (even and odd tiles).
// Every warpgroup computes every tile of the block, P = 0 where a warp sees none of it: a
// branch around a pending wgmma makes ptxas serialise them all (C7518). Order of events:
//   Prologue: copy Q and K[0] (cp.async group), K[1] and V[0] (group); cp.async wait 1; proxy
//     fence; barrier; wgmma fence; S[0] = Q K[0]^T into the even set; commit; wgmma wait 0.
//   Iteration it (all threads run all n_tiles of them):
//   1. cp.async wait 0 (K[it + 1] and V[it] have landed); proxy fence; barrier. Past it every
//      warpgroup has finished iteration it - 1: S[it] (read K buffer it % 2) and P V of it - 2
//      (read V buffer (it + 1) % 3) are complete.
//   2. Copy K[it + 2] into K buffer it % 2 and V[it + 1] into V buffer (it + 1) % 3 (those
//      that exist); commit (maybe an empty group).
//   3. Unless it is the last tile: wgmma fence; S[it + 1] = Q K[it + 1]^T into the other set;
//      commit. Pending now: P V of it - 1 (reads p and V buffer (it - 1) % 3, writes o) and
//      S[it + 1] (reads K buffer (it + 1) % 2, writes the other set).
//   4. Mask and online softmax of S[it]: row max, alpha, exp2, row sums (o untouched).
//   5. wgmma wait 1 (last tile: 0): P V of it - 1 is complete; o and p are free.
//   6. o *= alpha; p = fp16(P[it]); wgmma fence; O += P V[it] (V buffer it % 3); commit.
//   7. wgmma wait 1: S[it + 1] is complete, P V of it runs on into iteration it + 1. Last tile:
//      wait 0, nothing is left pending.
namespace attn_wgmma_detail {

// The body of lb::flash_attention_wgmma (PIPELINE 0 and 1, q_map and kv_map null) and of
// lb::flash_attention_wgmma_tma (PIPELINE TMA_RING, KV_STAGES stages): one definition of the
// per-tile math (the lambdas below) for every schedule. POLY > 0: one column pair of P in POLY
// by exp2_poly (softmax_exp2). sm_90a only.
template <int HP, int BQ, int BKV, int PIPELINE, int KV_STAGES, int SCHEDULE = 0, int POLY = 0,
          int MINB = 1>
__device__ __forceinline__ void flash_attention_body(
    const __half* __restrict__ qkv, long long qkv_stride, __half* __restrict__ ctx_hi,
    __half* __restrict__ ctx_lo, long long ctx_stride, const unsigned char* __restrict__ valid,
    const int* __restrict__ key_info, int seq_len, int num_heads, int head_dim, float scale,
    int causal, const TensorMap* q_map, const TensorMap* kv_map) {
    // Qualified names only: attention.cu's and linear_wgmma.cu's device functions share the
    // module.
    namespace ad = attn_wgmma_detail;
    static_assert(HP == 32 || HP == 64 || HP == 128 || HP == 256,
                  "padded head dim 32, 64, 128 or 256");
    static_assert(BQ == 64 || BQ == 128 || (BQ == 192 && PIPELINE == ad::TMA_RING),
                  "one or two warpgroups of 64 rows (the TMA ring: two or three)");
    static_assert(BKV == 64 || BKV == 128, "wgmma n64 or n128 score tiles");
    static_assert(PIPELINE == 0 || PIPELINE == 1 || PIPELINE == ad::TMA_RING,
                  "plain, pipelined or TMA-ring schedule");
    constexpr int THREADS = BQ * 2;
    constexpr int SW = ad::swizzle_bytes(HP);  // bytes per panel row
    constexpr int Q_BYTES = BQ * HP * 2;       // multiples of 1024: every tile 1024-aligned
    constexpr int KV_BYTES = BKV * HP * 2;
    constexpr int NS = BKV / 2;   // score accumulators per thread (m64nBKV)
    constexpr int NO = HP / 2;    // output accumulators per thread (m64nHP)
    constexpr int KD = HP / 16;   // k16 steps over the head dim (Q K^T)
    constexpr int KS = BKV / 16;  // k16 steps over the keys (P V)
    constexpr int KPP = SW / 32;  // k16 steps per panel (32 bytes each)
    static_assert(Q_BYTES % ad::ALIGN == 0 && KV_BYTES % ad::ALIGN == 0, "1024-byte tiles");

    extern __shared__ __align__(1024) unsigned char attn_wgmma_shared[];
    // Align the tiles to 1024 bytes whatever the start of dynamic shared memory.
    unsigned char* smem;
    const unsigned sbase = align_shared<ad::ALIGN>(attn_wgmma_shared, smem);
    // Layout: Q, the K buffers, the V buffers.
    // (The TMA ring: KV_STAGES K buffers, then KV_STAGES V buffers.)
    constexpr int K_TILES = PIPELINE == ad::TMA_RING ? KV_STAGES : ad::K_BUFFERS;
    const unsigned sQ = sbase, sK = sbase + Q_BYTES, sV = sK + K_TILES * KV_BYTES;

    // Warpgroup: rows 64 group .. 64 group + 63 (the TMA ring: warpgroup 0 the producer, -1).
    const int group = static_cast<int>(threadIdx.x / 128) - (PIPELINE == ad::TMA_RING ? 1 : 0);
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int b = blockIdx.y / num_heads, h = blockIdx.y % num_heads;
    // First query row of the block. Causal: the last query tiles (the most keys) first, so
    // the grid's tail runs the shortest blocks.
    const int qb0 = static_cast<int>(causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BQ;
    const int qg0 = qb0 + group * 64;       // ... of the warpgroup
    const int q0 = qg0 + warp * 16;         // ... of the warp

    // Keys [0, kv_end) may be visible; holes: some of them are invalid (read valid).
    const KeyExtent keys = visible_keys(key_info, b, seq_len);
    const int kv_end = keys.end;
    const bool holes = keys.holes;
    const unsigned char* vrow = holes ? valid + (long long)b * seq_len : nullptr;
    const int kv_stop = causal ? imin(kv_end, qb0 + BQ) : kv_end;
    const int n_tiles = (kv_stop + BKV - 1) / BKV;

    const long long row_base = (long long)b * seq_len;
    const __half* gq = qkv + row_base * qkv_stride + (long long)h * head_dim;
    const __half* gk = gq + (long long)num_heads * head_dim;
    const __half* gv = gk + (long long)num_heads * head_dim;

    const float sl = scale * 1.4426950408889634f;  // scores to the log2 domain
    const float NEG_INF = neg_inf();
    const bool group_rows = qg0 < seq_len;  // the warpgroup has a query row to compute
    const bool warp_rows = q0 < seq_len;    // the warp has one

    // Accumulator fragment of m64nNk16 (warp w of the warpgroup, g = lane / 4, t = lane % 4):
    // x[4 j + 2 r + e] is row 16 w + g + 8 r, column 8 j + 2 t + e of the warpgroup's 64 x N.
    float o[NO];
#pragma unroll
    for (int i = 0; i < NO; ++i) o[i] = 0.0f;
    float m_run[2] = {NEG_INF, NEG_INF};  // running max (log2 domain) of rows g and g + 8
    float l_run[2] = {0.0f, 0.0f};        // this lane's part of the running row sums

    // Copies of one tile (no commit): Q rows, K rows into K buffer buf, V rows into V buffer buf.
    auto load_q = [&]() {
        ad::load_tile<HP, BQ, THREADS>(smem, gq, qkv_stride, qb0, seq_len, nullptr, head_dim,
                                       qkv);
    };
    auto load_k = [&](int buf, int kv0) {
        ad::load_tile<HP, BKV, THREADS>(smem + Q_BYTES + buf * KV_BYTES, gk, qkv_stride, kv0,
                                        kv_end, vrow, head_dim, qkv);
    };
    auto load_v = [&](int buf, int kv0) {
        ad::load_tile<HP, BKV, THREADS>(smem + Q_BYTES + (ad::K_BUFFERS + buf) * KV_BYTES, gv,
                                        qkv_stride, kv0, kv_end, vrow, head_dim, qkv);
    };

    // Issue S = Q K^T of the warpgroup's rows against K buffer buf (no fence, commit or wait):
    // Q rows [query][d] (A) and K rows [key][d] (B) are both K-major. Every k16 step runs, also
    // over zero columns past head_dim: a branch between the wgmmas would make ptxas fence each
    // one (C7519).
    auto issue_scores = [&](float (&s)[NS], int buf) {
#pragma unroll
        for (int kk = 0; kk < KD; ++kk) {
            const unsigned koff = (kk % KPP) * 32;  // bytes into the panel's rows
            const unsigned qa = sQ + (kk / KPP) * (BQ * SW) + group * 64 * SW + koff;
            const unsigned kb = sK + buf * KV_BYTES + (kk / KPP) * (BKV * SW) + koff;
            const unsigned long long da = ad::smem_desc<SW>(qa, 16, 8 * SW);
            const unsigned long long db = ad::smem_desc<SW>(kb, 16, 8 * SW);
            if (kk == 0) {
                ad::SS<BKV>::template run<0>(s, da, db);
            } else {
                ad::SS<BKV>::template run<1>(s, da, db);
            }
        }
    };

    // o *= alpha, rows g (alpha[0]) and g + 8 (alpha[1]).
    auto rescale = [&](const float (&alpha)[2]) {
#pragma unroll
        for (int n = 0; n < NO / 4; ++n) {
            o[4 * n] *= alpha[0];
            o[4 * n + 1] *= alpha[0];
            o[4 * n + 2] *= alpha[1];
            o[4 * n + 3] *= alpha[1];
        }
    };

    // Scores of the tile at kv0 -> probabilities, in place: mask, online softmax step (m_run,
    // l_run), exp2. Returns whether the warp has rows that see the tile, with the factor for
    // the old outputs in alpha; a warp whose rows all precede the tile (causal) or lie past
    // seq_len gets P = 0 and keeps its outputs. rescale_here: 1 rescales the outputs
    // here, between the step and exp2 (the plain schedule), 0 leaves that to the caller (the
    // pipelined one: a pending P V still writes them). One basic block from the step to the
    // sums, so that l_run * alpha + (p0 + p1) contracts to the same fma in every schedule.
    // The lambdas take plain ints, constant once inlined: NVRTC 13.0 crashed (segmentation
    // fault) on generic lambdas taking a compile-time count here.
    // MASK_IDLE (three consumers in the packed overlap): a warp that sees none of the tile
    // runs the softmax with every score masked (P = 0 exactly, m_run and l_run unchanged:
    // alpha 1, or 0 times an l_run of 0), still returning false, instead of zeroing the
    // scores in a branch of its own: the branch's merge made ptxas keep a second score set,
    // spilling at the 160 registers of three consumers.
    constexpr bool MASK_IDLE = PIPELINE == ad::TMA_RING && BQ == 192 &&
                               SCHEDULE == ad::TMA_OVERLAP_PACKED;
    auto softmax = [&](int rescale_here, float (&s)[NS], int kv0,
                       float (&alpha)[2]) -> bool {
        const bool idle = !(warp_rows && !(causal && kv0 > q0 + 15));
        if constexpr (!MASK_IDLE) {
            if (idle) {
#pragma unroll
                for (int i = 0; i < NS; ++i) s[i] = 0.0f;
                return false;
            }
        }
        // s[4 j + 2 r + e]: row q0 + g + 8 r, key kv0 + 8 j + 2 t + e. The scores stay
        // unscaled until exp2 takes s sl - base in one fma; their row max, scaled, is the max
        // of the scaled scores (rounding is monotonic), so m_run is as before.
        bool edge = kv0 + BKV > kv_end || holes || (causal && kv0 + BKV - 1 > q0);
        if constexpr (MASK_IDLE) edge = edge || idle;
        if (edge) {
            const int row0 = q0 + g, row1 = q0 + g + 8;
#pragma unroll
            for (int j = 0; j < NS / 4; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int key = kv0 + 8 * j + 2 * t + e;
                    bool ok = key < kv_end;
                    if constexpr (MASK_IDLE) ok = ok && !idle;
                    if (ok && holes) ok = vrow[key] != 0;
                    if (!ok || (causal && key > row0)) s[4 * j + e] = NEG_INF;
                    if (!ok || (causal && key > row1)) s[4 * j + 2 + e] = NEG_INF;
                }
            }
        }

        // Online softmax: row max over the quad's 4 lanes, rescale factor, exponentiate.
        float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int j = 0; j < NS / 4; ++j) {
            mx[0] = fmaxf(mx[0], fmaxf(s[4 * j], s[4 * j + 1]));
            mx[1] = fmaxf(mx[1], fmaxf(s[4 * j + 2], s[4 * j + 3]));
        }
        float base[2];
#pragma unroll
        for (int r = 0; r < 2; ++r)
            alpha[r] = online_softmax_step(mx[r] * sl, m_run[r], l_run[r], base[r], NEG_INF);
        if (rescale_here == 1) rescale(alpha);
#pragma unroll
        for (int j = 0; j < NS / 4; ++j) {
            s[4 * j] = ad::softmax_exp2<POLY>(fmaf(s[4 * j], sl, -base[0]), j);
            s[4 * j + 1] = ad::softmax_exp2<POLY>(fmaf(s[4 * j + 1], sl, -base[0]), j);
            s[4 * j + 2] = ad::softmax_exp2<POLY>(fmaf(s[4 * j + 2], sl, -base[1]), j);
            s[4 * j + 3] = ad::softmax_exp2<POLY>(fmaf(s[4 * j + 3], sl, -base[1]), j);
            l_run[0] += s[4 * j] + s[4 * j + 1];
            l_run[1] += s[4 * j + 2] + s[4 * j + 3];
        }
        if constexpr (MASK_IDLE) {
            return !idle;
        } else {
            return true;
        }
    };

    // The accumulators of score columns 16 kk .. 16 kk + 15, s[8 kk .. 8 kk + 7], are in order
    // the fp16 pairs of the register A fragment of k16 step kk (m16n8k16's A layout per warp:
    // rows g, g + 8 x keys 2 t.., 2 t + 8..).
    auto pack = [&](unsigned (&p)[KS][4], const float (&s)[NS]) {
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                p[kk][i] = pack_half2(s[8 * kk + 2 * i], s[8 * kk + 2 * i + 1]);
                ad::fence_operand(p[kk][i]);
            }
        }
    };

    // Issue O += P V with V rows [key][d] of V buffer buf, N-major (no fence, commit or wait).
    auto issue_pv = [&](const unsigned (&p)[KS][4], int buf) {
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
            const unsigned vb = sV + buf * KV_BYTES + kk * 16 * SW;
            ad::RS<HP>::run(o, p[kk], ad::smem_desc<SW>(vb, BKV * SW, 8 * SW));
        }
    };

    // Keep the compiler from moving accesses of wgmma operands across their issue and wait.
    auto fence_scores = [&](float (&s)[NS]) {
#pragma unroll
        for (int i = 0; i < NS; ++i) ad::fence_operand(s[i]);
    };
    auto fence_outputs = [&]() {
#pragma unroll
        for (int i = 0; i < NO; ++i) ad::fence_operand(o[i]);
    };
    auto fence_probs = [&](unsigned (&p)[KS][4]) {
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
            for (int i = 0; i < 4; ++i) ad::fence_operand(p[kk][i]);
        }
    };

    // The plain and TMA-ring schedules' O += P V of one tile, waited for: P packed from the
    // probabilities in s into p, V from V buffer buf.
    auto pv_waited = [&](unsigned (&p)[KS][4], const float (&s)[NS], int buf) {
        pack(p, s);
        fence_outputs();
        ad::wgmma_fence();
        issue_pv(p, buf);
        ad::wgmma_commit();
        ad::wgmma_wait<0>();
        fence_outputs();
        fence_probs(p);
    };

    if constexpr (PIPELINE == ad::TMA_RING) {
        // setmaxnreg moves registers within the block's pool, the 384 x 168 it was launched
        // with (__launch_bounds__(384, 1)): 40 for the producer and 232 for the consumers use
        // all of it (three consumers: 512 x 128, 24 and 160). A pool too small would leave
        // setmaxnreg.inc waiting forever. Two blocks an SM (MINB 2, two consumers) launch with
        // 80: 24 for the producer and 104 for the consumers (enough for the plain and
        // ping-pong consumers at HP 32; at HP 64 they spill, and BKV 128 does not compile).
        constexpr int CONSUMERS = BQ / 64, BLOCK_THREADS = 128 * (CONSUMERS + 1);
        constexpr int LAUNCH_REGISTERS = 65536 / (BLOCK_THREADS * MINB) / 8 * 8;
        constexpr int PRODUCER_REGISTERS = CONSUMERS == 2 && MINB == 1 ? 40 : 24;
        constexpr int CONSUMER_REGISTERS =
            (BLOCK_THREADS * LAUNCH_REGISTERS - 128 * PRODUCER_REGISTERS) / (128 * CONSUMERS) /
            8 * 8;
        static_assert(CONSUMERS >= 2 && KV_STAGES >= 1, "two or three consumers, a ring");
        static_assert(MINB == 1 || (MINB == 2 && CONSUMERS == 2), "two blocks: two consumers");
        static_assert(MINB == 2 || CONSUMER_REGISTERS == (CONSUMERS == 2 ? 232 : 160),
                      "one block an SM: 232 registers for two consumers, 160 for three");
        static_assert(SCHEDULE == ad::TMA_PLAIN || SCHEDULE == ad::TMA_PINGPONG ||
                          SCHEDULE == ad::TMA_OVERLAP || SCHEDULE == ad::TMA_OVERLAP_PACKED,
                      "plain, ping-pong or overlapped consumers");
        // Ping-pong: a consumer's stage is released after the other's next S is issued (one
        // stage would deadlock); overlap: a consumer waits for tile it + 1's full barrier
        // while holding the stages of it - 1 (P V pending) and it (V; two would deadlock).
        static_assert(SCHEDULE != ad::TMA_PINGPONG || KV_STAGES >= 2, "ping-pong: 2 stages");
        static_assert(SCHEDULE != ad::TMA_OVERLAP || KV_STAGES >= 3, "overlap: 3 stages");
        // Packed overlap: a consumer waits for tile it + 1 while holding it (P V not issued).
        static_assert(SCHEDULE != ad::TMA_OVERLAP_PACKED || KV_STAGES >= 2, "packed: 2 stages");
        static_assert(128 * PRODUCER_REGISTERS + 128 * CONSUMERS * CONSUMER_REGISTERS <=
                          BLOCK_THREADS * LAUNCH_REGISTERS,
                      "the warpgroups' registers must fit the block's pool");
        // q_full, then full[KV_STAGES], then empty[KV_STAGES].
        __shared__ __align__(8) unsigned long long attn_tma_bars[1 + 2 * KV_STAGES];
        const unsigned q_full = static_cast<unsigned>(__cvta_generic_to_shared(attn_tma_bars));
        const unsigned full0 = q_full + 8, empty0 = full0 + 8 * KV_STAGES;
        // The warpgroup, uniform across each warp (a shuffle tells the compiler so).
        const int role = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
        if (threadIdx.x == 0) {
            ad::prefetch_tensormap(q_map);
            ad::prefetch_tensormap(kv_map);
            ad::mbarrier_init(q_full, 1);
#pragma unroll
            for (int st = 0; st < KV_STAGES; ++st) {
                ad::mbarrier_init(full0 + 8 * st, 1);
                ad::mbarrier_init(empty0 + 8 * st, 128 * CONSUMERS);
            }
            ad::fence_mbarrier_init();
        }
        __syncthreads();
        if (role == 0) {
            ad::setmaxnreg_dec<PRODUCER_REGISTERS>();
            if (threadIdx.x == 0 && n_tiles > 0) {
                // Columns of this head's Q, K and V in the qkv rows (head_dim == HP).
                const int q_col = h * head_dim, k_col = q_col + num_heads * head_dim;
                const int v_col = k_col + num_heads * head_dim;
                ad::mbarrier_arrive_expect_tx(q_full, Q_BYTES);
                ad::tma_load_3d(sQ, q_map, q_full, q_col, qb0, b);
                for (int it = 0; it < n_tiles; ++it) {
                    const int st = it % KV_STAGES;
                    ad::mbarrier_wait(empty0 + 8 * st, ((it / KV_STAGES) & 1) ^ 1);  // 1
                    const unsigned full = full0 + 8 * st;  // 2
                    ad::mbarrier_arrive_expect_tx(full, 2 * KV_BYTES);
                    ad::tma_load_3d(sK + st * KV_BYTES, kv_map, full, k_col, it * BKV, b);
                    ad::tma_load_3d(sV + st * KV_BYTES, kv_map, full, v_col, it * BKV, b);
                }
            }
            return;
        }
        ad::setmaxnreg_inc<CONSUMER_REGISTERS>();
        float s[NS];
        unsigned p[KS][4];
        if (n_tiles > 0) ad::mbarrier_wait(q_full, 0);
        if constexpr (SCHEDULE == ad::TMA_PLAIN) {
            for (int it = 0; it < n_tiles; ++it) {
                const int kv0 = it * BKV, st = it % KV_STAGES;
                ad::mbarrier_wait(full0 + 8 * st, (it / KV_STAGES) & 1);  // 1
                // A warpgroup whose rows all precede the tile's first key (causal) sees none of it.
                const bool work = group_rows && !(causal && kv0 > qg0 + 63);
                if (work) {  // 2
                    ad::wgmma_fence();
                    issue_scores(s, st);
                    ad::wgmma_commit();
                    ad::wgmma_wait<0>();
                    fence_scores(s);
                    float alpha[2];
                    softmax(1, s, kv0, alpha);
                    pv_waited(p, s, st);
                }
                ad::mbarrier_arrive(empty0 + 8 * st);  // 3
            }
        } else if constexpr (SCHEDULE == ad::TMA_PINGPONG) {
            // Turns: named barrier 1 + group is this warpgroup's, other the next one's.
            const unsigned mine = 1 + group, other = 1 + (group + 1) % CONSUMERS;
            if (group == CONSUMERS - 1) ad::named_arrive(1);  // warpgroup 0 goes first
            ad::named_sync(mine);                 // 0
            for (int it = 0; it < n_tiles; ++it) {
                const int kv0 = it * BKV, st = it % KV_STAGES;
                ad::mbarrier_wait(full0 + 8 * st, (it / KV_STAGES) & 1);  // 1
                const bool work = group_rows && !(causal && kv0 > qg0 + 63);
                if (work) {  // 2-5
                    ad::wgmma_fence();
                    issue_scores(s, st);
                    ad::wgmma_commit();
                    ad::named_arrive(other);
                    ad::wgmma_wait<0>();
                    fence_scores(s);
                    float alpha[2];
                    softmax(1, s, kv0, alpha);
                    pack(p, s);
                    fence_outputs();
                    ad::wgmma_fence();
                    issue_pv(p, st);
                    ad::wgmma_commit();
                    ad::named_sync(mine);
                    ad::wgmma_wait<0>();
                    fence_outputs();
                    fence_probs(p);
                } else {  // the same turns, no math
                    ad::named_arrive(other);
                    ad::named_sync(mine);
                }
                ad::mbarrier_arrive(empty0 + 8 * st);  // 6
            }
            if (group != CONSUMERS - 1) ad::named_arrive(other);  // 7
        } else {  // the overlap schedules: TMA_OVERLAP and TMA_OVERLAP_PACKED
            const unsigned mine = 1 + group, other = 1 + (group + 1) % CONSUMERS;
            auto wait_full = [&](int it) {
                ad::mbarrier_wait(full0 + 8 * (it % KV_STAGES), (it / KV_STAGES) & 1);
            };
            // Step 0, the first turn: S[0] issued (the last consumer lets warpgroup 0 go first)
            // and waited for.
            auto first_scores_turn = [&]() {
                if (group == CONSUMERS - 1) ad::named_arrive(1);
                wait_full(0);
                ad::named_sync(mine);
                ad::wgmma_fence();
                issue_scores(s, 0);
                ad::wgmma_commit();
                ad::named_arrive(other);
                ad::wgmma_wait<0>();
                fence_scores(s);
            };
            if constexpr (SCHEDULE == ad::TMA_OVERLAP) {
                float s_odd[NS];  // s: the scores of even tiles, s_odd of odd ones
                // Iteration it, steps 1-6, cur holding S[it] (issued, maybe pending), next to
                // take S[it + 1]; first: it == 0 (no P V before it); ahead: it + 1 < n_tiles.
                auto iteration = [&](int first, int ahead, int it, float (&cur)[NS],
                                     float (&next)[NS]) {
                    if (ahead) wait_full(it + 1);  // 1
                    ad::named_sync(mine);          // 2
                    fence_outputs();
                    ad::wgmma_fence();
                    if (!first) {
                        issue_pv(p, (it - 1) % KV_STAGES);
                        ad::wgmma_commit();
                    }
                    if (ahead) {
                        issue_scores(next, (it + 1) % KV_STAGES);
                        ad::wgmma_commit();
                    }
                    ad::named_arrive_if(ahead || group != CONSUMERS - 1, other);
                    // 3: S[it] is complete (P V of it - 1 and S[it + 1] may run on).
                    if (!first && ahead) {
                        ad::wgmma_wait<2>();
                    } else if (!first || ahead) {
                        ad::wgmma_wait<1>();
                    } else {
                        ad::wgmma_wait<0>();
                    }
                    fence_scores(cur);
                    float alpha[2];
                    const bool rows = softmax(0, cur, it * BKV, alpha);  // 4
                    if (ahead) ad::wgmma_wait<1>(); else ad::wgmma_wait<0>();  // 5
                    fence_outputs();
                    fence_probs(p);
                    if (!first) ad::mbarrier_arrive(empty0 + 8 * ((it - 1) % KV_STAGES));
                    if (rows) rescale(alpha);  // 6
                    pack(p, cur);
                };
                if (n_tiles > 0) {  // 0
                    first_scores_turn();
                    // Two tiles a trip, so that the score sets alternate without copies.
                    if (n_tiles == 1) {
                        iteration(1, 0, 0, s, s_odd);
                    } else {
                        iteration(1, 1, 0, s, s_odd);
                        int it = 1;
                        for (; it + 2 < n_tiles; it += 2) {
                            iteration(0, 1, it, s_odd, s);
                            iteration(0, 1, it + 1, s, s_odd);
                        }
                        if (it + 1 < n_tiles) {
                            iteration(0, 1, it, s_odd, s);
                            iteration(0, 0, it + 1, s, s_odd);
                        } else {
                            iteration(0, 0, it, s_odd, s);
                        }
                    }
                    // 7: P V of the last tile, outside the turns.
                    const int st = (n_tiles - 1) % KV_STAGES;
                    fence_outputs();
                    ad::wgmma_fence();
                    issue_pv(p, st);
                    ad::wgmma_commit();
                    ad::wgmma_wait<0>();
                    fence_outputs();
                    fence_probs(p);
                    ad::mbarrier_arrive(empty0 + 8 * st);
                }
            } else {  // TMA_OVERLAP_PACKED: one score set, P of tile it packed while S[it + 1] runs
                float alpha[2];
                // Iteration it, steps 1-4, p holding P[it]; ahead: it + 1 < n_tiles.
                auto iteration = [&](int ahead, int it) {
                    if (ahead) wait_full(it + 1);  // 1
                    ad::named_sync(mine);          // 2
                    fence_outputs();
                    ad::wgmma_fence();
                    if (ahead) {
                        issue_scores(s, (it + 1) % KV_STAGES);
                        ad::wgmma_commit();
                    }
                    issue_pv(p, it % KV_STAGES);
                    ad::wgmma_commit();
                    ad::named_arrive_if(ahead || group != CONSUMERS - 1, other);
                    bool rows = false;
                    if (ahead) {  // 3: S[it + 1] is complete (P V of it may run on)
                        ad::wgmma_wait<1>();
                        fence_scores(s);
                        rows = softmax(0, s, (it + 1) * BKV, alpha);
                    }
                    ad::wgmma_wait<0>();  // 4: P V of it is complete
                    fence_outputs();
                    fence_probs(p);
                    ad::mbarrier_arrive(empty0 + 8 * (it % KV_STAGES));
                    if (ahead) {
                        if (rows) rescale(alpha);
                        pack(p, s);
                    }
                };
                if (n_tiles > 0) {  // 0
                    first_scores_turn();
                    if (softmax(0, s, 0, alpha)) rescale(alpha);
                    pack(p, s);
                    int it = 0;
                    for (; it + 1 < n_tiles; ++it) iteration(1, it);
                    iteration(0, it);
                }
            }
        }
    } else if constexpr (PIPELINE == 0) {
        float s[NS];
        unsigned p[KS][4];
        // One commit group per K tile and per V tile (Q joins the first K): the counts of the
        // waits below hold for every tile, empty groups included.
        auto load_kv = [&](int buf, int kv0) {
            load_k(buf, kv0);
            cp_async_commit();
            load_v(buf, kv0);
            cp_async_commit();
        };
        if (n_tiles > 0) {
            load_q();
            load_kv(0, 0);
        }
        for (int it = 0; it < n_tiles; ++it) {
            const int kv0 = it * BKV, buf = it & 1;
            // In flight: K and V of this tile. Wait for K (and Q), make this thread's copies
            // visible to the async proxy (the tensor cores), then to every thread; past the
            // barrier every warpgroup has also finished (wgmma waited for) reading the other
            // buffers, tile it - 1.
            cp_async_wait<1>();
            ad::fence_proxy_async();
            __syncthreads();
            if (it + 1 < n_tiles) {
                load_kv(buf ^ 1, kv0 + BKV);
            } else {
                cp_async_commit();
                cp_async_commit();
            }

            // A warpgroup whose rows all precede the tile's first key (causal) sees none of it.
            const bool work = group_rows && !(causal && kv0 > qg0 + 63);
            if (work) {
                ad::wgmma_fence();
                issue_scores(s, buf);
                ad::wgmma_commit();
                ad::wgmma_wait<0>();
                fence_scores(s);
                float alpha[2];
                softmax(1, s, kv0, alpha);
            }

            // V of this tile (the next tile's K and V may still be in flight), visible to all.
            cp_async_wait<2>();
            ad::fence_proxy_async();
            __syncthreads();

            if (work) pv_waited(p, s, buf);
        }
    } else {
        constexpr int KB = ad::K_BUFFERS, VB = ad::PIPELINED_V_BUFFERS;
        float s_even[NS], s_odd[NS];  // scores of even and odd tiles
        unsigned p[KS][4];            // P of the tile whose P V may be pending
        // Steps 1-2 of iteration it.
        auto top = [&](int it) {
            cp_async_wait<0>();
            ad::fence_proxy_async();
            __syncthreads();
            if (it + 2 < n_tiles) load_k((it + 2) % KB, (it + 2) * BKV);
            if (it + 1 < n_tiles) load_v((it + 1) % VB, (it + 1) * BKV);
            cp_async_commit();
        };
        // Steps 4-7 of iteration it, cur holding S[it]; ahead: 1 where step 3 issued
        // S[it + 1], 0 on the last tile.
        auto finish = [&](int ahead, int it, float (&cur)[NS]) {
            float alpha[2];
            const bool rows = softmax(0, cur, it * BKV, alpha);
            if (ahead) ad::wgmma_wait<1>(); else ad::wgmma_wait<0>();
            fence_outputs();
            fence_probs(p);
            if (rows) rescale(alpha);
            pack(p, cur);
            fence_outputs();
            ad::wgmma_fence();
            issue_pv(p, it % VB);
            ad::wgmma_commit();
            if (ahead) ad::wgmma_wait<1>(); else ad::wgmma_wait<0>();
            if (!ahead) {
                fence_outputs();
                fence_probs(p);
            }
        };
        // Iteration it < n_tiles - 1, S[it + 1] into next.
        auto step = [&](int it, float (&cur)[NS], float (&next)[NS]) {
            top(it);
            ad::wgmma_fence();
            issue_scores(next, (it + 1) % KB);
            ad::wgmma_commit();
            finish(1, it, cur);
            fence_scores(next);
        };
        // The last iteration, it = n_tiles - 1.
        auto last = [&](int it, float (&cur)[NS]) {
            top(it);
            finish(0, it, cur);
        };
        if (n_tiles > 0) {
            load_q();
            load_k(0, 0);
            cp_async_commit();
            if (1 < n_tiles) load_k(1 % KB, BKV);
            load_v(0, 0);
            cp_async_commit();
            cp_async_wait<1>();
            ad::fence_proxy_async();
            __syncthreads();
            ad::wgmma_fence();
            issue_scores(s_even, 0);
            ad::wgmma_commit();
            ad::wgmma_wait<0>();
            fence_scores(s_even);
            // Two tiles a trip, so that the score sets alternate without copies.
            int it = 0;
            for (; it + 2 < n_tiles; it += 2) {
                step(it, s_even, s_odd);
                step(it + 1, s_odd, s_even);
            }
            if (it + 1 < n_tiles) {
                step(it, s_even, s_odd);
                last(it + 1, s_odd);
            } else {
                last(it, s_even);
            }
        }
    }
    if constexpr (PIPELINE != ad::TMA_RING) {
        cp_async_wait<0>();  // nothing is left in flight (the last groups are empty)
    }

    if (!warp_rows) return;
    store_context<HP / 8>(o, l_run, q0, g, t, seq_len, row_base, ctx_stride, h, head_dim,
                          ctx_hi, ctx_lo);
}

}  // namespace attn_wgmma_detail

template <int HP, int BQ, int BKV, int MINB, int PIPELINE>
__global__ void __launch_bounds__(BQ * 2, MINB)
flash_attention_wgmma(const __half* __restrict__ qkv, long long qkv_stride,
                      __half* __restrict__ ctx_hi, __half* __restrict__ ctx_lo,
                      long long ctx_stride, const unsigned char* __restrict__ valid,
                      const int* __restrict__ key_info, int seq_len, int num_heads,
                      int head_dim, float scale, int causal) {
    start_after_previous();
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    static_assert(MINB == 1 || MINB == 2 || MINB == 4, "one, two or four blocks an SM");
    static_assert(PIPELINE == 0 || PIPELINE == 1, "plain or pipelined schedule");
    static_assert(attention_wgmma_shared_bytes(HP, BQ, BKV, PIPELINE) <= 227 * 1024,
                  "Q and the K and V buffers must fit one block's shared memory");
    attn_wgmma_detail::flash_attention_body<HP, BQ, BKV, PIPELINE, 0>(
        qkv, qkv_stride, ctx_hi, ctx_lo, ctx_stride, valid, key_info, seq_len, num_heads,
        head_dim, scale, causal, nullptr, nullptr);
#elif defined(__CUDA_ARCH__)
    __trap();  // wgmma needs sm_90a: compile this kernel for sm_90a
#endif
}

// Dynamic shared bytes of one block of lb::flash_attention_wgmma_tma<hp, bq, bkv, kv_stages, *>:
// Q (bq rows), kv_stages K and kv_stages V buffers (bkv rows each), hp halves a row, plus 1024
// bytes of slack for aligning the first tile (the mbarriers are static shared memory).
// <64, 128, 64, 3>: 66560, <32, 128, 64, 3>: 33792, <64, 128, 128, 3>: 115712,
// <64, 192, 128, 6>: 222208.
__host__ __device__ constexpr int attention_wgmma_tma_shared_bytes(int hp, int bq, int bkv,
                                                                   int kv_stages) {
    return (bq + 2 * kv_stages * bkv) * hp * 2 + attn_wgmma_detail::ALIGN;
}

// FlashAttention-3's warp-specialised TMA ring, at BQ 128 (or 192) and BKV 64 or 128:
// lb::flash_attention_wgmma's semantics, parameters (then q_map and kv_map) and grid; 384
// threads (BQ 192: 512); dynamic shared memory lb::attention_wgmma_tma_shared_bytes(HP, BQ,
// BKV, KV_STAGES). Warpgroup 0 is the producer (setmaxnreg to 40 registers; one thread issues
// TMA copies), warpgroups 1 and 2 the consumers (query rows 0-63 and 64-127 of the block,
// setmaxnreg to 232; at BQ 192 also warpgroup 3, rows 128-191, and 24 and 160 registers).
// SCHEDULE (attn_wgmma_detail::TMA_*) picks the consumers' schedule: TMA_PLAIN, each running
// the plain schedule's math per key tile (S = Q K^T by SS wgmma waited for, mask and online
// softmax, O += P V by RS wgmma waited for) with no block barrier: the consumers drift
// apart, one's softmax overlapping another's wgmmas; TMA_PINGPONG, TMA_OVERLAP and
// TMA_OVERLAP_PACKED, FlashAttention-3's next steps (below), TMA_POLY_EXP2 or twice it
// added to any: FlashAttention-4's exponential for part of P. HP 32 or 64: a TMA box of HP
// columns is one panel (64 bytes with the 64-byte swizzle, 128 with the 128-byte one, as the
// descriptors expect);
// head_dim must equal HP: the boxes are HP columns wide, so a narrower head would read its
// neighbour's columns (ops.attention refuses it).
// Tensor maps (tensor_maps.py, 3-D): the qkv rows viewed as [batch][seq_len][3 H hd] fp16,
// dims {3 H hd, seq_len, batch}, strides {row bytes, seq_len row bytes}, the swizzle, zero
// fill: q_map boxes {HP, BQ, 1}, kv_map boxes {HP, BKV, 1}; box (c, r, b) is rows r.. of
// sequence b from column c (Q: h hd, K: (H + h) hd, V: (2 H + h) hd), zero past seq_len. Keys
// in [kv_end, seq_len) and hole keys are loaded (not zero-filled as the cp.async kernels do)
// and masked in the softmax as there: their P is 0.
// Tile it lives in stage st = it % KV_STAGES, round r = it / KV_STAGES. Barriers: q_full
// (count 1), full[st] (count 1) and empty[st] (count 128 BQ / 64: every consumer thread once a
// round).
//   Before the split: thread 0 prefetches the maps, initialises the barriers,
//   fence.mbarrier_init; __syncthreads (the block's only one).
//   Producer thread (threadIdx.x 0), where n_tiles > 0: arrive.expect_tx(q_full, Q_BYTES), TMA
//   the Q box (h hd, qb0, b); then for each tile it:
//   1. wait empty[st] phase r - 1 (parity (r & 1) ^ 1; passes at once in round 0): every
//      consumer is done with tile it - KV_STAGES (its P V waited for).
//   2. arrive.expect_tx(full[st], 2 KV_BYTES) (the whole boxes: zero fill counts); TMA the K
//      box into K buffer st and the V box into V buffer st, both completing on full[st].
//   Then exit. The other producer threads exit at once.
//   Consumer warpgroup, where n_tiles > 0: wait q_full parity 0; then for each tile it:
//   1. wait full[st] parity r & 1 (every consumer, also one skipping the tile: an arrive
//      without it could complete round r + 1's phase of empty[st] with round r's arrivals).
//   2. Unless the warpgroup sees none of the tile: S (wgmma, wait 0), mask and online softmax,
//      P V (wgmma, wait 0).
//   3. arrive on empty[st].
//   Then store_context as flash_attention_wgmma. The producer's step 1 at tile it needs only
//   the consumers' step 3 at tile it - KV_STAGES: any KV_STAGES >= 1 is deadlock-free; up to
//   KV_STAGES tiles are in flight or landed ahead of the slower consumer.
// TMA_PINGPONG (FlashAttention-3's ping-pong scheduling): the consumers take turns issuing
// wgmmas, so that one's softmax runs under the other's. Consumer c's turn starts when it
// passes bar.sync 1 + c, 256 and ends with its bar.arrive 1 + (c + 1) % C, 256 (the next
// one's; C consumers, 2 or 3, in a cycle). The producer and the arithmetic are TMA_PLAIN's.
// Consumer, n_tiles >= 0 (the turns balance at 0):
//   0. The last consumer arrives on 1 (warpgroup 0 goes first); sync on its own barrier (turn
//      0).
//   Tile it (every tile, the same barriers where the warpgroup skips it):
//   1. wait full[st] parity r & 1.
//   2. S = Q K^T issued (committed); arrive on the next one's barrier: turn it ends.
//   3. wgmma wait 0; mask and online softmax (under the others' S).
//   4. O += P V issued; sync on its own barrier (turn it + 1: the others have issued their S).
//   5. wgmma wait 0.
//   6. arrive on empty[st].
//   7. After the loop every consumer but the last arrives once more (the next one's last
//   sync; every phase: one sync, one arrive).
//   A warpgroup's release of tile it waits for the others' S of tile it + 1: KV_STAGES >= 2.
// TMA_OVERLAP: ping-pong, and S of tile it + 1 issued before the softmax of tile it (two score
// register sets, as flash_attention_wgmma's PIPELINE 1); every consumer computes every tile (P
// = 0 where a warp sees none of it: a branch around a pending wgmma serialises them). A turn
// issues P V of it - 1 and S of it + 1 back to back. Consumer, where n_tiles > 0:
//   0. The last consumer arrives on 1; wait full[0]; sync; S[0] issued; arrive; wait 0.
//   Iteration it (ahead: it + 1 < n_tiles):
//   1. If ahead: wait full[(it + 1) % KV_STAGES].
//   2. Sync (turn it + 1); O += P[it - 1] V[it - 1] (it > 0), S[it + 1] (if ahead) issued;
//      arrive on the next one's barrier, except the last consumer on the last tile (as 7).
//   3. wgmma wait until S[it] is complete (P V of it - 1 and S[it + 1] may run on).
//   4. Mask and online softmax of S[it] (o untouched).
//   5. wgmma wait 1 (0 if not ahead): P V of it - 1 is complete; arrive on its stage's empty.
//   6. o *= alpha; p = fp16(P[it]).
//   7. After the loop: O += P V of the last tile (outside the turns), wait 0, arrive on empty.
//   Step 1 waits for tile it + 1 while the stages of it - 1 and it are held: KV_STAGES >= 3;
//   with S of it + 1 in flight a consumer holds three, so more stages let the producer run
//   ahead (build.py's variant: 5).
// TMA_OVERLAP_PACKED (FlashAttention-3's order of the overlap, for BKV 128: TMA_OVERLAP's two
// score sets of 64 registers spill there): a turn issues S of tile it + 1 and P V of tile it,
// P[it] held packed in fp16 registers, and the softmax of it + 1 runs under that P V (and the
// other consumers' wgmmas): one score set. Every consumer computes every tile, as TMA_OVERLAP.
// Consumer, where n_tiles > 0:
//   0. The last consumer arrives on 1; wait full[0]; sync; S[0] issued; arrive; wait 0;
//      softmax of S[0]; o *= alpha; p = fp16(P[0]).
//   Iteration it (ahead: it + 1 < n_tiles), p holding P[it]:
//   1. If ahead: wait full[(it + 1) % KV_STAGES].
//   2. Sync (turn it + 1); S[it + 1] (if ahead), O += P[it] V[it] issued; arrive on the next
//      one's barrier, except the last consumer on the last tile.
//   3. If ahead: wgmma wait 1 (S[it + 1] is complete, P V of it runs on); mask and online
//      softmax of S[it + 1] (o untouched).
//   4. wgmma wait 0: P V of it is complete; arrive on empty[it % KV_STAGES]; if ahead: o *=
//      alpha, p = fp16(P[it + 1]).
//   Step 1 waits for tile it + 1 while holding it: KV_STAGES >= 2 (build.py's variants: 5 at
//   BQ 128, 6 at BQ 192, three consumers: the softmax's MASK_IDLE keeps it in 160 registers).
// SCHEDULE + k TMA_POLY_EXP2 (k 1 or 2): the same schedule, the softmax computing one column
// pair in POLY_EVERY / k with exp2_poly (FMA units) instead of exp2f (MUFU.EX2): not
// bit-identical.
// MINB 2 (two consumers only): __launch_bounds__(384, 2), two blocks an SM, four consumer
// warpgroups where one block has two, launched with 80 registers a thread (see setmaxnreg).
template <int HP, int BQ, int BKV, int KV_STAGES, int SCHEDULE, int MINB = 1>
__global__ void __launch_bounds__(128 * (BQ / 64 + 1), MINB)
flash_attention_wgmma_tma(const __half* __restrict__ qkv, long long qkv_stride,
                          __half* __restrict__ ctx_hi, __half* __restrict__ ctx_lo,
                          long long ctx_stride, const unsigned char* __restrict__ valid,
                          const int* __restrict__ key_info, int seq_len, int num_heads,
                          int head_dim, float scale, int causal,
                          const __grid_constant__ TensorMap q_map,
                          const __grid_constant__ TensorMap kv_map) {
    start_after_previous();
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    static_assert(HP == 32 || HP == 64, "one TMA box (HP columns, one swizzle row) a row");
    static_assert(attention_wgmma_tma_shared_bytes(HP, BQ, BKV, KV_STAGES) <= 227 * 1024,
                  "the ring must fit one block's shared memory");
    namespace ad = attn_wgmma_detail;
    // SCHEDULE % TMA_POLY_EXP2: the consumers' schedule; POLY_EIGHTHS = SCHEDULE /
    // TMA_POLY_EXP2, exp2_poly's share of P in eighths: one column pair in POLY_EVERY /
    // POLY_EIGHTHS (none where it is 0).
    constexpr int POLY_EIGHTHS = SCHEDULE / ad::TMA_POLY_EXP2;
    static_assert(POLY_EIGHTHS <= 2, "the polynomial takes one column pair in 8 or 4, or none");
    ad::flash_attention_body<HP, BQ, BKV, ad::TMA_RING, KV_STAGES, SCHEDULE % ad::TMA_POLY_EXP2,
                             POLY_EIGHTHS ? ad::POLY_EVERY / POLY_EIGHTHS : 0, MINB>(
        qkv, qkv_stride, ctx_hi, ctx_lo, ctx_stride, valid, key_info, seq_len, num_heads,
        head_dim, scale, causal, &q_map, &kv_map);
#elif defined(__CUDA_ARCH__)
    __trap();  // wgmma and TMA need sm_90a: compile this kernel for sm_90a
#endif
}

}  // namespace lb
