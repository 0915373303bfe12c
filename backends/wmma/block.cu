// The narrow block (whole rows in one tile): norm_qkv fuses norm1 into the Q/K/V GEMM's
// prologue; ffn_block runs everything from the attention context to the block's output rows
// (and their next LayerNorm) in one kernel. Products through nvcuda::wmma (fp16 operands,
// fp32 accumulators); ffn_block takes one or two products per step. Epilogues go through a
// shared fp32 tile.
#include <mma.h>

#include "common.cuh"

namespace lbw {
namespace {

using namespace nvcuda;

constexpr int kThreads = 128;          // norm_qkv: 4 warps, 2 x 2 over the output tile
constexpr int kQkvRows = 32;           // norm_qkv: rows per block
constexpr int kQkvCols = 64;           // norm_qkv: output columns per block
constexpr int kFfnRows = 64;           // ffn_block: rows per block
constexpr int kFfnColumnSplit = 4;     // ffn_block: warps sharing a 16-row group's columns
constexpr int kFfnWarps = kFfnRows / 16 * kFfnColumnSplit;
constexpr int kMaxFfnWidth = 128;      // ffn_block: widest d_model / ffn_dim
constexpr int kFfnFrags = kMaxFfnWidth / 16 / kFfnColumnSplit;  // fragments of one warp
constexpr int kRowValues = kMaxFfnWidth / 32;     // a lane's values of one row

__host__ __device__ inline int pad_to(int n, int m) { return (n + m - 1) / m * m; }

// norm_qkv shared memory: normed rows A [32][Kp + 8], weight tile W [64][Kp + 8] (fp16),
// output tile C [32][64 + 4] (fp32). Kp = K rounded up to 16.
struct QkvLayout {
  int lda, ldc, a, w, c, bytes;
};

__host__ __device__ inline QkvLayout qkv_layout(int k) {
  QkvLayout l;
  l.lda = pad_to(k, 16) + 8;
  l.ldc = kQkvCols + 4;
  l.a = 0;
  l.w = l.a + kQkvRows * l.lda * 2;
  l.c = l.w + kQkvCols * l.lda * 2;
  l.bytes = l.c + kQkvRows * l.ldc * 4;
  return l;
}

// NormQkvParams; grid (row blocks of 32, column blocks of 64); block 128 threads; dynamic
// shared qkv_layout(K).bytes.
template <typename T>
__global__ void __launch_bounds__(kThreads) norm_qkv_kernel(NormQkvParams p) {
  start_after_previous();
  extern __shared__ __align__(128) unsigned char smem[];
  const QkvLayout L = qkv_layout(p.K);
  __half* a_s = reinterpret_cast<__half*>(smem + L.a);
  __half* w_s = reinterpret_cast<__half*>(smem + L.w);
  float* c_s = reinterpret_cast<float*>(smem + L.c);
  const int k_pad = pad_to(p.K, 16);
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * kQkvRows;
  const int n0 = blockIdx.y * kQkvCols;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  // The weight tile streams in while the rows are normalised.
  copy_tile_async(w_s, L.lda, p.w + static_cast<int64_t>(n0) * p.K, p.K, kQkvCols, k_pad,
                  p.N - n0, p.K);
  cp_async_commit();

  const T* x = static_cast<const T*>(p.x);
  for (int r = warp; r < kQkvRows; r += kThreads / 32) {
    const int64_t row = m0 + r;
    if (row >= p.M) {
      for (int c = lane; c < k_pad; c += 32) a_s[r * L.lda + c] = __float2half_rn(0.f);
      continue;
    }
    const T* xr = x + row * p.K;
    const float2 stats = row_stats(xr, p.K, p.eps, lane);
    for (int c = lane; c < k_pad; c += 32) {
      float y = 0.f;
      if (c < p.K) {
        const float v = load_as_float(xr, c);
        if (p.copy && blockIdx.y == 0) p.copy[row * p.K + c] = v;
        y = (v - stats.x) * stats.y * p.norm_w[c] + p.norm_b[c];
      }
      a_s[r * L.lda + c] = __float2half_rn(y);
    }
  }
  cp_async_wait<0>();
  __syncthreads();

  const int wm = warp / 2, wn = warp % 2;   // warp tile: 16 rows x 32 columns
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2];
  wmma::fill_fragment(acc[0], 0.f);
  wmma::fill_fragment(acc[1], 0.f);
  for (int k = 0; k < k_pad; k += 16) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
    wmma::load_matrix_sync(a, a_s + (wm * 16) * L.lda + k, L.lda);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b;
      wmma::load_matrix_sync(b, w_s + (wn * 32 + j * 16) * L.lda + k, L.lda);
      wmma::mma_sync(acc[j], a, b, acc[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    wmma::store_matrix_sync(c_s + (wm * 16) * L.ldc + wn * 32 + j * 16, acc[j], L.ldc,
                            wmma::mem_row_major);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < kQkvRows * kQkvCols; e += kThreads) {
    const int r = e / kQkvCols, c = e % kQkvCols;
    const int64_t row = m0 + r;
    const int col = n0 + c;
    if (row < p.M && col < p.N) {
      p.out[row * p.N + col] = __float2half_rn(c_s[r * L.ldc + c] + p.bias[col]);
    }
  }
}

// ffn_block shared memory (offsets in bytes): the operand pair P [64][Wp + 8] fp16 hi, then
// lo (the context, norm2's rows, then the hidden rows), the accumulator tile C [64][Wp + 4]
// fp32, the residual rows X [64][Wp + 4] fp32 and two weight slots [Wp][Wp + 8] fp16. Dp, Fp:
// d_model, ffn_dim rounded up to 16; Wp = max(Dp, Fp).
struct FfnLayout {
  int dp, fp, wp, ldp, ldc, ldw, p_hi, p_lo, c, x, w0, w1, bytes;
};

__host__ __device__ inline FfnLayout ffn_layout(int d, int f) {
  FfnLayout l;
  l.dp = pad_to(d, 16);
  l.fp = pad_to(f, 16);
  l.wp = l.dp > l.fp ? l.dp : l.fp;
  l.ldp = l.wp + 8;
  l.ldc = l.wp + 4;
  l.ldw = l.wp + 8;
  l.p_hi = 0;
  l.p_lo = l.p_hi + kFfnRows * l.ldp * 2;
  l.c = l.p_lo + kFfnRows * l.ldp * 2;
  l.x = l.c + kFfnRows * l.ldc * 4;
  l.w0 = l.x + kFfnRows * l.ldc * 4;
  l.w1 = l.w0 + l.wp * l.ldw * 2;
  l.bytes = l.w1 + l.wp * l.ldw * 2;
  return l;
}

using FfnAcc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// c [64][n_frags * 16] = a [64][k_pad] @ w [n][k_pad]^T: warp w multiplies rows 16 (w / 4)
// by the column fragments w % 4, w % 4 + 4, ...; PRODUCTS 2 adds a_lo @ w^T first.
template <int PRODUCTS>
__device__ __forceinline__ void ffn_gemm(const __half* a_hi, const __half* a_lo, int lda,
                                         const __half* w, int ldw, int k_pad, int n_frags,
                                         float* c, int ldc) {
  const int warp = threadIdx.x / 32;
  const int rows = (warp / kFfnColumnSplit) * 16, first = warp % kFfnColumnSplit;
  FfnAcc acc[kFfnFrags];
#pragma unroll
  for (int j = 0; j < kFfnFrags; ++j) wmma::fill_fragment(acc[j], 0.f);
  for (int k = 0; k < k_pad; k += 16) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> ah, al;
    wmma::load_matrix_sync(ah, a_hi + rows * lda + k, lda);
    if (PRODUCTS == 2) wmma::load_matrix_sync(al, a_lo + rows * lda + k, lda);
#pragma unroll
    for (int j = 0; j < kFfnFrags; ++j) {
      const int frag = first + kFfnColumnSplit * j;
      if (frag >= n_frags) break;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b;
      wmma::load_matrix_sync(b, w + frag * 16 * ldw + k, ldw);
      if (PRODUCTS == 2) wmma::mma_sync(acc[j], al, b, acc[j]);
      wmma::mma_sync(acc[j], ah, b, acc[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < kFfnFrags; ++j) {
    const int frag = first + kFfnColumnSplit * j;
    if (frag >= n_frags) break;
    wmma::store_matrix_sync(c + rows * ldc + frag * 16, acc[j], ldc, wmma::mem_row_major);
  }
}

// A lane's entries lane + 32 i of the vector src [n] (0 past n).
__device__ __forceinline__ void lane_values(const float* src, int n, int lane,
                                            float (&dst)[kRowValues]) {
#pragma unroll
  for (int i = 0; i < kRowValues; ++i) {
    const int c = lane + 32 * i;
    dst[i] = src != nullptr && c < n ? src[c] : 0.f;
  }
}

// (mean, 1 / std) of a row whose lane holds v[i] at column lane + 32 i (columns >= d: 0).
__device__ __forceinline__ float2 row_stats_of(const float (&v)[kRowValues], int d, float eps,
                                               int lane) {
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kRowValues; ++i) sum += v[i];
  const float mean = warp_sum(sum) / d;
  float sq = 0.f;
#pragma unroll
  for (int i = 0; i < kRowValues; ++i) {
    const float dev = lane + 32 * i < d ? v[i] - mean : 0.f;
    sq += dev * dev;
  }
  return make_float2(mean, 1.f / sqrtf(warp_sum(sq) / d + eps));
}

// An operand element: its fp16 (hi, lo) pair with two products, hi alone with one.
template <int PRODUCTS>
__device__ __forceinline__ void put_operand(__half* hi, __half* lo, int i, float v) {
  if (PRODUCTS == 2) {
    split_half(v, hi[i], lo[i]);
  } else {
    hi[i] = __float2half_rn(v);
  }
}

__device__ __forceinline__ void store_as(void* out, DType type, int64_t i, float v) {
  switch (type) {
    case DType::kFloat32: store_from_float(static_cast<float*>(out), i, v); break;
    case DType::kFloat16: store_from_float(static_cast<__half*>(out), i, v); break;
    case DType::kBFloat16: store_from_float(static_cast<__nv_bfloat16*>(out), i, v); break;
  }
}

// FfnBlockParams; grid (row blocks of 64); block 512 threads; dynamic shared
// ffn_layout(D, F).bytes (168 KB at width 128: one block per SM). Each row's epilogue and
// LayerNorm run on one warp, a lane holding columns lane + 32 i; a warp's rows unrolled.
template <int PRODUCTS>
__global__ void __launch_bounds__(kFfnWarps * 32, 1) ffn_block_kernel(FfnBlockParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const FfnLayout L = ffn_layout(p.D, p.F);
  __half* p_hi = reinterpret_cast<__half*>(smem + L.p_hi);
  __half* p_lo = reinterpret_cast<__half*>(smem + L.p_lo);
  float* c_s = reinterpret_cast<float*>(smem + L.c);
  float* x_s = reinterpret_cast<float*>(smem + L.x);
  __half* w0 = reinterpret_cast<__half*>(smem + L.w0);
  __half* w1 = reinterpret_cast<__half*>(smem + L.w1);
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * kFfnRows;
  const int64_t rows_left = p.M - m0;
  const int D = p.D, F = p.F;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  // Group 0: out_proj's weight (requested before waiting for the kernel before this one: no
  // kernel of the forward writes the weights), the context and residual rows; group 1:
  // ffn_in's weight.
  copy_tile_async(w0, L.ldw, p.wo, D, L.dp, L.dp, D, D);
  start_after_previous();
  copy_tile_async(p_hi, L.ldp, p.ctx_hi + m0 * D, D, kFfnRows, L.dp, rows_left, D);
  if (PRODUCTS == 2) copy_tile_async(p_lo, L.ldp, p.ctx_lo + m0 * D, D, kFfnRows, L.dp,
                                     rows_left, D);
  copy_tile_async(x_s, L.ldc, p.residual + m0 * D, D, kFfnRows, L.dp, rows_left, D);
  cp_async_commit();
  copy_tile_async(w1, L.ldw, p.wi, D, L.fp, L.dp, F, D);
  cp_async_commit();

  // While the copies land: the vectors at this lane's columns, and bit j of valid_bits for
  // the warp's row warp + kFfnWarps j (rows past M invalid).
  float bo[kRowValues], n2_w[kRowValues], n2_b[kRowValues], bi[kRowValues], bf[kRowValues],
      norm_w[kRowValues], norm_b[kRowValues];
  lane_values(p.bo, D, lane, bo);
  lane_values(p.n2_w, D, lane, n2_w);
  lane_values(p.n2_b, D, lane, n2_b);
  lane_values(p.bi, F, lane, bi);
  lane_values(p.bf, D, lane, bf);
  lane_values(p.norm_w, D, lane, norm_w);
  lane_values(p.norm_b, D, lane, norm_b);
  constexpr int kRowsPerWarp = kFfnRows / kFfnWarps;
  const int my_row = warp + kFfnWarps * lane;
  const unsigned valid_bits = __ballot_sync(
      kFullMask, lane < kRowsPerWarp && my_row < rows_left &&
                     (p.valid == nullptr || p.valid[m0 + my_row] != 0));
  cp_async_wait<1>();
  __syncthreads();

  // out_proj; then ffn_out's weight into the slot out_proj is done with.
  ffn_gemm<PRODUCTS>(p_hi, p_lo, L.ldp, w0, L.ldw, L.dp, L.dp / 16, c_s, L.ldc);
  __syncthreads();
  copy_tile_async(w0, L.ldw, p.wf, F, L.dp, L.fp, D, F);
  cp_async_commit();

  // x = residual + (valid ? attention + bias : 0), kept in X; norm2 of x into P.
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; ++j) {
    const int r = warp + kFfnWarps * j;
    const bool valid = (valid_bits >> j) & 1u;
    float v[kRowValues];
#pragma unroll
    for (int i = 0; i < kRowValues; ++i) {
      const int c = lane + 32 * i;
      v[i] = 0.f;
      if (c < D) {
        v[i] = x_s[r * L.ldc + c] + (valid ? c_s[r * L.ldc + c] + bo[i] : 0.f);
        x_s[r * L.ldc + c] = v[i];
      }
    }
    const float2 st = row_stats_of(v, D, p.eps, lane);
#pragma unroll
    for (int i = 0; i < kRowValues; ++i) {
      const int c = lane + 32 * i;
      if (c >= L.dp) continue;
      const float y = c < D ? (v[i] - st.x) * st.y * n2_w[i] + n2_b[i] : 0.f;
      put_operand<PRODUCTS>(p_hi, p_lo, r * L.ldp + c, y);
    }
  }
  cp_async_wait<1>();
  __syncthreads();

  // ffn_in, then bias and GELU into P (the hidden rows).
  ffn_gemm<PRODUCTS>(p_hi, p_lo, L.ldp, w1, L.ldw, L.dp, L.fp / 16, c_s, L.ldc);
  __syncthreads();
#pragma unroll
  for (int r = warp; r < kFfnRows; r += kFfnWarps) {
#pragma unroll
    for (int i = 0; i < kRowValues; ++i) {
      const int c = lane + 32 * i;
      if (c >= L.fp) continue;
      const float h = c < F ? gelu(c_s[r * L.ldc + c] + bi[i]) : 0.f;
      put_operand<PRODUCTS>(p_hi, p_lo, r * L.ldp + c, h);
    }
  }
  cp_async_wait<0>();
  __syncthreads();

  // ffn_out; y = valid ? x + ffn + bias : 0 to out_rows; then the rows' norm.
  ffn_gemm<PRODUCTS>(p_hi, p_lo, L.ldp, w0, L.ldw, L.fp, L.dp / 16, c_s, L.ldc);
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; ++j) {
    const int r = warp + kFfnWarps * j;
    if (r >= rows_left) break;
    const int64_t row = m0 + r;
    const bool valid = (valid_bits >> j) & 1u;
    float v[kRowValues];
#pragma unroll
    for (int i = 0; i < kRowValues; ++i) {
      const int c = lane + 32 * i;
      v[i] = 0.f;
      if (c < D && valid) v[i] = x_s[r * L.ldc + c] + c_s[r * L.ldc + c] + bf[i];
      if (c < D && p.out_rows != nullptr) p.out_rows[row * D + c] = v[i];
    }
    if (p.norm_w == nullptr) continue;
    const float2 st = row_stats_of(v, D, p.eps, lane);
    const bool zero = p.zero_invalid && !valid;
#pragma unroll
    for (int i = 0; i < kRowValues; ++i) {
      const int c = lane + 32 * i;
      if (c >= D) continue;
      const float y = zero ? 0.f : (v[i] - st.x) * st.y * norm_w[i] + norm_b[i];
      store_as(p.normed, p.normed_type, row * D + c, y);
    }
  }
}

template <typename Kernel>
cudaError_t allow_shared(Kernel kernel, int bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

template <typename T>
LaunchResult launch_qkv(const NormQkvParams& p, cudaStream_t stream, const char* name) {
  const int bytes = qkv_layout(p.K).bytes;
  cudaError_t err = allow_shared(norm_qkv_kernel<T>, bytes);
  if (err != cudaSuccess) return {err, name};
  const dim3 grid(static_cast<unsigned>((p.M + kQkvRows - 1) / kQkvRows),
                  static_cast<unsigned>((p.N + kQkvCols - 1) / kQkvCols));
  return {launch_kernel(norm_qkv_kernel<T>, grid, dim3(kThreads), bytes, stream, p), name};
}

template <int PRODUCTS>
LaunchResult launch_ffn(const FfnBlockParams& p, cudaStream_t stream, const char* name) {
  const int bytes = ffn_layout(p.D, p.F).bytes;
  cudaError_t err = allow_shared(ffn_block_kernel<PRODUCTS>, bytes);
  if (err != cudaSuccess) return {err, name};
  const dim3 grid(static_cast<unsigned>((p.M + kFfnRows - 1) / kFfnRows));
  return {launch_kernel(ffn_block_kernel<PRODUCTS>, grid, dim3(kFfnWarps * 32), bytes, stream, p),
          name};
}

}  // namespace

LaunchResult launch_norm_qkv(const NormQkvParams& p, cudaStream_t stream) {
  switch (p.x_type) {
    case DType::kFloat32: return launch_qkv<float>(p, stream, "norm_qkv_kernel<float>");
    case DType::kFloat16: return launch_qkv<__half>(p, stream, "norm_qkv_kernel<half>");
    case DType::kBFloat16:
      return launch_qkv<__nv_bfloat16>(p, stream, "norm_qkv_kernel<bfloat16>");
  }
  return {cudaErrorInvalidValue, "norm_qkv_kernel (unknown input type)"};
}

LaunchResult launch_ffn_block(const FfnBlockParams& p, cudaStream_t stream) {
  if (p.ctx_lo == nullptr) return launch_ffn<1>(p, stream, "ffn_block_kernel<1>");
  return launch_ffn<2>(p, stream, "ffn_block_kernel<2>");
}

int ffn_block_smem_bytes(int d_model, int ffn_dim) { return ffn_layout(d_model, ffn_dim).bytes; }

}  // namespace lbw
