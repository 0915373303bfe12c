// Flash attention forward through nvcuda::wmma, in two kernels: attention_kernel (below;
// documented API only, the fallback) and flash_attention_kernel (further down; scores kept in
// registers through the fragment element layout, which a probe checks on the device first).
//
// attention_kernel: one block per (query block, sequence * head).
// Q, K, V and P are fp16 tensor-core operands with fp32 accumulation; the online softmax runs
// in fp32 (base 2). [S, S] scores never reach memory: each warp owns 16 query rows, computes
// their scores against a key block into shared memory, updates its rows' running max and sum
// in registers (two lanes per row), writes P as fp16, and accumulates P V into the context
// rows it keeps in shared fp32 (loaded as accumulator fragments for each product). Key blocks
// above the causal diagonal are skipped; masked keys get -inf; a row with no visible key gets
// context 0.
#include <math_constants.h>
#include <mma.h>

#include <algorithm>

#include "common.cuh"

namespace lbw {
namespace {

using namespace nvcuda;

constexpr int kBlockM = 64;                 // query rows per block
constexpr int kWarps = kBlockM / 16;        // 16 query rows per warp
constexpr int kThreads = kWarps * 32;

// Shared-memory layout of one block (offsets in bytes; every region 128-byte aligned).
struct Layout {
  int ldh, lds, ldp, ldo;                   // row strides: Q/K/V (halves), S (floats), P
                                            // (halves), O (floats)
  int q, k, v, s, p, o, key_ok, bytes;
};

__host__ __device__ inline Layout layout(int head_pad, int block_n) {
  Layout l;
  l.ldh = head_pad + 8;
  l.lds = block_n + 4;
  l.ldp = block_n + 8;
  l.ldo = head_pad + 4;
  l.q = 0;
  l.k = l.q + kBlockM * l.ldh * 2;
  l.v = l.k + block_n * l.ldh * 2;
  l.s = l.v + block_n * l.ldh * 2;
  l.p = l.s + kBlockM * l.lds * 4;
  l.o = l.p + kBlockM * l.ldp * 2;
  l.key_ok = l.o + kBlockM * l.ldo * 4;
  l.bytes = l.key_ok + block_n * 4;
  return l;
}

// rows x head_pad fp16 tile of column block col0 of qkv rows [row0, row0 + rows) of one
// sequence; rows past seq_len and columns past head_dim are zero.
__device__ __forceinline__ void load_rows(__half* dst, int ld, const AttentionParams& p,
                                          int64_t seq_base, int row0, int rows, int col0) {
  const int vecs_per_row = p.head_pad / 8;
  const int64_t stride = 3LL * p.heads * p.head_dim;
  for (int v = threadIdx.x; v < rows * vecs_per_row; v += kThreads) {
    const int r = v / vecs_per_row;
    const int c = (v % vecs_per_row) * 8;
    const bool ok = row0 + r < p.seq_len && c < p.head_dim;
    const __half* from = ok ? p.qkv + (seq_base + row0 + r) * stride + col0 + c : p.qkv;
    cp_async16(dst + r * ld + c, from, ok ? 16 : 0);
  }
}

// AttentionParams; grid (batch * heads, query blocks); block kThreads; dynamic shared
// layout(head_pad, BLOCK_N).bytes.
template <int BLOCK_N>
__global__ void __launch_bounds__(kThreads) attention_kernel(AttentionParams p) {
  start_after_previous();
  constexpr int kKeyFrags = BLOCK_N / 16;
  constexpr int kPerLane = BLOCK_N / 2;     // score columns per lane in the softmax
  extern __shared__ __align__(128) unsigned char smem[];
  const Layout L = layout(p.head_pad, BLOCK_N);
  __half* q_s = reinterpret_cast<__half*>(smem + L.q);
  __half* k_s = reinterpret_cast<__half*>(smem + L.k);
  __half* v_s = reinterpret_cast<__half*>(smem + L.v);
  float* s_s = reinterpret_cast<float*>(smem + L.s);
  __half* p_s = reinterpret_cast<__half*>(smem + L.p);
  float* o_s = reinterpret_cast<float*>(smem + L.o);
  int* key_ok_s = reinterpret_cast<int*>(smem + L.key_ok);   // 1: key exists and is valid

  const int b = blockIdx.x / p.heads, h = blockIdx.x % p.heads;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * kBlockM;   // longest causal blocks first
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row0 = warp * 16;                               // this warp's first row
  const int64_t seq_base = static_cast<int64_t>(b) * p.seq_len;
  const int d_model = p.heads * p.head_dim;
  const int q_col = h * p.head_dim, k_col = d_model + q_col, v_col = 2 * d_model + q_col;

  load_rows(q_s, L.ldh, p, seq_base, q0, kBlockM, q_col);
  cp_async_commit();
  for (int i = threadIdx.x; i < kBlockM * L.ldo; i += kThreads) o_s[i] = 0.f;

  // Softmax state: lanes 2r and 2r+1 share row0 + r (each half of the key block's columns).
  const int r_own = lane >> 1, half = lane & 1;
  const int row_own = row0 + r_own;
  const int query_own = q0 + row_own;
  float m_run = -CUDART_INF_F;              // running max of the row (base 2)
  float l_run = 0.f;                        // running sum of the row

  const int key_end = p.causal ? min(p.seq_len, q0 + kBlockM) : p.seq_len;
  const int warp_last_query = q0 + row0 + 15;
  for (int n0 = 0; n0 < key_end; n0 += BLOCK_N) {
    __syncthreads();                        // every warp is done with the previous block
    load_rows(k_s, L.ldh, p, seq_base, n0, BLOCK_N, k_col);
    load_rows(v_s, L.ldh, p, seq_base, n0, BLOCK_N, v_col);
    cp_async_commit();
    if (threadIdx.x < BLOCK_N) {
      const int key = n0 + threadIdx.x;
      key_ok_s[threadIdx.x] =
          key < p.seq_len && (p.valid == nullptr || p.valid[seq_base + key] != 0);
    }
    cp_async_wait<0>();
    __syncthreads();

    // Scores of this warp's 16 rows against the key block; 16-key tiles wholly above the
    // causal diagonal of these rows are left at 0 (the softmax masks them).
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> s_acc[kKeyFrags];
    bool live[kKeyFrags];
#pragma unroll
    for (int j = 0; j < kKeyFrags; ++j) {
      wmma::fill_fragment(s_acc[j], 0.f);
      live[j] = !p.causal || n0 + 16 * j <= warp_last_query;
    }
    for (int kd = 0; kd < p.head_pad; kd += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> q_frag;
      wmma::load_matrix_sync(q_frag, q_s + row0 * L.ldh + kd, L.ldh);
#pragma unroll
      for (int j = 0; j < kKeyFrags; ++j) {
        if (!live[j]) continue;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> k_frag;
        wmma::load_matrix_sync(k_frag, k_s + (j * 16) * L.ldh + kd, L.ldh);
        wmma::mma_sync(s_acc[j], q_frag, k_frag, s_acc[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < kKeyFrags; ++j) {
      wmma::store_matrix_sync(s_s + row0 * L.lds + j * 16, s_acc[j], L.lds,
                              wmma::mem_row_major);
    }
    __syncwarp();

    // Online softmax of the lane's row: columns half, half + 2, ...; P stored as fp16 and
    // the row's context rescaled in place.
    float s[kPerLane];
    float block_max = -CUDART_INF_F;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int c = half + 2 * j;
      const bool visible = key_ok_s[c] && (!p.causal || n0 + c <= query_own);
      s[j] = visible ? s_s[row_own * L.lds + c] * p.scale_log2 : -CUDART_INF_F;
      block_max = fmaxf(block_max, s[j]);
    }
    const float m_new = fmaxf(m_run, fmaxf(block_max, __shfl_xor_sync(kFullMask, block_max, 1)));
    const float m_safe = m_new == -CUDART_INF_F ? 0.f : m_new;   // no visible key yet
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const float e = exp2f(s[j] - m_safe);
      sum += e;
      p_s[row_own * L.ldp + half + 2 * j] = __float2half_rn(e);
    }
    sum += __shfl_xor_sync(kFullMask, sum, 1);
    const float alpha = exp2f(m_run - m_safe);
    l_run = l_run * alpha + sum;
    m_run = m_new;
    if (alpha != 1.f) {
      for (int d = half; d < p.head_pad; d += 2) o_s[row_own * L.ldo + d] *= alpha;
    }
    __syncwarp();

    // O rows += P V, a 16-column slice of the head at a time.
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> p_frag[kKeyFrags];
#pragma unroll
    for (int j = 0; j < kKeyFrags; ++j) {
      if (live[j]) wmma::load_matrix_sync(p_frag[j], p_s + row0 * L.ldp + j * 16, L.ldp);
    }
    for (int d0 = 0; d0 < p.head_pad; d0 += 16) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> o_acc;
      wmma::load_matrix_sync(o_acc, o_s + row0 * L.ldo + d0, L.ldo, wmma::mem_row_major);
#pragma unroll
      for (int j = 0; j < kKeyFrags; ++j) {
        if (!live[j]) continue;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> v_frag;
        wmma::load_matrix_sync(v_frag, v_s + (j * 16) * L.ldh + d0, L.ldh);
        wmma::mma_sync(o_acc, p_frag[j], v_frag, o_acc);
      }
      wmma::store_matrix_sync(o_s + row0 * L.ldo + d0, o_acc, L.ldo, wmma::mem_row_major);
    }
    __syncwarp();
  }

  // Normalise and store this warp's rows as an fp16 (hi, lo) pair, a row at a time.
  cp_async_wait<0>();   // a block with no key block still waits for its Q copy
  __syncwarp();
  for (int r = 0; r < 16; ++r) {
    const float l = __shfl_sync(kFullMask, l_run, 2 * r);
    const int query = q0 + row0 + r;
    if (query >= p.seq_len) continue;
    const int64_t out = (seq_base + query) * d_model + q_col;
    for (int d = lane; d < p.head_dim; d += 32) {
      const float o = o_s[(row0 + r) * L.ldo + d];
      __half hi, lo;
      split_half(l == 0.f ? 0.f : o / l, hi, lo);   // l == 0: no visible key, context 0
      p.ctx_hi[out + d] = hi;
      p.ctx_lo[out + d] = lo;
    }
  }
}

template <int BLOCK_N>
LaunchResult launch(const AttentionParams& p, cudaStream_t stream, const char* name) {
  const int bytes = layout(p.head_pad, BLOCK_N).bytes;
  if (bytes > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(
        attention_kernel<BLOCK_N>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err != cudaSuccess) return {err, name};
  }
  const int64_t heads = static_cast<int64_t>(p.batch) * p.heads;
  const int64_t q_blocks = (static_cast<int64_t>(p.seq_len) + kBlockM - 1) / kBlockM;
  if (heads > 0x7fffffff || q_blocks > 65535) return {cudaErrorInvalidConfiguration, name};
  const dim3 grid(static_cast<unsigned>(heads), static_cast<unsigned>(q_blocks));
  return {launch_kernel(attention_kernel<BLOCK_N>, grid, dim3(kThreads), bytes, stream, p), name};
}


// ---------------------------------------------------------------------------------------------
// Register-resident flash attention (FA2 order). Scores, probabilities and the context stay in
// wmma fragments for the whole key loop; shared memory holds only Q and two stages of K/V.
//
// It relies on the element layout of two fragment types, which the wmma API leaves
// unspecified; attention_layout_probe_kernel checks it on the device before any of these
// kernels is used (attention.py falls back to attention_kernel above otherwise). On sm_80 and
// sm_90, element i (0..7) of lane L of a 16x16 fp32 accumulator, and elements i and i + 8 of a
// 16x16 fp16 row-major matrix_a, hold
//     row L / 4 + 8 * bit1(i),   column 2 * (L % 4) + bit0(i) + 8 * bit2(i).
// So a lane holds two rows (g = L / 4 and g + 8) of every fragment, the four lanes of a quad
// together hold a row, and an accumulator of scores becomes the matrix_a of probabilities
// element by element.
//
// Per CTA: BLOCK_M = WARPS * MF * 16 query rows of one (sequence, head); each warp owns MF
// fragments of 16 rows. Per key block of BN keys: S = Q K^T into accumulators (Q fragments kept
// in registers when they fit), masks only where the block crosses the causal diagonal of the
// warp or holds a key that is invalid or past the end, row max over the quad (two shuffles),
// P = exp2(S * scale - m) in registers as fp16 matrix_a, O += P V. The kept max m of a row
// moves only when a block's max exceeds it by more than kLazy (log2 units), so P <= 2^8 and O
// is rescaled only then (exact algebra: l and O carry the same factor). K/V of block j + 1 are
// copied by cp.async while block j is computed; one barrier per key block.
// ---------------------------------------------------------------------------------------------

constexpr float kLazy = 8.f;  // the kept row max moves when a block's max exceeds it by this

template <int HP_, int MF_, int WARPS_, int BN_>
struct FlashCfg {
  static constexpr int HP = HP_;              // largest head_pad taken (columns past the call's
                                              // head_pad are skipped at run time)
  static constexpr int MF = MF_;              // 16-row fragments per warp
  static constexpr int WARPS = WARPS_;
  static constexpr int BN = BN_;              // keys per block
  static constexpr int kThreads = WARPS * 32;
  static constexpr int kBlockM = WARPS * MF * 16;
  static constexpr int kLd = HP + 8;          // row stride of the Q/K/V tiles (halves)
  static constexpr int kKF = BN / 16;         // key fragments per block
  static constexpr int kDF = HP / 16;         // head-dim fragments
  static constexpr int kMaskWords = BN / 32;  // 32-key words of the per-block key mask
  static constexpr bool kQInRegs = MF * HP <= 128;   // Q fragments held across the key loop
  // CTAs per multiprocessor that __launch_bounds__ caps the registers for (none spills):
  // 16 warps of 16 rows at head_pad 32 (128 registers), 12 warps of 16 rows at 64 (168),
  // else 8 warps (255: 32-row warps, larger head dims; 8 warps of 16 rows at 64 need ~160).
  static constexpr int kMinBlocks = MF == 1 && HP <= 32             ? 512 / kThreads
                                    : MF == 1 && HP <= 64 && WARPS == 4 ? 3
                                    : (256 / kThreads > 1 ? 256 / kThreads : 1);
  static constexpr int kTileBytes = BN * kLd * 2;
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + kBlockM * kLd * 2;
  static constexpr int kV = kK + 2 * kTileBytes;
  static constexpr int kMask = kV + 2 * kTileBytes;
  static constexpr int kBytes = kMask + 2 * kMaskWords * 4;
  static_assert(BN % 32 == 0 && HP % 16 == 0 && kThreads % (HP / 8) == 0, "tile shape");
};

using AccFrag = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
using AFrag = wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major>;
using KFrag = wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major>;
using VFrag = wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major>;
static_assert(AccFrag::num_elements == 8 && AFrag::num_elements == 16,
              "the fragment sizes the register layout assumes");

// The (row, column) of element i of a lane's accumulator (and matrix_a) fragment.
__host__ __device__ constexpr int frag_row(int lane, int i) {
  return lane / 4 + 8 * ((i >> 1) & 1);
}
__host__ __device__ constexpr int frag_col(int lane, int i) {
  return 2 * (lane % 4) + (i & 1) + 8 * ((i >> 2) & 1);
}

// op over v[0..N) as a balanced tree (N a power of two).
template <int N, class Op>
__device__ __forceinline__ float tree_reduce(float (&v)[N], Op op) {
  static_assert((N & (N - 1)) == 0, "a power of two");
#pragma unroll
  for (int w = N / 2; w >= 1; w /= 2) {
#pragma unroll
    for (int i = 0; i < w; ++i) v[i] = op(v[i], v[i + w]);
  }
  return v[0];
}

__device__ __forceinline__ float fast_exp2(float x) {  // ex2.approx: exp2(-inf) = +0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// A thread's share of the tile copies: 16 bytes at column c of rows r0, r0 + kRowStep, ...
// Columns in [head_dim, head_pad) are zero-filled (source bytes 0; the address, 8 columns to
// the left, stays inside the row); columns from head_pad on are never read, so not copied.
template <class C>
struct CopyPlan {
  static constexpr int kVecs = C::HP / 8;                // 16-byte pieces per row
  static constexpr int kRowStep = C::kThreads / kVecs;   // rows apart of a thread's pieces
  int r0, smem, src_col, bytes;
  bool active;
  __device__ __forceinline__ CopyPlan(int head_dim, int head_pad) {
    const int c = (threadIdx.x % kVecs) * 8;
    r0 = threadIdx.x / kVecs;
    smem = r0 * C::kLd + c;
    active = c < head_pad;
    src_col = c < head_dim ? c : c - 8;
    bytes = c < head_dim ? 16 : 0;
  }
};

// ROWS x HP tile by 16-byte cp.async: tile row r from row0 + r * stride, where src is this
// thread's first piece (row0 + cp.r0 * stride + cp.src_col); rows from rows_valid on are
// zero-filled, their address clamped to `fallback` (a piece of a row that exists).
template <class C, int ROWS>
__device__ __forceinline__ void copy_tile_from(__half* dst, const __half* src,
                                               const __half* fallback, int64_t stride,
                                               int rows_valid, const CopyPlan<C>& cp) {
  constexpr int kStep = CopyPlan<C>::kRowStep;
  constexpr int kIters = (ROWS + kStep - 1) / kStep;
  if (!cp.active) return;
  const int64_t step = kStep * stride;
  if (rows_valid >= ROWS) {
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      if (ROWS % kStep != 0 && cp.r0 + it * kStep >= ROWS) break;
      cp_async16(dst + cp.smem + it * kStep * C::kLd, src + it * step, cp.bytes);
    }
  } else {
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int r = cp.r0 + it * kStep;
      if (ROWS % kStep != 0 && r >= ROWS) break;
      const bool in = r < rows_valid;
      cp_async16(dst + cp.smem + it * kStep * C::kLd, in ? src + it * step : fallback,
                 in ? cp.bytes : 0);
    }
  }
}

// The same from the tile's first row (row0, which exists).
template <class C, int ROWS>
__device__ __forceinline__ void copy_tile(__half* dst, const __half* row0, int64_t stride,
                                          int rows_valid, const CopyPlan<C>& cp) {
  copy_tile_from<C, ROWS>(dst, row0 + cp.r0 * stride + cp.src_col, row0 + cp.src_col, stride,
                          rows_valid, cp);
}

// 1 when key exists and is valid (lanes of the warps that build the key mask).
__device__ __forceinline__ int key_ok(const AttentionParams& p, int64_t seq_base, int key) {
  if (key >= p.seq_len) return 0;
  return p.valid == nullptr || p.valid[seq_base + key] != 0;
}

// One key block of one warp's rows: S = Q K^T, masks (EDGE only), online softmax, O += P V.
// EDGE: the block holds a key that is invalid or past the end, or crosses the causal diagonal
// of the warp's rows; key fragments no row of a row fragment sees are skipped, and masked
// elements set to -inf. Interior blocks take the path without tests. EXACT: head_pad == HP.
template <class C, bool EDGE, bool EXACT>
__device__ __forceinline__ void flash_block(
    const AttentionParams& p, const __half* q_w, const __half* kt, const __half* vt,
    const uint32_t (&words)[C::kMaskWords], int n0, int wq0, int g, int t, int kd_live,
    const AFrag (&q_reg)[C::kQInRegs ? C::MF : 1][C::kQInRegs ? C::kDF : 1],
    AccFrag (&o)[C::MF][C::kDF], float (&m_run)[C::MF][2], float (&l_run)[C::MF][2]) {
  constexpr int MF = C::MF, KF = C::kKF, DF = C::kDF, Ld = C::kLd;
  // Head-dim fragment kd holds a column below head_pad.
  auto hd_live = [&](int kd) { return EXACT || kd == 0 || kd < kd_live; };
  // Key fragment jf holds a key some row of row fragment mf may see.
  auto live = [&](int mf, int jf) {
    return !EDGE || (n0 + 16 * jf < p.seq_len &&
                     (!p.causal || n0 + 16 * jf <= wq0 + 16 * mf + 15));
  };

  AccFrag s[MF][KF];
#pragma unroll
  for (int mf = 0; mf < MF; ++mf) {
#pragma unroll
    for (int jf = 0; jf < KF; ++jf) wmma::fill_fragment(s[mf][jf], 0.f);
  }
  // Q from shared memory (no fragment indexed by kd): a partly rolled loop keeps the code of
  // the wide head dims short; Q in registers needs it unrolled.
#pragma unroll(C::kQInRegs ? DF : 2)
  for (int kd = 0; kd < DF; ++kd) {
    if (!hd_live(kd)) continue;
    AFrag q_mem[C::kQInRegs ? 1 : MF];
    if constexpr (!C::kQInRegs) {
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) {
        wmma::load_matrix_sync(q_mem[mf], q_w + 16 * mf * Ld + 16 * kd, Ld);
      }
    }
#pragma unroll
    for (int jf = 0; jf < KF; ++jf) {
      if (!live(MF - 1, jf)) continue;   // the last row fragment sees the most keys
      KFrag kb;
      wmma::load_matrix_sync(kb, kt + 16 * jf * Ld + 16 * kd, Ld);
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) {
        if (!live(mf, jf)) continue;
        if constexpr (C::kQInRegs) {
          wmma::mma_sync(s[mf][jf], q_reg[mf][kd], kb, s[mf][jf]);
        } else {
          wmma::mma_sync(s[mf][jf], q_mem[mf], kb, s[mf][jf]);
        }
      }
    }
  }

  if constexpr (EDGE) {
    // -inf where the key is invalid or past the end, or above the diagonal. The fragments
    // skipped above are wholly masked here.
#pragma unroll
    for (int mf = 0; mf < MF; ++mf) {
#pragma unroll
      for (int jf = 0; jf < KF; ++jf) {
        const uint32_t bits = words[jf / 2] >> (16 * (jf & 1) + 2 * t);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int dk = (i & 1) + 8 * ((i >> 2) & 1);   // column - 2t within the fragment
          const int key = n0 + 16 * jf + 2 * t + dk;
          const int query = wq0 + 16 * mf + g + 8 * ((i >> 1) & 1);
          const bool visible = ((bits >> dk) & 1u) && (!p.causal || key <= query);
          if (!visible) s[mf][jf].x[i] = -CUDART_INF_F;
        }
      }
    }
  }

  // Row max over the quad; the kept max moves only past kLazy.
  float alpha[MF][2], m_use[MF][2];
  bool moved = false;
#pragma unroll
  for (int mf = 0; mf < MF; ++mf) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float part[KF];   // per key fragment, then a tree: short dependency chains
#pragma unroll
      for (int jf = 0; jf < KF; ++jf) {
        part[jf] = fmaxf(fmaxf(s[mf][jf].x[2 * r], s[mf][jf].x[2 * r + 1]),
                         fmaxf(s[mf][jf].x[2 * r + 4], s[mf][jf].x[2 * r + 5]));
      }
      float mx = tree_reduce<KF>(part, [](float a, float b) { return fmaxf(a, b); });
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
      const float mx2 = mx * p.scale_log2;   // -inf: no visible key in the block
      alpha[mf][r] = 1.f;
      if (mx2 > m_run[mf][r] + kLazy) {      // never while mx2 is -inf
        alpha[mf][r] = fast_exp2(m_run[mf][r] - mx2);   // m_run -inf: 0
        m_run[mf][r] = mx2;
        l_run[mf][r] *= alpha[mf][r];
        moved = true;
      }
      // No visible key yet (m_run -inf): P = exp2(-inf - 0) = 0, never -inf - -inf.
      m_use[mf][r] = m_run[mf][r] == -CUDART_INF_F ? 0.f : m_run[mf][r];
    }
  }
  if (__any_sync(kFullMask, moved)) {
#pragma unroll
    for (int mf = 0; mf < MF; ++mf) {
#pragma unroll
      for (int df = 0; df < DF; ++df) {
        if (!hd_live(df)) continue;
#pragma unroll
        for (int i = 0; i < 8; ++i) o[mf][df].x[i] *= alpha[mf][(i >> 1) & 1];
      }
    }
  }

  // P = exp2(S * scale - m) as fp16 matrix_a fragments, element by element (i and i + 8);
  // the block's row sums per key fragment, then a tree.
  AFrag pa[MF][KF];
  const float scale = p.scale_log2;
#pragma unroll
  for (int mf = 0; mf < MF; ++mf) {
    float sums[2][KF];
#pragma unroll
    for (int jf = 0; jf < KF; ++jf) {
      sums[0][jf] = sums[1][jf] = 0.f;
      if (!live(mf, jf)) continue;
#pragma unroll
      for (int k = 0; k < 4; ++k) {   // elements 2k, 2k + 1: one row, adjacent columns
        const int r = k & 1;
        const float e0 = fast_exp2(fmaf(s[mf][jf].x[2 * k], scale, -m_use[mf][r]));
        const float e1 = fast_exp2(fmaf(s[mf][jf].x[2 * k + 1], scale, -m_use[mf][r]));
        sums[r][jf] += e0 + e1;
        const __half2 h2 = __floats2half2_rn(e0, e1);
        pa[mf][jf].x[2 * k] = pa[mf][jf].x[2 * k + 8] = __low2half(h2);
        pa[mf][jf].x[2 * k + 1] = pa[mf][jf].x[2 * k + 9] = __high2half(h2);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l_run[mf][r] += tree_reduce<KF>(sums[r], [](float a, float b) { return a + b; });
    }
  }

  // O += P V.
#pragma unroll
  for (int jf = 0; jf < KF; ++jf) {
    if (!live(MF - 1, jf)) continue;
#pragma unroll
    for (int df = 0; df < DF; ++df) {
      if (!hd_live(df)) continue;
      VFrag vb;
      wmma::load_matrix_sync(vb, vt + 16 * jf * Ld + 16 * df, Ld);
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) {
        if (live(mf, jf)) wmma::mma_sync(o[mf][df], pa[mf][jf], vb, o[mf][df]);
      }
    }
  }
}

// AttentionParams, q_blocks = ceil(seq_len / kBlockM); 1-D order over (sequence * head, query
// block) with the query block fastest, laid on a 2-D grid (x * y CTAs, the surplus returns);
// block kThreads; dynamic shared FlashCfg::kBytes. EXACT: head_pad == HP.
template <int HP, int MF, int WARPS, int BN, bool EXACT>
__global__ void __launch_bounds__(WARPS * 32, (FlashCfg<HP, MF, WARPS, BN>::kMinBlocks))
    flash_attention_kernel(AttentionParams p, int q_blocks) {
  start_after_previous();
  using C = FlashCfg<HP, MF, WARPS, BN>;
  constexpr int DF = C::kDF, Ld = C::kLd, MW = C::kMaskWords;
  extern __shared__ __align__(128) unsigned char smem[];
  __half* q_s = reinterpret_cast<__half*>(smem + C::kQ);
  __half* k_s = reinterpret_cast<__half*>(smem + C::kK);
  __half* v_s = reinterpret_cast<__half*>(smem + C::kV);
  uint32_t* mask_s = reinterpret_cast<uint32_t*>(smem + C::kMask);  // bit: key exists, valid

  const int64_t id = static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x;
  const int64_t bh = id / q_blocks;
  if (bh >= static_cast<int64_t>(p.batch) * p.heads) return;
  // Within a head, the longest causal query blocks first; consecutive CTAs share K/V in L2.
  const int qb = q_blocks - 1 - static_cast<int>(id - bh * q_blocks);
  const int b = static_cast<int>(bh / p.heads), h = static_cast<int>(bh % p.heads);
  const int q0 = qb * C::kBlockM;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int wrow = warp * 16 * MF;              // the warp's first row in the block
  const int wq0 = q0 + wrow;                    // and its query
  const int64_t seq_base = static_cast<int64_t>(b) * p.seq_len;
  const int d_model = p.heads * p.head_dim;
  const int64_t stride = 3LL * d_model;
  const __half* q_ptr = p.qkv + seq_base * stride + h * p.head_dim;
  const __half* k_ptr = q_ptr + d_model;
  const __half* v_ptr = q_ptr + 2 * d_model;
  const int head_dim = p.head_dim, head_pad = EXACT ? HP : p.head_pad;
  const int kd_live = head_pad / 16;
  const int key_end = p.causal ? min(p.seq_len, q0 + C::kBlockM) : p.seq_len;
  const int n_blocks = (key_end + BN - 1) / BN;   // >= 1: q0 < seq_len

  const CopyPlan<C> cp(head_dim, head_pad);
  copy_tile<C, C::kBlockM>(q_s, q_ptr + static_cast<int64_t>(q0) * stride, stride,
                           p.seq_len - q0, cp);
  copy_tile<C, BN>(k_s, k_ptr, stride, p.seq_len, cp);
  copy_tile<C, BN>(v_s, v_ptr, stride, p.seq_len, cp);
  cp_async_commit();
  if (warp < MW) {
    const unsigned bits = __ballot_sync(kFullMask, key_ok(p, seq_base, 32 * warp + lane));
    if (lane == 0) mask_s[warp] = bits;
  }

  AccFrag o[MF][DF];
#pragma unroll
  for (int mf = 0; mf < MF; ++mf) {
#pragma unroll
    for (int df = 0; df < DF; ++df) wmma::fill_fragment(o[mf][df], 0.f);
  }
  // Per lane: rows g and g + 8 of each of its row fragments; m in scaled log2 units, l the
  // lane's partial sum (its columns), summed over the quad at the end.
  float m_run[MF][2], l_run[MF][2];
#pragma unroll
  for (int mf = 0; mf < MF; ++mf) {
    m_run[mf][0] = m_run[mf][1] = -CUDART_INF_F;
    l_run[mf][0] = l_run[mf][1] = 0.f;
  }

  cp_async_wait<0>();
  __syncthreads();
  const __half* q_w = q_s + wrow * Ld;
  AFrag q_reg[C::kQInRegs ? MF : 1][C::kQInRegs ? DF : 1];
  if constexpr (C::kQInRegs) {
#pragma unroll
    for (int mf = 0; mf < MF; ++mf) {
#pragma unroll
      for (int kd = 0; kd < DF; ++kd) {
        if (EXACT || kd < kd_live) {
          wmma::load_matrix_sync(q_reg[mf][kd], q_w + 16 * mf * Ld + 16 * kd, Ld);
        }
      }
    }
  }

  // This thread's first piece of the current key block's K and V rows.
  const __half* k_src = k_ptr + cp.r0 * stride + cp.src_col;
  const __half* v_src = v_ptr + cp.r0 * stride + cp.src_col;
  const bool warp_has_rows = wq0 < p.seq_len;
  const int wq_last = wq0 + 16 * MF - 1;
  for (int j = 0; j < n_blocks; ++j) {
    const int st = j & 1;
    const int n0 = j * BN;
    if (j > 0) {
      cp_async_wait<0>();     // block j's K/V (this thread's copies) ...
      __syncthreads();        // ... everyone's; and everyone is done with stage st ^ 1
    }
    const bool has_next = j + 1 < n_blocks;
    // The next block's key: in range, and its mask byte (key 0's where out of range), compared
    // only at the ballot below so that the load's latency hides behind this block's products.
    bool next_in = false;
    int next_byte = 0;
    if (has_next) {
      const int n1 = n0 + BN;
      k_src += BN * stride;
      v_src += BN * stride;
      copy_tile_from<C, BN>(k_s + (st ^ 1) * BN * Ld, k_src, k_ptr + cp.src_col, stride,
                            p.seq_len - n1, cp);
      copy_tile_from<C, BN>(v_s + (st ^ 1) * BN * Ld, v_src, v_ptr + cp.src_col, stride,
                            p.seq_len - n1, cp);
      cp_async_commit();
      if (warp < MW) {
        const int key = n1 + 32 * warp + lane;
        next_in = key < p.seq_len;
        next_byte = p.valid == nullptr ? 1 : p.valid[seq_base + (next_in ? key : 0)];
      }
    }

    // A warp whose rows are all past the end, or all above the block (causal), skips it.
    if (warp_has_rows && (!p.causal || n0 <= wq_last)) {
      uint32_t words[MW];
      uint32_t all = ~0u;
#pragma unroll
      for (int w = 0; w < MW; ++w) {
        words[w] = mask_s[st * MW + w];
        all &= words[w];
      }
      const __half* kt = k_s + st * BN * Ld;
      const __half* vt = v_s + st * BN * Ld;
      if (all != ~0u || (p.causal && n0 + BN - 1 > wq0)) {
        flash_block<C, true, EXACT>(p, q_w, kt, vt, words, n0, wq0, g, t, kd_live, q_reg, o,
                                    m_run, l_run);
      } else {
        flash_block<C, false, EXACT>(p, q_w, kt, vt, words, n0, wq0, g, t, kd_live, q_reg, o,
                                     m_run, l_run);
      }
    }

    if (has_next && warp < MW) {   // the next block's key mask, read after the next barrier
      const unsigned bits = __ballot_sync(kFullMask, next_in && next_byte != 0);
      if (lane == 0) mask_s[(st ^ 1) * MW + warp] = bits;
    }
  }

  // Normalise and store: each lane writes two adjacent columns of its rows (4-byte stores).
  __half* out_hi = p.ctx_hi + seq_base * d_model + h * head_dim;
  __half* out_lo = p.ctx_lo + seq_base * d_model + h * head_dim;
#pragma unroll
  for (int mf = 0; mf < MF; ++mf) {
    float inv_l[2];   // l == 0: no visible key, context 0
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = l_run[mf][r];
      l += __shfl_xor_sync(kFullMask, l, 1);
      l += __shfl_xor_sync(kFullMask, l, 2);
      inv_l[r] = l == 0.f ? 0.f : 1.f / l;
    }
#pragma unroll
    for (int df = 0; df < DF; ++df) {
      if (!EXACT && df >= kd_live) continue;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int r = k & 1;
        const int query = wq0 + 16 * mf + g + 8 * r;
        const int col = 16 * df + 8 * (k >> 1) + 2 * t;
        if (query >= p.seq_len || col >= head_dim) continue;   // head_dim: a multiple of 8
        __half hi0, lo0, hi1, lo1;
        // No visible key: write 0 itself, since o may hold 0 * inf from a masked key's V.
        const bool empty = inv_l[r] == 0.f;
        split_half(empty ? 0.f : o[mf][df].x[2 * k] * inv_l[r], hi0, lo0);
        split_half(empty ? 0.f : o[mf][df].x[2 * k + 1] * inv_l[r], hi1, lo1);
        const int64_t at = static_cast<int64_t>(query) * d_model + col;
        *reinterpret_cast<__half2*>(out_hi + at) = __halves2half2(hi0, hi1);
        *reinterpret_cast<__half2*>(out_lo + at) = __halves2half2(lo0, lo1);
      }
    }
  }
}

template <int HP, int MF, int WARPS, int BN, bool EXACT>
LaunchResult launch_flash(const AttentionParams& p, cudaStream_t stream, const char* name) {
  using C = FlashCfg<HP, MF, WARPS, BN>;
  if (EXACT ? p.head_pad != HP : p.head_pad > HP) return {cudaErrorInvalidValue, name};
  if (C::kBytes > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(
        flash_attention_kernel<HP, MF, WARPS, BN, EXACT>,
        cudaFuncAttributeMaxDynamicSharedMemorySize, C::kBytes);
    if (err != cudaSuccess) return {err, name};
  }
  const int64_t q_blocks = (static_cast<int64_t>(p.seq_len) + C::kBlockM - 1) / C::kBlockM;
  const int64_t heads = static_cast<int64_t>(p.batch) * p.heads;
  const int64_t max_x = 0x7fffffff;
  const int64_t per_row = std::min<int64_t>(heads, max_x / q_blocks);   // heads per grid row
  const int64_t rows = (heads + per_row - 1) / per_row;
  if (rows > 65535) return {cudaErrorInvalidConfiguration, name};
  const dim3 grid(static_cast<unsigned>(per_row * q_blocks), static_cast<unsigned>(rows));
  return {launch_kernel(flash_attention_kernel<HP, MF, WARPS, BN, EXACT>, grid,
                        dim3(C::kThreads), C::kBytes, stream, p, static_cast<int>(q_blocks)),
          name};
}

struct FlashInstance {
  const char* name;
  int head_pad, block_m, block_n, threads, bytes;
  LaunchResult (*launch)(const AttentionParams&, cudaStream_t, const char*);
};

// Each instance in two kernels: head_pad == HP (exact), and head_pad < HP (head-dim fragments
// past head_pad skipped at run time).
struct FlashPair {
  FlashInstance exact, padded;
};

#define LBW_FLASH_ONE(HP, MF, W, BN, EXACT, TAG)                                              \
  FlashInstance {                                                                           \
    "flash_attention_kernel<" #HP ", " #MF ", " #W ", " #BN ", " TAG ">", HP, W * MF * 16, BN, \
        W * 32, FlashCfg<HP, MF, W, BN>::kBytes, &launch_flash<HP, MF, W, BN, EXACT>         \
  }
#define LBW_FLASH(HP, MF, W, BN)                                        \
  FlashPair {                                                           \
    LBW_FLASH_ONE(HP, MF, W, BN, true, "true"),                         \
        LBW_FLASH_ONE(HP, MF, W, BN, false, "false")                    \
  }

// Variants (rows) by head_pad instance (columns 32, 64, 128, 256; a call takes the smallest
// that holds its head_pad). flash: 128 query rows, 4 warps of 32 rows up to head_pad 64 (each
// K/V fragment serves two row fragments), 8 warps of 16 rows above (the context fragments of
// 32 rows would not fit in registers). flash_w8: 8 warps of 16 rows throughout. flash_m64: 64
// rows, 4 warps of 16 (twice the CTAs, for grids smaller than the device; also chosen at
// head_pad 32, and above 128 where two of its blocks fit one SM).
constexpr const char* kVariantNames[] = {"flash", "flash_w8", "flash_m64"};
constexpr int kVariants = 3;
constexpr int kHeadPads[] = {32, 64, 128, 256};

const FlashPair kInstances[kVariants][4] = {
    {LBW_FLASH(32, 2, 4, 64), LBW_FLASH(64, 2, 4, 64), LBW_FLASH(128, 1, 8, 64),
     LBW_FLASH(256, 1, 8, 32)},
    {LBW_FLASH(32, 1, 8, 64), LBW_FLASH(64, 1, 8, 64), LBW_FLASH(128, 1, 8, 64),
     LBW_FLASH(256, 1, 8, 32)},
    {LBW_FLASH(32, 1, 4, 64), LBW_FLASH(64, 1, 4, 64), LBW_FLASH(128, 1, 4, 64),
     LBW_FLASH(256, 1, 4, 32)},
};
#undef LBW_FLASH
#undef LBW_FLASH_ONE

const FlashInstance* find_instance(int variant, int head_pad) {
  if (variant < 0 || variant >= kVariants || head_pad <= 0) return nullptr;
  for (int i = 0; i < 4; ++i) {
    if (head_pad == kHeadPads[i]) return &kInstances[variant][i].exact;
    if (head_pad < kHeadPads[i]) return &kInstances[variant][i].padded;
  }
  return nullptr;
}

// One warp: mismatches[0] accumulator elements loaded by load_matrix_sync against the layout,
// [1] matrix_a elements (i and i + 8), [2] a matrix_a built element by element from the
// layout, multiplied by the identity, read back through the accumulator layout, [3] an
// accumulator built from the layout and stored by store_matrix_sync.
__global__ void attention_layout_probe_kernel(int* mismatches) {
  __shared__ __align__(128) float f_s[256];
  __shared__ __align__(128) float out_s[256];
  __shared__ __align__(128) __half h_s[256];
  __shared__ __align__(128) __half eye_s[256];
  const int lane = threadIdx.x;
  for (int e = lane; e < 256; e += 32) {
    f_s[e] = static_cast<float>(e);
    out_s[e] = -1.f;
    h_s[e] = __int2half_rn(e);
    eye_s[e] = __int2half_rn(e / 16 == e % 16 ? 1 : 0);
  }
  __syncwarp();
  int bad[4] = {0, 0, 0, 0};
  AccFrag acc;
  wmma::load_matrix_sync(acc, f_s, 16, wmma::mem_row_major);
  for (int i = 0; i < 8; ++i) {
    bad[0] += acc.x[i] != static_cast<float>(16 * frag_row(lane, i) + frag_col(lane, i));
  }
  AFrag a;
  wmma::load_matrix_sync(a, h_s, 16);
  for (int i = 0; i < 16; ++i) {
    const int e = 16 * frag_row(lane, i % 8) + frag_col(lane, i % 8);
    bad[1] += __half2float(a.x[i]) != static_cast<float>(e);
  }
  AFrag built;
  for (int i = 0; i < 8; ++i) {
    const int e = 255 - (16 * frag_row(lane, i) + frag_col(lane, i));
    built.x[i] = built.x[i + 8] = __int2half_rn(e);
  }
  VFrag eye;
  wmma::load_matrix_sync(eye, eye_s, 16);
  AccFrag prod;
  wmma::fill_fragment(prod, 0.f);
  wmma::mma_sync(prod, built, eye, prod);
  for (int i = 0; i < 8; ++i) {
    const int e = 255 - (16 * frag_row(lane, i) + frag_col(lane, i));
    bad[2] += prod.x[i] != static_cast<float>(e);
  }
  AccFrag made;
  for (int i = 0; i < 8; ++i) {
    made.x[i] = static_cast<float>(16 * frag_row(lane, i) + frag_col(lane, i));
  }
  wmma::store_matrix_sync(out_s, made, 16, wmma::mem_row_major);
  __syncwarp();
  for (int e = lane; e < 256; e += 32) bad[3] += out_s[e] != static_cast<float>(e);
  for (int c = 0; c < 4; ++c) {
    const int total = static_cast<int>(warp_sum(static_cast<float>(bad[c])));
    if (lane == 0) mismatches[c] = total;
  }
}

}  // namespace

LaunchResult launch_attention(const AttentionParams& p, int block_n, cudaStream_t stream) {
  if (block_n == 64) return launch<64>(p, stream, "attention_kernel<64>");
  if (block_n == 32) return launch<32>(p, stream, "attention_kernel<32>");
  return {cudaErrorInvalidValue, "attention_kernel (unsupported key block)"};
}

int attention_smem_bytes(int head_pad, int block_n) { return layout(head_pad, block_n).bytes; }

int attention_variant_count() { return kVariants; }

const char* attention_variant_name(int variant) {
  return variant >= 0 && variant < kVariants ? kVariantNames[variant] : nullptr;
}

AttentionInstanceInfo attention_instance(int variant, int head_pad) {
  const FlashInstance* f = find_instance(variant, head_pad);
  if (f == nullptr) return {nullptr, 0, 0, 0, 0, 0};
  return {f->name, f->head_pad, f->block_m, f->block_n, f->threads, f->bytes};
}

LaunchResult launch_flash_attention(const AttentionParams& p, int variant,
                                    cudaStream_t stream) {
  const FlashInstance* f = find_instance(variant, p.head_pad);
  if (f == nullptr) return {cudaErrorInvalidValue, "flash_attention_kernel (no such variant)"};
  return f->launch(p, stream, f->name);
}

LaunchResult launch_attention_layout_probe(int* mismatches, cudaStream_t stream) {
  attention_layout_probe_kernel<<<1, 32, 0, stream>>>(mismatches);
  return {cudaGetLastError(), "attention_layout_probe_kernel"};
}

}  // namespace lbw
