"""Bytes on the wire, read from compiled HLO, for a 2^20 leaf on 8 workers."""

import jax
import jax.numpy as jnp
import pytest

import gradcomp
from gradcomp.parallel.wire import collective_bytes

import harness

# One worker runs the module: its tests share the module's dense step (``dense_bytes``),
# built once.
pytestmark = pytest.mark.xdist_group("wire")

SIZE = 2**20

# Largest fraction of none()'s bytes each compressor may send (issue 2).
BUDGETS = {
  "topk": ({"ratio": 0.01}, 0.025),
  "signsgd": ({}, 0.035),
  "qsgd": ({"levels": 4}, 0.3),
  "fp16": ({}, 0.51),
  "sketch_topk": ({"ratio": 0.01}, 0.06),  # issue 3: default cols
  # Survey 004 §4: 1 bit + two floats per column; packed codes; int32 slots.
  "onebit_sgd": ({}, 0.032),
  "fixed_point": ({"bits": 8}, 0.251),
  "dynamic_fixed_point": ({"bits": 12}, 0.376),
  "sparse_quantize": ({"threshold": 2.6, "max_ratio": 0.01}, 0.011),
  # Issue 34: 1 byte and 4 bits per value, a float32 / a uint8 per block of 32.
  "fp8": ({"block_size": 32}, 0.282),
  "fp4": ({}, 0.133),
}


def step_wire_bytes(tx) -> int:
  grads = harness.shard({"x": jnp.zeros((harness.WORKERS, SIZE))})
  state = harness.worker_state(tx, {"x": jax.ShapeDtypeStruct((SIZE,), jnp.float32)})
  return gradcomp.wire_bytes(harness.sharded_update(tx), grads, state)


@pytest.fixture(scope="module")
def dense_bytes():
  return step_wire_bytes(gradcomp.none(axis_name=harness.AXIS))


def test_dense_baseline_sends_the_float32_buffer(dense_bytes):
  assert dense_bytes == 4 * SIZE


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_compressed_fraction_of_dense(name, dense_bytes):
  kwargs, budget = BUDGETS[name]
  sent = step_wire_bytes(gradcomp.get(name, axis_name=harness.AXIS, **kwargs))
  assert 0 < sent <= budget * dense_bytes, sent / dense_bytes


def test_single_device_program_sends_nothing():
  tx = gradcomp.topk(0.01)
  x = {"x": jnp.zeros(64)}
  assert gradcomp.wire_bytes(tx.update, x, tx.init(x)) == 0


def test_parses_typed_tuple_and_async_operands():
  hlo = """
  %p0 = f32[8,4]{1,0} parameter(0)
  %p1 = s32[3]{0} parameter(1)
  %ar = (f32[8,4]{1,0}, s32[3]{0}) all-reduce(%p0, %p1), to_apply=%add
  %ag = u8[64]{0} all-gather(u8[8]{0} %bits), dimensions={0}
  %s = f16[10]{0} all-gather-start(f16[10]{0} %h), dimensions={0}
  %d = f16[80]{0} all-gather-done(%s)
  %cp = bf16[2]{0} collective-permute(%p2), source_target_pairs={{0,1}}
  %p2 = bf16[2]{0} parameter(2)
  """
  totals = collective_bytes(hlo)
  assert totals["all-reduce"] == 8 * 4 * 4 + 3 * 4
  assert totals["all-gather"] == 8 + 20
  assert totals["collective-permute"] == 4
