"""Parameter shapes, forward order and forward FLOPs, derived from the flax models.

The papers' models (paper 000 §5, Table 3: ResNet-20 and VGG-16 on CIFAR-10,
ResNet-50 on ImageNet, a 2-layer LSTM on PTB) and GPT-2 small are
defined once, in flax, in :mod:`gradcomp.models.zoo`; the training program
trains those modules. The benchmarks and the cost model need only the
gradients' shapes and the compute behind each, so this module reads them off
the same modules, without running them:

* **Shapes** from ``jax.eval_shape(model.init, ...)``: the ``params``
  collection only, so BatchNorm contributes its scale and bias, never its
  running mean / variance (those are not gradients). Names are the flax
  parameter paths joined by ``"/"`` (``"layer2/0/conv1/kernel"``); JAX / flax
  layouts: conv kernels HWIO ``(kh, kw, in, out)``, dense kernels
  ``(in, out)``, the embedding ``(vocab, features)``.
* **Order is forward order**: the order of first use of each parameter in the
  jaxpr of ``model.apply`` on one abstract sample (casts, reshapes and
  broadcasts are followed to the op that consumes their result). The
  gradient-ready order LayerFusion groups leaves in is its reverse (paper 000
  §4.1, Algorithm 2; §4.3), the order ``gradcomp.fusion.gradient_order`` reads
  from the training program's loss the same way.
* **Forward FLOPs per tensor and sample** (:func:`forward_flops`), from the
  same jaxpr: each tensor is attributed the FLOPs of the ops that combine it
  (or a value computed from parameters only, such as BatchNorm's
  ``scale * rsqrt(var + eps)``) with the sample's activations, so a cost model
  can split a backward time across tensors in proportion to their compute.

Derivations are cached: tracing ResNet-50 takes seconds. Nothing is compiled
or run. Imports nothing from gradcomp outside ``gradcomp.models``.
"""

from __future__ import annotations

import functools
import math
import typing
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from gradcomp.models import transformer, zoo

Shape = tuple[int, ...]
ShapeList = list[tuple[str, Shape]]

#: Parameter counts, each checked in ``tests/test_shapes.py`` against closed-form
#: arithmetic written out independently of the models.
RESNET50_NUM_PARAMS = 25_557_032  # torchvision resnet50, 161 tensors
RESNET20_NUM_PARAMS = 269_722  # ~0.27M, He et al. 2016 §4.2 quote "0.27M"
VGG16_NUM_PARAMS = 14_728_266  # CIFAR VGG-16 with conv bias + BN, Linear(512, 10)
LSTM_PTB_NUM_PARAMS = 19_780_400  # 2x650 LSTM, vocab 10k, untied decoder
GPT2_SMALL_NUM_PARAMS = 124_439_808  # GPT-2 small, BPE vocab, tied embeddings


#: Input geometry behind :func:`forward_flops`: ImageNet crops for ResNet-50, CIFAR
#: images for ResNet-20 / VGG-16, and Zaremba et al.'s BPTT length for the LSTM.
IMAGENET_INPUT_SIZE = 224
CIFAR_INPUT_SIZE = 32
PTB_SEQ_LEN = 35

#: GPT-2's BPE vocabulary (Radford et al. 2019, §2.2).
GPT2_VOCAB_SIZE = 50_257


class Tensor(typing.NamedTuple):
  """One parameter tensor of a model: flax path, shape, forward FLOPs per sample."""

  name: str
  shape: Shape
  flops: float


#: Primitives that only re-type or re-lay out one operand: a parameter passed
#: through them (a mixed-precision cast at the top of the model, a reshape) is
#: not yet *used*; its first use is where the result is consumed. Shared with
#: ``gradcomp.fusion.gradient_order``.
PASS_THROUGH = frozenset(
  {
    "convert_element_type",
    "reshape",
    "squeeze",
    "expand_dims",
    "transpose",
    "broadcast_in_dim",
    "copy",
    "copy_p",
    "device_put",
    "pvary",
    "pcast",
    "reduce_precision",
    "optimization_barrier",
  }
)

# A var's tag: None for a value computed from the sample (an activation), else
# the parameter leaves it is computed from (empty for constants and running
# statistics).
_Tag = frozenset[int] | None
_CONSTANT: frozenset[int] = frozenset()


def _op_flops(eqn) -> int:
  """FLOPs of one equation: 2 per multiply-add of a conv / matmul, else 1 per output."""
  out = math.prod(eqn.outvars[0].aval.shape)
  name = eqn.primitive.name
  if name == "conv_general_dilated":
    rhs = eqn.invars[1].aval.shape
    out_features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
    return 2 * out * (math.prod(rhs) // out_features)
  if name == "dot_general":
    (contracting, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    return 2 * out * math.prod(lhs[d] for d in contracting)
  return out


def _open(jaxpr):
  return jaxpr.jaxpr if isinstance(jaxpr, jex_core.ClosedJaxpr) else jaxpr


def scan_layout(invars, outvars, body) -> tuple[int, int]:
  """``(num_consts, num_carry)`` of a ``scan`` equation, read from the shapes.

  The operands are consts, carry, xs and the results carry, ys. A carry has
  the same shape outside the body as inside it; an xs operand or a ys result
  has the scan's length as an extra leading axis. So the carry is the longest
  run of results shaped like the body's, and the xs the longest run of
  trailing operands shaped unlike it. Read from the shapes rather than the
  equation's parameters, which JAX renamed (``num_consts`` / ``num_carry``
  up to 0.10; JAX 0.11's scan has neither).
  """

  def same(outer, inner) -> bool:
    return outer.aval.shape == inner.aval.shape

  carry = 0
  while carry < len(outvars) and same(outvars[carry], body.outvars[carry]):
    carry += 1
  xs = 0
  while xs < len(invars) - carry and not same(invars[-1 - xs], body.invars[-1 - xs]):
    xs += 1
  return len(invars) - carry - xs, carry


class _Walk:
  """Walks a jaxpr in program order: first use and FLOPs of each parameter leaf."""

  def __init__(self):
    self.position = 0
    self.first: dict[int, int] = {}
    self.flops: dict[int, float] = {}

  def tag(self, tags: dict, var) -> _Tag:
    if isinstance(var, jex_core.Literal):
      return _CONSTANT
    return tags.get(var, _CONSTANT)

  def walk(self, jaxpr, tags: dict, times: int) -> list[_Tag]:
    """Visits ``jaxpr`` (run ``times`` times per sample); returns its outputs' tags."""
    tags = dict(tags)
    for eqn in jaxpr.eqns:
      self.position += 1
      inputs = [self.tag(tags, v) for v in eqn.invars]
      name = eqn.primitive.name
      if name in PASS_THROUGH and len(eqn.invars) == len(eqn.outvars):
        tags.update(zip(eqn.outvars, inputs, strict=True))
        continue
      if name in ("cond", "while"):
        raise ValueError(f"no FLOPs convention for {name!r} (data-dependent control)")
      subs = [
        _open(v)
        for v in eqn.params.values()
        if isinstance(v, jex_core.ClosedJaxpr | jex_core.Jaxpr)
      ]
      if name == "scan":  # consts, then carry (recurrent state: data), then xs.
        (sub,) = subs
        consts, carry = scan_layout(eqn.invars, eqn.outvars, sub)
        sub_inputs = [
          None if consts <= i < consts + carry else t for i, t in enumerate(inputs)
        ]
        self.walk(
          sub,
          dict(zip(sub.invars, sub_inputs, strict=True)),
          times * eqn.params["length"],
        )
        outputs = [None] * len(eqn.outvars)
      elif len(subs) == 1 and len(subs[0].invars) == len(eqn.invars):
        # jit, custom_jvp / custom_vjp calls, remat, closed_call: run once here.
        (sub,) = subs
        outputs = self.walk(sub, dict(zip(sub.invars, inputs, strict=True)), times)
        if len(outputs) != len(eqn.outvars):
          outputs = [None] * len(eqn.outvars)
      else:
        outputs = self.op(eqn, inputs, times)
      tags.update(zip(eqn.outvars, outputs, strict=True))
    return [self.tag(tags, v) for v in jaxpr.outvars]

  def op(self, eqn, inputs: list[_Tag], times: int) -> list[_Tag]:
    """A primitive: uses its parameter operands, costs FLOPs if it meets the data."""
    leaves = frozenset().union(*(t for t in inputs if t is not None))
    for leaf in sorted(leaves):
      self.first.setdefault(leaf, self.position)
    if not any(t is None for t in inputs):
      return [leaves] * len(eqn.outvars)  # Parameters (or constants) only.
    if leaves:
      share = times * _op_flops(eqn) / len(leaves)
      for leaf in leaves:
        self.flops[leaf] = self.flops.get(leaf, 0.0) + share
    return [None] * len(eqn.outvars)


def derive(module: nn.Module, sample) -> tuple[Tensor, ...]:
  """The parameter tensors of ``module`` in forward order, with their FLOPs per sample.

  Traces ``module.init`` and ``module.apply(variables, sample)`` abstractly
  (``jax.eval_shape``, ``jax.make_jaxpr``; nothing is compiled or run) and
  walks the forward jaxpr in program order, recursing into ``jit``,
  ``custom_jvp`` / ``custom_vjp`` calls and ``scan`` bodies. A value is
  *data* if it is computed from the sample, else it carries the parameters it
  is computed from (none for constants and running statistics); casts,
  reshapes and broadcasts pass the parameters on without using them.

  * Order: by the first equation that uses each parameter (or a value computed
    from it); leaves first used by the same equation in reverse tree order.
    Reversed, this is the order in which backprop produces the gradients
    (paper 000 §4.1, §4.3), as ``gradcomp.fusion.gradient_order`` finds it.
  * FLOPs: an equation whose operands include data and parameter-carrying
    values costs ``conv_general_dilated``: ``2 * kh * kw * cin * cout * Hout *
    Wout``; ``dot_general``: ``2 *`` (output size) ``*`` (contracted size);
    any other primitive (the add of a bias, the multiply by a BatchNorm scale,
    the gather of an embedding): its output size. That cost goes to the
    parameters it carries (split evenly if several), times the length of each
    enclosing ``scan``. Equations on parameters only (BatchNorm's ``scale *
    rsqrt(var + eps)``) and on data only (activations, pooling, residual adds,
    gate nonlinearities) are attributed to no tensor.

  Args:
    module: a flax module whose ``apply(variables, x)`` is its forward pass in
      evaluation mode (BatchNorm with its running statistics).
    sample: one sample with a leading batch dimension of 1 (an array or a
      ``jax.ShapeDtypeStruct``), so FLOPs are per sample.

  Returns:
    One :class:`Tensor` per leaf of the ``params`` collection, names the flax
    paths joined by ``"/"``, in forward order; leaves the forward pass never
    uses come last, in tree order, with 0 FLOPs.

  Raises:
    ValueError: for ``cond`` / ``while`` in the forward pass (no convention).
  """
  sample = jax.ShapeDtypeStruct(sample.shape, sample.dtype)
  variables = jax.eval_shape(module.init, jax.random.PRNGKey(0), sample)
  params = variables["params"]
  state = {k: v for k, v in variables.items() if k != "params"}
  paths = jax.tree.leaves_with_path(params)
  closed = jax.make_jaxpr(lambda p, s, x: module.apply({"params": p, **s}, x))(
    params, state, sample
  )
  jaxpr = closed.jaxpr
  n_params, n_state = len(paths), len(jax.tree.leaves(state))
  tags = {var: frozenset({i}) for i, var in enumerate(jaxpr.invars[:n_params])}
  tags.update({var: None for var in jaxpr.invars[n_params + n_state :]})
  walker = _Walk()
  walker.walk(jaxpr, tags, 1)
  # Ties (one equation first using several leaves) in reverse tree order, so that
  # the reverse is gradient_order's, which keeps tree order among them.
  first = walker.first
  used = sorted(first, key=lambda i: (first[i], -i))
  order = used + [i for i in range(n_params) if i not in first]
  return tuple(
    Tensor(
      "/".join(str(k.key) for k in paths[i][0]),
      tuple(paths[i][1].shape),
      float(walker.flops.get(i, 0.0)),
    )
    for i in order
  )


#: ``lstm_ptb``'s arguments: Zaremba et al.'s "medium" model on PTB.
_LSTM_DEFAULTS = {
  "vocab": 10_000,
  "hidden": 650,
  "embed": 650,
  "layers": 2,
  "seq_len": PTB_SEQ_LEN,
}


#: ``gpt2_small``'s arguments: GPT-2's vocabulary, sequences of its full context.
_GPT2_DEFAULTS = {
  "vocab_size": GPT2_VOCAB_SIZE,
  "seq_len": transformer.SIZES["gpt2_small"]["context"],
}

#: The transformer's sizes, by their names in the zoo.
_GPT_SIZES = {"gpt_tiny": "tiny", "gpt_small": "small", "gpt2_small": "gpt2_small"}


def _image(size: int) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct((1, size, size, 3), jnp.float32)


@functools.lru_cache(maxsize=16)
def _derived(model: str, kwargs: tuple[tuple[str, int], ...]) -> tuple[Tensor, ...]:
  """:func:`derive` of a key of :data:`MODELS` with its builder's ``kwargs``."""
  kw = dict(kwargs)
  if model == "resnet50":
    return derive(zoo.create("resnet50", 1000), _image(IMAGENET_INPUT_SIZE))
  if model in ("resnet20", "vgg16"):
    return derive(zoo.create(model, 10), _image(CIFAR_INPUT_SIZE))
  seq_len = kw.pop("seq_len")
  if seq_len < 1:
    raise ValueError(f"seq_len must be positive, got {seq_len}")
  if model in _GPT_SIZES:  # Sequences longer than the context raise in the model.
    gpt = zoo.create(model, kw.pop("vocab_size"))
    tensors = derive(gpt, jax.ShapeDtypeStruct((1, seq_len), jnp.int32))
    return _with_attention(tensors, seq_len)
  lstm = zoo.create("lstm", kw.pop("vocab"), **kw)
  return derive(lstm, jax.ShapeDtypeStruct((1, seq_len), jnp.int32))


#: The fused QKV projection of a transformer block, whose tensor carries the
#: block's attention FLOPs (:func:`_with_attention`).
_QKV_KERNEL = "attn/c_attn/kernel"


def attention_flops(width: int, seq_len: int) -> int:
  """Forward FLOPs of one block's attention products on one sequence.

  ``q k^T`` (``2 * seq_len^2 * width``: per head ``seq_len x seq_len``
  scores, each a dot product of ``width / heads`` multiply-adds) plus the
  weighted sum of ``v`` (the same again): ``4 * width * seq_len^2``, the causal
  mask applied to the full square (the model computes every score, then
  masks). Softmax, scaling and masking (elementwise) are not counted, as no
  activation-only elementwise op is.

  Examples:
    >>> attention_flops(768, 1024)  # GPT-2 small, one block, full context.
    3221225472
  """
  return 4 * width * seq_len * seq_len


def _with_attention(tensors: tuple[Tensor, ...], seq_len: int) -> tuple[Tensor, ...]:
  """Each block's :func:`attention_flops` added to its ``attn/c_attn/kernel``.

  The jaxpr walk (:func:`derive`) attributes no tensor the attention products
  (both operands are activations); they belong to the block's QKV
  projection, whose outputs they consume (and whose gradient backprop
  produces after theirs). ``width`` is the kernel's input dimension.
  """
  return tuple(
    Tensor(t.name, t.shape, t.flops + attention_flops(t.shape[0], seq_len))
    if t.name.endswith(_QKV_KERNEL)
    else t
    for t in tensors
  )


def _tensors(model: str, **kwargs) -> tuple[Tensor, ...]:
  if model not in MODELS:
    raise ValueError(f"unknown model {model!r}; valid models: {sorted(MODELS)}")
  defaults = {"lstm_ptb": _LSTM_DEFAULTS, "gpt2_small": _GPT2_DEFAULTS}.get(model, {})
  unknown = set(kwargs) - set(defaults)
  if unknown:
    raise TypeError(f"unexpected arguments for {model!r}: {sorted(unknown)}")
  # Defaults filled in, so that every spelling of a model shares one cache entry.
  return _derived(model, tuple(sorted({**defaults, **kwargs}.items())))


def _pairs(tensors: Sequence[Tensor]) -> ShapeList:
  return [(t.name, t.shape) for t in tensors]


def resnet50_shapes() -> ShapeList:
  """ResNet-50 (ImageNet, 1000 classes): ``zoo.ResNet50``, torchvision's ``resnet50``.

  Bottleneck blocks ``[3, 4, 6, 3]`` of widths ``64, 128, 256, 512`` with expansion 4;
  the first block of every stage has a 1x1 projection shortcut ("downsample") with its
  BatchNorm. Convolutions have no bias; the classifier is ``Dense(2048, 1000)``.

  Returns:
    161 ``(name, shape)`` pairs in forward order, 25,557,032 parameters in all
    (53 conv kernels, 53 BatchNorm scale/bias pairs, fc kernel and bias).

  References:
    He et al., *Deep Residual Learning for Image Recognition*, CVPR 2016, Table 1.
  """
  return _pairs(_tensors("resnet50"))


def resnet20_shapes() -> ShapeList:
  """CIFAR-10 ResNet-20 of He et al. 2016 §4.2 (n = 3): ``zoo.ResNet20``.

  A 3x3 stem conv to 16 channels, then 3 stages of 3 basic blocks (two 3x3 convs, each
  with BatchNorm) at 16 / 32 / 64 channels, global average pooling and
  ``Dense(64, 10)``. Shortcuts are option A (strided identity with zero-padded
  channels), so there are no projection convs. Convolutions have no bias.

  Returns:
    59 ``(name, shape)`` pairs in forward order, 269,722 parameters (~0.27M, the
    number quoted in the paper's Table 6).

  References:
    He et al., *Deep Residual Learning for Image Recognition*, CVPR 2016, §4.2.
  """
  return _pairs(_tensors("resnet20"))


def vgg16_shapes() -> ShapeList:
  """CIFAR-10 VGG-16 with BatchNorm, in its common single-classifier variant.

  ``zoo.VGG16``: thirteen 3x3 convolutions following ``zoo.VGG16_CFG``, each with
  a bias and BatchNorm; after five max-pools a 32x32 input is 1x1x512, and the
  classifier is a single ``Dense(512, 10)`` (the widely used CIFAR variant, e.g.
  kuangliu's ``pytorch-cifar`` ``VGG('VGG16')``; the ImageNet model's 4096-wide
  fully connected layers are not used).

  Returns:
    54 ``(name, shape)`` pairs in forward order, 14,728,266 parameters.

  References:
    Simonyan & Zisserman, *Very Deep Convolutional Networks for Large-Scale Image
    Recognition*, ICLR 2015, Table 1 (configuration D).
  """
  return _pairs(_tensors("vgg16"))


def lstm_ptb_shapes(
  vocab: int = 10_000, hidden: int = 650, embed: int = 650, layers: int = 2
) -> ShapeList:
  """2-layer LSTM language model on PTB, Zaremba et al.'s "medium" size: ``zoo.LSTM``.

  Embedding ``(vocab, embed)``; per layer an input kernel ``(in, 4 * hidden)``, a
  recurrent kernel ``(hidden, 4 * hidden)`` and, as in PyTorch's ``nn.LSTM`` and
  Zaremba's Lua code (two ``nn.Linear``), two biases of ``4 * hidden``; an **untied**
  decoder ``Dense(hidden, vocab)``.

  Args:
    vocab: vocabulary size (10,000 for PTB).
    hidden: LSTM hidden size (650 for "medium").
    embed: embedding size (650 for "medium").
    layers: number of stacked LSTM layers.

  Returns:
    ``3 + 4 * layers`` ``(name, shape)`` pairs in forward order; 19,780,400
    parameters with the defaults.

  References:
    Zaremba, Sutskever & Vinyals, *Recurrent Neural Network Regularization*, 2014, §4.1.
  """
  return _pairs(
    _tensors("lstm_ptb", vocab=vocab, hidden=hidden, embed=embed, layers=layers)
  )


def gpt_shapes(name: str, vocab_size: int) -> ShapeList:
  """A size of the zoo's decoder-only transformer: ``zoo.create(name, vocab_size)``.

  Args:
    name: ``"gpt_tiny"``, ``"gpt_small"`` or ``"gpt2_small"``
      (``transformer.SIZES``' ``"tiny"``, ``"small"``, ``"gpt2_small"``).
    vocab_size: the vocabulary (256 for bytes, :data:`GPT2_VOCAB_SIZE` for GPT-2).

  Returns:
    ``4 + 12 * num_layers`` ``(name, shape)`` pairs in forward order: ``wte``,
    ``wpe``, per block ``h_{i}/ln_1``, ``attn/c_attn``, ``attn/c_proj``,
    ``ln_2``, ``mlp/c_fc``, ``mlp/c_proj`` (a kernel or scale, then a bias,
    each), ``ln_f``. The logits reuse ``wte``: there is no output head.
    Their FLOPs (:func:`forward_flops`) put each block's attention products,
    ``4 * d * seq_len^2`` per sequence, on its ``attn/c_attn/kernel``.

  Raises:
    ValueError: for another ``name``.
  """
  if name not in _GPT_SIZES:
    raise ValueError(f"unknown transformer {name!r}; valid: {sorted(_GPT_SIZES)}")
  context = transformer.SIZES[_GPT_SIZES[name]]["context"]
  kwargs = (("seq_len", context), ("vocab_size", vocab_size))
  return _pairs(_derived(name, kwargs))


def gpt2_small_shapes(vocab_size: int = GPT2_VOCAB_SIZE) -> ShapeList:
  """GPT-2 small: ``zoo.create("gpt2_small", vocab_size)``, ``transformer.GPT``.

  12 pre-LayerNorm blocks of width 768 (12 heads, MLP 3072), context 1024,
  logits tied to the token embedding ``wte (vocab_size, 768)``; a fused QKV
  ``attn/c_attn (768, 2304)``. See :func:`gpt_shapes` for the order.

  Args:
    vocab_size: the vocabulary, GPT-2's BPE by default.

  Returns:
    148 ``(name, shape)`` pairs in forward order; 124,439,808 parameters with
    the default vocabulary (GPT-2 small's "124M", counted with tied
    embeddings), ``vocab_size * 768 + 85,841,664`` in general.

  References:
    Radford et al., *Language Models are Unsupervised Multitask Learners*, 2019,
    §2.3 (its Table 2 lists this model as 117M; the released model has
    124,439,808 parameters).
  """
  return gpt_shapes("gpt2_small", vocab_size)


MODELS = {
  "resnet50": resnet50_shapes,
  "resnet20": resnet20_shapes,
  "vgg16": vgg16_shapes,
  "lstm_ptb": lstm_ptb_shapes,
  "gpt2_small": gpt2_small_shapes,
}


def forward_flops(model: str, **kwargs) -> list[float]:
  """Forward FLOPs per sample attributed to each parameter tensor of ``model``.

  Read from the jaxpr of the zoo model's forward pass (:func:`derive`), so entry
  ``i`` belongs to the tensor ``MODELS[model](**kwargs)[i]``. A cost model can
  split a measured or assumed backward time across the tensors in proportion to
  these numbers.

  What that derivation gives for these models (one multiply-add = 2 FLOPs;
  ``Hout x Wout`` is the op's output size):

  * Conv kernel ``(kh, kw, cin, cout)``: ``2 * kh * kw * cin * cout * Hout * Wout``.
  * Conv bias, BatchNorm scale, BatchNorm bias: ``cout * Hout * Wout`` each (one op
    per output element: the bias add; the multiply by ``scale * rsqrt(var +
    eps)``, in evaluation mode).
  * Dense kernel ``(din, dout)``: ``2 * din * dout``; dense bias: ``dout``.
  * LSTM, per sample of ``seq_len`` tokens (everything runs once per token):
    ``kernel_ih`` ``2 * din * 4h * seq_len``, ``kernel_hh`` ``2 * h * 4h * seq_len``,
    each bias ``4h * seq_len``, embedding ``embed * seq_len`` (a gather: one op per
    output element), decoder kernel ``2 * h * vocab * seq_len``, decoder bias
    ``vocab * seq_len``.
  * Transformer (``gpt2_small``), per sample of ``seq_len`` tokens (a sequence;
    everything runs once per token): ``wte`` ``2 * d * vocab * seq_len`` (the
    tied logits) plus ``d * seq_len`` (the gather), ``wpe`` ``d * seq_len``
    (its add), each Dense kernel ``2 * din * dout * seq_len``, each bias and
    LayerNorm scale / bias its size times ``seq_len``; each block's
    ``attn/c_attn/kernel`` also carries the block's attention products
    (:func:`attention_flops`): ``q k^T`` ``2 * d * seq_len^2`` plus the
    weighted sum of ``v`` ``2 * d * seq_len^2``, i.e. ``4 * d * seq_len`` per
    token, the causal mask applied to the full square (the model computes
    every score). They combine activations only, so the jaxpr walk attributes
    them to no tensor; they are added to the QKV projection whose outputs they
    consume. At 1,024 tokens they are 13 % of GPT-2 small's forward FLOPs
    (38.7 of 291 GFLOP per sequence); per token the count is no longer
    constant in ``seq_len``.

  Input geometry: ResNet-50 on :data:`IMAGENET_INPUT_SIZE` (torchvision v1.5: 7x7
  stride-2 stem to 112, max-pool to 56, stages at 56 / 28 / 14 / 7 with the stride
  on conv2 of each stage's first block and on its downsample conv); ResNet-20 on
  :data:`CIFAR_INPUT_SIZE` (32 / 16 / 8, first conv of stages 2 and 3 strided);
  VGG-16 on :data:`CIFAR_INPUT_SIZE` (convs at 32, 32 | 16, 16 | 8, 8, 8 | 4, 4, 4 |
  2, 2, 2); classifiers act on the pooled 1x1 features; GPT-2 small on sequences
  of its context, 1024 tokens (per token: divide by ``seq_len``; the
  attention part grows with it). Activations,
  pooling,
  residual adds (and option-A shortcuts), BatchNorm's centring and the LSTM's gate
  nonlinearities and elementwise products are attributed to no tensor.

  Args:
    model: a key of :data:`MODELS`.
    **kwargs: those of the model's ``MODELS`` function; ``"lstm_ptb"`` takes those
      of :func:`lstm_ptb_shapes` plus ``seq_len`` (default :data:`PTB_SEQ_LEN`),
      ``"gpt2_small"`` ``vocab_size`` and ``seq_len`` (default the context, 1024).

  Returns:
    One FLOP count per parameter tensor, in the order of ``MODELS[model](**kwargs)``.

  Raises:
    ValueError: if ``model`` is not a key of :data:`MODELS`, or ``seq_len < 1``
      (or, for ``gpt2_small``, longer than the context).
  """
  return [t.flops for t in _tensors(model, **kwargs)]


def total_size(shapes: Sequence[tuple[str, Shape]]) -> int:
  """Total number of elements of a shape list."""
  return sum(math.prod(s) for _, s in shapes)


def make_tree(
  shapes: Sequence[tuple[str, Shape]],
  dtype: jnp.dtype = jnp.float32,
  seed: int = 0,
  scale: float = 1.0,
) -> dict[str, jnp.ndarray]:
  """Random gradient-like tree ``{name: array}`` in the order of ``shapes``.

  Values are ``scale * N(0, 1)``, drawn with NumPy (much faster than JAX's threefry
  on CPU) in float32, then converted with :func:`jax.numpy.asarray`. (``jax.tree``
  flattens the dict in sorted-name order, which is also the flax model's tree
  order: names hold only letters, digits and ``_`` besides the ``/``.)

  Args:
    shapes: ``(name, shape)`` pairs, e.g. :func:`resnet50_shapes`.
    dtype: dtype of the leaves.
    seed: NumPy RNG seed.
    scale: standard deviation of the values.

  Returns:
    A dict with the insertion order of ``shapes``.
  """
  rng = np.random.default_rng(seed)
  tree = {}
  for name, shape in shapes:
    x = rng.standard_normal(shape, dtype=np.float32)
    if scale != 1.0:
      x *= np.float32(scale)
    tree[name] = jnp.asarray(x, dtype=dtype)
  return tree
