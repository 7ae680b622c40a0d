r"""Paper 001's time model: S-SGD, BIT-SGD, OD-SGD and CD-SGD step by step.

Paper 001 §2 and §3.3, eqs. 2-9. With ``tau`` the computation (forward and
backward) of one step, ``phi`` the full-precision exchange, ``psi`` the
2-bit exchange and ``delta`` the codec's time (Table 1):

* S-SGD, eq. 2: ``T = tau + phi``: compute, then exchange;
* BIT-SGD, eq. 5: ``T = tau + delta + psi``: compute, compress, exchange;
* OD-SGD (local update), eq. 4: ``T = max(tau, phi)``: the exchange of one
  step runs under the next step's compute;
* CD-SGD, eqs. 6-7: ``T = max(tau, phi_i)`` with ``phi_i = delta + psi`` on
  compressed messages and ``phi`` on the full-precision one of every ``k``.

**The step convention** (that of :func:`gradcomp.cdsgd`, and of Alg. 1 with
the switch's exchange moved under the next step). With ``n =
warmup_steps``, training steps ``t = 1, 2, ...`` are

* ``t < n``: warm-up, synchronous full-precision SGD: ``tau + phi``
  (:func:`delayed_exchange` says ``"synchronous"``);
* ``t = max(n, 1)``: the switch (or, without warm-up, the first step): its
  gradient becomes the first *message*, and no message is waiting to be
  exchanged under it: ``tau`` (``"none"``);
* ``t > max(n, 1)``: the message built at step ``t - 1`` is exchanged under
  step ``t``'s compute: ``max(tau, phi_{t-1})`` (``"full"`` or
  ``"compressed"``).

The message built at step ``m >= max(n, 1)`` has formal count ``c = m - n``
(the switch's is ``c = 0``) and is full precision when ``c % k == 0``, else
compressed: after the switch, ``k - 1`` compressed messages, then a full one
(Fig. 2 with k = 4). ``k = 1`` never compresses: OD-SGD. So the first formal
step ``n + 1`` exchanges the switch's message in full precision and costs
``max(tau, phi)``; and the switch step itself costs ``tau``, not ``tau +
phi``: its exchange is the one hidden under step ``n + 1``, counted once.
(The scheme's compiled program may run its collective on a zero message at
the switch; there is nothing to send, and this model prices it as nothing.)
With ``warmup_steps=0`` and ``1`` the first step is the switch; they differ
only in the first message's precision (``c = 1``: compressed for ``k > 1``;
``c = 0``: full).

**Per-worker events** (:func:`simulate_delayed`). On a
described :class:`~gradcomp.sim.cluster.Cluster` worker ``w`` computes step
``t`` in ``c_w(t)`` (:meth:`Cluster.compute_seconds`: speeds, slowdowns,
failures); the exchange of message ``m`` starts when every worker has
finished step ``m`` and the link is free (one exchange at a time), and must
end before any worker starts step ``m + 2`` (a synchronous one: ``m + 1``).
With ``S``, ``F`` a worker's start and finish, ``X``, ``E`` an exchange's
start and end and ``R(t)`` the exchange that gates step ``t``::

  S_w(t) = max(F_w(t-1), R(t))      F_w(t) = S_w(t) + c_w(t)
  X(m)   = max(max_w F_w(m), E(m'))  E(m)   = X(m) + d(m)   (m' the last one)
  R(t)   = E(t-1) after a synchronous step t-1, else E(t-2) (0 if none)

with ``d = phi`` (full) or ``delta + psi`` (compressed). The time after step
``t`` is when every worker could start step ``t + 1``: ``max_w max(F_w(t),
R(t+1))``, i.e. when the params the step produced exist on every worker. On
identical workers this is the closed form above, step by step
(:func:`method_step_seconds`); on unequal ones the one-step slack lets a
slowdown of one worker overlap a slowdown of another in the next step, which
a per-step ``tau_t = max_w c_w(t)`` cannot show. A failed worker never
finishes: a failure in step ``t`` stalls the run at the end of step ``t +
1`` (of step ``t`` if it is synchronous), and until then the time is that of
the healthy workers, as :class:`~gradcomp.sim.clock.SimClock` reports it.

The synchronous references are :func:`~gradcomp.sim.clock.simulate_rounds`
with a round every step: S-SGD with the full-precision wire; BIT-SGD with the
compressed wire plus ``delta * t`` (a barrier every step makes a constant
per-step cost add up exactly). Everything here is NumPy.

References:
  Paper 001 §2.1-2.3 (eqs. 2, 4, 5), §3.1-3.3 (Fig. 2, Alg. 1, eqs. 6-9).
"""

from __future__ import annotations

import math

import numpy as np

from gradcomp.sim.clock import _check_positive
from gradcomp.sim.cluster import Cluster, _check_step, _is_int, _is_real

#: The methods :func:`method_step_seconds` prices (paper 001 §4).
METHODS = ("ssgd", "bitsgd", "odsgd", "cdsgd")
#: What :func:`delayed_exchange` says about a step's exchange.
EXCHANGES = ("synchronous", "none", "full", "compressed")


def _seconds(name: str, value) -> float:
  """A finite time >= 0, as a float; else ``ValueError``."""
  if not _is_real(value) or not np.isfinite(value) or value < 0:
    raise ValueError(f"{name} must be finite and >= 0 seconds, got {value!r}")
  return float(value)


def _check_k(k) -> int:
  if not _is_int(k) or k < 1:
    raise ValueError(f"k must be an integer >= 1, got {k!r}")
  return int(k)


def _check_warmup(warmup_steps) -> int:
  if not _is_int(warmup_steps) or warmup_steps < 0:
    raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
  return int(warmup_steps)


def _check_method(method) -> str:
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
  return method


def delayed_exchange(step: int, *, k: int, warmup_steps: int) -> str:
  """What is exchanged in (or under) training step ``step`` of CD-SGD / OD-SGD.

  The module docstring's convention, with ``n = warmup_steps``:

  * ``"synchronous"``: ``step < n``, the step's own gradient, full precision,
    after its compute (a barrier);
  * ``"none"``: ``step == max(n, 1)``, the switch: no message is waiting;
  * ``"full"`` / ``"compressed"``: ``step > max(n, 1)``, the message of step
    ``step - 1``, whose formal count ``c = step - 1 - n`` is full precision
    when ``c % k == 0``.

  Args:
    step: the training step, 1-based.
    k: one message in ``k`` is full precision, >= 1 (``1``: OD-SGD).
    warmup_steps: the synchronous steps before the switch, >= 0.

  Returns:
    One of :data:`EXCHANGES`.

  Examples:
    >>> [delayed_exchange(t, k=2, warmup_steps=3) for t in range(1, 8)]
    ['synchronous', 'synchronous', 'none', 'full', 'compressed', 'full', 'compressed']

  References:
    Paper 001 Alg. 1 (warm-up, lines 1-16; ``count % k``, line 23), eq. 6.
  """
  _check_step(step)
  k, n = _check_k(k), _check_warmup(warmup_steps)
  if step < n:
    return "synchronous"
  if step == max(n, 1):
    return "none"
  return "full" if (step - 1 - n) % k == 0 else "compressed"


def method_step_seconds(
  method: str,
  step: int,
  *,
  tau: float,
  phi: float,
  psi: float | None = None,
  delta: float = 0.0,
  k: int = 2,
  warmup_steps: int = 0,
) -> float:
  """Seconds of training step ``step`` under paper 001's time model.

  .. math::

    T^{ssgd} = \\tau + \\varphi, \\quad
    T^{bit} = \\tau + \\delta + \\psi, \\quad
    T^{cd}_t = \\max(\\tau, \\varphi^{cd}_{t-1}),\\;
    \\varphi^{cd} = \\begin{cases} \\delta + \\psi & c \\bmod k \\ne 0 \\\\
    \\varphi & c \\bmod k = 0 \\end{cases}

  ``"odsgd"`` is ``"cdsgd"`` with ``k = 1`` (eq. 4, ``max(tau, phi)``; its
  ``k`` argument is ignored). For OD-SGD and CD-SGD the warm-up and the
  switch follow :func:`delayed_exchange`: ``tau + phi``, then ``tau``, then
  ``max(tau, .)``. S-SGD and BIT-SGD cost the same every step.

  Args:
    method: one of :data:`METHODS`.
    step: the training step, 1-based.
    tau: computation of one step (forward + backward), seconds.
    phi: full-precision exchange, seconds.
    psi: compressed exchange, seconds; needed by ``"bitsgd"`` and by
      ``"cdsgd"`` with ``k > 1``.
    delta: the codec's time (compress + decompress), seconds.
    k: CD-SGD's period of full-precision messages, >= 1.
    warmup_steps: synchronous steps before the switch, >= 0.

  Returns:
    Seconds (all times finite and >= 0, else ``ValueError``).

  Examples:
    >>> [method_step_seconds("cdsgd", t, tau=1.0, phi=3.0, psi=0.5, delta=0.25,
    ...                      k=2, warmup_steps=2) for t in range(1, 6)]
    [4.0, 1.0, 3.0, 1.0, 3.0]

  References:
    Paper 001 eqs. 2, 4, 5, 6 and 7.
  """
  method = _check_method(method)
  _check_step(step)
  tau, phi, delta = _seconds("tau", tau), _seconds("phi", phi), _seconds("delta", delta)
  k, n = _check_k(k), _check_warmup(warmup_steps)
  if method == "odsgd":
    k = 1
  needs_psi = method == "bitsgd" or (method == "cdsgd" and k > 1)
  if psi is None:
    if needs_psi:
      raise ValueError(f"psi must be given for method {method!r} with k={k}")
  else:
    psi = _seconds("psi", psi)
  if method == "ssgd":
    return tau + phi
  if method == "bitsgd":
    return tau + delta + psi
  exchange = delayed_exchange(step, k=k, warmup_steps=n)
  if exchange == "synchronous":
    return tau + phi
  if exchange == "none":
    return tau
  return max(tau, phi if exchange == "full" else delta + psi)


def steady_step_seconds(
  method: str,
  *,
  tau: float,
  phi: float,
  psi: float | None = None,
  delta: float = 0.0,
  k: int = 2,
) -> float:
  """The mean step after warm-up: one period of ``k`` messages.

  .. math::

    \\bar T^{cd} = \\frac{(k-1)\\max(\\tau, \\delta + \\psi)
      + \\max(\\tau, \\varphi)}{k}

  which is §3.3 ②'s ``((k-1)(delta + psi) + phi) / k`` when the exchange is
  the bottleneck, and ``tau`` when computation is (then independent of
  ``k``, Table 2: computed as ``tau`` plus the mean exposed exchange, so
  it is ``tau`` exactly then). S-SGD, BIT-SGD and OD-SGD cost the same every
  step. It is
  the mean of :func:`method_step_seconds` over any ``k`` consecutive steps
  after the switch.

  Args:
    method, tau, phi, psi, delta, k: as for :func:`method_step_seconds`.

  Returns:
    Seconds per step.

  Examples:
    With ``tau = 1``, ``phi = 3`` and ``delta + psi = 0.75``, CD-SGD's
    ``k = 2`` period costs ``(max(1, 0.75) + max(1, 3)) / 2 = 2``; S-SGD
    ``1 + 3``, BIT-SGD ``1 + 0.75``, OD-SGD ``max(1, 3)``.

    >>> from gradcomp.sim import steady_step_seconds
    >>> times = dict(tau=1.0, phi=3.0, psi=0.5, delta=0.25)
    >>> methods = ("ssgd", "bitsgd", "odsgd", "cdsgd")
    >>> [steady_step_seconds(m, **times, k=2) for m in methods]
    [4.0, 1.75, 3.0, 2.0]
    >>> steady_step_seconds("cdsgd", **{**times, "tau": 4.0}, k=2)  # compute-bound
    4.0

  References:
    Paper 001 §3.3 (eqs. 6-7 and conclusion ②).
  """
  method = _check_method(method)
  tau, phi, delta = _seconds("tau", tau), _seconds("phi", phi), _seconds("delta", delta)
  k = 1 if method == "odsgd" else _check_k(k)
  if psi is None:
    if method == "bitsgd" or (method == "cdsgd" and k > 1):
      raise ValueError(f"psi must be given for method {method!r} with k={k}")
    psi = 0.0
  psi = _seconds("psi", psi)
  if method == "ssgd":
    return tau + phi
  if method == "bitsgd":
    return tau + delta + psi
  # tau plus the mean exposed exchange: exactly tau when compute-bound.
  return tau + ((k - 1) * max(0.0, delta + psi - tau) + max(0.0, phi - tau)) / k


def _saving_args(tau, phi, psi, delta, full_precision):
  if not isinstance(full_precision, bool):
    raise ValueError(f"full_precision must be True or False, got {full_precision!r}")
  tau, phi = _seconds("tau", tau), _seconds("phi", phi)
  psi, delta = _seconds("psi", psi), _seconds("delta", delta)
  return tau, phi, psi, delta, phi if full_precision else delta + psi


def saving_over_local_update(
  *, tau: float, phi: float, psi: float, delta: float = 0.0, full_precision: bool
) -> float:
  """``T_s^loc``: what a CD-SGD step saves over OD-SGD's (local update), eq. 8.

  .. math::

    T_s^{loc} = \\begin{cases}
      0 & \\tau \\ge \\varphi \\\\
      \\varphi - \\tau & \\varphi^{cd} \\le \\tau < \\varphi \\\\
      \\varphi - \\delta - \\psi & \\tau < \\varphi^{cd},\\ i \\bmod k \\ne 0 \\\\
      0 & \\tau < \\varphi^{cd},\\ i \\bmod k = 0
    \\end{cases}

  as printed (its cases tested in order; ties, which the paper leaves open,
  go to the earlier case, where the cases agree). It equals its definition
  ``T^loc - T^cd = max(tau, phi) - max(tau, phi_cd)`` (eqs. 4, 7) whenever
  ``delta + psi <= max(tau, phi)``, i.e. when compressing does not make the
  exchange the bottleneck where full precision was not; otherwise eq. 8's
  first case says 0 where the definition is ``tau - delta - psi < 0`` (or
  its third ``phi - delta - psi`` where it is ``tau - delta - psi``).

  Args:
    tau, phi, psi, delta: seconds, as for :func:`method_step_seconds`.
    full_precision: whether the message exchanged under the step is the
      full-precision one (eq. 6's ``i mod k = 0``).

  Returns:
    Seconds saved per step.

  Examples:
    With ``tau = 1``, ``phi = 3``, ``delta + psi = 0.75``: OD-SGD's step is
    ``max(1, 3) = 3``; CD-SGD's is ``max(1, 0.75) = 1`` under a compressed
    message (saving ``phi - tau = 2``) and 3 under a full one (saving 0).

    >>> from gradcomp.sim import saving_over_local_update
    >>> times = dict(tau=1.0, phi=3.0, psi=0.5, delta=0.25)
    >>> saving_over_local_update(**times, full_precision=False)
    2.0
    >>> saving_over_local_update(**times, full_precision=True)
    0.0

  References:
    Paper 001 §3.3, eq. 8.
  """
  tau, phi, psi, delta, phi_cd = _saving_args(tau, phi, psi, delta, full_precision)
  if tau >= phi:
    return 0.0
  if tau >= phi_cd:
    return phi - tau
  return 0.0 if full_precision else phi - delta - psi


def saving_over_bitsgd(
  *, tau: float, phi: float, psi: float, delta: float = 0.0, full_precision: bool
) -> float:
  """``T_s^bit``: what a CD-SGD step saves over BIT-SGD's, eq. 9.

  .. math::

    T_s^{bit} = \\begin{cases}
      \\delta + \\psi & \\tau \\ge \\varphi^{cd} \\\\
      \\tau & \\tau < \\varphi^{cd},\\ i \\bmod k \\ne 0 \\\\
      \\tau + \\delta + \\psi - \\varphi & \\tau < \\varphi^{cd},\\ i \\bmod k = 0
    \\end{cases}

  as printed (ties to the first case, where the cases agree). It always
  equals its definition ``T^bit - T^cd`` (eqs. 5, 7); the third case is
  negative when the full-precision exchange is longer than a BIT-SGD step
  (§3.3).

  Args:
    tau, phi, psi, delta: seconds, as for :func:`method_step_seconds`.
    full_precision: whether the message exchanged under the step is the
      full-precision one (eq. 6's ``i mod k = 0``).

  Returns:
    Seconds saved per step (negative: CD-SGD's step is longer).

  Examples:
    With ``tau = 1``, ``phi = 3``, ``delta + psi = 0.75``: BIT-SGD's step is
    ``1 + 0.75 = 1.75``; CD-SGD's is 1 under a compressed message (saving
    ``delta + psi``) and ``max(1, 3) = 3`` under a full one (saving -1.25).

    >>> from gradcomp.sim import saving_over_bitsgd
    >>> times = dict(tau=1.0, phi=3.0, psi=0.5, delta=0.25)
    >>> saving_over_bitsgd(**times, full_precision=False)
    0.75
    >>> saving_over_bitsgd(**times, full_precision=True)
    -1.25

  References:
    Paper 001 §3.3, eq. 9.
  """
  tau, phi, psi, delta, phi_cd = _saving_args(tau, phi, psi, delta, full_precision)
  if tau >= phi_cd:
    return delta + psi
  return tau + delta + psi - phi if full_precision else tau


def _wire_seconds(cluster: Cluster, name: str, wire) -> float:
  """``cluster.comm_seconds`` of ``{kind: bytes}`` or ``{kind: (bytes, messages)}``."""
  if not isinstance(wire, dict):
    raise ValueError(f"{name} must be a dict {{kind: bytes}}, got {wire!r}")
  priced = {}
  for kind, value in wire.items():
    nbytes, messages = value if isinstance(value, tuple) else (value, 1)
    if not _is_real(nbytes) or not np.isfinite(nbytes) or nbytes < 0:
      raise ValueError(
        f"{name}[{kind!r}] must be finite bytes >= 0 (or (bytes, messages)), "
        f"got {value!r}"
      )
    if not _is_int(messages) or messages < 1:
      raise ValueError(
        f"{name}[{kind!r}] messages must be an integer >= 1, got {value!r}"
      )
    if nbytes:
      priced[kind] = (nbytes, messages)
  return float(cluster.comm_seconds(priced))


def simulate_delayed(
  cluster: Cluster,
  flops_per_step: float,
  full_wire: dict,
  compressed_wire: dict | None,
  *,
  k: int,
  warmup_steps: int,
  steps: int,
  delta: float = 0.0,
) -> np.ndarray:
  """Simulated seconds after each step 0 to ``steps`` of a CD-SGD run on a cluster.

  Plays out the module docstring's per-worker recursion: warm-up steps end
  in a synchronous full-precision exchange; from the switch on, message
  ``m`` is exchanged after every worker has finished step ``m`` (and the
  previous exchange has ended), and step ``m + 2`` waits for it. On identical
  workers each step costs :func:`method_step_seconds` with ``tau`` the
  compute, ``phi = Comm(full_wire)`` and ``psi = Comm(compressed_wire)``
  (``k = 1`` is OD-SGD). Entry ``t`` is when every worker could start step
  ``t + 1``, i.e. when the params of step ``t`` exist on every worker; the
  exchange of the last message is still in flight then. The clock is a pure
  function of its inputs, as :func:`~gradcomp.sim.clock.simulate_rounds`.

  Args:
    cluster: the described cluster (speeds, slowdowns, failures, links).
    flops_per_step: one worker's training FLOPs per step, finite and > 0.
    full_wire: ``{kind: bytes}`` of one full-precision exchange (as read from
      a compiled step's HLO: one message per kind), or ``{kind: (bytes,
      messages)}``; priced by :meth:`Cluster.comm_seconds`.
    compressed_wire: the same for a compressed exchange; ``None``: no
      compressor, every message full precision whatever ``k`` (OD-SGD, as
      :func:`gradcomp.cdsgd` with ``compressor=None``).
    k: one message in ``k`` is full precision, >= 1.
    warmup_steps: synchronous full-precision steps before the switch, >= 0.
    steps: the run's number of steps, >= 0.
    delta: the codec's time per compressed message, finite and >= 0
      seconds; it delays the exchange, not the compute (§3.2.2).

  Returns:
    float64 array of shape ``(steps + 1,)``: ``[0]`` is 0. A worker failing
    in step ``t`` makes the entries from ``t + 1`` on ``inf`` (from ``t`` on
    if step ``t`` is synchronous); entry ``t`` is the healthy workers'.

  Examples:
    >>> c = Cluster(2, flops_per_second=1.0, latency_us=0.0, bandwidth_gbps=8.0)
    >>> simulate_delayed(c, 1.0, {"all-reduce": 3e9}, None, k=1,
    ...                  warmup_steps=0, steps=3).round(9).tolist()
    [0.0, 1.0, 4.0, 7.0]

  References:
    Paper 001 §3.1 (Fig. 2), Alg. 1, eqs. 6-7;
  """
  if not isinstance(cluster, Cluster):
    raise ValueError(f"cluster must be a Cluster, got {cluster!r}")
  flops = _check_positive("flops_per_step", flops_per_step)
  k, n = _check_k(k), _check_warmup(warmup_steps)
  if not _is_int(steps) or steps < 0:
    raise ValueError(f"steps must be an integer >= 0, got {steps!r}")
  delta = _seconds("delta", delta)
  phi = _wire_seconds(cluster, "full_wire", full_wire)
  if compressed_wire is None:
    k = 1  # no compressor: every message full precision (OD-SGD).
    compressed = math.inf  # never used
  else:
    compressed = _wire_seconds(cluster, "compressed_wire", compressed_wire) + delta

  seconds = np.zeros(steps + 1)
  finish = np.zeros(cluster.workers)  # F_w(t - 1)
  gate = 0.0  # R(t): the end of the exchange that step t waits for.
  link = 0.0  # E of the last exchange: the link is free from then on.
  pending = None  # E(t - 1) of a message exchanged under step t: gates t + 1.
  for t in range(1, steps + 1):
    start = np.maximum(finish, gate)
    finish = start + cluster.compute_seconds(flops, t)
    synchronous = delayed_exchange(t, k=k, warmup_steps=n) == "synchronous"
    # Message t: the step's own gradient; a formal one has count c = t - n.
    duration = phi if synchronous or (t - n) % k == 0 else compressed
    link = max(finish.max(), link) + duration
    if synchronous:
      gate = link  # Step t + 1 waits for message t.
    else:
      if pending is not None:
        gate = pending  # Step t + 1 waits for message t - 1.
      pending = link
    done = np.maximum(finish, gate)
    finite = done[np.isfinite(done)]
    seconds[t] = finite.max() if finite.size else math.inf
  return seconds
