// LayerNorm kernels: one warp per row, fp32 statistics (two passes over the row).
#include "common.cuh"

namespace lbw {
namespace {

constexpr int kRowsPerBlock = 8;  // warps per block, one row each

// NormSplitParams: x [rows, cols] (T) -> hi, lo [rows, cols] fp16, copy [rows, cols] fp32.
template <typename T>
__global__ void __launch_bounds__(kRowsPerBlock * 32) norm_split_kernel(NormSplitParams p) {
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

// NormOutParams: x [rows, cols] fp32 -> out [rows, cols] (T); rows with valid 0 are 0.
template <typename T>
__global__ void __launch_bounds__(kRowsPerBlock * 32) norm_out_kernel(NormOutParams p) {
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

}  // namespace

LaunchResult launch_norm_split(const NormSplitParams& p, cudaStream_t stream) {
  const dim3 grid(row_blocks(p.rows)), block(kRowsPerBlock * 32);
  switch (p.x_type) {
    case DType::kFloat32:
      norm_split_kernel<float><<<grid, block, 0, stream>>>(p);
      return {cudaGetLastError(), "norm_split_kernel<float>"};
    case DType::kFloat16:
      norm_split_kernel<__half><<<grid, block, 0, stream>>>(p);
      return {cudaGetLastError(), "norm_split_kernel<half>"};
    case DType::kBFloat16:
      norm_split_kernel<__nv_bfloat16><<<grid, block, 0, stream>>>(p);
      return {cudaGetLastError(), "norm_split_kernel<bfloat16>"};
  }
  return {cudaErrorInvalidValue, "norm_split_kernel (unknown input type)"};
}

LaunchResult launch_norm_out(const NormOutParams& p, cudaStream_t stream) {
  const dim3 grid(row_blocks(p.rows)), block(kRowsPerBlock * 32);
  switch (p.out_type) {
    case DType::kFloat32:
      norm_out_kernel<float><<<grid, block, 0, stream>>>(p);
      return {cudaGetLastError(), "norm_out_kernel<float>"};
    case DType::kFloat16:
      norm_out_kernel<__half><<<grid, block, 0, stream>>>(p);
      return {cudaGetLastError(), "norm_out_kernel<half>"};
    case DType::kBFloat16:
      norm_out_kernel<__nv_bfloat16><<<grid, block, 0, stream>>>(p);
      return {cudaGetLastError(), "norm_out_kernel<bfloat16>"};
  }
  return {cudaErrorInvalidValue, "norm_out_kernel (unknown output type)"};
}

}  // namespace lbw
