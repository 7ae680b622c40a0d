"""Datasets of the training program and their deterministic, sharded batches.

Five datasets (DESIGN §3): scikit-learn's bundled ``digits`` (the default
config), the papers' ``cifar10``, ``imagenet`` and ``ptb`` read from the
standard on-disk layouts under a ``data_dir``, and byte-level ``text``
(``train/text.py``: the Python standard library's source, or a user's text).
A missing dataset raises ``DatasetNotFoundError`` naming the expected files
and the directory looked in; ``synthetic=True`` gives random data of the same
shapes for speed runs.

Every dataset is a ``Dataset`` of host-memory arrays, and ``batches`` walks it in
an order fixed by ``(seed, epoch)`` alone: the global batch of a step is the same
whatever the number of processes, each process reads only its contiguous slice
of it, and an iterator started at ``start_step`` resumes an interrupted run
exactly.

Examples:
  >>> ds = load("digits")
  >>> ds.x_train.shape, ds.num_classes
  ((1437, 8, 8, 1), 10)
  >>> x, y = next(batches(ds.x_train, ds.y_train, global_batch=64, seed=0))
  >>> x.shape, y.dtype
  ((64, 8, 8, 1), dtype('int32'))
"""

from __future__ import annotations

import dataclasses
import math
import pickle
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

NAMES = ("digits", "cifar10", "imagenet", "ptb", "text")

# Per-channel statistics of the training sets (RGB, on [0, 1] pixels).
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

_CIFAR_DIR = "cifar-10-batches-py"
_CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
_CIFAR_TEST = "test_batch"
_IMAGE_SUFFIXES = frozenset({".jpeg", ".jpg", ".png"})
_PTB_FILES = ("ptb.train.txt", "ptb.valid.txt")
_EOS, _UNK = "<eos>", "<unk>"
# The digits split is fixed, not drawn from the run's seed, so every run of
# every config is evaluated on the same 360 images.
_DIGITS_SPLIT_SEED = 0
_DIGITS_TEST_FRACTION = 0.2


class DatasetNotFoundError(FileNotFoundError):
  """A dataset's files are missing; the message names them and the directory."""


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
  """A dataset held in host memory.

  Images are float32 NHWC, normalised; labels int32. For ``ptb`` each row of
  ``x`` is a window of ``seq_len`` token ids and the same row of ``y`` the next
  tokens (see ``load_ptb``); for ``text`` likewise of ``context`` bytes (see
  ``text.load_text``). For ``imagenet`` the images are an ``ImageFiles``,
  and the ``text`` train windows a ``text.ByteWindows``: they index like an
  array but build only the rows asked for.

  Attributes:
    name: one of ``NAMES``.
    x_train: inputs, shape ``(n_train, ...)``.
    y_train: int32 targets, shape ``(n_train,)`` or ``(n_train, seq_len)``.
    x_test: inputs, shape ``(n_test, ...)``.
    y_test: int32 targets, shape ``(n_test,)`` or ``(n_test, seq_len)``.
    num_classes: number of classes (the vocabulary size for ``ptb`` and
      ``text``).
    vocab_size: the vocabulary size for ``ptb`` and ``text``, else ``None``.
    vocab: the words of the ``ptb`` vocabulary in id order, else ``None``.
    sha256: hex SHA-256 identifying a ``text`` corpus
      (``text.corpus_sha256``), else ``None``.
    description: what was read and its sizes (``text``), else ``None``.
  """

  name: str
  x_train: Any
  y_train: np.ndarray
  x_test: Any
  y_test: np.ndarray
  num_classes: int
  vocab_size: int | None = None
  vocab: tuple[str, ...] | None = None
  sha256: str | None = None
  description: str | None = None

  @property
  def token(self) -> str | None:
    """What one target of a language-model dataset is (``byte``, ``word``), else None."""
    return {"text": "byte", "ptb": "word"}.get(self.name)

  @property
  def input_shape(self) -> tuple[int, ...]:
    """Shape of one example, e.g. ``(32, 32, 3)``."""
    return tuple(self.x_train.shape[1:])


# -- entry point --------------------------------------------------------------


def load(
  name: str,
  data_dir: str | Path | None = None,
  *,
  synthetic: bool = False,
  seed: int = 0,
  **kwargs: Any,
) -> Dataset:
  """Loads dataset ``name``, or random data of its shapes if ``synthetic``.

  Args:
    name: one of ``NAMES``.
    data_dir: directory holding the dataset; not used by ``digits`` nor by
      synthetic data. For ``text`` it is the ``path`` of the user's text when
      ``path`` is not given; neither gives the standard library's source.
    synthetic: return ``synthetic_like(name, seed=seed, **kwargs)`` instead.
    seed: seed of the synthetic data (real data does not depend on it).
    **kwargs: passed to the loader: ``image_size`` for ``imagenet``,
      ``seq_len`` and ``num_streams`` for ``ptb``, ``path``, ``context``,
      ``stride`` and ``max_eval_windows`` for ``text`` (``text.load_text``).

  Returns:
    A ``Dataset``.

  Raises:
    ValueError: ``name`` is unknown, or ``data_dir`` is needed and not given.
    DatasetNotFoundError: the dataset's files are not in ``data_dir``.
  """
  _check_name(name)
  if synthetic:
    return synthetic_like(name, seed=seed, **kwargs)
  if name == "digits":
    return load_digits(**kwargs)
  if name == "text":
    from train import text  # Imported on use: text imports this module.

    path = kwargs.pop("path", None)
    return text.load_text(data_dir if path is None else path, **kwargs)
  if data_dir is None:
    raise ValueError(
      f"dataset {name!r} reads its files from a data_dir, and none was given; "
      f"set data_dir, or synthetic=True for random data of the same shapes."
    )
  loaders = {
    "cifar10": load_cifar10,
    "imagenet": load_imagenet_folder,
    "ptb": load_ptb,
  }
  return loaders[name](data_dir, **kwargs)


def _check_name(name: str) -> None:
  if name not in NAMES:
    raise ValueError(f"unknown dataset {name!r}; valid names are {', '.join(NAMES)}.")


# -- digits ---------------------------------------------------------------------


def load_digits() -> Dataset:
  """scikit-learn's bundled 8x8 digits, split 1437 / 360 by a fixed permutation.

  Pixels (0..16) are scaled to [0, 1]; images are ``(N, 8, 8, 1)`` float32.
  """
  from sklearn import datasets  # Imported on use: only digits needs it.

  bunch = datasets.load_digits()
  x = (bunch.images / 16.0).astype(np.float32)[..., None]
  y = bunch.target.astype(np.int32)
  order = np.random.default_rng(_DIGITS_SPLIT_SEED).permutation(len(y))
  n_test = math.ceil(_DIGITS_TEST_FRACTION * len(y))  # As sklearn rounds it.
  train, test = order[n_test:], order[:n_test]
  return Dataset("digits", x[train], y[train], x[test], y[test], num_classes=10)


# -- CIFAR-10 -------------------------------------------------------------------


def load_cifar10(data_dir: str | Path) -> Dataset:
  """CIFAR-10 from the pickled "python version" batches.

  Reads ``data_batch_1`` .. ``data_batch_5`` and ``test_batch`` from
  ``data_dir/cifar-10-batches-py/`` (or from ``data_dir`` itself when the
  batches lie there): dicts with ``b"data"``, uint8 ``(N, 3072)`` in CHW order,
  and ``b"labels"``. Images become float32 ``(N, 32, 32, 3)``, normalised per
  channel with ``CIFAR10_MEAN`` / ``CIFAR10_STD``.

  Args:
    data_dir: the directory holding ``cifar-10-batches-py/``.

  Returns:
    A ``Dataset`` with 50,000 / 10,000 images for the full dataset.

  Raises:
    DatasetNotFoundError: a batch file is missing.
  """
  root = Path(data_dir)
  folder = root / _CIFAR_DIR
  if not (folder / _CIFAR_TRAIN[0]).exists() and (root / _CIFAR_TRAIN[0]).exists():
    folder = root
  names = (*_CIFAR_TRAIN, _CIFAR_TEST)
  missing = [n for n in names if not (folder / n).is_file()]
  if missing:
    raise DatasetNotFoundError(
      f"CIFAR-10 not found: expected the python-version batches "
      f"{', '.join(names)} in {folder} (missing: {', '.join(missing)}). "
      f"Download and unpack cifar-10-python.tar.gz from "
      f"https://www.cs.toronto.edu/~kriz/cifar.html into {root}."
    )
  parts = [_read_cifar_batch(folder / n) for n in _CIFAR_TRAIN]
  x_train = np.concatenate([x for x, _ in parts])
  y_train = np.concatenate([y for _, y in parts])
  x_test, y_test = _read_cifar_batch(folder / _CIFAR_TEST)
  return Dataset(
    "cifar10",
    _normalize(x_train, CIFAR10_MEAN, CIFAR10_STD),
    y_train,
    _normalize(x_test, CIFAR10_MEAN, CIFAR10_STD),
    y_test,
    num_classes=10,
  )


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
  """uint8 NHWC images and int32 labels of one pickled batch."""
  with open(path, "rb") as f:
    batch = pickle.load(f, encoding="bytes")  # Python 2 pickles with bytes keys.
  data = np.asarray(batch[b"data"], np.uint8)
  x = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
  return x, np.asarray(batch[b"labels"], np.int32)


def _normalize(pixels: np.ndarray, mean: Sequence[float], std: Sequence[float]):
  """uint8 (..., C) pixels to float32 ``(pixels / 255 - mean) / std``."""
  x = pixels.astype(np.float32) / np.float32(255)
  return (x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)


# -- ImageNet -------------------------------------------------------------------


class ImageFiles:
  """Image files that index like a float32 ``(N, size, size, 3)`` array.

  Indexing (an int, a slice or an integer array) decodes just those files with
  Pillow: RGB, the shorter side resized to ``size`` (bilinear), center-cropped
  to ``size x size``, normalised with ``IMAGENET_MEAN`` / ``IMAGENET_STD``. So a
  process decodes only the rows of its own shard of each batch.

  Attributes:
    paths: the files, in example order.
    size: side of the square output images.
  """

  dtype = np.dtype(np.float32)
  ndim = 4

  def __init__(self, paths: Sequence[Path], size: int):
    self.paths = tuple(paths)
    self.size = size

  @property
  def shape(self) -> tuple[int, int, int, int]:
    return (len(self.paths), self.size, self.size, 3)

  def __len__(self) -> int:
    return len(self.paths)

  def __getitem__(self, key) -> np.ndarray:
    rows = np.arange(len(self.paths))[key]
    if rows.ndim == 0:
      return self._decode(self.paths[int(rows)])
    out = np.empty((len(rows), self.size, self.size, 3), np.float32)
    for i, row in enumerate(rows):
      out[i] = self._decode(self.paths[int(row)])
    return out

  def __array__(self, dtype=None, copy=None) -> np.ndarray:
    del copy  # Always a fresh array.
    out = self[:]
    return out if dtype is None else out.astype(dtype)

  def _decode(self, path: Path) -> np.ndarray:
    from PIL import Image  # Imported on use: only imagenet needs it.

    s = self.size
    with Image.open(path) as image:
      image = image.convert("RGB")
      w, h = image.size
      scale = s / min(w, h)
      w, h = max(s, round(w * scale)), max(s, round(h * scale))
      image = image.resize((w, h), Image.Resampling.BILINEAR)
      left, top = (w - s) // 2, (h - s) // 2
      image = image.crop((left, top, left + s, top + s))
      return _normalize(np.asarray(image), IMAGENET_MEAN, IMAGENET_STD)


def load_imagenet_folder(data_dir: str | Path, image_size: int = 224) -> Dataset:
  """ImageNet (or any image classification set) from an image-folder layout.

  Reads ``data_dir/train/<class>/<image>.JPEG`` and
  ``data_dir/val/<class>/<image>.JPEG`` (``.jpeg``, ``.jpg`` and ``.png`` in
  any case). Classes are the sorted names of the ``train`` subdirectories;
  ``val`` must use the same names. Images decode lazily (see ``ImageFiles``);
  labels are in memory.

  Args:
    data_dir: the directory holding ``train/`` and ``val/``.
    image_size: side of the square images, e.g. 224.

  Returns:
    A ``Dataset`` whose ``x_train`` / ``x_test`` are ``ImageFiles``.

  Raises:
    DatasetNotFoundError: ``train/`` or ``val/`` is missing or holds no images.
    ValueError: ``val/`` has a class that ``train/`` lacks, or ``image_size``
      is not positive.
  """
  if image_size < 1:
    raise ValueError(f"image_size must be a positive int, got {image_size}.")
  root = Path(data_dir)
  train = _image_folder(root, "train")
  classes = sorted(train)
  index = {c: i for i, c in enumerate(classes)}
  val = _image_folder(root, "val")
  unknown = sorted(set(val) - set(classes))
  if unknown:
    raise ValueError(
      f"{root / 'val'} has classes absent from {root / 'train'}: {unknown[:5]}."
    )

  def split(folder):
    pairs = [(p, index[c]) for c in sorted(folder) for p in folder[c]]
    return (
      ImageFiles([p for p, _ in pairs], image_size),
      np.asarray([label for _, label in pairs], np.int32),
    )

  x_train, y_train = split(train)
  x_test, y_test = split(val)
  return Dataset("imagenet", x_train, y_train, x_test, y_test, len(classes))


def _image_folder(root: Path, split: str) -> dict[str, list[Path]]:
  """``{class: sorted image paths}`` under ``root/split``; raises if empty."""
  folder = root / split
  found = {}
  if folder.is_dir():
    for d in sorted(p for p in folder.iterdir() if p.is_dir()):
      images = sorted(p for p in d.iterdir() if p.suffix.lower() in _IMAGE_SUFFIXES)
      if images:
        found[d.name] = images
  if not found:
    raise DatasetNotFoundError(
      f"ImageNet not found: expected images in the layout "
      f"{split}/<class>/<image>.JPEG (also train/ and val/ side by side) under "
      f"{root}, but {folder} "
      f"{'holds no images' if folder.is_dir() else 'does not exist'}."
    )
  return found


# -- Penn Treebank ----------------------------------------------------------------


def load_ptb(data_dir: str | Path, seq_len: int = 35, num_streams: int = 20) -> Dataset:
  """Word-level Penn Treebank for language modelling.

  Reads ``ptb.train.txt`` and ``ptb.valid.txt`` (the test split here is the
  validation file). Each line's words get ``"<eos>"`` appended; the vocabulary
  is the training words in order of first appearance, plus ``"<unk>"`` if
  absent, to which unknown validation words map. Each split's token stream is
  batchified into ``num_streams`` contiguous streams (``batchify``) and cut
  into windows of ``seq_len`` tokens; the targets are the inputs shifted by
  one token.

  Rows are window-major: row ``w * num_streams + s`` is window ``w`` of stream
  ``s``. So ``batches(..., global_batch=num_streams, shuffle=False)`` yields the
  classic truncated-BPTT batches, each row continuing the previous batch's row
  (carry the LSTM state across steps), while ``shuffle=True`` treats windows as
  independent sequences.

  Args:
    data_dir: the directory holding the ``ptb.*.txt`` files.
    seq_len: tokens per window (BPTT length).
    num_streams: number of parallel streams the token stream is split into.

  Returns:
    A ``Dataset`` of int32 ``(n, seq_len)`` inputs and targets.

  Raises:
    DatasetNotFoundError: a file is missing.
    ValueError: a split is too short for one window of every stream.
  """
  root = Path(data_dir)
  missing = [n for n in _PTB_FILES if not (root / n).is_file()]
  if missing:
    raise DatasetNotFoundError(
      f"Penn Treebank not found: expected {', '.join(_PTB_FILES)} in {root} "
      f"(missing: {', '.join(missing)}); they are in data/ of "
      f"http://www.fit.vutbr.cz/~imikolov/rnnlm/simple-examples.tgz."
    )
  train_words = _read_words(root / _PTB_FILES[0])
  vocab = list(dict.fromkeys(train_words))
  if _UNK not in vocab:
    vocab.append(_UNK)
  ids = {w: i for i, w in enumerate(vocab)}

  def split(name, words):
    tokens = np.asarray([ids.get(w, ids[_UNK]) for w in words], np.int32)
    try:
      return _windows(batchify(tokens, num_streams), seq_len)
    except ValueError as e:
      raise ValueError(f"{root / name}: {e}") from None

  x_train, y_train = split(_PTB_FILES[0], train_words)
  x_test, y_test = split(_PTB_FILES[1], _read_words(root / _PTB_FILES[1]))
  return Dataset(
    "ptb",
    x_train,
    y_train,
    x_test,
    y_test,
    num_classes=len(vocab),
    vocab_size=len(vocab),
    vocab=tuple(vocab),
  )


def _read_words(path: Path) -> list[str]:
  with open(path, encoding="utf-8") as f:
    return [w for line in f for w in (*line.split(), _EOS)]


def batchify(tokens: np.ndarray, num_streams: int) -> np.ndarray:
  """Splits a token stream into ``num_streams`` contiguous streams.

  Args:
    tokens: shape ``(n,)``.
    num_streams: number of rows.

  Returns:
    Shape ``(num_streams, n // num_streams)``: row ``s`` is the ``s``-th
    consecutive chunk of ``tokens``; the last ``n % num_streams`` tokens are
    dropped.
  """
  if num_streams < 1:
    raise ValueError(f"num_streams must be a positive int, got {num_streams}.")
  t = len(tokens) // num_streams
  return np.asarray(tokens[: num_streams * t]).reshape(num_streams, t)


def _windows(streams: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Window-major ``(inputs, targets)`` of ``(num_windows * num_streams, seq_len)``."""
  if seq_len < 1:
    raise ValueError(f"seq_len must be a positive int, got {seq_len}.")
  num_streams, t = streams.shape
  w = (t - 1) // seq_len  # Targets need one token past the last input.
  if w < 1:
    raise ValueError(
      f"{num_streams * t} tokens are too few for {num_streams} streams of "
      f"seq_len {seq_len} plus one target token."
    )

  def cut(offset):
    s = streams[:, offset : offset + w * seq_len].reshape(num_streams, w, seq_len)
    return np.ascontiguousarray(s.transpose(1, 0, 2).reshape(-1, seq_len))

  return cut(0), cut(1)


# -- synthetic ------------------------------------------------------------------

_SYNTHETIC_SIZES = {  # (n_train, n_test): small, so speed runs start at once.
  "digits": (1024, 256),
  "cifar10": (1024, 256),
  "imagenet": (128, 32),
  "ptb": (1024, 256),
  "text": (1024, 256),
}


def synthetic_like(
  name: str,
  *,
  seed: int = 0,
  num_train: int | None = None,
  num_test: int | None = None,
  image_size: int = 224,
  seq_len: int = 35,
  num_streams: int = 20,
  vocab_size: int = 10000,
  context: int = 128,
  path: Any = None,
) -> Dataset:
  """Random data with the shapes, dtypes and classes of dataset ``name``.

  Images are standard normal (as if normalised; digits uniform on [0, 1]) with
  uniform labels; ``ptb`` is a uniform token stream windowed like
  ``load_ptb``, so the targets are the inputs shifted by one; ``text`` is a
  uniform byte stream cut into consecutive windows of ``context`` bytes, the
  targets again shifted by one.

  Args:
    name: one of ``NAMES``.
    seed: seed of the data.
    num_train: training examples (windows for ``ptb``); a small default.
    num_test: test examples (windows for ``ptb``); a small default.
    image_size: image side for ``imagenet``.
    seq_len: window length for ``ptb``.
    num_streams: streams for ``ptb``.
    vocab_size: vocabulary size for ``ptb``.
    context: window length for ``text``.
    path: ignored (``text``'s corpus), so a config's dataset fields fit both.

  Returns:
    A ``Dataset``.
  """
  _check_name(name)
  default_train, default_test = _SYNTHETIC_SIZES[name]
  n_train = default_train if num_train is None else num_train
  n_test = default_test if num_test is None else num_test
  rng = np.random.default_rng(seed)
  del path  # Synthetic data reads nothing.
  if name == "text":

    def byte_windows(n):
      stream = rng.integers(0, 256, n * context + 1, np.int32)
      return _windows(batchify(stream, 1), context)

    (x_train, y_train), (x_test, y_test) = byte_windows(n_train), byte_windows(n_test)
    return Dataset(
      "text",
      x_train,
      y_train,
      x_test,
      y_test,
      256,
      vocab_size=256,
      description="synthetic: uniform random bytes",
    )
  if name == "ptb":

    def split(n):
      w = -(-n // num_streams)  # Whole windows per stream, then trim to n.
      tokens = rng.integers(0, vocab_size, num_streams * (w * seq_len + 1), np.int32)
      x, y = _windows(batchify(tokens, num_streams), seq_len)
      return x[:n], y[:n]

    (x_train, y_train), (x_test, y_test) = split(n_train), split(n_test)
    return Dataset(
      "ptb", x_train, y_train, x_test, y_test, vocab_size, vocab_size=vocab_size
    )
  shape, num_classes = {
    "digits": ((8, 8, 1), 10),
    "cifar10": ((32, 32, 3), 10),
    "imagenet": ((image_size, image_size, 3), 1000),
  }[name]

  def images(n):
    if name == "digits":
      return rng.random((n, *shape), np.float32)
    return rng.standard_normal((n, *shape), np.float32)

  def labels(n):
    return rng.integers(0, num_classes, n, np.int32)

  x_train, y_train = images(n_train), labels(n_train)
  x_test, y_test = images(n_test), labels(n_test)
  return Dataset(name, x_train, y_train, x_test, y_test, num_classes)


# -- batches ----------------------------------------------------------------------


def steps_per_epoch(num_examples: int, global_batch: int) -> int:
  """Full global batches in one pass; the last incomplete one is dropped."""
  return num_examples // global_batch


def batches(
  x: Any,
  y: np.ndarray,
  global_batch: int,
  seed: int,
  start_step: int = 0,
  process_index: int = 0,
  process_count: int = 1,
  *,
  shuffle: bool = True,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """Endless ``(x, y)`` batches: this process's slice of each step's global batch.

  Epoch ``e`` visits the examples in the order
  ``np.random.default_rng((seed, e)).permutation(n)`` (``arange(n)`` if not
  ``shuffle``), cut into ``steps_per_epoch`` global batches; the incomplete
  remainder is dropped. Global step ``t`` is batch ``t % steps_per_epoch`` of
  epoch ``t // steps_per_epoch``, so

  * the global batch of a step depends on ``seed`` and the step only: starting
    at ``start_step`` yields what an uninterrupted iterator yields from there
    (checkpoint resume), and the process count does not change it;
  * process ``p`` gets rows ``[p * b, (p + 1) * b)`` of it, with
    ``b = global_batch // process_count``: the concatenation over processes is
    the global batch, and a process indexes ``x`` only at its own rows (lazy
    ``ImageFiles`` decode just those). Splitting that slice evenly over the
    local devices in order gives each worker of a process-major mesh
    (``jax.devices()`` order) its own contiguous shard.

  Args:
    x: inputs, indexable by an int array along the first axis.
    y: targets, with ``len(y) == len(x)``.
    global_batch: examples per step over all processes.
    seed: seed of the order; a non-negative int.
    start_step: global step of the first batch yielded.
    process_index: this process, in ``[0, process_count)``.
    process_count: number of processes, dividing ``global_batch``.
    shuffle: permute each epoch; else keep the dataset order (e.g. stateful
      BPTT over ``load_ptb`` windows).

  Returns:
    An endless iterator of ``(x[rows], y[rows])`` with
    ``global_batch // process_count`` rows each.

  Raises:
    ValueError: inconsistent sizes or indices.
  """
  n = len(y)
  if len(x) != n:
    raise ValueError(f"x and y differ in length: {len(x)} != {n}.")
  if global_batch < 1:
    raise ValueError(f"global_batch must be a positive int, got {global_batch}.")
  if process_count < 1 or global_batch % process_count:
    raise ValueError(
      f"global_batch ({global_batch}) must be divisible by process_count "
      f"({process_count}): each process feeds an equal slice of every step."
    )
  if not 0 <= process_index < process_count:
    raise ValueError(
      f"process_index must be in [0, {process_count}), got {process_index}."
    )
  if start_step < 0:
    raise ValueError(f"start_step must be non-negative, got {start_step}.")
  per_epoch = steps_per_epoch(n, global_batch)
  if per_epoch < 1:
    raise ValueError(f"global_batch ({global_batch}) exceeds the {n} examples.")
  local = global_batch // process_count
  offset = process_index * local

  # A generator inside, so the checks above run at the call, not at first next().
  def generate():
    step, epoch, order = start_step, None, None
    while True:
      e, i = divmod(step, per_epoch)
      if e != epoch:
        epoch = e
        order = (
          np.random.default_rng((seed, e)).permutation(n) if shuffle else np.arange(n)
        )
      start = i * global_batch + offset
      rows = order[start : start + local]
      yield x[rows], y[rows]
      step += 1

  return generate()
