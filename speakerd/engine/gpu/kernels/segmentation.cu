// PyanNet (pyannote/segmentation-3.0) forward kernels. See engine/gpu/segmentation/engine.py.
// Layouts: per-window activations [k][C][P] (channel-major, so instance-norm rows are
// contiguous); LSTM tensors [k][T][F] (frame-major). A "split" row holds a float row three
// times over, [hi | lo | hi] with hi = x rounded to TF32 and lo = x - hi, so that one TF32
// tensor-core GEMM against [W_hi | W_hi | W_lo] sums hi*W_hi + lo*W_hi + hi*W_lo: FP32-accurate
// products at tensor-core speed (the "3xTF32" split; engine.py's "fast" math).

// speakerd.model.segmentation.architecture's sizes (tests/test_gpu_segmentation.py checks them)
#define WINDOW_SAMPLES 160000
#define SINC_FILTERS 80
#define SINC_KERNEL 251
#define SINC_STRIDE 10
#define POOL 3
#define CONV_CHANNELS 60
#define CONV_KERNEL 5
#define LSTM_HIDDEN 128
#define LSTM_GATE_ROWS 512
#define CLASSES 7
#define SPEAKERS 3

// tiles (engine.py's copies must match: tests/test_gpu_segmentation.py checks them)
#define SINC_TILE 128   // frames per block of sinc_global (the shared convolution)
#define SINC_HALF 40    // filters per block of sinc_global (40 accumulators a thread)
#define SINC_QUARTER 20 // filters per block of sinc_global64 (20 double accumulators a thread)
#define POOL_TILE 128   // pooled frames per block of the pooled sinc kernels; the in0 partial sums are per tile
#define SW_GROUP 20     // filters per block of sinc_window (3 frames x 20 filters = 60 accumulators a thread)
#define SW_SPAN (POOL_TILE * POOL * SINC_STRIDE + SINC_KERNEL)  // samples one sinc_window block reads
#define CONV_TILE 64    // pooled frames per block of conv5_pool
#define CONV_CI 16      // input channels staged per shared-memory chunk
#define LSTM_TB 16      // windows per block of lstm_layer (8 per half-block)
#define LC_THREADS 256  // threads of a lstm_cluster block
#define LC_CHUNK 16     // windows per matvec / cell-update phase of lstm_cluster
#define LC_UNITS 64     // hidden units per block of lstm_cluster (the cluster's two blocks hold 128)
#define LC_KQ 32        // recurrent inputs per k-quarter: a thread holds 4 gates x 32 weights

// Instance-norm rounding modes (engine.py NORM_MODES): how torch's normalisation may round.
// 0: ((x - mean) * invstd) * gamma + beta, each op rounded (ATen's native CUDA kernel as written)
// 1: fma((x - mean) * invstd, gamma, beta) (the same with the last two contracted)
// 2: fma(x, A, C), A = invstd * gamma, C = beta - mean * A (a per-channel affine)
// 3: fma(x - mean, A, beta)
// 4: x * A + C, each op rounded
// 5: (x - mean) * A + beta, each op rounded
__device__ __forceinline__ float norm_apply(float x, float mean, float invstd, float g, float b, int mode) {
  const float A = __fmul_rn(invstd, g);
  switch (mode) {
    case 0: return __fadd_rn(__fmul_rn(__fmul_rn(__fsub_rn(x, mean), invstd), g), b);
    case 1: return fmaf(__fmul_rn(__fsub_rn(x, mean), invstd), g, b);
    case 2: return fmaf(x, A, __fsub_rn(b, __fmul_rn(mean, A)));
    case 3: return fmaf(__fsub_rn(x, mean), A, b);
    case 4: return __fadd_rn(__fmul_rn(x, A), __fsub_rn(b, __fmul_rn(mean, A)));
    default: return __fadd_rn(__fmul_rn(__fsub_rn(x, mean), A), b);
  }
}

__device__ __forceinline__ float leaky(float v, float slope) { return v > 0.f ? v : v * slope; }

__device__ __forceinline__ float tf32_hi(float v) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
  return __uint_as_float(r);
}

// Writes v at column c of a row: plain (split 0, row of C) or split (row of 3C: hi | lo | hi).
__device__ __forceinline__ void put(float* row, int C, int c, float v, int split) {
  if (!split) {
    row[c] = v;
    return;
  }
  const float hi = tf32_hi(v);
  row[c] = hi;
  row[C + c] = v - hi;
  row[2 * C + c] = hi;
}

// Block-wide sums of two doubles (blockDim.x a multiple of 32, at most 1024); every thread gets them.
__device__ __forceinline__ double2 block_sum2(double s, double q) {
  __shared__ double ss[32], sq[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    s += __shfl_down_sync(0xffffffffu, s, o);
    q += __shfl_down_sync(0xffffffffu, q, o);
  }
  const int w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads();  // ss/sq may still be read by a previous call
  if ((threadIdx.x & 31) == 0) { ss[w] = s; sq[w] = q; }
  __syncthreads();
  s = 0.0; q = 0.0;
  for (int i = 0; i < nw; ++i) { s += ss[i]; q += sq[i]; }  // the same order in every thread
  return make_double2(s, q);
}

// Per-window statistics of the waveform instance norm over the window's 160000 samples
// (zeros past n included, as pyannote zero-pads the last window), sums in double:
// stats[k] = (mean, invstd) rounded to float (the fp32 math normalises each sample with them)
// and (a, c) of the affine y = a x + c, a = gamma * invstd and c = beta - mean * a from the
// double values, in float (stats: the shared convolution in float) and double (ac64: in double).
extern "C" __global__ __launch_bounds__(512) void window_stats(
    const float* __restrict__ x, long long n, const long long* __restrict__ starts, float gamma, float beta,
    float eps, float4* __restrict__ stats, double2* __restrict__ ac64) {
  const int k = blockIdx.x;
  const long long s0 = starts[k];
  double s = 0.0, q = 0.0;
  for (int i = threadIdx.x; i < WINDOW_SAMPLES; i += blockDim.x) {
    const long long j = s0 + i;
    const double v = j < n ? (double)x[j] : 0.0;
    s += v;
    q += v * v;
  }
  const double2 t = block_sum2(s, q);
  if (threadIdx.x == 0) {
    const double mean = t.x / WINDOW_SAMPLES;
    double var = t.y / WINDOW_SAMPLES - mean * mean;
    if (var < 0.0) var = 0.0;
    const double invstd = 1.0 / sqrt(var + (double)eps);
    const double a = (double)gamma * invstd, c = (double)beta - mean * a;
    stats[k] = make_float4((float)mean, (float)invstd, (float)a, (float)c);
    ac64[k] = make_double2(a, c);
  }
}

// Sum and sum of squares (double) of 128 threads' values v[f] for SW_GROUP / 1 filters, in a
// fixed order: part[(k * 80 + f) * tiles + tile] (the in0 statistics, reduced by norm0_stats).
template <int NF>
__device__ __forceinline__ void tile_partials(const float (&v)[NF], bool valid, float* red, int k, int f0, int tile,
                                              int tiles, double2* __restrict__ part) {
  // red: NF x POOL_TILE floats of shared memory, free for this use
#pragma unroll
  for (int f = 0; f < NF; ++f) red[f * POOL_TILE + threadIdx.x] = valid ? v[f] : 0.f;
  __syncthreads();
  // 4 threads a filter, 32 values each, then a 4-lane shuffle sum (lanes 4f .. 4f + 3 of one warp)
  const int f = threadIdx.x >> 2, part4 = threadIdx.x & 3;
  double s = 0.0, q = 0.0;
  if (f < NF) {
    for (int i = 0; i < POOL_TILE / 4; ++i) {
      const double w = (double)red[f * POOL_TILE + part4 * (POOL_TILE / 4) + i];
      s += w;
      q += w * w;
    }
  }
  s += __shfl_xor_sync(0xffffffffu, s, 1);
  q += __shfl_xor_sync(0xffffffffu, q, 1);
  s += __shfl_xor_sync(0xffffffffu, s, 2);
  q += __shfl_xor_sync(0xffffffffu, q, 2);
  if (f < NF && part4 == 0) part[((long long)k * SINC_FILTERS + f0 + f) * tiles + tile] = make_double2(s, q);
}

// FP32 math: window k's sinc convolution of its own normalised samples, rounded as torch
// rounds them (norm_apply, mode), then abs and MaxPool1d(3, 3): out [k][80][P]. A block is
// 128 pooled frames (3 x 128 sinc frames) x 20 filters of one window; a thread holds one
// pooled frame's 3 sinc frames x 20 filters, so the 15975-frame output never leaves registers.
// wT is [251][80] (filter fastest): a thread reads 20 weights as 5 broadcast float4s.
extern "C" __global__ __launch_bounds__(POOL_TILE) void sinc_window(
    const float* __restrict__ x, long long n, const long long* __restrict__ starts, const float4* __restrict__ stats,
    float gamma, float beta, int mode, const float* __restrict__ wT, int P, float* __restrict__ out,
    double2* __restrict__ part) {
  __shared__ float ys[SW_SPAN];
  __shared__ __align__(16) float ws[SINC_KERNEL * SW_GROUP];
  const int k = blockIdx.z, f0 = blockIdx.y * SW_GROUP, tile = blockIdx.x;
  const int p0 = tile * POOL_TILE;
  const long long base = starts[k] + (long long)p0 * POOL * SINC_STRIDE;
  const float4 st = stats[k];
  for (int i = threadIdx.x; i < SW_SPAN; i += POOL_TILE) {
    const long long j = base + i;
    // past n: the zero padding, normalised like any sample (torch pads, then normalises)
    ys[i] = norm_apply(j < n ? x[j] : 0.f, st.x, st.y, gamma, beta, mode);
  }
  for (int i = threadIdx.x; i < SINC_KERNEL * SW_GROUP; i += POOL_TILE)
    ws[i] = wT[(i / SW_GROUP) * SINC_FILTERS + f0 + i % SW_GROUP];
  __syncthreads();
  float a0[SW_GROUP], a1[SW_GROUP], a2[SW_GROUP];
#pragma unroll
  for (int f = 0; f < SW_GROUP; ++f) a0[f] = a1[f] = a2[f] = 0.f;
  const float* yt = ys + threadIdx.x * POOL * SINC_STRIDE;
#pragma unroll 2
  for (int t = 0; t < SINC_KERNEL; ++t) {
    const float v0 = yt[t], v1 = yt[t + SINC_STRIDE], v2 = yt[t + 2 * SINC_STRIDE];
    const float4* w4 = reinterpret_cast<const float4*>(ws + t * SW_GROUP);
#pragma unroll
    for (int q = 0; q < SW_GROUP / 4; ++q) {
      const float4 w = w4[q];
      a0[4 * q] = fmaf(w.x, v0, a0[4 * q]); a1[4 * q] = fmaf(w.x, v1, a1[4 * q]); a2[4 * q] = fmaf(w.x, v2, a2[4 * q]);
      a0[4 * q + 1] = fmaf(w.y, v0, a0[4 * q + 1]); a1[4 * q + 1] = fmaf(w.y, v1, a1[4 * q + 1]); a2[4 * q + 1] = fmaf(w.y, v2, a2[4 * q + 1]);
      a0[4 * q + 2] = fmaf(w.z, v0, a0[4 * q + 2]); a1[4 * q + 2] = fmaf(w.z, v1, a1[4 * q + 2]); a2[4 * q + 2] = fmaf(w.z, v2, a2[4 * q + 2]);
      a0[4 * q + 3] = fmaf(w.w, v0, a0[4 * q + 3]); a1[4 * q + 3] = fmaf(w.w, v1, a1[4 * q + 3]); a2[4 * q + 3] = fmaf(w.w, v2, a2[4 * q + 3]);
    }
  }
  const int p = p0 + threadIdx.x;
  const bool valid = p < P;
  float m[SW_GROUP];
#pragma unroll
  for (int f = 0; f < SW_GROUP; ++f) {
    m[f] = fmaxf(fabsf(a0[f]), fmaxf(fabsf(a1[f]), fabsf(a2[f])));
    if (valid) out[((long long)k * SINC_FILTERS + f0 + f) * P + p] = m[f];
  }
  __syncthreads();  // ws is reused for the partial sums
  tile_partials<SW_GROUP>(m, valid, ws, k, f0, tile, gridDim.x, part);
}

// Fast math, step 1: raw[f][g] = sum_k w[f][k] * x[10 g + k] over the whole group's
// (zero-padded) raw samples, once for all windows (they overlap 9 s in 10).
extern "C" __global__ __launch_bounds__(SINC_TILE) void sinc_global(
    const float* __restrict__ x, long long n, const float* __restrict__ wT, int G, float* __restrict__ raw) {
  __shared__ float xs[SINC_TILE * SINC_STRIDE + SINC_KERNEL];
  __shared__ __align__(16) float ws[SINC_KERNEL * SINC_HALF];
  const long long g0 = (long long)blockIdx.x * SINC_TILE;
  const int f0 = blockIdx.y * SINC_HALF;
  for (int i = threadIdx.x; i < SINC_TILE * SINC_STRIDE + SINC_KERNEL; i += blockDim.x) {
    const long long j = g0 * SINC_STRIDE + i;
    xs[i] = j < n ? x[j] : 0.f;
  }
  for (int i = threadIdx.x; i < SINC_KERNEL * SINC_HALF; i += blockDim.x)
    ws[i] = wT[(i / SINC_HALF) * SINC_FILTERS + f0 + i % SINC_HALF];
  __syncthreads();
  float acc[SINC_HALF];
#pragma unroll
  for (int f = 0; f < SINC_HALF; ++f) acc[f] = 0.f;
  const float* xt = xs + threadIdx.x * SINC_STRIDE;
#pragma unroll 2
  for (int k = 0; k < SINC_KERNEL; ++k) {
    const float v = xt[k];
    const float4* w4 = reinterpret_cast<const float4*>(ws + k * SINC_HALF);
#pragma unroll
    for (int q = 0; q < SINC_HALF / 4; ++q) {
      const float4 w = w4[q];
      acc[4 * q] = fmaf(w.x, v, acc[4 * q]); acc[4 * q + 1] = fmaf(w.y, v, acc[4 * q + 1]);
      acc[4 * q + 2] = fmaf(w.z, v, acc[4 * q + 2]); acc[4 * q + 3] = fmaf(w.w, v, acc[4 * q + 3]);
    }
  }
  const long long g = g0 + threadIdx.x;
  if (g < G) {
#pragma unroll
    for (int f = 0; f < SINC_HALF; ++f) raw[(long long)(f0 + f) * G + g] = acc[f];
  }
}

// sinc="shared64", step 1: sinc_global with the products and sums in double (FP64 runs at half
// the FP32 rate on Hopper; the shared convolution is 1/10 of the per-window work): the frames
// carry one rounding, at the end, instead of 251 float32 ones.
extern "C" __global__ __launch_bounds__(SINC_TILE) void sinc_global64(
    const float* __restrict__ x, long long n, const float* __restrict__ wT, int G, double* __restrict__ raw) {
  __shared__ float xs[SINC_TILE * SINC_STRIDE + SINC_KERNEL];
  __shared__ __align__(16) float ws[SINC_KERNEL * SINC_QUARTER];
  const long long g0 = (long long)blockIdx.x * SINC_TILE;
  const int f0 = blockIdx.y * SINC_QUARTER;
  for (int i = threadIdx.x; i < SINC_TILE * SINC_STRIDE + SINC_KERNEL; i += blockDim.x) {
    const long long j = g0 * SINC_STRIDE + i;
    xs[i] = j < n ? x[j] : 0.f;
  }
  for (int i = threadIdx.x; i < SINC_KERNEL * SINC_QUARTER; i += blockDim.x)
    ws[i] = wT[(i / SINC_QUARTER) * SINC_FILTERS + f0 + i % SINC_QUARTER];
  __syncthreads();
  double acc[SINC_QUARTER];
#pragma unroll
  for (int f = 0; f < SINC_QUARTER; ++f) acc[f] = 0.0;
  const float* xt = xs + threadIdx.x * SINC_STRIDE;
#pragma unroll 2
  for (int k = 0; k < SINC_KERNEL; ++k) {
    const double v = (double)xt[k];
    const float4* w4 = reinterpret_cast<const float4*>(ws + k * SINC_QUARTER);
#pragma unroll
    for (int q = 0; q < SINC_QUARTER / 4; ++q) {
      const float4 w = w4[q];
      acc[4 * q] = fma((double)w.x, v, acc[4 * q]); acc[4 * q + 1] = fma((double)w.y, v, acc[4 * q + 1]);
      acc[4 * q + 2] = fma((double)w.z, v, acc[4 * q + 2]); acc[4 * q + 3] = fma((double)w.w, v, acc[4 * q + 3]);
    }
  }
  const long long g = g0 + threadIdx.x;
  if (g < G) {
#pragma unroll
    for (int f = 0; f < SINC_QUARTER; ++f) raw[(long long)(f0 + f) * G + g] = acc[f];
  }
}

// sinc="shared64", step 2: sinc_shared_pool in double: a conv(x) + c sum(w) from the double
// frames, (a, c) and sum(w) in double, rounded once to float before abs and the pool.
extern "C" __global__ __launch_bounds__(POOL_TILE) void sinc_shared_pool64(
    const double* __restrict__ raw, int G, const long long* __restrict__ starts, const double2* __restrict__ ac64,
    const double* __restrict__ wsum, int P, float* __restrict__ out, double2* __restrict__ part) {
  __shared__ float red[POOL_TILE];
  const int tile = blockIdx.x, f = blockIdx.y, k = blockIdx.z;
  const int p = tile * POOL_TILE + threadIdx.x;
  const bool valid = p < P;
  float m[1] = {0.f};
  if (valid) {
    const double a = ac64[k].x, c = ac64[k].y * wsum[f];
    const double* r = raw + (long long)f * G + starts[k] / SINC_STRIDE + 3 * p;
    const float v0 = (float)fma(a, r[0], c), v1 = (float)fma(a, r[1], c), v2 = (float)fma(a, r[2], c);
    m[0] = fmaxf(fabsf(v0), fmaxf(fabsf(v1), fabsf(v2)));
    out[((long long)k * SINC_FILTERS + f) * P + p] = m[0];
  }
  tile_partials<1>(m, valid, red, k, f, tile, gridDim.x, part);
}

// Fast math, step 2: window k's sinc outputs from the shared ones, conv(a x + c) =
// a conv(x) + c sum(w); abs, MaxPool1d(3, 3): out [k][80][P], plus the in0 partial sums.
// Block: 128 pooled frames of one filter of one window.
extern "C" __global__ __launch_bounds__(POOL_TILE) void sinc_shared_pool(
    const float* __restrict__ raw, int G, const long long* __restrict__ starts, const float4* __restrict__ stats,
    const float* __restrict__ wsum, int P, float* __restrict__ out, double2* __restrict__ part) {
  __shared__ float red[POOL_TILE];
  const int tile = blockIdx.x, f = blockIdx.y, k = blockIdx.z;
  const int p = tile * POOL_TILE + threadIdx.x;
  const bool valid = p < P;
  float m[1] = {0.f};
  if (valid) {
    const float a = stats[k].z, c = stats[k].w * wsum[f];
    const float* r = raw + (long long)f * G + starts[k] / SINC_STRIDE + 3 * p;
    m[0] = fmaxf(fabsf(fmaf(a, r[0], c)), fmaxf(fabsf(fmaf(a, r[1], c)), fabsf(fmaf(a, r[2], c))));
    out[((long long)k * SINC_FILTERS + f) * P + p] = m[0];
  }
  tile_partials<1>(m, valid, red, k, f, tile, gridDim.x, part);
}

// in0's statistics from the sinc kernels' partial sums (fixed order, so replay is bitwise
// eager): ms[k * 80 + f] = (mean, invstd) in float, over P pooled frames.
extern "C" __global__ void norm0_stats(const double2* __restrict__ part, int rows, int tiles, int P, float eps,
                                       float2* __restrict__ ms) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  double s = 0.0, q = 0.0;
  for (int t = 0; t < tiles; ++t) {
    const double2 v = part[(long long)r * tiles + t];
    s += v.x;
    q += v.y;
  }
  const double mean = s / P;
  double var = q / P - mean * mean;
  if (var < 0.0) var = 0.0;
  ms[r] = make_float2((float)mean, (float)(1.0 / sqrt(var + (double)eps)));
}

// InstanceNorm1d(affine, biased variance) + leaky_relu over rows of length P, one block a row,
// sums in double. out_t null: in place; else written frame-major [k][P][C] (the LSTM input),
// split (3C a row) when split != 0.
extern "C" __global__ __launch_bounds__(256) void instnorm_leaky(
    float* __restrict__ y, int C, int P, const float* __restrict__ gamma, const float* __restrict__ beta, float eps,
    float slope, int mode, float* __restrict__ out_t, int split) {
  const long long row = blockIdx.x;
  const int c = (int)(row % C);
  float* r = y + row * P;
  double s = 0.0, q = 0.0;
  for (int i = threadIdx.x; i < P; i += blockDim.x) {
    const double v = r[i];
    s += v;
    q += v * v;
  }
  const double2 t = block_sum2(s, q);
  const double mean = t.x / P;
  double var = t.y / P - mean * mean;
  if (var < 0.0) var = 0.0;
  const float mf = (float)mean, inv = (float)(1.0 / sqrt(var + (double)eps));
  const long long k = row / C;
  const int width = split ? 3 * C : C;
  for (int i = threadIdx.x; i < P; i += blockDim.x) {
    const float v = leaky(norm_apply(r[i], mf, inv, gamma[c], beta[c], mode), slope);
    if (out_t) put(out_t + (k * P + i) * width, C, c, v, split);
    else r[i] = v;
  }
}

// Conv1d(Cin, 60, 5) + bias then MaxPool1d(3, 3): in [k][Cin][Pin], out [k][60][Pout].
// in_ms non-null: the input is normalised on load, leaky(norm_apply(x, mean, invstd,
// in_g[ci], in_b[ci])) with (mean, invstd) = in_ms[k * Cin + ci] (in0 fused, so the 80 x 5325
// activations are read once more instead of three times).
// Thread (px, cy): pooled frame px of the tile, output channels 20 cy .. 20 cy + 19, so it
// holds the 3 pre-pool frames x 20 channels in registers. wT is [Cin][5][60].
extern "C" __global__ __launch_bounds__(CONV_TILE * 3) void conv5_pool(
    const float* __restrict__ in, int Cin, int Pin, const float* __restrict__ wT, const float* __restrict__ bias,
    int Pout, float* __restrict__ out, const float2* __restrict__ in_ms, const float* __restrict__ in_g,
    const float* __restrict__ in_b, float slope, int mode) {
  __shared__ float xs[CONV_CI][3 * CONV_TILE + 4];
  __shared__ __align__(16) float ws[CONV_CI * CONV_KERNEL * CONV_CHANNELS];
  const int k = blockIdx.y, px = threadIdx.x, cy = threadIdx.y;
  const int tid = cy * CONV_TILE + px, nt = CONV_TILE * 3;
  const int t0 = blockIdx.x * CONV_TILE * 3;
  float acc[3][20];
#pragma unroll
  for (int i = 0; i < 3; ++i)
#pragma unroll
    for (int o = 0; o < 20; ++o) acc[i][o] = 0.f;
  for (int c0 = 0; c0 < Cin; c0 += CONV_CI) {
    __syncthreads();
    for (int i = tid; i < CONV_CI * (3 * CONV_TILE + 4); i += nt) {
      const int ci = i / (3 * CONV_TILE + 4), t = i % (3 * CONV_TILE + 4);
      float v = 0.f;
      if (c0 + ci < Cin && t0 + t < Pin) {
        v = in[((long long)k * Cin + c0 + ci) * Pin + t0 + t];
        if (in_ms) {
          const float2 ms = in_ms[k * Cin + c0 + ci];
          v = leaky(norm_apply(v, ms.x, ms.y, in_g[c0 + ci], in_b[c0 + ci], mode), slope);
        }
      }
      xs[ci][t] = v;
    }
    for (int i = tid; i < CONV_CI * CONV_KERNEL * CONV_CHANNELS; i += nt)
      ws[i] = c0 * CONV_KERNEL * CONV_CHANNELS + i < Cin * CONV_KERNEL * CONV_CHANNELS
                  ? wT[c0 * CONV_KERNEL * CONV_CHANNELS + i] : 0.f;
    __syncthreads();
    const int cmax = min(CONV_CI, Cin - c0);
    for (int ci = 0; ci < cmax; ++ci) {
#pragma unroll
      for (int tap = 0; tap < CONV_KERNEL; ++tap) {
        const float x0 = xs[ci][3 * px + tap], x1 = xs[ci][3 * px + tap + 1], x2 = xs[ci][3 * px + tap + 2];
        const float4* w4 = reinterpret_cast<const float4*>(ws + (ci * CONV_KERNEL + tap) * CONV_CHANNELS + 20 * cy);
#pragma unroll
        for (int q = 0; q < 5; ++q) {
          const float4 w = w4[q];
          acc[0][4*q] = fmaf(w.x, x0, acc[0][4*q]); acc[1][4*q] = fmaf(w.x, x1, acc[1][4*q]); acc[2][4*q] = fmaf(w.x, x2, acc[2][4*q]);
          acc[0][4*q+1] = fmaf(w.y, x0, acc[0][4*q+1]); acc[1][4*q+1] = fmaf(w.y, x1, acc[1][4*q+1]); acc[2][4*q+1] = fmaf(w.y, x2, acc[2][4*q+1]);
          acc[0][4*q+2] = fmaf(w.z, x0, acc[0][4*q+2]); acc[1][4*q+2] = fmaf(w.z, x1, acc[1][4*q+2]); acc[2][4*q+2] = fmaf(w.z, x2, acc[2][4*q+2]);
          acc[0][4*q+3] = fmaf(w.w, x0, acc[0][4*q+3]); acc[1][4*q+3] = fmaf(w.w, x1, acc[1][4*q+3]); acc[2][4*q+3] = fmaf(w.w, x2, acc[2][4*q+3]);
        }
      }
    }
  }
  const int p = blockIdx.x * CONV_TILE + px;
  if (p < Pout) {
#pragma unroll
    for (int o = 0; o < 20; ++o) {
      const int co = 20 * cy + o;
      // torch adds the bias before pooling; max(v + b) = max(v) + b exactly (same rounding per value)
      out[((long long)k * CONV_CHANNELS + co) * Pout + p] =
          fmaxf(acc[0][o] + bias[co], fmaxf(acc[1][o] + bias[co], acc[2][o] + bias[co]));
    }
  }
}

__device__ __forceinline__ float sigm(float v) { return 1.f / (1.f + expf(-v)); }

// One bidirectional LSTM layer's recurrence, the simple kernel (lstm="simple"). xp [k][T][1024]
// = x W_ih^T for both directions (forward gates 0..511, reverse 512..1023, each i,f,g,o x 128);
// bias [2][512] = b_ih + b_hh; whhT [2][128][512]; out [k][T][256] (split: 768). Block (window
// tile, direction) runs all T steps; W_hh (256 KB a direction) streams from L2.
extern "C" __global__ __launch_bounds__(256) void lstm_layer(
    const float* __restrict__ xp, const float* __restrict__ whhT, const float* __restrict__ bias,
    float* __restrict__ out, int B, int T, int split) {
  const int d = blockIdx.y, b0 = blockIdx.x * LSTM_TB;
  __shared__ float hs[LSTM_TB][LSTM_HIDDEN];
  const int j = threadIdx.x & 127, half = threadIdx.x >> 7;
  constexpr int NW = LSTM_TB / 2;
  float c[NW];
  const float* W = whhT + (size_t)d * LSTM_HIDDEN * LSTM_GATE_ROWS;
  const float bi = bias[d * 512 + j], bf = bias[d * 512 + 128 + j], bg = bias[d * 512 + 256 + j], bo = bias[d * 512 + 384 + j];
  const int width = split ? 768 : 256;
#pragma unroll
  for (int w = 0; w < NW; ++w) { c[w] = 0.f; hs[half * NW + w][j] = 0.f; }
  for (int s = 0; s < T; ++s) {
    const int t = d == 0 ? s : T - 1 - s;
    float a[NW][4];
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const int b = b0 + half * NW + w;
      const float* x = xp + ((size_t)b * T + t) * 1024 + d * 512;
      a[w][0] = b < B ? x[j] + bi : 0.f; a[w][1] = b < B ? x[128 + j] + bf : 0.f;
      a[w][2] = b < B ? x[256 + j] + bg : 0.f; a[w][3] = b < B ? x[384 + j] + bo : 0.f;
    }
    __syncthreads();
#pragma unroll 4
    for (int kk = 0; kk < LSTM_HIDDEN; ++kk) {
      const float w0 = W[kk * 512 + j], w1 = W[kk * 512 + 128 + j], w2 = W[kk * 512 + 256 + j], w3 = W[kk * 512 + 384 + j];
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        const float hk = hs[half * NW + w][kk];
        a[w][0] = fmaf(hk, w0, a[w][0]); a[w][1] = fmaf(hk, w1, a[w][1]);
        a[w][2] = fmaf(hk, w2, a[w][2]); a[w][3] = fmaf(hk, w3, a[w][3]);
      }
    }
    __syncthreads();
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const int b = b0 + half * NW + w;
      const float ig = sigm(a[w][0]), fg = sigm(a[w][1]), gg = tanhf(a[w][2]), og = sigm(a[w][3]);
      c[w] = fg * c[w] + ig * gg;
      const float hv = og * tanhf(c[w]);
      hs[half * NW + w][j] = hv;
      if (b < B) put(out + ((size_t)b * T + t) * width, 256, d * 128 + j, hv, split);
    }
  }
}

__device__ __forceinline__ void cluster_barrier() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Stores v into the peer block's shared memory at the address `local` has in this block's.
__device__ __forceinline__ void store_peer(float* local, unsigned peer, float v) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(local);
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(peer));
  asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(r), "f"(v) : "memory");
}

// One bidirectional LSTM layer's recurrence with W_hh held in registers (lstm="cluster").
// A direction's W_hh is 512 x 128 floats = 256 KB, the whole register file of one SM, so a
// cluster of two blocks (two SMs) holds it: block `rank` owns hidden units 64 rank .. +63 (all
// four gates), thread (warp w, lane l) holds the 4 gate rows of unit 64 rank + 32 (w / 4) + l
// for the recurrent inputs 32 (w % 4) .. +31: 128 registers. Each step, for TB windows (in
// chunks of 16): partial gate sums per k-quarter -> shared memory -> the cell update of
// (window, unit) pairs, whose h goes to both blocks' h copy (the peer's through distributed
// shared memory), then one cluster barrier. h is read from shared memory as broadcast float4s
// (16 FMAs a load). Dynamic shared memory: hs [2][TB][128] | red [16][4][64] float4 | cs [TB][64].
// whh [2][512][128] (torch's layout), bias [2][512], out as lstm_layer's. Grid (2 tiles, 2).
// CHUNK windows a phase: LC_CHUNK (lstm_cluster) or LC_CHUNK / 2 (lstm_cluster8, for groups
// so small that 16 windows a cluster leave SMs idle); TB is a multiple of it. Each (window,
// unit)'s sums are the same in either, so both give the same bits.
template <int CHUNK>
__device__ __forceinline__ void lstm_cluster_layer(
    const float* __restrict__ xp, const float* __restrict__ whh, const float* __restrict__ bias,
    float* __restrict__ out, int B, int T, int split, int TB) {
  static_assert(CHUNK * LC_UNITS % LC_THREADS == 0 && CHUNK <= LC_CHUNK && CHUNK % 2 == 0, "chunk");
  extern __shared__ __align__(16) float smem[];
  float* hs = smem;
  float4* red = reinterpret_cast<float4*>(hs + 2 * TB * LSTM_HIDDEN);
  float* cs = reinterpret_cast<float*>(red + LC_CHUNK * 4 * LC_UNITS);
  unsigned rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  const unsigned peer = rank ^ 1u;
  const int d = blockIdx.y, b0 = (blockIdx.x >> 1) * TB;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int q = warp & 3;
  const int um = (int)rank * LC_UNITS + (warp >> 2) * 32 + lane;  // the unit of this thread's weights
  const int slot_unit = (warp >> 2) * 32 + lane;                   // its index within the block's 64
  float w[4][LC_KQ];
  const float* wd = whh + (size_t)d * LSTM_GATE_ROWS * LSTM_HIDDEN;
#pragma unroll
  for (int g = 0; g < 4; ++g) {
    const float4* row = reinterpret_cast<const float4*>(wd + (size_t)(g * LSTM_HIDDEN + um) * LSTM_HIDDEN + LC_KQ * q);
#pragma unroll
    for (int i = 0; i < LC_KQ / 4; ++i) {
      const float4 v = row[i];
      w[g][4 * i] = v.x; w[g][4 * i + 1] = v.y; w[g][4 * i + 2] = v.z; w[g][4 * i + 3] = v.w;
    }
  }
  // the cell update's pairs: unit ul of this block, windows slot, slot + 4, ... of each chunk
  const int ul = tid & (LC_UNITS - 1), slot = tid >> 6;
  const int ug = (int)rank * LC_UNITS + ul;
  float bg[4];
#pragma unroll
  for (int g = 0; g < 4; ++g) bg[g] = bias[d * LSTM_GATE_ROWS + g * LSTM_HIDDEN + ug];
  for (int i = tid; i < 2 * TB * LSTM_HIDDEN; i += LC_THREADS) hs[i] = 0.f;
  for (int i = tid; i < TB * LC_UNITS; i += LC_THREADS) cs[i] = 0.f;
  const int width = split ? 768 : 256;
  cluster_barrier();  // both blocks running and zeroed before any distributed store
  constexpr int PAIRS = CHUNK * LC_UNITS / LC_THREADS;  // (window, unit) pairs a thread a chunk: 4 or 2
  for (int s = 0; s < T; ++s) {
    const int t = d == 0 ? s : T - 1 - s;
    const float* hc = hs + (s & 1) * TB * LSTM_HIDDEN;
    float* hn = hs + ((s + 1) & 1) * TB * LSTM_HIDDEN;
    for (int c0 = 0; c0 < TB; c0 += CHUNK) {
      float xv[PAIRS][4];
#pragma unroll
      for (int j = 0; j < PAIRS; ++j) {
        const int b = b0 + c0 + slot + 4 * j;
        const float* xr = xp + ((size_t)b * T + t) * 1024 + d * LSTM_GATE_ROWS + ug;
#pragma unroll
        for (int g = 0; g < 4; ++g) xv[j][g] = b < B ? xr[g * LSTM_HIDDEN] : 0.f;
      }
#pragma unroll 1
      for (int wi = 0; wi < CHUNK; wi += 2) {
        const float4* h0 = reinterpret_cast<const float4*>(hc + (c0 + wi) * LSTM_HIDDEN + LC_KQ * q);
        const float4* h1 = reinterpret_cast<const float4*>(hc + (c0 + wi + 1) * LSTM_HIDDEN + LC_KQ * q);
        float a0[4] = {0.f, 0.f, 0.f, 0.f}, a1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int i = 0; i < LC_KQ / 4; ++i) {
          const float4 x0 = h0[i], x1 = h1[i];
#pragma unroll
          for (int g = 0; g < 4; ++g) {
            a0[g] = fmaf(w[g][4 * i], x0.x, a0[g]); a1[g] = fmaf(w[g][4 * i], x1.x, a1[g]);
            a0[g] = fmaf(w[g][4 * i + 1], x0.y, a0[g]); a1[g] = fmaf(w[g][4 * i + 1], x1.y, a1[g]);
            a0[g] = fmaf(w[g][4 * i + 2], x0.z, a0[g]); a1[g] = fmaf(w[g][4 * i + 2], x1.z, a1[g]);
            a0[g] = fmaf(w[g][4 * i + 3], x0.w, a0[g]); a1[g] = fmaf(w[g][4 * i + 3], x1.w, a1[g]);
          }
        }
        red[(wi * 4 + q) * LC_UNITS + slot_unit] = make_float4(a0[0], a0[1], a0[2], a0[3]);
        red[((wi + 1) * 4 + q) * LC_UNITS + slot_unit] = make_float4(a1[0], a1[1], a1[2], a1[3]);
      }
      __syncthreads();
#pragma unroll
      for (int j = 0; j < PAIRS; ++j) {
        const int wc = slot + 4 * j, wl = c0 + wc, b = b0 + wl;
        const float4 p0 = red[(wc * 4 + 0) * LC_UNITS + ul], p1 = red[(wc * 4 + 1) * LC_UNITS + ul];
        const float4 p2 = red[(wc * 4 + 2) * LC_UNITS + ul], p3 = red[(wc * 4 + 3) * LC_UNITS + ul];
        const float gi = ((p0.x + p1.x) + (p2.x + p3.x)) + (xv[j][0] + bg[0]);
        const float gf = ((p0.y + p1.y) + (p2.y + p3.y)) + (xv[j][1] + bg[1]);
        const float gc = ((p0.z + p1.z) + (p2.z + p3.z)) + (xv[j][2] + bg[2]);
        const float go = ((p0.w + p1.w) + (p2.w + p3.w)) + (xv[j][3] + bg[3]);
        const float ig = sigm(gi), fg = sigm(gf), gg = tanhf(gc), og = sigm(go);
        const float c = fg * cs[wl * LC_UNITS + ul] + ig * gg;
        cs[wl * LC_UNITS + ul] = c;
        const float hv = og * tanhf(c);
        hn[wl * LSTM_HIDDEN + ug] = hv;
        store_peer(hn + wl * LSTM_HIDDEN + ug, peer, hv);
        if (b < B) put(out + ((size_t)b * T + t) * width, 256, d * LSTM_HIDDEN + ug, hv, split);
      }
      __syncthreads();  // red is rewritten by the next chunk
    }
    cluster_barrier();  // h of this step complete in both blocks
  }
}

extern "C" __global__ __cluster_dims__(2, 1, 1) __launch_bounds__(LC_THREADS, 1) void lstm_cluster(
    const float* __restrict__ xp, const float* __restrict__ whh, const float* __restrict__ bias,
    float* __restrict__ out, int B, int T, int split, int TB) {
  lstm_cluster_layer<LC_CHUNK>(xp, whh, bias, out, B, T, split, TB);
}

extern "C" __global__ __cluster_dims__(2, 1, 1) __launch_bounds__(LC_THREADS, 1) void lstm_cluster8(
    const float* __restrict__ xp, const float* __restrict__ whh, const float* __restrict__ bias,
    float* __restrict__ out, int B, int T, int split, int TB) {
  lstm_cluster_layer<LC_CHUNK / 2>(xp, whh, bias, out, B, T, split, TB);
}

// y[r][c] = leaky(y[r][c] + bias[c]) in place (the head's linear epilogue after cuBLAS).
extern "C" __global__ void bias_leaky(float* __restrict__ y, long long n, int C, const float* __restrict__ bias, float slope) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  y[i] = leaky(y[i] + bias[i % C], slope);
}

// classifier 128 -> 7, log_softmax ((z - max) - log(sum exp(z - max)), torch's order), and
// Powerset(3, 2).to_multilabel (argmax, the first max winning as torch.argmax does). One
// thread a frame; weights in shared memory.
extern "C" __global__ __launch_bounds__(128) void classify(
    const float* __restrict__ x, long long rows, const float* __restrict__ W, const float* __restrict__ b,
    const unsigned char* __restrict__ mapping, float* __restrict__ logp, unsigned char* __restrict__ ml) {
  __shared__ float ws[CLASSES * 128];
  for (int i = threadIdx.x; i < CLASSES * 128; i += blockDim.x) ws[i] = W[i];
  __syncthreads();
  const long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  float z[CLASSES];
#pragma unroll
  for (int o = 0; o < CLASSES; ++o) z[o] = 0.f;
  const float4* x4 = reinterpret_cast<const float4*>(x + r * 128);
  for (int q = 0; q < 32; ++q) {
    const float4 v = x4[q];
#pragma unroll
    for (int o = 0; o < CLASSES; ++o)
      z[o] = fmaf(v.w, ws[o * 128 + 4 * q + 3], fmaf(v.z, ws[o * 128 + 4 * q + 2], fmaf(v.y, ws[o * 128 + 4 * q + 1], fmaf(v.x, ws[o * 128 + 4 * q], z[o]))));
  }
#pragma unroll
  for (int o = 0; o < CLASSES; ++o) z[o] += b[o];
  float m = z[0];
  int am = 0;
#pragma unroll
  for (int o = 1; o < CLASSES; ++o) if (z[o] > m) { m = z[o]; am = o; }
  float s = 0.f;
#pragma unroll
  for (int o = 0; o < CLASSES; ++o) s += expf(z[o] - m);
  const float ls = logf(s);
#pragma unroll
  for (int o = 0; o < CLASSES; ++o) logp[r * CLASSES + o] = (z[o] - m) - ls;
#pragma unroll
  for (int s3 = 0; s3 < SPEAKERS; ++s3) ml[r * SPEAKERS + s3] = mapping[am * SPEAKERS + s3];
}
