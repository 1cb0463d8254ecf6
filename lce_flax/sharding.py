"""Meshes, logical axis rules, and the op under ``jax.shard_map`` (data-, FSDP- and vocab-parallel).

The op's kernels are opaque to XLA's sharding propagation: left to itself, ``jit`` on sharded inputs would
gather ``w`` (and often ``x``) onto every device. :func:`sharded_linear_cross_entropy` instead says per device
what to compute, with one call that takes the mesh and the axis names::

  mesh = make_mesh(data=2, fsdp=2, tensor=2)
  loss = sharded_linear_cross_entropy(x, w, labels, mesh=mesh)   # inside or outside jit

Layout it expects (it reshards to it if the arrays are placed otherwise):

* ``x`` [B, ..., H], ``labels`` / ``where`` [B, ...]: the first (batch) dim split over ``batch_axes``;
* ``w`` [H, V] (``w_layout="hv"``) or [V, H] (``"vh"``): V split over ``vocab_axis``, H over ``fsdp_axis``;
* ``bias`` [V]: split over ``vocab_axis``.

What each device does:

* **data parallel** (``batch_axes``): runs the op (any implementation, kernels included) on its own tokens,
  through the per-shard body of :mod:`lce_flax._partition` (the one the automatic, custom-partitioned path of
  :func:`lce_flax.linear_cross_entropy` lowers per device under Auto mesh axes): ``mean`` divides the local sums
  by the psum of the local counts of counted tokens (the global token mean, not a mean of means), then psums;
  dw and dbias are computed per shard inside a ``jax.custom_vjp`` and psum'd over the batch axes.
* **FSDP** (``fsdp_axis``, also a batch axis by default): ``w`` is stored split over H and all-gathered *once
  per call* to [H, V/t] before the op runs. Each logit contracts over the whole of H, so a device needs every row
  of H for the columns it computes; gathering once keeps the op (and its GPU kernels) unchanged and costs a
  transient H·V/t buffer per device (t = vocab-axis size), while the stored weight, its optimizer state and its
  gradient stay 1/(fsdp·t). The gradient leaves through a reduce-scatter (the all-gather's transpose). Gathering
  per vocab chunk instead would bound the transient buffer to H·chunk, but it would have to live inside every
  backend's chunk loop (kernels included), repeat for each pass over the chunks (twice in the lean design), and
  put a collective in each chunk's critical path; not done.
* **vocab parallel** (``vocab_axis``): each device holds V/t columns of ``w`` (and ``bias``) and runs the
  vocab-parallel head of :mod:`lce_flax._impl.vocab_parallel` on them: per-token partial row stats (running max,
  sum of exponentials, target logit, logit sum) combined across the axis by one pmax and one psum of [3, tokens],
  dx psum'd in float32, dw and dbias exact per shard. ``w`` is never gathered; per-device head memory is that of
  a V/t head. ``mode="lean"`` (and ``reduction="none"``) runs the chosen implementation's own kernels on the
  shard (its forward statistics, then its backward with the global lse); ``mode="fast"`` is the chunked token
  loop, which combines each token chunk's stats inside the loop (no kernel backend has that design, and
  ``impl="auto"`` picks it; :func:`lce_flax.explain` with ``vocab_shards=t`` says what runs).

All layouts run one per-shard body, the one the automatic (custom-partitioned) path of
:func:`lce_flax.linear_cross_entropy` lowers per device under Auto mesh axes, under ``jax.shard_map`` with
``check_vma=False``: the kernel backends' ``pallas_call`` outputs do not declare how they vary over manual mesh
axes; the tests check every reduction and mesh against one device.

Requirements, checked with errors naming the sizes: B divisible by the product of the batch axes' sizes, V by
the vocab axis' size, H by the FSDP axis' size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lce_flax import _partition
from lce_flax._impl import base, common
from lce_flax.options import LossOptions, resolve

DATA, FSDP, TENSOR = "data", "fsdp", "tensor"
MESH_AXES = (DATA, FSDP, TENSOR)

# Logical axis name -> mesh axes, for flax's ``nn.logical_to_mesh_*``. Tokens are split over both data axes;
# parameters are split over "fsdp" on their embedding dim (FSDP) and over "tensor" on vocab / MLP / heads.
# A mesh axis already used by an earlier dim of the same array is skipped by flax, so activations
# ("batch", "length", "embed") get P(("data", "fsdp"), None, None). "head_embed" (``HEAD_EMBED``) is the H dim of a
# head split over every axis that splits the tokens (``lce_flax.linen.SPLIT_KERNEL_AXES``): its kernel and optimizer
# state 1/n per device, gathered once per call, its gradient reduce-scattered (docs/multi_gpu.md). Override by
# passing your own rules.
HEAD_EMBED = "head_embed"
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", (DATA, FSDP)),
    ("length", None),
    ("embed", FSDP),
    (HEAD_EMBED, (DATA, FSDP)),
    ("vocab", TENSOR),
    ("mlp", TENSOR),
    ("heads", TENSOR),
    ("kv", None),
    ("layers", None),
    # mesh axis names used directly as logical names (nn.with_partitioning) map to themselves
    (DATA, DATA),
    (FSDP, FSDP),
    (TENSOR, TENSOR),
)


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh over the named axes ("data", "fsdp", "tensor"); one size may be -1 (all remaining devices).

  Args:
    data: data-parallel size (tokens split, parameters replicated).
    fsdp: fully-sharded data-parallel size (tokens split, parameters split on their embedding dim).
    tensor: tensor-parallel size (parameters split on vocab / MLP dims; the head is vocab-parallel).
    devices: the devices (default ``jax.devices()``).

  Returns:
    A ``Mesh`` with ``AxisType.Auto`` axes (sharding under ``jit`` is propagated by XLA; the op itself runs
    under ``shard_map``).
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = [data, fsdp, tensor]
  if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
    raise ValueError(f"mesh sizes {data=}, {fsdp=}, {tensor=} must be positive, with at most one -1")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if len(devices) % known:
      raise ValueError(f"{len(devices)} devices cannot be split into {data=} x {fsdp=} x {tensor=}")
    sizes[sizes.index(-1)] = len(devices) // known
  if math.prod(sizes) != len(devices):
    raise ValueError(f"{data=} x {fsdp=} x {tensor=} = {math.prod(sizes)} does not match {len(devices)} devices")
  return jax.make_mesh(tuple(sizes), MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def _axes_size(mesh: Mesh, axes) -> int:
  if axes is None:
    return 1
  axes = (axes,) if isinstance(axes, str) else tuple(axes)
  return math.prod(mesh.shape[a] for a in axes)


# -------------------------------------------------------------------------------------------- the call


def sharded_linear_cross_entropy(
    x: jax.Array,
    w: jax.Array,
    labels: jax.Array,
    *,
    mesh: Mesh,
    batch_axes: Sequence[str] | str | None = (DATA, FSDP),
    vocab_axis: str | None = TENSOR,
    fsdp_axis: Sequence[str] | str | None = FSDP,
    bias: jax.Array | None = None,
    where: jax.Array | None = None,
    w_layout: str = "hv",
    return_aux: bool = False,
    options: LossOptions | None = None,
    **overrides: Any,
):
  """:func:`lce_flax.linear_cross_entropy` on a mesh: tokens over ``batch_axes``, ``w`` over vocab and FSDP axes.

  Same arguments, results and numbers as the single-device op (see the module docstring for what each device
  computes). Axes that are None, or of size 1 in ``mesh``, are not used.

  Args:
    x: ``[B, ..., H]``; B split over ``batch_axes``.
    w: ``[H, V]`` or ``[V, H]`` (``w_layout``); V split over ``vocab_axis``, H over ``fsdp_axis``.
    labels: ``[B, ...]`` integer targets.
    mesh: the device mesh (e.g. from :func:`make_mesh`).
    batch_axes: mesh axes the tokens are split over (data parallel, FSDP).
    vocab_axis: mesh axis the vocabulary is split over (vocab-parallel head), or None.
    fsdp_axis: mesh axis (or axes, e.g. ``("data", "fsdp")`` for a head whose parameters are split over every
      axis that splits the tokens) ``w``'s H dim is split over (gathered once per call), or None.
    bias, where, w_layout, return_aux, options, **overrides: as in :func:`lce_flax.linear_cross_entropy`
      (with a vocab axis, see the module docstring for which design runs).

  Returns:
    The float32 loss (replicated scalar, or ``[B, ...]`` split like ``labels`` for ``reduction="none"``), and an
    :class:`lce_flax.Aux` with global ``num_correct``/``num_tokens`` if ``return_aux``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from lce_flax.sharding import make_mesh, sharded_linear_cross_entropy
    >>> mesh = make_mesh(data=-1, tensor=1)
    >>> n = mesh.size
    >>> x = jnp.ones((2 * n, 4)); w = jnp.zeros((4, 10)); y = jnp.zeros((2 * n,), jnp.int32)
    >>> print(f"{sharded_linear_cross_entropy(x, w, y, mesh=mesh):.4f}")  # log(10)
    2.3026
  """
  opts = resolve(options, overrides)
  x, w, labels = jnp.asarray(x), jnp.asarray(w), jnp.asarray(labels)
  base.check_arguments(x, w, labels, bias, where, w_layout)
  base.check_entropy(opts, return_aux)
  batch = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes or ())
  fsdp = (fsdp_axis,) if isinstance(fsdp_axis, str) else tuple(fsdp_axis or ())
  for a in (*batch, vocab_axis, *fsdp):
    if a is not None and a not in mesh.shape:
      raise ValueError(f"axis {a!r} is not an axis of the mesh {dict(mesh.shape)}")
  if vocab_axis is not None and vocab_axis in batch:
    raise ValueError(f"{vocab_axis=} cannot also be one of {batch_axes=}")
  if vocab_axis is not None and vocab_axis in fsdp:
    raise ValueError(f"{fsdp_axis=} cannot be (or hold) the vocab axis")
  batch = tuple(a for a in batch if mesh.shape[a] > 1)
  vaxis = vocab_axis if vocab_axis is not None and mesh.shape[vocab_axis] > 1 else None
  faxes = tuple(a for a in fsdp if mesh.shape[a] > 1)
  nb, nv, nf = _axes_size(mesh, batch), _axes_size(mesh, vaxis), _axes_size(mesh, faxes)
  vocab = common.vocab_size(w, w_layout)
  hidden = x.shape[-1]
  if x.ndim < 2:
    raise ValueError(f"x must be [B, ..., H] with a batch dim to split, got x.shape={x.shape}")
  if x.shape[0] % nb:
    raise ValueError(f"x.shape[0]={x.shape[0]} (tokens) must be divisible by the batch axes {batch} of total "
                     f"size {nb}")
  if vocab % nv:
    raise ValueError(f"V={vocab} (w.shape={w.shape}, {w_layout=}) must be divisible by the size {nv} of "
                     f"{vocab_axis=}")
  if hidden % nf:
    raise ValueError(f"H={hidden} (w.shape={w.shape}) must be divisible by the size {nf} of {fsdp_axis=}")
  if labels.size == 0:
    return base.per_device(x, w, labels, bias=bias, where=where, w_layout=w_layout, return_aux=return_aux,
                           options=opts)

  # one token dim: the per-shard bodies of lce_flax._partition take 2-D x and 1-D labels / where
  n = math.prod(labels.shape)
  x, w = _partition.narrow(x, w, opts)
  args = (x.reshape(n, hidden), w, bias, labels.reshape(n), None if where is None else where.reshape(n))
  lay = _partition.Layout(batch, faxes, (vaxis,) if vaxis else ())
  if any(t == AxisType.Explicit for t in mesh.axis_types):
    # an Explicit mesh types every array's sharding, and shard_map then refuses to reshard implicitly
    tok = P(batch or None)
    fspec = faxes or None
    w_spec = P(fspec, vaxis) if w_layout == "hv" else P(vaxis, fspec)
    specs = (P(batch or None, None), w_spec, P(vaxis), tok, tok)
    args = tuple(None if a is None else jax.sharding.reshard(a, NamedSharding(mesh, sp))
                 for a, sp in zip(args, specs))
  s = _partition.Static(opts, w_layout, vocab)
  loss, aux = _partition.outputs(_partition.run_shard_map(*args, s, (mesh, lay)), labels.shape, opts)
  return (loss, aux) if return_aux else loss


def from_types(x, w, labels, *, bias=None, where=None, w_layout="hv", return_aux=False,
               options: LossOptions | None = None):
  """The op on arrays whose shardings are in their types (mesh axes of ``AxisType.Explicit``).

  Reads the layout from the types — tokens over the mesh axes of ``x``'s first dim, V over the axis of ``w``'s
  vocabulary dim, H over the axes of ``w``'s hidden dim (FSDP) — and runs :func:`sharded_linear_cross_entropy`
  with it; :func:`lce_flax.linear_cross_entropy` calls this itself when it sees such inputs.
  """
  def spec_of(a):
    sh = jax.typeof(a).sharding
    return sh.mesh, tuple(sh.spec) + (None,) * (a.ndim - len(sh.spec))

  meshes = [spec_of(a)[0] for a in (x, w, labels, bias, where) if a is not None]
  mesh = next((m for m in meshes if m.axis_names), meshes[0])
  _, xs = spec_of(x)
  _, ws = spec_of(w)
  h_dim, v_dim = (0, 1) if w_layout == "hv" else (1, 0)
  if x.ndim < 2:
    raise ValueError(f"x is sharded but has no batch dim to split: x.shape={x.shape}")
  if _partition.entry_axes(xs[-1]):
    raise ValueError(f"x's hidden dim is sharded over {xs[-1]} (x.sharding={jax.typeof(x).sharding}); the head "
                     "contracts over H: shard the tokens instead, or reshard x")
  inner = [ax for e in xs[1:-1] for ax in _partition.entry_axes(e)]
  if inner:
    raise ValueError(f"x is sharded over {inner} on a dim other than its first (x.sharding="
                     f"{jax.typeof(x).sharding}); tokens may be split on the first dim only")
  batch = _partition.entry_axes(xs[0])
  vocab = _partition.entry_axes(ws[v_dim])
  fsdp = _partition.entry_axes(ws[h_dim])
  if len(vocab) > 1:
    raise ValueError(f"w.sharding={jax.typeof(w).sharding}: w's vocabulary dim may be split over one mesh axis")
  return sharded_linear_cross_entropy(
      x, w, labels, mesh=mesh, batch_axes=batch, vocab_axis=vocab[0] if vocab else None,
      fsdp_axis=fsdp or None, bias=bias, where=where, w_layout=w_layout, return_aux=return_aux,
      options=options)
