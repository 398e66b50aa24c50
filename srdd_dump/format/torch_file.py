"""A tensor saved by ``torch.save`` (the ``.pt`` files of an msprobe dump), read without torch and
without unpickling arbitrary objects.

The file is a zip: ``<name>/data.pkl`` is a pickle that rebuilds the tensor from storages held
as ``<name>/data/<key>`` (raw little-endian bytes). The unpickler here knows only the names such
a pickle uses (``torch._utils._rebuild_tensor_v2``, the typed storage classes, an empty
``OrderedDict``) and refuses any other global, so a file cannot run code. bfloat16 is read as
its 16 bits and widened to float32 exactly.
"""

from __future__ import annotations

import pickle
import zipfile
from collections import OrderedDict

import numpy as np

from ..errors import UserError

# torch's typed storage class names (and dtype names of torch >= 2's untyped form) -> numpy
STORAGE_DTYPES = {
    "FloatStorage": np.float32, "float32": np.float32,
    "DoubleStorage": np.float64, "float64": np.float64,
    "HalfStorage": np.float16, "float16": np.float16,
    "BFloat16Storage": "bfloat16", "bfloat16": "bfloat16",
    "LongStorage": np.int64, "int64": np.int64,
    "IntStorage": np.int32, "int32": np.int32,
    "ShortStorage": np.int16, "int16": np.int16,
    "CharStorage": np.int8, "int8": np.int8,
    "ByteStorage": np.uint8, "uint8": np.uint8,
    "BoolStorage": np.bool_, "bool": np.bool_,
}


class _Storage:
    def __init__(self, kind: str):
        self.kind = kind


class _Rebuild:
    """A tensor to be: (storage id, offset, shape, stride)."""

    def __init__(self, storage, offset, shape, stride, *_):
        self.storage, self.offset, self.shape, self.stride = storage, offset, shape, stride


def _rebuild_tensor_v2(storage, offset, shape, stride, *rest):
    return _Rebuild(storage, offset, tuple(shape), tuple(stride))


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, read_storage):
        import io

        super().__init__(io.BytesIO(data))
        self._read_storage = read_storage

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor_v2
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name in STORAGE_DTYPES:
            return _Storage(name)
        raise pickle.UnpicklingError(f"refused: {module}.{name} is not part of a saved tensor")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError("refused: an unknown persistent object")
        kind = pid[1].kind if isinstance(pid[1], _Storage) else str(pid[1])
        return self._read_storage(str(pid[2]), kind, int(pid[4]))


def read_tensor(path: str) -> np.ndarray:
    """The array saved in ``path`` (float32 for bfloat16). UserError for a file that is not a
    saved tensor, is damaged, or asks for anything but a tensor."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            pkl = next((n for n in names if n.endswith("/data.pkl")), None)
            if pkl is None:
                raise UserError(f"{path}: not a tensor saved by torch.save (no data.pkl)")
            prefix = pkl[: -len("data.pkl")]

            def read_storage(key: str, kind: str, numel: int) -> np.ndarray:
                dtype = STORAGE_DTYPES.get(kind)
                if dtype is None:
                    raise UserError(f"{path}: a storage of type {kind} is not supported")
                raw = archive.read(f"{prefix}data/{key}")
                if dtype == "bfloat16":
                    bits = np.frombuffer(raw, dtype="<u2", count=numel).astype(np.uint32)
                    return (bits << 16).view(np.float32)
                return np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<"), count=numel)

            found = _Unpickler(archive.read(pkl), read_storage).load()
    except UserError:
        raise
    except (zipfile.BadZipFile, pickle.UnpicklingError, KeyError, ValueError, EOFError,
            OSError) as exc:
        raise UserError(f"{path}: cannot read it as a saved tensor ({exc})") from None
    if not isinstance(found, _Rebuild):
        raise UserError(f"{path}: holds no single tensor")
    flat = found.storage
    if any(n < 0 for n in found.shape) or any(st < 0 for st in found.stride) \
            or len(found.shape) != len(found.stride):
        raise UserError(f"{path}: its shape does not fit its storage")
    if 0 not in found.shape:
        last = found.offset + sum((n - 1) * st for n, st in zip(found.shape, found.stride))
        if found.offset < 0 or last >= flat.size:
            raise UserError(f"{path}: its shape does not fit its storage")
    view = np.lib.stride_tricks.as_strided(
        flat[found.offset:], shape=found.shape,
        strides=tuple(st * flat.dtype.itemsize for st in found.stride), writeable=False)
    return np.array(view)
