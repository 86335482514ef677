"""kernels/compare.cu counts the words of two device arrays whose bits differ
(engine/gpu/bitwise.py, what every replay check of a cuDNN plan and a captured forward asks).

The count must equal NumPy's on the same bits for each word width, for sizes around the
warp and the grid-stride loop, with NaNs of equal bits counted equal and a sign flip of zero
counted different. Needs a GPU (REQUIRE_GPU=1 makes a skip a failure).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_gpu_engine import GPU_DETAIL, GPU_USABLE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not GPU_USABLE, reason=f"no usable GPU for the CuPy engine: {GPU_DETAIL}"),
]

#: Sizes: none, one, a warp and one, several blocks, more than the grid covers in one pass.
SIZES = (0, 1, 33, 257 * 3, 256 * 1024 * 5 + 7)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("size", SIZES)
def test_the_count_is_numpys(dtype, size) -> None:
    import cupy

    from speakerd.engine.gpu.bitwise import differing

    random = np.random.default_rng(size)
    a = random.standard_normal(size).astype(dtype)
    b = a.copy()
    changed = random.choice(size, size=min(size, 1 + size // 100), replace=False) if size else []
    b[changed] += dtype(1)
    if size > 2:
        a[-1] = b[-1] = np.nan  # the same NaN bits: equal
        a[0], b[0] = dtype(0.0), dtype(-0.0)  # equal values, other bits: different
    width = {2: np.uint16, 4: np.uint32, 8: np.uint64}[np.dtype(dtype).itemsize]
    expected = int(np.count_nonzero(a.view(width) != b.view(width)))
    stream = cupy.cuda.Stream(non_blocking=True)
    counted = differing(cupy.asarray(a), cupy.asarray(b), stream)
    assert counted == expected, f"{np.dtype(dtype).name} x {size}: counted {counted}, NumPy {expected}"
