// The linear layers: out = epilogue(a @ w^T + bias) on the tensor cores through nvcuda::wmma.
//
// fp16 operands, fp32 accumulators. The activations and weights arrive as fp16 (hi, lo)
// parts; per 16-deep k step and output fragment, three products accumulate lo*hi + hi*lo +
// hi*hi (fp16x3: about fp32 accuracy), two products a_lo*w_hi + a_hi*w_hi (the weight's hi
// part only), one product hi*hi. Two kernels:
//
// - linear_tiled (any K): one BM x BN output tile per CTA (the persistent form: CTAs take
//   tiles in turn, each loading the next tile's first stages under the current one's
//   epilogue); operand tiles BK deep stream through STAGES shared-memory stages filled by
//   16-byte cp.async, one barrier per K step (wait, barrier, refill the stage read last step,
//   compute); the pipelined variant (one product) loads the next k slice's fragments under
//   the current slice's products. Each thread's first copy row and its count of rows in range
//   are computed once a tile; out-of-range rows and the K tail are zero-filled.
// - linear_stream (K <= 128): a persistent CTA keeps a BN-column slice of the weight (whole K)
//   in shared memory and streams BM-row activation tiles through a ring of STAGES tiles, so
//   the next tiles load while the current one is multiplied and written out. RESIDENT_B
//   (one or two products): each warp also keeps its weight fragments (hi part, whole K) in
//   registers, so that per k step only the activation fragments come from shared memory.
//
// Epilogue (both): each warp stores one 16x16 accumulator fragment at a time to its own
// shared scratch; each lane then owns 8 consecutive columns of one row: bias (loaded once
// per column; the stream kernel keeps it in registers across tiles), GELU, residual and
// invalid-row zeroing, with 16-byte loads and stores where the columns are inside N and
// the rows 16-byte aligned (element by element otherwise). linear_stream handles a warp's
// fragments of one row block together, so their residual loads are in flight at once.
// Per accumulator element the arithmetic is the same as element by element: v = acc + bias,
// then the epilogue; a variant whose shared memory exceeds the device's limit runs as the
// Fallback variant (launch_tile).
//
// Norm epilogue (linear_stream, residual epilogues, N <= BN: the CTA holds whole rows): the
// fp32 rows the residual epilogue writes are also LayerNormed (LinearNormParams, a separate
// kernel argument). Each warp keeps its rows' values in registers; each warp's part of a row
// goes through the warps' scratch as its sum and its squared deviations from its own mean
// (one barrier), combined into the row's mean and variance (an identity exact in exact
// arithmetic), then y = (x - mean) * rstd * w + b is written as an fp16 (hi, lo) pair, hi
// only, or the output type with invalid rows zeroed (norm_out). Such a variant never falls
// back.
//
// Each of linear.cu, linear_two_products.cu and linear_three_products.cu instantiates the
// kernels of one product count (so the three compile in parallel); launch_linear in
// linear.cu dispatches to the other two.
#pragma once

#include <mma.h>

#include <algorithm>
#include <type_traits>

#include "common.cuh"

namespace lbw {
namespace {

using namespace nvcuda;

using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major>;
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

constexpr int kScratchLd = 20;                     // floats per row of a warp's 16x16 scratch
constexpr int kScratchBytes = 16 * kScratchLd * 4;  // 1280: a multiple of 32 (wmma alignment)

// The fragment row (lane % 16) and first of the 8 columns ((lane / 16) * 8) whose values a
// lane reads back from the scratch: lanes l and l + 16 share a row. A quarter warp's 16-byte
// reads then cover 8 rows at 20-float strides, 8 distinct bank groups (with lane / 2 and
// (lane % 2) * 8, two pairs of its reads shared a group).
__device__ __forceinline__ int value_row(int lane) { return lane % 16; }
__device__ __forceinline__ int value_col(int lane) { return (lane / 16) * 8; }
constexpr int kRowPartner = 16;  // lane ^ kRowPartner holds the other half of a lane's row
constexpr int kStreamMaxK = 128;                   // linear_stream keeps K whole in one stage

// Operand parts held in shared memory: activations hi (+ lo from two products on), weight hi
// (+ lo with three).
template <int PRODUCTS>
struct Parts {
  static_assert(PRODUCTS >= 1 && PRODUCTS <= 3, "one, two or three products");
  static constexpr int kA = PRODUCTS >= 2 ? 2 : 1;
  static constexpr int kW = PRODUCTS == 3 ? 2 : 1;
};

// acc[i][j] += the products of one 16-deep k step with the weight fragments b_hi (and b_lo,
// read with three products) already loaded: a points at the warp's first activation row (hi
// part; the lo part a_part halves further). Per accumulator the order is always lo*hi,
// hi*lo, hi*hi (the products present); the loops put the other fragments between two
// products into the same accumulator.
template <int FM, int FN, int PRODUCTS>
__device__ __forceinline__ void mma_rows(FragC (&acc)[FM][FN], const __half* a, int a_part,
                                         int lda, const FragB (&b_hi)[FN],
                                         const FragB (&b_lo)[FN]) {
#pragma unroll
  for (int i = 0; i < FM; ++i) {
    FragA a_hi, a_lo;
    wmma::load_matrix_sync(a_hi, a + i * 16 * lda, lda);
    if constexpr (PRODUCTS >= 2) {
      wmma::load_matrix_sync(a_lo, a + a_part + i * 16 * lda, lda);
#pragma unroll
      for (int j = 0; j < FN; ++j) wmma::mma_sync(acc[i][j], a_lo, b_hi[j], acc[i][j]);
    }
    if constexpr (PRODUCTS == 3) {
#pragma unroll
      for (int j = 0; j < FN; ++j) wmma::mma_sync(acc[i][j], a_hi, b_lo[j], acc[i][j]);
    }
#pragma unroll
    for (int j = 0; j < FN; ++j) wmma::mma_sync(acc[i][j], a_hi, b_hi[j], acc[i][j]);
  }
}

// mma_rows after loading the k step's weight fragments: w points at the warp's first weight
// row (lo part w_part halves further).
template <int FM, int FN, int PRODUCTS>
__device__ __forceinline__ void mma_step(FragC (&acc)[FM][FN], const __half* a, int a_part,
                                         int lda, const __half* w, int w_part, int ldw) {
  FragB b_hi[FN], b_lo[FN];
#pragma unroll
  for (int j = 0; j < FN; ++j) {
    wmma::load_matrix_sync(b_hi[j], w + j * 16 * ldw, ldw);
    if constexpr (PRODUCTS == 3) wmma::load_matrix_sync(b_lo[j], w + w_part + j * 16 * ldw, ldw);
  }
  mma_rows<FM, FN, PRODUCTS>(acc, a, a_part, lda, b_hi, b_lo);
}

// One 16-deep k slice of a warp's operand fragments, all held at once (the pipelined
// tiled loop loads the next slice's set while the current one is multiplied).
template <int FM, int FN, int PRODUCTS>
struct FragSet {
  FragA a_hi[FM], a_lo[PRODUCTS >= 2 ? FM : 1];
  FragB b_hi[FN], b_lo[PRODUCTS == 3 ? FN : 1];
};

// f = the fragments of one k slice (arguments as mma_step's).
template <int FM, int FN, int PRODUCTS>
__device__ __forceinline__ void load_frag_set(FragSet<FM, FN, PRODUCTS>& f, const __half* a,
                                              int a_part, int lda, const __half* w, int w_part,
                                              int ldw) {
#pragma unroll
  for (int j = 0; j < FN; ++j) {
    wmma::load_matrix_sync(f.b_hi[j], w + j * 16 * ldw, ldw);
    if constexpr (PRODUCTS == 3) wmma::load_matrix_sync(f.b_lo[j], w + w_part + j * 16 * ldw, ldw);
  }
#pragma unroll
  for (int i = 0; i < FM; ++i) {
    wmma::load_matrix_sync(f.a_hi[i], a + i * 16 * lda, lda);
    if constexpr (PRODUCTS >= 2) wmma::load_matrix_sync(f.a_lo[i], a + a_part + i * 16 * lda, lda);
  }
}

// acc[i][j] += the products of one loaded k slice, in mma_step's order per accumulator.
template <int FM, int FN, int PRODUCTS>
__device__ __forceinline__ void mma_frag_set(FragC (&acc)[FM][FN],
                                             const FragSet<FM, FN, PRODUCTS>& f) {
#pragma unroll
  for (int i = 0; i < FM; ++i) {
    if constexpr (PRODUCTS >= 2) {
#pragma unroll
      for (int j = 0; j < FN; ++j) wmma::mma_sync(acc[i][j], f.a_lo[i], f.b_hi[j], acc[i][j]);
    }
    if constexpr (PRODUCTS == 3) {
#pragma unroll
      for (int j = 0; j < FN; ++j) wmma::mma_sync(acc[i][j], f.a_hi[i], f.b_lo[j], acc[i][j]);
    }
#pragma unroll
    for (int j = 0; j < FN; ++j) wmma::mma_sync(acc[i][j], f.a_hi[i], f.b_hi[j], acc[i][j]);
  }
}

// Whether the epilogue may use 16-byte accesses: every output row starts 16-byte aligned.
__device__ __forceinline__ bool vector_epilogue(const LinearParams& p) {
  const uintptr_t bits = reinterpret_cast<uintptr_t>(p.out_hi) |
                         reinterpret_cast<uintptr_t>(p.out_lo) |
                         reinterpret_cast<uintptr_t>(p.out_f32) |
                         reinterpret_cast<uintptr_t>(p.residual);
  return p.N % 8 == 0 && (bits & 15) == 0;
}

// The bias of this lane's 8 columns [col, col + 8) (0 past N).
__device__ __forceinline__ void load_bias(const LinearParams& p, int col, float (&bias)[8]) {
#pragma unroll
  for (int e = 0; e < 8; ++e) bias[e] = col + e < p.N ? p.bias[col + e] : 0.f;
}

__device__ __forceinline__ uint4 pack_halves(const __half (&h)[8]) {
  uint4 u;
  u.x = static_cast<unsigned>(__half_as_ushort(h[0])) |
        static_cast<unsigned>(__half_as_ushort(h[1])) << 16;
  u.y = static_cast<unsigned>(__half_as_ushort(h[2])) |
        static_cast<unsigned>(__half_as_ushort(h[3])) << 16;
  u.z = static_cast<unsigned>(__half_as_ushort(h[4])) |
        static_cast<unsigned>(__half_as_ushort(h[5])) << 16;
  u.w = static_cast<unsigned>(__half_as_ushort(h[6])) |
        static_cast<unsigned>(__half_as_ushort(h[7])) << 16;
  return u;
}

// The residual of this lane's FN groups of 8 columns of one row (group j at column col + 16 j,
// element index idx + 16 j): two 16-byte loads a group where vec holds and the group is inside
// N, else element by element (0 past N).
template <int FN>
__device__ __forceinline__ void load_residual(const LinearParams& p, int64_t idx, int col,
                                              bool vec, float (&res)[FN][8]) {
#pragma unroll
  for (int j = 0; j < FN; ++j) {
    const int cj = col + 16 * j;
    const int64_t at = idx + 16 * j;
    if (vec && cj + 8 <= p.N) {
      const float4 r0 = *reinterpret_cast<const float4*>(p.residual + at);
      const float4 r1 = *reinterpret_cast<const float4*>(p.residual + at + 4);
      res[j][0] = r0.x, res[j][1] = r0.y, res[j][2] = r0.z, res[j][3] = r0.w;
      res[j][4] = r1.x, res[j][5] = r1.y, res[j][6] = r1.z, res[j][7] = r1.w;
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) res[j][e] = cj + e < p.N ? p.residual[at + e] : 0.f;
    }
  }
}

// The norm epilogue's residual step (store_row's residual epilogues, same arithmetic) for
// this lane's part of one output row (FN groups of 8 columns, group j at col + 16 j; values v
// = accumulator + bias): o = residual + (valid ? v : 0) (update) or valid ? residual + v : 0
// (sum), written to out_f32 unless it is null; o is 0 past N. Every group's residual is read
// before any is written (out may alias residual).
template <int FN>
__device__ __forceinline__ void residual_row(const LinearParams& p, int64_t row, int col,
                                             const float (&v)[FN][8], bool vec, bool update,
                                             float (&o)[FN][8]) {
  const int64_t idx = row * p.N + col;
  const bool valid = p.valid == nullptr || p.valid[row] != 0;
  float res[FN][8];
  load_residual<FN>(p, idx, col, vec, res);
#pragma unroll
  for (int j = 0; j < FN; ++j) {
    const int cj = col + 16 * j;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      if (update) {
        o[j][e] = res[j][e] + (valid ? v[j][e] : 0.f);
      } else {
        o[j][e] = valid ? res[j][e] + v[j][e] : 0.f;
      }
      if (cj + e >= p.N) o[j][e] = 0.f;
    }
    if (cj >= p.N || p.out_f32 == nullptr) continue;
    const int64_t at = idx + 16 * j;
    if (vec && cj + 8 <= p.N) {
      *reinterpret_cast<float4*>(p.out_f32 + at) =
          make_float4(o[j][0], o[j][1], o[j][2], o[j][3]);
      *reinterpret_cast<float4*>(p.out_f32 + at + 4) =
          make_float4(o[j][4], o[j][5], o[j][6], o[j][7]);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e)
        if (cj + e < p.N) p.out_f32[at + e] = o[j][e];
    }
  }
}

// This lane's part of one output row: FN groups of 8 columns, group j at col + 16 j, with
// values v = accumulator + bias. 16-byte accesses where vec holds and the group is inside N;
// element by element (guarded by N) otherwise. The residual epilogues read every group's
// residual before writing any (out may alias residual; the groups are disjoint).
template <int EPILOGUE, int FN>
__device__ __forceinline__ void store_row(const LinearParams& p, int64_t row, int col,
                                          const float (&v)[FN][8], bool vec) {
  const int64_t idx = row * p.N + col;
  if constexpr (EPILOGUE == static_cast<int>(Epilogue::kHalf) ||
                EPILOGUE == static_cast<int>(Epilogue::kGeluPair)) {
    constexpr bool kGelu = EPILOGUE == static_cast<int>(Epilogue::kGeluPair);
#pragma unroll
    for (int j = 0; j < FN; ++j) {
      const int cj = col + 16 * j;
      if (cj >= p.N) break;
      __half hi[8], lo[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        if constexpr (kGelu) {
          split_half(gelu(v[j][e]), hi[e], lo[e]);
        } else {
          hi[e] = __float2half_rn(v[j][e]);
        }
      }
      const int64_t at = idx + 16 * j;
      if (vec && cj + 8 <= p.N) {
        *reinterpret_cast<uint4*>(p.out_hi + at) = pack_halves(hi);
        if constexpr (kGelu) *reinterpret_cast<uint4*>(p.out_lo + at) = pack_halves(lo);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          if (cj + e < p.N) {
            p.out_hi[at + e] = hi[e];
            if constexpr (kGelu) p.out_lo[at + e] = lo[e];
          }
        }
      }
    }
  } else {
    const bool valid = p.valid == nullptr || p.valid[row] != 0;
    float res[FN][8];
    load_residual<FN>(p, idx, col, vec, res);
#pragma unroll
    for (int j = 0; j < FN; ++j) {
      const int cj = col + 16 * j;
      if (cj >= p.N) break;
      const int64_t at = idx + 16 * j;
      float o[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        if constexpr (EPILOGUE == static_cast<int>(Epilogue::kResidualUpdate)) {
          o[e] = res[j][e] + (valid ? v[j][e] : 0.f);
        } else {
          o[e] = valid ? res[j][e] + v[j][e] : 0.f;
        }
      }
      if (vec && cj + 8 <= p.N) {
        *reinterpret_cast<float4*>(p.out_f32 + at) = make_float4(o[0], o[1], o[2], o[3]);
        *reinterpret_cast<float4*>(p.out_f32 + at + 4) = make_float4(o[4], o[5], o[6], o[7]);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e)
          if (cj + e < p.N) p.out_f32[at + e] = o[e];
      }
    }
  }
}

// This lane's values of FN accumulator fragments side by side, the first at output column
// col0, read one at a time through the warp's scratch (16 x kScratchLd floats): lane l owns
// fragment row value_row(l) and in each fragment j the 8 columns col0 + 16 j + value_col(l)
// + [0, 8), v[j] = accumulator + bias[j]. Fragments that start past N give 0 (warp-uniform).
template <int FN>
__device__ __forceinline__ void fragment_values(const LinearParams& p, float* scratch,
                                                const FragC (&acc)[FN], int col0,
                                                const float (&bias)[FN][8], float (&v)[FN][8]) {
  const int lane = threadIdx.x % 32;
  const int r = value_row(lane), c = value_col(lane);
#pragma unroll
  for (int j = 0; j < FN; ++j) {
    if (col0 + 16 * j >= p.N) {
#pragma unroll
      for (int e = 0; e < 8; ++e) v[j][e] = 0.f;
      continue;
    }
    wmma::store_matrix_sync(scratch, acc[j], kScratchLd, wmma::mem_row_major);
    __syncwarp();
    const float4 x0 = *reinterpret_cast<const float4*>(scratch + r * kScratchLd + c);
    const float4 x1 = *reinterpret_cast<const float4*>(scratch + r * kScratchLd + c + 4);
    __syncwarp();  // the scratch is free for the next fragment
    v[j][0] = x0.x + bias[j][0], v[j][1] = x0.y + bias[j][1];
    v[j][2] = x0.z + bias[j][2], v[j][3] = x0.w + bias[j][3];
    v[j][4] = x1.x + bias[j][4], v[j][5] = x1.y + bias[j][5];
    v[j][6] = x1.z + bias[j][6], v[j][7] = x1.w + bias[j][7];
  }
}

// The warp writes FN accumulator fragments side by side, the first at (row0, col0) of the
// output (fragment_values: lane l writes row row0 + value_row(l)). The caller skips rows of
// fragments that start past M.
template <int FN>
__device__ __forceinline__ void store_fragments(const LinearParams& p, int epilogue, bool vec,
                                                float* scratch, const FragC (&acc)[FN],
                                                int64_t row0, int col0,
                                                const float (&bias)[FN][8]) {
  const int lane = threadIdx.x % 32;
  const int r = value_row(lane), c = value_col(lane);
  float v[FN][8];
  fragment_values<FN>(p, scratch, acc, col0, bias, v);
  const int64_t row = row0 + r;
  if (row >= p.M) return;
  const int col = col0 + c;
  switch (static_cast<Epilogue>(epilogue)) {
    case Epilogue::kHalf:
      store_row<static_cast<int>(Epilogue::kHalf), FN>(p, row, col, v, vec);
      break;
    case Epilogue::kGeluPair:
      store_row<static_cast<int>(Epilogue::kGeluPair), FN>(p, row, col, v, vec);
      break;
    case Epilogue::kResidualUpdate:
      store_row<static_cast<int>(Epilogue::kResidualUpdate), FN>(p, row, col, v, vec);
      break;
    case Epilogue::kResidualSum:
      store_row<static_cast<int>(Epilogue::kResidualSum), FN>(p, row, col, v, vec);
      break;
  }
}

// The norm epilogue's output of this lane's 8 columns [cj, cj + 8) at element index at:
// y in q.out_type (fp16: the hi part, and the lo part where q.lo is given). 16-byte stores
// where vec holds (and q's outputs are 16-byte aligned) and the group is inside N; element
// by element (guarded by N) otherwise.
__device__ __forceinline__ void store_norm(const LinearParams& p, const LinearNormParams& q,
                                           int64_t at, int cj, const float (&y)[8], bool vec) {
  const bool full = vec && cj + 8 <= p.N;
  if (q.out_type == DType::kFloat32) {
    float* out = static_cast<float*>(q.out) + at;
    if (full) {
      *reinterpret_cast<float4*>(out) = make_float4(y[0], y[1], y[2], y[3]);
      *reinterpret_cast<float4*>(out + 4) = make_float4(y[4], y[5], y[6], y[7]);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e)
        if (cj + e < p.N) out[e] = y[e];
    }
  } else if (q.out_type == DType::kBFloat16) {
    __nv_bfloat16* out = static_cast<__nv_bfloat16*>(q.out) + at;
    __nv_bfloat16 b[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) b[e] = __float2bfloat16_rn(y[e]);
    if (full) {
      uint4 u;
      u.x = static_cast<unsigned>(__bfloat16_as_ushort(b[0])) |
            static_cast<unsigned>(__bfloat16_as_ushort(b[1])) << 16;
      u.y = static_cast<unsigned>(__bfloat16_as_ushort(b[2])) |
            static_cast<unsigned>(__bfloat16_as_ushort(b[3])) << 16;
      u.z = static_cast<unsigned>(__bfloat16_as_ushort(b[4])) |
            static_cast<unsigned>(__bfloat16_as_ushort(b[5])) << 16;
      u.w = static_cast<unsigned>(__bfloat16_as_ushort(b[6])) |
            static_cast<unsigned>(__bfloat16_as_ushort(b[7])) << 16;
      *reinterpret_cast<uint4*>(out) = u;
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e)
        if (cj + e < p.N) out[e] = b[e];
    }
  } else {
    __half* out = static_cast<__half*>(q.out) + at;
    __half hi[8], lo[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) split_half(y[e], hi[e], lo[e]);
    if (full) {
      *reinterpret_cast<uint4*>(out) = pack_halves(hi);
      if (q.lo) *reinterpret_cast<uint4*>(q.lo + at) = pack_halves(lo);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        if (cj + e < p.N) {
          out[e] = hi[e];
          if (q.lo) q.lo[at + e] = lo[e];
        }
      }
    }
  }
}

// The norm epilogue of one tile (see the top): the warp's FM x FN fragments, fragment (i, j)
// at output row row0 + 16 i and column col0 + 16 j, one fragment row i at a time (o for all
// of them at once makes ptxas spill); every warp of the CTA calls it (one __syncthreads per
// fragment row). A row's columns start at 0 (N <= BN: the CTA's one column slice); warp n of
// the WARPS_N that share it holds columns [16 FN n, 16 FN (n + 1)). Each warp's part of a
// row goes out as its sum and its squared deviations from its own mean (both over its
// columns inside N), to the padding columns of the warps' scratch, which store_matrix_sync
// never writes (row r, column 16 + slot: sums in slot i, squares in slot FM + i; where FM > 2
// leaves too few columns, fragment row i's sums in slot 2 (i % 2) and its squares in the
// next), so the next fragment may be stored while other warps still read them; peers is the
// scratch of the first of the WARPS_N warps that share these rows (consecutive warps). A slot
// is rewritten in the next tile, after the caller's barrier, or (FM > 2) two fragment rows
// later, past the next fragment row's barrier, which every warp reaches after its last read.
// update: kResidualUpdate (else kResidualSum).
template <int FM, int FN, int WARPS_N>
__device__ __forceinline__ void norm_epilogue(const LinearParams& p, const LinearNormParams& q,
                                              bool update, bool vec, float* scratch,
                                              const float* peers, const FragC (&acc)[FM][FN],
                                              int64_t row0, int col0) {
  static_assert(kScratchLd - 16 >= 4, "four padding columns: two fragment rows' partials");
  constexpr bool kRing = 2 * FM > kScratchLd - 16;  // else one slot per partial of the tile
  constexpr int kPeerStride = kScratchBytes / 4;  // floats from one warp's scratch to the next
  const int lane = threadIdx.x % 32;
  const int r = value_row(lane);
  const int col = col0 + value_col(lane);
  const int slot = r * kScratchLd + 16;  // this lane's row's first padding column
  const bool vec_out = vec && ((reinterpret_cast<uintptr_t>(q.out) |
                                reinterpret_cast<uintptr_t>(q.lo)) & 15) == 0;
#pragma unroll
  for (int i = 0; i < FM; ++i) {
    const int64_t row = row0 + 16 * i + r;
    float o[FN][8];  // the fp32 row (0 past N and M)
    {
      float bias[FN][8];  // loaded here: registers are short across the tile loop
#pragma unroll
      for (int j = 0; j < FN; ++j) load_bias(p, col + 16 * j, bias[j]);
      float v[FN][8];
      fragment_values<FN>(p, scratch, acc[i], col0, bias, v);
      if (row < p.M) {
        residual_row<FN>(p, row, col, v, vec, update, o);
      } else {
#pragma unroll
        for (int j = 0; j < FN; ++j)
#pragma unroll
          for (int e = 0; e < 8; ++e) o[j][e] = 0.f;
      }
    }

    // This warp's part of the row (the two lanes that hold it): its sum and its squared
    // deviations from its own mean over its columns inside N (o is 0 past N).
    constexpr int kPartCols = 16 * FN;
    auto part_cols = [&](int n) { return min(max(p.N - kPartCols * n, 0), kPartCols); };
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < FN; ++j)
#pragma unroll
      for (int e = 0; e < 8; ++e) sum += o[j][e];
    sum += __shfl_xor_sync(kFullMask, sum, kRowPartner);
    const int mine = part_cols(col0 / kPartCols);  // col0 = 16 FN n: this warp is part n
    const float part_mean = mine > 0 ? sum / mine : 0.f;
    float sq = 0.f;
#pragma unroll
    for (int j = 0; j < FN; ++j) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float d = o[j][e] - part_mean;
        if (col + 16 * j + e < p.N) sq += d * d;
      }
    }
    sq += __shfl_xor_sync(kFullMask, sq, kRowPartner);
    const int sums = kRing ? slot + 2 * (i % 2) : slot + i;
    const int squares = kRing ? sums + 1 : slot + FM + i;
    if (lane < kRowPartner) {
      scratch[sums] = sum;
      scratch[squares] = sq;
    }
    __syncthreads();

    // The parts combined (Chan, Golub and LeVeque): mean = sum / N; squared deviations =
    // sum over parts of (theirs + cols (part mean - mean)^2) -> 1 / std.
    float part_sum[WARPS_N];
    sum = 0.f;
#pragma unroll
    for (int n = 0; n < WARPS_N; ++n) {
      part_sum[n] = peers[n * kPeerStride + sums];
      sum += part_sum[n];
    }
    const float mean = sum / p.N;
    sq = 0.f;
#pragma unroll
    for (int n = 0; n < WARPS_N; ++n) {
      const int cols = part_cols(n);
      if (cols == 0) continue;
      const float d = part_sum[n] / cols - mean;
      sq += peers[n * kPeerStride + squares] + cols * d * d;
    }
    const float rstd = 1.f / sqrtf(sq / p.N + q.eps);

    // y = (x - mean) * rstd * w + b, as norm_split and norm_out compute it.
    if (row < p.M) {
      const bool zero = q.zero_invalid && p.valid != nullptr && p.valid[row] == 0;
#pragma unroll
      for (int j = 0; j < FN; ++j) {
        const int cj = col + 16 * j;
        if (cj >= p.N) break;
        float y[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float w = cj + e < p.N ? q.weight[cj + e] : 0.f;
          const float b = cj + e < p.N ? q.bias[cj + e] : 0.f;
          y[e] = zero ? 0.f : (o[j][e] - mean) * rstd * w + b;
        }
        store_norm(p, q, row * p.N + cj, cj, y, vec_out);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// linear_tiled

template <int BM, int BN, int WARPS_M, int WARPS_N, int BK, int STAGES, int PRODUCTS>
struct Tiled {
  static constexpr int kThreads = WARPS_M * WARPS_N * 32;
  static constexpr int kFragsM = BM / WARPS_M / 16;   // 16x16 fragments per warp
  static constexpr int kFragsN = BN / WARPS_N / 16;
  static constexpr int kLds = BK + 8;                 // shared row stride (halves): no conflicts
  static constexpr int kAParts = Parts<PRODUCTS>::kA;
  static constexpr int kWParts = Parts<PRODUCTS>::kW;
  // Stage layout: a_hi [BM][kLds], (a_lo), w_hi [BN][kLds], (w_lo).
  static constexpr int kStageHalves = (kAParts * BM + kWParts * BN) * kLds;
  static constexpr int kChunks = BK / 8;              // 16-byte vectors per operand row
  static constexpr int kRowsPerPass = kThreads / kChunks;
  static constexpr int kAVecs = BM / kRowsPerPass;    // per thread and part
  static constexpr int kWVecs = BN / kRowsPerPass;
  static constexpr int kOperandBytes = STAGES * kStageHalves * 2;
  static constexpr int kScratch = WARPS_M * WARPS_N * kScratchBytes;
  static constexpr int kSmemBytes = kOperandBytes > kScratch ? kOperandBytes : kScratch;
  // The persistent form's scratch: the last stage, which the next tile's first loads leave
  // free during the epilogue.
  static constexpr int kPersistentScratch = (STAGES - 1) * kStageHalves * 2;
  static_assert(STAGES >= 2, "at least two stages");
  static_assert(kScratch <= kStageHalves * 2, "the scratch fits one stage");
  static_assert(BK % 16 == 0 && kThreads % kChunks == 0, "copy geometry");
  static_assert(BM % kRowsPerPass == 0 && BN % kRowsPerPass == 0, "copy geometry");
  static_assert(kFragsM * WARPS_M * 16 == BM && kFragsN * WARPS_N * 16 == BN, "warp tiles");
};

// LinearParams; grid (M tiles, N tiles), or PERSISTENT: a 1-D grid whose CTA b takes tiles
// b, b + gridDim.x, ... (M tile fastest); block T::kThreads; dynamic shared T::kSmemBytes.
// PIPELINED (one product): each warp loads the next k slice's fragments while it multiplies
// the current one, across stage boundaries too (the wait and barrier come after the
// second-to-last slice's products are issued); else, and with two or three products (whose
// two fragment sets ptxas spills), each slice is loaded, then multiplied. PERSISTENT: the
// next tile's first STAGES - 1 stages are requested before this tile's epilogue, which uses
// the last stage as its scratch, so the loads land while the epilogue runs.
template <int BM, int BN, int WARPS_M, int WARPS_N, int BK, int STAGES, int PRODUCTS, int MINB,
          bool PIPELINED, bool PERSISTENT>
__global__ void __launch_bounds__(WARPS_M * WARPS_N * 32, MINB)
linear_tiled(LinearParams p, int epilogue) {
  using T = Tiled<BM, BN, WARPS_M, WARPS_N, BK, STAGES, PRODUCTS>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __half* smem = reinterpret_cast<__half*>(smem_raw);

  const int warp = threadIdx.x / 32;
  const int wm = warp / WARPS_N, wn = warp % WARPS_N;
  const int64_t m_tiles = (p.M + BM - 1) / BM;
  const int64_t tiles = PERSISTENT ? m_tiles * ((p.N + BN - 1) / BN) : 1;
  int64_t tile = PERSISTENT ? blockIdx.x : 0;

  // This thread copies column chunk c of rows r0 + q * kRowsPerPass.
  const int c = (threadIdx.x % T::kChunks) * 8;
  const int r0 = threadIdx.x / T::kChunks;
  // The tile's origin; its rows in range are a prefix of q: a_in of them (w_in for the
  // weight); a row out of range copies from the first row (in range or clamped) with 0 bytes.
  int64_t m0, a_first;
  int n0, a_in, w_first, w_in;
  auto set_tile = [&](int64_t t) {
    m0 = PERSISTENT ? t % m_tiles * BM : static_cast<int64_t>(blockIdx.x) * BM;
    n0 = PERSISTENT ? static_cast<int>(t / m_tiles) * BN : blockIdx.y * BN;
    a_first = m0 + r0 < p.M ? m0 + r0 : p.M - 1;
    const int64_t a_left = p.M - (m0 + r0);
    a_in = a_left <= 0 ? 0 : static_cast<int>((a_left - 1) / T::kRowsPerPass + 1);
    w_first = n0 + r0 < p.N ? n0 + r0 : p.N - 1;
    const int w_left = p.N - (n0 + r0);
    w_in = w_left <= 0 ? 0 : (w_left - 1) / T::kRowsPerPass + 1;
  };
  set_tile(tile);
  const int s_off = r0 * T::kLds + c;  // this thread's first shared vector in a part

  // This thread's column of the K tile at k0 (0 where it is past K, which k_in tells).
  auto k_column = [&](int k0, bool& k_in) {
    k_in = k0 + c < p.K;
    return k_in ? k0 + c : 0;
  };
  // A stage's rows (load_rows) and weights (load_weights) of the K tile at k0.
  auto load_rows = [&](int stage, int k0) {
    bool k_in;
    const int kk = k_column(k0, k_in);
    __half* st = smem + stage * T::kStageHalves + s_off;
#pragma unroll
    for (int q = 0; q < T::kAVecs; ++q) {
      const bool in = k_in && q < a_in;
      const int64_t off = (a_first + (in ? q * T::kRowsPerPass : 0)) * p.K + kk;
      const int bytes = in ? 16 : 0;
      __half* dst = st + q * T::kRowsPerPass * T::kLds;
      cp_async16(dst, p.a_hi + off, bytes);
      if constexpr (T::kAParts == 2) cp_async16(dst + BM * T::kLds, p.a_lo + off, bytes);
    }
  };
  auto load_weights = [&](int stage, int k0) {
    bool k_in;
    const int kk = k_column(k0, k_in);
    __half* st = smem + stage * T::kStageHalves + T::kAParts * BM * T::kLds + s_off;
#pragma unroll
    for (int q = 0; q < T::kWVecs; ++q) {
      const bool in = k_in && q < w_in;
      const int64_t off =
          static_cast<int64_t>(w_first + (in ? q * T::kRowsPerPass : 0)) * p.K + kk;
      const int bytes = in ? 16 : 0;
      __half* dst = st + q * T::kRowsPerPass * T::kLds;
      cp_async16(dst, p.w_hi + off, bytes);
      if constexpr (T::kWParts == 2) cp_async16(dst + BN * T::kLds, p.w_lo + off, bytes);
    }
  };
  auto load_stage = [&](int stage, int k0) {
    load_rows(stage, k0);
    load_weights(stage, k0);
  };

  // One commit group per K tile (empty past the end): at iteration kt, kt + STAGES - 1
  // groups are committed, and waiting until STAGES - 2 are pending means tile kt landed.
  // weights_requested: the first stages' weights are in flight already (in group 0, which
  // lands first), so each group takes the rows alone.
  const int k_tiles = (p.K + BK - 1) / BK;
  auto load_first_stages = [&](bool weights_requested) {
#pragma unroll
    for (int t = 0; t < STAGES - 1; ++t) {
      if (t < k_tiles) {
        load_rows(t, t * BK);
        if (!weights_requested) load_weights(t, t * BK);
      }
      cp_async_commit();
    }
  };
  // No kernel of the forward writes the weights: their first stages are requested before
  // waiting for the kernel before this one (which writes the rows).
#pragma unroll
  for (int t = 0; t < STAGES - 1; ++t) {
    if (t < k_tiles) load_weights(t, t * BK);
  }
  start_after_previous();
  load_first_stages(true);
  const int a_warp = wm * T::kFragsM * 16 * T::kLds;
  const int w_warp = T::kAParts * BM * T::kLds + wn * T::kFragsN * 16 * T::kLds;
  // Each pass: one output tile (PERSISTENT: while the CTA has tiles left; else once).
  for (;;) {
    FragC acc[T::kFragsM][T::kFragsN];
#pragma unroll
    for (int i = 0; i < T::kFragsM; ++i)
#pragma unroll
      for (int j = 0; j < T::kFragsN; ++j) wmma::fill_fragment(acc[i][j], 0.f);
    if constexpr (PIPELINED && PRODUCTS == 1) {
      // Stage s holds tile t while t % STAGES == s. Before the loop: tile 0 visible, tile
      // STAGES - 1 requested. In tile kt, after slice KS - 2's products are issued: wait for
      // tile kt + 1, barrier (every warp has loaded its last fragments of tile kt's stage),
      // request tile kt + STAGES into that stage; slice KS - 1 then loads tile kt + 1's first
      // fragments. The fragment buffer of slice s is s % 2 (KS is even).
      using Frags = FragSet<T::kFragsM, T::kFragsN, PRODUCTS>;
      constexpr int KS = BK / 16;
      static_assert(KS % 2 == 0, "an even number of k slices per stage");
      auto load_frags = [&](Frags& f, int stage, int kk) {
        const __half* st = smem + stage * T::kStageHalves;
        load_frag_set(f, st + a_warp + kk, BM * T::kLds, T::kLds, st + w_warp + kk,
                      BN * T::kLds, T::kLds);
      };
      cp_async_wait<STAGES - 2>();
      __syncthreads();
      if (STAGES - 1 < k_tiles) load_stage(STAGES - 1, (STAGES - 1) * BK);
      cp_async_commit();
      Frags frags[2];
      load_frags(frags[0], 0, 0);
      int read = 0;
      for (int kt = 0; kt < k_tiles; ++kt) {
        const int next = read == STAGES - 1 ? 0 : read + 1;
#pragma unroll
        for (int s = 0; s < KS; ++s) {
          if (s + 1 < KS) {
            load_frags(frags[(s + 1) % 2], read, (s + 1) * 16);
          } else if (kt + 1 < k_tiles) {
            load_frags(frags[0], next, 0);
          }
          mma_frag_set(acc, frags[s % 2]);
          if (s == KS - 2) {
            cp_async_wait<STAGES - 2>();
            __syncthreads();
            if (kt + STAGES < k_tiles) load_stage(read, (kt + STAGES) * BK);
            cp_async_commit();
          }
        }
        read = next;
      }
    } else {
      int read = 0, write = STAGES - 1;
      for (int kt = 0; kt < k_tiles; ++kt) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // tile kt visible to all; every warp is done with the stage read last
        if (kt + STAGES - 1 < k_tiles) load_stage(write, (kt + STAGES - 1) * BK);
        cp_async_commit();
        const __half* st = smem + read * T::kStageHalves;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
          mma_step<T::kFragsM, T::kFragsN, PRODUCTS>(acc, st + a_warp + kk, BM * T::kLds, T::kLds,
                                                     st + w_warp + kk, BN * T::kLds, T::kLds);
        }
        read = read == STAGES - 1 ? 0 : read + 1;
        write = write == STAGES - 1 ? 0 : write + 1;
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // the operand stages become the warps' scratch (PERSISTENT: the last)

    const int64_t out_m0 = m0;
    const int out_n0 = n0;
    const int64_t next = tile + gridDim.x;
    const bool more = PERSISTENT && next < tiles;
    if (more) {  // the next tile's first stages, landing during this epilogue
      set_tile(next);
      load_first_stages(false);
    }
    float* scratch = reinterpret_cast<float*>(
        smem_raw + (PERSISTENT ? T::kPersistentScratch : 0) + warp * kScratchBytes);
    const bool vec = vector_epilogue(p);
    // One fragment at a time (a whole fragment row would hold FN x 16 more registers).
#pragma unroll
    for (int j = 0; j < T::kFragsN; ++j) {
      const int col0 = out_n0 + (wn * T::kFragsN + j) * 16;
      if (col0 >= p.N) break;
      float bias[1][8];
      load_bias(p, col0 + value_col(threadIdx.x % 32), bias[0]);
#pragma unroll
      for (int i = 0; i < T::kFragsM; ++i) {
        const int64_t row0 = out_m0 + (wm * T::kFragsM + i) * 16;
        if (row0 >= p.M) break;
        const FragC one[1] = {acc[i][j]};
        store_fragments<1>(p, epilogue, vec, scratch, one, row0, col0, bias);
      }
    }
    if (!more) break;
    tile = next;
  }
}

// ---------------------------------------------------------------------------------------
// linear_stream

template <int BM, int BN, int WARPS_M, int WARPS_N, int STAGES, int PRODUCTS>
struct Stream {
  static constexpr int kThreads = WARPS_M * WARPS_N * 32;
  static constexpr int kFragsM = BM / WARPS_M / 16;
  static constexpr int kFragsN = BN / WARPS_N / 16;
  static constexpr int kAParts = Parts<PRODUCTS>::kA;
  static constexpr int kWParts = Parts<PRODUCTS>::kW;
  static constexpr int kScratch = WARPS_M * WARPS_N * kScratchBytes;
  // Per thread, the most 16-byte vectors of one activation part per tile (K = 128).
  static constexpr int kAVecs = (BM * (kStreamMaxK / 8) + kThreads - 1) / kThreads;
  static_assert(STAGES >= 2, "at least two stages");
  static_assert(kFragsM * WARPS_M * 16 == BM && kFragsN * WARPS_N * 16 == BN, "warp tiles");

  // Shared row stride (halves) for K: K rounded up to 16, plus 8 (no LDSM bank conflicts).
  __host__ __device__ static int ld(int k) { return (k + 15) / 16 * 16 + 8; }
  // Layout: warp scratch, weight slice [kWParts][BN][ld], activation ring
  // [STAGES][kAParts][BM][ld].
  __host__ __device__ static int smem_bytes(int k) {
    return kScratch + 2 * ld(k) * (kWParts * BN + STAGES * kAParts * BM);
  }
};

// LinearParams with K <= 128; grid: a multiple of the N slices (ceil(N / BN)), CTA b takes
// slice b % slices and M tiles b / slices, + gridDim.x / slices, ...; block T::kThreads;
// dynamic shared T::smem_bytes(K). NORM: the norm epilogue with norm (a residual epilogue,
// N <= BN); norm is unused otherwise. RESIDENT_B: weight fragments in registers (see the top).
template <int BM, int BN, int WARPS_M, int WARPS_N, int STAGES, int PRODUCTS, int MINB,
          bool NORM, bool RESIDENT_B>
__global__ void __launch_bounds__(WARPS_M * WARPS_N * 32, MINB)
linear_stream(LinearParams p, int epilogue, LinearNormParams norm) {
  using T = Stream<BM, BN, WARPS_M, WARPS_N, STAGES, PRODUCTS>;
  static_assert(!RESIDENT_B || PRODUCTS <= 2, "resident weight fragments: the hi part only");
  constexpr int kSteps = kStreamMaxK / 16;  // k steps at most
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const int ld = T::ld(p.K);
  const int k_pad = ld - 8;
  const int warp = threadIdx.x / 32;
  const int wm = warp / WARPS_N, wn = warp % WARPS_N;
  float* scratch = reinterpret_cast<float*>(smem_raw + warp * kScratchBytes);
  __half* w_s = reinterpret_cast<__half*>(smem_raw + T::kScratch);
  __half* a_s = w_s + T::kWParts * BN * ld;
  const int a_stage = T::kAParts * BM * ld;  // halves per ring entry

  const int slices = NORM ? 1 : (p.N + BN - 1) / BN;  // NORM: N <= BN
  const int n0 = (blockIdx.x % slices) * BN;
  const int64_t m_tiles = (p.M + BM - 1) / BM;
  const int64_t tile_step = gridDim.x / slices;
  int64_t tile = blockIdx.x / slices;

  // Vector v of a [rows][k_pad] tile is row v / chunks, chunk v % chunks; this thread's
  // vectors are threadIdx.x + q * kThreads, walked incrementally.
  const int chunks = k_pad > 0 ? k_pad / 8 : 1;  // K = 0: one zero-filled chunk per row
  const int r_first = threadIdx.x / chunks, c_first = threadIdx.x % chunks;
  const int r_step = T::kThreads / chunks, c_step = T::kThreads % chunks;

  // The weight slice once (rows past N and columns past K zero-filled), requested before
  // waiting for the kernel before this one: no kernel of the forward writes the weights.
  for (int v = threadIdx.x; v < BN * chunks; v += T::kThreads) {
    const int r = v / chunks, c = (v % chunks) * 8;
    const int row = n0 + r;
    const bool ok = row < p.N && c < p.K;
    const int64_t off = ok ? static_cast<int64_t>(row) * p.K + c : 0;
    cp_async16(w_s + r * ld + c, p.w_hi + off, ok ? 16 : 0);
    if constexpr (T::kWParts == 2) cp_async16(w_s + (BN + r) * ld + c, p.w_lo + off, ok ? 16 : 0);
  }
  start_after_previous();
  auto load_tile = [&](int stage, int64_t t) {
    __half* dst = a_s + stage * a_stage;
    const int64_t m0 = t * BM;
    int r = r_first, c = c_first;
#pragma unroll
    for (int q = 0; q < T::kAVecs; ++q) {
      if (r < BM) {
        const int64_t row = m0 + r;
        const bool ok = row < p.M && c * 8 < p.K;
        const int64_t off = ok ? row * p.K + c * 8 : 0;
        cp_async16(dst + r * ld + c * 8, p.a_hi + off, ok ? 16 : 0);
        if constexpr (T::kAParts == 2)
          cp_async16(dst + (BM + r) * ld + c * 8, p.a_lo + off, ok ? 16 : 0);
      }
      r += r_step;
      c += c_step;
      if (c >= chunks) {
        c -= chunks;
        ++r;
      }
    }
  };

  // Commit groups: (weight + tile 0), tiles 1 .. STAGES - 2, then one per iteration (empty
  // past the end); at iteration it, waiting until STAGES - 2 are pending means that the
  // weight and the iteration's tile have landed. RESIDENT_B: the weight is a group of its
  // own before them, awaited before the loop to load the warp's weight fragments; the
  // count of pending groups at each wait in the loop stays the same.
  if constexpr (RESIDENT_B) cp_async_commit();
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    const int64_t t = tile + s * tile_step;
    if (t < m_tiles) load_tile(s, t);
    cp_async_commit();
  }

  const bool vec = vector_epilogue(p);
  const int col0 = n0 + wn * T::kFragsN * 16;  // the warp's first output column
  float bias[T::kFragsN][8];  // held across tiles (the norm epilogue loads it per tile)
  if constexpr (!NORM) {
#pragma unroll
    for (int j = 0; j < T::kFragsN; ++j)
      load_bias(p, col0 + 16 * j + value_col(threadIdx.x % 32), bias[j]);
  }

  const __half* w_warp = w_s + wn * T::kFragsN * 16 * ld;
  const int a_warp = wm * T::kFragsM * 16 * ld;
  FragB b_res[RESIDENT_B ? kSteps : 1][RESIDENT_B ? T::kFragsN : 1];  // [k step][fragment]
  if constexpr (RESIDENT_B) {
    cp_async_wait<STAGES - 1>();
    __syncthreads();  // the weight slice is visible
#pragma unroll
    for (int ks = 0; ks < kSteps; ++ks) {
      if (16 * ks >= k_pad) break;
#pragma unroll
      for (int j = 0; j < T::kFragsN; ++j)
        wmma::load_matrix_sync(b_res[ks][j], w_warp + j * 16 * ld + 16 * ks, ld);
    }
  }
  int read = 0, write = STAGES - 1;
  for (; tile < m_tiles; tile += tile_step) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // the tile is visible; every warp is done with the entry read last
    const int64_t ahead = tile + (STAGES - 1) * tile_step;
    if (ahead < m_tiles) load_tile(write, ahead);
    cp_async_commit();

    FragC acc[T::kFragsM][T::kFragsN];
#pragma unroll
    for (int i = 0; i < T::kFragsM; ++i)
#pragma unroll
      for (int j = 0; j < T::kFragsN; ++j) wmma::fill_fragment(acc[i][j], 0.f);
    const __half* a_tile = a_s + read * a_stage + a_warp;
    if constexpr (RESIDENT_B) {
#pragma unroll
      for (int ks = 0; ks < kSteps; ++ks) {
        if (16 * ks >= k_pad) break;
        mma_rows<T::kFragsM, T::kFragsN, PRODUCTS>(acc, a_tile + 16 * ks, BM * ld, ld,
                                                   b_res[ks], b_res[ks]);  // no lo part
      }
    } else {
      for (int kk = 0; kk < k_pad; kk += 16) {
        mma_step<T::kFragsM, T::kFragsN, PRODUCTS>(acc, a_tile + kk, BM * ld, ld, w_warp + kk,
                                                   BN * ld, ld);
      }
    }

    const int64_t m0 = tile * BM;
    if constexpr (NORM) {  // every warp: the epilogue has barriers
      norm_epilogue<T::kFragsM, T::kFragsN, WARPS_N>(
          p, norm, epilogue == static_cast<int>(Epilogue::kResidualUpdate), vec, scratch,
          reinterpret_cast<const float*>(smem_raw + wm * WARPS_N * kScratchBytes), acc,
          m0 + wm * T::kFragsM * 16, col0);
    } else {
#pragma unroll
      for (int i = 0; i < T::kFragsM; ++i) {
        const int64_t row0 = m0 + (wm * T::kFragsM + i) * 16;
        if (row0 >= p.M || col0 >= p.N) break;
        store_fragments<T::kFragsN>(p, epilogue, vec, scratch, acc[i], row0, col0, bias);
      }
    }
    read = read == STAGES - 1 ? 0 : read + 1;
    write = write == STAGES - 1 ? 0 : write + 1;
  }
  cp_async_wait<0>();
}

// ---------------------------------------------------------------------------------------
// Variants (GemmTile; tiles.py GEMM_TILES describes the same list): shape, warps, and per
// product count (1, 2, 3) the stages and the CTAs per SM asked of __launch_bounds__.

template <int BM_, int BN_, int WM_, int WN_, int BK_, int S1, int S2, int S3, int B1, int B2,
          int B3, bool PIPELINED_ = false, bool PERSISTENT_ = false>
struct TiledVariant {
  static constexpr int BM = BM_, BN = BN_, WM = WM_, WN = WN_, BK = BK_;
  static constexpr bool PIPELINED = PIPELINED_, PERSISTENT = PERSISTENT_;
  static constexpr int stages(int products) { return products == 1 ? S1 : products == 2 ? S2 : S3; }
  static constexpr int blocks(int products) { return products == 1 ? B1 : products == 2 ? B2 : B3; }
};

template <int BM_, int BN_, int WM_, int WN_, int S1, int S2, int S3, int B1, int B2, int B3,
          bool RESIDENT_B_ = false>
struct StreamVariant {
  static constexpr int BM = BM_, BN = BN_, WM = WM_, WN = WN_;
  static constexpr int stages(int products) { return products == 1 ? S1 : products == 2 ? S2 : S3; }
  static constexpr int blocks(int products) { return products == 1 ? B1 : products == 2 ? B2 : B3; }
  // Weight fragments in registers with one or two products (three would need the lo part).
  static constexpr bool resident_b(int products) { return RESIDENT_B_ && products <= 2; }
};

//                         BM   BN  warps  BK  stages p1/p2/p3  CTAs/SM p1/p2/p3
using T128x128 = TiledVariant<128, 128, 4, 2, 32, 4, 4, 4, 2, 1, 1>;
using T128x256 = TiledVariant<128, 256, 2, 4, 32, 4, 4, 3, 1, 1, 1>;
using T128x128w4 = TiledVariant<128, 128, 2, 2, 32, 4, 3, 2, 2, 2, 2>;
using T128x128k64 = TiledVariant<128, 128, 4, 2, 64, 4, 3, 3, 1, 1, 1>;
using T64x64 = TiledVariant<64, 64, 2, 2, 32, 3, 3, 3, 2, 2, 2>;
using T32x32 = TiledVariant<32, 32, 2, 2, 64, 2, 2, 2, 2, 2, 2>;
//                         BM   BN  warps  BK  stages p1/p2/p3  CTAs/SM p1/p2/p3  pipelined
using T128x128k64w4p = TiledVariant<128, 128, 2, 2, 64, 3, 2, 2, 2, 2, 1, true>;
//                           BM   BN  warps  BK  stages p1/p2/p3  CTAs/SM  pipelined persistent
using T128x128k64w4pp = TiledVariant<128, 128, 2, 2, 64, 3, 2, 2, 2, 2, 1, true, true>;
//                          BM   BN  warps  stages p1/p2/p3  CTAs/SM p1/p2/p3
using S128x128 = StreamVariant<128, 128, 4, 4, 3, 2, 2, 1, 1, 1>;
using S64x128 = StreamVariant<64, 128, 2, 4, 3, 2, 2, 2, 2, 1>;
using S64x64 = StreamVariant<64, 64, 2, 2, 2, 2, 2, 2, 2, 2>;
using S32x128 = StreamVariant<32, 128, 1, 4, 3, 2, 2, 2, 2, 2>;
//                          BM   BN  warps  stages p1/p2/p3  CTAs/SM p1/p2/p3  resident B
using S128x128w8r = StreamVariant<128, 128, 2, 4, 3, 2, 2, 1, 1, 1, true>;

// A variant whose shared memory exceeds the device's limit per block (e.g. 128x256 on an
// A100, 163 KB; the 3-product stream variants below sm_90) runs as this one (80-90 KB); not
// with the norm epilogue, which launch_stream then refuses (tiles.norm_gemm_tile picks a
// variant within the limit).
using Fallback = T128x128w4;
constexpr const char* kFallbackName = "linear_tiled<128x128, 4 warps, bk32> (fallback)";

struct DeviceInfo {
  int sms;         // multiprocessors
  int smem_limit;  // opt-in shared memory per block (bytes)
};

// The current device's DeviceInfo, cached per thread for the device of its last call.
cudaError_t device_info(DeviceInfo& info) {
  thread_local int cached_device = -1;
  thread_local DeviceInfo cached{0, 0};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device != cached_device) {
    DeviceInfo fresh{0, 0};
    err = cudaDeviceGetAttribute(&fresh.sms, cudaDevAttrMultiProcessorCount, device);
    if (err == cudaSuccess) {
      err = cudaDeviceGetAttribute(&fresh.smem_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                   device);
    }
    if (err != cudaSuccess) return err;
    cached = fresh;
    cached_device = device;
  }
  info = cached;
  return cudaSuccess;
}

cudaError_t allow_smem(const void* kernel, int bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

// One kernel's resident CTAs per SM (at least 1) for the last (SM count, bytes) asked.
struct ResidentCache {
  int sms = -1, bytes = -1, per_sm = 1;
};

// per_sm = resident CTAs of kernel per SM at this block size and shared memory, through the
// kernel's own cache (a thread_local of its launch function): a persistent grid's size only
// shapes the schedule, never the result.
template <typename Kernel>
cudaError_t resident_ctas(Kernel kernel, int threads, int bytes, const DeviceInfo& dev,
                          ResidentCache& cache, int& per_sm) {
  if (dev.sms != cache.sms || bytes != cache.bytes) {
    int found = 0;
    const cudaError_t err =
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&found, kernel, threads, bytes);
    if (err != cudaSuccess) return err;
    cache = ResidentCache{dev.sms, bytes, found > 0 ? found : 1};
  }
  per_sm = cache.per_sm;
  return cudaSuccess;
}

// The tiled variant V; a norm (only the stream tiles have the norm epilogue) is refused.
template <class V, int PRODUCTS>
LaunchResult launch_tiled(const LinearParams& p, Epilogue epilogue, cudaStream_t stream,
                          const DeviceInfo& dev, const char* name,
                          const LinearNormParams* norm) {
  if (norm != nullptr)
    return {cudaErrorInvalidValue, "linear (the norm epilogue needs a stream tile)"};
  constexpr int S = V::stages(PRODUCTS);
  using T = Tiled<V::BM, V::BN, V::WM, V::WN, V::BK, S, PRODUCTS>;
  if constexpr (!std::is_same_v<V, Fallback>) {
    if (T::kSmemBytes > dev.smem_limit)
      return launch_tiled<Fallback, PRODUCTS>(p, epilogue, stream, dev, kFallbackName, nullptr);
  }
  auto kernel = linear_tiled<V::BM, V::BN, V::WM, V::WN, V::BK, S, PRODUCTS, V::blocks(PRODUCTS),
                             V::PIPELINED, V::PERSISTENT>;
  cudaError_t err = allow_smem(reinterpret_cast<const void*>(kernel), T::kSmemBytes);
  if (err != cudaSuccess) return {err, name};
  const int64_t m_tiles = (p.M + V::BM - 1) / V::BM, n_tiles = (p.N + V::BN - 1) / V::BN;
  dim3 grid(static_cast<unsigned>(m_tiles), static_cast<unsigned>(n_tiles));
  if constexpr (V::PERSISTENT) {  // one CTA per resident slot, at most one per tile
    thread_local ResidentCache cache;  // one per instance of launch_tiled and thread
    int per_sm = 1;
    err = resident_ctas(kernel, T::kThreads, T::kSmemBytes, dev, cache, per_sm);
    if (err != cudaSuccess) return {err, name};
    grid = dim3(static_cast<unsigned>(
        std::min<int64_t>(m_tiles * n_tiles, static_cast<int64_t>(dev.sms) * per_sm)));
  }
  return {launch_kernel(kernel, grid, dim3(T::kThreads), T::kSmemBytes, stream, p,
                        static_cast<int>(epilogue)),
          name};
}

template <class V, int PRODUCTS, bool NORM>
LaunchResult launch_stream_kernel(const LinearParams& p, const LinearNormParams& norm,
                                  Epilogue epilogue, cudaStream_t stream,
                                  const DeviceInfo& dev, const char* name) {
  constexpr int S = V::stages(PRODUCTS);
  using T = Stream<V::BM, V::BN, V::WM, V::WN, S, PRODUCTS>;
  auto kernel = linear_stream<V::BM, V::BN, V::WM, V::WN, S, PRODUCTS, V::blocks(PRODUCTS), NORM,
                              V::resident_b(PRODUCTS)>;
  if (p.K > kStreamMaxK) return {cudaErrorInvalidValue, name};  // K above 128: linear_tiled
  const int bytes = T::smem_bytes(p.K);
  if (bytes > dev.smem_limit) {
    if constexpr (NORM) {
      return {cudaErrorInvalidValue, "linear_stream (norm epilogue: shared memory too large)"};
    } else {
      return launch_tiled<Fallback, PRODUCTS>(p, epilogue, stream, dev, kFallbackName, nullptr);
    }
  }
  cudaError_t err = allow_smem(reinterpret_cast<const void*>(kernel), bytes);
  if (err != cudaSuccess) return {err, name};
  thread_local ResidentCache cache;  // one per instance of launch_stream_kernel and thread
  int per_sm = 1;              // resident CTAs per SM at this K
  err = resident_ctas(kernel, T::kThreads, bytes, dev, cache, per_sm);
  if (err != cudaSuccess) return {err, name};
  const int64_t slices = (p.N + V::BN - 1) / V::BN;
  const int64_t work = (p.M + V::BM - 1) / V::BM * slices;
  int64_t ctas = static_cast<int64_t>(dev.sms) * per_sm / slices * slices;
  if (ctas < slices) ctas = slices;
  if (ctas > work) ctas = work;
  return {launch_kernel(kernel, dim3(static_cast<unsigned>(ctas)), dim3(T::kThreads), bytes,
                        stream, p, static_cast<int>(epilogue), norm),
          name};
}

// The stream variant V; with a norm its norm epilogue, which needs a residual epilogue, two
// or three products and whole rows in one CTA (N <= V::BN).
template <class V, int PRODUCTS>
LaunchResult launch_stream(const LinearParams& p, Epilogue epilogue, cudaStream_t stream,
                           const DeviceInfo& dev, const char* name,
                           const LinearNormParams* norm) {
  if (norm == nullptr)
    return launch_stream_kernel<V, PRODUCTS, false>(p, LinearNormParams{}, epilogue, stream,
                                                    dev, name);
  if (epilogue != Epilogue::kResidualUpdate && epilogue != Epilogue::kResidualSum)
    return {cudaErrorInvalidValue, "linear_stream (norm epilogue needs a residual epilogue)"};
  if (p.N > V::BN)
    return {cudaErrorInvalidValue, "linear_stream (norm epilogue needs N <= the tile's columns)"};
  if constexpr (PRODUCTS == 1) {
    return {cudaErrorInvalidValue, "linear_stream (norm epilogue needs two or three products)"};
  } else {
    return launch_stream_kernel<V, PRODUCTS, true>(p, *norm, epilogue, stream, dev, name);
  }
}

template <int PRODUCTS>
LaunchResult launch_tile(const LinearParams& p, GemmTile tile, Epilogue e, cudaStream_t s,
                         const LinearNormParams* norm) {
  DeviceInfo dev;
  const cudaError_t err = device_info(dev);
  if (err != cudaSuccess) return {err, "linear (device query)"};
  switch (tile) {
    case GemmTile::kTiled128x128:
      return launch_tiled<T128x128, PRODUCTS>(
          p, e, s, dev, "linear_tiled<128x128, 8 warps, bk32>", norm);
    case GemmTile::kTiled128x256:
      return launch_tiled<T128x256, PRODUCTS>(
          p, e, s, dev, "linear_tiled<128x256, 8 warps, bk32>", norm);
    case GemmTile::kTiled128x128w4:
      return launch_tiled<T128x128w4, PRODUCTS>(
          p, e, s, dev, "linear_tiled<128x128, 4 warps, bk32>", norm);
    case GemmTile::kTiled128x128k64:
      return launch_tiled<T128x128k64, PRODUCTS>(
          p, e, s, dev, "linear_tiled<128x128, 8 warps, bk64>", norm);
    case GemmTile::kTiled64x64:
      return launch_tiled<T64x64, PRODUCTS>(
          p, e, s, dev, "linear_tiled<64x64, 4 warps, bk32>", norm);
    case GemmTile::kTiled32x32:
      return launch_tiled<T32x32, PRODUCTS>(
          p, e, s, dev, "linear_tiled<32x32, 4 warps, bk64>", norm);
    case GemmTile::kTiled128x128k64w4p:
      return launch_tiled<T128x128k64w4p, PRODUCTS>(
          p, e, s, dev, "linear_tiled<128x128, 4 warps, bk64, pipelined>", norm);
    case GemmTile::kTiled128x128k64w4pp:
      return launch_tiled<T128x128k64w4pp, PRODUCTS>(
          p, e, s, dev, "linear_tiled<128x128, 4 warps, bk64, pipelined, persistent>", norm);
    case GemmTile::kStream128x128:
      return launch_stream<S128x128, PRODUCTS>(p, e, s, dev, "linear_stream<128x128, 16 warps>",
                                               norm);
    case GemmTile::kStream64x128:
      return launch_stream<S64x128, PRODUCTS>(p, e, s, dev, "linear_stream<64x128, 8 warps>", norm);
    case GemmTile::kStream64x64:
      return launch_stream<S64x64, PRODUCTS>(p, e, s, dev, "linear_stream<64x64, 4 warps>", norm);
    case GemmTile::kStream32x128:
      return launch_stream<S32x128, PRODUCTS>(p, e, s, dev, "linear_stream<32x128, 4 warps>", norm);
    case GemmTile::kStream128x128w8r:
      return launch_stream<S128x128w8r, PRODUCTS>(
          p, e, s, dev, "linear_stream<128x128, 8 warps, resident weight fragments>", norm);
  }
  return {cudaErrorInvalidValue, "linear (unknown tile)"};
}

}  // namespace

// The launches of launch_linear at two and three fp16 products (its arguments).
LaunchResult launch_linear_two_products(const LinearParams& p, GemmTile tile, Epilogue e,
                                        cudaStream_t s, const LinearNormParams* norm);
LaunchResult launch_linear_three_products(const LinearParams& p, GemmTile tile, Epilogue e,
                                          cudaStream_t s, const LinearNormParams* norm);

}  // namespace lbw
