// The tensor-core ceiling of nvcuda::wmma on the device: every warp multiplies fragments held
// in registers, kPeakChains independent accumulators in turn, with no memory traffic in the
// loop, so its time is the rate at which the SMs issue and retire mma.sync (16x16x16 fp16
// operands, fp32 accumulators: two HMMA.16816 each). The kernels of the stack are measured
// against it (bench/wmma_sweep.py peak).
#include <mma.h>

#include "common.cuh"

namespace lbw {
namespace {

using namespace nvcuda;

// grid blocks, block threads (a multiple of 32); out [blocks * threads] receives each
// thread's accumulator sum (so that no product can be dropped).
__global__ void mma_peak_kernel(float* out, int iters) {
  __shared__ __align__(128) __half tile[256];
  for (int e = threadIdx.x; e < 256; e += blockDim.x) tile[e] = __float2half_rn((e % 7) * 1e-3f);
  __syncthreads();
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b;
  wmma::load_matrix_sync(a, tile, 16);
  wmma::load_matrix_sync(b, tile, 16);
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kPeakChains];
#pragma unroll
  for (int j = 0; j < kPeakChains; ++j) wmma::fill_fragment(acc[j], 0.f);
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int j = 0; j < kPeakChains; ++j) wmma::mma_sync(acc[j], a, b, acc[j]);
  }
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < kPeakChains; ++j) {
#pragma unroll
    for (int i = 0; i < acc[j].num_elements; ++i) sum += acc[j].x[i];
  }
  out[static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x] = sum;
}

}  // namespace

LaunchResult launch_mma_peak(float* out, int blocks, int threads, int iters,
                             cudaStream_t stream) {
  mma_peak_kernel<<<blocks, threads, 0, stream>>>(out, iters);
  return {cudaGetLastError(), "mma_peak_kernel"};
}

}  // namespace lbw
