"""numpy arrays handed to TensorFlow without a copy: buffers aligned as its CPU kernels require,
and the tensor of such an array by DLPack (a parameter server's received gradients, the Keras
optimizer's inputs)."""
from __future__ import annotations

import numpy as np

# the alignment TensorFlow's CPU kernels require of a tensor's buffer (Eigen's largest packet)
TF_ALIGN = 64


def spec(shape: tuple, dtype):
    import tensorflow as tf

    return tf.TensorSpec(shape, tf.as_dtype(dtype))


def aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts on a ``TF_ALIGN`` boundary: what
    TensorFlow can use without a copy (``tensor``)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + TF_ALIGN, np.uint8)
    start = -raw.ctypes.data % TF_ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def aligned_copy(array, dtype=None) -> np.ndarray:
    """A writable copy of ``array`` (cast to ``dtype`` if given) in an ``aligned_empty`` array."""
    array = np.asarray(array)
    out = aligned_empty(array.shape, array.dtype if dtype is None else dtype)
    np.copyto(out, array, casting="unsafe")
    return out


def tensor(array, dtype):
    """``array`` as a TensorFlow tensor of ``dtype``: the same memory when it is writable,
    contiguous, of that dtype and ``TF_ALIGN``-aligned (DLPack: no copy; TensorFlow aborts the
    process on a misaligned buffer, so nothing else goes that way), else one aligned copy."""
    import tensorflow as tf

    array = np.asarray(array)
    dtype = np.dtype(getattr(dtype, "as_numpy_dtype", dtype))
    if not (array.dtype == dtype and array.flags.c_contiguous and array.flags.writeable
            and array.ctypes.data % TF_ALIGN == 0):
        array = aligned_copy(array, dtype)
    return tf.experimental.dlpack.from_dlpack(array.__dlpack__())


def joined(arrays: list, dtype) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, sizes)``: ``arrays`` (of one row shape) one after the other in one ``aligned_empty``
    array of ``dtype``, and each one's row count (int64): many tables' rows as one tensor (a
    conversion costs a few microseconds, and a step may carry dozens of tables), split again in
    the graph (``tf.split(rows, sizes, num=len(arrays))``)."""
    sizes = np.array([len(a) for a in arrays], np.int64)
    first = np.asarray(arrays[0])
    out = aligned_empty((int(sizes.sum()),) + first.shape[1:], dtype)
    at = 0
    for a, n in zip(arrays, sizes):
        out[at:at + n] = a
        at += n
    return out, sizes


def row_groups(shapes: list, dtypes: list) -> list[list[int]]:
    """Positions of the ``shapes`` (and ``dtypes``) that share a row shape and a dtype, grouped in
    order of first appearance: the tables ``joined`` passes as one array."""
    groups: dict = {}
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        groups.setdefault((tuple(shape[1:]), np.dtype(getattr(dtype, "as_numpy_dtype", dtype))), []).append(i)
    return list(groups.values())
