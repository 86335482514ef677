// Implicit-GEMM convolution on tensor cores (mma.sync m16n8k8 TF32), NHWC float32 in and
// out, with the block's epilogue fused: y = act(conv(x, w) + bias (+ residual)).
//
// Why our own: cuDNN is weakest on the thin, wide layers (layer1: 32 channels at 80x998),
// and in strict FP32 it only has SIMT engines (2.1 ms for layer1's b32 conv at best, 22 of
// the H200's ~51 FP32 TFLOP/s). The "3xTF32" variant keeps FP32 accuracy on tensor cores:
// each operand is split into a TF32 high part and a TF32 remainder, and
// hi*hi + hi*lo + lo*hi is accumulated in FP32 (the dropped lo*lo term is ~2^-22 relative),
// so the error stays at FP32 level (checked against float64 by the GPU tests) for three
// MMAs per product. The plain TF32 variant is one MMA on operands rounded to TF32. Rounding
// is done with integer ops (round_tf32), not cvt.rna.tf32.f32, whose quarter issue rate
// would cost more than the MMAs themselves.
//
// GEMM view: M = n*ho*wo output pixels, N = cout, K = r*r*cin ordered (tap, channel) to
// match KRSC weights. Block tile BM x BN x BK (128 x 32|64 x 32): one K step is 32
// channels of one filter tap, so every A row is 128 contiguous bytes of one input pixel
// (zero-filled by cp.async where the tap falls in the padding). STAGES-deep cp.async
// pipeline; 4 warps, each 32 rows x BN. Within each 8-wide k slice, the fragment's columns
// t and t + 4 are read from the adjacent shared columns 2t and 2t + 1, for A and B alike
// (a dot product does not care which k pairs with which, only that A and B agree), so each
// fragment pair is one 8-byte load; rows are padded to 40 floats so those loads hit 32
// different banks per half warp.
//
// Requirements (checked on the host): cin % 32 == 0, cout % BN == 0, r in {1, 3},
// pad = r / 2; 16-byte aligned x and w.

#define IGEMM_BM 128
#define IGEMM_BK 32
#define IGEMM_STAGES 3
#define IGEMM_THREADS 128
#define IGEMM_LDS 40  // IGEMM_BK + 8 floats of padding

#include "common.cuh"

namespace {

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
}

// v rounded to TF32 (10 mantissa bits), to nearest with ties away from zero, by integer
// ops on the bits (adding half of the dropped ulp carries into the kept bits and, at a
// mantissa overflow, into the exponent, which is the correct rounding there too): two
// full-rate instructions where cvt.rna.tf32.f32 would issue at a quarter of the rate.
__device__ __forceinline__ unsigned round_tf32(unsigned bits) { return (bits + 0x1000u) & 0xffffe000u; }

// hi = TF32(v), lo = TF32(v - hi) (v - hi is exact in FP32, |v - hi| <= 2^-11 |v|):
// hi + lo is v to ~2^-22 relative, the accuracy 3xTF32 needs to stay at FP32 level.
__device__ __forceinline__ void split(float v, unsigned& hi, unsigned& lo) {
    hi = round_tf32(__float_as_uint(v));
    lo = round_tf32(__float_as_uint(v - __uint_as_float(hi)));
}

template <int BN, bool PRECISE>
__device__ __forceinline__ void conv_igemm(const float* __restrict__ x, const float* __restrict__ w,
                                           const float* __restrict__ bias, const float* __restrict__ residual,
                                           float* __restrict__ y, int n, int h, int wd, int c, int ho, int wo,
                                           int k, int r, int stride, int relu) {
    extern __shared__ float4 shared4[];
    float* a_tiles = reinterpret_cast<float*>(shared4);          // IGEMM_STAGES x BM x LDS
    float* b_tiles = a_tiles + IGEMM_STAGES * IGEMM_BM * IGEMM_LDS;  // IGEMM_STAGES x BN x LDS
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int group = lane >> 2, quad = lane & 3;  // mma fragment coordinates
    const int m0 = blockIdx.x * IGEMM_BM, n0 = blockIdx.y * BN;
    const int pixels = n * ho * wo, pad = r / 2;

    // Loads: thread tid copies 16-byte chunk (tid % 8) of rows tid/8 + 16j, so a warp reads
    // 512 contiguous bytes of a row block per instruction.
    const int chunk = tid & 7, row0 = tid >> 3;
    int a_image[8], a_ih[8], a_iw[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int m = m0 + row0 + 16 * j;
        if (m < pixels) {
            const int image = m / (ho * wo), rest = m - image * (ho * wo);
            const int oh = rest / wo, ow = rest - (rest / wo) * wo;
            a_image[j] = image * h * wd * c + chunk * 4;
            a_ih[j] = oh * stride - pad;
            a_iw[j] = ow * stride - pad;
        } else {
            a_image[j] = 0;
            a_ih[j] = -(1 << 28);  // never inside the image: the row loads zeros
            a_iw[j] = 0;
        }
    }
    const int steps_per_tap = c / IGEMM_BK, steps = r * r * steps_per_tap, filter = r * r * c;

    auto load = [&](int stage, int step) {
        const int tap = step / steps_per_tap, c0 = (step - tap * steps_per_tap) * IGEMM_BK;
        const int dh = tap / r, dw = tap - (tap / r) * r;
        float* a_tile = a_tiles + stage * IGEMM_BM * IGEMM_LDS;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int ih = a_ih[j] + dh, iw = a_iw[j] + dw;
            const bool inside = static_cast<unsigned>(ih) < static_cast<unsigned>(h) &&
                                static_cast<unsigned>(iw) < static_cast<unsigned>(wd);
            const float* source = inside ? x + a_image[j] + (ih * wd + iw) * c + c0 : x;
            cp_async16(a_tile + (row0 + 16 * j) * IGEMM_LDS + chunk * 4, source, inside);
        }
        float* b_tile = b_tiles + stage * BN * IGEMM_LDS;
#pragma unroll
        for (int j = 0; j < BN / 16; ++j) {
            const int row = row0 + 16 * j;
            cp_async16(b_tile + row * IGEMM_LDS + chunk * 4, w + (n0 + row) * filter + tap * c + c0 + chunk * 4, true);
        }
    };

    float acc[2][BN / 8][4];
    zero_fragments(acc);

#pragma unroll
    for (int s = 0; s < IGEMM_STAGES - 1; ++s) {
        if (s < steps) load(s, s);
        cp_async_commit();
    }
    for (int step = 0; step < steps; ++step) {
        cp_async_wait<IGEMM_STAGES - 2>();
        __syncthreads();  // this step's tile landed; everyone is done with the stage refilled next
        const int next = step + IGEMM_STAGES - 1;
        if (next < steps) load(next % IGEMM_STAGES, next);
        cp_async_commit();
        const float* a_tile = a_tiles + (step % IGEMM_STAGES) * IGEMM_BM * IGEMM_LDS + warp * 32 * IGEMM_LDS;
        const float* b_tile = b_tiles + (step % IGEMM_STAGES) * BN * IGEMM_LDS;
#pragma unroll
        for (int kk = 0; kk < IGEMM_BK; kk += 8) {
            unsigned a_hi[2][4], a_lo[2][4];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const float* rows = a_tile + (i * 16 + group) * IGEMM_LDS + kk + 2 * quad;
                const float2 top = *reinterpret_cast<const float2*>(rows);                   // row g
                const float2 bottom = *reinterpret_cast<const float2*>(rows + 8 * IGEMM_LDS);  // row g + 8
                const float v[4] = {top.x, bottom.x, top.y, bottom.y};  // a0..a3: (g, t) (g+8, t) (g, t+4) (g+8, t+4)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    if (PRECISE) {
                        split(v[e], a_hi[i][e], a_lo[i][e]);
                    } else {
                        a_hi[i][e] = round_tf32(__float_as_uint(v[e]));
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
                const float2 column =
                    *reinterpret_cast<const float2*>(b_tile + (j * 8 + group) * IGEMM_LDS + kk + 2 * quad);
                unsigned b_hi[2], b_lo[2];
                if (PRECISE) {
                    split(column.x, b_hi[0], b_lo[0]);
                    split(column.y, b_hi[1], b_lo[1]);
                } else {
                    b_hi[0] = round_tf32(__float_as_uint(column.x));
                    b_hi[1] = round_tf32(__float_as_uint(column.y));
                }
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    if (PRECISE) {
                        // The tensor cores' FP32 accumulation rounds toward zero: chained over
                        // K = 2304 (layer4) that biased the sum by 1.5e-5 of the output scale,
                        // 10x a strict FMA engine (measured on an H200). So each 8-wide k slice is
                        // summed from zero (small terms first) and added with a round-to-nearest
                        // FADD, leaving only three chained MMAs to truncate.
                        float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                        mma_tf32(part, a_lo[i], b_hi);
                        mma_tf32(part, a_hi[i], b_lo);
                        mma_tf32(part, a_hi[i], b_hi);
#pragma unroll
                        for (int e = 0; e < 4; ++e) acc[i][j][e] += part[e];
                    } else {
                        mma_tf32(acc[i][j], a_hi[i], b_hi);
                    }
                }
            }
        }
    }
    cp_async_wait<0>();

    // Epilogue from the accumulator fragments: rows group and group + 8 of each m16 tile,
    // two adjacent channels per thread (one 8-byte store).
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int m = m0 + warp * 32 + i * 16 + group + half * 8;
            if (m >= pixels) continue;
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
                const int channel = n0 + j * 8 + 2 * quad;
                const long long at = static_cast<long long>(m) * k + channel;
                float2 out = make_float2(acc[i][j][2 * half] + bias[channel], acc[i][j][2 * half + 1] + bias[channel + 1]);
                if (residual != nullptr) {
                    const float2 add = *reinterpret_cast<const float2*>(residual + at);
                    out.x += add.x;
                    out.y += add.y;
                }
                if (relu) {
                    out.x = fmaxf(out.x, 0.0f);
                    out.y = fmaxf(out.y, 0.0f);
                }
                *reinterpret_cast<float2*>(y + at) = out;
            }
        }
    }
}

}  // namespace

#define IGEMM_PARAMS                                                                                        \
    const float *__restrict__ x, const float *__restrict__ w, const float *__restrict__ bias,              \
        const float *__restrict__ residual, float *__restrict__ y, int n, int h, int wd, int c, int ho, int wo, \
        int k, int r, int stride, int relu
#define IGEMM_ARGS x, w, bias, residual, y, n, h, wd, c, ho, wo, k, r, stride, relu

// Entry points: conv_igemm_<math>_n<BN>. grid (ceil(pixels / 128), cout / BN), block 128,
// dynamic shared memory IGEMM_STAGES * (128 + BN) * 40 * 4 bytes; residual may be null.
extern "C" __global__ __launch_bounds__(IGEMM_THREADS) void conv_igemm_tf32_n32(IGEMM_PARAMS) {
    conv_igemm<32, false>(IGEMM_ARGS);
}
extern "C" __global__ __launch_bounds__(IGEMM_THREADS) void conv_igemm_tf32_n64(IGEMM_PARAMS) {
    conv_igemm<64, false>(IGEMM_ARGS);
}
extern "C" __global__ __launch_bounds__(IGEMM_THREADS) void conv_igemm_3xtf32_n32(IGEMM_PARAMS) {
    conv_igemm<32, true>(IGEMM_ARGS);
}
extern "C" __global__ __launch_bounds__(IGEMM_THREADS) void conv_igemm_3xtf32_n64(IGEMM_PARAMS) {
    conv_igemm<64, true>(IGEMM_ARGS);
}
