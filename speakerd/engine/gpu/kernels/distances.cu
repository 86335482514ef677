// SciPy's pdist(X, "euclidean") on the GPU, the same bits, as rows of the square matrix
// (speakerd/engine/gpu/distances.py launches it; speakerd/model/diarization/linkage.py is the
// reference and the consumer).
//
// SciPy's EuclideanDistance sums |x_ik - x_jk|^2 over k = 0, 1, ... in that order from 0.0 in
// float64, then takes the square root, with no fused multiply-add on x86-64. Here each pair is
// one thread's chain of __dsub_rn, __dmul_rn and __dadd_rn in that order: those intrinsics
// are never contracted into an FMA, whatever -fmad says, and __dsqrt_rn is IEEE's correctly
// rounded root, as the host's. |a - b| squared is (a - b) squared to the bit (the sign does
// not touch the magnitude), and (i, j) gives the same value as (j, i): a - b is exactly
// -(b - a). So a band of rows can be computed whole, both triangles, and copied to the host
// as contiguous rows.
//
// pair_distances: a TILE x TILE tile of (row, column) pairs per block of THREADS_X x THREADS_Y
//   threads, each thread MICRO x MICRO pairs; the dimensions are staged through shared memory
//   K_STEP at a time (both tiles' rows, float64), in order, so every pair's sum runs
//   k = 0, 1, ... as SciPy's.

#define TILE 64
#define MICRO 4
#define THREADS_X (TILE / MICRO)
#define THREADS_Y (TILE / MICRO)
#define K_STEP 16

extern "C" __global__ void pair_distances(const double* __restrict__ points, int rows, int dim,
                                          int row_begin, int row_end, double* __restrict__ out) {
    // out[(i - row_begin) * rows + j] = distance(i, j) for row_begin <= i < row_end, 0 <= j < rows
    __shared__ double a[K_STEP][TILE + 1];
    __shared__ double b[K_STEP][TILE + 1];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int thread = ty * THREADS_X + tx;
    const int i0 = row_begin + blockIdx.y * TILE;
    const int j0 = blockIdx.x * TILE;
    double sum[MICRO][MICRO];
#pragma unroll
    for (int r = 0; r < MICRO; ++r)
#pragma unroll
        for (int c = 0; c < MICRO; ++c) sum[r][c] = 0.0;

    for (int k0 = 0; k0 < dim; k0 += K_STEP) {
        // stage TILE rows x K_STEP dimensions of each side (zeros past the ends)
        for (int e = thread; e < TILE * K_STEP; e += THREADS_X * THREADS_Y) {
            const int r = e / K_STEP, k = e % K_STEP;
            const int i = i0 + r, j = j0 + r, kk = k0 + k;
            a[k][r] = (i < row_end && kk < dim) ? points[(long long)i * dim + kk] : 0.0;
            b[k][r] = (j < rows && kk < dim) ? points[(long long)j * dim + kk] : 0.0;
        }
        __syncthreads();
        const int steps = min(K_STEP, dim - k0);
        for (int k = 0; k < steps; ++k) {
            double av[MICRO], bv[MICRO];
#pragma unroll
            for (int r = 0; r < MICRO; ++r) av[r] = a[k][ty + r * THREADS_Y];
#pragma unroll
            for (int c = 0; c < MICRO; ++c) bv[c] = b[k][tx + c * THREADS_X];
#pragma unroll
            for (int r = 0; r < MICRO; ++r)
#pragma unroll
                for (int c = 0; c < MICRO; ++c) {
                    const double difference = __dsub_rn(av[r], bv[c]);
                    sum[r][c] = __dadd_rn(sum[r][c], __dmul_rn(difference, difference));
                }
        }
        __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < MICRO; ++r) {
        const int i = i0 + ty + r * THREADS_Y;
        if (i >= row_end) continue;
#pragma unroll
        for (int c = 0; c < MICRO; ++c) {
            const int j = j0 + tx + c * THREADS_X;
            if (j < rows) out[(long long)(i - row_begin) * rows + j] = __dsqrt_rn(sum[r][c]);
        }
    }
}
