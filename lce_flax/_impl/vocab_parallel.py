"""The head with its vocabulary split over mesh axes (tensor parallel), for every backend.

Each device holds ``V/t`` columns of ``w`` (and of ``bias``) and the same tokens. Nothing of shape ``[B, V]`` or
``[H, V]`` ever crosses devices; per call the axis carries ``[3, B]`` float32 row statistics (a pmax and one psum)
and, in the backward, the float32 partial dx (one psum of ``B·H``).

Labels: :func:`localize` turns the normalised labels of the whole vocabulary into shard-local ones — the column
index on the shard that holds the label, and on every other shard a value in ``[V/t, V)``: counted, in range, and
matching no column there (the backends' protocol in ``common.py``). A backend then runs unchanged on its shard;
only ``spec.opts.vocab_size`` (the label space, V) and ``w``'s column count (V/t) differ.

Two designs, as on one device:

* **lean** (:func:`lce_flax._impl.base.lean` with reduction axes; any backend, the kernels included; 8·B·H·V
  FLOPs over all devices, O(B) residuals): the backend's ``stats`` on the shard (its forward kernel's row
  statistics), combined across the axes by :func:`lce_flax._math.all_reduce_stats` and finalised with the global
  labels; the backward runs the backend's ``grads`` on the shard with the *global* lse, so its dz is the true
  ``softmax - onehot`` of the whole vocabulary restricted to this shard's columns: dw and dbias are this shard's,
  exact; the partial dx is psum'd in float32 before it is rounded. Differentiable with any per-token cotangent
  (``reduction="none"``).
* **fast** (:func:`lce_flax._impl.base.fast` with the chunked backend's token-chunk design and ``axes``; 6·B·H·V):
  forms the gradients while each token chunk's logits are on hand, which needs that chunk's global lse
  first: one combine per token chunk, inside the loop. A kernel would need the collective inside its own loop;
  no kernel backend has this design (dispatch runs their lean one, and says so).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax


def axes_size(axes: tuple[str, ...]) -> int:
  """Devices along ``axes`` (inside ``shard_map`` or a ``custom_partitioning`` lowering)."""
  return math.prod(lax.axis_size(a) for a in axes)


def shard_index(axes: tuple[str, ...]):
  """This device's position along ``axes``, major to minor (the order of a ``PartitionSpec`` entry)."""
  idx = jnp.int32(0)
  for a in axes:
    idx = idx * lax.axis_size(a) + lax.axis_index(a)
  return idx


def localize(labels, axes: tuple[str, ...], columns: int):
  """Normalised labels of the whole vocabulary → this shard's (``columns`` per shard along ``axes``).

  Ignored tokens (-1) and out-of-range labels (V) keep their codes; a label held here becomes its local column;
  one held elsewhere becomes ``columns`` (< V when the vocabulary is split)."""
  start = shard_index(axes) * columns
  here = (labels >= start) & (labels < start + columns)
  elsewhere = (labels >= 0) & (labels < columns * axes_size(axes)) & ~here
  return jnp.where(here, labels - start, jnp.where(elsewhere, columns, labels))
