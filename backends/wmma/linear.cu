// The linear layers: out = epilogue(a @ w^T + bias) on the tensor cores through nvcuda::wmma.
//
// fp16 operands, fp32 accumulators. With three products the fp32 operands arrive split into
// fp16 (hi, lo) parts and each tile step accumulates lo*hi + hi*lo + hi*hi (fp16x3: about
// fp32 accuracy); with one product only the hi parts are used. Operand tiles stream through
// two shared-memory stages filled by cp.async; the epilogue stores the accumulators to shared
// memory and applies bias, GELU, residual and invalid-row zeroing element by element.
#include <mma.h>

#include "common.cuh"

namespace lbw {
namespace {

using namespace nvcuda;

constexpr int kBK = 32;           // K per shared-memory stage
constexpr int kLds = kBK + 8;     // shared row stride of an operand tile (halves)

template <int BM, int BN, int WARPS_M, int WARPS_N, int PRODUCTS, int kStages>
struct Tile {
  static constexpr int kThreads = WARPS_M * WARPS_N * 32;
  static constexpr int kParts = PRODUCTS == 3 ? 2 : 1;         // hi (and lo) of each operand
  static constexpr int kFragsM = BM / WARPS_M / 16;            // 16x16 fragments per warp
  static constexpr int kFragsN = BN / WARPS_N / 16;
  static constexpr int kStageHalves = kParts * (BM + BN) * kLds;
  static constexpr int kLdc = BN + 4;                          // epilogue row stride (floats)
  static constexpr int kOperandBytes = kStages * kStageHalves * 2;
  static constexpr int kEpilogueBytes = BM * kLdc * 4;
  static constexpr int kSmemBytes =
      kOperandBytes > kEpilogueBytes ? kOperandBytes : kEpilogueBytes;
};

// Copy rows [row0, row0 + rows) x columns [k0, k0 + kBK) of src [limit, K] into dst
// [rows][kLds]; out-of-range vectors are zero-filled.
template <int ROWS, int THREADS>
__device__ __forceinline__ void load_tile(__half* dst, const __half* src, int64_t row0,
                                          int64_t limit, int K, int k0) {
  constexpr int kVecs = ROWS * (kBK / 8);
#pragma unroll
  for (int v = threadIdx.x; v < kVecs; v += THREADS) {
    const int r = v / (kBK / 8);
    const int c = (v % (kBK / 8)) * 8;
    const int64_t row = row0 + r;
    const bool ok = row < limit && k0 + c < K;
    const __half* from = ok ? src + row * K + k0 + c : src;
    cp_async16(dst + r * kLds + c, from, ok ? 16 : 0);
  }
}

// LinearParams; grid (M tiles, N tiles); block T::kThreads; dynamic shared T::kSmemBytes;
// STAGES operand tiles in flight.
template <int BM, int BN, int WARPS_M, int WARPS_N, int PRODUCTS, int EPILOGUE, int STAGES>
__global__ void __launch_bounds__(WARPS_M * WARPS_N * 32, 1)
linear_kernel(LinearParams p) {
  using T = Tile<BM, BN, WARPS_M, WARPS_N, PRODUCTS, STAGES>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __half* smem = reinterpret_cast<__half*>(smem_raw);

  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * BM;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * BN;
  const int warp = threadIdx.x / 32;
  const int wm = warp / WARPS_N, wn = warp % WARPS_N;

  // Stage layout: a_hi [BM][kLds], (a_lo), w_hi [BN][kLds], (w_lo).
  auto a_part = [&](int stage, int part) {
    return smem + stage * T::kStageHalves + part * BM * kLds;
  };
  auto w_part = [&](int stage, int part) {
    return smem + stage * T::kStageHalves + T::kParts * BM * kLds + part * BN * kLds;
  };
  auto load_stage = [&](int stage, int k0) {
    load_tile<BM, T::kThreads>(a_part(stage, 0), p.a_hi, m0, p.M, p.K, k0);
    load_tile<BN, T::kThreads>(w_part(stage, 0), p.w_hi, n0, p.N, p.K, k0);
    if (PRODUCTS == 3) {
      load_tile<BM, T::kThreads>(a_part(stage, 1), p.a_lo, m0, p.M, p.K, k0);
      load_tile<BN, T::kThreads>(w_part(stage, 1), p.w_lo, n0, p.N, p.K, k0);
    }
    cp_async_commit();
  };

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[T::kFragsM][T::kFragsN];
#pragma unroll
  for (int i = 0; i < T::kFragsM; ++i)
#pragma unroll
    for (int j = 0; j < T::kFragsN; ++j) wmma::fill_fragment(acc[i][j], 0.f);

  // One commit group per K tile (empty past the end): after the commit of iteration kt,
  // waiting until STAGES - 1 groups are pending means tile kt has landed.
  const int k_tiles = (p.K + kBK - 1) / kBK;
#pragma unroll
  for (int t = 0; t < STAGES - 1; ++t) {
    if (t < k_tiles) {
      load_stage(t, t * kBK);
    } else {
      cp_async_commit();
    }
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    const int ahead = kt + STAGES - 1;   // refills the stage computed in iteration kt - 1
    if (ahead < k_tiles) {
      load_stage(ahead % STAGES, ahead * kBK);
    } else {
      cp_async_commit();
    }
    cp_async_wait<STAGES - 1>();
    __syncthreads();
    const int stage = kt % STAGES;
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b_hi[T::kFragsN];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b_lo[T::kFragsN];
#pragma unroll
      for (int j = 0; j < T::kFragsN; ++j) {
        const int n = (wn * T::kFragsN + j) * 16;
        wmma::load_matrix_sync(b_hi[j], w_part(stage, 0) + n * kLds + kk, kLds);
        if (PRODUCTS == 3) wmma::load_matrix_sync(b_lo[j], w_part(stage, 1) + n * kLds + kk, kLds);
      }
#pragma unroll
      for (int i = 0; i < T::kFragsM; ++i) {
        const int m = (wm * T::kFragsM + i) * 16;
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a_hi, a_lo;
        wmma::load_matrix_sync(a_hi, a_part(stage, 0) + m * kLds + kk, kLds);
        if (PRODUCTS == 3) wmma::load_matrix_sync(a_lo, a_part(stage, 1) + m * kLds + kk, kLds);
#pragma unroll
        for (int j = 0; j < T::kFragsN; ++j) {
          if (PRODUCTS == 3) {
            wmma::mma_sync(acc[i][j], a_lo, b_hi[j], acc[i][j]);
            wmma::mma_sync(acc[i][j], a_hi, b_lo[j], acc[i][j]);
          }
          wmma::mma_sync(acc[i][j], a_hi, b_hi[j], acc[i][j]);
        }
      }
    }
    __syncthreads();  // the stage is refilled next iteration
  }

  // Epilogue: accumulators -> shared fp32 tile -> per element bias, GELU, residual, zeroing.
  float* c_tile = reinterpret_cast<float*>(smem_raw);
#pragma unroll
  for (int i = 0; i < T::kFragsM; ++i)
#pragma unroll
    for (int j = 0; j < T::kFragsN; ++j) {
      const int m = (wm * T::kFragsM + i) * 16, n = (wn * T::kFragsN + j) * 16;
      wmma::store_matrix_sync(c_tile + m * T::kLdc + n, acc[i][j], T::kLdc, wmma::mem_row_major);
    }
  __syncthreads();
  for (int e = threadIdx.x; e < BM * BN; e += T::kThreads) {
    const int r = e / BN, c = e % BN;
    const int64_t row = m0 + r, col = n0 + c;
    if (row >= p.M || col >= p.N) continue;
    const float v = c_tile[r * T::kLdc + c] + p.bias[col];
    const int64_t idx = row * p.N + col;
    if (EPILOGUE == static_cast<int>(Epilogue::kHalf)) {
      p.out_hi[idx] = __float2half_rn(v);
    } else if (EPILOGUE == static_cast<int>(Epilogue::kGeluPair)) {
      __half hi, lo;
      split_half(gelu(v), hi, lo);
      p.out_hi[idx] = hi;
      p.out_lo[idx] = lo;
    } else {
      const bool valid = p.valid == nullptr || p.valid[row] != 0;
      const float res = p.residual[idx];
      if (EPILOGUE == static_cast<int>(Epilogue::kResidualUpdate)) {
        p.out_f32[idx] = res + (valid ? v : 0.f);
      } else {
        p.out_f32[idx] = valid ? res + v : 0.f;
      }
    }
  }
}

template <int BM, int BN, int WARPS_M, int WARPS_N, int PRODUCTS, int EPILOGUE, int STAGES>
LaunchResult launch(const LinearParams& p, cudaStream_t stream, const char* name) {
  using T = Tile<BM, BN, WARPS_M, WARPS_N, PRODUCTS, STAGES>;
  auto kernel = linear_kernel<BM, BN, WARPS_M, WARPS_N, PRODUCTS, EPILOGUE, STAGES>;
  if (T::kSmemBytes > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes);
    if (err != cudaSuccess) return {err, name};
  }
  const dim3 grid(static_cast<unsigned>((p.M + BM - 1) / BM),
                  static_cast<unsigned>((p.N + BN - 1) / BN));
  kernel<<<grid, T::kThreads, T::kSmemBytes, stream>>>(p);
  return {cudaGetLastError(), name};
}

template <int PRODUCTS, int EPILOGUE>
LaunchResult launch_tile(const LinearParams& p, GemmTile tile, cudaStream_t stream) {
  switch (tile) {
    case GemmTile::k128x128:
      return launch<128, 128, 4, 2, PRODUCTS, EPILOGUE, 2>(p, stream, "linear_kernel<128x128>");
    case GemmTile::k64x64:
      return launch<64, 64, 2, 2, PRODUCTS, EPILOGUE, 2>(p, stream, "linear_kernel<64x64>");
    case GemmTile::k32x32:
      return launch<32, 32, 2, 2, PRODUCTS, EPILOGUE, 2>(p, stream, "linear_kernel<32x32>");
    case GemmTile::k128x128x3:
      return launch<128, 128, 4, 2, PRODUCTS, EPILOGUE, 3>(p, stream,
                                                            "linear_kernel<128x128, 3 stages>");
    case GemmTile::k64x64x3:
      return launch<64, 64, 2, 2, PRODUCTS, EPILOGUE, 3>(p, stream,
                                                          "linear_kernel<64x64, 3 stages>");
    case GemmTile::k32x32x3:
      return launch<32, 32, 2, 2, PRODUCTS, EPILOGUE, 3>(p, stream,
                                                          "linear_kernel<32x32, 3 stages>");
  }
  return {cudaErrorInvalidValue, "linear_kernel (unknown tile)"};
}

}  // namespace

LaunchResult launch_linear(const LinearParams& p, GemmTile tile, int products,
                           Epilogue epilogue, cudaStream_t stream) {
  constexpr int kHalf = static_cast<int>(Epilogue::kHalf);
  constexpr int kGelu = static_cast<int>(Epilogue::kGeluPair);
  constexpr int kUpdate = static_cast<int>(Epilogue::kResidualUpdate);
  constexpr int kSum = static_cast<int>(Epilogue::kResidualSum);
  if (products == 1 && epilogue == Epilogue::kHalf) return launch_tile<1, kHalf>(p, tile, stream);
  if (products == 3) {
    switch (epilogue) {
      case Epilogue::kHalf: break;  // Q/K/V: one product
      case Epilogue::kGeluPair: return launch_tile<3, kGelu>(p, tile, stream);
      case Epilogue::kResidualUpdate: return launch_tile<3, kUpdate>(p, tile, stream);
      case Epilogue::kResidualSum: return launch_tile<3, kSum>(p, tile, stream);
    }
  }
  return {cudaErrorInvalidValue, "linear_kernel (unsupported products/epilogue)"};
}

}  // namespace lbw
