"""One wgmma on the GPU, against NumPy: which descriptor fields, start addresses and
accumulator layout kernels/conv_wgmma.cu may use (H200 only; prints JSON lines).

conv_wgmma.cu keeps both operands K-major without swizzle, in 8-row x 16-byte core
matrices, and tells wgmma where they are by a descriptor's LBO (its reading: between core
matrices along K) and SBO (along M or N); it reads the accumulators back by the layout its
comment gives (thread t: rows 16 * (t / 32) + (t % 32) / 4 and + 8, columns 8j + 2 * (t % 4)
and + 1). Both readings were written from documentation without a GPU. This probe runs one
m64n32k16 MMA on random halves with the operands stored the same way, once with LBO and SBO
as conv_wgmma.cu sets them and once swapped, and compares every accumulator with A @ B^T:
the line with "matches": true names the reading that holds. conv_wgmma.cu also starts a
tap's A operand one pixel (16 bytes) into its plane, off the 128-byte core-matrix grid, so
the probe stores A shifted by 0, 1 and 3 rows and starts the descriptor there. Run with
`python scripts/probe_wgmma.py` where the package's GPU dependencies are installed.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np

from speakerd.engine.gpu import kernels

#: The probe: A 64 x 16 and B 32 x 16 (rows x k) halves from global memory into shared
#: memory as conv_wgmma.cu lays them out (k group g = k / 8 at g * A_ROWS * 16 bytes, row r
#: at (r + shift) * 16 bytes; B likewise with 32 rows, unshifted), then one wgmma with the
#: given descriptor fields, A's starting `shift` rows in; every thread writes its 16
#: accumulators in order.
A_ROWS = 72
SOURCE = r"""
__device__ __forceinline__ unsigned long long descriptor(const void* smem, unsigned lbo, unsigned sbo) {
    const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    return static_cast<unsigned long long>((address >> 4) & 0x3FFFu) |
           static_cast<unsigned long long>((lbo >> 4) & 0x3FFFu) << 16 |
           static_cast<unsigned long long>((sbo >> 4) & 0x3FFFu) << 32;
}

extern "C" __global__ void __launch_bounds__(128)
probe(const unsigned short* a, const unsigned short* b, float* d, unsigned a_lbo, unsigned a_sbo,
      unsigned b_lbo, unsigned b_sbo, int shift) {
    __shared__ __align__(128) unsigned short a_s[2 * 72 * 8];  // 2 k groups of A_ROWS rows
    __shared__ __align__(128) unsigned short b_s[32 * 16];
    const int t = threadIdx.x;
    for (int i = t; i < 2 * 72 * 8; i += 128) a_s[i] = 0;
    __syncthreads();
    for (int i = t; i < 64 * 16; i += 128) {
        const int row = i / 16, k = i % 16;
        a_s[(k / 8) * 72 * 8 + (row + shift) * 8 + k % 8] = a[i];
    }
    for (int i = t; i < 32 * 16; i += 128) {
        const int row = i / 16, k = i % 16;
        b_s[(k / 8) * 32 * 8 + row * 8 + k % 8] = b[i];
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    float c[16];
    for (int i = 0; i < 16; ++i) c[i] = 0.0f;
    const unsigned long long da = descriptor(a_s + shift * 8, a_lbo, a_sbo);
    const unsigned long long db = descriptor(b_s, b_lbo, b_sbo);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
        "%16, %17, p, 1, 1, 0, 0;\n}\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]), "+f"(c[4]), "+f"(c[5]), "+f"(c[6]), "+f"(c[7]),
          "+f"(c[8]), "+f"(c[9]), "+f"(c[10]), "+f"(c[11]), "+f"(c[12]), "+f"(c[13]), "+f"(c[14]), "+f"(c[15])
        : "l"(da), "l"(db), "r"(1));
    asm volatile("wgmma.commit_group.sync.aligned;\nwgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    for (int i = 0; i < 16; ++i) d[t * 16 + i] = c[i];
}
"""


def expected_layout(product: np.ndarray) -> np.ndarray:
    """[128 threads, 16] accumulators of `product` (64 x 32) by conv_wgmma.cu's reading."""
    out = np.empty((128, 16), dtype=np.float64)
    for t in range(128):
        warp, group, quad = t // 32, (t % 32) // 4, t % 4
        for i in range(16):
            j, e = i // 4, i % 4
            out[t, i] = product[16 * warp + group + 8 * (e // 2), 8 * j + 2 * quad + e % 2]
    return out


def main() -> None:
    import cupy

    random = np.random.default_rng(3)
    a = random.standard_normal((64, 16)).astype(np.float16)
    b = random.standard_normal((32, 16)).astype(np.float16)
    product = a.astype(np.float64) @ b.astype(np.float64).T
    expected = expected_layout(product)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "probe.cubin"
        path.write_bytes(kernels.compile_binary(SOURCE, "90a", "probe_wgmma.cu"))
        probe = cupy.RawModule(path=str(path)).get_function("probe")
        a_d, b_d = cupy.asarray(a.view(np.uint16)), cupy.asarray(b.view(np.uint16))
        d = cupy.empty((128, 16), dtype=cupy.float32)
        # conv_wgmma.cu's reading: LBO = the k-group plane (rows * 16 bytes), SBO = 8 rows (128)
        for name, a_fields, b_fields, shift in (
            ("lbo=k-groups sbo=8-rows (conv_wgmma.cu)", (A_ROWS * 16, 128), (32 * 16, 128), 0),
            ("lbo=8-rows sbo=k-groups (swapped)", (128, A_ROWS * 16), (128, 32 * 16), 0),
            ("conv_wgmma.cu's fields, A 1 row (16 bytes) in", (A_ROWS * 16, 128), (32 * 16, 128), 1),
            ("conv_wgmma.cu's fields, A 3 rows (48 bytes) in", (A_ROWS * 16, 128), (32 * 16, 128), 3),
        ):
            d.fill(float("nan"))
            fields = (np.uint32(v) for v in (*a_fields, *b_fields))
            probe((1,), (128,), (a_d, b_d, d, *fields, np.int32(shift)))
            got = d.get().astype(np.float64)
            error = np.abs(got - expected).max() / np.abs(product).max()
            as_set = bool(np.allclose(np.sort(got.ravel()), np.sort(product.ravel()), rtol=1e-3, atol=1e-3))
            print(json.dumps({
                "descriptor": name, "matches": bool(error < 1e-3), "max_error": float(error),
                "same_values_other_layout": as_set and not error < 1e-3,
                "thread0": [round(float(v), 4) for v in got[0, :8]],
                "expected0": [round(float(v), 4) for v in expected[0, :8]],
            }))  # fmt: skip


if __name__ == "__main__":
    main()
