// LayerNorm of fp32 rows, one warp per row: to an fp16 (hi, lo) pair, to fp16 alone, or to
// fp32 with invalid rows zeroed.
#include "common.cuh"

namespace lb {

enum NormOut { PAIR = 0, ONE_HALF = 1, FLOAT = 2 };

constexpr int NORM_WARPS = 4;  // rows per block

// Row r of x ([M, D], D a multiple of 4, rows 16-byte aligned): y = (x - mean) / sqrt(var +
// eps) * weight + bias, the variance from a second pass over the row. PAIR writes hi and lo,
// ONE_HALF hi alone, FLOAT writes out_f, 0 on rows whose valid byte is 0 (valid may be null).
// Rows up to 128 HELD wide are read from global memory once, all of a lane's loads in
// flight together, and held in registers (HELD float4s a lane: 1, 2, 4 or 8, the fewest that
// hold the row, so that narrow rows keep few registers and many warps an SM); wider ones are
// read by each pass, at HELD 8 only (the kernels of fewer trap on them).
template <int OUT, int HELD>
__global__ void __launch_bounds__(NORM_WARPS * 32)
layer_norm(const float* __restrict__ x, long long x_stride, const float* __restrict__ weight,
           const float* __restrict__ bias, int M, int D, float eps,
           __half* __restrict__ out_hi, __half* __restrict__ out_lo, long long out_stride,
           float* __restrict__ out_f, const unsigned char* __restrict__ valid) {
    start_after_previous();
    const int row = blockIdx.x * NORM_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= M) return;
    const float4* src = reinterpret_cast<const float4*>(x + (long long)row * x_stride);
    const int quads = D / 4;
    constexpr bool STREAMS = HELD == 8;  // the one kernel for rows past 1024
    if (!STREAMS && quads > 32 * HELD) __trap();
    const bool held = !STREAMS || quads <= 32 * HELD;

    float4 v_held[HELD];
    float sum = 0.0f;
    if (held) {
#pragma unroll
        for (int i = 0; i < HELD; ++i) {
            const int q = lane + 32 * i;
            v_held[i] = q < quads ? src[q] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int i = 0; i < HELD; ++i) sum += quad_sum(v_held[i]);
    } else {
        for (int q = lane; q < quads; q += 32) sum += quad_sum(src[q]);
    }
    sum = warp_sum(sum);
    const float mean = sum / D;

    float sq = 0.0f;
    if (held) {
#pragma unroll
        for (int i = 0; i < HELD; ++i)  // past the row: padding, not summed
            if (lane + 32 * i < quads) sq += quad_square_sum(v_held[i], mean);
    } else {
        for (int q = lane; q < quads; q += 32) sq += quad_square_sum(src[q], mean);
    }
    sq = warp_sum(sq);
    const float rstd = rsqrtf(sq / D + eps);

    const bool keep = OUT != FLOAT || valid == nullptr || valid[row] != 0;
    const float4* w4 = reinterpret_cast<const float4*>(weight);
    const float4* b4 = reinterpret_cast<const float4*>(bias);
    const long long o = (long long)row * out_stride;
    // Normalise quad q (values v) of the row and store it.
    auto emit = [&](float4 v, int q) {
        const float4 n = normalize_quad(v, mean, rstd, w4[q], b4[q]);
        if (OUT == FLOAT) {
            reinterpret_cast<float4*>(out_f + o)[q] = keep ? n : make_float4(0, 0, 0, 0);
        } else {
            __half2 h[2], l[2];
            split_quad(n, h, l);
            __half2* hi = reinterpret_cast<__half2*>(out_hi + o + 4 * q);
            hi[0] = h[0];
            hi[1] = h[1];
            if (OUT == PAIR) {
                __half2* lo = reinterpret_cast<__half2*>(out_lo + o + 4 * q);
                lo[0] = l[0];
                lo[1] = l[1];
            }
        }
    };
    if (held) {
#pragma unroll
        for (int i = 0; i < HELD; ++i)
            if (lane + 32 * i < quads) emit(v_held[i], lane + 32 * i);
    } else {
        for (int q = lane; q < quads; q += 32) emit(src[q], q);
    }
}

}  // namespace lb
