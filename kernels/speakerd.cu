// speakerd CUDA kernels (compiled at run time by CuPy/NVRTC for the device's architecture).
//
// Layouts: trunk activations are NHWC float32 (H = mel rows, W = frames, C fastest), the
// layout cuDNN's fastest convolution engines read. Masks are [n, 3, F] float32 with F, the
// mask frame count, read from device memory so one captured CUDA graph serves any F.

#define FRAMES 998
#define MELS 80
#define SPEAKERS 3
#define TRUNK_CHANNELS 256
#define TRUNK_MELS 10
#define TRUNK_FRAMES 125
#define POOL_FEATURES (TRUNK_CHANNELS * TRUNK_MELS)
#define TILE 32

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

// pyannote StatsPool (weighted) of the trunk output under each speaker's mask, one kernel.
//
// x: NHWC [n, 10, 125, 256]; feature f = channel * 10 + mel (pyannote flattens NCHW
// [256, 10] into 2560 rows). masks: [n, 3, F] with F = *mask_frames; trunk frame t takes
// mask frame floor(t * F / 125) (nearest resize). pooled: [n * 3, 5120], means then stds.
// active: [n * 3] trunk frames with non-zero weight (0 = empty mask: output is seg_1.bias).
// grid (n, 10 mel rows), block 256 (one thread per channel: reads coalesced along C).
extern "C" __global__ void stats_pool(const float* __restrict__ x, const float* __restrict__ masks,
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
    const float* column = x + ((long long)chunk * TRUNK_MELS + mel) * TRUNK_FRAMES * TRUNK_CHANNELS + channel;
    float mean[SPEAKERS] = {0.0f, 0.0f, 0.0f};
    for (int t = 0; t < TRUNK_FRAMES; ++t) {
        const float value = column[t * TRUNK_CHANNELS];
#pragma unroll
        for (int s = 0; s < SPEAKERS; ++s) mean[s] += w[s][t] * value;
    }
    float var[SPEAKERS] = {0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int s = 0; s < SPEAKERS; ++s) mean[s] /= v1[s];
    for (int t = 0; t < TRUNK_FRAMES; ++t) {
        const float value = column[t * TRUNK_CHANNELS];
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
