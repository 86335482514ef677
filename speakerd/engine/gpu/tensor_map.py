"""Tensor maps for Hopper's tensor memory accelerator (TMA): the description of a tensor in
global memory and of the box one copy moves, which kernels/conv_wgmma.cu reads to load each
output tile's halo with one instruction per channel group.

Why a tensor map: conv_wgmma.cu's halo copy by cp.async cost each of a block's 128 threads
12 to 21 copies per tile, each with its own index arithmetic and bounds check; on the H100
a build that left the copy out ran layer1's residual convolution in half the time
(scripts/time_wgmma_variants.py). With a map one thread asks for the box, and the TMA
zero-fills what lies outside the image.

The map is encoded by the CUDA driver (cuTensorMapEncodeTiled, called through ctypes: CuPy
does not wrap it) and copied to device memory, where the kernel takes its address: it names
the input buffer's address, so it is made once per bound convolution and stays valid for the
buffer's life (a plan's buffers live as long as the plan; CUDA graphs replay it as is).
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

#: sizeof(CUtensorMap) in cuda.h: 16 opaque 64-bit words, 64-byte aligned (device
#: allocations are 256-byte aligned)
TENSOR_MAP_BYTES = 128
#: cuda.h's CU_TENSOR_MAP_DATA_TYPE_FLOAT16
DATA_TYPE_FLOAT16 = 6
#: CU_TENSOR_MAP_INTERLEAVE_NONE and CU_TENSOR_MAP_SWIZZLE_NONE: conv_wgmma.cu's halo layout
#: has no swizzle (a tap's shift by one pixel must stay a 16-byte start address)
INTERLEAVE_NONE = 0
SWIZZLE_NONE = 0
#: CU_TENSOR_MAP_L2_PROMOTION_L2_128B: a box row of one channel group is 16 bytes per pixel
#: strided by the pixel's CIN * 2 bytes, so whole 128-byte lines are fetched into L2 once
#: for all the groups' boxes of a tile
L2_PROMOTION_128B = 2
#: CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: elements outside the tensor read as zeros, the
#: convolution's padding
OOB_FILL_ZEROS = 0
#: a box's extent along any dimension (cuTensorMapEncodeTiled's limit)
BOX_MAX = 256
#: elements per box along the innermost dimension: one channel group, 16 bytes of halves
GROUP_CHANNELS = 8


@functools.cache
def _encode_tiled():  # -> the driver's cuTensorMapEncodeTiled
    library = ctypes.CDLL("libcuda.so.1")
    encode = library.cuTensorMapEncodeTiled
    uint64_p, uint32_p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
    encode.restype = ctypes.c_int
    enum = ctypes.c_int
    encode.argtypes = [ctypes.c_void_p, enum, ctypes.c_uint32, ctypes.c_void_p, uint64_p, uint64_p, uint32_p,
                       uint32_p, enum, enum, enum, enum]  # fmt: skip
    return encode


def nhwc_box_map_bytes(pointer: int, shape: tuple[int, int, int, int], box: tuple[int, int]) -> bytes:
    """The CUtensorMap of the FP16 NHWC tensor at device address `pointer` of `shape` (n,
    h, w, c), read in boxes of (rows, cols) = `box` pixels of one image x GROUP_CHANNELS
    channels (coordinates: channel, column, row, image; innermost first)."""
    n, h, w, c = shape
    rows, cols = box
    assert pointer % 16 == 0, f"a tensor map's tensor must be 16-byte aligned, not at {pointer:#x}"
    assert c % GROUP_CHANNELS == 0, f"{c} channels are no whole number of {GROUP_CHANNELS}-channel groups"
    assert 0 < rows <= BOX_MAX and 0 < cols <= BOX_MAX, f"box {box} exceeds the TMA's {BOX_MAX} per dimension"
    dims = (ctypes.c_uint64 * 4)(c, w, h, n)
    strides = (ctypes.c_uint64 * 3)(c * 2, w * c * 2, h * w * c * 2)  # bytes, of dimensions 1..3
    box_dims = (ctypes.c_uint32 * 4)(GROUP_CHANNELS, cols, rows, 1)
    element_strides = (ctypes.c_uint32 * 4)(1, 1, 1, 1)
    holder = (ctypes.c_uint64 * (TENSOR_MAP_BYTES // 8 + 8))()  # room to place the map 64-byte aligned
    address = (ctypes.addressof(holder) + 63) // 64 * 64
    status = _encode_tiled()(address, DATA_TYPE_FLOAT16, 4, pointer, dims, strides, box_dims, element_strides,
                             INTERLEAVE_NONE, SWIZZLE_NONE, L2_PROMOTION_128B, OOB_FILL_ZEROS)  # fmt: skip
    if status != 0:
        raise RuntimeError(
            f"cuTensorMapEncodeTiled refused the FP16 NHWC tensor {shape} at {pointer:#x} with box "
            f"{(GROUP_CHANNELS, cols, rows, 1)}: CUresult {status}"
        )
    return ctypes.string_at(address, TENSOR_MAP_BYTES)


def nhwc_box_map(x, shape: tuple[int, int, int, int], box: tuple[int, int]):  # -> cupy.ndarray
    """nhwc_box_map_bytes of CuPy array `x` (FP16, `shape` n, h, w, c), in device memory:
    the 128 bytes whose address conv_wgmma.cu's entry points take as `halo_map`."""
    import cupy

    assert x.itemsize == 2 and x.size == int(np.prod(shape)), (x.dtype, x.size, shape)
    encoded = nhwc_box_map_bytes(int(x.data.ptr), shape, box)
    return cupy.asarray(np.frombuffer(encoded, dtype=np.uint8))
