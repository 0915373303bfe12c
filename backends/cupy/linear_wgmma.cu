// Hopper GEMMs with fused epilogues on wgmma.mma_async: the same kernel interface and semantics
// as lb::linear (linear.cu), out = epilogue(A @ W^T + bias), A [M, K] and W [N, K] as fp16
// (hi, lo) pairs, both operands read by the tensor cores from 128-byte-swizzled shared memory
// filled by a cp.async pipeline of STAGES stages; PENDING wgmma groups (0 or 1) left running
// from one K tile into the next (the schedule above the kernel).
//
// MUST BE COMPILED FOR sm_90a (NVRTC --gpu-architecture=sm_90a, nvcc -arch=sm_90a): wgmma exists
// only there. For any other target (sm_80, plain sm_90, sm_100, ...) the kernels still compile,
// so that this file can share a module with the sm_80 kernels, but their body is a trap.
//
// Launch: block BM * 2 threads (one warpgroup of 128 threads per 64 rows of the tile), grid
// (ceil(M / BM), ceil(N / BN)) as lb::linear (RESIDUAL_NORM: N <= BN, one block along N),
// dynamic shared memory lb::linear_wgmma_shared_bytes(BM, BN, PRODUCTS, STAGES) bytes, above
// 48 KB only after the kernel's max dynamic shared memory attribute has been raised to it.
// lb::linear_wgmma_ws (one product, BM 128, warp-specialised: a producer warpgroup and two
// consumers, stages handed over through mbarriers) takes 384 threads, the same grid and
// linear_wgmma_shared_bytes(128, BN, 1, STAGES) bytes (its mbarriers are static shared memory).
// lb::linear_wgmma_tma (its TMA variant: one producer thread, tensor maps a_map and w_map
// appended to the parameters) takes the same threads, grid and shared bytes as
// linear_wgmma_ws; at BLOCKS 2 (two blocks an SM), 288 threads.
#include "common.cuh"
#include "wgmma.cuh"

namespace lb {

namespace wgmma_detail {

using namespace lb::wgmma;  // descriptors, fences and the wgmma instructions

constexpr int BK = 64;        // K columns per stage: 128 bytes per tile row, one 128B-swizzle row
constexpr int ROW_BYTES = BK * 2;
constexpr int ALIGN = 1024;   // a 128B-swizzle atom (8 rows x 128 bytes) starts at 1024 bytes

// Copy rows [r0, r0 + ROWS) x columns [k0, k0 + BK) of a row-major fp16 matrix into the tile at
// tile_ptr (1024-byte aligned), zero-filling rows past row_end and columns past k_end (a
// multiple of 8). Row r occupies bytes [128 r, 128 r + 128) of the tile; its 16-byte
// chunk c (columns 8c..8c+7) lands in chunk slot c ^ (r % 8): the 128-byte swizzle, which the
// tensor cores undo on the absolute shared address (the tile starts at a multiple of 1024).
template <int ROWS, int THREADS>
__device__ __forceinline__ void load_tile(unsigned char* tile_ptr, const __half* src,
                                          long long stride, int r0, int row_end, int k0,
                                          int k_end) {
    constexpr int CHUNKS = ROWS * (BK / 8);
    static_assert(CHUNKS % THREADS == 0, "tile chunks must divide among the threads");
#pragma unroll
    for (int i = 0; i < CHUNKS / THREADS; ++i) {
        int c = threadIdx.x + i * THREADS;
        int r = c / (BK / 8), kc = c % (BK / 8);
        bool ok = r0 + r < row_end && k0 + kc * 8 < k_end;
        const __half* g = ok ? src + (long long)(r0 + r) * stride + k0 + kc * 8 : src;
        cp_async16(tile_ptr + r * ROW_BYTES + ((kc ^ (r & 7)) << 4), g, ok);
    }
}

// load_tile<ROWS, 128> for linear_wgmma_ws's producer warpgroup (threadIdx.x 0 .. 127), in few
// registers (it holds 40): the same chunks to the same swizzled slots (thread t copies chunk
// t % 8 of rows t / 8 + 16 i, whose slot is chunk ^ (t / 8 % 8) for every i), from one source
// address and destination advanced 16 rows a step rather than one address a chunk kept live.
template <int ROWS>
__device__ __forceinline__ void load_tile_lean(unsigned char* tile_ptr, const __half* src,
                                               long long stride, int r0, int row_end, int k0,
                                               int k_end) {
    static_assert(ROWS % 16 == 0, "16 rows a step of 128 threads");
    const int kc = threadIdx.x % (BK / 8), r = threadIdx.x / (BK / 8);
    const bool k_ok = k0 + kc * 8 < k_end;
    const __half* g = src + (long long)(r0 + r) * stride + k0 + kc * 8;
    unsigned char* d = tile_ptr + r * ROW_BYTES + ((kc ^ (r & 7)) << 4);
#pragma unroll 1
    for (int i = 0; i < ROWS / 16; ++i) {
        const bool ok = k_ok && r0 + r + 16 * i < row_end;
        cp_async16(d, ok ? g : src, ok);
        g += 16 * stride;
        d += 16 * ROW_BYTES;
    }
}

// wgmma shared-memory matrix descriptor of a K-major operand in the canonical 128B-swizzle
// layout: leading-dimension byte offset unused for swizzled K-major layouts (16, 1 by
// convention), stride-dimension byte offset 1024 (from one group of 8 rows to the next), base
// offset 0 (atoms 1024-aligned).
__device__ __forceinline__ unsigned long long operand_desc(unsigned addr) {
    return smem_desc<128>(addr, 16, 1024);
}

// The first row and column of this block's tile: the grid (ceil(M / BM), ceil(N / BN)) is
// walked N tile first in the order blocks are dispatched (blockIdx.x fastest), so that the
// blocks running at once share their rows of A (read from DRAM once) and all of W (it stays in
// L2) rather than each reading rows of A the others do not.
__device__ __forceinline__ int2 tile_origin(int bm, int bn) {
    const unsigned block = blockIdx.x + blockIdx.y * gridDim.x;
    return make_int2(static_cast<int>(block / gridDim.y) * bm,
                     static_cast<int>(block % gridDim.y) * bn);
}

// The first row and column of output tile `tile` of a grid of n_tiles tiles along N, in the
// same order (a persistent block's tiles: blockIdx.x, + gridDim.x, ...).
__device__ __forceinline__ int2 tile_origin_of(int tile, int n_tiles, int bm, int bn) {
    return make_int2(tile / n_tiles * bm, tile % n_tiles * bn);
}

// Asks L2 for the fp32 residual rows [m0, m0 + BM) x columns [n0, n0 + BN) of res (row
// stride `stride`, rows below M and columns below N only), one 128-byte line a request,
// requests index, index + count, ... of the tile's: issued before the mainloop, so that the
// epilogue's residual reads (RESIDUAL, RESIDUAL_NORM) find their lines in L2 instead of
// waiting a DRAM round trip each batch.
template <int BM, int BN>
__device__ __forceinline__ void prefetch_residual_tile(const float* res, long long stride,
                                                       int m0, int n0, int M, int N, int index,
                                                       int count) {
    constexpr int LINES = BN * 4 / 128;  // 128-byte lines of a tile row
    static_assert(LINES >= 1 && BN * 4 % 128 == 0, "whole lines a tile row");
    for (int i = index; i < BM * LINES; i += count) {
        const int row = m0 + i / LINES, col = n0 + (i % LINES) * 32;
        if (row < M && col < N)
            asm volatile("prefetch.global.L2 [%0];\n" ::"l"(res + row * stride + col));
    }
}

// Column groups of a row whose residuals load together (RESIDUAL): 8, or 4 where a thread
// has at most 112 registers (linear_wgmma_tma at two blocks an SM: 8 spill there).
constexpr int RESIDUAL_BATCH = 8, RESIDUAL_BATCH_LEAN = 4;

// The HALF, GELU_PAIR and RESIDUAL epilogues of one thread's m64nBNk16 accumulator fragment:
// acc[4 j + 2 h + e] + bias is output row row0 + 8 h, column n0 + 8 j + 2 t + e (row0: the
// row of the thread's g = lane / 4 within its warp's 16, n0: the tile's first column, t =
// lane % 4), stored where row < M and column < N (RESIDUAL: BATCH column groups' residuals
// read, then written). The kernels' restrict qualifiers carry through inlining.
template <int BN, int EPI, int BATCH = RESIDUAL_BATCH>
__device__ __forceinline__ void store_fragment(const float (&acc)[BN / 2], int row0, int n0,
                                               int t, int M, int N, const float* bias,
                                               __half* out_hi, __half* out_lo,
                                               long long out_stride, const float* res,
                                               float* out_f, const unsigned char* valid,
                                               int zero_sum) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        int row = row0 + h * 8;
        if (row >= M) continue;
        const bool keep = valid == nullptr || valid[row] != 0;  // RESIDUAL
        long long o_row = (long long)row * out_stride;
        if constexpr (EPI == RESIDUAL) {  // BATCH column groups at once
#pragma unroll
            for (int j0 = 0; j0 < BN / 8; j0 += BATCH)
                store_residuals<BATCH>(
                    [&](int jj) { return n0 + (j0 + jj) * 8 + 2 * t; },
                    [&](int jj, int col) {
                        return make_float2(acc[4 * (j0 + jj) + 2 * h] + bias[col],
                                           acc[4 * (j0 + jj) + 2 * h + 1] + bias[col + 1]);
                    },
                    N, o_row, keep, zero_sum, res, out_f);
        } else {
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
                int col = n0 + j * 8 + 2 * t;
                if (col >= N) continue;
                store_pair<EPI>(acc[4 * j + 2 * h] + bias[col],
                                acc[4 * j + 2 * h + 1] + bias[col + 1], o_row + col, out_hi,
                                out_lo);
            }
        }
    }
}

// Floats a row of the staged output tile takes (STAGED): BN + 8, so that a half-warp's float2
// fragment stores (4 rows' 4 lanes) fall in distinct banks.
template <int BN>
__host__ __device__ constexpr int staged_row(void) { return BN + 8; }

// A pointer's bits, for the staged epilogues' alignment tests.
__device__ __forceinline__ unsigned long long address(const void* p) {
    return reinterpret_cast<unsigned long long>(p);
}

// The first step of the staged epilogues (store_tile_staged, store_tile_staged_eight), for
// the 2 BM threads of a BM x 128 tile's warpgroups: their accumulators (store_fragment's
// layout) go to tile (fp32, staged_row floats a row) once every wgmma of all of them has read
// its stages (named barrier 1 of 2 BM threads), then a second barrier.
template <int BM>
__device__ __forceinline__ void stage_accumulators(const float (&acc)[64], float* tile,
                                                   int group, int warp, int lane) {
    constexpr int BN = 128, STRIDE = staged_row<BN>();
    static_assert(BM == 64 || BM == 128, "one or two warpgroups");
    named_sync<2 * BM>(1);  // every warpgroup's wgmmas are complete: the stages are free
    float* mine = tile + (group * 64 + warp * 16 + lane / 4) * STRIDE + 2 * (lane % 4);
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
            *reinterpret_cast<float2*>(mine + h * 8 * STRIDE + 8 * j) =
                make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
    named_sync<2 * BM>(1);
}

// The epilogues of a BM x 128 output tile through shared memory (STAGED), for the 2 BM threads
// of its warpgroups (BM 128: linear_wgmma's block or linear_wgmma_tma's consumers; BM 64:
// linear_wgmma's one warpgroup): their accumulators (store_fragment's layout) go to tile
// (fp32, staged_row floats a row) once every wgmma of all of them has read its stages (named
// barrier 1 of 2 BM threads); then, after a second barrier, warp w (0 .. BM / 16 - 1 across
// the warpgroups) takes rows w, w + BM / 16, ... and its lane the four columns
// n0 + 4 lane .. + 3, so that a warp reads and writes whole rows: 512 contiguous bytes of the
// fp32 residual (HALF and GELU_PAIR: 256 of fp16) instead of eight 32-byte pieces. RESIDUAL
// and RESIDUAL_NORM read ROWS rows' residuals before writing any (res may be out_f: each
// element is read and written by one thread). RESIDUAL_NORM (n0 0, N <= 128: a warp holds
// whole rows) then LayerNorms each new row a warp a row (a lane's four columns summed in
// order, a butterfly over the warp, the variance from a second pass: the unstaged epilogue's
// operations summed in another order) into norm_hi (and norm_lo).
// Columns go four at a time where all four are below N and the rows and bases are 16-byte
// aligned (the fp16 outputs' 8-byte stores too; the norm's rows 8-byte), else one by one.
template <int EPI, int BM = 128>
__device__ __forceinline__ void store_tile_staged(
    const float (&acc)[64], float* tile, int group, int warp, int lane, int m0, int n0, int M,
    int N, const float* bias, __half* out_hi, __half* out_lo, long long out_stride,
    const float* res, float* out_f, const unsigned char* valid, int zero_sum,
    const float* norm_w = nullptr, const float* norm_b = nullptr, float eps = 0.0f,
    __half* norm_hi = nullptr, __half* norm_lo = nullptr, long long norm_stride = 0) {
    constexpr int BN = 128, STRIDE = staged_row<BN>(), ROWS = 4, WARPS = BM / 16;
    constexpr bool FP32_OUT = EPI == RESIDUAL || EPI == RESIDUAL_NORM;
    stage_accumulators<BM>(acc, tile, group, warp, lane);
    const int col = n0 + 4 * lane, first = group * 4 + warp;
    const bool live = col < N;  // RESIDUAL_NORM: dead lanes still join the row's sums
    if (EPI != RESIDUAL_NORM && !live) return;
    const unsigned long long at = FP32_OUT ? address(out_f) | address(res)
                                           : address(out_hi) | address(out_lo);
    const bool wide = col + 4 <= N && (out_stride & 3) == 0 && (at & 15) == 0;
    const bool norm_wide = col + 4 <= N && (norm_stride & 3) == 0 &&
                           ((address(norm_hi) | address(norm_lo)) & 7) == 0;
    float b[4], nw[4], nb[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        b[e] = col + e < N ? bias[col + e] : 0.0f;
        if constexpr (EPI == RESIDUAL_NORM) {
            nw[e] = col + e < N ? norm_w[col + e] : 0.0f;
            nb[e] = col + e < N ? norm_b[col + e] : 0.0f;
        }
    }
    for (int r0 = first; r0 < BM; r0 += WARPS * ROWS) {
        float4 v[ROWS], rv[ROWS];
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
            const int r = r0 + WARPS * i, row = m0 + r;
            v[i] = *reinterpret_cast<const float4*>(tile + r * STRIDE + 4 * lane);
            v[i] = make_float4(v[i].x + b[0], v[i].y + b[1], v[i].z + b[2], v[i].w + b[3]);
            rv[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (FP32_OUT && live && row < M) {
                const float* from = res + row * out_stride + col;
                if (wide) {
                    rv[i] = *reinterpret_cast<const float4*>(from);
                } else {
                    rv[i].x = from[0];
                    if (col + 1 < N) rv[i].y = from[1];
                    if (col + 2 < N) rv[i].z = from[2];
                    if (col + 3 < N) rv[i].w = from[3];
                }
            }
        }
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
            const int row = m0 + r0 + WARPS * i;
            if (row >= M) break;  // the same row across the warp
            const long long o = row * out_stride + col;
            float y[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
            if constexpr (FP32_OUT) {
                const bool keep = valid == nullptr || valid[row] != 0;
                const float2 p = residual_value(y[0], y[1], make_float2(rv[i].x, rv[i].y), keep,
                                                zero_sum);
                const float2 q = residual_value(y[2], y[3], make_float2(rv[i].z, rv[i].w), keep,
                                                zero_sum);
                y[0] = p.x, y[1] = p.y, y[2] = q.x, y[3] = q.y;
                if (wide) {
                    *reinterpret_cast<float4*>(out_f + o) = make_float4(y[0], y[1], y[2], y[3]);
                } else if (live) {
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        if (col + e < N) out_f[o + e] = y[e];
                }
            }
            __half hi[4], lo[4];
            if constexpr (EPI == RESIDUAL_NORM) {
#pragma unroll
                for (int e = 0; e < 4; ++e) y[e] = col + e < N ? y[e] : 0.0f;
                const float mean = warp_sum(y[0] + y[1] + y[2] + y[3]) / N;
                float sq = 0.0f;
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float d = col + e < N ? y[e] - mean : 0.0f;
                    sq += d * d;
                }
                const float rstd = rsqrtf(warp_sum(sq) / N + eps);
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    split_half((y[e] - mean) * rstd * nw[e] + nb[e], hi[e], lo[e]);
            } else if constexpr (!FP32_OUT) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    if (EPI == GELU_PAIR) {
                        split_half(gelu(y[e]), hi[e], lo[e]);
                    } else {
                        hi[e] = __float2half_rn(y[e]);
                    }
                }
            }
            if constexpr (EPI != RESIDUAL) {  // fp16 rows: the output's, or the norm's
                __half* to_hi = EPI == RESIDUAL_NORM ? norm_hi : out_hi;
                __half* to_lo = EPI == RESIDUAL_NORM ? norm_lo : EPI == GELU_PAIR ? out_lo
                                                                                  : nullptr;
                const long long n = EPI == RESIDUAL_NORM ? row * norm_stride + col : o;
                const bool vec = EPI == RESIDUAL_NORM ? norm_wide : wide;
                if (vec) {
                    *reinterpret_cast<uint2*>(to_hi + n) = make_uint2(
                        pack_halves(hi[0], hi[1]), pack_halves(hi[2], hi[3]));
                    if (to_lo != nullptr)
                        *reinterpret_cast<uint2*>(to_lo + n) = make_uint2(
                            pack_halves(lo[0], lo[1]), pack_halves(lo[2], lo[3]));
                } else if (live) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        if (col + e >= N) continue;
                        to_hi[n + e] = hi[e];
                        if (to_lo != nullptr) to_lo[n + e] = lo[e];
                    }
                }
            }
        }
    }
}

// Four fp16 values (two __half2) to to: one 8-byte store where wide (to 8-byte aligned), else
// one by one.
__device__ __forceinline__ void store_half_quad(__half* to, const __half2 (&h)[2], bool wide) {
    if (wide) {
        *reinterpret_cast<uint2*>(to) = make_uint2(*reinterpret_cast<const unsigned*>(&h[0]),
                                                   *reinterpret_cast<const unsigned*>(&h[1]));
    } else {
        to[0] = __low2half(h[0]), to[1] = __high2half(h[0]);
        to[2] = __low2half(h[1]), to[3] = __high2half(h[1]);
    }
}

// The rows of store_tile_staged_eight (below) after the staging: VEC, float4 accesses (the
// fp32 rows and bases 16-byte aligned, the norm's fp16 rows 8-byte), else one by one. b, nw,
// nb: the lane's bias and norm parameters (zero past N).
template <int EPI, int BM, bool VEC>
__device__ __forceinline__ void store_rows_eight(
    const float* tile, int q, int part, int first, int m0, int n0, int M, int N,
    const float4 (&b)[4], const float4 (&nw)[4], const float4 (&nb)[4], long long out_stride,
    const float* res, float* out_f, const unsigned char* valid, int zero_sum, float eps,
    __half* norm_hi, __half* norm_lo, long long norm_stride) {
    constexpr int BN = 128, STRIDE = staged_row<BN>(), WARPS = BM / 16, CHUNKS = BN / 32;
    constexpr int GROUPS = BM / (4 * WARPS), BATCH = 2;  // four-row groups a warp, at once
    constexpr bool NORM = EPI == RESIDUAL_NORM;
    static_assert(GROUPS % BATCH == 0, "whole batches");
    for (int g0 = 0; g0 < GROUPS; g0 += BATCH) {
        float4 v[BATCH][CHUNKS], rv[BATCH][CHUNKS];
        bool keep[BATCH];
#pragma unroll
        for (int i = 0; i < BATCH; ++i) {  // the batch's loads, before any store
            const int r = 4 * (first + WARPS * (g0 + i)) + q, row = m0 + r;
            keep[i] = valid == nullptr || (row < M && valid[row] != 0);
#pragma unroll
            for (int c = 0; c < CHUNKS; ++c) {
                const int col = n0 + 4 * part + 32 * c;
                v[i][c] = *reinterpret_cast<const float4*>(tile + r * STRIDE + 4 * part +
                                                           32 * c);
                v[i][c] = make_float4(v[i][c].x + b[c].x, v[i][c].y + b[c].y,
                                      v[i][c].z + b[c].z, v[i][c].w + b[c].w);
                rv[i][c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (row < M && col < N) {
                    const float* from = res + row * out_stride + col;
                    if constexpr (VEC) {
                        rv[i][c] = *reinterpret_cast<const float4*>(from);
                    } else {
                        rv[i][c] = make_float4(from[0], from[1], from[2], from[3]);
                    }
                }
            }
        }
#pragma unroll
        for (int i = 0; i < BATCH; ++i) {
            const int row = m0 + 4 * (first + WARPS * (g0 + i)) + q;
            const bool in_rows = row < M;
            const long long o_row = row * out_stride;
            float4 y[CHUNKS];
            float sum = 0.0f;
#pragma unroll
            for (int c = 0; c < CHUNKS; ++c) {
                const int col = n0 + 4 * part + 32 * c;
                const float2 p = residual_value(v[i][c].x, v[i][c].y,
                                                make_float2(rv[i][c].x, rv[i][c].y), keep[i],
                                                zero_sum);
                const float2 h = residual_value(v[i][c].z, v[i][c].w,
                                                make_float2(rv[i][c].z, rv[i][c].w), keep[i],
                                                zero_sum);
                y[c] = col < N ? make_float4(p.x, p.y, h.x, h.y) : make_float4(0, 0, 0, 0);
                if (in_rows && col < N) {
                    float* to = out_f + o_row + col;
                    if constexpr (VEC) {
                        *reinterpret_cast<float4*>(to) = y[c];
                    } else {
                        to[0] = y[c].x, to[1] = y[c].y, to[2] = y[c].z, to[3] = y[c].w;
                    }
                }
                if constexpr (NORM) sum += quad_sum(y[c]);
            }
            if constexpr (NORM) {
#pragma unroll
                for (int o = 1; o < 8; o *= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
                const float mean = sum / N;
                float sq = 0.0f;
#pragma unroll
                for (int c = 0; c < CHUNKS; ++c)
                    if (n0 + 4 * part + 32 * c < N) sq += quad_square_sum(y[c], mean);
#pragma unroll
                for (int o = 1; o < 8; o *= 2) sq += __shfl_xor_sync(0xffffffffu, sq, o);
                const float rstd = rsqrtf(sq / N + eps);
                const long long n_row = row * norm_stride;
#pragma unroll
                for (int c = 0; c < CHUNKS; ++c) {
                    const int col = n0 + 4 * part + 32 * c;
                    if (!in_rows || col >= N) continue;
                    __half2 hi[2], lo[2];
                    split_quad(normalize_quad(y[c], mean, rstd, nw[c], nb[c]), hi, lo);
                    store_half_quad(norm_hi + n_row + col, hi, VEC);
                    if (norm_lo != nullptr)  // null: the hi half alone, for one product
                        store_half_quad(norm_lo + n_row + col, lo, VEC);
                }
            }
        }
    }
}

// The RESIDUAL and RESIDUAL_NORM epilogues of a BM x 128 output tile through shared memory
// eight lanes a row (STAGED 2): the values of store_tile_staged (RESIDUAL_NORM's row sums in
// another order), the accumulators staged the same way (stage_accumulators), but lane l of
// a warp takes row 4 i + l / 8 of the warp's rows and the 16 columns n0 + 4 (l % 8) + 32 c,
// c < 4, as four float4s: one warp instruction covers four rows, 8 lanes reading 128
// contiguous bytes of each (a row's 512 in four); RESIDUAL_NORM's two sums a row are 3-level
// butterflies within the 8 lanes (quad_sum, quad_square_sum), and the bias and norm
// parameters are held for all 16 columns. Warp w (0 .. BM / 16 - 1 across the warpgroups)
// takes the four-row groups w, w + BM / 16, .., two groups at a time, their residuals and
// valid bytes read before any is written (res may be out_f: each element is read and written
// by one thread). Rows past M take part in the butterflies and store nothing. Float4
// accesses where every fp32 row and base is 16-byte aligned and the norm's fp16 rows 8-byte
// (one loop), else one by one (another); N is a multiple of 4.
template <int EPI, int BM = 128>
__device__ __forceinline__ void store_tile_staged_eight(
    const float (&acc)[64], float* tile, int group, int warp, int lane, int m0, int n0, int M,
    int N, const float* bias, long long out_stride, const float* res, float* out_f,
    const unsigned char* valid, int zero_sum, const float* norm_w, const float* norm_b,
    float eps, __half* norm_hi, __half* norm_lo, long long norm_stride) {
    constexpr int BN = 128, CHUNKS = BN / 32;
    static_assert(EPI == RESIDUAL || EPI == RESIDUAL_NORM, "the fp32 epilogues");
    stage_accumulators<BM>(acc, tile, group, warp, lane);
    const int q = lane / 8, part = lane % 8, first = group * 4 + warp;
    const bool vec = (out_stride & 3) == 0 && ((address(out_f) | address(res)) & 15) == 0 &&
                     (norm_stride & 3) == 0 && ((address(norm_hi) | address(norm_lo)) & 7) == 0;
    float4 b[CHUNKS], nw[CHUNKS], nb[CHUNKS];
    const auto load4 = [N](const float* p, int col) {  // zeros past N
        return col < N ? make_float4(p[col], p[col + 1], p[col + 2], p[col + 3])
                       : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    };
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        const int col = n0 + 4 * part + 32 * c;
        b[c] = load4(bias, col);
        nw[c] = nb[c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if constexpr (EPI == RESIDUAL_NORM) {
            nw[c] = load4(norm_w, col);
            nb[c] = load4(norm_b, col);
        }
    }
    if (vec) {
        store_rows_eight<EPI, BM, true>(tile, q, part, first, m0, n0, M, N, b, nw, nb,
                                        out_stride, res, out_f, valid, zero_sum, eps, norm_hi,
                                        norm_lo, norm_stride);
    } else {
        store_rows_eight<EPI, BM, false>(tile, q, part, first, m0, n0, M, N, b, nw, nb,
                                         out_stride, res, out_f, valid, zero_sum, eps, norm_hi,
                                         norm_lo, norm_stride);
    }
}

// The consumer warpgroups of linear_wgmma_ws and linear_wgmma_tma: acc (this thread's part of
// warpgroup group's 64 x BN tile) = the sum over the k_tiles K tiles of the stage ring at base
// (stage s: A tile of 128 rows, then W tile of BN rows, 128 bytes each), tile kt the ring's
// (first + kt)-th, in stage (first + kt) % STAGES (first: the K tiles a persistent block's
// earlier output tiles took). Per tile: wait on full[s] (parity: its round & 1); wgmma fence;
// the tile's BK / 16 k16 wgmmas; commit; wgmma wait 1, so tile kt - 1's group is complete and
// its stage is released on empty (tile kt's runs on). After the loop: wait 0 and release the
// last.
template <int BN, int STAGES>
__device__ __forceinline__ void consume_stages(float (&acc)[BN / 2], unsigned base,
                                               unsigned full0, unsigned empty0, int k_tiles,
                                               int group, int first = 0) {
    constexpr int A_TILE = 128 * ROW_BYTES, STAGE = A_TILE + BN * ROW_BYTES;
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;
    for (int kt = 0; kt < k_tiles; ++kt) {
        const int s = (first + kt) % STAGES;
        mbarrier_wait(full0 + 8 * s, ((first + kt) / STAGES) & 1);
        const unsigned st = base + s * STAGE;
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) fence_operand(acc[i]);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            unsigned a = st + group * 64 * ROW_BYTES + kk * 32;
            unsigned w = st + A_TILE + kk * 32;
            SS<BN>::template run<1>(acc, operand_desc(a), operand_desc(w));
        }
        wgmma_commit();
        wgmma_wait<1>();
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) fence_operand(acc[i]);
        if (kt > 0) mbarrier_arrive(empty0 + 8 * ((first + kt - 1) % STAGES));
    }
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) fence_operand(acc[i]);
    if (k_tiles > 0) mbarrier_arrive(empty0 + 8 * ((first + k_tiles - 1) % STAGES));
}

// linear_wgmma_tma's producer thread for one output tile (rows from m0, columns from n0): its
// k_tiles K tiles, the ring's done + 0 .. done + k_tiles - 1 (done: the block's K tiles
// before this output tile's), tile kt in stage kt % STAGES. Per K tile k: 1. wait until the
// stage's last wgmmas are complete (empty, parity (round & 1) ^ 1); 2. arm full with the
// stage's bytes and copy A's box (k BK, m0) and W's (k BK, n0) into it.
template <int STAGES, int A_TILE, int STAGE>
__device__ __forceinline__ void produce_tile(unsigned base, unsigned full0, unsigned empty0,
                                             const TensorMap* a_map, const TensorMap* w_map,
                                             int k_tiles, int done, int m0, int n0) {
    for (int k = 0; k < k_tiles; ++k) {
        const int kt = done + k, s = kt % STAGES;
        mbarrier_wait(empty0 + 8 * s, ((kt / STAGES) & 1) ^ 1);  // 1
        const unsigned full = full0 + 8 * s, st = base + s * STAGE;  // 2
        mbarrier_arrive_expect_tx(full, STAGE);
        tma_load_2d(st, a_map, full, k * BK, m0);
        tma_load_2d(st + A_TILE, w_map, full, k * BK, n0);
    }
}

// Issues one K tile's wgmmas (BK / 16 k16 steps x PRODUCTS) into acc from the stage at shared
// address s (A_hi, W_hi, then A_lo past one product, then W_lo at three; A_TILE and W_TILE
// bytes each), for the warpgroup's 64 rows. Product 0: a_hi w_hi; 1: a_hi w_lo; 2: a_lo w_hi
// (two products: 0 and 2). Each k16 step starts 32 bytes further into the 128-byte rows;
// the hardware swizzles the resulting addresses.
template <int BN, int PRODUCTS, int A_TILE, int W_TILE>
__device__ __forceinline__ void issue_tile_products(float (&acc)[BN / 2], unsigned s,
                                                    int group) {
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
#pragma unroll
        for (int part = 0; part < PRODUCTS; ++part) {
            const int product = PRODUCTS == 2 && part == 1 ? 2 : part;
            unsigned a = s + (product == 2 ? A_TILE + W_TILE : 0) + group * 64 * ROW_BYTES +
                         kk * 32;
            unsigned w = s + A_TILE + (product == 1 ? A_TILE + W_TILE : 0) + kk * 32;
            SS<BN>::template run<1>(acc, operand_desc(a), operand_desc(w));
        }
    }
}

}  // namespace wgmma_detail

// Dynamic shared bytes of one block of lb::linear_wgmma<bm, bn, products, *, stages, *>: stages
// x (tiles of 64 K columns: A hi and, past one product, lo; W hi and, at three products, lo)
// plus 1024 bytes of slack for aligning the first tile to 1024 bytes. Three stages:
// <128, 128, 1>: 99328, <128, 128, 2>: 148480, <128, 128, 3>: 197632, <64, 128, 1>: 74752,
// <64, 128, 2>: 99328, <64, 128, 3>: 148480, <64, 64, 1>: 50176, <64, 64, 2>: 74752,
// <64, 64, 3>: 99328. Four stages: <128, 128, 1>: 132096, <128, 256, 1>: 197632.
__host__ __device__ constexpr int linear_wgmma_shared_bytes(int bm, int bn, int products,
                                                            int stages) {
    return stages * (a_parts(products) * bm + w_parts(products) * bn) * wgmma_detail::ROW_BYTES +
           wgmma_detail::ALIGN;
}

// The most dynamic shared memory a block may have on sm_90 (227 KiB).
constexpr int MAX_WGMMA_SHARED_BYTES = 227 * 1024;

// Block tile BM x BN, BM / 64 warpgroups, each computing 64 rows x BN columns with
// wgmma m64nBNk16 (BN 64, 128 or 256: BN / 2 fp32 accumulators a thread); PRODUCTS 1 (a_hi
// w_hi), 2 (a_hi w_hi + a_lo w_hi: w_lo not read) or 3 (a_hi w_hi + a_hi w_lo + a_lo w_hi),
// one fp32 accumulator.
// HALF: out_hi = fp16(acc + bias). GELU_PAIR: (out_hi, out_lo) = split(GELU(acc + bias)),
// or out_hi alone where out_lo is null.
// RESIDUAL: out_f = res + acc + bias on rows whose valid byte is set (all rows when valid is
// null); other rows get res (zero_sum 0) or 0 (zero_sum 1). res may be out_f (in place).
// RESIDUAL_NORM: RESIDUAL, then LayerNorm of each new fp32 row over its N columns, as
// layer_norm (norm.cu): y = (x - mean) / sqrt(var + eps) * norm_w + norm_b, the variance from
// a second pass; (norm_hi, norm_lo) = split(y), or norm_hi alone where norm_lo is null. Needs
// N <= BN and one block along N. The norm rows may be the A operand's own rows (in place):
// they are written after the block's last copy of A has landed (the last K tile's barrier),
// and no other block reads them (each block reads only its own BM rows of A).
// M is any size; N and K are multiples of 8 (zero-padded weights and activations). The norm
// arguments are ignored by the other epilogues.
//
// Schedule over the k_tiles K tiles of BK columns. Tile kt lives in stage kt % STAGES and is
// copied DISTANCE = STAGES - 1 - PENDING tiles ahead; each iteration leaves PENDING wgmma
// groups running. <3, 0> (distance 2) is the plain schedule; <4, 1> keeps one group in flight
// (CUTLASS's sm90 mainloops wait the same way) at the same distance. Order of events:
//   Prologue: copy tiles 0 .. DISTANCE - 1, one cp.async group each (empty past k_tiles).
//   Iteration kt:
//   1. cp.async wait DISTANCE - 1: this thread's copies of tile kt have landed; proxy fence;
//      barrier. Past it every thread's copies of tile kt are visible to the tensor cores, and
//      every warpgroup has passed its wgmma wait of iteration kt - 1: the groups of tiles up
//      to kt - 1 - PENDING are complete in every warpgroup.
//   2. wgmma fence; tile kt's wgmmas (BK / 16 k16 steps x PRODUCTS) from stage kt % STAGES,
//      accumulating into acc; commit.
//   3. Copy tile kt + DISTANCE (if it exists) into stage (kt + DISTANCE) % STAGES, which last
//      held tile kt + DISTANCE - STAGES = kt - 1 - PENDING, complete by step 1; commit.
//   4. wgmma wait PENDING. With 1, tile kt's group runs on over iteration kt + 1's barrier,
//      copies and issue; tile kt + 1's wgmmas chain onto the same accumulators, which no
//      other instruction touches before the wait 0 after the loop.
//   After the loop: wgmma wait 0 (PENDING 1), cp.async wait 0, the epilogue.
// STAGED 1 (tiles BN 128): the epilogue through shared memory (store_tile_staged) after the
// mainloop, the output tile staged over the stages, a warp a row; STAGED 2 (RESIDUAL and
// RESIDUAL_NORM): the same, eight lanes a row (store_tile_staged_eight).
template <int BM, int BN, int PRODUCTS, int EPI, int STAGES, int PENDING, int STAGED = 0>
__global__ void __launch_bounds__(BM * 2, 1)
linear_wgmma(const __half* a_hi, const __half* a_lo, long long a_stride,
             const __half* __restrict__ w_hi, const __half* __restrict__ w_lo,
             long long w_stride, const float* __restrict__ bias, int M, int N, int K,
             __half* __restrict__ out_hi, __half* __restrict__ out_lo, long long out_stride,
             const float* res, float* out_f, const unsigned char* __restrict__ valid,
             int zero_sum, const float* __restrict__ norm_w, const float* __restrict__ norm_b,
             float eps, __half* norm_hi, __half* norm_lo, long long norm_stride) {
    start_after_previous();
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    // Qualified names only: linear.cu's lb::BK, lb::STAGES, lb::load_tile may share the module.
    namespace wd = wgmma_detail;
    constexpr int BK = wd::BK, ROW_BYTES = wd::ROW_BYTES, ALIGN = wd::ALIGN;
    constexpr int DISTANCE = STAGES - 1 - PENDING;  // K tiles copied ahead of the one computed
    static_assert(BM == 64 || BM == 128, "one or two warpgroups of 64 rows");
    static_assert(BN == 64 || BN == 128 || BN == 256, "wgmma n64, n128 or n256");
    static_assert(PRODUCTS >= 1 && PRODUCTS <= 3, "one, two or three fp16 products");
    static_assert(PENDING == 0 || PENDING == 1, "wgmma groups left running: 0 or 1");
    static_assert(DISTANCE >= 1, "at least one K tile copied ahead");
    static_assert(!STAGED || BN == 128, "staged: tiles 128 wide");
    static_assert(STAGED != 2 || EPI == RESIDUAL || EPI == RESIDUAL_NORM,
                  "eight lanes a row: the fp32 epilogues");
    static_assert(!STAGED || BM * wd::staged_row<BN>() * 4 <=
                                 STAGES * (a_parts(PRODUCTS) * BM + w_parts(PRODUCTS) * BN) * 128,
                  "the staged tile must fit in the stages");
    static_assert(linear_wgmma_shared_bytes(BM, BN, PRODUCTS, STAGES) <= MAX_WGMMA_SHARED_BYTES,
                  "the stages must fit one block's shared memory");
    constexpr int THREADS = BM * 2;
    constexpr int A_PARTS = a_parts(PRODUCTS), W_PARTS = w_parts(PRODUCTS);
    constexpr int A_TILE = BM * ROW_BYTES, W_TILE = BN * ROW_BYTES;  // bytes, multiples of 1024
    constexpr int STAGE = A_PARTS * A_TILE + W_PARTS * W_TILE;
    extern __shared__ __align__(1024) unsigned char wgmma_shared[];

    // Align the stages to 1024 bytes whatever the start of dynamic shared memory.
    unsigned char* smem;
    const unsigned base = align_shared<ALIGN>(wgmma_shared, smem);

    const int2 origin = wd::tile_origin(BM, BN);
    const int m0 = origin.x, n0 = origin.y;
    const int group = threadIdx.x / 128;  // warpgroup: rows 64 group .. 64 group + 63 of the tile
    const int k_tiles = (K + BK - 1) / BK;

    // Stage layout: A_hi, W_hi, then A_lo (PRODUCTS 2 and 3), then W_lo (PRODUCTS 3).
    auto load_stage = [&](int stage, int kt) {
        unsigned char* s = smem + stage * STAGE;
        int k0 = kt * BK;
        wd::load_tile<BM, THREADS>(s, a_hi, a_stride, m0, M, k0, K);
        wd::load_tile<BN, THREADS>(s + A_TILE, w_hi, w_stride, n0, N, k0, K);
        if (A_PARTS == 2)
            wd::load_tile<BM, THREADS>(s + A_TILE + W_TILE, a_lo, a_stride, m0, M, k0, K);
        if (W_PARTS == 2)
            wd::load_tile<BN, THREADS>(s + 2 * A_TILE + W_TILE, w_lo, w_stride, n0, N, k0, K);
    };

    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;

#pragma unroll
    for (int s = 0; s < DISTANCE; ++s) {
        if (s < k_tiles) load_stage(s, s);
        cp_async_commit();
    }
    if constexpr (EPI == RESIDUAL || EPI == RESIDUAL_NORM)
        wd::prefetch_residual_tile<BM, BN>(res, out_stride, m0, n0, M, N, threadIdx.x, THREADS);

    for (int kt = 0; kt < k_tiles; ++kt) {
        // 1. This thread's copies of tile kt are done; make them visible to the async proxy
        // (the tensor cores), then to every thread. The barrier also tells that every
        // warpgroup has finished (wgmma_wait<PENDING> below) reading stage
        // (kt - 1 - PENDING) % STAGES, overwritten in step 3.
        cp_async_wait<DISTANCE - 1>();
        wd::fence_proxy_async();
        __syncthreads();

        // 2. Tile kt's wgmmas.
        const unsigned s = base + (kt % STAGES) * STAGE;
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) wd::fence_operand(acc[i]);
        wd::wgmma_fence();
        wd::issue_tile_products<BN, PRODUCTS, A_TILE, W_TILE>(acc, s, group);
        wd::wgmma_commit();

        // 3. Refill the stage of tile kt - 1 - PENDING while the tensor cores work.
        int next = kt + DISTANCE;
        if (next < k_tiles) load_stage(next % STAGES, next);
        cp_async_commit();

        // 4. Wait until at most PENDING groups (tile kt's) are still running.
        wd::wgmma_wait<PENDING>();
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) wd::fence_operand(acc[i]);
    }
    if constexpr (PENDING > 0) {
        wd::wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) wd::fence_operand(acc[i]);
    }
    cp_async_wait<0>();

    // Accumulator fragment of m64nNk16 (g = lane / 4, t = lane % 4, warp w of the warpgroup):
    // acc[4 j + 2 h + e] is row 16 w + g + 8 h, column 8 j + 2 t + e of the warpgroup's 64 x BN.
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    if (EPI == RESIDUAL_NORM && (gridDim.y != 1 || N > BN)) __trap();  // whole rows a block
    if constexpr (STAGED == 2) {  // as STAGED 1, eight lanes a row
        wd::store_tile_staged_eight<EPI, BM>(acc, reinterpret_cast<float*>(smem), group, warp,
                                             lane, m0, n0, M, N, bias, out_stride, res, out_f,
                                             valid, zero_sum, norm_w, norm_b, eps, norm_hi,
                                             norm_lo, norm_stride);
    } else if constexpr (STAGED) {  // every copy has landed (cp_async_wait, then the barrier)
        wd::store_tile_staged<EPI, BM>(acc, reinterpret_cast<float*>(smem), group, warp, lane,
                                       m0, n0, M, N, bias, out_hi, out_lo, out_stride, res,
                                       out_f, valid, zero_sum, norm_w, norm_b, eps, norm_hi,
                                       norm_lo, norm_stride);
    } else if constexpr (EPI == RESIDUAL_NORM) {
        // A row's N columns lie in the 4 lanes of one quad (n0 = 0): each lane sums its own
        // over j, two shuffles within the quad give the row's sum. Rows past M take part in
        // the shuffles with zeros and store nothing.
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = m0 + group * 64 + warp * 16 + g + h * 8;
            const bool in_rows = row < M;
            const bool keep = valid == nullptr || (in_rows && valid[row] != 0);
            const long long o_row = (long long)row * out_stride;
            // The row's residuals read before any is written (res may be out_f), as in
            // store_fragment's RESIDUAL, the whole row at once.
            float2 r[BN / 8];
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
                const int col = j * 8 + 2 * t;
                r[j] = in_rows && col < N ? *reinterpret_cast<const float2*>(res + o_row + col)
                                          : make_float2(0.0f, 0.0f);
            }
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
                const int col = j * 8 + 2 * t;
                float2 v = make_float2(0.0f, 0.0f);
                if (in_rows && col < N) {
                    v = residual_value(acc[4 * j + 2 * h] + bias[col],
                                       acc[4 * j + 2 * h + 1] + bias[col + 1], r[j], keep,
                                       zero_sum);
                    *reinterpret_cast<float2*>(out_f + o_row + col) = v;
                }
                acc[4 * j + 2 * h] = v.x;  // the row's new values, normed below
                acc[4 * j + 2 * h + 1] = v.y;
                sum += v.x + v.y;
            }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const float mean = sum / N;

            float sq = 0.0f;
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
                if (j * 8 + 2 * t >= N) continue;
                const float a = acc[4 * j + 2 * h] - mean, b = acc[4 * j + 2 * h + 1] - mean;
                sq += a * a + b * b;
            }
            sq += __shfl_xor_sync(0xffffffffu, sq, 1);
            sq += __shfl_xor_sync(0xffffffffu, sq, 2);
            const float rstd = rsqrtf(sq / N + eps);

            if (!in_rows) continue;
            const long long n_row = (long long)row * norm_stride;
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
                const int col = j * 8 + 2 * t;
                if (col >= N) continue;
                const float2 w = *reinterpret_cast<const float2*>(norm_w + col);
                const float2 b = *reinterpret_cast<const float2*>(norm_b + col);
                const float y0 = (acc[4 * j + 2 * h] - mean) * rstd * w.x + b.x;
                const float y1 = (acc[4 * j + 2 * h + 1] - mean) * rstd * w.y + b.y;
                __half h0, l0, h1, l1;
                split_half(y0, h0, l0);
                split_half(y1, h1, l1);
                *reinterpret_cast<__half2*>(norm_hi + n_row + col) = __halves2half2(h0, h1);
                if (norm_lo != nullptr)  // null: the hi half alone, for one product
                    *reinterpret_cast<__half2*>(norm_lo + n_row + col) = __halves2half2(l0, l1);
            }
        }
    } else {
        wd::store_fragment<BN, EPI>(acc, m0 + group * 64 + warp * 16 + g, n0, t, M, N, bias,
                                    out_hi, out_lo, out_stride, res, out_f, valid, zero_sum);
    }
#elif defined(__CUDA_ARCH__)
    __trap();  // wgmma needs sm_90a: compile this kernel for sm_90a
#endif
}

// The widest reduction linear_wgmma_norm_prologue takes: two K tiles, held whole.
constexpr int MAX_PROLOGUE_K = 2 * wgmma_detail::BK;

// linear_wgmma with LayerNorm in its prologue: A = LayerNorm(x) of the fp32 rows x ([M, K],
// row stride x_stride, rows 16-byte aligned), y = (x - mean) / sqrt(var + eps) * norm_w +
// norm_b, each row's statistics computed exactly as layer_norm's (norm.cu: one warp a row, a
// lane's quad summed, a butterfly of shuffles, the variance from a second pass), so the fp16
// rows the wgmmas read are the ones layer_norm would write. EPI HALF or GELU_PAIR, PRODUCTS
// as linear_wgmma (the norm's lo half written for PRODUCTS 2 and 3), the same launch (BM * 2
// threads, its grid) and shared bytes linear_wgmma_shared_bytes(BM, BN, PRODUCTS, 2). K a
// multiple of 8 and at most MAX_PROLOGUE_K, so that every K tile stays in shared memory:
// tile kt in its own stage (A hi, W hi, A lo, W lo, as linear_wgmma's stages). M is any size.
// Order of events:
//   1. cp.async W's tiles (zero-filled past N and K) into their stages; commit.
//   2. Each warp norms rows warp, warp + BM / 16, ... of the block's BM (zero rows past M,
//      zero columns past K: both tiles are written whole) and stores them as fp16 into the
//      A tiles with the 128-byte swizzle load_tile uses.
//   3. cp.async wait 0; proxy fence (the W copies and the generic stores of A become visible
//      to the tensor cores); barrier.
//   4. Per K tile: wgmma fence, its BK / 16 k16 steps x PRODUCTS, commit, wait 0.
//   5. The epilogue, store_fragment (as the unstaged linear_wgmma).
template <int BM, int BN, int PRODUCTS, int EPI>
__global__ void __launch_bounds__(BM * 2, 1)
linear_wgmma_norm_prologue(const float* __restrict__ x, long long x_stride,
                           const float* __restrict__ norm_w, const float* __restrict__ norm_b,
                           float eps, const __half* __restrict__ w_hi,
                           const __half* __restrict__ w_lo, long long w_stride,
                           const float* __restrict__ bias, int M, int N, int K,
                           __half* __restrict__ out_hi, __half* __restrict__ out_lo,
                           long long out_stride) {
    start_after_previous();
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    namespace wd = wgmma_detail;
    constexpr int BK = wd::BK, ROW_BYTES = wd::ROW_BYTES, ALIGN = wd::ALIGN;
    constexpr int K_TILES = MAX_PROLOGUE_K / BK;
    static_assert(BM == 64 || BM == 128, "one or two warpgroups of 64 rows");
    static_assert(BN == 64 || BN == 128, "wgmma n64 or n128");
    static_assert(PRODUCTS >= 1 && PRODUCTS <= 3, "one, two or three fp16 products");
    static_assert(EPI == HALF || EPI == GELU_PAIR, "the epilogues of Q/K/V and ffn_in");
    static_assert(linear_wgmma_shared_bytes(BM, BN, PRODUCTS, K_TILES) <=
                  MAX_WGMMA_SHARED_BYTES, "every K tile must fit one block's shared memory");
    constexpr int THREADS = BM * 2, WARPS = THREADS / 32;
    constexpr int A_PARTS = a_parts(PRODUCTS), W_PARTS = w_parts(PRODUCTS);
    constexpr int A_TILE = BM * ROW_BYTES, W_TILE = BN * ROW_BYTES;  // bytes, multiples of 1024
    constexpr int STAGE = A_PARTS * A_TILE + W_PARTS * W_TILE;
    extern __shared__ __align__(1024) unsigned char wgmma_shared[];

    unsigned char* smem;
    const unsigned base = align_shared<ALIGN>(wgmma_shared, smem);

    const int2 origin = wd::tile_origin(BM, BN);
    const int m0 = origin.x, n0 = origin.y;
    const int group = threadIdx.x / 128;  // warpgroup: rows 64 group .. 64 group + 63 of the tile
    const int k_tiles = (K + BK - 1) / BK;
    if (K > MAX_PROLOGUE_K) __trap();  // the host refuses these

    // 1. W's tiles, in flight while the rows are normed.
    for (int kt = 0; kt < k_tiles; ++kt) {
        unsigned char* s = smem + kt * STAGE;
        wd::load_tile<BN, THREADS>(s + A_TILE, w_hi, w_stride, n0, N, kt * BK, K);
        if (W_PARTS == 2)
            wd::load_tile<BN, THREADS>(s + 2 * A_TILE + W_TILE, w_lo, w_stride, n0, N, kt * BK,
                                       K);
    }
    cp_async_commit();

    // 2. Lane l holds quad l (columns 4 l .. 4 l + 3) of a row: K tile l / 16, 16-byte chunk
    // l % 16 / 2 of the tile's row, its half l % 2; the chunk lands in slot chunk ^ (row % 8).
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int quads = K / 4;
    const bool lane_in = lane < quads;
    const float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const float4 w = lane_in ? reinterpret_cast<const float4*>(norm_w)[lane] : zero4;
    const float4 b = lane_in ? reinterpret_cast<const float4*>(norm_b)[lane] : zero4;
    const int lane_tile = lane / 16, chunk = lane % 16 / 2;
    unsigned char* a_quad = smem + lane_tile * STAGE + (lane % 2) * 8;
#pragma unroll 4
    for (int i = 0; i < BM / WARPS; ++i) {
        const int r = warp + WARPS * i, row = m0 + r;
        const bool ok = lane_in && row < M;
        const float4 v =
            ok ? reinterpret_cast<const float4*>(x + (long long)row * x_stride)[lane] : zero4;
        const float sum = warp_sum(0.0f + quad_sum(v));  // layer_norm's from 0: never -0
        const float mean = sum / K;
        const float sq = warp_sum(lane_in ? quad_square_sum(v, mean) : 0.0f);  // row's only
        const float rstd = rsqrtf(sq / K + eps);
        const float4 y = ok ? normalize_quad(v, mean, rstd, w, b) : zero4;
        __half2 hi[2], lo[2];
        split_quad(y, hi, lo);
        const int offset = r * ROW_BYTES + ((chunk ^ (r & 7)) << 4);
        *reinterpret_cast<uint2*>(a_quad + offset) = *reinterpret_cast<const uint2*>(hi);
        if (A_PARTS == 2)
            *reinterpret_cast<uint2*>(a_quad + A_TILE + W_TILE + offset) =
                *reinterpret_cast<const uint2*>(lo);
    }

    // 3. W's copies and A's stores visible to the tensor cores, of every thread.
    cp_async_wait<0>();
    wd::fence_proxy_async();
    __syncthreads();

    // 4. The wgmmas, one group a K tile.
    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;
#pragma unroll 1
    for (int kt = 0; kt < k_tiles; ++kt) {
        const unsigned s = base + kt * STAGE;
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) wd::fence_operand(acc[i]);
        wd::wgmma_fence();
        wd::issue_tile_products<BN, PRODUCTS, A_TILE, W_TILE>(acc, s, group);
        wd::wgmma_commit();
        wd::wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) wd::fence_operand(acc[i]);
    }

    // 5. The epilogue (fragment layout as linear_wgmma's).
    const int g = lane / 4, t = lane % 4;
    wd::store_fragment<BN, EPI>(acc, m0 + group * 64 + (warp % 4) * 16 + g, n0, t, M, N, bias,
                                out_hi, out_lo, out_stride, nullptr, nullptr, nullptr, 0);
#elif defined(__CUDA_ARCH__)
    __trap();  // wgmma needs sm_90a: compile this kernel for sm_90a
#endif
}

// Warp-specialised variant (FlashAttention-3 / CUTLASS "sm90 warp-specialized" style), one
// fp16 product, EPI HALF, GELU_PAIR or RESIDUAL with linear_wgmma's semantics. Block 384
// threads, three warpgroups: warpgroup 0 the producer (cp.async copies only, setmaxnreg.dec to
// 40 registers), warpgroups 1 and 2 the consumers (wgmma and the epilogue on rows 0-63 and
// 64-127 of the 128 x BN tile, setmaxnreg.inc to 232; 128 x 40 + 256 x 232 <= 65536). Grid and
// shared memory as linear_wgmma<128, BN, 1, EPI, STAGES, *> (the same stage layout and
// 128B-swizzled operands, the same descriptors).
//
// Tile kt lives in stage s = kt % STAGES in round r = kt / STAGES. Each stage has two mbarriers:
// full[s] (count 128: each producer thread arrives once a round) and empty[s] (count 256: each
// consumer thread arrives once a round). Phase r of full[s] completes when tile kt's copies have
// landed and been fenced for the async proxy; phase r of empty[s] when both consumer
// warpgroups' wgmmas reading tile kt are complete. Phase r is waited for with parity r & 1; the
// producer's wait for phase r - 1 of empty[s] (parity (r & 1) ^ 1) passes at once in round 0
// on a fresh barrier. No waiter can be two phases behind (each waits every phase in turn),
// so the parity is never ambiguous. Order of events:
//   Before the split: thread 0 initialises the barriers; __syncthreads (the block's only one).
//   Producer, tile kt = 0 .. k_tiles - 1:
//   1. wait empty[s] phase r - 1: the wgmmas of tile kt - STAGES are complete in both
//      consumers.
//   2. cp.async tile kt into stage s (zero-filled past M, N and K, as linear_wgmma); commit.
//   3. kt > 0: cp.async wait 1 (this thread's copies of tile kt - 1 have landed); proxy fence
//      (they become visible to the async proxy, which wgmma reads through); arrive on full of
//      tile kt - 1. The fence stays in the writing thread, as linear_wgmma's step 1. (CUTLASS's
//      sm90_mma_multistage_gmma_ss_warpspecialized.hpp instead lets the copies arrive
//      themselves, cp.async.mbarrier.arrive, with no proxy fence, and no producer wait.)
//   After the loop: cp.async wait 0, proxy fence, arrive on full of tile k_tiles - 1; exit
//   (nothing of the producer is needed past its last arrive).
//   Consumer, tile kt = 0 .. k_tiles - 1:
//   1. wait full[s] phase r.
//   2. wgmma fence; tile kt's BK / 16 k16 wgmmas from stage s into acc; commit.
//   3. wgmma wait 1: tile kt - 1's group is complete (tile kt's runs on); kt > 0: arrive on
//      empty of tile kt - 1.
//   After the loop: wgmma wait 0, arrive on empty of the last tile, the epilogue (registers and
//   global memory only: no barrier).
// The producer at tile kt needs tile kt - STAGES released, which the consumers do at tile
// kt - STAGES + 1, whose full barrier the producer arrives on at tile kt - STAGES + 2 <= kt - 1:
// STAGES >= 3 never deadlocks. Up to STAGES - 1 tiles are copied ahead of the one computed, the
// copies of at most two in flight at once (the producer's cp.async wait 1).
template <int BN, int EPI, int STAGES>
__global__ void __launch_bounds__(384, 1)
linear_wgmma_ws(const __half* a_hi, const __half* a_lo, long long a_stride,
                const __half* __restrict__ w_hi, const __half* __restrict__ w_lo,
                long long w_stride, const float* __restrict__ bias, int M, int N, int K,
                __half* __restrict__ out_hi, __half* __restrict__ out_lo, long long out_stride,
                const float* res, float* out_f, const unsigned char* __restrict__ valid,
                int zero_sum, const float* __restrict__ norm_w, const float* __restrict__ norm_b,
                float eps, __half* norm_hi, __half* norm_lo, long long norm_stride) {
    start_after_previous();
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    namespace wd = wgmma_detail;
    constexpr int BM = 128, BK = wd::BK, ROW_BYTES = wd::ROW_BYTES, ALIGN = wd::ALIGN;
    constexpr int PRODUCER_REGISTERS = 40, CONSUMER_REGISTERS = 232;
    static_assert(BN == 128 || BN == 256, "wgmma n128 or n256");
    static_assert(EPI == HALF || EPI == GELU_PAIR || EPI == RESIDUAL, "no RESIDUAL_NORM");
    static_assert(STAGES >= 3, "fewer stages deadlock (the schedule above)");
    static_assert(128 * PRODUCER_REGISTERS + 256 * CONSUMER_REGISTERS <= 65536,
                  "the warpgroups' registers must fit the register file");
    static_assert(linear_wgmma_shared_bytes(BM, BN, 1, STAGES) <= MAX_WGMMA_SHARED_BYTES,
                  "the stages must fit one block's shared memory");
    constexpr int A_TILE = BM * ROW_BYTES, W_TILE = BN * ROW_BYTES;  // bytes, multiples of 1024
    constexpr int STAGE = A_TILE + W_TILE;
    extern __shared__ __align__(1024) unsigned char wgmma_shared[];
    __shared__ __align__(8) unsigned long long full_bar[STAGES], empty_bar[STAGES];

    unsigned char* smem;
    const unsigned base = align_shared<ALIGN>(wgmma_shared, smem);
    const unsigned full0 = static_cast<unsigned>(__cvta_generic_to_shared(full_bar));
    const unsigned empty0 = static_cast<unsigned>(__cvta_generic_to_shared(empty_bar));

    const int2 origin = wd::tile_origin(BM, BN);
    const int m0 = origin.x, n0 = origin.y;
    const int k_tiles = (K + BK - 1) / BK;
    // The warpgroup, uniform across each warp (a shuffle tells the compiler so).
    const int role = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);

    if (threadIdx.x == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            wd::mbarrier_init(full0 + 8 * s, 128);
            wd::mbarrier_init(empty0 + 8 * s, 256);
        }
    }
    __syncthreads();

    if (role == 0) {
        // Producer: threadIdx.x 0 .. 127 are load_tile_lean's thread indices.
        wd::setmaxnreg_dec<PRODUCER_REGISTERS>();
        for (int kt = 0; kt < k_tiles; ++kt) {
            const int s = kt % STAGES;
            wd::mbarrier_wait(empty0 + 8 * s, ((kt / STAGES) & 1) ^ 1);  // 1
            unsigned char* st = smem + s * STAGE;  // 2
            wd::load_tile_lean<BM>(st, a_hi, a_stride, m0, M, kt * BK, K);
            wd::load_tile_lean<BN>(st + A_TILE, w_hi, w_stride, n0, N, kt * BK, K);
            cp_async_commit();
            if (kt > 0) {  // 3
                cp_async_wait<1>();
                wd::fence_proxy_async();
                wd::mbarrier_arrive(full0 + 8 * ((kt - 1) % STAGES));
            }
        }
        if (k_tiles > 0) {  // drain the last tile
            cp_async_wait<0>();
            wd::fence_proxy_async();
            wd::mbarrier_arrive(full0 + 8 * ((k_tiles - 1) % STAGES));
        }
        return;
    }

    // Consumers: warpgroup role - 1 computes rows 64 (role - 1) .. 64 (role - 1) + 63.
    wd::setmaxnreg_inc<CONSUMER_REGISTERS>();
    const int group = role - 1;
    float acc[BN / 2];
    wd::consume_stages<BN, STAGES>(acc, base, full0, empty0, k_tiles, group);

    // Accumulator fragment as linear_wgmma's: the warp's 16 rows of the consumer's 64.
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    wd::store_fragment<BN, EPI>(acc, m0 + group * 64 + warp * 16 + lane / 4, n0, lane % 4, M,
                                N, bias, out_hi, out_lo, out_stride, res, out_f, valid,
                                zero_sum);
#elif defined(__CUDA_ARCH__)
    __trap();  // wgmma needs sm_90a: compile this kernel for sm_90a
#endif
}

// TMA variant of linear_wgmma_ws: the same semantics, epilogues (HALF, GELU_PAIR, RESIDUAL at
// one product), 384-thread layout (warpgroup 0 the producer at 40 registers, warpgroups 1 and 2
// the consumers at 232), grid, dynamic shared memory (linear_wgmma_shared_bytes(128, BN, 1,
// STAGES)), stage layout (A tile 128 x 64, then W tile BN x 64, 128B-swizzled, 1024-aligned)
// and descriptors; but the producer is one thread (threadIdx.x 0) issuing TMA tile copies.
// Parameters: linear_wgmma's, then a_map and w_map, the tensor maps of A ([M, K] fp16, box
// 64 x 128) and W ([N, K] fp16, box 64 x BN), 128B swizzle, zero fill (tensor_maps.py); the
// a_hi and w_hi pointers and strides are not read (the maps hold them); a_lo and w_lo unused.
// Each map is a __grid_constant__ parameter whose generic address the TMA instructions take.
// BLOCKS 2 (BN 128, STAGES 3): two blocks an SM, so that one block's epilogue runs under the
// other's wgmmas; 288 threads, the consumers warpgroups 0 and 1 and the producer thread
// threadIdx.x 256 (warp 8), no setmaxnreg (launch bounds cap a thread at 112 registers).
// STAGED (with BLOCKS 2, not PERSISTENT): the epilogue through shared memory once the last
// wgmma is done (store_tile_staged), the tile staged over the stages.
// PERSISTENT (with BLOCKS 2): a grid of at most two blocks an SM along x, each taking output
// tiles blockIdx.x, blockIdx.x + gridDim.x, ... of the (ceil(M / 128), ceil(N / BN)) tiles
// in tile_origin's order; the ring runs on across a block's tiles (kt below counts the
// block's K tiles over all of them), so the producer copies the next tile's first stages while
// the consumers run this tile's epilogue. The producer warp loops over the tiles together
// (its other lanes prefetch each tile's residual rows), its first lane issuing the copies.
//
// Tile kt lives in stage s = kt % STAGES in round r = kt / STAGES. full[s] has count 1 (the
// producer's arrive.expect_tx of STAGE_BYTES = (128 + BN) x 128 bytes: TMA counts the whole
// box, its zero-filled parts included) and completes phase r when that arrive is in and both
// copies' bytes have landed (complete_tx; TMA writes through the async proxy, which wgmma reads
// through: no proxy fence). empty[s] has count 256 as in linear_wgmma_ws. Parities as there.
//   Before the split: thread 0 initialises the barriers, fence.mbarrier_init; __syncthreads.
//   Producer thread, tile kt = 0 .. k_tiles - 1 (PERSISTENT: on through the block's output
//   tiles, kt counting on; the tile's own K offset is k = kt - its first kt):
//   1. wait empty[s] phase r - 1 (parity (r & 1) ^ 1): tile kt - STAGES's wgmmas are complete.
//   2. arrive.expect_tx(full[s], STAGE_BYTES); TMA A box (k0, m0) and W box (k0, n0) into
//      stage s, both completing on full[s].
//   Then exit (the copies complete on their own). The producer warp's other lanes wait for
//   the first at the end of each output tile; the producer warpgroup's other warps (BLOCKS
//   1) exit at once.
//   Consumers: linear_wgmma_ws's steps (wait full[s] parity r & 1; wgmmas; commit; wait 1;
//   release tile kt - 1 on empty), wait 0 and release the last tile, the epilogue; then the
//   next output tile's (PERSISTENT), the ring's kt counting on.
// The producer at tile kt needs tile kt - STAGES released, which the consumers do at tile
// kt - STAGES + 1 after its full wait, announced at producer step kt - STAGES + 1 < kt: any
// STAGES >= 2 is deadlock-free; up to STAGES tiles are copied ahead of the one computed.
template <int BN, int EPI, int STAGES, int BLOCKS = 1, int PERSISTENT = 0, int STAGED = 0>
__global__ void __launch_bounds__(BLOCKS == 1 ? 384 : 288, BLOCKS)
linear_wgmma_tma(const __half* a_hi, const __half* a_lo, long long a_stride,
                 const __half* __restrict__ w_hi, const __half* __restrict__ w_lo,
                 long long w_stride, const float* __restrict__ bias, int M, int N, int K,
                 __half* __restrict__ out_hi, __half* __restrict__ out_lo, long long out_stride,
                 const float* res, float* out_f, const unsigned char* __restrict__ valid,
                 int zero_sum, const float* __restrict__ norm_w,
                 const float* __restrict__ norm_b, float eps, __half* norm_hi, __half* norm_lo,
                 long long norm_stride, const __grid_constant__ TensorMap a_map,
                 const __grid_constant__ TensorMap w_map) {
    start_after_previous();
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    namespace wd = wgmma_detail;
    constexpr int BM = 128, BK = wd::BK, ROW_BYTES = wd::ROW_BYTES, ALIGN = wd::ALIGN;
    constexpr int PRODUCER_REGISTERS = 40, CONSUMER_REGISTERS = 232;
    static_assert(BLOCKS == 1 || BLOCKS == 2, "one block an SM (384 threads) or two (288)");
    static_assert(BLOCKS == 1 || BN == 128, "two blocks an SM: 64 accumulators a thread");
    static_assert(!PERSISTENT || BLOCKS == 2, "persistent: the two-blocks-an-SM layout");
    static_assert(!STAGED || (BLOCKS == 2 && !PERSISTENT), "staged: one tile a block, BN 128");
    static_assert(!STAGED || 128 * wd::staged_row<BN>() * 4 <= STAGES * (128 + BN) * 128,
                  "the staged tile must fit in the stages");
    static_assert(BLOCKS == 1 || 2 * (linear_wgmma_shared_bytes(BM, BN, 1, STAGES) + 1024) <=
                                     228 * 1024, "two blocks' stages must fit an SM");
    static_assert(BN == 128 || BN == 256, "wgmma n128 or n256; a TMA box of at most 256 rows");
    static_assert(EPI == HALF || EPI == GELU_PAIR || EPI == RESIDUAL, "no RESIDUAL_NORM");
    static_assert(STAGES >= 2, "fewer stages deadlock (the schedule above)");
    static_assert(128 * PRODUCER_REGISTERS + 256 * CONSUMER_REGISTERS <= 65536,
                  "the warpgroups' registers must fit the register file");
    static_assert(linear_wgmma_shared_bytes(BM, BN, 1, STAGES) <= MAX_WGMMA_SHARED_BYTES,
                  "the stages must fit one block's shared memory");
    constexpr int A_TILE = BM * ROW_BYTES, W_TILE = BN * ROW_BYTES;  // bytes, multiples of 1024
    constexpr int STAGE = A_TILE + W_TILE;  // the transaction bytes of one K tile's two boxes
    extern __shared__ __align__(1024) unsigned char wgmma_shared[];
    __shared__ __align__(8) unsigned long long full_bar[STAGES], empty_bar[STAGES];

    unsigned char* smem;  // TMA writes the stages; STAGED: the output tile over them after
    const unsigned base = align_shared<ALIGN>(wgmma_shared, smem);
    const unsigned full0 = static_cast<unsigned>(__cvta_generic_to_shared(full_bar));
    const unsigned empty0 = static_cast<unsigned>(__cvta_generic_to_shared(empty_bar));

    const int2 origin = wd::tile_origin(BM, BN);  // a persistent block's first tile's: unused
    const int m0 = origin.x, n0 = origin.y;
    const int k_tiles = (K + BK - 1) / BK;
    const int role = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
    // The producer: warpgroup 0 (BLOCKS 1), or warp 8 after the two consumers (BLOCKS 2).
    constexpr int PRODUCER_ROLE = BLOCKS == 1 ? 0 : 2, PRODUCER_THREAD = 128 * PRODUCER_ROLE;
    // PERSISTENT: this block's output tiles, blockIdx.x, + gridDim.x, ... below tile_end.
    const int n_tiles = (N + BN - 1) / BN, tile_end = (M + BM - 1) / BM * n_tiles;

    if (threadIdx.x == 0) {
        wd::prefetch_tensormap(&a_map);
        wd::prefetch_tensormap(&w_map);
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            wd::mbarrier_init(full0 + 8 * s, 1);
            wd::mbarrier_init(empty0 + 8 * s, 256);
        }
        wd::fence_mbarrier_init();
    }
    __syncthreads();

    if (role == PRODUCER_ROLE) {
        if constexpr (BLOCKS == 1) wd::setmaxnreg_dec<PRODUCER_REGISTERS>();
        if constexpr (PERSISTENT) {
            if (threadIdx.x >= PRODUCER_THREAD + 32) return;  // the producer warp goes on
            int done = 0;  // the block's K tiles before this output tile's
            for (int tile = blockIdx.x; tile < tile_end; tile += gridDim.x, done += k_tiles) {
                const int2 at = wd::tile_origin_of(tile, n_tiles, BM, BN);
                if constexpr (EPI == RESIDUAL)  // the whole warp, ahead of the copies
                    wd::prefetch_residual_tile<BM, BN>(res, out_stride, at.x, at.y, M, N,
                                                       threadIdx.x - PRODUCER_THREAD, 32);
                if (threadIdx.x == PRODUCER_THREAD)
                    wd::produce_tile<STAGES, A_TILE, STAGE>(base, full0, empty0, &a_map,
                                                            &w_map, k_tiles, done, at.x, at.y);
                __syncwarp();
            }
        } else {
            if constexpr (EPI == RESIDUAL)  // the producer warp, its copies not yet waited for
                if (threadIdx.x < PRODUCER_THREAD + 32)
                    wd::prefetch_residual_tile<BM, BN>(res, out_stride, m0, n0, M, N,
                                                       threadIdx.x - PRODUCER_THREAD, 32);
            if (threadIdx.x == PRODUCER_THREAD)
                wd::produce_tile<STAGES, A_TILE, STAGE>(base, full0, empty0, &a_map, &w_map,
                                                        k_tiles, 0, m0, n0);
        }
        return;
    }

    // Consumers: warpgroup group computes rows 64 group .. 64 group + 63 of each tile.
    if constexpr (BLOCKS == 1) wd::setmaxnreg_inc<CONSUMER_REGISTERS>();
    const int group = BLOCKS == 1 ? role - 1 : role;
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    constexpr int BATCH = BLOCKS == 1 ? wd::RESIDUAL_BATCH : wd::RESIDUAL_BATCH_LEAN;
    float acc[BN / 2];
    // One output tile's wgmmas from the ring (done: the block's K tiles before it) and epilogue
    // (STAGED: through the stages, which every copy has reached and no wgmma reads any more).
    auto compute_tile = [&](int tile_m0, int tile_n0, int done) {
        wd::consume_stages<BN, STAGES>(acc, base, full0, empty0, k_tiles, group, done);
        if constexpr (STAGED)
            wd::store_tile_staged<EPI>(acc, reinterpret_cast<float*>(smem), group, warp, lane,
                                       tile_m0, tile_n0, M, N, bias, out_hi, out_lo, out_stride,
                                       res, out_f, valid, zero_sum);
        else
            wd::store_fragment<BN, EPI, BATCH>(acc, tile_m0 + group * 64 + warp * 16 + lane / 4,
                                               tile_n0, lane % 4, M, N, bias, out_hi, out_lo,
                                               out_stride, res, out_f, valid, zero_sum);
    };
    if constexpr (PERSISTENT) {
        int done = 0;
        for (int tile = blockIdx.x; tile < tile_end; tile += gridDim.x, done += k_tiles) {
            const int2 at = wd::tile_origin_of(tile, n_tiles, BM, BN);
            compute_tile(at.x, at.y, done);
        }
    } else {
        compute_tile(m0, n0, 0);
    }
#elif defined(__CUDA_ARCH__)
    __trap();  // wgmma and TMA need sm_90a: compile this kernel for sm_90a
#endif
}

}  // namespace lb
