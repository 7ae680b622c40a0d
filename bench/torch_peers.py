"""PyTorch peers of gradcomp's compressors, for the compress suite (issue 18).

The same algorithms as ``peers.py`` (naive ``jax.numpy``), written the obvious
way in eager PyTorch on the CPU: one worker, compress + decompress of each
tensor, "per tensor" a Python loop over the model's 161 gradient tensors (as a
per-parameter communication hook runs), "one buffer" the pre-flattened
gradient. Error feedback, where gradcomp's row has it, is the obvious
``e = r + g``, ``r = e - out``; PowerSGD (rank 4) is ``powerSGD_hook``'s
recipe: 1-D tensors pass uncompressed, the others are viewed as
``(-1, last dim)`` matrices (a 1-D buffer as a zero-padded near-square
matrix, as gradcomp does), ``P = M Q``, ``P`` orthonormalised by QR,
``Q = M^T P``, output ``P Q^T``, ``Q`` kept as the warm start. The sign
codecs send packed sign bits (8 per byte) and unpack them.

On a GPU (when JAX runs on one) the tensors live on it and each call ends
with ``torch.cuda.synchronize()``. PyTorch is not a dependency of gradcomp:
``pip install torch`` (the CPU build; BUILD_NOTES says which) makes
``python -m bench compress`` time these beside its own rows;
without it the suite says so and goes on.
Each timed call gets fresh copies of the gradients, made before the clock
starts, and its outputs are released after it stops, as for the JAX rows
(``timing.py``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


def available() -> bool:
  """Whether PyTorch can be imported."""
  try:
    import torch  # noqa: F401, PLC0415
  except ImportError:
    return False
  return True


def _keep(n: int, ratio: float) -> int:
  return max(1, math.ceil(ratio * n))


def _algorithms(torch, device="cpu") -> dict[str, tuple[Callable, Callable]]:
  """label -> (fn(x, leaf_state, alone) -> (out, leaf_state), init(x, alone))."""

  def topk(x, s, alone, ratio=0.01):
    flat = x.reshape(-1)
    _, idx = torch.topk(flat.abs(), _keep(flat.numel(), ratio), sorted=False)
    out = torch.zeros_like(flat)
    out[idx] = flat[idx]
    return out.view_as(x), s

  def randomk(x, s, alone, ratio=0.01):
    flat = x.reshape(-1)
    idx = torch.randint(0, flat.numel(), (_keep(flat.numel(), ratio),), device=device)
    out = torch.zeros_like(flat)
    out[idx] = flat[idx]
    return out.view_as(x), s

  def dgc(x, s, alone, ratio=0.01, momentum=0.9, sample_ratio=0.01):
    u, v = s
    u.mul_(momentum).add_(x)
    v.add_(u)
    flat = v.reshape(-1)
    n = flat.numel()
    size = (max(1, math.ceil(sample_ratio * n)),)
    sample = flat[torch.randint(0, n, size, device=device)].abs()
    thr = torch.topk(sample, _keep(sample.numel(), ratio), sorted=False).values.min()
    idx = (flat.abs() >= thr).nonzero().reshape(-1)[: _keep(n, ratio)]
    out = torch.zeros_like(flat)
    out[idx] = flat[idx]
    u.reshape(-1)[idx] = 0
    flat[idx] = 0
    return out.view_as(x), s

  def qsgd(x, s, alone, levels=4, bucket=512):
    flat = x.reshape(-1)
    b = torch.nn.functional.pad(flat, (0, -flat.numel() % bucket)).view(-1, bucket)
    norm = b.norm(dim=1, keepdim=True)
    level = b.abs() / torch.where(norm > 0, norm, torch.ones_like(norm)) * levels
    xi = torch.floor(level + torch.rand_like(b))
    out = norm * b.sign() * xi / levels
    return out.reshape(-1)[: flat.numel()].view_as(x), s

  def terngrad(x, s, alone):
    m = x.abs().max()
    keep = torch.rand_like(x) * m < x.abs()
    return m * x.sign() * keep, s

  shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=device)

  def sign_bits(x):
    """``x`` through packed sign bits (the 1-bit payload), back to +-1."""
    flat = (x.reshape(-1) >= 0).to(torch.uint8)
    flat = torch.nn.functional.pad(flat, (0, -flat.numel() % 8))
    bits = (flat.view(-1, 8) << shifts).sum(dim=1, dtype=torch.uint8)
    signs = ((bits[:, None] >> shifts) & 1).reshape(-1)[: x.numel()]
    return (signs.float() * 2 - 1).view_as(x)

  def signsgd(x, s, alone):
    return sign_bits(x), s

  def scaled_sign(x, s, alone):
    return x.abs().mean() * sign_bits(x), s

  def fp16(x, s, alone):
    return x.half().float(), s

  def powersgd(x, q, alone):
    if q is None:  # powerSGD_hook: 1-D tensors go uncompressed.
      return x, q
    if x.dim() >= 2:
      m = x.reshape(-1, x.shape[-1])
    else:  # the one buffer: near-square, zero-padded (as gradcomp does).
      rows = math.isqrt(x.numel() - 1) + 1
      pad = rows * q.shape[0] - x.numel()
      m = torch.nn.functional.pad(x, (0, pad)).view(rows, q.shape[0])
    p, _ = torch.linalg.qr(m @ q)
    q = m.t() @ p
    return (p @ q.t()).reshape(-1)[: x.numel()].view_as(x), q

  def no_state(x, alone):
    return None

  def dgc_init(x, alone):
    return torch.zeros_like(x), torch.zeros_like(x)

  def powersgd_init(x, alone, rank=4):
    if x.dim() >= 2:
      cols = x.shape[-1]
    elif alone:
      cols = -(-x.numel() // (math.isqrt(x.numel() - 1) + 1))
    else:
      return None
    q = torch.randn(cols, rank, generator=torch.Generator().manual_seed(0))
    return q.to(device)

  return {
    "fp16": (fp16, no_state),
    "topk": (topk, no_state),
    "randomk": (randomk, no_state),
    "dgc": (dgc, dgc_init),
    "qsgd": (qsgd, no_state),
    "terngrad": (terngrad, no_state),
    "signsgd": (signsgd, no_state),
    "ef_signsgd": (scaled_sign, no_state),
    "powersgd": (powersgd, powersgd_init),
  }


LABELS = ("fp16", "topk", "randomk", "dgc", "qsgd", "terngrad", "signsgd")
LABELS += ("ef_signsgd", "powersgd")


def contender(
  label: str,
  error_feedback: bool,
  tensors: Sequence[np.ndarray],
  *,
  warmup: int = 1,
) -> tuple[Callable[[], Any], Callable[[Any], Any], Callable[[list[float]], dict]]:
  """The PyTorch peer of ``label`` on ``tensors`` (float32), warmed up.

  Returns ``(prepare, call, result)`` for ``timing.interleaved`` (the compress
  suite's ``Contender``): fresh clones of the tensors, one call (returning once
  the device is done), and the JSON record of a list of times.
  """
  import torch  # noqa: PLC0415  (optional: not a gradcomp dependency)

  torch.manual_seed(1)
  device = "cuda" if _on_gpu() and torch.cuda.is_available() else "cpu"
  fn, leaf_init = _algorithms(torch, device)[label]
  sources = [torch.from_numpy(np.array(t, np.float32)).to(device) for t in tensors]
  alone = len(sources) == 1
  states = [leaf_init(x, alone) for x in sources]
  residuals = [torch.zeros_like(x) for x in sources] if error_feedback else None

  def sync():
    if device == "cuda":
      torch.cuda.synchronize()

  def prepare():
    xs = [x.clone() for x in sources]
    sync()
    return xs

  def call(xs):
    nonlocal residuals
    es = [r + x for r, x in zip(residuals, xs, strict=True)] if error_feedback else xs
    outs = []
    for i, e in enumerate(es):
      out, states[i] = fn(e, states[i], alone)
      outs.append(out)
    if error_feedback:
      residuals = [e - out for e, out in zip(es, outs, strict=True)]
    sync()
    return outs

  for _ in range(1 + warmup):
    call(prepare())

  def result(times: list[float]) -> dict[str, Any]:
    return {
      "median_ms": statistics.median(times),
      "min_ms": min(times),
      "times_ms": list(times),
      "torch_version": torch.__version__,
      "threads": torch.get_num_threads(),
      "device": device,
    }

  return prepare, call, result


def _on_gpu() -> bool:
  """Whether JAX runs on a GPU here: the PyTorch peers then run on it too."""
  import jax  # noqa: PLC0415

  return jax.default_backend() == "gpu"
