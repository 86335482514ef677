// SciPy's centroid linkage on the GPU, the same bits: `_hierarchy.fast_linkage` (Müllner's
// generic algorithm) over the square distance matrix pair_distances (distances.cu) left in
// device memory. speakerd/model/diarization/linkage.py's `_fast_linkage` is the reference
// this ports operation for operation (the same versioned rows, the same heap, the same
// first-minimum rules); speakerd/engine/gpu/linkage.py launches it.
//
// initial_neighbors: one warp a row x: x's nearest candidate above it (the first minimum by
//   index, strict <, as find_min_dist) and a flag for any non-finite distance above the
//   diagonal (SciPy's check of the condensed matrix).
// centroid_merges: one block of THREADS threads runs the n - 1 merges. The heap of the
//   candidates' distances lives in shared memory and thread 0 alone changes it, in SciPy's
//   order; each merge's O(live) work is spread over the block: the re-search of a stale
//   candidate, the merged cluster's distances to every live cluster (Lance-Williams'
//   centroid update in _centroid's operation order, no FMA: __dmul_rn, __dadd_rn, __dsub_rn,
//   __ddiv_rn, __dsqrt_rn), the candidates moved from x to y, the lowered bounds (listed in
//   index order, applied by thread 0 in that order) and y's nearest candidate above it, and
//   the removal of x from the live list.
//
// The live clusters are a list in index order, cut into WARPS contiguous ranges, one a
// warp, its lanes striding through it: a warp's first minimum is its lanes' lexicographic
// (distance, index) minimum, and the warps' in warp order give the whole list's first
// minimum, as one pass in index order would.

#define THREADS 1024
#define WARPS (THREADS / 32)
// positions one lane handles per round of a range: their loads are issued together
#define UNROLL 4
// fallen bounds of one merge gathered into shared memory for thread 0's heap changes (more
// are read from device memory): a merge of clustered rows lowers about a hundred at most
#define LOWERED_SHARED 1024
// rows one call takes: heap_index's range
#define MAX_ROWS 65535

// status bits
#define NONFINITE 1
#define NO_NEIGHBOR 2

__device__ __forceinline__ double distance_of(const double* S, long long n, const int* version, int a, int b) {
    // the row of whichever of a and b was merged into last holds their current distance
    return version[a] >= version[b] ? S[(long long)a * n + b] : S[(long long)b * n + a];
}

__device__ __forceinline__ double centroid(double d_xi, double d_yi, double d_xy, long long size_x,
                                           long long size_y) {
    const double merged = (double)(size_x + size_y);
    const double spread = __dadd_rn(__dmul_rn(__dmul_rn((double)size_x, d_xi), d_xi),
                                    __dmul_rn(__dmul_rn((double)size_y, d_yi), d_yi));
    const double cross = __dmul_rn(__dmul_rn((double)(size_x * size_y), d_xy), d_xy);
    return __dsqrt_rn(__ddiv_rn(__dsub_rn(spread, __ddiv_rn(cross, merged)), merged));
}

// (distance, index) a is before b: the smaller distance, the lower index on a tie
__device__ __forceinline__ bool before(double da, int ia, double db, int ib) {
    return da < db || (da == db && ia >= 0 && (ib < 0 || ia < ib));
}

__device__ __forceinline__ void warp_first_min(double& dist, int& index) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        const double other_dist = __shfl_down_sync(0xffffffffu, dist, offset);
        const int other_index = __shfl_down_sync(0xffffffffu, index, offset);
        if (before(other_dist, other_index, dist, index)) {
            dist = other_dist;
            index = other_index;
        }
    }
}

// --- the heap (_structures.pxi's Heap), thread 0 only ------------------------------------

// keys and heap positions are below MAX_ROWS: 16 bits each, so the whole heap (its values,
// its keys by position and the positions by key) fits in shared memory: 12 bytes a row
typedef unsigned short heap_index;

__device__ __forceinline__ void heap_swap(double* values, heap_index* key_by_index, heap_index* index_by_key,
                                          int i, int j) {
    const double value = values[i];
    values[i] = values[j];
    values[j] = value;
    const int key_i = key_by_index[i], key_j = key_by_index[j];
    key_by_index[i] = (heap_index)key_j;
    key_by_index[j] = (heap_index)key_i;
    index_by_key[key_i] = (heap_index)j;
    index_by_key[key_j] = (heap_index)i;
}

__device__ void heap_sift_up(double* values, heap_index* key_by_index, heap_index* index_by_key, int index) {
    int parent = (index - 1) >> 1;
    while (index > 0 && values[parent] > values[index]) {
        heap_swap(values, key_by_index, index_by_key, index, parent);
        index = parent;
        parent = (index - 1) >> 1;
    }
}

__device__ void heap_sift_down(double* values, heap_index* key_by_index, heap_index* index_by_key, int size,
                               int index) {
    int child = (index << 1) + 1;
    while (child < size) {
        if (child + 1 < size && values[child + 1] < values[child]) child += 1;
        if (values[index] > values[child]) {
            heap_swap(values, key_by_index, index_by_key, index, child);
            index = child;
            child = (index << 1) + 1;
        } else {
            break;
        }
    }
}

__device__ void heap_change_value(double* values, heap_index* key_by_index, heap_index* index_by_key, int size,
                                  int key, double value) {
    const int index = index_by_key[key];
    const double old_value = values[index];
    values[index] = value;
    if (value < old_value)
        heap_sift_up(values, key_by_index, index_by_key, index);
    else
        heap_sift_down(values, key_by_index, index_by_key, size, index);
}

// --- kernels -------------------------------------------------------------------------------

extern "C" __global__ void initial_neighbors(const double* __restrict__ S, int n, int* __restrict__ neighbor,
                                             double* __restrict__ min_dist, int* __restrict__ status) {
    const int lane = threadIdx.x & 31;
    const int x = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (x >= n - 1) return;
    const double* row = S + (long long)x * n;
    double best = __longlong_as_double(0x7ff0000000000000LL);  // inf
    int best_index = -1;
    bool finite = true;
    for (int j = x + 1 + lane; j < n; j += 32) {
        const double d = row[j];
        finite = finite && isfinite(d);
        if (d < best) {
            best = d;
            best_index = j;
        }
    }
    warp_first_min(best, best_index);
    const bool all_finite = __all_sync(0xffffffffu, finite);
    if (lane == 0) {
        neighbor[x] = best_index;
        min_dist[x] = best;
        if (!all_finite) atomicOr(status, NONFINITE);
        if (best_index < 0) atomicOr(status, NO_NEIGHBOR);
    }
}

// Z [n - 1, 4] as SciPy's linkage matrix; S [n, n] is overwritten (rows of merged clusters).
// Global scratch, each of n entries (lowered_z and lowered_d: n + WARPS): version, size,
// cluster_id, alive, position, moved, lowered_z, lowered_d. neighbor and min_dist come from
// initial_neighbors. Dynamic shared memory (12 (n - 1) + 12 LOWERED_SHARED bytes): the heap's
// values, the gathered fallen bounds' distances and keys, the heap's keys by position and
// positions by key.
extern "C" __global__ __launch_bounds__(THREADS) void centroid_merges(double* __restrict__ S, int n, double* __restrict__ Z, int* __restrict__ neighbor,
                    double* __restrict__ min_dist, int* __restrict__ version, long long* __restrict__ size,
                    long long* __restrict__ cluster_id, int* __restrict__ alive, int* __restrict__ position,
                    int* __restrict__ moved, int* __restrict__ lowered_z, double* __restrict__ lowered_d,
                    int* __restrict__ status) {
    extern __shared__ double shared[];
    double* values = shared;
    double* gathered_d = values + (n - 1);
    int* gathered_z = (int*)(gathered_d + LOWERED_SHARED);
    heap_index* key_by_index = (heap_index*)(gathered_z + LOWERED_SHARED);
    heap_index* index_by_key = key_by_index + (n - 1);
    __shared__ int s_x, s_y, s_valid, s_failed;
    __shared__ double s_dist;
    __shared__ long long s_nx, s_ny;
    __shared__ double warp_dist[WARPS];
    __shared__ int warp_index[WARPS], warp_lowered[WARPS], lowered_before[WARPS + 1];

    if (*status) return;  // initial_neighbors found a non-finite distance or a row without a candidate
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const long long rows = n;
    const double inf = __longlong_as_double(0x7ff0000000000000LL);

    for (int i = tid; i < n; i += THREADS) {
        version[i] = -1;
        size[i] = 1;
        cluster_id[i] = i;
        alive[i] = i;
        position[i] = i;
    }
    for (int i = tid; i < n - 1; i += THREADS) {
        values[i] = min_dist[i];
        key_by_index[i] = (heap_index)i;
        index_by_key[i] = (heap_index)i;
    }
    if (tid == 0) s_failed = 0;
    __syncthreads();
    int heap_size = n - 1;  // thread 0's
    if (tid == 0)
        for (int i = heap_size / 2 - 1; i >= 0; --i)
            heap_sift_down(values, key_by_index, index_by_key, heap_size, i);
    __syncthreads();

    int count = n;
    for (int k = 0; k < n - 1; ++k) {
        // the heap's minimum, re-searched while its candidate's distance is stale
        for (int attempt = 0; attempt < n - k; ++attempt) {
            if (tid == 0) {
                const int x = key_by_index[0];
                const int y = neighbor[x];
                s_x = x;
                s_y = y;
                s_dist = values[0];
                s_valid = values[0] == distance_of(S, rows, version, x, y);
            }
            __syncthreads();
            if (s_valid) break;
            const int x = s_x;
            // find_min_dist(x): the first minimum over the live clusters above x
            const int low = position[x] + 1;
            const int span = (count - low + WARPS - 1) / WARPS;
            const int first = low + warp * span, last = min(count, first + span);
            const int version_x = version[x];
            const double* row_x = S + (long long)x * rows;
            double best = inf;
            int best_index = -1;
            for (int base = first; base < last; base += 32 * UNROLL) {
                int zs[UNROLL];
                double ds[UNROLL];
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    const int p = base + u * 32 + lane;
                    zs[u] = p < last ? alive[p] : -1;
                }
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    const int z = zs[u];
                    if (z >= 0) ds[u] = version_x >= version[z] ? row_x[z] : S[(long long)z * rows + x];
                }
#pragma unroll
                for (int u = 0; u < UNROLL; ++u)
                    if (zs[u] >= 0 && ds[u] < best) {  // positions rise with u: the first minimum
                        best = ds[u];
                        best_index = zs[u];
                    }
            }
            warp_first_min(best, best_index);
            if (lane == 0) {
                warp_dist[warp] = best;
                warp_index[warp] = best_index;
            }
            __syncthreads();
            if (tid == 0) {
                double dist = inf;
                int y = -1;
                for (int w = 0; w < WARPS; ++w)
                    if (warp_dist[w] < dist) {
                        dist = warp_dist[w];
                        y = warp_index[w];
                    }
                if (y < 0) {
                    s_failed = 1;
                } else {
                    neighbor[x] = y;
                    min_dist[x] = dist;
                    heap_change_value(values, key_by_index, index_by_key, heap_size, x, dist);
                }
                s_y = y;
                s_dist = dist;
            }
            __syncthreads();
            if (s_failed) {
                if (tid == 0) atomicOr(status, NO_NEIGHBOR);
                return;
            }
        }
        // remove_min, the linkage row, the merged cluster in y's place
        if (tid == 0) {
            const int x = s_x, y = s_y;
            heap_swap(values, key_by_index, index_by_key, 0, heap_size - 1);
            heap_size -= 1;
            heap_sift_down(values, key_by_index, index_by_key, heap_size, 0);
            long long id_x = cluster_id[x], id_y = cluster_id[y];
            const long long nx = size[x], ny = size[y];
            if (id_x > id_y) {
                const long long t = id_x;
                id_x = id_y;
                id_y = t;
            }
            Z[4LL * k + 0] = (double)id_x;
            Z[4LL * k + 1] = (double)id_y;
            Z[4LL * k + 2] = s_dist;
            Z[4LL * k + 3] = (double)(nx + ny);
            size[x] = 0;
            size[y] = nx + ny;
            cluster_id[y] = n + k;
            s_nx = nx;
            s_ny = ny;
        }
        __syncthreads();

        // every live z's distance to the merged y (into row y), x's candidates moved to y,
        // the bounds below y that fell listed in order, y's nearest candidate above it
        const int x = s_x, y = s_y;
        const double d_xy = s_dist;
        const long long nx = s_nx, ny = s_ny;
        const int version_x = version[x], version_y = version[y];
        double* row_x = S + (long long)x * rows;
        double* row_y = S + (long long)y * rows;
        const int span = (count + WARPS - 1) / WARPS;
        const int first = warp * span, last = min(count, first + span);
        int* listed_z = lowered_z + warp * span;
        double* listed_d = lowered_d + warp * span;
        int listed_count = 0;
        double best = inf;
        int best_index = -1;
        for (int base = first; base < last; base += 32 * UNROLL) {
            int zs[UNROLL];
            double to_x[UNROLL], to_y[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int p = base + u * 32 + lane;
                zs[u] = p < last ? alive[p] : -1;
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int z = zs[u];
                if (z >= 0 && z != x && z != y) {
                    const int version_z = version[z];
                    to_x[u] = version_x >= version_z ? row_x[z] : S[(long long)z * rows + x];
                    to_y[u] = version_y >= version_z ? row_y[z] : S[(long long)z * rows + y];
                }
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int z = zs[u];
                bool fell = false;
                double d = 0.0;
                if (z >= 0 && z != x && z != y) {
                    d = centroid(to_x[u], to_y[u], d_xy, nx, ny);
                    row_y[z] = d;
                    if (z < y) {
                        if (z < x && neighbor[z] == x) neighbor[z] = y;
                        fell = d < min_dist[z];
                    } else if (d < best) {
                        best = d;
                        best_index = z;
                    }
                }
                const unsigned ballot = __ballot_sync(0xffffffffu, fell);
                if (fell) {
                    const int slot = listed_count + __popc(ballot & ((1u << lane) - 1u));
                    listed_z[slot] = z;
                    listed_d[slot] = d;
                }
                listed_count += __popc(ballot);
            }
        }
        warp_first_min(best, best_index);
        if (lane == 0) {
            warp_dist[warp] = best;
            warp_index[warp] = best_index;
            warp_lowered[warp] = listed_count;
        }
        __syncthreads();
        if (tid == 0) {
            lowered_before[0] = 0;
            for (int w = 0; w < WARPS; ++w) lowered_before[w + 1] = lowered_before[w] + warp_lowered[w];
        }
        __syncthreads();
        // the fallen bounds, in index order, gathered into shared memory; each z's candidate
        // and bound set by the thread that moves it (distinct z: any order)
        const int fallen = lowered_before[WARPS];
        for (int i = tid; i < fallen; i += THREADS) {
            int w = 0;
            while (lowered_before[w + 1] <= i) ++w;
            const int at = w * span + (i - lowered_before[w]);
            const int z = lowered_z[at];
            const double d = lowered_d[at];
            neighbor[z] = y;
            min_dist[z] = d;
            if (i < LOWERED_SHARED) {
                gathered_z[i] = z;
                gathered_d[i] = d;
            }
        }
        __syncthreads();

        // thread 0: the heap in SciPy's order, the fallen bounds first, then y's candidate
        if (tid == 0) {
            version[y] = k;
            for (int i = 0; i < fallen; ++i) {
                int z;
                double d;
                if (i < LOWERED_SHARED) {
                    z = gathered_z[i];
                    d = gathered_d[i];
                } else {
                    int w = 0;
                    while (lowered_before[w + 1] <= i) ++w;
                    const int at = w * span + (i - lowered_before[w]);
                    z = lowered_z[at];
                    d = lowered_d[at];
                }
                heap_change_value(values, key_by_index, index_by_key, heap_size, z, d);
            }
            if (y < n - 1) {
                double dist = inf;
                int nearest = -1;
                for (int w = 0; w < WARPS; ++w)
                    if (warp_dist[w] < dist) {
                        dist = warp_dist[w];
                        nearest = warp_index[w];
                    }
                if (nearest < 0) {
                    s_failed = 1;
                } else {
                    neighbor[y] = nearest;
                    min_dist[y] = dist;
                    heap_change_value(values, key_by_index, index_by_key, heap_size, y, dist);
                }
            }
        }
        // x leaves the live list (x < y: a heap key's candidate has a higher index)
        const int from = position[x];
        for (int p = from + tid; p < count - 1; p += THREADS) moved[p] = alive[p + 1];
        __syncthreads();
        if (s_failed) {
            if (tid == 0) atomicOr(status, NO_NEIGHBOR);
            return;
        }
        for (int p = from + tid; p < count - 1; p += THREADS) {
            const int z = moved[p];
            alive[p] = z;
            position[z] = p;
        }
        count -= 1;
        __syncthreads();
    }
}
