"""MMIDIDX token files (``PREFIX.bin`` + ``PREFIX.idx``), the format of Megatron-LM and PaddleNLP.

    python -m llmtrain.data.indexed PREFIX            # print what a prefix holds
    python -m llmtrain.data.preprocess merge --inputs A B --output-prefix C   # merge shards

Layout of ``PREFIX.idx`` (little endian), as written by Megatron's and PaddleNLP's
``MMapIndexedDataset``::

    b"MMIDIDX\\x00\\x00"   magic (9 bytes)
    <Q version = 1
    <B dtype code         1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    <Q n_items            number of sequences (we write one per document)
    <Q n_doc_idx          length of the document index (= n_documents + 1)
    int32[n_items]        sizes: tokens per item
    int64[n_items]        pointers: byte offset of each item in PREFIX.bin
    int64[n_doc_idx]      doc_idx: first item of each document, then n_items

``PREFIX.bin`` is the items' tokens back to back. We write one item per document
with its EOD included, so ``doc_idx == arange(n_docs + 1)``; files where a document
spans several items (sentence-split Megatron data) read fine too.

Side files share the prefix and hold one value per token of ``PREFIX.bin``, in the
same order, so Megatron and PaddleNLP never see them: ``PREFIX.wbd`` (uint8, 1 where
a token starts a word; written by ``preprocess --word-boundaries``). PaddleNLP reads
``PREFIX.lsm`` as a loss mask, so that name is avoided.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import sys

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}
SIDE_FILES = {"wbd": np.uint8}  # word-boundary flags, one per token


def dtype_code(dtype) -> int:
    for k, v in DTYPES.items():
        if np.dtype(v) == np.dtype(dtype):
            return k
    raise ValueError(f"dtype {dtype} has no MMIDIDX code; use one of {[np.dtype(v).name for v in DTYPES.values()]}")


def exists(prefix: str) -> bool:
    return os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")


def write_index(path: str, dtype, sizes: np.ndarray, doc_idx: np.ndarray) -> None:
    """Write an ``.idx`` file for items of ``sizes`` stored back to back."""
    sizes = np.asarray(sizes, dtype=np.int32)  # [n_items]
    pointers = np.zeros(len(sizes), dtype=np.int64)  # [n_items] byte offsets
    np.cumsum(sizes[:-1].astype(np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    doc_idx = np.asarray(doc_idx, dtype=np.int64)  # [n_docs + 1]
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", dtype_code(dtype)))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(sizes.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(doc_idx.tobytes(order="C"))


class IndexedWriter:
    """Streams documents to ``PREFIX.bin`` (and side files); ``finalize`` writes ``PREFIX.idx``.

    Everything is written under ``*.tmp`` names and renamed at the end, so a crashed
    run never leaves a half-written prefix that looks complete.
    """

    def __init__(self, prefix: str, dtype, side: tuple[str, ...] = ()):
        self.prefix, self.dtype, self.side = prefix, np.dtype(dtype), tuple(side)
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._files = {"bin": open(prefix + ".bin.tmp", "wb")}
        for name in self.side:
            self._files[name] = open(f"{prefix}.{name}.tmp", "wb")
        self._sizes: list[np.ndarray] = []
        self.n_tokens = 0

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray, side: dict | None = None) -> None:
        """Append documents: ``tokens`` [sum(lengths)] back to back, ``lengths`` [n_docs]."""
        tokens = np.asarray(tokens)
        if len(tokens) and tokens.max(initial=0) > np.iinfo(self.dtype).max:
            raise ValueError(f"{self.prefix}: token id {int(tokens.max())} does not fit {self.dtype}")
        self._files["bin"].write(tokens.astype(self.dtype, copy=False).tobytes())
        for name in self.side:
            arr = np.asarray(side[name], dtype=SIDE_FILES[name])
            if len(arr) != len(tokens):
                raise ValueError(f"{self.prefix}.{name}: {len(arr)} values for {len(tokens)} tokens")
            self._files[name].write(arr.tobytes())
        self._sizes.append(np.asarray(lengths, dtype=np.int32))
        self.n_tokens += len(tokens)

    def finalize(self) -> None:
        for f in self._files.values():
            f.close()
        sizes = np.concatenate(self._sizes) if self._sizes else np.zeros(0, np.int32)
        write_index(self.prefix + ".idx.tmp", self.dtype, sizes, np.arange(len(sizes) + 1))
        for name in ("bin", *self.side):
            os.replace(f"{self.prefix}.{name}.tmp", f"{self.prefix}.{name}")
        for name in SIDE_FILES:  # a side file of an earlier run would not match these tokens
            if name not in self.side and os.path.exists(f"{self.prefix}.{name}"):
                os.remove(f"{self.prefix}.{name}")
        os.replace(self.prefix + ".idx.tmp", self.prefix + ".idx")

    def abort(self) -> None:
        for name, f in self._files.items():
            f.close()
            path = f"{self.prefix}.{name}.tmp"
            if os.path.exists(path):
                os.remove(path)


class IndexedDataset:
    """Memory-mapped reader of an MMIDIDX prefix (ours, Megatron's or PaddleNLP's)."""

    def __init__(self, prefix: str):
        self.prefix = str(prefix)
        idx, bin_ = self.prefix + ".idx", self.prefix + ".bin"
        for p in (idx, bin_):
            if not os.path.isfile(p):
                raise FileNotFoundError(
                    f"{p} does not exist; create it with `python -m llmtrain.data.preprocess --input CORPUS "
                    f"--tokenizer DIR --output-prefix {self.prefix}` (for the default corpus: "
                    f"scripts/prepare_default_corpus.sh)")
        with open(idx, "rb") as f:
            magic = f.read(9)
            if magic != MAGIC:
                raise ValueError(f"{idx}: not an MMIDIDX index (magic {magic!r}, expected {MAGIC!r})")
            (version,) = struct.unpack("<Q", f.read(8))
            if version != VERSION:
                raise ValueError(f"{idx}: MMIDIDX version {version}, only {VERSION} is supported")
            (code,) = struct.unpack("<B", f.read(1))
            if code not in DTYPES:
                raise ValueError(f"{idx}: unknown dtype code {code}")
            self.dtype = np.dtype(DTYPES[code])
            n_items, n_doc = struct.unpack("<QQ", f.read(16))
            offset = f.tell()
        buf = np.memmap(idx, mode="r", dtype=np.uint8)
        self.sizes = np.frombuffer(buf, np.int32, n_items, offset)  # [n_items]
        self.pointers = np.frombuffer(buf, np.int64, n_items, offset + 4 * n_items)  # [n_items] bytes
        self.doc_idx = np.frombuffer(buf, np.int64, n_doc, offset + 12 * n_items)  # [n_docs + 1]
        expected = offset + 12 * n_items + 8 * n_doc
        if len(buf) != expected:
            raise ValueError(f"{idx}: {len(buf)} bytes, expected {expected} for {n_items} items")
        nbytes = os.path.getsize(bin_)
        if nbytes % self.dtype.itemsize:
            raise ValueError(f"{bin_}: {nbytes} bytes is not a multiple of {self.dtype} size")
        self.tokens = (np.memmap(bin_, mode="r", dtype=self.dtype) if nbytes
                       else np.zeros(0, self.dtype))  # [n_tokens], flat
        last = int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize if n_items else 0
        if last > nbytes:
            raise ValueError(f"{bin_}: {nbytes} bytes, but {idx} points up to byte {last}")
        self.starts = self.pointers // self.dtype.itemsize  # [n_items] element offsets

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        s = int(self.starts[i])
        return self.tokens[s: s + int(self.sizes[i])]

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset .. offset+length`` of item ``i`` (a view into the memmap)."""
        s = int(self.starts[i]) + offset
        n = int(self.sizes[i]) - offset if length is None else length
        return self.tokens[s: s + n]

    @property
    def n_docs(self) -> int:
        return len(self.doc_idx) - 1

    @property
    def n_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))

    def side(self, name: str) -> np.ndarray:
        """[n_tokens] values of side file ``PREFIX.<name>`` aligned with ``self.tokens`` (memory-mapped once)."""
        cache = self.__dict__.setdefault("_side", {})
        if name not in cache:
            cache[name] = self._open_side(name)
        return cache[name]

    def _open_side(self, name: str) -> np.ndarray:
        path = f"{self.prefix}.{name}"
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} does not exist; re-run preprocess with --word-boundaries")
        arr = np.memmap(path, mode="r", dtype=SIDE_FILES.get(name, np.uint8))
        if len(arr) != len(self.tokens):
            raise ValueError(f"{path}: {len(arr)} values for {len(self.tokens)} tokens in {self.prefix}.bin")
        return arr

    def fingerprint(self) -> str:
        """sha256 of the ``.idx`` bytes and the ``.bin`` size: names derived caches."""
        h = hashlib.sha256()
        with open(self.prefix + ".idx", "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        h.update(str(os.path.getsize(self.prefix + ".bin")).encode())
        return h.hexdigest()


def merge(prefixes: list[str], out_prefix: str) -> IndexedDataset:
    """Concatenate shards (same dtype) into ``out_prefix``; side files merge when every shard has them."""
    shards = [IndexedDataset(p) for p in prefixes]
    if not shards:
        raise ValueError("merge: no input prefixes")
    dtypes = {s.dtype for s in shards}
    if len(dtypes) != 1:
        raise ValueError(f"merge: shards have different dtypes: "
                         + ", ".join(f"{s.prefix}={s.dtype}" for s in shards))
    side = [n for n in SIDE_FILES if all(os.path.isfile(f"{s.prefix}.{n}") for s in shards)]
    partial = [n for n in SIDE_FILES if n not in side and any(os.path.isfile(f"{s.prefix}.{n}") for s in shards)]
    if partial:
        raise ValueError(f"merge: side files {partial} exist for some shards only")
    os.makedirs(os.path.dirname(os.path.abspath(out_prefix)), exist_ok=True)
    for name in ("bin", *side):
        with open(f"{out_prefix}.{name}.tmp", "wb") as out:
            for s in shards:
                with open(f"{s.prefix}.{name}", "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 24)
    sizes = np.concatenate([s.sizes for s in shards])
    doc_idx, base = [np.zeros(1, np.int64)], 0
    for s in shards:
        doc_idx.append(s.doc_idx[1:] + base)
        base += len(s)
    write_index(out_prefix + ".idx.tmp", shards[0].dtype, sizes, np.concatenate(doc_idx))
    for name in ("bin", *side):
        os.replace(f"{out_prefix}.{name}.tmp", f"{out_prefix}.{name}")
    os.replace(out_prefix + ".idx.tmp", out_prefix + ".idx")
    return IndexedDataset(out_prefix)


def main(argv=None) -> int:
    for prefix in argv if argv is not None else sys.argv[1:]:
        ds = IndexedDataset(prefix)
        side = [n for n in SIDE_FILES if os.path.isfile(f"{prefix}.{n}")]
        print(f"{prefix}: {ds.n_docs} documents, {len(ds)} items, {ds.n_tokens} tokens, dtype {ds.dtype}, "
              f"longest item {int(ds.sizes.max()) if len(ds) else 0}; side files: {side or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
