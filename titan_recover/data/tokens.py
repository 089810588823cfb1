"""Pre-tokenized corpora on disk: many shard files under one folder, with a manifest.

Two layouts are read, both formats that users already have on disk:

* ``datatrove``: datatrove's tokenized files (``*.ds``: the token ids back to back,
  2 bytes each up to 65,536 ids and 4 beyond; ``*.ds.index``: uint64 end offset of every
  document), as datatrove's ``DocumentTokenizer`` writes them and nanotron reads them.
  ``titan_recover.data.prepare`` writes this layout too.
* ``megatron``: Megatron-LM's indexed datasets (``*.bin`` tokens, ``*.idx`` header with the
  token dtype), as ``tools/preprocess_data.py`` / ``IndexedDatasetBuilder`` write them.

Each folder has a ``manifest.json`` (written by ``prepare``, or by ``index`` for a folder
prepared elsewhere): layout, token dtype, tokenizer identity and vocabulary size,
token/document counts, the largest token id, and every shard's size and sha256. Opening a
dataset checks the manifest and every shard's size (O(shards)); the checksums are checked
by the separate ``verify`` command, which reads everything.

A rank reads windows of ``seq_len + 1`` tokens with one ``pread`` each: shard ``i`` of
``n_i`` tokens holds ``(n_i - 1) // seq_len`` windows (windows do not cross shard files,
as in datatrove's reader). Not ``mmap``: the kernel maps whole page-cache folios into a
mapping, so a rank reading random windows saw its RSS grow with the corpus (peak 226 MiB
at 10^6 tokens, 1,778 MiB at 10^9, ``bench.data``); with ``pread`` the data stays in the
page cache and a rank holds a few open files (at most ``OPEN_FILES``).
"""

from __future__ import annotations

import bisect
import glob
import hashlib
import json
import os
import struct
import tempfile
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any, BinaryIO, Iterable

import numpy as np

MANIFEST = "manifest.json"
SCHEMA = "titan_recover.tokens/1"
LAYOUTS = ("datatrove", "megatron")
DTYPES: dict[str, np.dtype[np.integer]] = {
    "uint16": np.dtype("<u2"),
    "uint32": np.dtype("<u4"),
    "int32": np.dtype("<i4"),
}

# Megatron-LM's indexed dataset header: magic, version 1, a dtype code (its DType enum)
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_CODES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16"}
_HASH_CHUNK = 1 << 24
OPEN_FILES = 64  # shard files a reader keeps open (least recently used closed first)


class DataError(ValueError):
    """The data cannot be trained on as it is; the message names the file and the problem."""


def dtype_for_vocab(vocab_size: int) -> str:
    """Token width from the vocabulary: 2 bytes up to 65,536 ids, 4 bytes beyond."""
    if not isinstance(vocab_size, int) or vocab_size <= 0:
        raise DataError(f"vocabulary size must be a positive int, got {vocab_size!r}")
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def tokenizer_identity(tokenizer_dir: str) -> str:
    """sha256 over the tokenizer's files: ties a dataset to the exact tokenizer."""
    digest = hashlib.sha256()
    found = False
    for name in ("tokenizer.json", "tokenizer_config.json"):
        path = os.path.join(tokenizer_dir, name)
        if os.path.exists(path):
            found = True
            digest.update(name.encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    if not found:
        raise DataError(f"{tokenizer_dir}: no tokenizer.json or tokenizer_config.json in this folder")
    return digest.hexdigest()


ATOMIC_PREFIX = ".tmp."  # a process killed inside ``atomic_write`` leaves such a file behind


def atomic_write(path: str, data: bytes) -> None:
    """Temp file in the same folder + ``os.replace``: readers never see half a file."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=ATOMIC_PREFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_json(path: str, value: Any) -> None:
    atomic_write(path, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode())


# --------------------------------------------------------------------------------------
# Manifest
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shard:
    file: str  # relative to the dataset folder
    tokens: int
    documents: int
    max_token_id: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    layout: str
    dtype: str
    tokenizer_sha256: str
    vocab_size: int
    shards: tuple[Shard, ...]
    source: dict = field(default_factory=dict)  # how it was prepared (for idempotence and people)

    @property
    def num_tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def num_documents(self) -> int:
        return sum(s.documents for s in self.shards)

    @property
    def max_token_id(self) -> int:
        return max(s.max_token_id for s in self.shards)

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "layout": self.layout,
            "dtype": self.dtype,
            "tokenizer": {"sha256": self.tokenizer_sha256, "vocab_size": self.vocab_size},
            "num_tokens": self.num_tokens,
            "num_documents": self.num_documents,
            "max_token_id": self.max_token_id,
            "source": self.source,
            "shards": [asdict(s) for s in self.shards],
        }

    @classmethod
    def from_json(cls, raw: Any, where: str) -> Manifest:
        """Validates every field; ``DataError`` names the manifest and the field."""

        def need(ok: bool, what: str) -> None:
            if not ok:
                raise DataError(f"{where}: {what}")

        def is_count(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 0

        need(isinstance(raw, dict), "not a JSON object")
        need(raw.get("schema") == SCHEMA, f"schema is {raw.get('schema')!r}, expected {SCHEMA!r}")
        need(raw.get("layout") in LAYOUTS, f"layout must be one of {LAYOUTS}, got {raw.get('layout')!r}")
        need(raw.get("dtype") in DTYPES, f"dtype must be one of {tuple(DTYPES)}, got {raw.get('dtype')!r}")
        tok = raw.get("tokenizer")
        need(
            isinstance(tok, dict) and isinstance(tok.get("sha256"), str) and is_count(tok.get("vocab_size")),
            "tokenizer must be {sha256: str, vocab_size: int}",
        )
        need(isinstance(raw.get("source", {}), dict), "source must be an object")
        shards = raw.get("shards")
        need(isinstance(shards, list) and len(shards) > 0, "shards must be a non-empty list")
        parsed = []
        for i, s in enumerate(shards):
            need(
                isinstance(s, dict)
                and isinstance(s.get("file"), str)
                and isinstance(s.get("sha256"), str)
                and all(is_count(s.get(k)) for k in ("tokens", "documents", "max_token_id")),
                f"shards[{i}] must be {{file, sha256: str; tokens, documents, max_token_id: int >= 0}}",
            )
            need(
                not os.path.isabs(s["file"]) and ".." not in s["file"].split("/"),
                f"shards[{i}].file must be a path inside the dataset folder, got {s['file']!r}",
            )
            parsed.append(Shard(s["file"], s["tokens"], s["documents"], s["max_token_id"], s["sha256"]))
        manifest = cls(
            raw["layout"], raw["dtype"], tok["sha256"], tok["vocab_size"], tuple(parsed), raw.get("source", {})
        )
        for key in ("num_tokens", "num_documents", "max_token_id"):
            need(
                raw.get(key) == getattr(manifest, key),
                f"{key} is {raw.get(key)!r}, its shards say {getattr(manifest, key)}",
            )
        return manifest


def read_manifest(folder: str) -> Manifest:
    path = os.path.join(folder, MANIFEST)
    if not os.path.isdir(folder):
        raise DataError(f"{folder}: no such dataset folder")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise DataError(
            f"{path} is missing: prepare the folder with `python -m titan_recover.data prepare`, or, "
            f"for tokens prepared elsewhere (datatrove .ds, Megatron .bin/.idx), write one with "
            f"`python -m titan_recover.data index {folder} --tokenizer TOKENIZER_DIR`"
        ) from None
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: cannot read the manifest ({e})") from None
    return Manifest.from_json(raw, path)


# --------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------


def megatron_dtype(idx_path: str) -> str:
    """The token dtype named by a Megatron ``.idx`` header."""
    try:
        with open(idx_path, "rb") as f:
            head = f.read(len(MEGATRON_MAGIC) + 9)
    except OSError as e:
        raise DataError(f"{idx_path}: cannot read the index ({e})") from None
    if len(head) < len(MEGATRON_MAGIC) + 9 or not head.startswith(MEGATRON_MAGIC):
        raise DataError(f"{idx_path}: not a Megatron indexed dataset index (bad magic)")
    version, code = struct.unpack("<QB", head[len(MEGATRON_MAGIC) :])
    if version != 1:
        raise DataError(f"{idx_path}: Megatron index version {version}, only version 1 is read")
    name = MEGATRON_CODES.get(code)
    if name not in DTYPES:
        raise DataError(f"{idx_path}: token dtype {name or code!r} is not a token id type {tuple(DTYPES)}")
    return name


class TokenDataset:
    """Read-only view of a prepared folder: windows of ``seq_len + 1`` tokens by index."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.manifest = read_manifest(folder)
        self.dtype = DTYPES[self.manifest.dtype]
        for shard in self.manifest.shards:
            path = self.path(shard)
            try:
                size = os.path.getsize(path)
            except OSError:
                raise DataError(f"{path}: shard listed in {MANIFEST} is missing") from None
            if size != shard.tokens * self.dtype.itemsize:
                raise DataError(
                    f"{path}: {size} bytes, but {MANIFEST} lists {shard.tokens} {self.manifest.dtype} tokens "
                    f"({shard.tokens * self.dtype.itemsize} bytes): the shard was changed or truncated; "
                    "prepare the folder again"
                )
        self._files: OrderedDict[int, int] = OrderedDict()  # shard -> fd
        self._seq_len = 0
        self._ends: list[int] = []

    def path(self, shard: Shard) -> str:
        return os.path.join(self.folder, shard.file)

    def check_tokenizer(self, tokenizer_dir: str, vocab_size: int, key: str) -> None:
        """The data was tokenized by this exact tokenizer (same files, same vocabulary); ``key`` is the
        setting naming the tokenizer folder."""
        m, where = self.manifest, os.path.join(self.folder, MANIFEST)
        identity = tokenizer_identity(tokenizer_dir)
        if m.vocab_size != vocab_size or m.tokenizer_sha256 != identity:
            raise DataError(
                f"{where}: tokenized with another tokenizer (vocabulary {m.vocab_size}, sha256 "
                f"{m.tokenizer_sha256[:12]}) than the job's {tokenizer_dir} (vocabulary {vocab_size}, sha256 "
                f"{identity[:12]}): set {key} to the tokenizer it was prepared with, or prepare it again"
            )

    def check_vocab(self, model_vocab: int, what: str) -> None:
        """Every token id is an index of the model's embedding table."""
        if self.manifest.max_token_id >= model_vocab:
            raise DataError(
                f"{os.path.join(self.folder, MANIFEST)}: token ids go up to {self.manifest.max_token_id}, "
                f"but {what} has a vocabulary of {model_vocab}: use a model flavor whose vocab_size is larger"
            )

    def num_windows(self, seq_len: int) -> int:
        self._layout(seq_len)
        return self._ends[-1]

    def _layout(self, seq_len: int) -> None:
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if seq_len != self._seq_len:
            ends, total = [], 0
            for shard in self.manifest.shards:
                total += max(0, (shard.tokens - 1) // seq_len)
                ends.append(total)
            if total == 0:
                raise DataError(f"{self.folder}: no shard holds seq_len + 1 = {seq_len + 1} tokens")
            self._seq_len, self._ends = seq_len, ends

    def _read(self, i: int, start: int, count: int) -> np.ndarray:
        """``count`` tokens of shard ``i`` from token ``start`` (one pread)."""
        if i in self._files:
            self._files.move_to_end(i)
        else:
            if len(self._files) >= OPEN_FILES:
                os.close(self._files.popitem(last=False)[1])
            self._files[i] = os.open(self.path(self.manifest.shards[i]), os.O_RDONLY)
        width = self.dtype.itemsize
        data = os.pread(self._files[i], count * width, start * width)
        if len(data) != count * width:
            raise DataError(
                f"{self.path(self.manifest.shards[i])}: shorter than {MANIFEST} says (changed under the run)"
            )
        return np.frombuffer(data, dtype=self.dtype)

    def close(self) -> None:
        while self._files:
            os.close(self._files.popitem()[1])

    def __del__(self) -> None:
        if hasattr(self, "_files"):
            self.close()

    def window(self, index: int, seq_len: int, vocab_size: int) -> np.ndarray:
        """Window ``index`` (``seq_len + 1`` tokens, int64); ids outside ``[0, vocab_size)`` are a
        ``DataError`` naming the file and offset (a file changed under the run)."""
        self._layout(seq_len)
        if not 0 <= index < self._ends[-1]:
            raise ValueError(f"window must be in [0, {self._ends[-1]}), got {index}")
        i = bisect.bisect_right(self._ends, index)
        start = (index - (self._ends[i - 1] if i else 0)) * seq_len
        tokens = self._read(i, start, seq_len + 1).astype(np.int64)
        bad = np.flatnonzero((tokens < 0) | (tokens >= vocab_size))
        if bad.size:
            offset = start + int(bad[0])
            raise DataError(
                f"{self.path(self.manifest.shards[i])}: token id {int(tokens[bad[0]])} at token offset {offset} "
                f"(byte {offset * self.dtype.itemsize}) is outside the vocabulary [0, {vocab_size}): the file "
                f"differs from {MANIFEST}; check it with `python -m titan_recover.data verify {self.folder}`"
            )
        return tokens


# --------------------------------------------------------------------------------------
# Writing (datatrove layout) and adopting folders prepared elsewhere
# --------------------------------------------------------------------------------------


class ShardWriter:
    """Writes one datatrove shard (``.ds`` + ``.ds.index``) under temp names, publishing
    both on ``close``: a shard either exists whole or not at all."""

    def __init__(self, path: str, dtype: str) -> None:
        self.path, self.dtype = path, DTYPES[dtype]
        self._tmp = f"{path}.tmp"
        self._data: BinaryIO = open(self._tmp, "wb")
        self._index: BinaryIO = open(f"{self._tmp}.index", "wb")
        self._sha = hashlib.sha256()
        self.tokens = self.documents = 0
        self.max_token_id = 0

    def add(self, ids: Iterable[int] | np.ndarray) -> None:
        """Appends one document."""
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size == 0:
            return
        if arr.min() < 0 or arr.max() > np.iinfo(self.dtype).max:
            raise DataError(f"{self.path}: token id outside {self.dtype.name}")
        data = arr.astype(self.dtype).tobytes()
        self._data.write(data)
        self._sha.update(data)
        self.tokens += arr.size
        self.documents += 1
        self.max_token_id = max(self.max_token_id, int(arr.max()))
        self._index.write(np.uint64(self.tokens).tobytes())

    def close(self) -> Shard:
        for f in (self._data, self._index):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        os.replace(f"{self._tmp}.index", f"{self.path}.index")
        os.replace(self._tmp, self.path)
        return Shard(os.path.basename(self.path), self.tokens, self.documents, self.max_token_id, self._sha.hexdigest())

    def abandon(self) -> None:
        for f in (self._data, self._index):
            f.close()
        for p in (self._tmp, f"{self._tmp}.index"):
            if os.path.exists(p):
                os.remove(p)


def scan_shard(path: str, file: str, dtype: str, documents: int) -> Shard:
    """One read of a shard file: its token count, sha256 and largest id (``file``: its name in the folder)."""
    width, digest, biggest, size = DTYPES[dtype].itemsize, hashlib.sha256(), 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):  # a multiple of every token width
            if len(chunk) % width:
                raise DataError(f"{path}: not a whole number of {width}-byte tokens")
            digest.update(chunk)
            ids = np.frombuffer(chunk, dtype=DTYPES[dtype])
            if ids.min() < 0:
                raise DataError(f"{path}: negative token id {int(ids.min())}")
            biggest, size = max(biggest, int(ids.max())), size + len(chunk)
    return Shard(file, size // width, documents, biggest, digest.hexdigest())


def _datatrove_shard(path: str, file: str, dtype: str) -> Shard:
    width = DTYPES[dtype].itemsize
    size = os.path.getsize(path)
    if size % width:
        raise DataError(f"{path}: {size} bytes is not a whole number of {width}-byte tokens")
    index = f"{path}.index"
    if not os.path.exists(index):
        raise DataError(f"{index} is missing (datatrove writes one beside every .ds file)")
    ends = np.fromfile(index, dtype="<u8")
    if ends.size and int(ends[-1]) != size // width:
        raise DataError(
            f"{index}: documents end at token {int(ends[-1])}, but {path} holds {size // width} tokens of "
            f"{width} bytes: is the token width right (--dtype)?"
        )
    return scan_shard(path, file, dtype, int(ends.size))


def _megatron_shard(path: str, file: str, dtype: str) -> Shard:
    idx = path[: -len(".bin")] + ".idx"
    found = megatron_dtype(idx)
    if found != dtype:
        raise DataError(f"{idx}: tokens are {found}, other shards of this folder are {dtype}")
    header = len(MEGATRON_MAGIC) + 9 + 16
    size = os.path.getsize(idx)
    if size < header:
        raise DataError(
            f"{idx}: truncated: its {size} bytes end inside the header ({header} bytes: magic, version, "
            f"dtype, sequence and document counts); write it again with Megatron's preprocess_data.py"
        )
    with open(idx, "rb") as f:
        f.seek(len(MEGATRON_MAGIC) + 9)
        sequences, documents = struct.unpack("<QQ", f.read(16))
    needed = header + 12 * sequences + 8 * documents  # int32 lengths, int64 pointers, int64 document starts
    if size < needed:
        raise DataError(
            f"{idx}: truncated: {size} bytes, but its {sequences:,} sequences and {documents:,} document "
            f"entries need {needed:,}; write it again with Megatron's preprocess_data.py"
        )
    held = int(np.fromfile(idx, dtype="<i4", count=sequences, offset=header).sum(dtype=np.int64))
    on_disk = os.path.getsize(path) // DTYPES[dtype].itemsize
    if held != on_disk:
        raise DataError(
            f"{idx}: its sequences hold {held:,} tokens, but {path} holds {on_disk:,}: the pair was "
            "changed or truncated, or comes from two different runs"
        )
    return scan_shard(path, file, dtype, max(0, documents - 1))  # Megatron's document index starts with a 0


def index_folder(folder: str, tokenizer_dir: str, vocab_size: int, dtype: str | None = None) -> Manifest:
    """Writes ``manifest.json`` for tokens prepared elsewhere (datatrove or Megatron files)."""
    ds = sorted(glob.glob(os.path.join(glob.escape(folder), "**", "*.ds"), recursive=True))
    bins = sorted(glob.glob(os.path.join(glob.escape(folder), "**", "*.bin"), recursive=True))
    if ds and bins:
        raise DataError(f"{folder}: holds both datatrove (.ds) and Megatron (.bin) files; index one layout per folder")
    if not ds and not bins:
        raise DataError(f"{folder}: no datatrove (.ds) or Megatron (.bin + .idx) token files found")
    layout, files = ("datatrove", ds) if ds else ("megatron", bins)
    if layout == "megatron":
        dtype = megatron_dtype(files[0][: -len(".bin")] + ".idx")
    dtype = dtype or dtype_for_vocab(vocab_size)
    if dtype not in DTYPES:
        raise DataError(f"token dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    read = _datatrove_shard if layout == "datatrove" else _megatron_shard
    shards = [read(path, os.path.relpath(path, folder), dtype) for path in files]
    manifest = Manifest(
        layout,
        dtype,
        tokenizer_identity(tokenizer_dir),
        vocab_size,
        tuple(shards),
        {"indexed_from": layout, "tokenizer_dir": os.path.abspath(tokenizer_dir)},
    )
    if manifest.max_token_id >= vocab_size:
        raise DataError(
            f"{folder}: token ids go up to {manifest.max_token_id}, beyond the tokenizer's vocabulary {vocab_size}"
        )
    write_json(os.path.join(folder, MANIFEST), manifest.to_json())
    return manifest


def verify(folder: str) -> list[str]:
    """Full check of every shard against the manifest; returns the problems found."""
    dataset = TokenDataset(folder)  # sizes first
    problems = []
    for shard in dataset.manifest.shards:
        path = dataset.path(shard)
        if (digest := file_sha256(path)) != shard.sha256:
            problems.append(f"{path}: sha256 {digest[:16]}... differs from {MANIFEST} ({shard.sha256[:16]}...)")
    return problems
