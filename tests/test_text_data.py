"""Byte-level text data (``train/text.py``): split, identity, windows, baseline."""

import hashlib
import itertools
import json
import math
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from train import data, text

ROOT = pathlib.Path(__file__).resolve().parent.parent
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def write_letters(root, n=30):
  """``n`` documents, document ``i`` one letter repeated ``20 + i`` times."""
  for i in range(n):
    folder = root / ("sub" if i % 3 else "")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"doc{i:02d}.txt").write_text(LETTERS[i] * (20 + i))
  return root


def letters_of(corpus_docs):
  return {pathlib.PurePosixPath(rel).name for rel in corpus_docs}


def take(it, k):
  return list(itertools.islice(it, k))


@pytest.fixture(scope="module")
def stdlib_corpus():
  return text.read_corpus()


# -- identity and split -------------------------------------------------------------

_CHILD = """
import hashlib, json, sys
from train import text
out = {}
for key, path in json.loads(sys.argv[1]).items():
  c = text.read_corpus(path)
  out[key] = [c.sha256, c.train_documents, c.validation_documents,
              hashlib.sha256(c.train).hexdigest(),
              hashlib.sha256(c.validation).hexdigest()]
print(json.dumps(out))
"""


def summary(c):
  return [
    c.sha256,
    list(c.train_documents),
    list(c.validation_documents),
    hashlib.sha256(c.train).hexdigest(),
    hashlib.sha256(c.validation).hexdigest(),
  ]


def test_hash_and_split_equal_in_a_fresh_process(tmp_path, stdlib_corpus):
  write_letters(tmp_path)
  paths = {"tmp": str(tmp_path), "stdlib": None}
  child = subprocess.run(
    [sys.executable, "-c", _CHILD, json.dumps(paths)],
    cwd=ROOT,
    env={"PYTHONHASHSEED": "12345", "PATH": ""},  # Another str hash seed.
    capture_output=True,
    text=True,
    check=True,
  )
  theirs = json.loads(child.stdout)
  assert theirs["tmp"] == summary(text.read_corpus(tmp_path))
  assert theirs["stdlib"] == summary(stdlib_corpus)


def test_hash_names_paths_and_bytes_not_location(tmp_path):
  a = write_letters(tmp_path / "a")
  b = shutil.copytree(a, tmp_path / "b")
  digest = text.read_corpus(a).sha256
  assert text.read_corpus(b).sha256 == digest
  (b / "doc00.txt").write_text("AAAA")
  assert text.read_corpus(b).sha256 != digest
  (b / "doc00.txt").write_text(LETTERS[0] * 20)
  assert text.read_corpus(b).sha256 == digest
  (b / "doc00.txt").rename(b / "doc99.txt")
  assert text.read_corpus(b).sha256 != digest


def test_split_by_document_and_windows_stay_in_their_split(tmp_path):
  write_letters(tmp_path)
  (tmp_path / ".hidden.txt").write_text("hidden")  # Skipped: hidden.
  (tmp_path / "image.bin").write_bytes(b"\x89PNG\0\x01")  # Skipped: not text.
  (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))  # Not UTF-8.
  c = text.read_corpus(tmp_path)
  train, val = c.train_documents, c.validation_documents
  assert set(train).isdisjoint(val) and len(train) + len(val) == 30
  assert sorted(train) == list(train) and sorted(val) == list(val)
  assert val and all(text.is_validation(p) for p in val)  # No fallback needed.
  assert not any(text.is_validation(p) for p in train)
  # Each document is one letter, so a window's letters name its documents.
  letter = {f"doc{i:02d}.txt": ord(LETTERS[i]) for i in range(30)}
  ds = text.load_text(tmp_path, context=8, stride=1)
  for x, y, docs in (
    (np.asarray(ds.x_train), np.asarray(ds.y_train), train),
    (ds.x_test, ds.y_test, val),
  ):
    allowed = {text.SEPARATOR} | {letter[d] for d in letters_of(docs)}
    assert set(np.unique(x)) | set(np.unique(y)) <= allowed
  assert len(ds.x_train) == len(c.train) - 8  # Stride 1: every start.


def test_small_corpus_keeps_both_splits_non_empty(tmp_path):
  for name in ("a.txt", "b.txt"):  # Neither name's digest is below 13.
    (tmp_path / name).write_text(name * 10)
  assert not any(map(text.is_validation, ["a.txt", "b.txt"]))
  c = text.read_corpus(tmp_path)
  assert len(c.train_documents) == len(c.validation_documents) == 1


def test_single_file_documents_are_blank_line_blocks(tmp_path):
  blocks = [f"paragraph {i}\nline two of {i}" for i in range(40)]
  file = tmp_path / "book.txt"
  file.write_text("\n\n".join(blocks[:20]) + "\n \n\t\n" + "\n\n\n".join(blocks[20:]))
  c = text.read_corpus(file)
  names = [f"book.txt#{i}" for i in range(40)]
  assert sorted(c.train_documents + c.validation_documents) == sorted(names)
  assert c.validation_documents and c.train_documents
  expected = b"".join(blocks[int(n.split("#")[1])].encode() + b"\0" for n in names)
  joined = b"".join(
    blocks[int(n.split("#")[1])].encode() + b"\0" for n in c.validation_documents
  )
  assert bytes(c.validation) == joined and len(c.train) + len(joined) == len(expected)


# -- windows and batches ----------------------------------------------------------


def test_targets_are_inputs_shifted_by_one_byte(tmp_path):
  write_letters(tmp_path)
  for name in ("mixed1.txt", "mixed2.txt"):
    (tmp_path / name).write_text("The quick brown fox jumps over the lazy dog. " * 4)
  ds = text.load_text(tmp_path, context=10, stride=3)
  stream = ds.x_train.stream
  x, y = np.asarray(ds.x_train), np.asarray(ds.y_train)
  assert x.shape == y.shape == (len(ds.x_train), 10) and x.dtype == np.int32
  assert len(x) == (len(stream) - 11) // 3 + 1
  for i in (0, 1, len(x) // 2, len(x) - 1):
    np.testing.assert_array_equal(x[i], stream[3 * i : 3 * i + 10])
    np.testing.assert_array_equal(y[i], stream[3 * i + 1 : 3 * i + 11])
  np.testing.assert_array_equal(y[:, :-1], x[:, 1:])
  np.testing.assert_array_equal(ds.x_train[[4, 2]], x[[4, 2]])  # Lazy = eager.
  # Validation windows: consecutive, non-overlapping, also shifted by one.
  np.testing.assert_array_equal(ds.y_test[:, :-1], ds.x_test[:, 1:])
  np.testing.assert_array_equal(ds.x_test[1:, 0], ds.y_test[:-1, -1])


def test_batches_resume_gives_the_same_windows(tmp_path):
  write_letters(tmp_path)
  ds = text.load_text(tmp_path, context=6, stride=5)

  def run(start, **kwargs):
    it = data.batches(ds.x_train, ds.y_train, 16, seed=3, start_step=start, **kwargs)
    return take(it, 40 - start)

  full = run(0)
  per_epoch = data.steps_per_epoch(len(ds.x_train), 16)
  assert 1 < per_epoch < 40  # The run crosses epochs.
  for start in (1, per_epoch, 37):
    for (x, y), (xr, yr) in zip(full[start:], run(start), strict=True):
      np.testing.assert_array_equal(x, xr)
      np.testing.assert_array_equal(y, yr)
  halves = [run(5, process_index=p, process_count=2) for p in range(2)]
  np.testing.assert_array_equal(
    np.concatenate([halves[0][3][0], halves[1][3][0]]), full[8][0]
  )


def test_eval_windows_cap_spreads_evenly():
  stream = np.arange(101, dtype=np.uint8)
  x, y = text.eval_windows(stream, context=10)
  assert x.shape == (10, 10)
  np.testing.assert_array_equal(x[:, 0], np.arange(0, 100, 10))
  x, y = text.eval_windows(stream, context=10, max_windows=4)
  np.testing.assert_array_equal(x[:, 0], [0, 20, 50, 70])  # Windows 0, 2, 5, 7.
  np.testing.assert_array_equal(y, x + 1)


# -- registry and errors -------------------------------------------------------------


def test_registered_in_data_load(tmp_path):
  write_letters(tmp_path)
  assert "text" in data.NAMES
  ds = data.load("text", path=tmp_path, context=8)
  assert ds.name == "text" and ds.num_classes == ds.vocab_size == 256
  assert ds.input_shape == (8,) and ds.sha256 == text.read_corpus(tmp_path).sha256
  again = data.load("text", tmp_path, context=8)  # data_dir as the path.
  np.testing.assert_array_equal(again.x_test, ds.x_test)
  syn = data.load(
    "text", synthetic=True, seed=1, num_train=40, num_test=8, context=16, path="x"
  )
  assert syn.x_train.shape == (40, 16) and syn.x_test.shape == (8, 16)
  assert syn.num_classes == 256 and syn.y_train.max() < 256
  np.testing.assert_array_equal(syn.y_train[:, :-1], syn.x_train[:, 1:])


def test_missing_empty_and_too_small_name_the_path(tmp_path):
  missing = tmp_path / "nowhere"
  with pytest.raises(data.DatasetNotFoundError, match=str(missing)):
    data.load("text", path=missing)
  empty = tmp_path / "empty.txt"
  empty.write_text("")
  with pytest.raises(ValueError, match=str(empty)):
    text.load_text(empty)
  blank = tmp_path / "blank.txt"
  blank.write_text("\n  \n\t\n")
  with pytest.raises(ValueError, match=str(blank)):
    text.load_text(blank)
  folder = tmp_path / "folder"
  folder.mkdir()
  with pytest.raises(ValueError, match=str(folder)):
    text.load_text(folder)
  (folder / "data.bin").write_bytes(b"\0\1\2")
  with pytest.raises(ValueError, match=str(folder)):
    text.load_text(folder)
  one = tmp_path / "one.txt"
  one.write_text("a single block\nof two lines\n")
  with pytest.raises(ValueError, match="cannot be split"):
    text.load_text(one)
  write_letters(tmp_path / "small", n=4)
  with pytest.raises(ValueError, match=r"too small for one window of context \+ 1"):
    text.load_text(tmp_path / "small", context=64)


# -- unigram baseline -------------------------------------------------------------


def test_unigram_baseline_closed_form():
  # Train "aab": p(a) = 3 / 259, p(b) = 2 / 259 after add-one over 256 bytes.
  got = text.unigram_bits_per_byte(np.frombuffer(b"aab", np.uint8), [97, 98])
  want = (math.log2(259 / 3) + math.log2(259 / 2)) / 2
  assert got == pytest.approx(want, rel=1e-12)


def test_unigram_baseline_by_hand_on_a_corpus(tmp_path):
  for i in range(12):
    (tmp_path / f"{i}.txt").write_text("ab" * (i + 1) + "b" * i)
  c = text.read_corpus(tmp_path)
  train, val = bytes(c.train), bytes(c.validation)
  total = len(train) + 256
  bits = [-math.log2((train.count(bytes([b])) + 1) / total) for b in val]
  got = text.unigram_bits_per_byte(c.train, c.validation)
  assert got == pytest.approx(sum(bits) / len(bits), rel=1e-12)


# -- the default corpus ---------------------------------------------------------------


def test_default_corpus_sizes_split_and_hash(stdlib_corpus):
  c = stdlib_corpus
  root = text.stdlib_root()
  files = sorted(
    p.relative_to(root).as_posix()
    for p in root.rglob("*.py")
    if not text.EXCLUDED_DIRS & set(p.relative_to(root).parts[:-1])
  )
  assert sorted(c.train_documents + c.validation_documents) == files
  assert "os.py" in files and not any(f.startswith("test/") for f in files)
  assert list(c.validation_documents) == [f for f in files if text.is_validation(f)]
  assert 0.02 < len(c.validation_documents) / len(files) < 0.10  # 13/256 = 5 %.
  sizes = {f: (root / f).stat().st_size for f in files}
  assert len(c.train) == sum(sizes[f] + 1 for f in c.train_documents)
  assert len(c.validation) == sum(sizes[f] + 1 for f in c.validation_documents)
  # The docstring's definition of the digest, recomputed here.
  h = hashlib.sha256(text._HASH_TAG)
  for f in files:
    content = (root / f).read_bytes()
    h.update(f.encode() + b"\0" + str(len(content)).encode() + b"\0" + content)
  assert c.sha256 == h.hexdigest()
  # The add-one unigram cross-entropy is at least the validation bytes' own
  # entropy (Gibbs' inequality). Python source is mostly lower-case English
  # words, spaces and punctuation: English letters alone carry about 4.1 bits
  # (Shannon 1951, F1), case, digits and symbols add to it, and the ~95
  # printable ASCII bytes used uniformly would give log2(95) = 6.6 bits.
  # So 4 to 6 bits per byte; Python 3.11 measures 4.96.
  baseline = text.unigram_bits_per_byte(c.train, c.validation)
  freq = np.bincount(c.validation, minlength=256) / len(c.validation)
  entropy = -(freq[freq > 0] * np.log2(freq[freq > 0])).sum()
  assert entropy <= baseline and 4 < baseline < 6
  ds = text.load_text(context=128)
  windows = min(text.MAX_EVAL_WINDOWS, (len(c.validation) - 1) // 128)
  assert len(ds.x_train) <= text.MAX_TRAIN_WINDOWS and ds.x_test.shape == (windows, 128)
  np.testing.assert_array_equal(ds.x_train.stream, c.train)
