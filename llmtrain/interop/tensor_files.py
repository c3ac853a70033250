"""Weight files of a PaddleNLP checkpoint directory: find, read (to fp32 numpy), write.

    from llmtrain.interop.tensor_files import find_weight_files, read_tensors
    files, kind = find_weight_files("ckpt/")            # [".../model.safetensors"], "safetensors"
    tensors, origin = read_tensors(files, kind, bf16_bits=False)

What PaddleNLP 2.8.1 `save_pretrained` writes (measured):
  - `model.safetensors` (metadata `{"format": "np"}`), or `model_state.pdparams` (pickle, `paddle.save`);
  - sharded: `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`, or
    `model_state-0000i-of-0000n.pdparams` + `model_state.pdparams.index.json`,
    the index mapping every tensor name to its file under `weight_map`;
  - bfloat16 weights go into safetensors as dtype `U16` (the raw bf16 bits, since
    numpy has no bfloat16) and `config.json` says `"dtype": "bfloat16"`; files from
    other tools may say `BF16`. Both become fp32 here, as do float8 `F8_E4M3` tensors
    (DeepSeek-V3's FP8 release; its block scales are applied by `deepseek.py`).

Safetensors are preferred when both kinds exist: a pickled `.pdparams` can run code
when loaded, so `read_tensors` warns when it unpickles one from outside the run
directory (the caller says which: `pickle_warning`).

The safetensors reader is our own (8-byte header length, JSON header, raw
little-endian data) so that BF16/U16 need no framework and a truncated file is
reported with its name instead of crashing later.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import tempfile
from typing import Iterator, Optional

import numpy as np

from llmtrain.utils.files import chmod_as_created
from llmtrain.utils.log import log0

SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
PICKLE_SINGLE = "model_state.pdparams"
PICKLE_INDEX = "model_state.pdparams.index.json"

_SAFE_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "U16": np.uint16, "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U8": np.uint8, "BOOL": np.bool_, "F8_E4M3": np.uint8,
}


def _e4m3_values() -> np.ndarray:
    """fp32 value of each of the 256 float8 e4m3fn bit patterns (1 sign, 4 exponent bits with bias 7, 3 mantissa
    bits; exponent 0 subnormal; 0x7f/0xff NaN, no infinities), the format of DeepSeek-V3's FP8 weights."""
    bits = np.arange(256)
    exp, man = (bits >> 3) & 0xF, bits & 0x7
    mag = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    mag[(exp == 15) & (man == 7)] = np.nan
    return np.where(bits & 0x80, -mag, mag).astype(np.float32)


E4M3 = _e4m3_values()


class CheckpointFileError(ValueError):
    """A weight file or index is absent, truncated or malformed; the message names the file."""


def find_weight_files(ckpt_dir: str) -> tuple[list[str], str]:
    """The weight files to read and their kind (`safetensors` or `pdparams`), safetensors first."""
    def index_files(index_name: str) -> list[str]:
        index_path = os.path.join(ckpt_dir, index_name)
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointFileError(f"{index_path}: not a readable shard index with a 'weight_map' ({e})") from e
        names = sorted(set(weight_map.values()))
        absent = [n for n in names if not os.path.isfile(os.path.join(ckpt_dir, n))]
        if absent:
            raise CheckpointFileError(f"{index_path} lists shard files that do not exist: {', '.join(absent)}")
        return [os.path.join(ckpt_dir, n) for n in names]

    for name, kind, sharded in ((SAFE_SINGLE, "safetensors", False), (SAFE_INDEX, "safetensors", True),
                                (PICKLE_SINGLE, "pdparams", False), (PICKLE_INDEX, "pdparams", True)):
        if os.path.isfile(os.path.join(ckpt_dir, name)):
            return (index_files(name) if sharded else [os.path.join(ckpt_dir, name)]), kind
    present = sorted(os.listdir(ckpt_dir)) if os.path.isdir(ckpt_dir) else []
    tp_split = [n for n in present if ".tp" in n and n.endswith((".pdparams", ".safetensors"))]
    hint = (" It holds tensor-parallel split files (" + ", ".join(tp_split) + "): merge them into one "
            "model with PaddleNLP first (load with its tensor_parallel_degree, save unified).") if tp_split else ""
    raise CheckpointFileError(
        f"{ckpt_dir}: no weights found (looked for {SAFE_SINGLE}, {SAFE_INDEX}, {PICKLE_SINGLE}, {PICKLE_INDEX}; "
        f"directory has: {', '.join(present) or 'nothing'}).{hint}")


def bf16_bits_to_fp32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 stored as uint16 bit patterns -> float32 (exact: bf16 is the top half of fp32)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _check_weight_dtype(dtype: np.dtype, is_bf16: bool, where: str, is_fp8: bool = False) -> None:
    """Weights are floating point; uint16 only as bfloat16 bits, uint8 only as float8 e4m3 bits (`F8_E4M3`)."""
    if is_fp8:
        return
    if dtype == np.uint16 and not is_bf16:
        raise CheckpointFileError(
            f"{where}: uint16 tensor but neither the file (BF16) nor config.json (dtype=bfloat16) says it holds "
            "bfloat16 bits")
    if dtype != np.uint16 and not np.issubdtype(dtype, np.floating):
        raise CheckpointFileError(f"{where}: dtype {dtype} is not a floating-point weight")


def _to_fp32(arr: np.ndarray, is_bf16: bool, where: str, is_fp8: bool = False) -> np.ndarray:
    """A weight as contiguous fp32; uint16 is accepted only as bfloat16 bits, uint8 only as float8 e4m3 bits (the
    values before any block scale: `llmtrain.interop.deepseek` applies DeepSeek's `weight_scale_inv`)."""
    _check_weight_dtype(arr.dtype, is_bf16, where, is_fp8)
    if is_fp8:
        return E4M3[arr]
    if arr.dtype == np.uint16:
        return bf16_bits_to_fp32(arr)
    return np.array(arr, dtype=np.float32)  # a copy: never a view into a mapped file


class LazyArray:
    """One tensor of a memory-mapped safetensors file, converted to fp32 only when `np.asarray` asks.

    Has `.shape`, so shape checks (`np.shape`) read nothing; a loader that slices each
    parameter for its rank holds one full tensor at a time instead of the whole model."""

    def __init__(self, raw: np.ndarray, is_bf16: bool, where: str, is_fp8: bool = False):
        self.raw, self.is_bf16, self.where, self.is_fp8 = raw, is_bf16, where, is_fp8
        self.shape = tuple(raw.shape)
        self.ndim = raw.ndim
        self.dtype = np.dtype(np.float32)

    def __array__(self, dtype=None, copy=None):
        arr = _to_fp32(self.raw, self.is_bf16, self.where, self.is_fp8)
        return arr if dtype is None else arr.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"LazyArray({self.where}, shape={list(self.shape)})"


def read_safetensors(path: str, bf16_bits: bool, lazy: bool = False) -> dict[str, np.ndarray]:
    """name -> fp32 array of one safetensors file; `bf16_bits`: U16 tensors hold bfloat16 (PaddleNLP's way).

    lazy: return `LazyArray`s over the memory-mapped file instead (dtype checked now, data read later)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointFileError(f"{path}: truncated safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise CheckpointFileError(f"{path}: header length {n} exceeds the file size {size}")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointFileError(f"{path}: unreadable safetensors header ({e})") from e
    header.pop("__metadata__", None)
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n) if size > 8 + n else np.zeros(0, np.uint8)
    out = {}
    for name, info in header.items():
        where = f"{path}: tensor {name!r}"
        dtype = _SAFE_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise CheckpointFileError(f"{where}: unsupported dtype {info.get('dtype')!r}")
        start, end = info["data_offsets"]
        shape = [int(s) for s in info["shape"]]
        if end > data.size or end - start != int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize:
            raise CheckpointFileError(f"{where}: data offsets {start}..{end} do not fit shape {shape} "
                                      f"{info['dtype']} in a data section of {data.size} bytes (truncated file?)")
        arr = np.frombuffer(data[start:end], dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape)
        is_bf16 = bf16_bits or info["dtype"] == "BF16"
        is_fp8 = info["dtype"] == "F8_E4M3"
        if lazy:
            _check_weight_dtype(arr.dtype, is_bf16, where, is_fp8)
            out[name] = LazyArray(arr, is_bf16, where, is_fp8)
        else:
            out[name] = _to_fp32(arr, is_bf16, where, is_fp8)
    return out


def read_pdparams(path: str, bf16_bits: bool) -> dict[str, np.ndarray]:
    """name -> fp32 array of one pickled `paddle.save` state dict (may run code: see the module docstring)."""
    import paddle

    try:
        state = paddle.load(path)
    except Exception as e:  # noqa: BLE001 - paddle raises many kinds on a bad pickle
        raise CheckpointFileError(f"{path}: cannot load ({type(e).__name__}: {e})") from e
    if not isinstance(state, dict):
        raise CheckpointFileError(f"{path}: expected a dict of tensors, found {type(state).__name__}")
    out = {}
    for name, value in state.items():
        where = f"{path}: tensor {name!r}"
        if isinstance(value, paddle.Tensor):
            is_bf16 = value.dtype == paddle.bfloat16
            value = value.astype("float32").numpy() if is_bf16 or value.dtype == paddle.float16 else value.numpy()
        elif not isinstance(value, np.ndarray):
            raise CheckpointFileError(f"{where}: not a tensor ({type(value).__name__})")
        out[name] = _to_fp32(value, bf16_bits, where)
    return out


def read_tensors(files: list[str], kind: str, bf16_bits: bool = False, pickle_warning: bool = True,
                 warnings: Optional[list] = None, lazy: bool = False) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """All tensors of the weight files as fp32 numpy, and the file each name came from.

    lazy: safetensors tensors come as `LazyArray`s (a pickle is always loaded whole).

    A name present in two files is an error (a corrupt shard set). `pickle_warning`
    prints the pickle warning before unpickling (and appends it to `warnings`); the
    caller turns it off for files inside its own run directory.
    """
    tensors: dict[str, np.ndarray] = {}
    origin: dict[str, str] = {}
    for path in files:
        if kind == "pdparams":
            if pickle_warning:
                msg = (f"WARNING: {path} is a pickle (.pdparams); unpickling a file can run arbitrary code. "
                       "Load only checkpoints you trust, or convert them to safetensors.")
                log0(msg)
                if warnings is not None:
                    warnings.append(msg)
            part = read_pdparams(path, bf16_bits)
        else:
            part = read_safetensors(path, bf16_bits, lazy)
        for name, arr in part.items():
            if name in tensors:
                raise CheckpointFileError(f"tensor {name!r} is in both {origin[name]} and {path}")
            tensors[name], origin[name] = arr, path
    return tensors, origin


def write_safetensors(tensors: dict[str, np.ndarray], path: str) -> None:
    """One safetensors file with PaddleNLP's metadata (`format: np`), as `from_pretrained` expects."""
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, path, metadata={"format": "np"})


def write_pdparams(tensors: dict[str, np.ndarray], path: str) -> None:
    """One `paddle.save` state dict of tensors, as PaddleNLP's `save_pretrained` writes it."""
    import paddle

    paddle.save({k: paddle.to_tensor(np.ascontiguousarray(v)) for k, v in tensors.items()}, path)


def fsync_tree(root: str) -> None:
    """fsync every file under `root`, then the directories (so a rename publishes complete data)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def dtype_of_config(cfg: dict) -> Optional[str]:
    """The weight dtype `config.json` declares (`dtype`, or HF's `torch_dtype`), if any."""
    return cfg.get("dtype") or cfg.get("torch_dtype")


@contextlib.contextmanager
def staged_dir(out_dir: str) -> Iterator[str]:
    """Write a directory atomically: yields an empty staging directory beside `out_dir`; when the block ends
    without an error its files are fsynced and it replaces `out_dir` (an old one is moved aside first and removed
    after, so `out_dir` is never half-written); on an error the staging directory is removed and `out_dir` is
    left as it was."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        yield tmp
        for dirpath, _, filenames in os.walk(tmp):  # mkdtemp makes 0700 and safetensors' save_file 0600 files
            chmod_as_created(dirpath)
            for name in filenames:
                chmod_as_created(os.path.join(dirpath, name))
        fsync_tree(tmp)
        if os.path.exists(out_dir):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=parent)
            os.rename(out_dir, os.path.join(old, "x"))
            os.rename(tmp, out_dir)
            shutil.rmtree(old)
        else:
            os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class StackedTransposed:
    """Per-expert 2-D tensors [out, in] seen as one stacked [E, in, out]; read only on `np.asarray`."""

    def __init__(self, parts: list):
        self.parts = parts
        self.shape = (len(parts), *reversed(np.shape(parts[0])))
        self.ndim = 3
        self.dtype = np.dtype(np.float32)

    def __array__(self, dtype=None, copy=None):
        arr = np.stack([np.asarray(p, dtype=np.float32).T for p in self.parts])
        return arr if dtype is None else arr.astype(dtype, copy=False)
