// Launch parameters shared by the kernels (.cu) and the bindings (ops.cpp), and small device
// helpers. Every pointer is device memory; matrices are row-major and contiguous.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace lbw {

// Element type of a tensor that kernels read or write in more than one type.
enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// What the linear kernel does with each accumulator element v = (a @ w^T)[row, col].
enum class Epilogue : int {
  kHalf = 0,            // out_hi = half(v + bias)                                  (Q/K/V)
  kGeluPair = 1,        // (out_hi, out_lo) = split(gelu(v + bias))                 (ffn_in)
  kResidualUpdate = 2,  // out = residual + (valid ? v + bias : 0)                  (out_proj)
  kResidualSum = 3,     // out = valid ? residual + v + bias : 0                    (ffn_out)
};

// The result of one launch: the CUDA error (cudaSuccess if none) and the kernel's name.
struct LaunchResult {
  cudaError_t error;
  const char* kernel;
};

// norm_split: LayerNorm of each row, written as an fp16 (hi, lo) pair.
struct NormSplitParams {
  const void* x;          // [rows, cols] in x_type
  DType x_type;
  const float* weight;    // [cols] fp32
  const float* bias;      // [cols] fp32
  __half* hi;             // [rows, cols] fp16: half(y)
  __half* lo;             // [rows, cols] fp16: half(y - hi), or null
  float* copy;            // [rows, cols] fp32 copy of x, or null
  int64_t rows;
  int cols;
  float eps;
  bool in_registers;      // the row-in-registers kernel where it applies (launch_norm_split)
};

// norm_out: LayerNorm of each fp32 row into the output type; invalid rows written as 0.
struct NormOutParams {
  const float* x;         // [rows, cols] fp32
  const float* weight;    // [cols] fp32
  const float* bias;      // [cols] fp32
  void* out;              // [rows, cols] in out_type
  DType out_type;
  const uint8_t* valid;   // [rows] uint8 (nonzero = valid token), or null (all valid)
  int64_t rows;
  int cols;
  float eps;
};

// linear: out[M, N] = epilogue(a[M, K] @ w[N, K]^T + bias) on the tensor cores.
struct LinearParams {
  const __half* a_hi;     // [M, K] fp16 high part of the activations
  const __half* a_lo;     // [M, K] fp16 low part (two or three products), else null
  const __half* w_hi;     // [N, K] fp16 high part of the weight (PyTorch's [out, in] layout)
  const __half* w_lo;     // [N, K] fp16 low part (three products), else null
  const float* bias;      // [N] fp32
  const float* residual;  // [M, N] fp32 (residual epilogues; may alias out_f32), else null
  const uint8_t* valid;   // [M] uint8 (nonzero = valid token), or null (all valid)
  float* out_f32;         // [M, N] fp32 (residual epilogues), else null
  __half* out_hi;         // [M, N] fp16 (kHalf, kGeluPair), else null
  __half* out_lo;         // [M, N] fp16 (kGeluPair), else null
  int64_t M;
  int N;
  int K;                  // a multiple of 8
};

// The norm epilogue of linear (launch_linear's norm): LayerNorm of each output row of a
// residual epilogue (linear_stream with N at most the tile's columns: one CTA holds whole
// rows). The row is the fp32 value the epilogue writes to out_f32 (out_f32 may then be null:
// the rows are only normalised). A separate kernel argument: more LinearParams fields make
// ptxas spill in the plain kernels.
struct LinearNormParams {
  const float* weight;    // [N] fp32
  const float* bias;      // [N] fp32
  void* out;              // [M, N] in out_type (fp16: the high part); may alias a_hi / a_lo
  __half* lo;             // [M, N] fp16 low part (out_type fp16), or null
  DType out_type;
  int zero_invalid;       // 1: rows with valid 0 are written as 0 (the final norm)
  float eps;
};

// attention: flash attention of every (sequence, head) from the packed Q/K/V rows.
struct AttentionParams {
  const __half* qkv;      // [batch * seq_len, 3 * d_model] fp16: q | k | v, head h at h * head_dim
  __half* ctx_hi;         // [batch * seq_len, d_model] fp16 high part of the context
  __half* ctx_lo;         // [batch * seq_len, d_model] fp16 low part of the context
  const uint8_t* valid;   // [batch, seq_len] uint8 (nonzero = valid key), or null (all valid)
  int batch;
  int seq_len;
  int heads;
  int head_dim;           // a multiple of 8, at most 256
  int head_pad;           // head_dim rounded up to a multiple of 16
  int causal;             // 1: key j is visible to query i only if j <= i
  float scale_log2;       // head_dim ** -0.5 * log2(e): scores go through exp2
};

// norm_qkv: LayerNorm of whole rows in the GEMM prologue, then Q/K/V = normed @ w^T + bias
// with one fp16 product (d_model up to 256).
struct NormQkvParams {
  const void* x;          // [M, K] in x_type: the block's input rows
  DType x_type;
  const float* norm_w;    // [K] fp32 norm1 weight
  const float* norm_b;    // [K] fp32 norm1 bias
  const __half* w;        // [N, K] fp16 (hi part of the fused Q/K/V weight)
  const float* bias;      // [N] fp32
  __half* out;            // [M, N] fp16 Q/K/V rows
  float* copy;            // [M, K] fp32 copy of x (written by the first column block), or null
  int64_t M;
  int N;
  int K;                  // a multiple of 8, at most 256
  float eps;
};

// ffn_block: from the attention context to the block's output rows for 64 whole rows
// (d_model and ffn_dim up to 128): out_proj + bias, invalid rows zeroed, residual; norm2;
// ffn_in + bias + exact GELU; ffn_out + bias + residual, invalid rows zeroed; then,
// optionally, a LayerNorm of the output rows (the final norm, or the next block's norm1).
// One fp16 product per step (ctx_lo null), or two (activations split, weights rounded once);
// the hidden rows stay in shared memory.
struct FfnBlockParams {
  const __half* ctx_hi;   // [M, D] fp16 high part of the attention context
  const __half* ctx_lo;   // [M, D] fp16 low part, or null (one product)
  const float* residual;  // [M, D] fp32 block input rows (may alias out_rows)
  const uint8_t* valid;   // [M] uint8 (nonzero = valid token), or null (all valid)
  const __half* wo;       // [D, D] fp16 out_proj weight
  const float* bo;        // [D] fp32
  const float* n2_w;      // [D] fp32 norm2 weight
  const float* n2_b;      // [D] fp32 norm2 bias
  const __half* wi;       // [F, D] fp16 ffn_in weight
  const float* bi;        // [F] fp32
  const __half* wf;       // [D, F] fp16 ffn_out weight
  const float* bf;        // [D] fp32
  float* out_rows;        // [M, D] fp32 block output rows, or null
  const float* norm_w;    // [D] fp32 weight of the output rows' norm, or null (no norm)
  const float* norm_b;    // [D] fp32 its bias
  void* normed;           // [M, D] the normed output rows in normed_type
  DType normed_type;
  bool zero_invalid;      // invalid rows of normed are 0 (the final norm)
  int64_t M;
  int D;                  // multiples of 8, at most 128
  int F;
  float eps;
};

// GEMM variants the host passes down (tiles.py GEMM_TILES describes each; linear.cuh sets
// their stages): kTiled* take any K, one output tile per CTA (kTiled128x128k64w4pp: a
// persistent grid, each CTA taking tiles in turn); kStream* (K <= 128) are persistent, with
// a weight column slice resident in shared memory (kStream128x128w8r: its fragments
// resident in registers too, with one or two products).
enum class GemmTile : int {
  kTiled128x128 = 0, kTiled128x256 = 1, kTiled128x128w4 = 2, kTiled128x128k64 = 3,
  kTiled64x64 = 4, kTiled32x32 = 5, kStream128x128 = 6, kStream64x128 = 7, kStream64x64 = 8,
  kStream32x128 = 9, kTiled128x128k64w4p = 10, kStream128x128w8r = 11,
  kTiled128x128k64w4pp = 12
};
constexpr int kGemmTiles = 13;  // number of GemmTile values

LaunchResult launch_norm_split(const NormSplitParams& p, cudaStream_t stream);
LaunchResult launch_norm_out(const NormOutParams& p, cudaStream_t stream);
LaunchResult launch_linear(const LinearParams& p, GemmTile tile, int products,
                           Epilogue epilogue, cudaStream_t stream,
                           const LinearNormParams* norm = nullptr);  // norm: stream tiles
LaunchResult launch_attention(const AttentionParams& p, int block_n, cudaStream_t stream);
int attention_smem_bytes(int head_pad, int block_n);  // dynamic shared memory of one block
// Register-resident flash attention (attention.cu): variants 0 .. attention_variant_count() - 1
// by name; each runs the instance for the call's head_pad (the smallest of 32, 64, 128, 256
// that holds it). Their fragment-layout assumption is checked on the device by the probe,
// which writes 4 mismatch counts (all 0: the layout holds).
struct AttentionInstanceInfo {
  const char* name;       // kernel name, null if the variant has no instance for the head_pad
  int head_pad, block_m, block_n, threads, smem_bytes;
};
int attention_variant_count();
const char* attention_variant_name(int variant);
AttentionInstanceInfo attention_instance(int variant, int head_pad);
LaunchResult launch_flash_attention(const AttentionParams& p, int variant, cudaStream_t stream);
LaunchResult launch_attention_layout_probe(int* mismatches, cudaStream_t stream);
// peak.cu: blocks x threads threads, each warp running iters rounds of kPeakChains
// register-resident 16x16x16 products; out [blocks * threads] fp32.
constexpr int kPeakChains = 8;
LaunchResult launch_mma_peak(float* out, int blocks, int threads, int iters,
                             cudaStream_t stream);
LaunchResult launch_norm_qkv(const NormQkvParams& p, cudaStream_t stream);
LaunchResult launch_ffn_block(const FfnBlockParams& p, cudaStream_t stream);
int ffn_block_smem_bytes(int d_model, int ffn_dim);      // dynamic shared memory of one block

// Whether this host thread launches the forward kernels as programmatic dependents of the
// kernel before them in the stream (sm_90 on): each may begin launching while that kernel
// runs and waits for it in start_after_previous. Set by the bindings (ops.cpp).
bool programmatic_launches();

#ifdef __CUDACC__

// kernel<<<grid, block, smem_bytes, stream>>>(args...), as a programmatic dependent launch
// where programmatic_launches() holds (also inside a stream capture: the graph keeps the
// edge); the launch's error, else the last pending one (ops.cpp's check_launch clears it).
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, int smem_bytes,
                          cudaStream_t stream, const Args&... args) {
  cudaLaunchAttribute programmatic = {};
  programmatic.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  programmatic.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = static_cast<size_t>(smem_bytes);
  config.stream = stream;
  const bool on = programmatic_launches();
  config.attrs = on ? &programmatic : nullptr;
  config.numAttrs = on ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, args...);
  return err != cudaSuccess ? err : cudaGetLastError();
}

// In every forward kernel before any global memory access but copies of weights (which no
// kernel of the forward writes): wait until the kernel before it in the stream has finished
// and its writes are visible, then let the next kernel begin launching (griddepcontrol).
// Nothing to wait for in an ordinary launch; compiled to nothing below sm_90.
__device__ __forceinline__ void start_after_previous() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// 16-byte asynchronous copy global -> shared; src_bytes 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(dst), "l"(gmem), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
}

__device__ __forceinline__ float gelu(float x) {  // exact (erf) GELU
  return 0.5f * x * (1.f + erff(x * 0.70710678118654752f));
}

__device__ __forceinline__ float load_as_float(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load_as_float(const __half* p, int64_t i) {
  return __half2float(p[i]);
}
__device__ __forceinline__ float load_as_float(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}

__device__ __forceinline__ void store_from_float(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store_from_float(__half* p, int64_t i, float v) {
  p[i] = __float2half_rn(v);
}
__device__ __forceinline__ void store_from_float(__nv_bfloat16* p, int64_t i, float v) {
  p[i] = __float2bfloat16_rn(v);
}

// (mean, 1 / std) of the row x[0, cols) for the calling warp (two passes, fp32).
template <typename T>
__device__ __forceinline__ float2 row_stats(const T* x, int cols, float eps, int lane) {
  float sum = 0.f;
  for (int c = lane; c < cols; c += 32) sum += load_as_float(x, c);
  const float mean = warp_sum(sum) / cols;
  float sq = 0.f;
  for (int c = lane; c < cols; c += 32) {
    const float d = load_as_float(x, c) - mean;
    sq += d * d;
  }
  return make_float2(mean, 1.f / sqrtf(warp_sum(sq) / cols + eps));
}

// Copy a rows x cols tile of src (row stride ld_src elements, valid_rows x valid_cols of it
// real) into dst (row stride ld_dst) by 16-byte cp.async; the rest is zero-filled. cols and
// valid_cols are multiples of 16 bytes' worth of T.
template <typename T>
__device__ __forceinline__ void copy_tile_async(T* dst, int ld_dst, const T* src,
                                                int64_t ld_src, int rows, int cols,
                                                int64_t valid_rows, int valid_cols) {
  constexpr int kPerVec = 16 / sizeof(T);
  const int vecs = cols / kPerVec;
  // Piece v = r * vecs + q; the thread's (r, q) advance by blockDim.x pieces without a
  // division per piece.
  const int step_r = blockDim.x / vecs, step_q = blockDim.x % vecs;
  int r = threadIdx.x / vecs, q = threadIdx.x % vecs;
  for (; r < rows; r += step_r, q += step_q) {
    if (q >= vecs) {
      q -= vecs;
      ++r;
      if (r >= rows) break;
    }
    const int c = q * kPerVec;
    const bool ok = r < valid_rows && c < valid_cols;
    cp_async16(dst + r * ld_dst + c, ok ? src + r * ld_src + c : src, ok ? 16 : 0);
  }
}

// fp16 (hi, lo) parts of x: hi + lo == x to about 22 bits.
__device__ __forceinline__ void split_half(float x, __half& hi, __half& lo) {
  hi = __float2half_rn(x);
  lo = __float2half_rn(x - __half2float(hi));
}

#endif  // __CUDACC__

}  // namespace lbw
