// A whole FP16 BasicBlock of layer1 in one kernel (32 -> 32 channels, 3x3 stride 1, identity
// shortcut), NHWC half in and out, mma.sync m16n8k16 with FP32 accumulation:
//   hidden = half(relu(conv1(x) + b1)),  y = half(relu(conv2(hidden) + b2 + x)),
// with the range check of FP16 mode on both (flag |= 1 where |value| > 65504 or NaN).
//
// Why: layer1's six convolutions are the trunk's widest activations (b32: 163 MB per
// tensor). Run one by one, every conv reads its input and writes its output, and conv2
// reads the block input again as its residual: five tensor crossings of HBM per block. Here
// the hidden activation never leaves the SM: a block computes an output tile of ROWS x
// COLS pixels from a halo of (ROWS + 4) x (COLS + 4) input pixels, conv1 on the
// (ROWS + 2) x (COLS + 2) hidden pixels the tile's conv2 reads (the ring recomputed by the
// neighbouring tiles too), conv2 on the tile, and the residual comes from the same halo.
// Two crossings remain: x in, y out.
//
// Persistent: one block per SM walks the tiles (grid-stride). Both convolutions' weights
// (2 x 9 x 32 x 32 halves) are loaded once per block, not once per tile, and the next
// tile's halo is copied (cp.async) while this one computes: two halo buffers.
//
// Arithmetic matches kernels/conv_f16.cu step for step (same fragments, the same tap and
// k order, FP32 bias and residual adds, round to nearest half): a block computed here
// equals, bit for bit, conv_f16's conv1 then conv2 (tests/test_gpu_block.py checks).
//
// Shared memory (halves, rows padded to F16B_LD = 48 so that the 8-byte fragment loads of
// a half warp hit 32 distinct banks, as in conv_f16.cu):
//   w1, w2      9 taps x 32 output channels x 48
//   halo x 2    (ROWS + 4) x (COLS + 4) pixels x 48
//   hidden      (ROWS + 2) x (COLS + 2) pixels x 48
//   staged y    ROWS x COLS pixels x 40 (the output tile as halves, stored in 16-byte pieces)
//
// Warps: 8 x WARPS_N. conv1's hidden pixels, taken in flat order, make HIDDEN_FRAGS m16
// fragments; pixel warp m (of 8) computes fragments m, m + 8, m + 16 (MI1 of them; a
// fragment past the last is computed on a clamped pixel and dropped). conv2's ROWS * COLS
// pixels make OUT / 128 fragments per pixel warp. WARPS_N = 1: a warp covers all 32
// channels (4 n8 tiles), so a weight fragment loaded once feeds MI MMAs and shared memory
// carries ~213 bytes per MMA. WARPS_N = 2: two warps split the channels (2 n8 tiles each),
// twice the warps to hide latency with one block per SM, at ~341 bytes per MMA (each loads
// its A fragments itself); the autotuner times both.
//
// Requirements (checked on the host, block.py): 32 channels in and out, 16-byte aligned
// x, w1, w2, y and hidden_out; hidden_out may be null (then only y is written: what
// serves), else the hidden activation is written too (taps).

#define F16B_PIXEL_WARPS 8  // warps along the pixels; x WARPS_N along the channels
#define F16B_C 32
#define F16B_LD 48        // halves per shared pixel or weight row (32 + 16 padding)
#define F16B_STAGE_LD 40  // halves per staged output pixel (32 + 8: rows stay 16-byte aligned)
#define F16B_TAPS 9

#include "common.cuh"

namespace {

template <int ROWS, int COLS, int WARPS_N>
struct BlockTile {
    static constexpr int HR = ROWS + 2, HC = COLS + 2;  // hidden tile
    static constexpr int IR = ROWS + 4, IC = COLS + 4;  // input halo
    static constexpr int HIDDEN = HR * HC;
    static constexpr int OUT = ROWS * COLS;
    static constexpr int WARPS = F16B_PIXEL_WARPS;  // along the pixels
    static constexpr int THREADS = 32 * F16B_PIXEL_WARPS * WARPS_N;
    static constexpr int NT = 4 / WARPS_N;  // n8 tiles (8 channels each) per warp
    static constexpr int HIDDEN_FRAGS = (HIDDEN + 15) / 16;
    static constexpr int MI1 = (HIDDEN_FRAGS + WARPS - 1) / WARPS;
    static constexpr int MI2 = OUT / 16 / WARPS;
    static constexpr int W_HALVES = F16B_TAPS * F16B_C * F16B_LD;
    static constexpr int IN_HALVES = IR * IC * F16B_LD;
    static constexpr int HID_HALVES = HIDDEN * F16B_LD;
    static constexpr int STAGE_HALVES = OUT * F16B_STAGE_LD;
    static constexpr int SHARED_BYTES = (2 * W_HALVES + 2 * IN_HALVES + HID_HALVES + STAGE_HALVES) * 2;
    static_assert(OUT % (16 * WARPS) == 0, "conv2's fragments split evenly over the warps");
    static_assert(WARPS_N == 1 || WARPS_N == 2, "the channels split over one or two warps");
    static_assert(SHARED_BYTES <= 227 * 1024, "one block's shared memory on Hopper");
};

// MI m16 fragments x NT n8 tiles of a 3x3 conv with 32 input channels over shared memory:
// acc[i] += the taps of the pixels whose (top, bottom) row offsets are `top[i]`,
// `bottom[i]` (halves, tap (0, 0)), ROW pixels apart per image row, for output channels
// `channel0` + 0 .. 8 * NT - 1. Same fragment layout and order as conv_f16.cu.
template <int MI, int NT, int ROW>
__device__ __forceinline__ void conv3x3_32(float (&acc)[MI][NT][4], const unsigned short* __restrict__ source,
                                           const unsigned short* __restrict__ weights, const int (&top)[MI],
                                           const int (&bottom)[MI], int channel0, int group, int quad) {
#pragma unroll
    for (int tap = 0; tap < F16B_TAPS; ++tap) {
        const int shift = ((tap / 3) * ROW + tap % 3) * F16B_LD;
        const unsigned short* b_tap = weights + (tap * F16B_C + channel0) * F16B_LD;
#pragma unroll
        for (int kk = 0; kk < F16B_C; kk += 16) {
            unsigned a[MI][4];
#pragma unroll
            for (int i = 0; i < MI; ++i)
                load_a_f16(a[i], source + top[i] + shift + kk + 4 * quad, source + bottom[i] + shift + kk + 4 * quad);
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const uint2 column = *reinterpret_cast<const uint2*>(b_tap + (j * 8 + group) * F16B_LD + kk + 4 * quad);
                const unsigned bw[2] = {column.x, column.y};
#pragma unroll
                for (int i = 0; i < MI; ++i) mma_f16(acc[i][j], a[i], bw);
            }
        }
    }
}

template <int ROWS, int COLS, int WARPS_N>
__device__ __forceinline__ void block_f16(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w1,
                                          const float* __restrict__ b1, const unsigned short* __restrict__ w2,
                                          const float* __restrict__ b2, unsigned short* __restrict__ y,
                                          unsigned short* __restrict__ hidden_out, int* __restrict__ flag, int n,
                                          int h, int wd) {
    using T = BlockTile<ROWS, COLS, WARPS_N>;
    extern __shared__ float4 shared4[];
    unsigned short* w1_s = reinterpret_cast<unsigned short*>(shared4);
    unsigned short* w2_s = w1_s + T::W_HALVES;
    unsigned short* halo_s = w2_s + T::W_HALVES;  // two buffers of IN_HALVES
    unsigned short* hidden_s = halo_s + 2 * T::IN_HALVES;
    unsigned short* stage_s = hidden_s + T::HID_HALVES;
    const int tid = threadIdx.x, lane = tid & 31;
    const int warp = (tid >> 5) % T::WARPS;                // along the pixels
    const int channel0 = (tid >> 5) / T::WARPS * T::NT * 8;  // this warp's first output channel
    const int group = lane >> 2, quad = lane & 3;
    const int tiles_w = (wd + COLS - 1) / COLS, tiles_h = (h + ROWS - 1) / ROWS;
    const int tiles = n * tiles_h * tiles_w;
    const long long image_pixels = static_cast<long long>(h) * wd;

    // Per-lane fragment rows, the same for every tile: conv1 reads the halo at hidden pixel
    // p = (r, c) -> halo pixel (r, c) for tap (0, 0); conv2 reads the hidden tile at output
    // pixel o = (r, c) -> hidden pixel (r, c).
    int top1[T::MI1], bottom1[T::MI1], top2[T::MI2], bottom2[T::MI2];
#pragma unroll
    for (int i = 0; i < T::MI1; ++i) {
        const int p0 = min((warp + i * T::WARPS) * 16 + group, T::HIDDEN - 1);
        const int p1 = min((warp + i * T::WARPS) * 16 + group + 8, T::HIDDEN - 1);
        top1[i] = (p0 / T::HC * T::IC + p0 % T::HC) * F16B_LD;
        bottom1[i] = (p1 / T::HC * T::IC + p1 % T::HC) * F16B_LD;
    }
#pragma unroll
    for (int i = 0; i < T::MI2; ++i) {
        const int o0 = (warp * T::MI2 + i) * 16 + group, o1 = o0 + 8;
        top2[i] = (o0 / COLS * T::HC + o0 % COLS) * F16B_LD;
        bottom2[i] = (o1 / COLS * T::HC + o1 % COLS) * F16B_LD;
    }
    float2 bias1[T::NT], bias2[T::NT];
#pragma unroll
    for (int j = 0; j < T::NT; ++j) {
        bias1[j] = *reinterpret_cast<const float2*>(b1 + channel0 + j * 8 + 2 * quad);
        bias2[j] = *reinterpret_cast<const float2*>(b2 + channel0 + j * 8 + 2 * quad);
    }

    // Copies one tile's halo into `buffer`: 4 x 16-byte pieces per pixel, zeros outside.
    auto load_halo = [&](int tile, unsigned short* buffer) {
        const int image = tile / (tiles_h * tiles_w), rest = tile - image * tiles_h * tiles_w;
        const int ih0 = rest / tiles_w * ROWS - 2, iw0 = rest % tiles_w * COLS - 2;
        const unsigned short* base = x + image * image_pixels * F16B_C;
        for (int index = tid; index < T::IR * T::IC * 4; index += T::THREADS) {
            const int pixel = index >> 2, piece = index & 3;
            const int row = pixel / T::IC, col = pixel - row * T::IC;
            const int ih = ih0 + row, iw = iw0 + col;
            const bool inside = static_cast<unsigned>(ih) < static_cast<unsigned>(h) &&
                                static_cast<unsigned>(iw) < static_cast<unsigned>(wd);
            const unsigned short* source = inside ? base + (static_cast<long long>(ih) * wd + iw) * F16B_C + piece * 8 : x;
            cp_async16(buffer + pixel * F16B_LD + piece * 8, source, inside);
        }
    };

    // Both weight sets (row (tap, n) of 32 input channels), then the first tile's halo.
    for (int index = tid; index < F16B_TAPS * F16B_C * 4; index += T::THREADS) {
        const int row = index >> 2, piece = index & 3;
        const int tap = row / F16B_C, out = row - tap * F16B_C;
        const long long at = static_cast<long long>(out) * F16B_TAPS * F16B_C + tap * F16B_C + piece * 8;
        cp_async16(w1_s + row * F16B_LD + piece * 8, w1 + at, true);
        cp_async16(w2_s + row * F16B_LD + piece * 8, w2 + at, true);
    }
    if (static_cast<int>(blockIdx.x) < tiles) load_halo(blockIdx.x, halo_s);
    asm volatile("cp.async.commit_group;\n" ::);

    bool bad = false;
    int buffer = 0;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x, buffer ^= 1) {
        // The next tile's halo goes into the other buffer, whose last readers (the previous
        // tile's conv1 and residual) passed the barrier before its output was stored.
        const int next = tile + gridDim.x;
        if (next < tiles) load_halo(next, halo_s + (buffer ^ 1) * T::IN_HALVES);
        asm volatile("cp.async.commit_group;\ncp.async.wait_group 1;\n" ::);
        __syncthreads();
        const unsigned short* in_s = halo_s + buffer * T::IN_HALVES;
        const int image = tile / (tiles_h * tiles_w), rest = tile - image * tiles_h * tiles_w;
        const int oh0 = rest / tiles_w * ROWS, ow0 = rest % tiles_w * COLS;

        // conv1 on the hidden tile -> relu(+ b1) as halves in shared memory; hidden pixels
        // outside the image are conv2's zero padding
        {
            float acc[T::MI1][T::NT][4];
            zero_fragments(acc);
            conv3x3_32<T::MI1, T::NT, T::IC>(acc, in_s, w1_s, top1, bottom1, channel0, group, quad);
#pragma unroll
            for (int i = 0; i < T::MI1; ++i)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int p = (warp + i * T::WARPS) * 16 + group + half * 8;
                    if (p >= T::HIDDEN) continue;
                    const int ih = oh0 - 1 + p / T::HC, iw = ow0 - 1 + p % T::HC;
                    const bool inside = static_cast<unsigned>(ih) < static_cast<unsigned>(h) &&
                                        static_cast<unsigned>(iw) < static_cast<unsigned>(wd);
#pragma unroll
                    for (int j = 0; j < T::NT; ++j) {
                        unsigned packed = 0u;
                        if (inside) {
                            const float v0 = fmaxf(acc[i][j][2 * half] + bias1[j].x, 0.0f);
                            const float v1 = fmaxf(acc[i][j][2 * half + 1] + bias1[j].y, 0.0f);
                            bad |= out_of_half_range(v0) | out_of_half_range(v1);
                            packed = pack_half2(v0, v1);
                        }
                        *reinterpret_cast<unsigned*>(hidden_s + p * F16B_LD + channel0 + j * 8 + 2 * quad) = packed;
                    }
                }
        }
        __syncthreads();

        // conv2 on the output tile, + b2 + the block input (the halo's centre), relu -> staged
        {
            float acc[T::MI2][T::NT][4];
            zero_fragments(acc);
            conv3x3_32<T::MI2, T::NT, T::HC>(acc, hidden_s, w2_s, top2, bottom2, channel0, group, quad);
#pragma unroll
            for (int i = 0; i < T::MI2; ++i)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int o = (warp * T::MI2 + i) * 16 + group + half * 8;
                    const int orow = o / COLS, ocol = o % COLS;
                    const bool inside = oh0 + orow < h && ow0 + ocol < wd;
                    const unsigned short* residual = in_s + ((orow + 2) * T::IC + ocol + 2) * F16B_LD + channel0;
#pragma unroll
                    for (int j = 0; j < T::NT; ++j) {
                        const float2 r = unpack_half2(*reinterpret_cast<const unsigned*>(residual + j * 8 + 2 * quad));
                        const float v0 = fmaxf(acc[i][j][2 * half] + bias2[j].x + r.x, 0.0f);
                        const float v1 = fmaxf(acc[i][j][2 * half + 1] + bias2[j].y + r.y, 0.0f);
                        if (inside) bad |= out_of_half_range(v0) | out_of_half_range(v1);
                        *reinterpret_cast<unsigned*>(stage_s + o * F16B_STAGE_LD + channel0 + j * 8 + 2 * quad) =
                            pack_half2(v0, v1);
                    }
                }
        }
        __syncthreads();

        // The output tile (and, for taps, the hidden tile's centre) in 16-byte pieces.
        const long long image_base = image * image_pixels;
        for (int index = tid; index < T::OUT * 4; index += T::THREADS) {
            const int o = index >> 2, piece = index & 3;
            const int orow = o / COLS, ocol = o - orow * COLS;
            const int oh = oh0 + orow, ow = ow0 + ocol;
            if (oh >= h || ow >= wd) continue;
            const long long at = (image_base + static_cast<long long>(oh) * wd + ow) * F16B_C + piece * 8;
            *reinterpret_cast<uint4*>(y + at) = *reinterpret_cast<const uint4*>(stage_s + o * F16B_STAGE_LD + piece * 8);
            if (hidden_out != nullptr)
                *reinterpret_cast<uint4*>(hidden_out + at) =
                    *reinterpret_cast<const uint4*>(hidden_s + ((orow + 1) * T::HC + ocol + 1) * F16B_LD + piece * 8);
        }
    }
    asm volatile("cp.async.wait_group 0;\n" ::);  // no copy outlives the block (an empty group at most)
    raise_flag(bad, flag);
}

}  // namespace

// Entry points: block_f16_<ROWS>x<COLS>_w<WARPS>, WARPS = 8 x WARPS_N. grid (min(tiles,
// SMs)), block 32 x WARPS threads, dynamic shared memory BlockTile<...>::SHARED_BYTES
// (block.py computes the same; it does not depend on the warps); hidden_out may be null.
// n, h, wd: the batch and the layer's height and width (input = output size).
#define F16B_ENTRY(ROWS, COLS, WARPS)                                                                              \
    extern "C" __global__ __launch_bounds__(32 * WARPS, 1) void block_f16_##ROWS##x##COLS##_w##WARPS(              \
        const unsigned short* __restrict__ x, const unsigned short* __restrict__ w1, const float* __restrict__ b1,   \
        const unsigned short* __restrict__ w2, const float* __restrict__ b2, unsigned short* __restrict__ y,        \
        unsigned short* __restrict__ hidden_out, int* __restrict__ flag, int n, int h, int wd) {                    \
        block_f16<ROWS, COLS, WARPS / F16B_PIXEL_WARPS>(x, w1, b1, w2, b2, y, hidden_out, flag, n, h, wd);         \
    }
F16B_ENTRY(8, 32, 8)
F16B_ENTRY(16, 16, 8)
F16B_ENTRY(4, 32, 8)
F16B_ENTRY(8, 32, 16)
F16B_ENTRY(16, 16, 16)
