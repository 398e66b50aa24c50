"""A tensor saved by ``torch.save`` (the ``.pt`` files of an msprobe dump), read without torch and
without unpickling arbitrary objects.

The file is a zip: ``<name>/data.pkl`` is a pickle that rebuilds the tensor from storages held
as ``<name>/data/<key>`` (raw little-endian bytes). No unpickler reads it: ``_load`` runs the
few opcodes such a pickle uses (tuples, ints, strings, a persistent storage id, one call) and
knows only the names it calls (``torch._utils._rebuild_tensor_v2``, the typed storage classes,
an empty ``OrderedDict``); anything else is refused, so a file cannot run code. bfloat16 is read as
its 16 bits and widened to float32 exactly.
"""

from __future__ import annotations

import struct
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


MAX_EXPANSION = 64  # elements of a tensor per element of its storage, at most


class _Storage:
    def __init__(self, kind: str):
        self.kind = kind


class _Rebuild:
    """A tensor to be: (storage id, offset, shape, stride)."""

    def __init__(self, storage, offset, shape, stride, *_):
        self.storage, self.offset, self.shape, self.stride = storage, offset, shape, stride


def _rebuild_tensor_v2(storage, offset, shape, stride, *rest):
    return _Rebuild(storage, offset, tuple(shape), tuple(stride))


class RefusedPickle(ValueError):
    """The pickle asks for something a saved tensor never holds."""


def _load(data: bytes, read_storage):
    """Run the pickle opcodes a saved tensor uses, and no others: no pickle module, no global
    but ``ALLOWED``, nothing called but the tensor rebuild and an empty OrderedDict."""
    stack: list = []
    marks: list[int] = []
    memo: dict[int, object] = {}
    at = 0

    def take(n: int) -> bytes:
        nonlocal at
        if at + n > len(data):
            raise RefusedPickle("truncated")
        chunk, at = data[at:at + n], at + n
        return chunk

    def line() -> str:
        nonlocal at
        end = data.find(b"\n", at)
        if end < 0:
            raise RefusedPickle("truncated")
        text, at = data[at:end].decode("ascii"), end + 1
        return text

    def pop_mark() -> list:
        start = marks.pop()
        items = stack[start:]
        del stack[start:]
        return items

    while True:
        op = take(1)
        if op == b"\x80":  # PROTO
            take(1)
        elif op == b"\x95":  # FRAME
            take(8)
        elif op == b"c":  # GLOBAL
            stack.append(_global(line(), line()))
        elif op == b"\x93":  # STACK_GLOBAL
            name = stack.pop()
            stack.append(_global(stack.pop(), name))
        elif op in (b"q", b"r", b"\x94"):  # BINPUT, LONG_BINPUT, MEMOIZE
            key = (take(1)[0] if op == b"q" else int.from_bytes(take(4), "little")
                   if op == b"r" else len(memo))
            memo[key] = stack[-1]
        elif op in (b"h", b"j"):  # BINGET, LONG_BINGET
            key = take(1)[0] if op == b"h" else int.from_bytes(take(4), "little")
            stack.append(memo[key])
        elif op == b"(":
            marks.append(len(stack))
        elif op in (b"X", b"\x8c"):  # BINUNICODE, SHORT_BINUNICODE
            n = int.from_bytes(take(4 if op == b"X" else 1), "little")
            stack.append(take(n).decode("utf-8"))
        elif op in (b"K", b"M", b"J"):
            size = {b"K": 1, b"M": 2, b"J": 4}[op]
            stack.append(int.from_bytes(take(size), "little", signed=op == b"J"))
        elif op == b"\x8a":  # LONG1
            stack.append(int.from_bytes(take(take(1)[0]), "little", signed=True))
        elif op == b"G":  # BINFLOAT
            stack.append(float(np.frombuffer(take(8), dtype=">f8")[0]))
        elif op == b"t":
            stack.append(tuple(pop_mark()))
        elif op == b")":
            stack.append(())
        elif op in (b"\x85", b"\x86", b"\x87"):  # TUPLE1..3
            n = op[0] - 0x84
            items = tuple(stack[-n:])
            del stack[-n:]
            stack.append(items)
        elif op in (b"\x88", b"\x89", b"N"):
            stack.append({b"\x88": True, b"\x89": False, b"N": None}[op])
        elif op == b"}":
            stack.append({})
        elif op == b"]":
            stack.append([])
        elif op == b"Q":  # BINPERSID
            stack.append(read_storage(stack.pop()))
        elif op == b"R":  # REDUCE
            args = stack.pop()
            stack.append(stack.pop()(*args))
        elif op == b".":
            return stack.pop()
        else:
            raise RefusedPickle(f"refused: pickle opcode {op!r} is not part of a saved tensor")


def _global(module: str, name: str):
    if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
        return _rebuild_tensor_v2
    if (module, name) == ("collections", "OrderedDict"):
        return lambda *args: OrderedDict()
    if module == "torch" and name in STORAGE_DTYPES:
        return _Storage(name)
    raise RefusedPickle(f"refused: {module}.{name} is not part of a saved tensor")


def _storage_of(pid, read_storage):
    if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
        raise RefusedPickle("refused: an unknown persistent object")
    kind = pid[1].kind if isinstance(pid[1], _Storage) else str(pid[1])
    return read_storage(str(pid[2]), kind, int(pid[4]))


def _stored_members(data: bytes) -> dict[str, memoryview] | None:
    """name -> contents of each member of a zip whose members are all stored uncompressed
    (as torch.save writes them), read from its central directory in place: the zipfile module
    costs more than the read for the small files of an msprobe dump. None for a zip this does
    not handle (compressed members, zip64); ValueError for what is not a zip."""
    end = data.rfind(b"PK\x05\x06", max(0, len(data) - 65557))
    if end < 0:
        raise ValueError("not a zip file (no end of central directory)")
    count, size, offset = struct.unpack_from("<HII", data, end + 10)
    if offset == 0xFFFFFFFF or count == 0xFFFF:
        return None
    view, members, at = memoryview(data), {}, offset
    for _ in range(count):
        if data[at:at + 4] != b"PK\x01\x02":
            raise ValueError("damaged central directory")
        method, = struct.unpack_from("<H", data, at + 10)
        csize, usize, name_len, extra_len, comment_len = struct.unpack_from("<IIHHH", data,
                                                                            at + 20)
        local, = struct.unpack_from("<I", data, at + 42)
        if method != 0 or csize != usize or 0xFFFFFFFF in (csize, local):
            return None
        name = data[at + 46:at + 46 + name_len].decode("utf-8")
        if data[local:local + 4] != b"PK\x03\x04":
            raise ValueError(f"damaged local header of {name}")
        skip_name, skip_extra = struct.unpack_from("<HH", data, local + 26)
        start = local + 30 + skip_name + skip_extra
        if start + csize > len(data):
            raise ValueError(f"{name} runs past the end of the file")
        members[name] = view[start:start + csize]
        at += 46 + name_len + extra_len + comment_len
    return members


def read_tensor(path: str, bfloat16_bits: bool = False) -> np.ndarray:
    """The array saved in ``path`` (float32 for bfloat16, or its 16 bits as uint16 with
    ``bfloat16_bits``). UserError for a file that is not a saved tensor, is damaged, or asks
    for anything but a tensor."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
        members = _stored_members(data)
        if members is None:  # compressed or zip64: the zipfile module reads it
            with zipfile.ZipFile(path) as archive:
                members = {n: archive.read(n) for n in archive.namelist()}
        pkl = next((n for n in members if n.endswith("/data.pkl")), None)
        if pkl is None:
            raise UserError(f"{path}: not a tensor saved by torch.save (no data.pkl)")
        prefix = pkl[: -len("data.pkl")]

        def read_storage(key: str, kind: str, numel: int) -> np.ndarray:
            dtype = STORAGE_DTYPES.get(kind)
            if dtype is None:
                raise UserError(f"{path}: a storage of type {kind} is not supported")
            raw = members[f"{prefix}data/{key}"]
            if dtype == "bfloat16":
                bits = np.frombuffer(raw, dtype="<u2", count=numel)
                return bits if bfloat16_bits else (bits.astype(np.uint32) << 16).view(
                    np.float32)
            return np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<"), count=numel)

        found = _load(bytes(members[pkl]), lambda pid: _storage_of(pid, read_storage))
    except UserError:
        raise
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except (zipfile.BadZipFile, KeyError, ValueError, EOFError, OSError, IndexError,
            TypeError, struct.error) as exc:
        raise UserError(f"{path}: cannot read it as a saved tensor ({exc})") from None
    if not isinstance(found, _Rebuild) or not isinstance(found.storage, np.ndarray):
        raise UserError(f"{path}: holds no single tensor")
    return _view(path, found)


def _view(path: str, found: _Rebuild) -> np.ndarray:
    """The tensor's elements, after checking that its shape and strides stay inside its
    storage and make no more elements than MAX_EXPANSION times the storage holds (a stride
    of 0 repeats one element: a crafted file must not allocate gigabytes)."""
    flat = found.storage
    numbers = (*found.shape, *found.stride, found.offset)
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in numbers) \
            or any(n < 0 for n in numbers) or len(found.shape) != len(found.stride):
        raise UserError(f"{path}: its shape does not fit its storage")
    count = int(np.prod(found.shape, dtype=np.float64))
    if count > MAX_EXPANSION * max(flat.size, 1):
        raise UserError(f"{path}: its shape makes {count} elements of a storage of "
                        f"{flat.size}")
    if count:
        last = found.offset + sum((n - 1) * st for n, st in zip(found.shape, found.stride))
        if last >= flat.size:
            raise UserError(f"{path}: its shape does not fit its storage")
    view = np.lib.stride_tricks.as_strided(
        flat[found.offset:], shape=found.shape,
        strides=tuple(st * flat.dtype.itemsize for st in found.stride), writeable=False)
    # a contiguous tensor is returned as it lies in the file's bytes (read-only), not copied
    return view if view.flags.c_contiguous else np.array(view)
