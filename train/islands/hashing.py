"""A hash of an island's global state, compared across islands each round (DESIGN §12).

SHA-256 over the round number and, for each leaf of ``(global params, outer
optimizer state)`` in tree order, its dtype, shape and bytes. Bitwise: two
islands hash alike only if every value is the same bit pattern, which they
are when they apply the same decoded mean in the same order on the same
program (``replica.py`` orders payloads by island).
"""

from __future__ import annotations

import hashlib

import jax
import numpy as np


def state_hash(round_: int, *trees) -> str:
  """Hex SHA-256 of ``round_`` and every leaf of ``trees`` (dtype, shape, bytes).

  Examples:
    >>> import numpy as np
    >>> a = {"w": np.zeros(3, np.float32)}
    >>> state_hash(1, a) == state_hash(1, {"w": np.zeros(3, np.float32)})
    True
    >>> state_hash(1, a) == state_hash(2, a)
    False
  """
  h = hashlib.sha256(f"round={int(round_)}".encode())
  for tree in trees:
    leaves, treedef = jax.tree.flatten(tree)
    h.update(str(treedef).encode())
    for leaf in leaves:
      x = np.ascontiguousarray(np.asarray(leaf))
      h.update(f"{x.dtype.str}{x.shape}".encode())
      h.update(x.tobytes())
  return h.hexdigest()
