// FP16 3x3 stride-1 convolution on Hopper's warpgroup MMA (wgmma.mma_async, sm_90a), NHWC
// half in and out, FP32 accumulation, the block's epilogue fused and range-checked as in
// conv_f16.cu:
//   y = half(act(conv(x, w) + bias (+ residual))), flag |= 1 where |y| > 65504 or NaN.
//
// Why: layer1 at b32 (32 -> 32 channels, 80 x 998) takes 1.67 of the b32 batch's 4.43 ms at
// ~170 TFLOP/s, a sixth of the H200's FP16 peak, in conv_f16.cu (mma.sync) and in this
// file's first version alike. That version ran one tile per block in strict order (copy the
// halo and the weights, wait, issue the MMAs, wait, stage the outputs in shared memory,
// store), so a block's tensor-core work was a short burst between two waits on memory:
// 0.278 ms for layer1 at 8 x 64 against a tensor-core time of ~0.05 ms and an HBM floor
// (163 MB in, 163 MB out) of ~0.07 ms.
//
// This version is persistent and keeps memory busy while the MMAs run:
//   - the grid is BLOCKS blocks per SM (igemm.wgmma_grid), each walking the output tiles
//     of one channel tile (blockIdx.y) with a stride of gridDim.x;
//   - the block's weights (all nine taps, all input channels, BN outputs) are copied once;
//   - the halo has two stages: while the MMAs of tile t run (asynchronously), the same
//     threads issue the copies of tile t + 1's halo into the other stage;
//   - the residual a thread adds is loaded into registers while the MMAs run, where the
//     registers allow (RESIDUAL_EARLY);
//   - the epilogue reads the accumulators from registers (bias, residual, ReLU, range
//     check, 16-byte loads and stores of 8 channels: wg_channel), so no shared memory is
//     staged and another block's MMAs use the tensor cores meanwhile (BLOCKS per SM: 2 or 3).
//
// What the stages cost (scripts/time_wgmma_variants.py leaves each out; H100, 3e02174):
// layer1's 8 x 64 bias + ReLU took 0.182 ms, 0.175 without the MMAs, 0.128 without the
// epilogue's loads and stores, 0.131 without the halo copy, 0.015 with the MMAs alone. The
// tensor cores are not what bounds it; the memory instructions and their latency with 8
// warps per SM are (Nsight Compute: an instruction issued on 35% of cycles).
//
// Tiling: one warpgroup (128 threads) per block computes ROWS output rows x COLS output
// columns of one image for BN output channels: ROWS * COLS / 64 m64 tiles of 64 consecutive
// pixels of one output row. Every tap's A operand is the halo ((ROWS + 2) x (COLS + 2) input
// pixels, all CIN channels) shifted by (dh, dw) pixels, so a tap costs no copy, only a
// different descriptor.
//
// Shared-memory layouts (wgmma's K-major layout without swizzle: a core matrix is 8 rows of
// 16 bytes, 128 contiguous bytes; the descriptor's LBO steps between core matrices along K,
// its SBO between core matrices along M or N; both readings confirmed on an H200 by one
// wgmma against NumPy, and tests/test_gpu_fp16.py checks every entry point against float64):
//   halo    [channel group of 8][pixel] 16 bytes each: a run of 8 pixels of one halo row is
//           a core matrix wherever it starts, so the shift by dw (one pixel, 16 bytes) is a
//           start address (16-byte granular), SBO = 128 bytes, LBO = pixels * 16.
//   weights [tap][channel group][n] 16 bytes each: SBO = 128 bytes, LBO = BN * 16.
// Every wgmma of a tile is issued back to back, then one commit and one wait.
//
// The sums are the same for every launch and grid (each output's sum runs over taps and k
// steps in one fixed order, in one thread's accumulator), so a replayed graph gives the
// eager launch's bits.
//
// Requirements: a compute capability 9.0 device (sm_90a code), 3x3 stride 1 pad 1, cin ==
// CIN, cout % BN == 0 (the host checks these); 16-byte aligned x, w, y and residual (they
// hold: every buffer is a CuPy allocation, 256-byte aligned, and a pixel's channels are 64
// bytes or more). Compiled for sm_90a by kernels.py (wgmma has no plain sm_90 form), not through
// CuPy.

#define WG_THREADS 128  // one warpgroup
#define WG_STAGES 2     // halo buffers: this tile's and the next one's

// Measurement switches: the engine's build leaves both at their defaults. A script that
// times variants of this file (scripts/time_wgmma_variants.py) compiles it with other values.
#ifndef WG_RESIDUAL_EARLY
#define WG_RESIDUAL_EARLY 1  // load the residual while the MMAs run (see RESIDUAL_EARLY)
#endif
#ifndef WG_OMIT
// Stages left out, to time what each costs (the outputs are then wrong): 1 the MMAs,
// 2 the epilogue's loads and stores, 4 the next tile's halo copy.
#define WG_OMIT 0
#endif

#include "common.cuh"

namespace {

template <int CIN, int BN, int ROWS, int COLS>
struct WgTile {
    static constexpr int HALO_ROWS = ROWS + 2;
    static constexpr int HALO_COLS = COLS + 2;
    static constexpr int PIXELS = HALO_ROWS * HALO_COLS;
    static constexpr int GROUPS = CIN / 8;
    static constexpr int HALO_BYTES = GROUPS * PIXELS * 16;  // one stage
    static constexpr int B_BYTES = 9 * GROUPS * BN * 16;
    static constexpr int SHARED_BYTES = WG_STAGES * HALO_BYTES + B_BYTES;
    static constexpr int M_TILES = ROWS * COLS / 64;
    static_assert(COLS % 64 == 0, "an m64 tile is 64 pixels of one output row");
    static_assert(CIN % 16 == 0, "a k step is 16 input channels");
    static_assert(BN % 32 == 0, "the epilogue writes 32 channels per 16-byte store of each quad");
    static_assert(HALO_BYTES % 128 == 0, "every stage and the weights start 128-byte aligned");
    // wgmma's descriptor holds a start address in 16-byte units in 14 bits: the whole
    // shared window (and any start within it) must stay under 256 KB
    static_assert(SHARED_BYTES <= (1 << 18), "descriptor start addresses fit 14 bits");
};

// A shared-memory matrix descriptor: K-major, no swizzle, base offset 0; the start address,
// LBO and SBO in units of 16 bytes (14 bits each).
__device__ __forceinline__ unsigned long long wg_descriptor(const void* smem, unsigned lbo_bytes, unsigned sbo_bytes) {
    const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    return static_cast<unsigned long long>((address >> 4) & 0x3FFFu) |
           static_cast<unsigned long long>((lbo_bytes >> 4) & 0x3FFFu) << 16 |
           static_cast<unsigned long long>((sbo_bytes >> 4) & 0x3FFFu) << 32;
}

// d (64 x BN, FP32) += a (64 x 16) * b (16 x BN), both K-major from shared memory. The
// accumulator fragment: thread t of the warpgroup holds rows 16 * (t / 32) + (t % 32) / 4
// (+ 8 for d[4j + 2], d[4j + 3]) and columns 8j + 2 * (t % 4) (+ 1 for the odd ones).
#define WG_D16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define WG_D32                                                                                                 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
    "%23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WG_OUT16(d)                                                                                                 \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),   \
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])

// scale_d 0: d = a * b (the accumulators are written, not read).
template <int BN>
__device__ __forceinline__ void wgmma_f16(float (&d)[BN / 2], unsigned long long a, unsigned long long b, int scale_d);

template <>
__device__ __forceinline__ void wgmma_f16<32>(float (&d)[16], unsigned long long a, unsigned long long b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 " WG_D16 ", %16, %17, p, 1, 1, 0, 0;\n}\n"
        : WG_OUT16(d)
        : "l"(a), "l"(b), "r"(scale_d));
}

template <>
__device__ __forceinline__ void wgmma_f16<64>(float (&d)[32], unsigned long long a, unsigned long long b, int scale_d) {
    float* e = d + 16;
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " WG_D32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
        : WG_OUT16(d), WG_OUT16(e)
        : "l"(a), "l"(b), "r"(scale_d));
}

// Keeps the compiler from moving accumulator registers across the asynchronous MMAs: each
// is "read and written" here, where the hardware is not writing them.
template <int M, int N>
__device__ __forceinline__ void wg_pin(float (&acc)[M][N]) {
#pragma unroll
    for (int i = 0; i < M; ++i)
#pragma unroll
        for (int j = 0; j < N; ++j) asm volatile("" : "+f"(acc[i][j])::"memory");
}

// Copies the halo of the output tile (image, oh0, ow0) into `stage` ([group][pixel] x 16
// bytes): a pixel's CIN * 2 bytes are read by GROUPS neighbouring threads (coalesced), each
// 16 bytes landing in its channel group's plane; zeros outside the image.
template <int CIN, int BN, int ROWS, int COLS>
__device__ __forceinline__ void wg_copy_halo(unsigned char* stage, const unsigned short* __restrict__ x, int image,
                                             int oh0, int ow0, int h, int wd) {
    using T = WgTile<CIN, BN, ROWS, COLS>;
    const long long image_base = static_cast<long long>(image) * h * wd * CIN;
    for (int index = threadIdx.x; index < T::PIXELS * T::GROUPS; index += WG_THREADS) {
        const int pixel = index / T::GROUPS, group = index - pixel * T::GROUPS;
        const int row = pixel / T::HALO_COLS, col = pixel - row * T::HALO_COLS;
        const int ih = oh0 - 1 + row, iw = ow0 - 1 + col;
        const bool inside =
            static_cast<unsigned>(ih) < static_cast<unsigned>(h) && static_cast<unsigned>(iw) < static_cast<unsigned>(wd);
        const unsigned short* source = inside ? x + image_base + (static_cast<long long>(ih) * wd + iw) * CIN + group * 8 : x;
        cp_async16(stage + (group * T::PIXELS + pixel) * 16, source, inside);
    }
}

// The output channel (from the block's first) of MMA column n: within each 32 columns, thread
// quad q's columns 8j + 2q and 8j + 2q + 1 (j = 0..3, the accumulator fragment's) are
// channels 8q + 2j and 8q + 2j + 1, so each thread holds 8 consecutive channels (16 bytes
// of output) per 32 columns. The weights are copied in this order; the output is NHWC as
// ever.
__device__ __forceinline__ int wg_channel(int n) {
    const int chunk = n / 32, j = (n % 32) / 8, q = (n % 8) / 2, odd = n % 2;
    return 32 * chunk + 8 * q + 2 * j + odd;
}

// Output tile `tile` of a channel tile's walk -> (image, first output row, first column):
// columns first, so a block's neighbours in the walk share halo columns in L2.
template <int ROWS, int COLS>
__device__ __forceinline__ void wg_tile_origin(int tile, int ho, int wo, int& image, int& oh0, int& ow0) {
    const int col_tiles = (wo + COLS - 1) / COLS, row_blocks = (ho + ROWS - 1) / ROWS;
    const int z = tile / col_tiles;
    ow0 = (tile - z * col_tiles) * COLS;
    image = z / row_blocks;
    oh0 = (z - image * row_blocks) * ROWS;
}

// The output column of the accumulator fragment's row 16 * warp + group (+ 8 for the second
// pair of each n8 block: half 1) of m64 tile m, in the tile at column ow0.
template <int COLS>
__device__ __forceinline__ int wg_output_column(int ow0, int m, int warp, int group, int half) {
    return ow0 + (m % (COLS / 64)) * 64 + 16 * warp + group + 8 * half;
}

// The offset of `channel` at output pixel (image, oh, ow) of the NHWC output (and residual).
__device__ __forceinline__ long long wg_output_offset(int image, int oh, int ow, int ho, int wo, int k, int channel) {
    return ((static_cast<long long>(image) * ho + oh) * wo + ow) * k + channel;
}

// `c` is conv_f16.cu's argument, unread here: the channels are CIN (the host checked c == CIN).
template <int CIN, int BN, int ROWS, int COLS>
__device__ __forceinline__ void conv_wgmma(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,
                                           const float* __restrict__ bias, const unsigned short* __restrict__ residual,
                                           unsigned short* __restrict__ y, int* __restrict__ flag, int h, int wd, int c,
                                           int ho, int wo, int k, int relu, int images) {
    using T = WgTile<CIN, BN, ROWS, COLS>;
    constexpr int COL_TILES = COLS / 64;
    constexpr int CHUNKS = BN / 32;  // 16-byte loads and stores per output pixel and thread
    // the residual loaded early takes M_TILES * BN / 4 registers: only for the smaller tiles
    constexpr bool RESIDUAL_EARLY = WG_RESIDUAL_EARLY && T::M_TILES * BN / 4 <= 32;
    extern __shared__ float4 shared4[];
    unsigned char* halo_s = reinterpret_cast<unsigned char*>(shared4);  // WG_STAGES x [group][pixel] x 16 bytes
    unsigned char* b_s = halo_s + WG_STAGES * T::HALO_BYTES;            // [tap][group][n] x 16 bytes
    const int tid = threadIdx.x, n0 = blockIdx.y * BN;
    const int all_tiles = ((wo + COLS - 1) / COLS) * ((ho + ROWS - 1) / ROWS) * images;

    // the block's weights, every tap and input channel, MMA column n holding output channel
    // wg_channel(n): (n, tap)'s CIN * 2 bytes read by GROUPS neighbouring threads
    for (int index = tid; index < 9 * T::GROUPS * BN; index += WG_THREADS) {
        const int group = index % T::GROUPS, rest = index / T::GROUPS;
        const int n = rest % BN, tap = rest / BN;
        cp_async16(b_s + ((tap * T::GROUPS + group) * BN + n) * 16,
                   w + static_cast<long long>(n0 + wg_channel(n)) * 9 * CIN + tap * CIN + group * 8, true);
    }
    int image, oh0, ow0;
    int tile = blockIdx.x;
    if (tile < all_tiles) {
        wg_tile_origin<ROWS, COLS>(tile, ho, wo, image, oh0, ow0);
        wg_copy_halo<CIN, BN, ROWS, COLS>(halo_s, x, image, oh0, ow0, h, wd);
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");

    // this thread's columns 8j + 2 * quad (+ 1) hold channels 32 * (j / 4) + 8 * quad + 2 * (j % 4)
    // (+ 1): 8 consecutive channels per 32 columns, whose bias pairs stay in registers
    const int warp = tid >> 5, group = (tid & 31) >> 2, quad = tid & 3;
    float2 bias_pair[BN / 8];
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
        bias_pair[j] = *reinterpret_cast<const float2*>(bias + n0 + wg_channel(8 * j + 2 * quad));

    const unsigned long long b_first = wg_descriptor(b_s, BN * 16, 128);
    float acc[T::M_TILES][BN / 2];
    if (WG_OMIT & 1)
#pragma unroll
        for (int m = 0; m < T::M_TILES; ++m)
#pragma unroll
            for (int j = 0; j < BN / 2; ++j) acc[m][j] = 0.0f;
    bool bad = false;
    for (int step = 0; tile < all_tiles; tile += gridDim.x, ++step) {
        unsigned char* stage = halo_s + (step & 1) * T::HALO_BYTES;
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");
        // the copies are ordinary (generic-proxy) writes; wgmma reads through the async proxy
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();

        const unsigned long long a_first = wg_descriptor(stage, T::PIXELS * 16, 128);
        wg_pin(acc);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int tap = 0; tap < 9; ++tap) {
            const int dh = tap / 3, dw = tap - dh * 3;
#pragma unroll
            for (int ks = 0; ks < CIN / 16; ++ks) {
                // descriptors as the first ones plus compile-time offsets in 16-byte units (the
                // start address field is the low 14 bits and no sum leaves them): no registers
                const unsigned long long b = b_first + (tap * T::GROUPS + 2 * ks) * BN;
#pragma unroll
                for (int m = 0; m < T::M_TILES; ++m) {
                    const int pixel = (m / COL_TILES + dh) * T::HALO_COLS + (m % COL_TILES) * 64 + dw;
                    // the tile's first MMA overwrites the accumulators (scale-d 0)
                    if (!(WG_OMIT & 1))
                        wgmma_f16<BN>(acc[m], a_first + 2 * ks * T::PIXELS + pixel, b, tap == 0 && ks == 0 ? 0 : 1);
                }
            }
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");

        // while they run: the next tile's halo into the other stage (its last reader, the
        // previous tile's MMAs, finished before every thread passed the barrier above)
        const int next = tile + gridDim.x;
        const int here_image = image, here_oh0 = oh0, here_ow0 = ow0;
        if (next < all_tiles && !(WG_OMIT & 4)) {
            wg_tile_origin<ROWS, COLS>(next, ho, wo, image, oh0, ow0);
            wg_copy_halo<CIN, BN, ROWS, COLS>(halo_s + ((step + 1) & 1) * T::HALO_BYTES, x, image, oh0, ow0, h, wd);
        }
        asm volatile("cp.async.commit_group;\n" ::: "memory");

        // the residual this thread's epilogue adds, loaded while the MMAs run (where the
        // registers allow: RESIDUAL_EARLY), so that no epilogue step waits on memory
        uint4 early[RESIDUAL_EARLY ? T::M_TILES : 1][2][CHUNKS];
        if constexpr (RESIDUAL_EARLY) {
            if (residual != nullptr && !(WG_OMIT & 2)) {
#pragma unroll
                for (int m = 0; m < T::M_TILES; ++m)
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const int oh = here_oh0 + m / COL_TILES;
                        const int ow = wg_output_column<COLS>(here_ow0, m, warp, group, half);
                        const bool inside = oh < ho && ow < wo;
                        const long long at = wg_output_offset(here_image, oh, ow, ho, wo, k, n0 + 8 * quad);
#pragma unroll
                        for (int chunk = 0; chunk < CHUNKS; ++chunk)
                            early[m][half][chunk] = inside ? __ldg(reinterpret_cast<const uint4*>(residual + at + 32 * chunk))
                                                           : make_uint4(0, 0, 0, 0);
                    }
            }
        }

        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        wg_pin(acc);

        // Epilogue from the accumulator fragment: row 16 * warp + group (+ 8 for the second
        // pair of each n8 block) of m64 tile m; per 32 columns, this thread's 8 consecutive
        // channels (wg_channel): one 16-byte residual load and one 16-byte store, a warp's
        // covering 8 whole pixels.
#pragma unroll
        for (int m = 0; m < T::M_TILES; ++m) {
            const int oh = here_oh0 + m / COL_TILES;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int ow = wg_output_column<COLS>(here_ow0, m, warp, group, half);
                if ((WG_OMIT & 2) || oh >= ho || ow >= wo) continue;
                const long long at = wg_output_offset(here_image, oh, ow, ho, wo, k, n0 + 8 * quad);
#pragma unroll
                for (int chunk = 0; chunk < CHUNKS; ++chunk) {
                    float v[8];
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int j = 4 * chunk + i;
                        v[2 * i] = acc[m][4 * j + 2 * half] + bias_pair[j].x;
                        v[2 * i + 1] = acc[m][4 * j + 2 * half + 1] + bias_pair[j].y;
                    }
                    if (residual != nullptr)
                        add_halves(v, RESIDUAL_EARLY ? early[RESIDUAL_EARLY ? m : 0][half][chunk]
                                                     : __ldg(reinterpret_cast<const uint4*>(residual + at + 32 * chunk)));
                    *reinterpret_cast<uint4*>(y + at + 32 * chunk) = relu_check_pack(v, relu, bad);
                }
            }
        }
    }
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    raise_flag(bad, flag);
}

}  // namespace

// Entry points: conv_wgmma_c<CIN>_n<BN>_<ROWS>x<COLS>, 3x3 stride 1 only; conv_f16.cu's
// arguments and then `images`, the batch. grid (min(tiles, BLOCKS x SMs), cout / BN) where
// tiles = images * ceil(ho / ROWS) * ceil(wo / COLS)
// (igemm.wgmma_grid), block 128, dynamic shared memory WgTile<CIN, BN, ROWS, COLS>::SHARED_BYTES
// (igemm.wgmma_shared_bytes computes the same); residual may be null. BLOCKS: the blocks
// per SM the grid is sized for; the launch bounds cap the registers at 65536 / (128 x
// BLOCKS) and the shared memory must fit BLOCKS blocks (228 KB per SM, 1 KB of it reserved
// per block).
#define WG_ENTRY(CIN, BN, ROWS, COLS, BLOCKS)                                                                   \
    static_assert(BLOCKS * (WgTile<CIN, BN, ROWS, COLS>::SHARED_BYTES + 1024) <= 233472,                       \
                  "BLOCKS blocks fit an SM's shared memory");                                                   \
    extern "C" __global__ __launch_bounds__(WG_THREADS, BLOCKS) void conv_wgmma_c##CIN##_n##BN##_##ROWS##x##COLS( \
        const unsigned short* __restrict__ x, const unsigned short* __restrict__ w, const float* __restrict__ bias, \
        const unsigned short* __restrict__ residual, unsigned short* __restrict__ y, int* __restrict__ flag, int h,  \
        int wd, int c, int ho, int wo, int k, int relu, int images) {                                          \
        conv_wgmma<CIN, BN, ROWS, COLS>(x, w, bias, residual, y, flag, h, wd, c, ho, wo, k, relu, images);  \
    }
WG_ENTRY(32, 32, 8, 64, 2)
WG_ENTRY(32, 32, 4, 64, 3)
WG_ENTRY(32, 32, 2, 128, 2)
WG_ENTRY(64, 64, 2, 64, 1)
WG_ENTRY(64, 32, 2, 64, 2)
WG_ENTRY(128, 32, 1, 64, 1)
