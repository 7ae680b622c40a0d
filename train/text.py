"""Byte-level language-modelling data on real text (dataset ``"text"``).

The default corpus is human-written text that every machine has offline
through the project's own install: the Python standard library's source, the
``.py`` files under ``sysconfig.get_paths()["stdlib"]`` without
``site-packages`` / ``dist-packages`` and without the test suites (``test/``,
``tests/``, ``idle_test/`` at any depth) and the generated ``pydoc_data``,
so it is the library's code, comments and docstrings. A user's own text comes from ``path`` (``read_corpus``).

Bytes are the tokens (no tokenizer, vocabulary 256). A corpus is a list of
*documents* in sorted relative-path order; each split's stream is its
documents' bytes, each followed by one ``SEPARATOR`` byte (NUL, absent from
text). The split is by document, never by position: a document goes to
validation iff the first byte of ``sha256(relpath)`` is below
``VALIDATION_THRESHOLD`` (13 / 256, about 5 %), so every process on every
machine with the same files gets the same split, and no document (hence no
window) lies in both. ``sha256`` identifies the corpus (``corpus_sha256``).

Training rows are windows of ``context + 1`` bytes of the train stream read
lazily (``ByteWindows``): row ``i`` starts at byte ``i * stride``, its input is
the first ``context`` bytes and its target the next ``context`` (shifted by
one). Through ``data.batches`` that gives random windows from a seeded,
resumable position. Evaluation uses a fixed set of non-overlapping windows of
the validation stream (``eval_windows``). ``unigram_bits_per_byte`` is the
baseline a model must beat.

Examples:
  >>> import pathlib, tempfile
  >>> root = pathlib.Path(tempfile.mkdtemp())
  >>> _ = (root / "a.txt").write_text("The cat sat on the mat.\\n")
  >>> _ = (root / "b.txt").write_text("A dog lay by the log.\\n")
  >>> corpus = read_corpus(root)
  >>> corpus.train_documents, corpus.validation_documents
  (('b.txt',), ('a.txt',))
  >>> bytes(corpus.train)
  b'A dog lay by the log.\\n\\x00'
  >>> ds = load_text(root, context=8)
  >>> ds.x_train.shape, ds.x_train.dtype, ds.num_classes
  ((15, 8), dtype('int32'), 256)
  >>> bytes(ds.x_train[2].astype("u1")), bytes(ds.y_train[2].astype("u1"))
  (b'dog lay ', b'og lay b')
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import platform
import re
import sysconfig
from pathlib import Path

import numpy as np

from train import data

VOCAB_SIZE = 256
#: Ends every document in a split's stream.
SEPARATOR = 0
#: A document is in validation iff ``sha256(relpath)[0] < VALIDATION_THRESHOLD``.
VALIDATION_THRESHOLD = 13
#: ``load_text`` picks the smallest stride giving at most this many train windows.
MAX_TRAIN_WINDOWS = 2**21
#: ``load_text``'s default cap on the validation windows.
MAX_EVAL_WINDOWS = 4096
#: Directories left out of the default corpus (at any depth): installed
#: packages, test suites, and ``pydoc_data``, whose one file is the reference
#: manual generated into a Python literal (757 KB on 3.11; it fell in
#: validation and made 61 % of it prose unlike the code the model trains on).
EXCLUDED_DIRS = frozenset(
  {
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idle_test",
    "__pycache__",
    "pydoc_data",
  }
)
# Prefix of the hashed bytes: names this module's reading and split rule.
_HASH_TAG = b"gradcomp.text/2 split=sha256(relpath)[0]<13 sep=NUL\n"
# One or more blank (whitespace-only) lines.
_BLANK_LINES = re.compile(rb"\r?\n(?:[ \t\f\v]*\r?\n)+")


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
  """A corpus read and split by document.

  Attributes:
    train: uint8 stream of the train documents, each followed by ``SEPARATOR``.
    validation: the same for the validation documents.
    train_documents: relative paths of the train documents, in stream order.
    validation_documents: the same for validation.
    sha256: hex digest identifying the corpus (``corpus_sha256``).
    description: what was read, from where, and the split's sizes.
  """

  train: np.ndarray
  validation: np.ndarray
  train_documents: tuple[str, ...]
  validation_documents: tuple[str, ...]
  sha256: str
  description: str


def stdlib_root() -> Path:
  """The running Python's standard library directory, the default corpus's root."""
  return Path(sysconfig.get_paths()["stdlib"])


def stdlib_documents() -> list[tuple[str, bytes]]:
  """The default corpus: ``(relpath, bytes)`` of the stdlib's ``.py`` files.

  Returns:
    Every ``.py`` file under ``stdlib_root()`` outside ``EXCLUDED_DIRS``,
    sorted by its ``/``-separated path relative to the root.
  """
  return [
    (rel, path.read_bytes())
    for rel, path in _walk(stdlib_root(), EXCLUDED_DIRS)
    if rel.endswith(".py")
  ]


def read_documents(path: str | Path) -> list[tuple[str, bytes]]:
  """A user's documents: the text files of a directory, or a file's blocks.

  A directory's documents are its files, recursively, in sorted relative-path
  order, skipping hidden names (starting with ``.``), empty files and files
  that are not text (holding a NUL byte or not valid UTF-8). A single file's
  documents are its blocks separated by blank lines (whitespace-only lines
  dropped), named ``<file name>#<block index>``, so one file still splits by
  document (``split_documents`` keeps both splits non-empty).

  Args:
    path: a text file or a directory of text files.

  Returns:
    ``(relpath, bytes)`` of each document, in order.

  Raises:
    DatasetNotFoundError: ``path`` does not exist.
    ValueError: the file has no text, or the directory no text file.
  """
  root = Path(path)
  if not root.exists():
    raise data.DatasetNotFoundError(
      f"text not found: {root} does not exist; give a text file or a directory "
      f"of text files, or no path for the Python standard library's source."
    )
  if root.is_dir():
    docs = []
    for rel, file in _walk(root, frozenset(), skip_hidden=True):
      content = file.read_bytes()
      if content and _is_text(content):
        docs.append((rel, content))
    if not docs:
      raise ValueError(f"{root} holds no text file (non-empty, UTF-8, no NUL byte).")
    return docs
  blocks = [b.strip(b"\r\n") for b in _BLANK_LINES.split(root.read_bytes())]
  docs = [(f"{root.name}#{i}", b) for i, b in enumerate(b for b in blocks if b.strip())]
  if not docs:
    raise ValueError(f"{root} is empty: it holds no text.")
  return docs


def _walk(root: Path, excluded: frozenset[str], skip_hidden: bool = False):
  """Sorted ``(relpath, path)`` of the regular files under ``root``."""
  found = []
  for folder, dirs, files in os.walk(root):
    dirs[:] = [
      d for d in dirs if d not in excluded and not (skip_hidden and d.startswith("."))
    ]
    for name in files:
      file = Path(folder, name)
      if not (skip_hidden and name.startswith(".")) and file.is_file():
        found.append((file.relative_to(root).as_posix(), file))
  return sorted(found)


def _is_text(content: bytes) -> bool:
  if b"\0" in content:
    return False
  try:
    content.decode("utf-8")
  except UnicodeDecodeError:
    return False
  return True


def is_validation(relpath: str) -> bool:
  """The split rule: ``sha256(relpath)[0] < VALIDATION_THRESHOLD`` (about 5 %)."""
  return hashlib.sha256(relpath.encode("utf-8")).digest()[0] < VALIDATION_THRESHOLD


def split_documents(relpaths: list[str]) -> list[bool]:
  """Whether each document is in validation, by ``is_validation``.

  So that both splits are non-empty (a small corpus), if no document falls in
  validation the one of smallest ``sha256(relpath)`` does, and if all do the
  one of largest digest goes to train. Both depend on the paths alone.

  Args:
    relpaths: the documents' relative paths, at least two.

  Returns:
    One flag per document, ``True`` for validation.

  Raises:
    ValueError: fewer than two documents.
  """
  if len(relpaths) < 2:
    raise ValueError(
      f"{len(relpaths)} document(s) cannot be split into train and validation; "
      f"give at least two files, or a file with at least two blank-line-"
      f"separated blocks."
    )
  flags = [is_validation(p) for p in relpaths]
  digests = [hashlib.sha256(p.encode("utf-8")).digest() for p in relpaths]
  if not any(flags):
    flags[digests.index(min(digests))] = True
  elif all(flags):
    flags[digests.index(max(digests))] = False
  return flags


def corpus_sha256(documents: list[tuple[str, bytes]]) -> str:
  """The corpus's identity: SHA-256 of its paths and bytes, in order.

  The hashed bytes are ``_HASH_TAG`` (naming this reading and split rule), then
  for each document in order ``relpath + b"\\0" + str(len) + b"\\0" + bytes``
  (UTF-8 path, decimal length). Equal digests mean the same documents under the
  same paths, hence the same split and streams. The default corpus's digest
  changes with the Python version (and distribution) whose stdlib it reads.

  Args:
    documents: ``(relpath, bytes)`` pairs.

  Returns:
    The hex digest.

  Examples:
    >>> corpus_sha256([("a", b"x")]) == corpus_sha256([("b", b"x")])
    False
  """
  h = hashlib.sha256(_HASH_TAG)
  for rel, content in documents:
    h.update(b"%s\0%d\0" % (rel.encode("utf-8"), len(content)))
    h.update(content)
  return h.hexdigest()


def read_corpus(path: str | Path | None = None) -> Corpus:
  """Reads, splits by document and hashes a corpus.

  Args:
    path: a text file or directory (``read_documents``); ``None`` for the
      Python standard library's source (``stdlib_documents``).

  Returns:
    A ``Corpus``.

  Raises:
    DatasetNotFoundError: ``path`` does not exist.
    ValueError: no text, or fewer than two documents.
  """
  if path is None:
    docs = stdlib_documents()
    source = (
      f"Python {platform.python_version()} standard library source "
      f"({stdlib_root()}, .py files without tests)"
    )
  else:
    docs = read_documents(path)
    source = f"text of {Path(path)}"
  flags = split_documents([rel for rel, _ in docs])
  sep = bytes([SEPARATOR])

  def stream(keep):
    chosen = [d for d, f in zip(docs, flags, strict=True) if f == keep]
    joined = b"".join(b for _, content in chosen for b in (content, sep))
    return np.frombuffer(joined, np.uint8), tuple(rel for rel, _ in chosen)

  (train, train_docs), (val, val_docs) = stream(False), stream(True)
  return Corpus(
    train,
    val,
    train_docs,
    val_docs,
    corpus_sha256(docs),
    f"{source}: {len(train_docs)} + {len(val_docs)} documents, "
    f"{len(train):,} train + {len(val):,} validation bytes",
  )


class ByteWindows:
  """Windows of a byte stream that index like an int32 ``(n, context)`` array.

  Row ``i`` is ``stream[i * stride + offset : i * stride + offset + context]``
  for ``i < n = (len(stream) - context - 1) // stride + 1``, the number of
  windows of ``context + 1`` bytes at multiples of ``stride``. Inputs use
  ``offset=0`` and targets ``offset=1``. Only the rows asked for are built.

  Attributes:
    stream: the uint8 stream.
    context: bytes per row.
    stride: bytes between the starts of consecutive rows.
    offset: 0 for inputs, 1 for targets.
  """

  dtype = np.dtype(np.int32)
  ndim = 2

  def __init__(self, stream: np.ndarray, context: int, stride: int, offset: int):
    if context < 1 or stride < 1:
      raise ValueError(f"context and stride must be positive, got {context}, {stride}.")
    self.stream = np.asarray(stream, np.uint8)
    self.context, self.stride, self.offset = context, stride, offset
    self._len = max(0, (len(self.stream) - context - 1) // stride + 1)

  @property
  def shape(self) -> tuple[int, int]:
    return (self._len, self.context)

  def __len__(self) -> int:
    return self._len

  def __getitem__(self, key) -> np.ndarray:
    rows = np.arange(self._len)[key]
    starts = rows[..., None] * self.stride + self.offset
    return self.stream[starts + np.arange(self.context)].astype(np.int32)

  def __array__(self, dtype=None, copy=None) -> np.ndarray:
    del copy  # Always a fresh array.
    out = self[:]
    return out if dtype is None else out.astype(dtype)


def default_stride(stream_len: int, context: int) -> int:
  """The smallest stride giving at most ``MAX_TRAIN_WINDOWS`` windows."""
  return max(1, math.ceil((stream_len - context) / MAX_TRAIN_WINDOWS))


def eval_windows(
  stream: np.ndarray, context: int, max_windows: int = MAX_EVAL_WINDOWS
) -> tuple[np.ndarray, np.ndarray]:
  """A fixed set of non-overlapping windows of a stream, for evaluation.

  Window ``k`` starts at byte ``k * context``: its input is ``context`` bytes
  and its target the ``context`` bytes one further on, so the targets of all
  ``m = (len(stream) - 1) // context`` windows cover the stream once. If ``m``
  exceeds ``max_windows``, windows ``(j * m) // max_windows`` for ``j <
  max_windows`` are kept, spread evenly over the stream.

  Args:
    stream: uint8 bytes.
    context: bytes per window.
    max_windows: the cap.

  Returns:
    int32 inputs and targets, each ``(min(m, max_windows), context)``.
  """
  m = (len(stream) - 1) // context
  k = np.arange(m) if m <= max_windows else (np.arange(max_windows) * m) // max_windows
  x = ByteWindows(stream, context, context, 0)
  y = ByteWindows(stream, context, context, 1)
  return x[k], y[k]


def unigram_bits_per_byte(train: np.ndarray, targets: np.ndarray) -> float:
  """Cross-entropy in bits per byte of the add-one unigram model of ``train``.

  .. math::

    p(b) = \\frac{c_b + 1}{N + 256}, \\qquad
    H = -\\frac{1}{|T|} \\sum_{t \\in T} \\log_2 p(t),

  with ``c_b`` the count of byte ``b`` among the ``N`` train bytes and ``T``
  the targets. A model's mean loss in nats is ``H * ln 2`` at the same level.

  Args:
    train: the bytes the model is fitted on (e.g. ``Corpus.train``).
    targets: the bytes it is scored on (e.g. ``Corpus.validation``, or the
      targets of ``eval_windows``).

  Returns:
    Bits per byte.

  Examples:
    >>> round(unigram_bits_per_byte(np.array([0, 0, 1, 1]), np.array([0, 1])), 4)
    6.4374
  """
  counts = byte_counts(train) + 1.0
  log_p = np.log2(counts) - np.log2(counts.sum())
  seen = byte_counts(targets)
  return float(-(seen * log_p).sum() / seen.sum())


def byte_counts(stream, chunk: int = 1 << 20) -> np.ndarray:
  """float64 ``(256,)`` occurrences of each byte value, counted chunk by chunk.

  ``np.bincount`` widens its input to int64; chunks keep that copy small.
  """
  a = np.asarray(stream).ravel()
  if a.size and not (0 <= a.min() and a.max() < VOCAB_SIZE):
    raise ValueError(f"bytes must lie in [0, {VOCAB_SIZE}), got {a.min()}..{a.max()}.")
  counts = np.zeros(VOCAB_SIZE, np.float64)
  for start in range(0, a.size, chunk):
    counts += np.bincount(a[start : start + chunk], minlength=VOCAB_SIZE)
  return counts


def load_text(
  path: str | Path | None = None,
  context: int = 128,
  stride: int | None = None,
  max_eval_windows: int = MAX_EVAL_WINDOWS,
) -> data.Dataset:
  """Byte-level language-modelling windows of a corpus (``read_corpus``).

  Args:
    path: a text file or directory; ``None`` for the standard library source.
    context: bytes per window (the targets are the next ``context`` bytes).
    stride: bytes between train window starts; ``None`` picks
      ``default_stride`` (at most ``MAX_TRAIN_WINDOWS`` windows, so each
      epoch's permutation stays small).
    max_eval_windows: cap on the validation windows (``eval_windows``).

  Returns:
    A ``Dataset`` named ``"text"``: ``x_train`` / ``y_train`` are
    ``ByteWindows`` of the train stream (``x_train.stream``), ``x_test`` /
    ``y_test`` int32 arrays of validation windows; ``num_classes =
    vocab_size = 256``; ``sha256`` and ``description`` from the corpus (the
    description adds the window counts and the unigram baseline on the
    validation stream).

  Raises:
    DatasetNotFoundError: ``path`` does not exist.
    ValueError: no text, a bad argument, or a split shorter than one window of
      ``context + 1`` bytes.
  """
  if context < 1:
    raise ValueError(f"context must be a positive int, got {context}.")
  if stride is not None and stride < 1:
    raise ValueError(f"stride must be a positive int or None, got {stride}.")
  if max_eval_windows < 1:
    raise ValueError(f"max_eval_windows must be positive, got {max_eval_windows}.")
  corpus = read_corpus(path)
  short = [
    f"{name} has {len(s)} bytes"
    for name, s in (("train", corpus.train), ("validation", corpus.validation))
    if len(s) < context + 1
  ]
  if short:
    raise ValueError(
      f"corpus too small for one window of context + 1 = {context + 1} bytes in "
      f"each split: {' and '.join(short)} ({corpus.description})."
    )
  if stride is None:
    stride = default_stride(len(corpus.train), context)
  x_train = ByteWindows(corpus.train, context, stride, 0)
  y_train = ByteWindows(corpus.train, context, stride, 1)
  x_test, y_test = eval_windows(corpus.validation, context, max_eval_windows)
  baseline = unigram_bits_per_byte(corpus.train, corpus.validation)
  return data.Dataset(
    "text",
    x_train,
    y_train,
    x_test,
    y_test,
    num_classes=VOCAB_SIZE,
    vocab_size=VOCAB_SIZE,
    sha256=corpus.sha256,
    description=(
      f"{corpus.description}; {len(x_train):,} train windows (stride {stride}), "
      f"{len(x_test):,} validation windows of context {context}; unigram "
      f"baseline {baseline:.4f} bits/byte"
    ),
  )
