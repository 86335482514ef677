// A recording's PCM to 16 kHz mono on the GPU (speakerd/engine/gpu/pcm.py launches these).
//
// The arithmetic is speakerd/model/recording.py's and speakerd/model/resample.py's:
// pcm_mono_s16 / pcm_mono_f32: interleaved frames -> the channels' mean, summed in float64
//   and rounded once (NumPy's `frames.mean(axis=1, dtype=float64)`), s16 scaled by 1/32768
//   first (exact). The f32 form also finds the first frame holding a NaN/Inf or a sample
//   outside [-1, 1] (atomicMin on its index), which the launcher reports as the request's
//   error: pyannote neither clips nor normalises.
// resample_sinc: torchaudio.functional.resample's defaults as a polyphase FIR: output
//   sample j * new + p is filter p (2 width + orig taps, NumPy's float32 table) over the
//   input samples from j * orig - width on, zeros outside the recording. Summed in float64
//   (torchaudio's conv1d sums in float32 in an order of its own: the two differ by float32
//   rounding), one thread per output sample. Outputs [out_begin, out_end) only: a recording
//   is resampled piece by piece as it arrives, each output once its taps' samples are in
//   (the sums do not depend on where a piece ended, so the result is the same).

#define MONO_THREADS 256
#define RESAMPLE_THREADS 256
#define INT16_SCALE 32768.0

extern "C" __global__ __launch_bounds__(MONO_THREADS) void pcm_mono_s16(
    const short* __restrict__ pcm, int channels, long long frames, float* __restrict__ out) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < frames;
       i += (long long)gridDim.x * blockDim.x) {
    double sum = 0.0;
    for (int c = 0; c < channels; ++c) sum += (double)((float)pcm[i * channels + c] / (float)INT16_SCALE);
    out[i] = (float)(sum / channels);
  }
}

extern "C" __global__ __launch_bounds__(MONO_THREADS) void pcm_mono_f32(
    const float* __restrict__ pcm, int channels, long long frames, float* __restrict__ out,
    unsigned long long* __restrict__ first_bad) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < frames;
       i += (long long)gridDim.x * blockDim.x) {
    double sum = 0.0;
    bool bad = false;
    for (int c = 0; c < channels; ++c) {
      float x = pcm[i * channels + c];
      bad |= !(fabsf(x) <= 1.0f);  // NaN compares false: caught here too
      sum += (double)x;
    }
    if (bad) atomicMin(first_bad, (unsigned long long)i);
    out[i] = (float)(sum / channels);
  }
}

extern "C" __global__ __launch_bounds__(RESAMPLE_THREADS) void resample_sinc(
    const float* __restrict__ x, long long n, const float* __restrict__ kernel, int orig, int new_rate,
    int width, int taps, long long out_begin, long long out_end, float* __restrict__ y) {
  for (long long o = out_begin + (long long)blockIdx.x * blockDim.x + threadIdx.x; o < out_end;
       o += (long long)gridDim.x * blockDim.x) {
    long long j = o / new_rate;
    int p = (int)(o - j * new_rate);
    long long first = j * orig - width;  // input index of tap 0
    const float* filter = kernel + (long long)p * taps;
    double sum = 0.0;
    int k0 = first < 0 ? (int)(-first) : 0;
    long long last = first + taps;  // one past tap taps-1
    int k1 = last > n ? (int)(taps - (last - n)) : taps;
    for (int k = k0; k < k1; ++k) sum += (double)filter[k] * (double)x[first + k];
    y[o] = (float)sum;
  }
}
