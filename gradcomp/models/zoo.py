"""Models of the training program, chosen by name: ``create("mlp", num_classes=10)``.

Small flax.linen models for the digits config, and the papers' architectures
(paper 000 §5, Table 3): ResNet-20 and VGG-16 on CIFAR-10, ResNet-50 on
ImageNet, a 2-layer LSTM on PTB. Batch normalisation keeps its running
statistics in the ``batch_stats`` collection; the step averages them over
workers (synchronous BN statistics, so every worker evaluates the same model).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp


class MLP(nn.Module):
  """Flatten, ``len(features)`` ReLU layers, a linear classifier."""

  num_classes: int
  features: Sequence[int] = (128,)

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    x = x.reshape(x.shape[0], -1)
    for i, width in enumerate(self.features):
      x = nn.relu(nn.Dense(width, name=f"hidden_{i}")(x))
    return nn.Dense(self.num_classes, name="out")(x)


class CNN(nn.Module):
  """Two 3x3 convolutions (the second strided), then a linear classifier."""

  num_classes: int
  features: Sequence[int] = (16, 32)

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    for i, width in enumerate(self.features):
      x = nn.relu(nn.Conv(width, (3, 3), strides=1 + (i > 0), name=f"conv_{i}")(x))
    x = x.reshape(x.shape[0], -1)
    return nn.Dense(self.num_classes, name="out")(x)


def _norm(train: bool):
  return nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5)


class _BasicBlock(nn.Module):
  width: int
  stride: int

  @nn.compact
  def __call__(self, x, train: bool):
    y = nn.Conv(self.width, (3, 3), self.stride, use_bias=False)(x)
    y = nn.relu(_norm(train)(y))
    y = nn.Conv(self.width, (3, 3), use_bias=False)(y)
    y = _norm(train)(y)
    if x.shape != y.shape:  # Projection shortcut (option B of He et al.).
      x = nn.Conv(self.width, (1, 1), self.stride, use_bias=False)(x)
      x = _norm(train)(x)
    return nn.relu(x + y)


class ResNet20(nn.Module):
  """He et al. 2016's CIFAR ResNet-20: 3 stages of 3 basic blocks, 16-32-64."""

  num_classes: int
  blocks_per_stage: int = 3

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = nn.Conv(16, (3, 3), use_bias=False)(x)
    x = nn.relu(_norm(train)(x))
    for stage, width in enumerate((16, 32, 64)):
      for b in range(self.blocks_per_stage):
        x = _BasicBlock(width, 2 if stage > 0 and b == 0 else 1)(x, train)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes)(x)


class VGG16(nn.Module):
  """VGG-16 for 32x32 inputs: 13 conv+BN layers, one hidden dense layer."""

  num_classes: int

  @nn.compact
  def __call__(self, x, train: bool = False):
    stages = ((64, 2), (128, 2), (256, 3), (512, 3), (512, 3))
    for width, convs in stages:
      for _ in range(convs):
        x = nn.Conv(width, (3, 3), use_bias=False)(x)
        x = nn.relu(_norm(train)(x))
      x = nn.max_pool(x, (2, 2), (2, 2))
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(nn.Dense(512)(x))
    return nn.Dense(self.num_classes)(x)


class _Bottleneck(nn.Module):
  width: int
  stride: int

  @nn.compact
  def __call__(self, x, train: bool):
    y = nn.relu(_norm(train)(nn.Conv(self.width, (1, 1), use_bias=False)(x)))
    y = nn.Conv(self.width, (3, 3), self.stride, use_bias=False)(y)
    y = nn.relu(_norm(train)(y))
    y = _norm(train)(nn.Conv(4 * self.width, (1, 1), use_bias=False)(y))
    if x.shape != y.shape:
      x = nn.Conv(4 * self.width, (1, 1), self.stride, use_bias=False)(x)
      x = _norm(train)(x)
    return nn.relu(x + y)


class ResNet50(nn.Module):
  """He et al. 2016's ImageNet ResNet-50 (bottleneck blocks 3-4-6-3)."""

  num_classes: int

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = nn.Conv(64, (7, 7), 2, use_bias=False)(x)
    x = nn.relu(_norm(train)(x))
    x = nn.max_pool(x, (3, 3), (2, 2), padding="SAME")
    for stage, (width, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3))):
      for b in range(blocks):
        x = _Bottleneck(width, 2 if stage > 0 and b == 0 else 1)(x, train)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes)(x)


class LSTM(nn.Module):
  """Word-level LSTM language model: embedding, stacked LSTMs, decoder.

  Windows are independent sequences (zero initial state), so batches may be
  shuffled; logits are ``(batch, seq_len, num_classes)``.
  """

  num_classes: int
  hidden: int = 650
  layers: int = 2

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    h = nn.Embed(self.num_classes, self.hidden)(x)
    for _ in range(self.layers):
      # Zeros shaped *and typed* like the inputs: under shard_map a constant
      # carry would be replicated while the scan makes it per worker.
      zeros = jnp.zeros_like(h[:, 0])
      h = nn.RNN(nn.OptimizedLSTMCell(self.hidden))(h, initial_carry=(zeros, zeros))
    return nn.Dense(self.num_classes)(h)


MODELS: dict[str, Callable[..., nn.Module]] = {
  "mlp": MLP,
  "cnn": CNN,
  "resnet20": ResNet20,
  "vgg16": VGG16,
  "resnet50": ResNet50,
  "lstm": LSTM,
}


def check_name(name: str) -> None:
  """Raises ``ValueError`` listing the valid names unless ``name`` is one."""
  if name not in MODELS:
    raise ValueError(
      f"unknown model {name!r} (config.model.name); valid names: {', '.join(MODELS)}"
    )


def create(name: str, num_classes: int, **kwargs: Any) -> nn.Module:
  """The model registered as ``name``.

  Args:
    name: a key of ``MODELS``.
    num_classes: outputs of the classifier (the vocabulary for ``lstm``).
    **kwargs: the model's own fields, e.g. ``features`` for ``mlp``.

  Raises:
    ValueError: for an unknown name (the message lists the valid ones).
  """
  check_name(name)
  return MODELS[name](num_classes=num_classes, **kwargs)
