"""gradcomp: gradient compression for communication-efficient data-parallel JAX.

Every compressor is an ``optax.GradientTransformation`` whose ``update`` returns
the mean over workers (``axis_name``) of the decompressed gradients. This
namespace holds what a training script uses: the compressors and the parts to
build one, ``layerfusion`` and its ``Plan``, the training schemes, the
compressor registry, the optimizers that compress their momentum
(``onebit_adam``, ``compressed_adam``, ``zero_one_adam``, ``demo``), ``wire_bytes`` and the worker-axis helpers. The rest lives
in subpackages:

* :mod:`gradcomp.fusion` -- LayerFusion's planner: gradient order, profiles,
  the searches.
* :mod:`gradcomp.sim` -- described clusters, the cost model, the timeline
  simulator and simulated time.
* :mod:`gradcomp.topology` -- gossip topologies.
* :mod:`gradcomp.edgegossip` -- paper 002's components (imported on its own:
  ``from gradcomp import edgegossip``, as it loads scikit-learn).

The version is 0.x: names may move between minor versions, without aliases.
"""

from gradcomp import fusion as fusion
from gradcomp import sim as sim
from gradcomp import topology as topology
from gradcomp.compressors.base import CompressorState as CompressorState
from gradcomp.compressors.base import LeafCodec as LeafCodec
from gradcomp.compressors.base import leafwise as leafwise
from gradcomp.compressors.dense import fp16 as fp16
from gradcomp.compressors.dense import none as none
from gradcomp.compressors.dgc import dgc as dgc
from gradcomp.compressors.finite import apply_if_finite as apply_if_finite
from gradcomp.compressors.fixed_point import (
  DynamicFixedPointState as DynamicFixedPointState,
)
from gradcomp.compressors.fixed_point import dynamic_fixed_point as dynamic_fixed_point
from gradcomp.compressors.fixed_point import fixed_point as fixed_point
from gradcomp.compressors.intq import int_quantize as int_quantize
from gradcomp.compressors.lowp import fp4 as fp4
from gradcomp.compressors.lowp import fp8 as fp8
from gradcomp.compressors.memory import error_feedback as error_feedback
from gradcomp.compressors.onebit import onebit_sgd as onebit_sgd
from gradcomp.compressors.powersgd import powersgd as powersgd
from gradcomp.compressors.qgz import qgz as qgz
from gradcomp.compressors.quantizers import qsgd as qsgd
from gradcomp.compressors.quantizers import terngrad as terngrad
from gradcomp.compressors.randomk import randomk as randomk
from gradcomp.compressors.registry import get as get
from gradcomp.compressors.registry import names as names
from gradcomp.compressors.registry import register as register
from gradcomp.compressors.signs import ef_signsgd as ef_signsgd
from gradcomp.compressors.signs import signsgd as signsgd
from gradcomp.compressors.sketch_topk import sketch_topk as sketch_topk
from gradcomp.compressors.sparse_quantize import sparse_quantize as sparse_quantize
from gradcomp.compressors.threshold import threshold_quantize as threshold_quantize
from gradcomp.compressors.topk import topk as topk
from gradcomp.compressors.warmup import DenseWarmupState as DenseWarmupState
from gradcomp.compressors.warmup import dense_warmup as dense_warmup
from gradcomp.fusion.hierarchical import hierarchical as hierarchical
from gradcomp.fusion.layerfusion import layerfusion as layerfusion
from gradcomp.fusion.plan import Plan as Plan
from gradcomp.optimizers.compressed_adam import (
  CompressedAdamState as CompressedAdamState,
)
from gradcomp.optimizers.compressed_adam import compressed_adam as compressed_adam
from gradcomp.optimizers.demo import DeMoState as DeMoState
from gradcomp.optimizers.demo import demo as demo
from gradcomp.optimizers.onebit_adam import OneBitAdamState as OneBitAdamState
from gradcomp.optimizers.onebit_adam import onebit_adam as onebit_adam
from gradcomp.optimizers.zero_one_adam import ZeroOneAdamState as ZeroOneAdamState
from gradcomp.optimizers.zero_one_adam import zero_one_adam as zero_one_adam
from gradcomp.parallel.wire import axis_wire as axis_wire
from gradcomp.parallel.wire import wire_bytes as wire_bytes
from gradcomp.parallel.workers import add_worker_axis as add_worker_axis
from gradcomp.parallel.workers import drop_worker_axis as drop_worker_axis
from gradcomp.schemes.async_ps import AsyncPSState as AsyncPSState
from gradcomp.schemes.async_ps import async_ps as async_ps
from gradcomp.schemes.backup import BackupState as BackupState
from gradcomp.schemes.backup import backup_workers as backup_workers
from gradcomp.schemes.cdsgd import CDSGDState as CDSGDState
from gradcomp.schemes.cdsgd import cdsgd as cdsgd
from gradcomp.schemes.easgd import EASGDState as EASGDState
from gradcomp.schemes.easgd import easgd as easgd
from gradcomp.schemes.gosgd import GoSGDState as GoSGDState
from gradcomp.schemes.gosgd import gosgd as gosgd
from gradcomp.schemes.gossip import GossipState as GossipState
from gradcomp.schemes.gossip import gossip as gossip
from gradcomp.schemes.local_sgd import LocalSGDState as LocalSGDState
from gradcomp.schemes.local_sgd import local_sgd as local_sgd
from gradcomp.schemes.sparseloco import sparseloco as sparseloco
from gradcomp.schemes.stale import StaleState as StaleState
from gradcomp.schemes.stale import stale_sgd as stale_sgd

__version__ = "0.1.0"

# The public names, by contract: tests/test_docs.py checks them against the API
# reference (every name here has a page, every page's name is here) and against
# the namespace (every public non-module attribute is here). The subpackages
# fusion, sim and topology have pages of their own.
__all__ = [
  "add_worker_axis",
  "apply_if_finite",
  "async_ps",
  "AsyncPSState",
  "axis_wire",
  "backup_workers",
  "BackupState",
  "cdsgd",
  "CDSGDState",
  "compressed_adam",
  "CompressedAdamState",
  "CompressorState",
  "demo",
  "DeMoState",
  "dense_warmup",
  "DenseWarmupState",
  "dgc",
  "drop_worker_axis",
  "dynamic_fixed_point",
  "DynamicFixedPointState",
  "easgd",
  "EASGDState",
  "ef_signsgd",
  "error_feedback",
  "fixed_point",
  "fp16",
  "fp4",
  "fp8",
  "get",
  "gosgd",
  "GoSGDState",
  "gossip",
  "GossipState",
  "hierarchical",
  "int_quantize",
  "layerfusion",
  "LeafCodec",
  "leafwise",
  "local_sgd",
  "LocalSGDState",
  "names",
  "none",
  "onebit_adam",
  "onebit_sgd",
  "OneBitAdamState",
  "Plan",
  "powersgd",
  "qgz",
  "qsgd",
  "randomk",
  "register",
  "signsgd",
  "sketch_topk",
  "sparse_quantize",
  "sparseloco",
  "stale_sgd",
  "StaleState",
  "terngrad",
  "threshold_quantize",
  "topk",
  "wire_bytes",
  "zero_one_adam",
  "ZeroOneAdamState",
]
