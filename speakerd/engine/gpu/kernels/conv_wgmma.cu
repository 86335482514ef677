// FP16 3x3 stride-1 convolution on Hopper's warpgroup MMA (wgmma.mma_async, sm_90a), NHWC
// half in and out, FP32 accumulation, the block's epilogue fused and range-checked as in
// conv_f16.cu:
//   y = half(act(conv(x, w) + bias (+ residual))), flag |= 1 where |y| > 65504 or NaN.
//
// Why: layer1 at b32 (32 -> 32 channels, 80 x 998) takes 1.68 of the b32 batch's 4.39 ms
// in conv_f16.cu at ~163 TFLOP/s, bound by how fast its eight warps feed mma.sync from
// shared memory (every tap reloads its fragments through registers). wgmma reads both
// operands from shared memory itself, asynchronously, so a warpgroup issues a tap's MMAs
// without loading a fragment.
//
// Tiling: one warpgroup (128 threads) per block computes ROWS output rows x COLS output
// columns of one image for BN output channels: ROWS * COLS / 64 m64 tiles of 64 consecutive
// pixels of one output row. Per 32-channel K chunk it copies the halo ((ROWS + 2) x
// (COLS + 2) input pixels) and the chunk's weights of all nine taps into shared memory
// once; every tap's A operand is then the halo shifted by (dh, dw) pixels, so a tap costs
// no copy at all, only a different descriptor.
//
// Shared-memory layouts (wgmma's K-major layout without swizzle: a core matrix is 8 rows of
// 16 bytes, 128 contiguous bytes; the descriptor's LBO steps between core matrices along K,
// its SBO between core matrices along M or N):
//   halo    [channel group of 8][pixel] 16 bytes each: a run of 8 pixels of one halo row is
//           a core matrix wherever it starts, so the shift by dw (one pixel, 16 bytes) is a
//           start address (16-byte granular), SBO = 128 bytes, LBO = pixels * 16.
//   weights [tap][channel group][n] 16 bytes each: SBO = 128 bytes, LBO = BN * 16.
// Every wgmma of a chunk is issued back to back, then one commit and one wait.
//
// Epilogue: the accumulators go through shared memory (FP32, rows padded by 8 floats) to
// the common FP16 epilogue (common.cuh, f16_tile_epilogue), as in conv_f16.cu.
//
// Requirements (checked on the host): a compute capability 9.0 device (sm_90a code), 3x3
// stride 1 pad 1, cin % 32 == 0, cout % BN == 0, 16-byte aligned x, w, residual and y.
// Compiled for sm_90a by kernels.py (wgmma has no plain sm_90 form), not through CuPy.

#define WG_THREADS 128  // one warpgroup
#define WG_CHUNK 32     // input channels per K chunk: 4 groups of 8
#define WG_OUT_PAD 8    // floats of padding per staged output row

#include "common.cuh"

namespace {

template <int BN, int ROWS, int COLS>
struct WgTile {
    static constexpr int HALO_ROWS = ROWS + 2;
    static constexpr int HALO_COLS = COLS + 2;
    static constexpr int PIXELS = HALO_ROWS * HALO_COLS;
    static constexpr int GROUPS = WG_CHUNK / 8;
    static constexpr int A_BYTES = GROUPS * PIXELS * 16;
    static constexpr int B_BYTES = 9 * GROUPS * BN * 16;
    static constexpr int LDO = BN + WG_OUT_PAD;
    static constexpr int OUT_BYTES = ROWS * COLS * LDO * 4;
    static constexpr int LOAD_BYTES = A_BYTES + B_BYTES;
    static constexpr int SHARED_BYTES = LOAD_BYTES > OUT_BYTES ? LOAD_BYTES : OUT_BYTES;
    static constexpr int M_TILES = ROWS * COLS / 64;
    static_assert(COLS % 64 == 0, "an m64 tile is 64 pixels of one output row");
    static_assert(A_BYTES % 16 == 0, "the weights start 16-byte aligned");
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

template <int BN>
__device__ __forceinline__ void wgmma_f16(float (&d)[BN / 2], unsigned long long a, unsigned long long b);

template <>
__device__ __forceinline__ void wgmma_f16<32>(float (&d)[16], unsigned long long a, unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 " WG_D16 ", %16, %17, p, 1, 1, 0, 0;\n}\n"
        : WG_OUT16(d)
        : "l"(a), "l"(b), "r"(1));
}

template <>
__device__ __forceinline__ void wgmma_f16<64>(float (&d)[32], unsigned long long a, unsigned long long b) {
    float* e = d + 16;
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " WG_D32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
        : WG_OUT16(d), WG_OUT16(e)
        : "l"(a), "l"(b), "r"(1));
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

template <int BN, int ROWS, int COLS>
__device__ __forceinline__ void conv_wgmma(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,
                                           const float* __restrict__ bias, const unsigned short* __restrict__ residual,
                                           unsigned short* __restrict__ y, int* __restrict__ flag, int h, int wd, int c,
                                           int ho, int wo, int k, int relu) {
    using T = WgTile<BN, ROWS, COLS>;
    constexpr int COL_TILES = COLS / 64;
    extern __shared__ float4 shared4[];
    unsigned char* a_s = reinterpret_cast<unsigned char*>(shared4);  // [group][pixel] x 16 bytes
    unsigned char* b_s = a_s + T::A_BYTES;                           // [tap][group][n] x 16 bytes
    const int tid = threadIdx.x;
    const int n0 = blockIdx.x * BN, ow0 = blockIdx.y * COLS;
    const int row_blocks = (ho + ROWS - 1) / ROWS;
    const int image = blockIdx.z / row_blocks, oh0 = (blockIdx.z - image * row_blocks) * ROWS;
    const int ih0 = oh0 - 1, iw0 = ow0 - 1;
    const long long image_base = static_cast<long long>(image) * h * wd * c;
    const int filter = 9 * c;
    const unsigned long long a_first = wg_descriptor(a_s, T::PIXELS * 16, 128);
    const unsigned long long b_first = wg_descriptor(b_s, BN * 16, 128);
    float acc[T::M_TILES][BN / 2];
#pragma unroll
    for (int m = 0; m < T::M_TILES; ++m)
#pragma unroll
        for (int e = 0; e < BN / 2; ++e) acc[m][e] = 0.0f;

    for (int c0 = 0; c0 < c; c0 += WG_CHUNK) {
        // the halo of this chunk, a pixel's 64 bytes read by 4 neighbouring threads
        // (coalesced), each 16 bytes landing in its channel group's plane; zeros outside
        for (int index = tid; index < T::PIXELS * T::GROUPS; index += WG_THREADS) {
            const int pixel = index >> 2, group = index & 3;
            const int row = pixel / T::HALO_COLS, col = pixel - row * T::HALO_COLS;
            const int ih = ih0 + row, iw = iw0 + col;
            const bool inside =
                static_cast<unsigned>(ih) < static_cast<unsigned>(h) && static_cast<unsigned>(iw) < static_cast<unsigned>(wd);
            const unsigned short* source = inside ? x + image_base + (static_cast<long long>(ih) * wd + iw) * c + c0 + group * 8 : x;
            cp_async16(a_s + (group * T::PIXELS + pixel) * 16, source, inside);
        }
        // the chunk's weights, every tap: (n, tap)'s 64 bytes read by 4 neighbouring threads
        for (int index = tid; index < 9 * T::GROUPS * BN; index += WG_THREADS) {
            const int group = index & 3, rest = index >> 2;
            const int n = rest % BN, tap = rest / BN;
            cp_async16(b_s + ((tap * T::GROUPS + group) * BN + n) * 16,
                       w + static_cast<long long>(n0 + n) * filter + tap * c + c0 + group * 8, true);
        }
        asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
        // the copies are ordinary (generic-proxy) writes; wgmma reads through the async proxy
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();

        wg_pin(acc);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int tap = 0; tap < 9; ++tap) {
            const int dh = tap / 3, dw = tap - dh * 3;
#pragma unroll
            for (int ks = 0; ks < WG_CHUNK / 16; ++ks) {
                // descriptors as the first ones plus compile-time offsets in 16-byte units (the
                // start address field is the low 14 bits and no sum leaves them): no registers
                const unsigned long long b = b_first + (tap * T::GROUPS + 2 * ks) * BN;
#pragma unroll
                for (int m = 0; m < T::M_TILES; ++m) {
                    const int pixel = (m / COL_TILES + dh) * T::HALO_COLS + (m % COL_TILES) * 64 + dw;
                    wgmma_f16<BN>(acc[m], a_first + 2 * ks * T::PIXELS + pixel, b);
                }
            }
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        wg_pin(acc);
        __syncthreads();  // every warp's MMAs are done with the chunk before it is refilled
    }

    // Stage the accumulators (FP32) in shared memory: pixel p = row * COLS + column.
    float* out_s = reinterpret_cast<float*>(shared4);
    const int warp = tid >> 5, group = (tid & 31) >> 2, quad = tid & 3;
#pragma unroll
    for (int m = 0; m < T::M_TILES; ++m)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int pixel = (m / COL_TILES) * COLS + (m % COL_TILES) * 64 + 16 * warp + group + 8 * half;
#pragma unroll
            for (int j = 0; j < BN / 8; ++j)
                *reinterpret_cast<float2*>(out_s + pixel * T::LDO + j * 8 + 2 * quad) =
                    make_float2(acc[m][4 * j + 2 * half], acc[m][4 * j + 2 * half + 1]);
        }
    __syncthreads();

    f16_tile_epilogue<ROWS, COLS, BN, WG_THREADS>(
        [&](int pixel, int part, float4& s0, float4& s1) {
            const float* staged = out_s + pixel * T::LDO + part * 8;
            s0 = *reinterpret_cast<const float4*>(staged);
            s1 = *reinterpret_cast<const float4*>(staged + 4);
        },
        bias, residual, y, flag, image, oh0, ow0, ho, wo, k, n0, relu);
}

}  // namespace

// Entry points: conv_wgmma_n<BN>_<ROWS>x<COLS>, 3x3 stride 1 only. grid (cout / BN,
// ceil(wo / COLS), n * ceil(ho / ROWS)), block 128, dynamic shared memory WgTile<BN, ROWS,
// COLS>::SHARED_BYTES (igemm.wgmma_shared_bytes computes the same); residual may be null.
// BLOCKS: the blocks per SM the launch bounds ask for, which caps the registers (65536 /
// (128 x BLOCKS)) below what would spill the accumulators (M_TILES x BN / 2 floats).
#define WG_ENTRY(BN, ROWS, COLS, BLOCKS)                                                                      \
    extern "C" __global__ __launch_bounds__(WG_THREADS, BLOCKS) void conv_wgmma_n##BN##_##ROWS##x##COLS(       \
        const unsigned short* __restrict__ x, const unsigned short* __restrict__ w, const float* __restrict__ bias, \
        const unsigned short* __restrict__ residual, unsigned short* __restrict__ y, int* __restrict__ flag, int h,  \
        int wd, int c, int ho, int wo, int k, int relu) {                                                      \
        conv_wgmma<BN, ROWS, COLS>(x, w, bias, residual, y, flag, h, wd, c, ho, wo, k, relu);               \
    }
WG_ENTRY(32, 4, 64, 4)
WG_ENTRY(32, 2, 128, 4)
WG_ENTRY(32, 8, 64, 2)
WG_ENTRY(64, 2, 64, 4)
