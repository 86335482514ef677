"""Our elementwise epilogue kernels (kernels/speakerd.cu `bias_only`, `bias_relu`,
`bias_add_relu` and their `_f16` forms), bound once to their buffers.

They follow a bare cuDNN convolution (where the math allows no fused cuDNN graph, or the
fused one was slower) and the final linear (its bias). Bound at plan build time, so the
forward path only launches: nothing is computed or allocated per batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

#: Epilogues a convolution of the trunk needs: stem and conv1 "bias_relu", conv2
#: "bias_add_relu" (residual), shortcut "bias_only".
EPILOGUES = ("bias_only", "bias_relu", "bias_add_relu")
#: Threads per block of the elementwise epilogue; blocks are capped at this many per SM
#: (grid-stride loop), enough to keep HBM busy on an H200's 132 SMs.
THREADS = 256
BLOCKS_PER_SM = 8
#: Elements one thread step handles: 16 bytes, i.e. 8 halves or 4 floats; every trunk
#: channel count (32..256) and the embedding (256) is a multiple of both.
VECTOR_BYTES = 16


@dataclass(frozen=True)
class Epilogue:
    """y[:elements] = act(y + bias[c] (+ residual)) in place, NHWC with the channels fastest;
    `kind` is one of EPILOGUES, `kernel` the entry point launched (half `y`: the _f16 form,
    which raises the plan's range flag)."""

    kind: str
    kernel: str
    blocks: int
    args: tuple

    @classmethod
    def bind(
        cls, kind: str, y, bias, residual, channels: int, elements: int, flag, sm_count: int
    ) -> Epilogue:
        """Bound to `y` (the conv's output buffer, a view of the widest size: `elements` is
        the conv's own output size), `bias` [channels] float32 and, for bias_add_relu,
        `residual`; `flag` is the plan's range flag, given exactly when `y` holds halves."""
        assert kind in EPILOGUES, f"epilogue {kind!r}, expected one of {EPILOGUES}"
        assert (residual is not None) == (kind == "bias_add_relu"), (kind, residual is None)
        assert elements <= y.size and (residual is None or elements <= residual.size), (elements, y.size)
        half = y.dtype.itemsize == 2
        assert (flag is not None) == half, "half epilogues, and only they, take the range flag"
        width = VECTOR_BYTES // y.dtype.itemsize
        assert channels % width == 0, f"{channels} channels are not a multiple of {width}"
        vectors = elements // width
        blocks = min(-(-vectors // THREADS), sm_count * BLOCKS_PER_SM)
        args = [y, bias] + ([residual] if residual is not None else [])
        args += [np.int64(vectors), np.int32(channels // width)] + ([flag] if half else [])
        return cls(kind, f"{kind}_f16" if half else kind, blocks, tuple(args))

    def launch(self, kernels: Mapping[str, object], stream) -> None:
        """Enqueue on `stream`; `kernels` is the engine's kernel table."""
        kernels[self.kernel]((self.blocks,), (THREADS,), self.args, stream=stream)
