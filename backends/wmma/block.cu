// The narrow block (whole rows in one tile): norm_qkv fuses norm1 into the Q/K/V GEMM's
// prologue; ffn_block runs everything from the attention context to the block's output rows
// in one kernel. Products through nvcuda::wmma (fp16 operands, fp32 accumulators); ffn_block
// uses three products per tile step (fp16x3). Epilogues go through a shared fp32 tile.
#include <mma.h>

#include "common.cuh"

namespace lbw {
namespace {

using namespace nvcuda;

constexpr int kThreads = 128;          // 4 warps, 2 x 2 over the output tile
constexpr int kQkvRows = 32;           // norm_qkv: rows per block
constexpr int kQkvCols = 64;           // norm_qkv: output columns per block
constexpr int kFfnRows = 32;           // ffn_block: rows per block
constexpr int kMaxFfnWidth = 128;      // ffn_block: widest d_model / ffn_dim

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

// ffn_block shared memory (offsets in bytes): A pair [32][Dp + 8] (context, then norm2's
// rows), H pair [32][Fp + 8] (hidden rows), X [32][Dp + 4] fp32 (residual rows), C [32][Wp +
// 4] fp32 (accumulator tile), two weight buffers of two parts [Wp][Wp + 8]. Dp, Fp: d_model,
// ffn_dim rounded up to 32; Wp = max(Dp, Fp).
struct FfnLayout {
  int dp, fp, wp, lda, ldh, ldx, ldc, ldw;
  int a_hi, a_lo, h_hi, h_lo, x, c, w0_hi, w0_lo, w1_hi, w1_lo, bytes;
};

__host__ __device__ inline FfnLayout ffn_layout(int d, int f) {
  FfnLayout l;
  l.dp = pad_to(d, 32);
  l.fp = pad_to(f, 32);
  l.wp = l.dp > l.fp ? l.dp : l.fp;
  l.lda = l.dp + 8;
  l.ldh = l.fp + 8;
  l.ldx = l.dp + 4;
  l.ldc = l.wp + 4;
  l.ldw = l.wp + 8;
  l.a_hi = 0;
  l.a_lo = l.a_hi + kFfnRows * l.lda * 2;
  l.h_hi = l.a_lo + kFfnRows * l.lda * 2;
  l.h_lo = l.h_hi + kFfnRows * l.ldh * 2;
  l.x = l.h_lo + kFfnRows * l.ldh * 2;
  l.c = l.x + kFfnRows * l.ldx * 4;
  l.w0_hi = l.c + kFfnRows * l.ldc * 4;
  l.w0_lo = l.w0_hi + l.wp * l.ldw * 2;
  l.w1_hi = l.w0_lo + l.wp * l.ldw * 2;
  l.w1_lo = l.w1_hi + l.wp * l.ldw * 2;
  l.bytes = l.w1_lo + l.wp * l.ldw * 2;
  return l;
}

// c [32][n_pad] = a [32][k_pad] @ w [n_pad][k_pad]^T with three fp16 products per step
// (lo*hi + hi*lo + hi*hi); 4 warps, each 16 rows x n_pad / 2 columns (n_pad a multiple of
// 32, at most 128).
__device__ __forceinline__ void gemm3(const __half* a_hi, const __half* a_lo, int lda,
                                      const __half* w_hi, const __half* w_lo, int ldw,
                                      int k_pad, int n_pad, float* c, int ldc) {
  constexpr int kMaxFrags = kMaxFfnWidth / 32;
  const int warp = threadIdx.x / 32;
  const int wm = warp / 2, wn = warp % 2;
  const int cols = n_pad / 2, frags = cols / 16;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kMaxFrags];
#pragma unroll
  for (int j = 0; j < kMaxFrags; ++j) wmma::fill_fragment(acc[j], 0.f);
  for (int k = 0; k < k_pad; k += 16) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> ah, al;
    wmma::load_matrix_sync(ah, a_hi + (wm * 16) * lda + k, lda);
    wmma::load_matrix_sync(al, a_lo + (wm * 16) * lda + k, lda);
#pragma unroll
    for (int j = 0; j < kMaxFrags; ++j) {
      if (j >= frags) break;
      const int n = wn * cols + j * 16;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> bh, bl;
      wmma::load_matrix_sync(bh, w_hi + n * ldw + k, ldw);
      wmma::load_matrix_sync(bl, w_lo + n * ldw + k, ldw);
      wmma::mma_sync(acc[j], al, bh, acc[j]);
      wmma::mma_sync(acc[j], ah, bl, acc[j]);
      wmma::mma_sync(acc[j], ah, bh, acc[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < kMaxFrags; ++j) {
    if (j >= frags) break;
    wmma::store_matrix_sync(c + (wm * 16) * ldc + wn * cols + j * 16, acc[j], ldc,
                            wmma::mem_row_major);
  }
}

// LayerNorm of the rows of x [32][ld] (first d columns) for the calling warp's rows; each
// result y goes to put(r, c, y) (columns d..d_pad get put(r, c, 0)).
template <typename Put>
__device__ __forceinline__ void norm_rows(const float* x, int ld, int d, int d_pad,
                                          const float* w, const float* b, float eps, Put put) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = warp; r < kFfnRows; r += kThreads / 32) {
    const float2 stats = row_stats(x + r * ld, d, eps, lane);
    for (int c = lane; c < d_pad; c += 32) {
      put(r, c, c < d ? (x[r * ld + c] - stats.x) * stats.y * w[c] + b[c] : 0.f);
    }
  }
}

// FfnBlockParams; grid (row blocks of 32); block 128 threads; dynamic shared
// ffn_layout(D, F).bytes (about 200 KB at width 128: one block per SM, hence the register
// bound of one block). T: the output type with the final norm (float without it).
template <typename T, bool FINAL>
__global__ void __launch_bounds__(kThreads, 1) ffn_block_kernel(FfnBlockParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const FfnLayout L = ffn_layout(p.D, p.F);
  __half* a_hi = reinterpret_cast<__half*>(smem + L.a_hi);
  __half* a_lo = reinterpret_cast<__half*>(smem + L.a_lo);
  __half* h_hi = reinterpret_cast<__half*>(smem + L.h_hi);
  __half* h_lo = reinterpret_cast<__half*>(smem + L.h_lo);
  float* x_s = reinterpret_cast<float*>(smem + L.x);
  float* c_s = reinterpret_cast<float*>(smem + L.c);
  __half* w0_hi = reinterpret_cast<__half*>(smem + L.w0_hi);
  __half* w0_lo = reinterpret_cast<__half*>(smem + L.w0_lo);
  __half* w1_hi = reinterpret_cast<__half*>(smem + L.w1_hi);
  __half* w1_lo = reinterpret_cast<__half*>(smem + L.w1_lo);
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * kFfnRows;
  const int64_t rows_left = p.M - m0;
  const int D = p.D, F = p.F;

  // Group 0: the context rows and out_proj's weight; group 1: ffn_in's weight.
  copy_tile_async(a_hi, L.lda, p.ctx_hi + m0 * D, D, kFfnRows, L.dp, rows_left, D);
  copy_tile_async(a_lo, L.lda, p.ctx_lo + m0 * D, D, kFfnRows, L.dp, rows_left, D);
  copy_tile_async(w0_hi, L.ldw, p.wo_hi, D, L.dp, L.dp, D, D);
  copy_tile_async(w0_lo, L.ldw, p.wo_lo, D, L.dp, L.dp, D, D);
  cp_async_commit();
  copy_tile_async(w1_hi, L.ldw, p.wi_hi, D, L.fp, L.dp, F, D);
  copy_tile_async(w1_lo, L.ldw, p.wi_lo, D, L.fp, L.dp, F, D);
  cp_async_commit();

  // out_proj, then x = residual + (valid ? attention + bias : 0).
  cp_async_wait<1>();
  __syncthreads();
  gemm3(a_hi, a_lo, L.lda, w0_hi, w0_lo, L.ldw, L.dp, L.dp, c_s, L.ldc);
  __syncthreads();
  // Group 2: ffn_out's weight into the buffer out_proj is done with.
  copy_tile_async(w0_hi, L.ldw, p.wf_hi, F, L.dp, L.fp, D, F);
  copy_tile_async(w0_lo, L.ldw, p.wf_lo, F, L.dp, L.fp, D, F);
  cp_async_commit();
  for (int e = threadIdx.x; e < kFfnRows * L.dp; e += kThreads) {
    const int r = e / L.dp, c = e % L.dp;
    float x = 0.f;
    if (r < rows_left && c < D) {
      const int64_t row = m0 + r;
      const bool valid = p.valid == nullptr || p.valid[row] != 0;
      x = p.residual[row * D + c] + (valid ? c_s[r * L.ldc + c] + p.bo[c] : 0.f);
    }
    x_s[r * L.ldx + c] = x;
  }
  __syncthreads();

  // norm2 into the A pair (the context is no longer needed).
  norm_rows(x_s, L.ldx, D, L.dp, p.n2_w, p.n2_b, p.eps, [&](int r, int c, float y) {
    split_half(y, a_hi[r * L.lda + c], a_lo[r * L.lda + c]);
  });
  cp_async_wait<1>();
  __syncthreads();

  // ffn_in + bias + GELU into the H pair.
  gemm3(a_hi, a_lo, L.lda, w1_hi, w1_lo, L.ldw, L.dp, L.fp, c_s, L.ldc);
  __syncthreads();
  for (int e = threadIdx.x; e < kFfnRows * L.fp; e += kThreads) {
    const int r = e / L.fp, c = e % L.fp;
    const float h = c < F ? gelu(c_s[r * L.ldc + c] + p.bi[c]) : 0.f;
    split_half(h, h_hi[r * L.ldh + c], h_lo[r * L.ldh + c]);
  }
  cp_async_wait<0>();
  __syncthreads();

  // ffn_out + bias + residual; invalid rows 0; then the final norm or the fp32 rows out.
  gemm3(h_hi, h_lo, L.ldh, w0_hi, w0_lo, L.ldw, L.fp, L.dp, c_s, L.ldc);
  __syncthreads();
  for (int e = threadIdx.x; e < kFfnRows * L.dp; e += kThreads) {
    const int r = e / L.dp, c = e % L.dp;
    if (r >= rows_left || c >= D) continue;
    const int64_t row = m0 + r;
    const bool valid = p.valid == nullptr || p.valid[row] != 0;
    const float y = valid ? x_s[r * L.ldx + c] + c_s[r * L.ldc + c] + p.bf[c] : 0.f;
    if (FINAL) {
      x_s[r * L.ldx + c] = y;
    } else {
      static_cast<float*>(p.out)[row * D + c] = y;
    }
  }
  if (FINAL) {
    __syncthreads();
    T* out = static_cast<T*>(p.out);
    norm_rows(x_s, L.ldx, D, D, p.fn_w, p.fn_b, p.eps, [&](int r, int c, float y) {
      if (r >= rows_left) return;
      const int64_t row = m0 + r;
      const bool valid = p.valid == nullptr || p.valid[row] != 0;
      store_from_float(out, row * D + c, valid ? y : 0.f);
    });
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
  norm_qkv_kernel<T><<<grid, kThreads, bytes, stream>>>(p);
  return {cudaGetLastError(), name};
}

template <typename T, bool FINAL>
LaunchResult launch_ffn(const FfnBlockParams& p, cudaStream_t stream, const char* name) {
  const int bytes = ffn_layout(p.D, p.F).bytes;
  cudaError_t err = allow_shared(ffn_block_kernel<T, FINAL>, bytes);
  if (err != cudaSuccess) return {err, name};
  const dim3 grid(static_cast<unsigned>((p.M + kFfnRows - 1) / kFfnRows));
  ffn_block_kernel<T, FINAL><<<grid, kThreads, bytes, stream>>>(p);
  return {cudaGetLastError(), name};
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
  if (p.fn_w == nullptr) return launch_ffn<float, false>(p, stream, "ffn_block_kernel");
  switch (p.out_type) {
    case DType::kFloat32:
      return launch_ffn<float, true>(p, stream, "ffn_block_kernel<float, final>");
    case DType::kFloat16:
      return launch_ffn<__half, true>(p, stream, "ffn_block_kernel<half, final>");
    case DType::kBFloat16:
      return launch_ffn<__nv_bfloat16, true>(p, stream, "ffn_block_kernel<bfloat16, final>");
  }
  return {cudaErrorInvalidValue, "ffn_block_kernel (unknown output type)"};
}

int ffn_block_smem_bytes(int d_model, int ffn_dim) { return ffn_layout(d_model, ffn_dim).bytes; }

}  // namespace lbw
