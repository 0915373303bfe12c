// wgmma building blocks shared by the Hopper kernels (linear_wgmma.cu, attention_wgmma.cu):
// shared-memory matrix descriptors, the async-proxy and wgmma fences, commit and wait, mbarriers
// (also with transaction bytes), TMA tensor maps and 2-D and 3-D tile loads, setmaxnreg, operand
// fences, and the m64nNk16 f32 += f16 x f16 instructions with A from shared memory (SS) or from
// registers (RS). The instructions exist only on sm_90a (mbarrier try_wait, TMA and
// setmaxnreg: sm_90); callers use them only there.
#pragma once
#include "common.cuh"

namespace lb {

// A TMA tensor map (CUtensorMap: 128 bytes, 64-byte aligned; NVRTC has no cuda.h), built on the
// host by cuTensorMapEncodeTiled (tensor_maps.py) and passed to a kernel by value as a
// `const __grid_constant__` parameter, whose generic address the TMA instructions take.
struct alignas(64) TensorMap {
    unsigned long long v[16];
};
static_assert(sizeof(TensorMap) == 128 && alignof(TensorMap) == 64, "CUtensorMap's layout");

namespace wgmma {

// Named barrier id among COUNT threads (256: two warpgroups): bar.sync waits for all of them,
// bar.arrive counts this thread in without waiting (the attention consumers' turns, the GEMMs'
// staged epilogue).
template <int COUNT = 256>
__device__ __forceinline__ void named_sync(unsigned id) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(COUNT) : "memory");
}
__device__ __forceinline__ void named_arrive(unsigned id) {
    asm volatile("bar.arrive %0, 256;" ::"r"(id) : "memory");
}

// wgmma shared-memory matrix descriptor: start address >> 4 (bits 0-13), leading-dimension byte
// offset >> 4 (bits 16-29), stride-dimension byte offset >> 4 (bits 32-45), base offset 0 (bits
// 49-51: every swizzle pattern starts at a multiple of its size), swizzle mode (bits 62-63):
// 1 = 128B, 2 = 64B.
template <int SW>
__device__ __forceinline__ unsigned long long smem_desc(unsigned addr, unsigned lbo,
                                                        unsigned sbo) {
    constexpr unsigned long long MODE = SW == 128 ? 1ull : 2ull;
    return static_cast<unsigned long long>((addr & 0x3FFFF) >> 4) |
           (static_cast<unsigned long long>((lbo & 0x3FFFF) >> 4) << 16) |
           (static_cast<unsigned long long>((sbo & 0x3FFFF) >> 4) << 32) | (MODE << 62);
}

__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// mbarriers in shared memory (addresses from __cvta_generic_to_shared), CTA scope: init to an
// arrival count (one thread, before a block barrier), arrive (release), and wait for the
// completion of the phase of parity `parity` (acquire): try_wait.parity succeeds once the
// barrier's current phase has the other parity, so on a fresh barrier (phase 0 running)
// parity 1 succeeds at once.
__device__ __forceinline__ void mbarrier_init(unsigned addr, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(addr), "r"(count) : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(unsigned addr) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(addr) : "memory");
}

__device__ __forceinline__ void mbarrier_wait(unsigned addr, unsigned parity) {
    unsigned done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(addr), "r"(parity)
            : "memory");
    } while (!done);
}

// Make the mbarrier initialisations above visible to the async proxy (TMA's complete_tx) and
// other threads; before the block barrier that publishes them (CUTLASS fence_barrier_init).
__device__ __forceinline__ void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Arrive on the mbarrier at addr (one of its arrivals) after raising its expected transaction
// count by tx bytes: the phase completes once every arrival is in and tx bytes have landed.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(unsigned addr, unsigned tx) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(addr),
                 "r"(tx)
                 : "memory");
}

// Fetch the tensor map at a generic address (a __grid_constant__ parameter) into the cache.
__device__ __forceinline__ void prefetch_tensormap(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(map))
                 : "memory");
}

// TMA: copy the box of map at coordinates (c0 inner, c1 outer) into shared memory at dst,
// signalling its bytes on the mbarrier at bar (complete_tx). Elements outside the tensor are
// zero-filled and count towards the bytes all the same (the whole box).
__device__ __forceinline__ void tma_load_2d(unsigned dst, const TensorMap* map, unsigned bar,
                                            int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
        "[%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}

// TMA: copy the box of a 3-D map at coordinates (c0 inner, c1, c2 outer) into shared memory at
// dst, signalling its bytes on the mbarrier at bar, as tma_load_2d.
__device__ __forceinline__ void tma_load_3d(unsigned dst, const TensorMap* map, unsigned bar,
                                            int c0, int c1, int c2) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
        "[%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}

// The registers a thread of the executing warpgroup holds from here on (setmaxnreg: every
// warp of the warpgroup runs it; N a multiple of 8 in 24 .. 256).
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// Keep the compiler from moving accesses of a wgmma operand register across wgmma issue and wait.
__device__ __forceinline__ void fence_operand(float& x) { asm volatile("" : "+f"(x)::"memory"); }

__device__ __forceinline__ void fence_operand(unsigned& x) {
    asm volatile("" : "+r"(x)::"memory");
}

#define LB_AW_RW8(i)                                                                     \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]),          \
        "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define LB_AW_W8(i)                                                                      \
    "=f"(d[i]), "=f"(d[i + 1]), "=f"(d[i + 2]), "=f"(d[i + 3]), "=f"(d[i + 4]),          \
        "=f"(d[i + 5]), "=f"(d[i + 6]), "=f"(d[i + 7])

// The accumulator operand lists of the instructions below: %0 .. %(N - 1) for N fp32 registers.
#define LB_AW_ACC16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define LB_AW_ACC32                                                                      \
    LB_AW_ACC16 ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, "   \
                "%30, %31"
#define LB_AW_ACC64                                                                      \
    LB_AW_ACC32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "   \
                "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, " \
                "%61, %62, %63"
#define LB_AW_ACC128                                                                     \
    LB_AW_ACC64 ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, "   \
                "%78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, " \
                "%93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, "    \
                "%106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, "   \
                "%118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
// The text of wgmma m64nNk16 f32 += f16 x f16 with operands named by number: accumulators ACC,
// scale-d the predicate (operand SCALE != 0); SS reads A and B through the descriptors DA and
// DB, RS reads A from the four registers A and B through the descriptor DB.
#define LB_AW_SS(N, ACC, DA, DB, SCALE)                                                  \
    "{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE ", 0;\n"                                  \
    "wgmma.mma_async.sync.aligned.m64n" N "k16.f32.f16.f16 {" ACC "}, " DA ", " DB         \
    ", p, 1, 1, 0, 0;\n}\n"
#define LB_AW_RS(N, ACC, A, DB, SCALE)                                                   \
    "{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE ", 0;\n"                                  \
    "wgmma.mma_async.sync.aligned.m64n" N "k16.f32.f16.f16 {" ACC "}, {" A "}, " DB        \
    ", p, 1, 1, 1;\n}\n"

// SS<N>::run<SCALE_D>: d (64 x N fp32, the m64nNk16 accumulator fragment) = A * B + SCALE_D * d,
// A (64 x 16) and B (16 x N) both K-major in shared memory (descriptors da, db): imm-trans-a and
// imm-trans-b 0. With SCALE_D 0 d is only written (its old value is not an input).
template <int N>
struct SS;

// RS<N>::run: d (64 x N fp32) += A * B, A (64 x 16 fp16) from registers (a[0..3], the fragment
// of the m16n8k16 A operand for the warp's 16 rows), B (16 x N) N-major in shared memory
// (descriptor db, imm-trans-b 1).
template <int N>
struct RS;

template <>
struct SS<64> {
    template <int SCALE_D>
    static __device__ __forceinline__ void run(float (&d)[32], unsigned long long da,
                                               unsigned long long db) {
        if constexpr (SCALE_D == 0) {
            asm volatile(
                LB_AW_SS("64", LB_AW_ACC32, "%32", "%33", "%34")
                : LB_AW_W8(0), LB_AW_W8(8), LB_AW_W8(16), LB_AW_W8(24)
                : "l"(da), "l"(db), "n"(0));
        } else {
            asm volatile(
                LB_AW_SS("64", LB_AW_ACC32, "%32", "%33", "%34")
                : LB_AW_RW8(0), LB_AW_RW8(8), LB_AW_RW8(16), LB_AW_RW8(24)
                : "l"(da), "l"(db), "n"(1));
        }
    }
};

template <>
struct SS<128> {
    template <int SCALE_D>
    static __device__ __forceinline__ void run(float (&d)[64], unsigned long long da,
                                               unsigned long long db) {
        if constexpr (SCALE_D == 0) {
            asm volatile(
                LB_AW_SS("128", LB_AW_ACC64, "%64", "%65", "%66")
                : LB_AW_W8(0), LB_AW_W8(8), LB_AW_W8(16), LB_AW_W8(24), LB_AW_W8(32), LB_AW_W8(40),
                  LB_AW_W8(48), LB_AW_W8(56)
                : "l"(da), "l"(db), "n"(0));
        } else {
            asm volatile(
                LB_AW_SS("128", LB_AW_ACC64, "%64", "%65", "%66")
                : LB_AW_RW8(0), LB_AW_RW8(8), LB_AW_RW8(16), LB_AW_RW8(24), LB_AW_RW8(32),
                  LB_AW_RW8(40), LB_AW_RW8(48), LB_AW_RW8(56)
                : "l"(da), "l"(db), "n"(1));
        }
    }
};

// m64n256k16, accumulate only (SCALE_D 1): the 128x256 GEMM tile (linear_wgmma.cu).
template <>
struct SS<256> {
    template <int SCALE_D>
    static __device__ __forceinline__ void run(float (&d)[128], unsigned long long da,
                                               unsigned long long db) {
        static_assert(SCALE_D == 1, "SS<256> only accumulates");
        asm volatile(
            LB_AW_SS("256", LB_AW_ACC128, "%128", "%129", "%130")
            : LB_AW_RW8(0), LB_AW_RW8(8), LB_AW_RW8(16), LB_AW_RW8(24), LB_AW_RW8(32),
              LB_AW_RW8(40), LB_AW_RW8(48), LB_AW_RW8(56), LB_AW_RW8(64), LB_AW_RW8(72),
              LB_AW_RW8(80), LB_AW_RW8(88), LB_AW_RW8(96), LB_AW_RW8(104), LB_AW_RW8(112),
              LB_AW_RW8(120)
            : "l"(da), "l"(db), "n"(1));
    }
};

template <>
struct RS<32> {
    static __device__ __forceinline__ void run(float (&d)[16], const unsigned (&a)[4],
                                               unsigned long long db) {
        asm volatile(
            LB_AW_RS("32", LB_AW_ACC16, "%16, %17, %18, %19", "%20", "%21")
            : LB_AW_RW8(0), LB_AW_RW8(8)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(1));
    }
};

template <>
struct RS<64> {
    static __device__ __forceinline__ void run(float (&d)[32], const unsigned (&a)[4],
                                               unsigned long long db) {
        asm volatile(
            LB_AW_RS("64", LB_AW_ACC32, "%32, %33, %34, %35", "%36", "%37")
            : LB_AW_RW8(0), LB_AW_RW8(8), LB_AW_RW8(16), LB_AW_RW8(24)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(1));
    }
};

template <>
struct RS<128> {
    static __device__ __forceinline__ void run(float (&d)[64], const unsigned (&a)[4],
                                               unsigned long long db) {
        asm volatile(
            LB_AW_RS("128", LB_AW_ACC64, "%64, %65, %66, %67", "%68", "%69")
            : LB_AW_RW8(0), LB_AW_RW8(8), LB_AW_RW8(16), LB_AW_RW8(24), LB_AW_RW8(32),
              LB_AW_RW8(40), LB_AW_RW8(48), LB_AW_RW8(56)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(1));
    }
};

template <>
struct RS<256> {
    static __device__ __forceinline__ void run(float (&d)[128], const unsigned (&a)[4],
                                               unsigned long long db) {
        asm volatile(
            LB_AW_RS("256", LB_AW_ACC128, "%128, %129, %130, %131", "%132", "%133")
            : LB_AW_RW8(0), LB_AW_RW8(8), LB_AW_RW8(16), LB_AW_RW8(24), LB_AW_RW8(32),
              LB_AW_RW8(40), LB_AW_RW8(48), LB_AW_RW8(56), LB_AW_RW8(64), LB_AW_RW8(72),
              LB_AW_RW8(80), LB_AW_RW8(88), LB_AW_RW8(96), LB_AW_RW8(104), LB_AW_RW8(112),
              LB_AW_RW8(120)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(1));
    }
};

#undef LB_AW_RW8
#undef LB_AW_W8
#undef LB_AW_ACC16
#undef LB_AW_ACC32
#undef LB_AW_ACC64
#undef LB_AW_ACC128
#undef LB_AW_SS
#undef LB_AW_RS

}  // namespace wgmma
}  // namespace lb
