// How many words of two device arrays differ, bit for bit (speakerd/engine/gpu/bitwise.py):
// the replay checks of cuDNN plans and captured forwards, set-up only. Ours rather than
// CuPy's array_equal, whose comparison and reduction kernels a fresh machine compiles for
// seconds per dtype in every process that checks (the engine and each tuning worker); this
// file compiles in a fraction of one, with the other kernels.
//
// count_differing_u16/_u32/_u64: a grid-stride loop over n words, each thread's count summed
// over its warp with shuffles, one atomicAdd per warp that saw a difference. `count` must be
// zero before the launch; blockDim.x a multiple of 32.

template <typename Word>
__device__ __forceinline__ void count_differing(const Word* __restrict__ a, const Word* __restrict__ b,
                                                unsigned long long n, unsigned long long* __restrict__ count) {
    unsigned long long local = 0;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        local += a[i] != b[i];
    for (int offset = 16; offset > 0; offset /= 2) local += __shfl_down_sync(0xffffffffu, local, offset);
    if ((threadIdx.x & 31) == 0 && local != 0) atomicAdd(count, local);
}

extern "C" __global__ void count_differing_u16(const unsigned short* __restrict__ a,
                                               const unsigned short* __restrict__ b, unsigned long long n,
                                               unsigned long long* __restrict__ count) {
    count_differing(a, b, n, count);
}

extern "C" __global__ void count_differing_u32(const unsigned int* __restrict__ a,
                                               const unsigned int* __restrict__ b, unsigned long long n,
                                               unsigned long long* __restrict__ count) {
    count_differing(a, b, n, count);
}

extern "C" __global__ void count_differing_u64(const unsigned long long* __restrict__ a,
                                               const unsigned long long* __restrict__ b, unsigned long long n,
                                               unsigned long long* __restrict__ count) {
    count_differing(a, b, n, count);
}
