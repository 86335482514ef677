// speakerd CUDA kernels (compiled at run time by CuPy/NVRTC for the device's architecture).
//
// Layouts: trunk activations are NHWC (H = mel rows, W = frames, C fastest), the layout
// cuDNN's fastest convolution engines read: float32, or float16 in FP16 mode (whose kernels
// end in _f16, compute in FP32 and flag any value outside FP16's range). Masks are [n, 3, F] float32 with F, the
// mask frame count, read from device memory so one captured CUDA graph serves any F.

#define FRAMES 998
#define MELS 80
#define SPEAKERS 3
#define TRUNK_CHANNELS 256
#define TRUNK_MELS 10
#define TRUNK_FRAMES 125
#define POOL_FEATURES (TRUNK_CHANNELS * TRUNK_MELS)
#define TILE 32
#define STEM_CHANNELS 32
#define STEM_TAPS 9
#define STEM_THREADS 128

#include "common.cuh"

// fbank [n, 998 frames, 80 mels] -> stem input NHWC [n, 80, 998, 1]: a tiled transpose
// through shared memory so both the read and the write are coalesced.
// grid (ceil(998/32), ceil(80/32), n), block (32, 8).
extern "C" __global__ void fbank_to_stem(const float* __restrict__ fbank, float* __restrict__ out) {
    __shared__ float tile[TILE][TILE + 1];  // +1: no bank conflicts on the transposed read
    const size_t chunk = blockIdx.z;
    const float* src = fbank + chunk * FRAMES * MELS;
    float* dst = out + chunk * FRAMES * MELS;
    const int frame0 = blockIdx.x * TILE, mel0 = blockIdx.y * TILE;
    for (int i = threadIdx.y; i < TILE; i += blockDim.y) {
        const int frame = frame0 + i, mel = mel0 + threadIdx.x;
        if (frame < FRAMES && mel < MELS) tile[i][threadIdx.x] = src[frame * MELS + mel];
    }
    __syncthreads();
    for (int i = threadIdx.y; i < TILE; i += blockDim.y) {
        const int mel = mel0 + i, frame = frame0 + threadIdx.x;
        if (frame < FRAMES && mel < MELS) dst[mel * FRAMES + frame] = tile[threadIdx.x][i];
    }
}

// The convolution epilogue in place on NHWC y: y = act(y + bias[c] (+ residual)).
// Vectorised by float4: every channel count of the trunk (32..256) is a multiple of 4.
template <bool RESIDUAL, bool RELU>
__device__ __forceinline__ void epilogue(float4* __restrict__ y, const float4* __restrict__ bias,
                                         const float4* __restrict__ residual, long long vectors,
                                         int channel_vectors) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < vectors; i += stride) {
        float4 v = y[i];
        const float4 b = bias[i % channel_vectors];
        v.x += b.x; v.y += b.y; v.z += b.z; v.w += b.w;
        if (RESIDUAL) {
            const float4 r = residual[i];
            v.x += r.x; v.y += r.y; v.z += r.z; v.w += r.w;
        }
        if (RELU) {
            v.x = fmaxf(v.x, 0.0f); v.y = fmaxf(v.y, 0.0f); v.z = fmaxf(v.z, 0.0f); v.w = fmaxf(v.w, 0.0f);
        }
        y[i] = v;
    }
}

extern "C" __global__ void bias_only(float4* y, const float4* bias, long long vectors, int channel_vectors) {
    epilogue<false, false>(y, bias, nullptr, vectors, channel_vectors);
}

extern "C" __global__ void bias_relu(float4* y, const float4* bias, long long vectors, int channel_vectors) {
    epilogue<false, true>(y, bias, nullptr, vectors, channel_vectors);
}

extern "C" __global__ void bias_add_relu(float4* y, const float4* bias, const float4* residual, long long vectors,
                                         int channel_vectors) {
    epilogue<true, true>(y, bias, residual, vectors, channel_vectors);
}

// The FP16 epilogue after a bare cuDNN conv with half output, in place on NHWC y, 8 halves
// (16 bytes) a step: y = half(act(y + bias[c] (+ residual))) computed in FP32. The conv's
// own output is checked too: cuDNN converted it to half, so an overflow there reads as inf
// (or 65504 where a plan saturates, flagged conservatively).
template <bool RESIDUAL, bool RELU>
__device__ __forceinline__ void epilogue_f16(uint4* __restrict__ y, const float4* __restrict__ bias,
                                             const uint4* __restrict__ residual, long long vectors,
                                             int channel_vectors, int* __restrict__ flag) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    bool bad = false;
    const long long rounds = (vectors + stride - 1) / stride;  // every thread reaches raise_flag's barrier
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (long long round = 0; round < rounds; ++round, i += stride) {
        if (i >= vectors) continue;
        const uint4 packed = y[i];
        const unsigned words[4] = {packed.x, packed.y, packed.z, packed.w};
        const int channel = static_cast<int>(i % channel_vectors) * 2;  // in float4s of bias
        const float4 b0 = bias[channel], b1 = bias[channel + 1];
        const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
        float v[8];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float2 pair = unpack_half2(words[e]);
            v[2 * e] = pair.x;
            v[2 * e + 1] = pair.y;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            bad |= !(fabsf(v[e]) < HALF_MAX_FINITE);
            v[e] += b[e];
        }
        if (RESIDUAL) add_halves(v, residual[i]);
        y[i] = relu_check_pack(v, RELU, bad);
    }
    raise_flag(bad, flag);
}

// vectors: 8-half groups of y; channel_vectors: 8-half groups per pixel.
extern "C" __global__ void bias_only_f16(uint4* y, const float4* bias, long long vectors, int channel_vectors,
                                         int* flag) {
    epilogue_f16<false, false>(y, bias, nullptr, vectors, channel_vectors, flag);
}

extern "C" __global__ void bias_relu_f16(uint4* y, const float4* bias, long long vectors, int channel_vectors,
                                         int* flag) {
    epilogue_f16<false, true>(y, bias, nullptr, vectors, channel_vectors, flag);
}

extern "C" __global__ void bias_add_relu_f16(uint4* y, const float4* bias, const uint4* residual, long long vectors,
                                             int channel_vectors, int* flag) {
    epilogue_f16<true, true>(y, bias, residual, vectors, channel_vectors, flag);
}

// The stem, 1 -> 32 channels 3x3 stride 1 pad 1, + bias + ReLU, by direct FP32 arithmetic:
// one input channel leaves a GEMM nothing to tile (cuDNN ran it at 2.7 TFLOP/s, 0.46 ms of
// a 6.9 ms TF32 b32 forward), while this kernel is bound by writing its output once.
// x: [n, 80, 998] (the stem input, C = 1); w: KRSC [32, 3, 3, 1]; one thread per output
// pixel. The block's 128 pixels x 32 channels are one contiguous run of the NHWC output, so
// they are staged in shared memory and written by consecutive threads in 16-byte pieces
// (written a pixel per thread, 128 or 64 bytes each, the stores ran at 1.1 / 1.6 TB/s).
// grid ceil(n * 80 * 998 / 128), block STEM_THREADS.
template <bool HALF>
__device__ __forceinline__ void stem(const float* __restrict__ x, const float* __restrict__ w,
                                     const float* __restrict__ bias, void* __restrict__ y, int n,
                                     int* __restrict__ flag) {
    // 16-byte pieces of one pixel's output, and of its staged row (padded by one piece so a
    // quarter warp's row writes hit different banks)
    constexpr int PIECES = STEM_CHANNELS * (HALF ? 2 : 4) / 16;
    constexpr int ROW = PIECES + 1;
    __shared__ float weights[STEM_TAPS][STEM_CHANNELS];
    __shared__ float shift[STEM_CHANNELS];
    __shared__ uint4 staged[STEM_THREADS * ROW];
    for (int i = threadIdx.x; i < STEM_TAPS * STEM_CHANNELS; i += blockDim.x)
        weights[i % STEM_TAPS][i / STEM_TAPS] = w[i];
    if (threadIdx.x < STEM_CHANNELS) shift[threadIdx.x] = bias[threadIdx.x];
    __syncthreads();
    const long long total = (long long)n * MELS * FRAMES, first = (long long)blockIdx.x * STEM_THREADS;
    const long long pixel = first + threadIdx.x;
    bool bad = false;
    if (pixel < total) {
        const int image = static_cast<int>(pixel / (MELS * FRAMES));
        const int rest = static_cast<int>(pixel - (long long)image * MELS * FRAMES);
        const int mel = rest / FRAMES, frame = rest - (rest / FRAMES) * FRAMES;
        const float* plane = x + (long long)image * MELS * FRAMES;
        float v[STEM_TAPS];
#pragma unroll
        for (int tap = 0; tap < STEM_TAPS; ++tap) {
            const int ih = mel + tap / 3 - 1, iw = frame + tap % 3 - 1;
            v[tap] = (ih >= 0 && ih < MELS && iw >= 0 && iw < FRAMES) ? plane[ih * FRAMES + iw] : 0.0f;
        }
        float out[STEM_CHANNELS];
#pragma unroll
        for (int k = 0; k < STEM_CHANNELS; ++k) {
            float acc = 0.0f;
#pragma unroll
            for (int tap = 0; tap < STEM_TAPS; ++tap) acc = fmaf(v[tap], weights[tap][k], acc);
            out[k] = acc + shift[k];
        }
        uint4* row = staged + threadIdx.x * ROW;
#pragma unroll
        for (int q = 0; q < PIECES; ++q) {
            if (HALF) {
                float part[8];
#pragma unroll
                for (int e = 0; e < 8; ++e) part[e] = out[q * 8 + e];
                row[q] = relu_check_pack(part, true, bad);
            } else {
                const float4 part = make_float4(fmaxf(out[4 * q], 0.0f), fmaxf(out[4 * q + 1], 0.0f),
                                                fmaxf(out[4 * q + 2], 0.0f), fmaxf(out[4 * q + 3], 0.0f));
                row[q] = *reinterpret_cast<const uint4*>(&part);
            }
        }
    }
    __syncthreads();
    const int pieces = static_cast<int>(min((long long)STEM_THREADS, total - first)) * PIECES;
    uint4* block_out = reinterpret_cast<uint4*>(y) + first * PIECES;
    for (int i = threadIdx.x; i < pieces; i += STEM_THREADS) block_out[i] = staged[(i / PIECES) * ROW + i % PIECES];
    if (HALF) raise_flag(bad, flag);
}

extern "C" __global__ void stem_f32(const float* x, const float* w, const float* bias, float* y, int n) {
    stem<false>(x, w, bias, y, n, nullptr);
}

extern "C" __global__ void stem_f16(const float* x, const float* w, const float* bias, unsigned short* y, int n,
                                    int* flag) {
    stem<true>(x, w, bias, y, n, flag);
}

// pyannote StatsPool (weighted) of the trunk output under each speaker's mask, one kernel.
//
// x: NHWC [n, 10, 125, 256]; feature f = channel * 10 + mel (pyannote flattens NCHW
// [256, 10] into 2560 rows). masks: [n, 3, F] with F = *mask_frames; trunk frame t takes
// mask frame floor(t * F / 125) (nearest resize). pooled: [n * 3, 5120], means then stds.
// active: [n * 3] trunk frames with non-zero weight (0 = empty mask: output is seg_1.bias).
// grid (n, 10 mel rows), block 256 (one thread per channel: reads coalesced along C).
__device__ __forceinline__ float load_activation(const float* p) { return *p; }
__device__ __forceinline__ float load_activation(const unsigned short* p) { return half_to_float(*p); }

template <typename T>
__device__ __forceinline__ void stats_pool(const T* __restrict__ x, const float* __restrict__ masks,
                                           const int* __restrict__ mask_frames, float* __restrict__ pooled,
                                           int* __restrict__ active) {
    __shared__ float w[SPEAKERS][TRUNK_FRAMES];
    __shared__ float v1[SPEAKERS], v2[SPEAKERS];
    const int chunk = blockIdx.x, mel = blockIdx.y, channel = threadIdx.x;
    const int frames = *mask_frames;
    for (int i = threadIdx.x; i < SPEAKERS * TRUNK_FRAMES; i += blockDim.x) {
        const int s = i / TRUNK_FRAMES, t = i % TRUNK_FRAMES;
        const long long source = (long long)t * frames / TRUNK_FRAMES;
        w[s][t] = masks[((long long)chunk * SPEAKERS + s) * frames + source];
    }
    __syncthreads();
    if (threadIdx.x < SPEAKERS) {
        const int s = threadIdx.x;
        float sum = 0.0f, sum_sq = 0.0f;
        int count = 0;
        for (int t = 0; t < TRUNK_FRAMES; ++t) {
            sum += w[s][t];
            sum_sq += w[s][t] * w[s][t];
            count += w[s][t] != 0.0f;
        }
        v1[s] = sum + 1e-8f;  // pyannote: v1 = sum(w) + 1e-8
        v2[s] = sum_sq;
        if (mel == 0) active[chunk * SPEAKERS + s] = count;
    }
    __syncthreads();
    const T* column = x + ((long long)chunk * TRUNK_MELS + mel) * TRUNK_FRAMES * TRUNK_CHANNELS + channel;
    float mean[SPEAKERS] = {0.0f, 0.0f, 0.0f};
    for (int t = 0; t < TRUNK_FRAMES; ++t) {
        const float value = load_activation(column + t * TRUNK_CHANNELS);
#pragma unroll
        for (int s = 0; s < SPEAKERS; ++s) mean[s] += w[s][t] * value;
    }
    float var[SPEAKERS] = {0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int s = 0; s < SPEAKERS; ++s) mean[s] /= v1[s];
    for (int t = 0; t < TRUNK_FRAMES; ++t) {
        const float value = load_activation(column + t * TRUNK_CHANNELS);
#pragma unroll
        for (int s = 0; s < SPEAKERS; ++s) {
            const float d = value - mean[s];
            var[s] += w[s][t] * d * d;
        }
    }
    const int feature = channel * TRUNK_MELS + mel;
#pragma unroll
    for (int s = 0; s < SPEAKERS; ++s) {
        // pyannote: var = sum(w (x - mean)^2) / (v1 - v2 / v1 + 1e-8); std = sqrt(var)
        const float denominator = v1[s] - v2[s] / v1[s] + 1e-8f;
        float* row = pooled + ((long long)chunk * SPEAKERS + s) * 2 * POOL_FEATURES;
        row[feature] = mean[s];
        row[POOL_FEATURES + feature] = sqrtf(var[s] / denominator);
    }
}

extern "C" __global__ void stats_pool_f32(const float* x, const float* masks, const int* mask_frames, float* pooled,
                                          int* active) {
    stats_pool(x, masks, mask_frames, pooled, active);
}

// The FP16 trunk's output (halves), pooled in FP32; block (0, 0) also reads the trunk's
// range maxima. Each convolution run by a fused cuDNN graph writes the largest magnitude
// of its FP32 result (before the rounding to half) into its slot of `amax` (0 for the
// others); one beyond 65504, or NaN, raises the range flag like our own kernels do. Read
// here rather than by a kernel of its own because the pool runs after the whole trunk
// anyway (one launch less: ~2 us of a b1 forward). Slots are cleared as they are read, so
// a slot whose convolution stops being fused cannot keep a stale value.
extern "C" __global__ void stats_pool_f16(const unsigned short* x, const float* masks, const int* mask_frames,
                                          float* pooled, int* active, float* amax, int amax_count, int* flag) {
    if (blockIdx.x == 0 && blockIdx.y == 0) {
        bool bad = false;
        for (int i = threadIdx.x; i < amax_count; i += blockDim.x) {
            bad |= out_of_half_range(amax[i]);
            amax[i] = 0.0f;
        }
        raise_flag(bad, flag);
    }
    stats_pool(x, masks, mask_frames, pooled, active);
}
