// Flash attention forward through nvcuda::wmma: one block per (query block, sequence * head).
//
// Q, K, V and P are fp16 tensor-core operands with fp32 accumulation; the online softmax runs
// in fp32 (base 2). [S, S] scores never reach memory: each warp owns 16 query rows, computes
// their scores against a key block into shared memory, updates its rows' running max and sum
// in registers (two lanes per row), writes P as fp16, and accumulates P V into the context
// rows it keeps in shared fp32 (loaded as accumulator fragments for each product). Key blocks
// above the causal diagonal are skipped; masked keys get -inf; a row with no visible key gets
// context 0.
#include <math_constants.h>
#include <mma.h>

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
  const dim3 grid(static_cast<unsigned>(p.batch * p.heads),
                  static_cast<unsigned>((p.seq_len + kBlockM - 1) / kBlockM));
  attention_kernel<BLOCK_N><<<grid, kThreads, bytes, stream>>>(p);
  return {cudaGetLastError(), name};
}

}  // namespace

LaunchResult launch_attention(const AttentionParams& p, int block_n, cudaStream_t stream) {
  if (block_n == 64) return launch<64>(p, stream, "attention_kernel<64>");
  if (block_n == 32) return launch<32>(p, stream, "attention_kernel<32>");
  return {cudaErrorInvalidValue, "attention_kernel (unsupported key block)"};
}

int attention_smem_bytes(int head_pad, int block_n) { return layout(head_pad, block_n).bytes; }

}  // namespace lbw
