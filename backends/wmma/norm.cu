// LayerNorm kernels: one warp per row, fp32 statistics (two passes over the row).
// norm_split_kernel reads the row three times (two statistics passes and the output pass,
// element by element); norm_split_registers_kernel, for rows of up to 1024 elements in
// groups of 4 with aligned pointers, reads it once by 8- or 16-byte loads into registers.
#include "common.cuh"

namespace lbw {
namespace {

constexpr int kRowsPerBlock = 8;  // warps per block, one row each

// NormSplitParams: x [rows, cols] (T) -> hi, lo [rows, cols] fp16, copy [rows, cols] fp32.
template <typename T>
__global__ void __launch_bounds__(kRowsPerBlock * 32) norm_split_kernel(NormSplitParams p) {
  start_after_previous();
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= p.rows) return;
  const T* x = static_cast<const T*>(p.x) + row * p.cols;
  const float2 stats = row_stats(x, p.cols, p.eps, lane);
  const int64_t base = row * p.cols;
  for (int c = lane; c < p.cols; c += 32) {
    const float v = load_as_float(x, c);
    if (p.copy) p.copy[base + c] = v;
    const float y = (v - stats.x) * stats.y * p.weight[c] + p.bias[c];
    __half hi, lo;
    split_half(y, hi, lo);
    p.hi[base + c] = hi;
    if (p.lo) p.lo[base + c] = lo;
  }
}

// Four consecutive elements of a row as floats (16-byte load for fp32, 8-byte otherwise).
__device__ __forceinline__ float4 load4(const float* x) {
  return *reinterpret_cast<const float4*>(x);
}
__device__ __forceinline__ float4 load4(const __half* x) {
  const uint2 u = *reinterpret_cast<const uint2*>(x);
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
  return make_float4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ float4 load4(const __nv_bfloat16* x) {
  const uint2 u = *reinterpret_cast<const uint2*>(x);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
  return make_float4(a.x, a.y, b.x, b.y);
}

// Four halves to 8-byte aligned dst in one store.
__device__ __forceinline__ void store4(__half* dst, const __half (&h)[4]) {
  uint2 u;
  u.x = static_cast<unsigned>(__half_as_ushort(h[0])) |
        static_cast<unsigned>(__half_as_ushort(h[1])) << 16;
  u.y = static_cast<unsigned>(__half_as_ushort(h[2])) |
        static_cast<unsigned>(__half_as_ushort(h[3])) << 16;
  *reinterpret_cast<uint2*>(dst) = u;
}

// norm_split_kernel's result with the row in registers: lane l holds the groups of 4
// columns l, l + 32, ... (VECS of them; cols % 4 == 0, cols <= 128 VECS); x, weight, bias
// and copy 16-byte aligned rows and groups for fp32, x 8-byte for fp16/bf16, hi and lo
// 8-byte (launch_norm_split checks). Statistics: the same two passes, over the registers.
template <typename T, int VECS>
__global__ void __launch_bounds__(kRowsPerBlock * 32)
norm_split_registers_kernel(NormSplitParams p) {
  start_after_previous();
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= p.rows) return;
  const int64_t base = row * p.cols;
  const T* x = static_cast<const T*>(p.x) + base;
  float v[VECS][4];
#pragma unroll
  for (int q = 0; q < VECS; ++q) {
    const int c = 4 * (lane + 32 * q);
    const float4 f = c < p.cols ? load4(x + c) : make_float4(0.f, 0.f, 0.f, 0.f);
    v[q][0] = f.x, v[q][1] = f.y, v[q][2] = f.z, v[q][3] = f.w;
  }
  float sum = 0.f;
#pragma unroll
  for (int q = 0; q < VECS; ++q)
#pragma unroll
    for (int e = 0; e < 4; ++e) sum += v[q][e];  // 0 past cols
  const float mean = warp_sum(sum) / p.cols;
  float sq = 0.f;
#pragma unroll
  for (int q = 0; q < VECS; ++q) {
    if (4 * (lane + 32 * q) >= p.cols) continue;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float d = v[q][e] - mean;
      sq += d * d;
    }
  }
  const float rstd = 1.f / sqrtf(warp_sum(sq) / p.cols + p.eps);
#pragma unroll
  for (int q = 0; q < VECS; ++q) {
    const int c = 4 * (lane + 32 * q);
    if (c >= p.cols) continue;
    if (p.copy)
      *reinterpret_cast<float4*>(p.copy + base + c) =
          make_float4(v[q][0], v[q][1], v[q][2], v[q][3]);
    const float4 w = *reinterpret_cast<const float4*>(p.weight + c);
    const float4 b = *reinterpret_cast<const float4*>(p.bias + c);
    const float ws[4] = {w.x, w.y, w.z, w.w}, bs[4] = {b.x, b.y, b.z, b.w};
    __half hi[4], lo[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) split_half((v[q][e] - mean) * rstd * ws[e] + bs[e], hi[e], lo[e]);
    store4(p.hi + base + c, hi);
    if (p.lo) store4(p.lo + base + c, lo);
  }
}

// NormOutParams: x [rows, cols] fp32 -> out [rows, cols] (T); rows with valid 0 are 0.
template <typename T>
__global__ void __launch_bounds__(kRowsPerBlock * 32) norm_out_kernel(NormOutParams p) {
  start_after_previous();
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= p.rows) return;
  const float* x = p.x + row * p.cols;
  T* out = static_cast<T*>(p.out);
  const int64_t base = row * p.cols;
  if (p.valid && !p.valid[row]) {
    for (int c = lane; c < p.cols; c += 32) store_from_float(out, base + c, 0.f);
    return;
  }
  const float2 stats = row_stats(x, p.cols, p.eps, lane);
  for (int c = lane; c < p.cols; c += 32) {
    store_from_float(out, base + c, (x[c] - stats.x) * stats.y * p.weight[c] + p.bias[c]);
  }
}

unsigned row_blocks(int64_t rows) {
  return static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
}

// Whether norm_split_registers_kernel takes p (see its alignment rules).
bool registers_apply(const NormSplitParams& p) {
  auto aligned = [](const void* q, uintptr_t bytes) {
    return (reinterpret_cast<uintptr_t>(q) & (bytes - 1)) == 0;
  };
  const uintptr_t x_bytes = p.x_type == DType::kFloat32 ? 16 : 8;
  return p.in_registers && p.cols % 4 == 0 && p.cols <= 1024 && aligned(p.x, x_bytes) &&
         aligned(p.weight, 16) && aligned(p.bias, 16) && aligned(p.hi, 8) &&
         aligned(p.lo, 8) && aligned(p.copy, 16);
}

template <typename T>
LaunchResult launch_norm_split_registers(const NormSplitParams& p, dim3 grid, dim3 block,
                                         cudaStream_t stream, const char* name) {
  auto kernel = p.cols <= 128   ? norm_split_registers_kernel<T, 1>
                : p.cols <= 256 ? norm_split_registers_kernel<T, 2>
                : p.cols <= 512 ? norm_split_registers_kernel<T, 4>
                                : norm_split_registers_kernel<T, 8>;
  return {launch_kernel(kernel, grid, block, 0, stream, p), name};
}

}  // namespace

LaunchResult launch_norm_split(const NormSplitParams& p, cudaStream_t stream) {
  const dim3 grid(row_blocks(p.rows)), block(kRowsPerBlock * 32);
  if (registers_apply(p)) {
    switch (p.x_type) {
      case DType::kFloat32:
        return launch_norm_split_registers<float>(p, grid, block, stream,
                                                  "norm_split_registers_kernel<float>");
      case DType::kFloat16:
        return launch_norm_split_registers<__half>(p, grid, block, stream,
                                                   "norm_split_registers_kernel<half>");
      case DType::kBFloat16:
        return launch_norm_split_registers<__nv_bfloat16>(
            p, grid, block, stream, "norm_split_registers_kernel<bfloat16>");
    }
  }
  switch (p.x_type) {
    case DType::kFloat32:
      return {launch_kernel(norm_split_kernel<float>, grid, block, 0, stream, p),
              "norm_split_kernel<float>"};
    case DType::kFloat16:
      return {launch_kernel(norm_split_kernel<__half>, grid, block, 0, stream, p),
              "norm_split_kernel<half>"};
    case DType::kBFloat16:
      return {launch_kernel(norm_split_kernel<__nv_bfloat16>, grid, block, 0, stream, p),
              "norm_split_kernel<bfloat16>"};
  }
  return {cudaErrorInvalidValue, "norm_split_kernel (unknown input type)"};
}

LaunchResult launch_norm_out(const NormOutParams& p, cudaStream_t stream) {
  const dim3 grid(row_blocks(p.rows)), block(kRowsPerBlock * 32);
  switch (p.out_type) {
    case DType::kFloat32:
      return {launch_kernel(norm_out_kernel<float>, grid, block, 0, stream, p),
              "norm_out_kernel<float>"};
    case DType::kFloat16:
      return {launch_kernel(norm_out_kernel<__half>, grid, block, 0, stream, p),
              "norm_out_kernel<half>"};
    case DType::kBFloat16:
      return {launch_kernel(norm_out_kernel<__nv_bfloat16>, grid, block, 0, stream, p),
              "norm_out_kernel<bfloat16>"};
  }
  return {cudaErrorInvalidValue, "norm_out_kernel (unknown output type)"};
}

}  // namespace lbw
