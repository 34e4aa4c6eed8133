"""Minimal .safetensors reader/writer for the ds4 reference (F32, F64, BF16, I32, I64).

Layout: 8-byte little-endian header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__"?: {...}}, then the data
block; offsets are relative to the start of the data block. Tensors are stored row-major, little-endian.
"""
import json
import os
import struct

import numpy as np
import torch

# safetensors dtype name -> (numpy dtype of the stored bytes, bytes per element)
_STORED = {
    "F32": (np.dtype("<f4"), 4),
    "F64": (np.dtype("<f8"), 8),
    "BF16": (np.dtype("<u2"), 2),
    "I32": (np.dtype("<i4"), 4),
    "I64": (np.dtype("<i8"), 8),
}


def _bf16_bits_to_f32(bits):
    """bf16 is the top half of an f32: shift the 16 bits up."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16_bits(x):
    """Round-to-nearest-even f32 -> bf16 bits (NaN stays NaN)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16
    nan = np.isnan(x)
    rounded = np.where(nan, (u >> 16) | np.uint32(0x40), rounded)
    return rounded.astype(np.uint16)


def read_header(path):
    """Returns (header dict without __metadata__, byte offset of the data block)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: file too short for a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        size = os.path.getsize(path)
        if n > size - 8:
            raise ValueError(f"{path}: header length {n} exceeds file size {size}")
        header = json.loads(f.read(n).decode("utf-8"))
    header.pop("__metadata__", None)
    return header, 8 + n


def load(path, names=None):
    """Reads tensors (all, or only `names`) as torch tensors: floats become float32 (BF16 widened),
    I32 -> int32, I64 -> int64. Raises ValueError naming the file and tensor on bad input."""
    header, base = read_header(path)
    size = os.path.getsize(path)
    out = {}
    with open(path, "rb") as f:
        for name, info in header.items():
            if names is not None and name not in names:
                continue
            dt = info.get("dtype")
            if dt not in _STORED:
                raise ValueError(f"{path}: tensor '{name}' has dtype {dt}; expected one of {sorted(_STORED)}")
            npdt, width = _STORED[dt]
            shape = [int(s) for s in info["shape"]]
            begin, end = (int(v) for v in info["data_offsets"])
            count = int(np.prod(shape)) if shape else 1
            if end - begin != count * width or base + end > size:
                raise ValueError(f"{path}: tensor '{name}' data_offsets {begin}..{end} do not match "
                                 f"shape {shape} of {dt} within a file of {size} bytes")
            f.seek(base + begin)
            arr = np.frombuffer(f.read(end - begin), dtype=npdt).reshape(shape)
            if dt == "BF16":
                arr = _bf16_bits_to_f32(arr).reshape(shape)
            out[name] = torch.from_numpy(arr.astype(arr.dtype.newbyteorder("="), copy=True))
    return out


def save(path, tensors, dtypes=None):
    """Writes {name: tensor} atomically (temp file, fsync, rename), names in sorted order.
    Float tensors are written as F32 unless dtypes[name] says "BF16" or "F64"; int32 -> I32, int64 -> I64."""
    dtypes = dtypes or {}
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        if t.dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            dt = dtypes.get(name, "F32")
            a = t.to(torch.float64).numpy()
            if dt == "F32":
                data = a.astype("<f4").tobytes()
            elif dt == "F64":
                data = a.astype("<f8").tobytes()
            elif dt == "BF16":
                data = _f32_to_bf16_bits(a.astype(np.float32)).astype("<u2").tobytes()
            else:
                raise ValueError(f"{path}: cannot write float tensor '{name}' as {dt}")
        elif t.dtype == torch.int32:
            dt, data = "I32", t.numpy().astype("<i4").tobytes()
        elif t.dtype == torch.int64:
            dt, data = "I64", t.numpy().astype("<i8").tobytes()
        else:
            raise ValueError(f"{path}: tensor '{name}' has unsupported torch dtype {t.dtype}")
        header[name] = {"dtype": dt, "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    hdr = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hdr += b" " * ((8 - len(hdr) % 8) % 8)  # keep the data block 8-byte aligned
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hdr)))
        f.write(hdr)
        for b in blobs:
            f.write(b)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
