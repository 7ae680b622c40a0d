r"""An MLP on scikit-learn's digits, Sketch-Fusion SGD over 8 workers.

The default config: sketch_topk (paper 000 Alg. 1, 5% of the coordinates)
inside LayerFusion with the plan its cost model chooses (``plan="auto"``: it
profiles the compressor first, about 10-20 s, then here fuses the four leaves
into one buffer; ``plan.json`` keeps the plan, and a resume reads it back),
then SGD with momentum, on 8 virtual CPU devices. 600 steps of 128 images (53
epochs); on a quiet 2-core CPU it takes about 20 s end to end (65 s on one
shared with other jobs, 2026-11-28) and ends at test accuracy 0.978
(eval_loss 0.074), sending 11,064 bytes per step per worker against
38,456 with ``none`` (the dense fp32 all-reduce; both include 16 bytes of
logged metrics and the non-finite agreement):

  python -m train --config configs/default.py --workdir /tmp/wd_default

Other compressors and plans from the command line, e.g.:

  python -m train --config configs/default.py --workdir /tmp/wd_topk \
    --config.compressor.name=topk --config.compressor.ratio=0.01 \
    --config.fusion.plan=layerwise

Fields of ``config.compressor`` other than ``name`` are the factory's keyword
arguments; ``None`` leaves the factory's default, and a set field the chosen
compressor does not take is ignored with a warning.

Training schemes the same way, e.g. local SGD averaging every 8
steps, or DiLoCo with top-k 1 % pseudo-gradients:

  python -m train --config configs/default.py --workdir /tmp/wd_local \
    --config.scheme.name=local_sgd --config.scheme.every=8 \
    --config.compressor.name=none
  python -m train --config configs/default.py --workdir /tmp/wd_diloco \
    --config.scheme.name=local_sgd --config.scheme.every=8 \
    --config.scheme.outer_learning_rate=0.7 \
    --config.compressor.name=topk --config.compressor.ratio=0.01

CD-SGD (paper 001) with 2-bit threshold codes and a full-precision message
every k=2 steps, after 50 synchronous warm-up steps:

  python -m train --config configs/default.py --workdir /tmp/wd_cdsgd \
    --config.scheme.name=cdsgd --config.scheme.local_learning_rate=0.1 \
    --config.scheme.warmup_steps=50 --config.scheme.k=2 \
    --config.compressor.name=threshold_quantize \
    --config.compressor.threshold=0.01 --config.fusion.plan=none

``metrics.jsonl`` then also carries ``sim_seconds`` (the simulated clock of
``config.cluster``) and, for a scheme, ``consensus_distance``.

Meshes with several axes (``config.mesh``, DESIGN §7, ``train/mesh.py``):
FSDP, params and optimizer state sharded over 4 devices and top-k across
the 2 groups on each device's shard; or hierarchical compression, a dense
reduce-scatter inside each "node" of 4 and top-k between the 2 nodes:

  python -m train --config configs/default.py --workdir /tmp/wd_fsdp \
    --config.mesh=data=2,fsdp=4 --config.compressor.name=topk \
    --config.compressor.ratio=0.01
  python -m train --config configs/default.py --workdir /tmp/wd_nodes \
    --config.mesh=node=2,local=4 --config.compressor.hierarchical=local \
    --config.compressor.name=topk --config.compressor.ratio=0.01
"""

import ml_collections
from ml_collections import config_dict


def compressor(name: str, **kwargs) -> ml_collections.ConfigDict:
  """Compressor fields: every known keyword, unset unless given."""
  c = ml_collections.ConfigDict()
  c.name = name
  for key, kind in (
    ("ratio", float),
    ("rows", int),
    ("cols", int),
    ("rank", int),
    ("levels", int),
    ("threshold", float),
    ("momentum", float),
    ("seed", int),
    ("error_feedback", bool),
    ("bits", int),
    ("int_bits", int),
    ("block_size", int),
    ("max_ratio", float),
    ("format", str),
    ("stochastic", bool),
    # The program's, not the factory's: the mesh's fast axis ("local" on
    # config.mesh=node=N,local=M) to reduce-scatter over before compressing
    # over the slow one, gradcomp.hierarchical (train/mesh.py).
    ("hierarchical", str),
    # The program's too: dense float32 all-reduces before the compressor's
    # first exchange (gradcomp.compressors.warmup.dense_warmup; synchronous
    # training). A placeholder: unset is no warm-up, and earlier runs'
    # configs stay the same (the benchmarks' --reuse).
    ("warmup_steps", int),
  ):
    c[key] = config_dict.placeholder(kind)
  c.update(kwargs)
  return c


def scheme(name: str, **kwargs) -> ml_collections.ConfigDict:
  """Scheme fields: every known keyword, unset unless given.

  ``none`` is synchronous data parallelism. ``local_sgd`` takes ``every``
  and, for DiLoCo, ``outer_learning_rate`` (Nesterov SGD with
  ``outer_momentum``, default 0.9); its pseudo-gradients go through
  ``config.compressor`` (``none``: the dense mean). Streaming DiLoCo adds
  ``fragments``, ``overlap``, ``alpha`` (the merge weight of the local
  params), ``eager`` (Kale et al.'s eager updates) and ``split_leaves``
  (equal fragments that may cut leaves). ``sparseloco`` (Sarfi et al.
  2025) takes ``every``, ``outer_learning_rate``, ``k`` (values kept per
  ``chunk`` x ``chunk`` tile), ``chunk``, ``value_bits``, ``ef_decay`` and
  ``mean`` (``workers`` or Templar's ``senders``), and sends its own codec
  (``config.compressor`` is set to ``none``).
  ``easgd`` takes
  ``alpha`` and ``every``. ``cdsgd`` (paper 001) takes
  ``local_learning_rate``, ``k``, ``warmup_steps``, ``message_scale`` and
  ``flush_residual``; ``config.optimizer`` is then its global (server)
  optimizer and ``config.compressor`` its compressor (``none``: OD-SGD).
  ``gossip`` takes ``topology`` (ring, torus, exponential,
  one_peer_exponential, complete) and, with a compressor (CHOCO-SGD),
  ``gamma`` (and ``public_copies=False`` for the uncorrected compressed
  gossip CHOCO fixes); ``gosgd`` takes ``p``. ``async_ps`` (survey 004
  §2.3) takes ``staleness_bound``, ``delay_compensation`` (DC-ASGD's
  lambda) and ``jitter``, with ``config.compressor`` on its pushes;
  ``backup_workers`` (§2.2) takes ``backups`` and ``jitter``. Both read the
  workers' speeds from ``config.cluster.speeds``. ``stale_sgd`` takes
  ``staleness``: synchronous SGD whose every gradient is that many steps late
  (survey Fig. 2). ``edgegossip`` (paper 002) is GoSGD (``p``) on per-worker
  shards with balanced, loss-ranked epochs (``train/edgegossip.py``): the
  aggregator's ``method`` and ``ratio``, ``balance``, ``selection`` (loss,
  random or shuffle), the balancer's ``speed_threshold`` and
  ``failure_threshold``; speeds from ``config.cluster``.
  """
  c = ml_collections.ConfigDict()
  c.name = name
  for key, kind in (
    ("every", int),
    ("fragments", int),
    ("overlap", int),
    ("eager", bool),
    ("split_leaves", bool),
    ("alpha", float),
    ("outer_learning_rate", float),
    ("outer_momentum", float),
    ("local_learning_rate", float),
    ("k", int),
    ("warmup_steps", int),
    ("message_scale", float),
    ("flush_residual", bool),
    ("topology", str),
    ("gamma", float),
    ("p", float),
    ("public_copies", bool),
    ("staleness_bound", int),
    ("delay_compensation", float),
    ("jitter", float),
    ("backups", int),
    ("staleness", int),
    ("method", str),
    ("ratio", int),
    ("balance", bool),
    ("selection", str),
    ("speed_threshold", float),
    ("failure_threshold", float),
    ("chunk", int),
    ("value_bits", int),
    ("ef_decay", float),
    ("mean", str),
  ):
    c[key] = config_dict.placeholder(kind)
  c.update(kwargs)
  return c


def cluster(**kwargs) -> ml_collections.ConfigDict:
  """The described cluster the simulated clock prices each step on (DESIGN §6).

  One worker per device of the run. ``speeds``: relative compute speed per
  worker (``None``: all 1.0); ``flops_per_second``: a speed-1.0 worker's
  training throughput (``None``: gradcomp's 8 TFLOP/s); links: bandwidth
  (Gbit/s) and latency (us) per message. ``allreduce``: how an all-reduce
  moves bytes (``gradcomp.sim.cluster.ALLREDUCE``: ring,
  recursive_halving_doubling, rabenseifner, binary_tree, hierarchical,
  sharded_parameter_server, or best, the cheapest per message size), e.g.
  ``--config.cluster.allreduce=rabenseifner``; ``servers`` and ``colocated``
  shape the sharded parameter server, ``workers_per_node`` and the intra-node
  link the hierarchical one. The defaults are ``gradcomp.sim.Cluster``'s.
  """
  c = ml_collections.ConfigDict()
  c.bandwidth_gbps = 20.0
  c.latency_us = 25.0
  c.allreduce = "ring"
  c.servers = 1
  c.colocated = False
  c.workers_per_node = 1
  c.intra_bandwidth_gbps = 128.0
  c.intra_latency_us = 5.0
  c.flops_per_second = config_dict.placeholder(float)
  c.speeds = config_dict.placeholder(tuple)
  c.update(kwargs)
  return c


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0

  config.dataset = ml_collections.ConfigDict()
  config.dataset.name = "digits"
  config.dataset.data_dir = config_dict.placeholder(str)
  config.dataset.synthetic = False

  config.model = ml_collections.ConfigDict()
  config.model.name = "mlp"
  config.model.features = (128,)

  config.compressor = compressor("sketch_topk", ratio=0.05)
  config.fusion = ml_collections.ConfigDict()
  config.fusion.plan = "auto"  # layerwise | single | auto | none
  config.fusion.search = "heuristic"  # for "auto": heuristic | optimal
  # for "auto": unset or inner (the compressor's exchange form) | auto
  # (gather or reduce-scatter per group, for codecs with an exchange=
  # keyword). A placeholder, so runs saved before the field existed are
  # the same config (the benchmarks' --reuse).
  config.fusion.exchange = config_dict.placeholder(str)

  # none|local_sgd|easgd|cdsgd|gossip|gosgd|async_ps|backup_workers|stale_sgd|
  # edgegossip
  config.scheme = scheme("none")
  # Sufficient-factor broadcasting (train/factors.py; synchronous only): each
  # nn.Dense layer for which Poseidon's rule finds its factors cheaper on the
  # wire than the compressor's (or dense) exchange sends them instead.
  config.sufficient_factors = False
  config.cluster = cluster()

  config.optimizer = ml_collections.ConfigDict()
  # sgd | adamw | muon | onebit_adam | zero_one_adam | demo | compressed_adam
  # (train/optimizer.py; muon is optax.contrib.muon, MuLoCo's inner optimizer
  # under scheme local_sgd; the last four exchange their own momentum:
  # compressor none, but compressed_adam's codec is config.compressor;
  # onebit_adam and compressed_adam need freeze_step)
  config.optimizer.name = "sgd"
  config.optimizer.learning_rate = 0.1
  config.optimizer.momentum = 0.9  # sgd
  config.optimizer.nesterov = False  # sgd
  config.optimizer.b1 = 0.9  # adamw
  config.optimizer.b2 = 0.999  # adamw
  config.optimizer.eps = 1e-8  # adamw
  config.optimizer.weight_decay = 0.0  # adamw: not on norms and biases
  config.optimizer.schedule = "constant"  # constant | cosine | warmup_cosine
  config.optimizer.warmup_steps = 0  # warmup_cosine
  config.optimizer.min_learning_rate_ratio = 0.0  # warmup_cosine: final / peak
  # Clip the exchanged gradient's global norm (None: no clipping).
  config.optimizer.clip_norm = config_dict.placeholder(float)
  # Whose gradient clip_norm clips (train/optimizer.py, clip_scope): "worker"
  # (each worker's own, before any exchange or compressor: the one rule every
  # method can follow, the transformer study's) | "mean" (the exchanged mean,
  # synchronous chains). A placeholder: unset is each method's behaviour
  # before the field existed, and earlier runs' configs stay the same (the
  # benchmarks' --reuse).
  config.optimizer.clip_scope = config_dict.placeholder(str)
  # True: AdamW's weight-decay mask (matrices and embeddings, not norms and
  # biases) for every optimizer, DeMo and SGD included; False: every leaf
  # decayed. A placeholder: unset is each optimizer's mask before the field
  # existed (AdamW, Muon and the Adam family masked, SGD and DeMo not).
  config.optimizer.mask_decay = config_dict.placeholder(bool)
  # onebit_adam, compressed_adam: dense AdamW updates before the variance
  # freezes.
  config.optimizer.freeze_step = config_dict.placeholder(int)
  # onebit_adam, compressed_adam: the warm-up's gradients through
  # int_quantize(warmup_bits, exchange="scatter") in one fused buffer (ZeRO++'s
  # qgZ with LoCo's error feedback) instead of the dense all-reduce: 4 or 8;
  # warmup_block_size: values per scale (None: int_quantize's 512).
  config.optimizer.warmup_bits = config_dict.placeholder(int)
  config.optimizer.warmup_block_size = config_dict.placeholder(int)
  # zero_one_adam: its schedule (None: DeepSpeed's 100000, 16, 32678, 16).
  config.optimizer.var_freeze_step = config_dict.placeholder(int)
  config.optimizer.var_update_scaler = config_dict.placeholder(int)
  config.optimizer.local_step_scaler = config_dict.placeholder(int)
  config.optimizer.local_step_clipper = config_dict.placeholder(int)
  # demo: momentum decay, DCT chunk and coefficients kept per chunk (None:
  # DeMo's 0.999, 64, 32). muon: beta is its momentum (None: 0.95).
  config.optimizer.beta = config_dict.placeholder(float)
  config.optimizer.chunk = config_dict.placeholder(int)
  config.optimizer.topk = config_dict.placeholder(int)

  config.step = "shard_map"  # shard_map | pmap (train/step.py)
  # Workers: the first config.workers devices (one process), or all if unset.
  config.workers = config_dict.placeholder(int)
  # The mesh over the workers, "name=size,..." (train/mesh.py); unset:
  # "data=<workers>". "data=2,fsdp=4": params and optimizer state sharded
  # over fsdp (FSDP / ZeRO), the gradient reduce-scattered over fsdp and
  # compressed over data. "node=2,local=4": with
  # config.compressor.hierarchical="local", dense reduce-scatter inside a
  # node, compression across nodes. Every device is a worker; multi-axis
  # meshes run scheme.name=none under step=shard_map.
  config.mesh = config_dict.placeholder(str)
  config.global_batch_size = 128
  # Typed placeholders, so a variant can unset one and the command line can
  # still set it.
  config.num_train_steps = config_dict.placeholder(int)
  config.num_train_steps = 600  # If unset: num_epochs epochs.
  config.num_epochs = config_dict.placeholder(float)
  config.eval_batch_size = 512
  # Per-worker params (local SGD, gossip, ...): each eval also scores every
  # worker's own model on the whole test set (eval_worker_*), 8 workers
  # costing 8 evaluations. Unset: yes; False: only the workers' average.
  config.eval_each_worker = config_dict.placeholder(bool)

  config.log_every_steps = 50
  config.eval_every_steps = 200
  config.checkpoint_every_steps = 200
  config.checkpoints_to_keep = 3
  config.max_consecutive_nonfinite = 10
  config.profile_steps = 0  # > 0: trace that many steps into workdir/profile.
  return config
