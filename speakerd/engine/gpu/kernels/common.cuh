// Device helpers shared by the kernels/*.cu files. Included textually by
// server/engine/gpu/kernels.py (an `#include "common.cuh"` line is replaced by this file
// before NVRTC sees the source), so the source CuPy caches its binary under holds this text
// too: an edit here recompiles every kernel that uses it.
//
// FP16 without cuda_fp16.h (NVRTC's built-in headers only): halves are 16-bit words,
// converted by PTX.

#pragma once

#define HALF_MAX_FINITE 65504.0f

// 16 bytes global -> shared, asynchronously; !valid fills them with zeros and reads nothing.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    const int bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(gmem), "r"(bytes));
}

// c += a * b by one warp-wide mma.sync (FP32 accumulators; a: 4 and b: 2 registers of
// packed operands). The two shapes the convolutions use:
//   mma_tf32: m16n8k8, TF32 operands (kernels/conv_igemm.cu)
//   mma_f16: m16n8k16, FP16 operands (kernels/conv_f16.cu)
#define MMA_SYNC(NAME, INSTRUCTION)                                                                          \
    __device__ __forceinline__ void NAME(float* c, const unsigned* a, const unsigned* b) {                  \
        asm volatile(INSTRUCTION " {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                  \
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                         \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));                     \
    }
MMA_SYNC(mma_tf32, "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32")
MMA_SYNC(mma_f16, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32")

// The FP16 convolutions' m16k16 A fragment (kernels/conv_f16.cu, block_f16.cu): pixel rows g
// and g + 8 of a 16-wide k slice, 8 bytes each from `top` and `bottom` (the slice's shared
// columns 4 * quad .. 4 * quad + 3: conv_f16.cu's "Fragments" says why that order works).
__device__ __forceinline__ void load_a_f16(unsigned (&a)[4], const unsigned short* top, const unsigned short* bottom) {
    const uint2 t = *reinterpret_cast<const uint2*>(top);
    const uint2 b = *reinterpret_cast<const uint2*>(bottom);
    a[0] = t.x;
    a[1] = b.x;
    a[2] = t.y;
    a[3] = b.y;
}

// An MMA accumulator tile [M16][N8 tiles][4] set to zero (compile-time indices only).
template <int M16, int N8>
__device__ __forceinline__ void zero_fragments(float (&acc)[M16][N8][4]) {
#pragma unroll
    for (int i = 0; i < M16; ++i)
#pragma unroll
        for (int j = 0; j < N8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
}

__device__ __forceinline__ float half_to_float(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(h));
    return f;
}

// Two floats as one f16x2 word, lo in the low half (round to nearest; beyond 65504 the
// conversion gives inf, which the range check has flagged before).
__device__ __forceinline__ unsigned pack_half2(float lo, float hi) {
    unsigned packed;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(hi), "f"(lo));
    return packed;
}

__device__ __forceinline__ float2 unpack_half2(unsigned packed) {
    return make_float2(half_to_float(static_cast<unsigned short>(packed & 0xffffu)),
                       half_to_float(static_cast<unsigned short>(packed >> 16)));
}

// Whether v is outside FP16's finite range (NaN included: it compares false).
__device__ __forceinline__ bool out_of_half_range(float v) { return !(fabsf(v) <= HALF_MAX_FINITE); }

// v[0..7] += the 8 halves of `add` (16 bytes of a half residual).
__device__ __forceinline__ void add_halves(float (&v)[8], uint4 add) {
    const unsigned words[4] = {add.x, add.y, add.z, add.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const float2 pair = unpack_half2(words[e]);
        v[2 * e] += pair.x;
        v[2 * e + 1] += pair.y;
    }
}

// The end of every FP16 epilogue: ReLU (when `relu`), the range check (bad |= any of the 8
// outside FP16's range) and the 8 values as 16 bytes of halves.
__device__ __forceinline__ uint4 relu_check_pack(float (&v)[8], bool relu, bool& bad) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        if (relu) v[e] = fmaxf(v[e], 0.0f);
        bad |= out_of_half_range(v[e]);
    }
    return make_uint4(pack_half2(v[0], v[1]), pack_half2(v[2], v[3]), pack_half2(v[4], v[5]), pack_half2(v[6], v[7]));
}

// One flag write per block whose threads saw a value out of range (the host reads the flag
// with the outputs and recomputes the batch without FP16). Every thread of the block must
// reach it (a barrier).
__device__ __forceinline__ void raise_flag(bool bad, int* flag) {
    if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(flag, 1);
}

// The FP16 epilogue of a block's output tile of ROWS x COLS pixels x BN channels (pixel p =
// row * COLS + column from (oh0, ow0) of `image`, channels from n0), THREADS threads: per
// 8 channels (16 bytes), sums(pixel, part, s0, s1) gives the FP32 sums of the convolution,
// then bias, residual, ReLU, the range check and the store; pixels outside the image are
// skipped. The kernels differ only in where the sums are (kernels/conv_f16.cu: staged in
// shared memory, or split K's slices; conv_wgmma.cu: staged).
template <int ROWS, int COLS, int BN, int THREADS, class Sums>
__device__ __forceinline__ void f16_tile_epilogue(Sums sums, const float* __restrict__ bias,
                                                  const unsigned short* __restrict__ residual,
                                                  unsigned short* __restrict__ y, int* __restrict__ flag,
                                                  int image, int oh0, int ow0, int ho, int wo, int k, int n0,
                                                  int relu) {
    bool bad = false;
    for (int index = threadIdx.x; index < ROWS * COLS * (BN / 8); index += THREADS) {
        const int pixel = index / (BN / 8), part = index - pixel * (BN / 8);
        const int oh = oh0 + pixel / COLS, ow = ow0 + pixel % COLS;
        if (oh >= ho || ow >= wo) continue;
        const int channel = n0 + part * 8;
        const float4 b0 = *reinterpret_cast<const float4*>(bias + channel);
        const float4 b1 = *reinterpret_cast<const float4*>(bias + channel + 4);
        float4 s0, s1;
        sums(pixel, part, s0, s1);
        float v[8] = {s0.x + b0.x, s0.y + b0.y, s0.z + b0.z, s0.w + b0.w,
                      s1.x + b1.x, s1.y + b1.y, s1.z + b1.z, s1.w + b1.w};
        const long long at = ((static_cast<long long>(image) * ho + oh) * wo + ow) * k + channel;
        if (residual != nullptr) add_halves(v, *reinterpret_cast<const uint4*>(residual + at));
        *reinterpret_cast<uint4*>(y + at) = relu_check_pack(v, relu, bad);
    }
    raise_flag(bad, flag);
}
