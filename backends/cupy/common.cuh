// PTX-level building blocks of the cupy kernels: cp.async copies, ldmatrix fragment loads,
// mma.sync tensor-core products, fp16 pair splitting and exact GELU. sm_80 and later.
#pragma once
#include <cuda_fp16.h>

namespace lb {

// 16 bytes global -> shared, asynchronously; when valid is false the 16 bytes are zero-filled
// and nothing is read (src must still be a mapped address: pass the tensor's base).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    int bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(dst), "l"(gmem), "r"(bytes));
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::);
}

// Wait until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
}

// Four 8x8 fp16 matrices from shared memory; lane l gives the address of row (l % 8) of
// matrix l / 8, and receives in r[i] its two elements of matrix i (row l / 4, columns
// 2 (l % 4) and 2 (l % 4) + 1), or with trans those of the transposed matrix.
__device__ __forceinline__ void ldmatrix_x4(unsigned r[4], const void* smem) {
    unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned r[4], const void* smem) {
    unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// d += a (16x16, row-major fragment) * b (16x8, column-major fragment), fp32 accumulators.
// Fragments (g = lane / 4, t = lane % 4): a[0] row g cols 2t..2t+1, a[1] row g+8, a[2] row g
// cols 2t+8.., a[3] row g+8 cols 2t+8..; b[0] k 2t..2t+1 col g, b[1] k 2t+8..; d[0..1] row g
// cols 2t..2t+1, d[2..3] row g+8.
__device__ __forceinline__ void mma16816(float d[4], const unsigned a[4], const unsigned b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Two floats as one register of two fp16 (the first in the low half).
__device__ __forceinline__ unsigned pack_half2(float x, float y) {
    __half2 h = __floats2half2_rn(x, y);
    return *reinterpret_cast<unsigned*>(&h);
}

// x = hi + lo in fp16, to about 22 bits.
__device__ __forceinline__ void split_half(float x, __half& hi, __half& lo) {
    hi = __float2half_rn(x);
    lo = __float2half_rn(x - __half2float(hi));
}

// The fp16 tiles a GEMM stage holds per operand: A's hi half and, past one product, its lo
// half; W's hi half and, at three products, its lo half (products 1, 2 or 3).
__host__ __device__ constexpr int a_parts(int products) { return products > 1 ? 2 : 1; }
__host__ __device__ constexpr int w_parts(int products) { return products == 3 ? 2 : 1; }

// The first ALIGN-aligned byte of dynamic shared memory dynamic: its shared-window address,
// and (aligned) its generic pointer.
template <int ALIGN>
__device__ __forceinline__ unsigned align_shared(unsigned char* dynamic,
                                                 unsigned char*& aligned) {
    const unsigned raw = static_cast<unsigned>(__cvta_generic_to_shared(dynamic));
    const unsigned base = (raw + ALIGN - 1) & ~static_cast<unsigned>(ALIGN - 1);
    aligned = dynamic + (base - raw);
    return base;
}

// The sum of v over the warp's 32 lanes, every lane getting it (a butterfly of shuffles).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Two fp16 values as one 32-bit word, a first (the lower address).
__device__ __forceinline__ unsigned pack_halves(__half a, __half b) {
    const __half2 h = __halves2half2(a, b);
    return *reinterpret_cast<const unsigned*>(&h);
}

// y's four values split into fp16 (hi, lo) pairs (split_half), packed two to a __half2.
__device__ __forceinline__ void split_quad(float4 y, __half2 (&hi)[2], __half2 (&lo)[2]) {
    __half h[4], l[4];
    split_half(y.x, h[0], l[0]);
    split_half(y.y, h[1], l[1]);
    split_half(y.z, h[2], l[2]);
    split_half(y.w, h[3], l[3]);
    hi[0] = __halves2half2(h[0], h[1]);
    hi[1] = __halves2half2(h[2], h[3]);
    lo[0] = __halves2half2(l[0], l[1]);
    lo[1] = __halves2half2(l[2], l[3]);
}

// The sum of v's four values, and of their squared distances from mean (LayerNorm's two
// passes: norm.cu, and linear_wgmma.cu's norm prologue).
__device__ __forceinline__ float quad_sum(float4 v) { return (v.x + v.y) + (v.z + v.w); }

__device__ __forceinline__ float quad_square_sum(float4 v, float mean) {
    const float a = v.x - mean, b = v.y - mean, c = v.z - mean, d = v.w - mean;
    return (a * a + b * b) + (c * c + d * d);
}

// LayerNorm of the four values v: (v - mean) * rstd * w + b.
__device__ __forceinline__ float4 normalize_quad(float4 v, float mean, float rstd, float4 w,
                                                 float4 b) {
    return make_float4((v.x - mean) * rstd * w.x + b.x, (v.y - mean) * rstd * w.y + b.y,
                       (v.z - mean) * rstd * w.z + b.z, (v.w - mean) * rstd * w.w + b.w);
}

// Programmatic dependent launch (sm_90 on): wait until the kernel before this one on the
// stream has completed and its writes are visible, then let the kernel after this one start
// launching, so that its launch overlaps this kernel's run. No-ops in an ordinary launch and
// below sm_90. The first statement of every kernel, before any global memory access.
__device__ __forceinline__ void start_after_previous() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Exact GELU, x * Phi(x), with the libdevice erf.
__device__ __forceinline__ float gelu(float x) {
    return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
}

// GEMM epilogues (linear.cu, linear_wgmma.cu; RESIDUAL_NORM in linear_wgmma.cu only).
enum Epilogue { HALF = 0, GELU_PAIR = 1, RESIDUAL = 2, RESIDUAL_NORM = 3 };

// The residual update of two columns of a row whose residual values are r: r + (x, y) where
// keep, else r (zero_sum 0) or 0.
__device__ __forceinline__ float2 residual_value(float x, float y, float2 r, bool keep,
                                                 int zero_sum) {
    if (keep) return make_float2(r.x + x, r.y + y);
    return zero_sum ? make_float2(0.0f, 0.0f) : r;
}

// The RESIDUAL epilogue of COUNT column pairs of one output row (at o_row): pair c is columns
// column(c) and column(c) + 1, stored where column(c) < N, with the biased products
// products(c, column(c)): out_f = residual_value(products, res). res may be out_f, but each
// element is read and written by this thread alone: all COUNT residuals are read before any
// is written, so that the reads overlap (in source order each would wait for the store
// before it).
template <int COUNT, typename Column, typename Products>
__device__ __forceinline__ void store_residuals(Column column, Products products, int N,
                                                long long o_row, bool keep, int zero_sum,
                                                const float* res, float* out_f) {
    float2 r[COUNT];
#pragma unroll
    for (int c = 0; c < COUNT; ++c) {
        const int col = column(c);
        r[c] = col < N ? *reinterpret_cast<const float2*>(res + o_row + col)
                       : make_float2(0.0f, 0.0f);
    }
#pragma unroll
    for (int c = 0; c < COUNT; ++c) {
        const int col = column(c);
        if (col >= N) continue;
        const float2 p = products(c, col);
        *reinterpret_cast<float2*>(out_f + o_row + col) =
            residual_value(p.x, p.y, r[c], keep, zero_sum);
    }
}

// Store the biased products x, y of columns o and o + 1 of an output row by epilogue EPI:
// HALF: out_hi = fp16; GELU_PAIR: (out_hi, out_lo) = split(GELU), out_hi alone where out_lo
// is null (RESIDUAL: store_residuals, a row's pairs at once).
template <int EPI>
__device__ __forceinline__ void store_pair(float x, float y, long long o, __half* out_hi,
                                           __half* out_lo) {
    static_assert(EPI == HALF || EPI == GELU_PAIR, "the residual epilogues store whole rows");
    if (EPI == HALF) {
        *reinterpret_cast<__half2*>(out_hi + o) = __floats2half2_rn(x, y);
    } else if (EPI == GELU_PAIR) {
        x = gelu(x);
        y = gelu(y);
        __half xh, xl, yh, yl;
        split_half(x, xh, xl);
        split_half(y, yh, yl);
        *reinterpret_cast<__half2*>(out_hi + o) = __halves2half2(xh, yh);
        if (out_lo != nullptr)  // null: the hi half alone, for one product
            *reinterpret_cast<__half2*>(out_lo + o) = __halves2half2(xl, yl);
    }
}

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

// Sequence b's keys that may be visible: [0, end), end being seq_len or less where key_info
// (the per-sequence rows of cuda_host.key_info; may be null) says so; holes: some keys before
// end are invalid, so the kernel must read the mask.
struct KeyExtent {
    int end;
    bool holes;
};

__device__ __forceinline__ KeyExtent visible_keys(const int* __restrict__ key_info, int b,
                                                 int seq_len) {
    KeyExtent e{seq_len, false};
    if (key_info != nullptr) {
        e.end = imin(e.end, key_info[b * 4]);
        e.holes = key_info[b * 4 + 1] != 0;
    }
    if (e.end < 0) e.end = 0;
    return e;
}

// One online-softmax step of a row held by the 4 lanes of a quad: mx, this lane's max of the
// new (log2-domain) scores, becomes the row's; the running max m_run and this lane's running
// sum l_run move to the new max. Returns the factor for the old sums and outputs, and in base
// what to subtract from the new scores (0 while the row has no visible key, so that
// exp2(-inf) gives 0, never NaN).
__device__ __forceinline__ float online_softmax_step(float mx, float& m_run, float& l_run,
                                                     float& base, float neg_inf) {
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m_run, mx);
    base = m_new == neg_inf ? 0.0f : m_new;
    const float alpha = exp2f(m_run - base);
    m_run = m_new;
    l_run *= alpha;
    return alpha;
}

// Attention's last step for one warp's 16 query rows: normalise by the row sums (each lane
// holds its part, l_run, of rows g and g + 8, g = lane / 4; 0 where no key was visible) and
// write the context as hi/lo pairs (the hi half alone where ctx_lo is null). o holds the
// warp's 16 x (8 GROUPS) fp32 outputs as o[4 n + 2 r + e]: row q0 + g + 8 r, column
// 8 n + 2 t + e (t = lane % 4); columns past head_dim and rows past seq_len are not written.
// ctx row i of the head starts at (row_base + i) * ctx_stride + head * head_dim.
template <int GROUPS>
__device__ __forceinline__ void store_context(const float* o, const float (&l_run)[2], int q0,
                                              int g, int t, int seq_len, long long row_base,
                                              long long ctx_stride, int head, int head_dim,
                                              __half* ctx_hi, __half* ctx_lo) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float l = l_run[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        const int row = q0 + g + 8 * r;
        if (row >= seq_len) continue;
        const long long off = (row_base + row) * ctx_stride + (long long)head * head_dim + 2 * t;
        __half* hi = ctx_hi + off;
#pragma unroll
        for (int n = 0; n < GROUPS; ++n) {
            if (n * 8 >= head_dim) break;
            __half h0, l0, h1, l1;
            split_half(o[4 * n + 2 * r] * inv, h0, l0);
            split_half(o[4 * n + 2 * r + 1] * inv, h1, l1);
            *reinterpret_cast<__half2*>(hi + n * 8) = __halves2half2(h0, h1);
            if (ctx_lo != nullptr)
                *reinterpret_cast<__half2*>(ctx_lo + off + n * 8) = __halves2half2(l0, l1);
        }
    }
}

}  // namespace lb
