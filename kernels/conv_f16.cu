// FP16 convolution on tensor cores (mma.sync m16n8k16, FP32 accumulation), NHWC half in and
// out, with the block's epilogue fused and range-checked:
//   y = half(act(conv(x, w) + bias (+ residual))), flag |= 1 where |y| > 65504 or NaN.
//
// Why our own: in FP16 the thin wide layers are memory-bound (layer1 at b32 moves 163 MB
// in and 163 MB out per conv for 47 GFLOP, 0.06 ms of tensor-core work), and cuDNN's bare
// conv (0.26 ms) plus an epilogue pass (another read and write of the activation) costs
// about three of those floors; cuDNN's fused graphs cannot flag an FP16 overflow at all.
//
// Halo tiling: a block computes 2 output rows x 128 output columns of one image for BN
// output channels. Per 32-channel K chunk it copies the input rows and columns those
// outputs read (the halo: 4 x 130 pixels for a 3x3 stride-1 conv) into shared memory once,
// and every one of the r x r taps reads its A fragments from there: the input crosses
// L2 ~2x per conv instead of 9x for a per-tap implicit GEMM. The weights of the chunk (all
// taps) sit beside it. Two shared-memory stages and a persistent grid: the copy of the
// next K chunk (of the same tile, or of the block's next tile) overlaps this chunk's MMAs
// and the tile's epilogue.
//
// Fragments: within each 16-wide k slice, thread t's k pairs (2t, 2t+1) and (2t+8, 2t+9)
// are read from the adjacent shared columns 4t..4t+3, for A and B alike (a dot product does
// not care which k pairs with which, only that A and B agree): one 8-byte load per
// fragment row. Rows are padded (48 halves; 40 where consecutive output columns are two
// pixels apart) so those loads hit 32 different banks per half warp.
//
// Epilogue: accumulators go through shared memory (FP32, rows padded by 8 floats) so that
// bias, residual and the stores are 16-byte accesses along the channels.
//
// Requirements (checked on the host): cin % 32 == 0, cout % BN == 0, r in {1, 3}, pad = r / 2
// (r = 1: pad 0), 16-byte aligned x, w, residual and y.
//
// No cuda_fp16.h: conversions are PTX (cvt), so the file compiles with NVRTC's built-in
// headers only (CI compiles every kernel without a CUDA toolkit).

#define F16_THREADS 256
#define F16_COLS 128   // output columns per block
#define F16_ROWS 2     // output rows per block
#define F16_CHUNK 32   // input channels per K chunk
#define F16_LDB 48     // halves per shared weight row (32 + 16 padding)
#define F16_OUT_PAD 8  // floats of padding per staged output row
#define F16_MAX_FINITE 65504.0f

namespace {

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    const int bytes = valid ? 16 : 0;  // 0: fill the 16 bytes with zeros, read nothing
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(gmem), "r"(bytes));
}

__device__ __forceinline__ void mma_f16(float* c, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Two floats as one f16x2 word, lo in the low half (round to nearest; beyond 65504 the
// conversion gives inf, which the range check has flagged before).
__device__ __forceinline__ unsigned pack_half2(float lo, float hi) {
    unsigned packed;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(hi), "f"(lo));
    return packed;
}

__device__ __forceinline__ float2 unpack_half2(unsigned packed) {
    unsigned short lo, hi;
    asm("mov.b32 {%0, %1}, %2;\n" : "=h"(lo), "=h"(hi) : "r"(packed));
    float2 out;
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(out.x) : "h"(lo));
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(out.y) : "h"(hi));
    return out;
}

template <int R, int STRIDE, int BN>
struct HaloTile {
    // Shared pixels between consecutive output columns (and rows) of one tap: a 1x1 conv
    // copies only the pixels it reads, so its halo is dense whatever the stride.
    static constexpr int STEP = R == 1 ? 1 : STRIDE;
    static constexpr int PAD = R / 2;
    static constexpr int LDA = STEP == 1 ? 48 : 40;
    static constexpr int ROWS = (F16_ROWS - 1) * STEP + R;
    static constexpr int COLS = (F16_COLS - 1) * STEP + R;
    static constexpr int A_HALVES = ROWS * COLS * LDA;
    static constexpr int B_HALVES = R * R * BN * F16_LDB;
    static constexpr int LDO = BN + F16_OUT_PAD;
    static constexpr int OUT_FLOATS = F16_ROWS * F16_COLS * LDO;
    static constexpr int LOAD_BYTES = (A_HALVES + B_HALVES) * 2;
    // One stage holds a K chunk's halo and weights, or (once its chunk is consumed) the
    // tile's staged outputs. Two stages (the next chunk copied while this one computes)
    // where they fit in 227 KB; the 3x3 stride-2 halo (5 x 257 pixels) fits only once.
    static constexpr int STAGE_BYTES = LOAD_BYTES > OUT_FLOATS * 4 ? LOAD_BYTES : OUT_FLOATS * 4;
    static constexpr int STAGES = 2 * STAGE_BYTES <= 227 * 1024 ? 2 : 1;
    static constexpr int SHARED_BYTES = STAGES * STAGE_BYTES;
};

// Where one output tile lies: channels n0.., columns ow0.., rows oh0.. of one image.
struct TilePlace {
    int n0, ow0, oh0, image;
};

__device__ __forceinline__ TilePlace place_of(int tile, int channel_tiles, int column_tiles, int row_blocks, int bn) {
    const int rest = tile / channel_tiles, z = rest / column_tiles;
    TilePlace place;
    place.n0 = (tile - rest * channel_tiles) * bn;  // channel tiles fastest: they share the halo in L2
    place.ow0 = (rest - z * column_tiles) * F16_COLS;
    place.image = z / row_blocks;
    place.oh0 = (z - place.image * row_blocks) * F16_ROWS;
    return place;
}

template <int R, int STRIDE, int BN>
__device__ __forceinline__ void conv_f16(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,
                                         const float* __restrict__ bias,
                                         const unsigned short* __restrict__ residual,
                                         unsigned short* __restrict__ y, int* __restrict__ flag, int n, int h, int wd,
                                         int c, int ho, int wo, int k, int relu) {
    using T = HaloTile<R, STRIDE, BN>;
    extern __shared__ float4 shared4[];
    unsigned char* shared = reinterpret_cast<unsigned char*>(shared4);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int group = lane >> 2, quad = lane & 3;  // mma fragment coordinates
    const int channel_tiles = k / BN, column_tiles = (wo + F16_COLS - 1) / F16_COLS;
    const int row_blocks = (ho + F16_ROWS - 1) / F16_ROWS;
    const int tiles = channel_tiles * column_tiles * row_blocks * n;
    const int chunks = c / F16_CHUNK, filter = R * R * c;
    const int hstep = R == 1 ? STRIDE : 1;  // input pixels between consecutive halo pixels
    // Persistent: block b takes tiles b, b + gridDim.x, ...; item i is K chunk i % chunks of
    // the block's tile i / chunks, so the copy of the next chunk (of this tile or the next)
    // overlaps the MMAs and the epilogue of this one.
    const int my_tiles = blockIdx.x < tiles ? (tiles - 1 - blockIdx.x) / gridDim.x + 1 : 0;
    const int items = my_tiles * chunks;

    auto load = [&](int item, int stage) {
        const TilePlace at = place_of(blockIdx.x + (item / chunks) * gridDim.x, channel_tiles, column_tiles,
                                      row_blocks, BN);
        const int c0 = (item % chunks) * F16_CHUNK;
        unsigned short* a_s = reinterpret_cast<unsigned short*>(shared + stage * T::STAGE_BYTES);
        unsigned short* b_s = a_s + T::A_HALVES;
        const int ih0 = at.oh0 * STRIDE - T::PAD, iw0 = at.ow0 * STRIDE - T::PAD;
        const long long image_base = static_cast<long long>(at.image) * h * wd * c;
        // the halo of this chunk: 4 x 16-byte pieces per pixel, zeros in the padding
        for (int index = tid; index < T::ROWS * T::COLS * 4; index += F16_THREADS) {
            const int pixel = index >> 2, piece = index & 3;
            const int row = pixel / T::COLS, col = pixel - row * T::COLS;
            const int ih = ih0 + row * hstep, iw = iw0 + col * hstep;
            const bool inside = static_cast<unsigned>(ih) < static_cast<unsigned>(h) &&
                                static_cast<unsigned>(iw) < static_cast<unsigned>(wd);
            const unsigned short* source =
                inside ? x + image_base + (static_cast<long long>(ih) * wd + iw) * c + c0 + piece * 8 : x;
            cp_async16(a_s + pixel * T::LDA + piece * 8, source, inside);
        }
        // the chunk's weights, every tap: row (tap, n) of 32 channels
        for (int index = tid; index < R * R * BN * 4; index += F16_THREADS) {
            const int row = index >> 2, piece = index & 3;
            const int tap = row / BN, channel = row - tap * BN;
            const unsigned short* source = w + static_cast<long long>(at.n0 + channel) * filter + tap * c + c0 + piece * 8;
            cp_async16(b_s + row * F16_LDB + piece * 8, source, true);
        }
    };

    // Warp tile: 32 output pixels (one quarter of an output row) x BN channels.
    const int warp_row = warp >> 2, warp_col = (warp & 3) * 32;
    float acc[2][BN / 8][4];
    bool bad = false;
    if (T::STAGES == 2 && items > 0) load(0, 0);
    asm volatile("cp.async.commit_group;\n" ::);
    for (int item = 0; item < items; ++item) {
        const int stage = T::STAGES == 2 ? (item & 1) : 0;
        if (T::STAGES == 2) {
            if (item + 1 < items) load(item + 1, stage ^ 1);
            asm volatile("cp.async.commit_group;\ncp.async.wait_group 1;\n" ::: "memory");
        } else {
            load(item, 0);
            asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
        }
        __syncthreads();  // this item's copy landed for every thread
        const int chunk = item % chunks;
        if (chunk == 0) {
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < BN / 8; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
        }
        const unsigned short* a_s = reinterpret_cast<const unsigned short*>(shared + stage * T::STAGE_BYTES);
        const unsigned short* b_s = a_s + T::A_HALVES;
#pragma unroll
        for (int tap = 0; tap < R * R; ++tap) {
            const int dh = tap / R, dw = tap - (tap / R) * R;
            const unsigned short* a_tap =
                a_s + ((warp_row * T::STEP + dh) * T::COLS + warp_col * T::STEP + dw) * T::LDA;
            const unsigned short* b_tap = b_s + tap * BN * F16_LDB;
#pragma unroll
            for (int kk = 0; kk < F16_CHUNK; kk += 16) {
                unsigned a[2][4];
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    const unsigned short* rows = a_tap + (i * 16 + group) * T::STEP * T::LDA + kk + 4 * quad;
                    const uint2 top = *reinterpret_cast<const uint2*>(rows);                            // pixel g
                    const uint2 bottom = *reinterpret_cast<const uint2*>(rows + 8 * T::STEP * T::LDA);  // g + 8
                    a[i][0] = top.x;
                    a[i][1] = bottom.x;
                    a[i][2] = top.y;
                    a[i][3] = bottom.y;
                }
#pragma unroll
                for (int j = 0; j < BN / 8; ++j) {
                    const uint2 column =
                        *reinterpret_cast<const uint2*>(b_tap + (j * 8 + group) * F16_LDB + kk + 4 * quad);
                    const unsigned b[2] = {column.x, column.y};
#pragma unroll
                    for (int i = 0; i < 2; ++i) mma_f16(acc[i][j], a[i], b);
                }
            }
        }
        if (chunk == chunks - 1) {
            // The tile is done: stage its accumulators (FP32) in this stage's memory, then
            // bias, residual, ReLU, range check and the store, 8 channels (16 bytes) a step.
            const TilePlace at = place_of(blockIdx.x + (item / chunks) * gridDim.x, channel_tiles, column_tiles,
                                          row_blocks, BN);
            float* out_s = reinterpret_cast<float*>(shared + stage * T::STAGE_BYTES);
            __syncthreads();  // every warp is done reading the chunk's tiles
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int pixel = warp_row * F16_COLS + warp_col + i * 16 + group + half * 8;
#pragma unroll
                    for (int j = 0; j < BN / 8; ++j)
                        *reinterpret_cast<float2*>(out_s + pixel * T::LDO + j * 8 + 2 * quad) =
                            make_float2(acc[i][j][2 * half], acc[i][j][2 * half + 1]);
                }
            __syncthreads();
            for (int index = tid; index < F16_ROWS * F16_COLS * (BN / 8); index += F16_THREADS) {
                const int pixel = index / (BN / 8), part = index - pixel * (BN / 8);
                const int oh = at.oh0 + pixel / F16_COLS, ow = at.ow0 + pixel % F16_COLS;
                if (oh >= ho || ow >= wo) continue;
                const float* staged = out_s + pixel * T::LDO + part * 8;
                const int channel = at.n0 + part * 8;
                const float4 b0 = *reinterpret_cast<const float4*>(bias + channel);
                const float4 b1 = *reinterpret_cast<const float4*>(bias + channel + 4);
                const float4 s0 = *reinterpret_cast<const float4*>(staged);
                const float4 s1 = *reinterpret_cast<const float4*>(staged + 4);
                float v[8] = {s0.x + b0.x, s0.y + b0.y, s0.z + b0.z, s0.w + b0.w,
                              s1.x + b1.x, s1.y + b1.y, s1.z + b1.z, s1.w + b1.w};
                const long long offset = ((static_cast<long long>(at.image) * ho + oh) * wo + ow) * k + channel;
                if (residual != nullptr) {
                    const uint4 add = *reinterpret_cast<const uint4*>(residual + offset);
                    const unsigned words[4] = {add.x, add.y, add.z, add.w};
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const float2 pair = unpack_half2(words[e]);
                        v[2 * e] += pair.x;
                        v[2 * e + 1] += pair.y;
                    }
                }
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    if (relu) v[e] = fmaxf(v[e], 0.0f);
                    bad |= !(fabsf(v[e]) <= F16_MAX_FINITE);  // NaN compares false: flagged too
                }
                *reinterpret_cast<uint4*>(y + offset) = make_uint4(pack_half2(v[0], v[1]), pack_half2(v[2], v[3]),
                                                                   pack_half2(v[4], v[5]), pack_half2(v[6], v[7]));
            }
        }
        __syncthreads();  // everyone is done with this stage before it is refilled
    }
    if (__syncthreads_or(bad) && tid == 0) atomicOr(flag, 1);
}

}  // namespace

#define F16_PARAMS                                                                                             \
    const unsigned short *__restrict__ x, const unsigned short *__restrict__ w, const float *__restrict__ bias, \
        const unsigned short *__restrict__ residual, unsigned short *__restrict__ y, int *__restrict__ flag,   \
        int n, int h, int wd, int c, int ho, int wo, int k, int relu
#define F16_ARGS x, w, bias, residual, y, flag, n, h, wd, c, ho, wo, k, relu

// Entry points: conv_f16_r<R>s<STRIDE>_n<BN>. A persistent grid of at most
// cout / BN * ceil(wo / 128) * ceil(ho / 2) * n blocks (one per tile at most; the host
// launches F16_WAVES per SM), block 256, dynamic shared memory
// HaloTile<R, STRIDE, BN>::SHARED_BYTES (igemm.f16_shared_bytes computes the same number);
// residual may be null. Launch bounds allow 255 registers: the stages take over 113 KB of
// shared memory, so one block is what fits an SM anyway (the 1x1 kernel's 2 may share one).
extern "C" __global__ __launch_bounds__(F16_THREADS, 1) void conv_f16_r3s1_n32(F16_PARAMS) {
    conv_f16<3, 1, 32>(F16_ARGS);
}
extern "C" __global__ __launch_bounds__(F16_THREADS, 1) void conv_f16_r3s1_n64(F16_PARAMS) {
    conv_f16<3, 1, 64>(F16_ARGS);
}
extern "C" __global__ __launch_bounds__(F16_THREADS, 1) void conv_f16_r3s2_n32(F16_PARAMS) {
    conv_f16<3, 2, 32>(F16_ARGS);
}
extern "C" __global__ __launch_bounds__(F16_THREADS, 1) void conv_f16_r3s2_n64(F16_PARAMS) {
    conv_f16<3, 2, 64>(F16_ARGS);
}
extern "C" __global__ __launch_bounds__(F16_THREADS, 1) void conv_f16_r1s2_n32(F16_PARAMS) {
    conv_f16<1, 2, 32>(F16_ARGS);
}
extern "C" __global__ __launch_bounds__(F16_THREADS, 1) void conv_f16_r1s2_n64(F16_PARAMS) {
    conv_f16<1, 2, 64>(F16_ARGS);
}
