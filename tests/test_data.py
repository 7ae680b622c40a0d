"""Dataset loaders on tiny files in the real formats, and the batch iterator."""

import itertools
import pickle

import numpy as np
import pytest
from PIL import Image

from train import data

# -- CIFAR-10 -------------------------------------------------------------------


def write_cifar(root, n=4):
  """Python-version batches as the real archive holds them; returns the arrays."""
  folder = root / "cifar-10-batches-py"
  folder.mkdir()
  rng = np.random.default_rng(0)
  written = {}
  for i, name in enumerate([*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]):
    pixels = rng.integers(0, 256, (n, 3072), np.uint8)
    labels = [(i + j) % 10 for j in range(n)]
    batch = {
      b"batch_label": name.encode(),
      b"labels": labels,
      b"data": pixels,
      b"filenames": [f"{j}.png".encode() for j in range(n)],
    }
    with open(folder / name, "wb") as f:
      pickle.dump(batch, f, protocol=2)
    written[name] = pixels, np.asarray(labels)
  return written


def test_cifar10_loads_python_batches(tmp_path):
  written = write_cifar(tmp_path)
  ds = data.load("cifar10", tmp_path)
  assert ds.x_train.shape == (20, 32, 32, 3) and ds.x_test.shape == (4, 32, 32, 3)
  assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int32
  assert ds.num_classes == 10 and ds.input_shape == (32, 32, 3)
  np.testing.assert_array_equal(
    ds.y_train,
    np.concatenate([written[f"data_batch_{i}"][1] for i in range(1, 6)]),
  )
  pixels, labels = written["test_batch"]
  np.testing.assert_array_equal(ds.y_test, labels)
  # Row layout is 1024 red, 1024 green, 1024 blue values, each row-major 32x32.
  image = pixels[2].reshape(3, 32, 32)
  for c in range(3):
    expected = (image[c] / 255.0 - data.CIFAR10_MEAN[c]) / data.CIFAR10_STD[c]
    np.testing.assert_allclose(ds.x_test[2, :, :, c], expected, rtol=1e-5, atol=1e-5)


def test_cifar10_missing_names_files_and_directory(tmp_path):
  with pytest.raises(data.DatasetNotFoundError) as e:
    data.load("cifar10", tmp_path)
  assert isinstance(e.value, FileNotFoundError)
  assert "data_batch_1" in str(e.value) and "test_batch" in str(e.value)
  assert str(tmp_path / "cifar-10-batches-py") in str(e.value)


# -- ImageNet folder ---------------------------------------------------------------

COLORS = {"n01": (250, 10, 120), "n02": (20, 200, 60)}


def write_image_folder(root):
  """2 classes x 3 solid-colour JPEGs (one not square) in train/, 1 each in val/."""
  for split, count in (("train", 3), ("val", 1)):
    for name, color in COLORS.items():
      (root / split / name).mkdir(parents=True)
      for j in range(count):
        size = (24, 16) if j == 0 else (16, 16)
        image = Image.new("RGB", size, color)
        image.save(root / split / name / f"{name}_{j}.JPEG", quality=100)


def test_imagenet_folder_decodes_resizes_and_normalises(tmp_path):
  write_image_folder(tmp_path)
  ds = data.load("imagenet", tmp_path, image_size=8)
  assert ds.num_classes == 2
  assert ds.x_train.shape == (6, 8, 8, 3) and ds.x_test.shape == (2, 8, 8, 3)
  np.testing.assert_array_equal(ds.y_train, [0, 0, 0, 1, 1, 1])
  np.testing.assert_array_equal(ds.y_test, [0, 1])
  batch = ds.x_train[np.array([0, 4])]
  assert batch.shape == (2, 8, 8, 3) and batch.dtype == np.float32
  for image, color in zip(batch, COLORS.values(), strict=True):
    expected = (np.array(color) / 255 - data.IMAGENET_MEAN) / data.IMAGENET_STD
    # JPEG may move a solid colour by a level or two.
    np.testing.assert_allclose(image, np.broadcast_to(expected, image.shape), atol=0.05)
  assert np.asarray(ds.x_test).shape == (2, 8, 8, 3)
  assert ds.x_train[1].shape == (8, 8, 3)


def test_imagenet_missing_names_layout_and_directory(tmp_path):
  with pytest.raises(data.DatasetNotFoundError) as e:
    data.load("imagenet", tmp_path)
  assert "train/<class>/<image>.JPEG" in str(e.value)
  assert str(tmp_path) in str(e.value)


# -- Penn Treebank ----------------------------------------------------------------

PTB_TRAIN = " the cat sat \n the dog sat on the mat \n a cat ran \n" * 4
PTB_VALID = " the cat ate the fish \n the dog sat \n" * 2


def write_ptb(root):
  (root / "ptb.train.txt").write_text(PTB_TRAIN)
  (root / "ptb.valid.txt").write_text(PTB_VALID)


def test_ptb_vocab_and_shifted_windows(tmp_path):
  write_ptb(tmp_path)
  ds = data.load("ptb", tmp_path, seq_len=3, num_streams=2)
  words = "the cat sat <eos> dog on mat a ran <unk>".split()
  assert ds.vocab == tuple(words)
  assert ds.vocab_size == ds.num_classes == len(words)
  ids = {w: i for i, w in enumerate(words)}
  tokens = np.array(
    [ids[w] for line in PTB_TRAIN.splitlines() for w in (*line.split(), "<eos>")]
  )
  # 60 tokens: 2 streams of 30, so 9 windows of 3 (plus 1 target token).
  assert ds.x_train.shape == ds.y_train.shape == (18, 3)
  assert ds.x_train.dtype == ds.y_train.dtype == np.int32
  streams = tokens.reshape(2, 30)
  for w in range(9):
    for s in range(2):
      row = w * 2 + s  # Window-major: a batch of num_streams rows continues the last.
      np.testing.assert_array_equal(ds.x_train[row], streams[s, 3 * w : 3 * w + 3])
      np.testing.assert_array_equal(ds.y_train[row], streams[s, 3 * w + 1 : 3 * w + 4])
  # Validation words unseen in training map to <unk>.
  assert ids["<unk>"] in ds.x_test and ds.x_test.shape[1] == 3
  np.testing.assert_array_equal(ds.y_test[:, :-1], ds.x_test[:, 1:])


def test_ptb_missing_names_files_and_directory(tmp_path):
  (tmp_path / "ptb.train.txt").write_text(PTB_TRAIN)
  with pytest.raises(data.DatasetNotFoundError) as e:
    data.load("ptb", tmp_path)
  assert "ptb.valid.txt" in str(e.value) and str(tmp_path) in str(e.value)


def test_ptb_too_short_is_a_clear_error(tmp_path):
  write_ptb(tmp_path)
  with pytest.raises(ValueError, match="too few"):
    data.load_ptb(tmp_path, seq_len=100, num_streams=2)


# -- digits, names, synthetic -----------------------------------------------------------


def test_digits_split_is_fixed_and_complete():
  a, b = data.load("digits"), data.load("digits", seed=7)
  assert a.num_classes == 10 and a.x_train.shape == (1437, 8, 8, 1)
  assert a.x_test.shape == (360, 8, 8, 1) and a.x_train.dtype == np.float32
  assert 0 <= a.x_train.min() and a.x_train.max() <= 1
  np.testing.assert_array_equal(a.x_test, b.x_test)
  np.testing.assert_array_equal(a.y_train, b.y_train)
  assert set(np.unique(a.y_train)) == set(range(10))
  # Every image lies in exactly one split: the pixel sums match sklearn's.
  from sklearn.datasets import load_digits

  total = load_digits().images.sum() / 16
  np.testing.assert_allclose(a.x_train.sum() + a.x_test.sum(), total, rtol=1e-5)


def test_unknown_name_and_missing_data_dir():
  with pytest.raises(ValueError, match="digits, cifar10, imagenet, ptb"):
    data.load("mnist")
  with pytest.raises(ValueError, match="data_dir"):
    data.load("cifar10")


@pytest.mark.parametrize(
  "name, kwargs, x_shape, dtype, classes",
  [
    ("digits", {}, (8, 8, 1), np.float32, 10),
    ("cifar10", {}, (32, 32, 3), np.float32, 10),
    ("imagenet", {"image_size": 16}, (16, 16, 3), np.float32, 1000),
    ("ptb", {"seq_len": 5, "vocab_size": 50}, (5,), np.int32, 50),
  ],
)
def test_synthetic_shapes(name, kwargs, x_shape, dtype, classes):
  ds = data.load(name, synthetic=True, seed=3, num_train=40, num_test=8, **kwargs)
  assert ds.x_train.shape == (40, *x_shape) and ds.x_test.shape == (8, *x_shape)
  assert ds.x_train.dtype == dtype and ds.y_train.dtype == np.int32
  assert ds.num_classes == classes
  assert 0 <= ds.y_train.min() and ds.y_train.max() < classes
  again = data.load(name, synthetic=True, seed=3, num_train=40, num_test=8, **kwargs)
  np.testing.assert_array_equal(ds.x_train, again.x_train)
  if name == "ptb":
    np.testing.assert_array_equal(ds.y_train[:, :-1], ds.x_train[:, 1:])


# -- batches --------------------------------------------------------------------------

N = 50  # Not a multiple of the batch: the remainder of each epoch is dropped.


def take(it, k):
  return list(itertools.islice(it, k))


def rows(global_batch=8, seed=0, **kwargs):
  """Batches of the example indices themselves."""
  x = np.arange(N)
  return data.batches(x, x.astype(np.int32), global_batch, seed, **kwargs)


def test_batches_deterministic_given_seed():
  a, b, c = take(rows(), 20), take(rows(), 20), take(rows(seed=1), 20)
  for (xa, ya), (xb, _) in zip(a, b, strict=True):
    np.testing.assert_array_equal(xa, xb)
    np.testing.assert_array_equal(xa, ya)
  assert any(not np.array_equal(xa, xc) for (xa, _), (xc, _) in zip(a, c, strict=True))


def test_batches_epochs_are_disjoint_permutations():
  per_epoch = data.steps_per_epoch(N, 8)
  assert per_epoch == 6
  steps = [x for x, _ in take(rows(), 2 * per_epoch)]
  for epoch in range(2):
    seen = np.concatenate(steps[epoch * per_epoch : (epoch + 1) * per_epoch])
    assert len(np.unique(seen)) == 48
  assert not np.array_equal(steps[0], steps[per_epoch])


def test_batches_resume_from_start_step():
  full = take(rows(), 17)
  for start in (0, 5, 6, 13):
    resumed = take(rows(start_step=start), 17 - start)
    for (x, _), (xr, _) in zip(full[start:], resumed, strict=True):
      np.testing.assert_array_equal(x, xr)


@pytest.mark.parametrize("process_count", [2, 4, 8])
def test_batches_process_slices_concatenate_to_global_batch(process_count):
  single = take(rows(start_step=3), 10)
  slices = [
    take(rows(start_step=3, process_index=p, process_count=process_count), 10)
    for p in range(process_count)
  ]
  for step, (x, _) in enumerate(single):
    parts = [slices[p][step][0] for p in range(process_count)]
    assert all(len(part) == 8 // process_count for part in parts)
    np.testing.assert_array_equal(np.concatenate(parts), x)


def test_batches_unshuffled_keeps_order():
  (x0, _), (x1, _) = take(rows(shuffle=False), 2)
  np.testing.assert_array_equal(np.concatenate([x0, x1]), np.arange(16))


def test_batches_reject_bad_arguments():
  with pytest.raises(
    ValueError, match=r"global_batch \(8\) must be divisible by process_count \(3\)"
  ):
    rows(process_count=3)
  with pytest.raises(ValueError, match="process_index"):
    rows(process_index=2, process_count=2)
  with pytest.raises(ValueError, match="exceeds"):
    rows(global_batch=64)
