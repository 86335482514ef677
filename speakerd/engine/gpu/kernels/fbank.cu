// pyannote's Kaldi fbank on the GPU (speakerd/engine/gpu/fbank.py launches these).
//
// The arithmetic is speakerd/model/fbank.py's, step for step, in float64: per 400-sample
// frame remove the DC, pre-emphasise (0.97, sample 0 its own predecessor), multiply by the
// symmetric Hamming window, zero-pad to 512, power spectrum, 80 triangular mel filters,
// log(max(energy, FLT_EPSILON)). Why float64: a mel bin 80 dB below its frame's peak holds
// one FFT bin whose float32 FFT error is ~1e-3 relative (1.8e-3 in log units measured
// against the float64 pipeline), while float64 leaves only the final float32 rounding
// (~2e-6); the H200 runs float64 at half its float32 rate and this kernel is bound by its
// memory traffic either way. The window, twiddle and mel tables come from NumPy (the
// launcher uploads them), so both sides use the same numbers.
//
// fbank_frames: one frame per 16 threads (half a warp), so every step between phases is a
//   __syncwarp of that half. The 512-point real FFT is a 256-point complex FFT of
//   z[n] = y[2n] + i y[2n+1] as 16 x 16: each lane does a 16-point FFT in registers (one
//   column), the twiddles W256^(n2 k1), a transpose through shared memory, a second
//   16-point FFT per lane (one row), then X[k] = E[k] + W512^k O[k] splits the halves.
// fbank_window_sums / fbank_window_write: windows of 998 frames starting every
//   `frame_step` frames, each with its own per-mel mean removed. Sums are float64 per
//   (window, 128-row slice), in a fixed order (no atomics: two runs give the same bits).

#define FRAME_LENGTH 400
#define FRAME_SHIFT 160
#define INT16_SCALE 32768.0
#define PREEMPHASIS 0.97
// float32 epsilon: torchaudio floors the mel energies at torch.finfo(torch.float).eps
#define LOG_FLOOR 1.1920928955078125e-07
#define MELS 80
#define FRAMES 998
// 512-point real FFT = 256-point complex FFT = RADIX x RADIX
#define FFT_SIZE 512
#define FFT_HALF 256
#define RADIX 16
// threads per frame: one per column / row of the 16 x 16 decomposition
#define LANES 16
#define FRAME_THREADS 128
#define FRAMES_PER_BLOCK (FRAME_THREADS / LANES)
// the transpose buffer's rows are padded by one double2 so that the column reads of the
// second FFT fall in distinct banks
#define PADDED_ROW (RADIX + 1)
#define FRAME_BUFFER (RADIX * PADDED_ROW)
// mean sums: rows per slice and slices per window (7 x 128 + 102 = 998)
#define SLICE_ROWS 128
#define SLICES ((FRAMES + SLICE_ROWS - 1) / SLICE_ROWS)
#define SUM_ROW_GROUPS 4
#define SUM_THREADS (MELS * SUM_ROW_GROUPS)
#define WRITE_THREADS 256
#define MEL_VECTORS (MELS / 4)

__device__ __forceinline__ double2 cadd(double2 a, double2 b) { return make_double2(a.x + b.x, a.y + b.y); }
__device__ __forceinline__ double2 csub(double2 a, double2 b) { return make_double2(a.x - b.x, a.y - b.y); }
__device__ __forceinline__ double2 cmul(double2 a, double2 b) {
    return make_double2(a.x * b.x - a.y * b.y, a.x * b.y + a.y * b.x);
}

// W16^e = exp(-2 pi i e / 16) for e in 0..7; called with compile-time e only (folds away).
#define COS_PI_8 0.92387953251128675613
#define SIN_PI_8 0.38268343236508977173
#define SQRT_HALF 0.70710678118654752440
__device__ __forceinline__ double2 twiddle16(int e) {
    switch (e) {
        case 0: return make_double2(1.0, 0.0);
        case 1: return make_double2(COS_PI_8, -SIN_PI_8);
        case 2: return make_double2(SQRT_HALF, -SQRT_HALF);
        case 3: return make_double2(SIN_PI_8, -COS_PI_8);
        case 4: return make_double2(0.0, -1.0);
        case 5: return make_double2(-SIN_PI_8, -COS_PI_8);
        case 6: return make_double2(-SQRT_HALF, -SQRT_HALF);
        default: return make_double2(-COS_PI_8, -SIN_PI_8);
    }
}

__device__ __forceinline__ constexpr int bit_reverse4(int i) {
    return ((i & 1) << 3) | ((i & 2) << 1) | ((i & 4) >> 1) | ((i & 8) >> 3);
}

// One radix-2 stage of fft16: butterflies of span 2 * HALF, twiddles W16^(j * 8 / HALF).
template <int HALF>
__device__ __forceinline__ void fft16_stage(double2 (&t)[RADIX]) {
#pragma unroll
    for (int k = 0; k < RADIX; k += 2 * HALF) {
#pragma unroll
        for (int j = 0; j < HALF; ++j) {
            const double2 v = cmul(twiddle16(j * (8 / HALF)), t[k + j + HALF]);
            const double2 u = t[k + j];
            t[k + j] = cadd(u, v);
            t[k + j + HALF] = csub(u, v);
        }
    }
}

// In-register 16-point DFT, A[k] = sum_n a[n] W16^(n k): radix-2 decimation in time, every
// index a compile-time constant (template stages, unrolled loops: no local memory).
__device__ __forceinline__ void fft16(double2 (&a)[RADIX]) {
    double2 t[RADIX];
#pragma unroll
    for (int i = 0; i < RADIX; ++i) t[i] = a[bit_reverse4(i)];
    fft16_stage<1>(t);
    fft16_stage<2>(t);
    fft16_stage<4>(t);
    fft16_stage<8>(t);
#pragma unroll
    for (int i = 0; i < RADIX; ++i) a[i] = t[i];
}

// log-mel energies of frames [0, total_frames): frame g is frame f = g % frames_per_recording
// of recording r = g / frames_per_recording, whose samples start at samples + r *
// recording_stride; a recording's samples at or past `valid_samples` read as zeros (the
// zero padding of a short last window, without copying it). frames: [total_frames, 80].
// window [400], twiddle [512] = W512^k, mel_weight [nonzeros], mel_index [3][80] = (first
// FFT bin, bin count, offset into mel_weight) of each filter.
extern "C" __global__ __launch_bounds__(FRAME_THREADS) void fbank_frames(
    const float* __restrict__ samples, long long recording_stride, long long valid_samples,
    int frames_per_recording, long long total_frames, const double* __restrict__ window,
    const double2* __restrict__ twiddle, const double* __restrict__ mel_weight, const int* __restrict__ mel_index,
    float* __restrict__ frames) {
    __shared__ double2 buffers[FRAMES_PER_BLOCK][FRAME_BUFFER];
    const int lane = threadIdx.x % LANES;
    const int slot = threadIdx.x / LANES;
    const long long g = (long long)blockIdx.x * FRAMES_PER_BLOCK + slot;
    if (g >= total_frames) return;  // the whole half-warp leaves together
    const unsigned half = 0xFFFFu << (threadIdx.x & 16);  // this frame's 16 lanes
    const long long recording = g / frames_per_recording;
    const long long start = (g - recording * frames_per_recording) * FRAME_SHIFT;
    const float* frame = samples + recording * recording_stride + start;
    const long long valid = valid_samples - start;  // samples of this frame that exist
    double2* z = buffers[slot];
    double* y = reinterpret_cast<double*>(z);  // y[n] real, z[n] = y[2n] + i y[2n+1]

    // DC offset: the frame's mean (400 = 25 x 16 samples, a float64 sum across the lanes)
    double sum = 0.0;
#pragma unroll 5
    for (int n = lane; n < FRAME_LENGTH; n += LANES) sum += n < valid ? (double)__ldg(frame + n) : 0.0;
#pragma unroll
    for (int offset = LANES / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(half, sum, offset);
    const double mean = sum * INT16_SCALE / FRAME_LENGTH;

    // pre-emphasis and window into y; 400..511 are the zero padding
#pragma unroll 4
    for (int n = lane; n < FFT_SIZE; n += LANES) {
        double value = 0.0;
        if (n < FRAME_LENGTH) {
            const int previous = n > 0 ? n - 1 : 0;
            const double current = (n < valid ? (double)__ldg(frame + n) : 0.0) * INT16_SCALE - mean;
            const double before = (previous < valid ? (double)__ldg(frame + previous) : 0.0) * INT16_SCALE - mean;
            value = (current - PREEMPHASIS * before) * __ldg(window + n);
        }
        y[n] = value;
    }
    __syncwarp(half);

    // column n2 = lane: A[k1] = sum_n1 z[16 n1 + n2] W16^(n1 k1), times W256^(n2 k1)
    double2 a[RADIX];
#pragma unroll
    for (int i = 0; i < RADIX; ++i) a[i] = z[i * RADIX + lane];
    fft16(a);
    __syncwarp(half);  // every lane has read its column before the transpose overwrites z
#pragma unroll
    for (int k1 = 0; k1 < RADIX; ++k1) {
        z[k1 * PADDED_ROW + lane] = cmul(a[k1], __ldg(twiddle + 2 * lane * k1));  // W256^e = W512^(2e)
    }
    __syncwarp(half);

    // row k1 = lane: Z[k1 + 16 k2] = sum_n2 B[n2][k1] W16^(n2 k2)
#pragma unroll
    for (int i = 0; i < RADIX; ++i) a[i] = z[lane * PADDED_ROW + i];
    fft16(a);
    __syncwarp(half);
#pragma unroll
    for (int k2 = 0; k2 < RADIX; ++k2) z[lane + RADIX * k2] = a[k2];
    __syncwarp(half);

    // power |X[k]|^2 for k < 256 (the Nyquist bin has no mel weight):
    // E = (Z[k] + conj Z[-k]) / 2, O = (Z[k] - conj Z[-k]) / 2i, X = E + W512^k O
    double power[RADIX];
#pragma unroll
    for (int j = 0; j < RADIX; ++j) {
        const int k = lane + RADIX * j;
        const double2 zk = z[k], zm = z[(FFT_HALF - k) & (FFT_HALF - 1)];
        const double2 even = make_double2(0.5 * (zk.x + zm.x), 0.5 * (zk.y - zm.y));
        const double2 odd = make_double2(0.5 * (zk.y + zm.y), -0.5 * (zk.x - zm.x));
        const double2 x = cadd(even, cmul(__ldg(twiddle + k), odd));
        power[j] = x.x * x.x + x.y * x.y;
    }
    __syncwarp(half);
#pragma unroll
    for (int j = 0; j < RADIX; ++j) y[lane + RADIX * j] = power[j];
    __syncwarp(half);

    // mel filters: each a contiguous run of FFT bins
    float* out = frames + g * MELS;
#pragma unroll
    for (int j = 0; j < MELS / LANES; ++j) {
        const int mel = lane + LANES * j;
        const int first = __ldg(mel_index + mel), count = __ldg(mel_index + MELS + mel);
        const double* weight = mel_weight + __ldg(mel_index + 2 * MELS + mel);
        double energy = 0.0;
        for (int i = 0; i < count; ++i) energy += y[first + i] * __ldg(weight + i);
        out[mel] = (float)log(fmax(energy, LOG_FLOOR));
    }
}

// partial[(w * SLICES + s) * 80 + m] = sum over rows of slice s of window w of frames[row, m],
// window w (0 <= w < count) being frames [(first + w) * frame_step, ... + 998).
// Grid (count, SLICES), SUM_THREADS threads.
extern "C" __global__ __launch_bounds__(SUM_THREADS) void fbank_window_sums(const float* __restrict__ frames,
                                                                           int first, int frame_step,
                                                                           double* __restrict__ partial) {
    __shared__ double sums[SUM_ROW_GROUPS][MELS];
    const int mel = threadIdx.x % MELS, group = threadIdx.x / MELS;
    const int window = blockIdx.x, slice = blockIdx.y;
    const float* rows = frames + ((long long)(first + window) * frame_step + slice * SLICE_ROWS) * MELS;
    const int count = min(SLICE_ROWS, FRAMES - slice * SLICE_ROWS);
    double sum = 0.0;
    for (int row = group; row < count; row += SUM_ROW_GROUPS) sum += (double)__ldg(rows + row * MELS + mel);
    sums[group][mel] = sum;
    __syncthreads();
    if (group == 0) {
        double total = 0.0;
#pragma unroll
        for (int i = 0; i < SUM_ROW_GROUPS; ++i) total += sums[i][mel];
        partial[((long long)window * SLICES + slice) * MELS + mel] = total;
    }
}

// out[w] = window w's frames minus its per-mel mean (from fbank_window_sums' partial sums),
// [count, 998, 80] float32, each value rounded once from float64. Grid (count, SLICES),
// WRITE_THREADS threads; frames and out 16-byte aligned.
extern "C" __global__ __launch_bounds__(WRITE_THREADS) void fbank_window_write(const float4* __restrict__ frames,
                                                                              int first, int frame_step,
                                                                              const double* __restrict__ partial,
                                                                              float4* __restrict__ out) {
    __shared__ double mean[MELS];
    const int window = blockIdx.x, slice = blockIdx.y;
    if (threadIdx.x < MELS) {
        double total = 0.0;
#pragma unroll
        for (int s = 0; s < SLICES; ++s) total += partial[((long long)window * SLICES + s) * MELS + threadIdx.x];
        mean[threadIdx.x] = total / FRAMES;
    }
    __syncthreads();
    const int row0 = slice * SLICE_ROWS;
    const int vectors = min(SLICE_ROWS, FRAMES - row0) * MEL_VECTORS;
    const float4* src = frames + ((long long)(first + window) * frame_step + row0) * MEL_VECTORS;
    float4* dst = out + ((long long)window * FRAMES + row0) * MEL_VECTORS;
    for (int i = threadIdx.x; i < vectors; i += WRITE_THREADS) {
        const float4 v = __ldg(src + i);
        const int m = (i % MEL_VECTORS) * 4;
        dst[i] = make_float4((float)((double)v.x - mean[m]), (float)((double)v.y - mean[m + 1]),
                             (float)((double)v.z - mean[m + 2]), (float)((double)v.w - mean[m + 3]));
    }
}
