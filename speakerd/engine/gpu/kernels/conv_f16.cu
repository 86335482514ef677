// FP16 convolution on tensor cores (mma.sync m16n8k16, FP32 accumulation), NHWC half in and
// out, with the block's epilogue fused and range-checked:
//   y = half(act(conv(x, w) + bias (+ residual))), flag |= 1 where |y| > 65504 or NaN.
//
// Why our own: in FP16 the thin wide layers are memory-bound (layer1 at b32 moves 163 MB
// in and 163 MB out per conv for 47 GFLOP, 0.06 ms of tensor-core work), and cuDNN's bare
// conv (0.207 ms on the H200) plus an epilogue pass (another read and write of the
// activation, 0.08 ms) costs four of those floors; cuDNN's fused graphs cannot flag an FP16
// overflow at all. (Ours, 0.28-0.32 ms, is only a few percent faster: see docs/performance.md.)
//
// Halo tiling: a block computes a pixel tile of ROWS output rows x COLS output columns of
// one image for BN output channels. Per 32-channel K chunk it copies the input rows and
// columns those outputs read (the halo: (ROWS + 2) x (COLS + 2) pixels for a 3x3 stride-1
// conv) into shared memory once, and every one of the r x r taps reads its A fragments from
// there: the input crosses L2 ~2x per conv instead of 9x for a per-tap implicit GEMM. The
// weights of the chunk (all taps) sit beside it. One stage: two blocks per SM overlap one's
// copy with the other's MMAs. (A persistent grid with two stages, the next chunk copied
// while this one computes, ran slower on the H200: 0.344 vs 0.288 ms for layer1's b32 conv,
// at one block of 168-182 registers per SM: afc55b1, in git history under measurements/.)
//
// Pixel tiles (template ROWS x COLS, entry points below; the autotuner times each): always
// 256 threads, 8 warps, each warp PX = ROWS * COLS / 8 consecutive pixels of one output row
// (PX / 16 m16 fragments) x BN channels.
//   2 x 128: the first tile; fewest blocks, so the fewest reloads of the chunk's weights.
//   1 x 128: twice the blocks, for grids too small to fill 132 SMs (layer2 at b1: 80 blocks
//            of 2 x 128), at a halo of 3 x 130 = 3.05x the outputs.
//   4 x 64, 8 x 32 (3x3 stride 1 only): squarer halos read fewer input pixels per output,
//            6 x 66 = 1.55x and 10 x 34 = 1.33x instead of 4 x 130 = 2.03x, for layer1 at
//            b32 (32 -> 32 channels, 80 x 998), which is bound by these loads.
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
// Split K (entry points ending _sk<SPLIT>, for grids too small to fill the GPU: layer3 and
// layer4 at b1 have 40-80 blocks of 1 x 128 for 132 SMs): SPLIT blocks share one output
// tile, each summing 1/SPLIT of the input channels (blockIdx.z = tile row * SPLIT + split).
// Each writes its FP32 sums to its slice of `partials` and takes a ticket from the tile's
// counter in `tickets`; the block that takes the last ticket adds the SPLIT slices in split
// order (the same order whichever block comes last, so every launch, eager or replayed in a
// graph, gives the same bits), runs the epilogue and sets the counter back to zero for the
// next launch. No block ever waits for another (a block that is not last just ends), so the
// grid may be any size. Floating-point atomics would be simpler and not reproducible.
// (partials and tickets are not __restrict__: other blocks write what the last one reads.)
//
// Requirements (checked on the host): cin % 32 == 0, cout % BN == 0, r in {1, 3}, pad = r / 2
// (r = 1: pad 0), 16-byte aligned x, w, residual and y; split K: cin % (32 * SPLIT) == 0,
// partials 16-byte aligned with SPLIT * tiles * ROWS * COLS * BN floats, and a zeroed counter
// per tile (tiles = the grid's blocks / SPLIT).
//
// No cuda_fp16.h: conversions are PTX (cvt, in common.cuh), so the file compiles with
// NVRTC's built-in headers only (CI compiles every kernel without a CUDA toolkit).

#define F16_THREADS 256
#define F16_BLOCKS_PER_SM 2  // caps registers at 128 a thread: two blocks share an SM
// The 3x3 stride-2 halo of a 2 x 128 tile (5 x 257 pixels, 158 KB with 64 channels' weights)
// fits one block per SM: no register cap there (at 128 its 64-channel variant spilled 8
// bytes). Its 1 x 128 tiles keep the bound: uncapped, the registers they
// use decide whether two blocks share an SM.
#define F16_BLOCKS_PER_SM_WIDE 1
#define F16_CHUNK 32   // input channels per K chunk
#define F16_LDB 48     // halves per shared weight row (32 + 16 padding)
#define F16_OUT_PAD 8  // floats of padding per staged output row

#include "common.cuh"

namespace {

// The shared-memory layout of one block computing ROWS x COLS output pixels x BN channels.
template <int R, int STRIDE, int BN, int ROWS, int COLS>
struct HaloTile {
    // Shared pixels between consecutive output columns (and rows) of one tap: a 1x1 conv
    // copies only the pixels it reads, so its halo is dense whatever the stride.
    static constexpr int STEP = R == 1 ? 1 : STRIDE;
    static constexpr int PAD = R / 2;
    static constexpr int LDA = STEP == 1 ? 48 : 40;
    static constexpr int HALO_ROWS = (ROWS - 1) * STEP + R;
    static constexpr int HALO_COLS = (COLS - 1) * STEP + R;
    static constexpr int A_HALVES = HALO_ROWS * HALO_COLS * LDA;
    static constexpr int B_HALVES = R * R * BN * F16_LDB;
    static constexpr int LDO = BN + F16_OUT_PAD;
    static constexpr int OUT_FLOATS = ROWS * COLS * LDO;
    static constexpr int LOAD_BYTES = (A_HALVES + B_HALVES) * 2;
    static constexpr int SHARED_BYTES = LOAD_BYTES > OUT_FLOATS * 4 ? LOAD_BYTES : OUT_FLOATS * 4;
};

template <int R, int STRIDE, int BN, int ROWS, int COLS, int SPLIT>
__device__ __forceinline__ void conv_f16(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,
                                         const float* __restrict__ bias,
                                         const unsigned short* __restrict__ residual,
                                         unsigned short* __restrict__ y, int* __restrict__ flag, int h, int wd,
                                         int c, int ho, int wo, int k, int relu, float* partials, int* tickets) {
    using T = HaloTile<R, STRIDE, BN, ROWS, COLS>;
    // Warp tile: PX consecutive output pixels of one output row x BN channels, MI m16
    // fragments; WARPS_PER_ROW warps share an output row.
    constexpr int WARPS = F16_THREADS / 32;
    constexpr int PX = ROWS * COLS / WARPS;
    constexpr int MI = PX / 16;
    constexpr int WARPS_PER_ROW = COLS / PX;
    static_assert(PX == 16 || PX == 32, "a warp owns one or two m16 fragments of pixels");
    static_assert(COLS % PX == 0 && ROWS * WARPS_PER_ROW == WARPS, "a warp's pixels lie in one output row");
    extern __shared__ float4 shared4[];
    unsigned short* a_s = reinterpret_cast<unsigned short*>(shared4);  // HALO_ROWS x HALO_COLS x LDA
    unsigned short* b_s = a_s + T::A_HALVES;                           // taps x BN x LDB
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int group = lane >> 2, quad = lane & 3;  // mma fragment coordinates
    const int n0 = blockIdx.x * BN, ow0 = blockIdx.y * COLS;
    const int row_blocks = (ho + ROWS - 1) / ROWS;
    const int tile_z = blockIdx.z / SPLIT, split = blockIdx.z - tile_z * SPLIT;  // SPLIT 1: blockIdx.z, 0
    const int image = tile_z / row_blocks, oh0 = (tile_z - image * row_blocks) * ROWS;
    const int ih0 = oh0 * STRIDE - T::PAD, iw0 = ow0 * STRIDE - T::PAD;
    const int hstep = R == 1 ? STRIDE : 1;  // input pixels between consecutive halo pixels
    const long long image_base = static_cast<long long>(image) * h * wd * c;
    const int filter = R * R * c;

    // Unsigned: / and % by the power of two WARPS_PER_ROW become a shift and a mask (signed,
    // they cost the 2 x 128 entry points 1-7 more registers than warp >> 2, ptxas sm_90).
    const int warp_row = static_cast<unsigned>(warp) / WARPS_PER_ROW;
    const int warp_col = static_cast<unsigned>(warp) % WARPS_PER_ROW * PX;
    float acc[MI][BN / 8][4];
    zero_fragments(acc);

    const int c_split = c / SPLIT;  // this block's input channels: [split * c_split, + c_split)
    for (int c0 = split * c_split; c0 < (split + 1) * c_split; c0 += F16_CHUNK) {
        // the halo of this chunk: 4 x 16-byte pieces per pixel, zeros in the padding
        for (int index = tid; index < T::HALO_ROWS * T::HALO_COLS * 4; index += F16_THREADS) {
            const int pixel = index >> 2, piece = index & 3;
            const int row = pixel / T::HALO_COLS, col = pixel - row * T::HALO_COLS;
            const int ih = ih0 + row * hstep, iw = iw0 + col * hstep;
            const bool inside =
                static_cast<unsigned>(ih) < static_cast<unsigned>(h) && static_cast<unsigned>(iw) < static_cast<unsigned>(wd);
            const unsigned short* source = inside ? x + image_base + (static_cast<long long>(ih) * wd + iw) * c + c0 + piece * 8 : x;
            cp_async16(a_s + pixel * T::LDA + piece * 8, source, inside);
        }
        // the chunk's weights, every tap: row (tap, n) of 32 channels
        for (int index = tid; index < R * R * BN * 4; index += F16_THREADS) {
            const int row = index >> 2, piece = index & 3;
            const int tap = row / BN, n = row - tap * BN;
            cp_async16(b_s + row * F16_LDB + piece * 8, w + static_cast<long long>(n0 + n) * filter + tap * c + c0 + piece * 8,
                       true);
        }
        asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::);
        __syncthreads();
#pragma unroll
        for (int tap = 0; tap < R * R; ++tap) {
            const int dh = tap / R, dw = tap - (tap / R) * R;
            const unsigned short* a_tap =
                a_s + ((warp_row * T::STEP + dh) * T::HALO_COLS + warp_col * T::STEP + dw) * T::LDA;
            const unsigned short* b_tap = b_s + tap * BN * F16_LDB;
#pragma unroll
            for (int kk = 0; kk < F16_CHUNK; kk += 16) {
                unsigned a[MI][4];
#pragma unroll
                for (int i = 0; i < MI; ++i) {
                    const unsigned short* rows = a_tap + (i * 16 + group) * T::STEP * T::LDA + kk + 4 * quad;
                    load_a_f16(a[i], rows, rows + 8 * T::STEP * T::LDA);  // pixels g and g + 8
                }
#pragma unroll
                for (int j = 0; j < BN / 8; ++j) {
                    const uint2 column = *reinterpret_cast<const uint2*>(b_tap + (j * 8 + group) * F16_LDB + kk + 4 * quad);
                    const unsigned b[2] = {column.x, column.y};
#pragma unroll
                    for (int i = 0; i < MI; ++i) mma_f16(acc[i][j], a[i], b);
                }
            }
        }
        __syncthreads();  // everyone is done with this chunk's tiles before they are refilled
    }

    // Stage the accumulators (FP32) in shared memory: pixel p = row * COLS + column.
    float* out_s = reinterpret_cast<float*>(shared4);
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int pixel = warp_row * COLS + warp_col + i * 16 + group + half * 8;
#pragma unroll
            for (int j = 0; j < BN / 8; ++j)
                *reinterpret_cast<float2*>(out_s + pixel * T::LDO + j * 8 + 2 * quad) =
                    make_float2(acc[i][j][2 * half], acc[i][j][2 * half + 1]);
        }
    __syncthreads();

    // Split K: this block's sums to its slice, a ticket, and only the last block goes on.
    constexpr int TILE_FLOATS = ROWS * COLS * BN;  // one split's slice of one tile
    const int tiles = gridDim.x * gridDim.y * (gridDim.z / SPLIT);
    const int tile = (tile_z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    if constexpr (SPLIT > 1) {
        float* slice = partials + (static_cast<long long>(split) * tiles + tile) * TILE_FLOATS;
        for (int index = tid; index < ROWS * COLS * (BN / 8); index += F16_THREADS) {
            const int pixel = index / (BN / 8), part = index - pixel * (BN / 8);
            const float* staged = out_s + pixel * T::LDO + part * 8;
            float4* to = reinterpret_cast<float4*>(slice + pixel * BN + part * 8);
            __stcg(to, *reinterpret_cast<const float4*>(staged));  // to L2: the last block reads it there
            __stcg(to + 1, *reinterpret_cast<const float4*>(staged + 4));
        }
        __threadfence();  // the slice is visible to every block before the ticket is taken
        __syncthreads();
        bool last = false;
        if (tid == 0) {
            last = atomicAdd(tickets + tile, 1) == SPLIT - 1;
            if (last) tickets[tile] = 0;  // every split has taken its ticket: none touches it again
        }
        if (!__syncthreads_or(last)) return;
        __threadfence();  // the other slices are read after their tickets were seen
    }

    // Bias, residual, ReLU, range check and the store, 8 channels (16 bytes) per step.
    f16_tile_epilogue<ROWS, COLS, BN, F16_THREADS>(
        [&](int pixel, int part, float4& s0, float4& s1) {
            if constexpr (SPLIT == 1) {
                const float* staged = out_s + pixel * T::LDO + part * 8;
                s0 = *reinterpret_cast<const float4*>(staged);
                s1 = *reinterpret_cast<const float4*>(staged + 4);
            } else {  // the slices' sum in split order (bits independent of which block is last)
                const float* at = partials + static_cast<long long>(tile) * TILE_FLOATS + pixel * BN + part * 8;
                const long long between = static_cast<long long>(tiles) * TILE_FLOATS;  // one split's slices
                s0 = __ldcg(reinterpret_cast<const float4*>(at));
                s1 = __ldcg(reinterpret_cast<const float4*>(at + 4));
#pragma unroll
                for (int other = 1; other < SPLIT; ++other) {
                    const float4 p0 = __ldcg(reinterpret_cast<const float4*>(at + other * between));
                    const float4 p1 = __ldcg(reinterpret_cast<const float4*>(at + other * between + 4));
                    s0 = make_float4(s0.x + p0.x, s0.y + p0.y, s0.z + p0.z, s0.w + p0.w);
                    s1 = make_float4(s1.x + p1.x, s1.y + p1.y, s1.z + p1.z, s1.w + p1.w);
                }
            }
        },
        bias, residual, y, flag, image, oh0, ow0, ho, wo, k, n0, relu);
}

}  // namespace

#define F16_PARAMS                                                                                               \
    const unsigned short *__restrict__ x, const unsigned short *__restrict__ w, const float *__restrict__ bias,   \
        const unsigned short *__restrict__ residual, unsigned short *__restrict__ y, int *__restrict__ flag, int h, \
        int wd, int c, int ho, int wo, int k, int relu
#define F16_ARGS x, w, bias, residual, y, flag, h, wd, c, ho, wo, k, relu

// Entry points: conv_f16_r<R>s<STRIDE>_n<BN>_<ROWS>x<COLS>. grid (cout / BN, ceil(wo / COLS),
// n * ceil(ho / ROWS)), block 256, dynamic shared memory HaloTile<R, STRIDE, BN, ROWS,
// COLS>::SHARED_BYTES (the host computes the same numbers, igemm.f16_shared_bytes and
// igemm.f16_grid; igemm.F16_PIXEL_TILES lists these tiles); residual may be null.
#define F16_ENTRY(R, S, BN, ROWS, COLS, BLOCKS)                                                   \
    extern "C" __global__ __launch_bounds__(F16_THREADS, BLOCKS) void                             \
        conv_f16_r##R##s##S##_n##BN##_##ROWS##x##COLS(F16_PARAMS) {                               \
        conv_f16<R, S, BN, ROWS, COLS, 1>(F16_ARGS, nullptr, nullptr);                            \
    }
// Split K (see the top of the file): conv_f16_r<R>s<STRIDE>_n<BN>_<ROWS>x<COLS>_sk<SPLIT>, the
// same grid with z * SPLIT, two more arguments: partials (FP32) and tickets (zeroed counters,
// one per tile); igemm.F16_SPLITS lists these.
#define F16_SPLIT_ENTRY(R, S, BN, ROWS, COLS, BLOCKS, SPLIT)                                      \
    extern "C" __global__ __launch_bounds__(F16_THREADS, BLOCKS) void                             \
        conv_f16_r##R##s##S##_n##BN##_##ROWS##x##COLS##_sk##SPLIT(                                \
            F16_PARAMS, float* partials, int* tickets) {                                          \
        conv_f16<R, S, BN, ROWS, COLS, SPLIT>(F16_ARGS, partials, tickets);                       \
    }
F16_ENTRY(3, 1, 32, 2, 128, F16_BLOCKS_PER_SM)
F16_ENTRY(3, 1, 32, 1, 128, F16_BLOCKS_PER_SM)
F16_ENTRY(3, 1, 32, 4, 64, F16_BLOCKS_PER_SM)
F16_ENTRY(3, 1, 32, 8, 32, F16_BLOCKS_PER_SM)
F16_ENTRY(3, 1, 64, 2, 128, F16_BLOCKS_PER_SM)
F16_ENTRY(3, 1, 64, 1, 128, F16_BLOCKS_PER_SM)
F16_ENTRY(3, 1, 64, 4, 64, F16_BLOCKS_PER_SM)
F16_ENTRY(3, 2, 32, 2, 128, F16_BLOCKS_PER_SM_WIDE)
F16_ENTRY(3, 2, 32, 1, 128, F16_BLOCKS_PER_SM_WIDE)
F16_ENTRY(3, 2, 64, 2, 128, F16_BLOCKS_PER_SM_WIDE)
F16_ENTRY(3, 2, 64, 1, 128, F16_BLOCKS_PER_SM_WIDE)
F16_ENTRY(1, 2, 32, 2, 128, F16_BLOCKS_PER_SM)
F16_ENTRY(1, 2, 32, 1, 128, F16_BLOCKS_PER_SM)
F16_ENTRY(1, 2, 64, 2, 128, F16_BLOCKS_PER_SM)
F16_ENTRY(1, 2, 64, 1, 128, F16_BLOCKS_PER_SM)
F16_SPLIT_ENTRY(3, 1, 64, 1, 128, F16_BLOCKS_PER_SM, 2)
F16_SPLIT_ENTRY(3, 1, 64, 1, 128, F16_BLOCKS_PER_SM, 4)
F16_SPLIT_ENTRY(3, 1, 64, 1, 128, F16_BLOCKS_PER_SM, 8)
F16_SPLIT_ENTRY(3, 1, 32, 1, 128, F16_BLOCKS_PER_SM, 2)
F16_SPLIT_ENTRY(3, 1, 32, 1, 128, F16_BLOCKS_PER_SM, 4)
F16_SPLIT_ENTRY(3, 2, 64, 1, 128, F16_BLOCKS_PER_SM_WIDE, 2)
F16_SPLIT_ENTRY(3, 2, 64, 1, 128, F16_BLOCKS_PER_SM_WIDE, 4)
