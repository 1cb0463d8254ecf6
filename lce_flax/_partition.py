"""The op under Auto mesh axes: a ``custom_partitioning`` rule, so XLA runs the kernels on each device's shard.

Why: the kernel implementations lower to Triton / Mosaic custom calls that XLA's SPMD partitioner cannot split.
Under ``jit`` with Auto axes (``NamedSharding``-placed inputs, ``in_shardings``, ``with_sharding_constraint``,
``jax.set_mesh``) XLA would gather ``x`` and ``w`` and every device would compute every token. Here the op is a
``jax.experimental.custom_partitioning`` function: the partitioner asks :func:`_partition` for a per-device
lowering once it knows the operands' shardings, and each device runs the ordinary single-device op on its shard.
:func:`lce_flax.linear_cross_entropy` routes here when a context mesh (``jax.set_mesh``) has an Auto axis of size
> 1, and, in a process with several devices, for what XLA's partitioner cannot split by itself (compiled kernels,
chunked's loop over token chunks): without a context mesh, ``jit`` gives no sign at trace time that the inputs are
sharded. ``lce_flax.explain`` says which route a call takes.

Design (one per-shard body, :func:`shard_forward` / :func:`shard_grads` / :func:`shard_backward`, shared with the
explicit ``shard_map`` form :func:`lce_flax.sharding.sharded_linear_cross_entropy`):

* ``custom_partitioning`` does not differentiate, so the op is a ``jax.custom_vjp`` around partitioned
  primitives. Primal (no gradient asked): the *forward* primitive (loss, per-token loss and lse, counts).
* ``reduction`` mean/sum (one scalar cotangent): the vjp's forward runs the *grads* primitive, whose per-shard
  body is ``jax.value_and_grad`` of :func:`lce_flax._impl.base.per_device` (the implementation's own
  fast or lean design) with the global counted-token total; dx, dw, dbias come back as residuals and the
  backward multiplies them by the cotangent. Same FLOPs as the single-device op; residuals are the grads.
* ``reduction="none"`` (per-token cotangents): the forward primitive, then a *backward* primitive whose per-shard
  body is ``jax.vjp`` of the local op applied to the incoming per-token cotangents. That backward re-runs the
  local forward inside ``jax.vjp`` (one extra 2·B·H·V pass on top of the design's own backward: 10·B·H·V FLOPs
  for a lean design instead of 8) — the price of keeping only O(B) residuals between the passes.
* Cotangents of ``Aux`` outputs: for ``"none"`` the cotangent of ``aux.token_loss`` is added to the loss's (they
  are the same values) and that of ``aux.lse`` goes to the local op's vjp; for ``"mean"``/``"sum"`` either one
  raises a ValueError naming ``reduction="none"`` (the grads primitive has formed the gradient of the loss only).
  ``aux.entropy`` (``entropy=True``), a pass of its own, has a backward primitive of its own
  (:func:`shard_entropy_backward`, run only when it gets a cotangent, with any reduction), whose gradients are
  added to the loss's; x, w and bias are then residuals of a reduced loss too.

Layouts (read from the operand shardings XLA chose; anything else is resharded to the nearest of these by the
partitioner, by returning the wanted ``arg_shardings`` from :func:`_partition`):

* tokens: the first dim of the (flattened) x / labels / where over any mesh axes — those of x's first dim;
* ``w`` replicated, or its H dim over one or more mesh axes (FSDP): all-gathered inside the per-shard body
  once per call, dw leaves through a reduce-scatter (``psum_scatter``) over those axes, or a slice where the
  tokens are replicated over them; dw and dbias are psum'd over the other token axes;
* x's H dim sharded: x is resharded to H-replicated (an all-gather of each device's own tokens' H slices, not of
  other devices' tokens);
* ``w``'s V dim (and ``bias``) over mesh axes not used by the tokens or by H (vocab parallel): each device runs
  the vocab-parallel head (:mod:`lce_flax._impl.vocab_parallel`) on its columns — the backend's own kernels for
  the lean design, row statistics combined across those axes, dx psum'd; dw and dbias stay split like w.

x and w enter the primitives in the op's compute dtype (``LossOptions.dtype``) where it is narrower than theirs
(:func:`narrow`): a head of float32 parameters computing in bf16 then gathers w and reduces dw in bf16, as
``nn.Dense(dtype=bf16)`` does, and the cast's transpose hands back float32 gradients.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lce_flax import _math
from lce_flax._impl import base, common
from lce_flax.options import LossOptions


@dataclasses.dataclass(frozen=True)
class Static:
  """What the primitives are specialised on (hashable)."""

  opts: LossOptions
  w_layout: str
  vocab: int


@dataclasses.dataclass(frozen=True)
class Layout:
  """Mesh axes of one call, per shard: tokens over ``tok``, w's H dim over ``wh``, its V dim (and bias) over
  ``v``."""

  tok: tuple[str, ...]
  wh: tuple[str, ...]
  v: tuple[str, ...] = ()


def narrow(x, w, opts: LossOptions):
  """``x`` and ``w`` cast to ``opts.dtype`` where it is narrower than theirs (a float32 parameter of a bf16 head).

  Each device casts them before its matmuls anyway; casting before the primitives makes what crosses devices (the
  FSDP gather of w, dw's reduction over the token axes) move in that dtype, half the bytes of float32. Each
  device's dw is rounded to it before the sum instead of after (the sum of n shards is rounded n - 1 more times,
  as for the plain head's gradient). Within a device nothing changes: dw is accumulated in float32 and rounded
  to the compute dtype as on one device."""
  cast = lambda a: a.astype(opts.dtype) if narrows(a.dtype, opts) else a
  return cast(x), cast(w)


def narrows(dtype, opts: LossOptions) -> bool:
  """Whether :func:`narrow` casts an operand of ``dtype``."""
  return opts.dtype is not None and jnp.finfo(dtype).bits > jnp.finfo(opts.dtype).bits


# --------------------------------------------------------------------------------------- per-shard bodies


def _h_dim(s: Static) -> int:
  return 0 if s.w_layout == "hv" else 1


def _gather_w(w, s: Static, lay: Layout):
  return lax.all_gather(w, lay.wh, axis=_h_dim(s), tiled=True) if lay.wh else w


def _reduce_dw(dw, s: Static, lay: Layout):
  """dw of the gathered, token-replicated w: summed over the token axes, back to this device's H slice."""
  other = tuple(a for a in lay.tok if a not in lay.wh)
  if other:
    dw = lax.psum(dw, other)
  if not lay.wh:
    return dw
  scat = tuple(a for a in lay.wh if a in lay.tok)
  if scat == lay.wh:
    return lax.psum_scatter(dw, lay.wh, scatter_dimension=_h_dim(s), tiled=True)
  if scat:  # some H axes are token axes, others not: sum over all (identical on the others), then slice
    dw = lax.psum(dw, scat)
  n = math.prod(lax.axis_size(a) for a in lay.wh)
  idx = 0
  for a in lay.wh:
    idx = idx * lax.axis_size(a) + lax.axis_index(a)
  size = dw.shape[_h_dim(s)] // n
  return lax.dynamic_slice_in_dim(dw, idx * size, size, axis=_h_dim(s))


def _count(labels, where, s: Static, lay: Layout):
  norm = _math.normalize_labels(labels.reshape(-1), None if where is None else where.reshape(-1) != 0,
                                s.opts.ignore_index, s.vocab)
  c = (norm != _math.IGNORED).sum(dtype=jnp.int32)
  return lax.psum(c, lay.tok) if lay.tok else c


def _local(x, w, bias, labels, where, s: Static, lay: Layout, count):
  return base.per_device(x, w, labels, bias=bias, where=where, w_layout=s.w_layout, return_aux=True,
                         options=s.opts, count=count, vocab_axes=lay.v)


def _finish(loss, aux, count, s: Static, lay: Layout):
  correct = aux.num_correct
  if lay.tok:
    correct = lax.psum(correct, lay.tok)
    if s.opts.reduction != "none":  # local sums (divided by the global count for mean): the global value
      loss = lax.psum(loss, lay.tok)
  return (loss, aux.token_loss, aux.lse, correct, count) + ((aux.entropy,) if s.opts.entropy else ())


def _reduce_grads(dx, dw, db, s: Static, lay: Layout):
  """(dx, dw, dbias) of the gathered w back to this device's slices, summed over the token axes."""
  dw = _reduce_dw(dw, s, lay)
  if db is not None and lay.tok:
    db = lax.psum(db, lay.tok)
  return dx, dw, db


def shard_forward(x, w, bias, labels, where, s: Static, lay: Layout):
  """(loss, token_loss, lse, num_correct, num_tokens[, entropy]) of this shard; loss and counts are global."""
  count = _count(labels, where, s, lay)
  loss, aux = _local(x, _gather_w(w, s, lay), bias, labels, where, s, lay, count)
  return _finish(loss, aux, count, s, lay)


def shard_grads(x, w, bias, labels, where, s: Static, lay: Layout):
  """The forward's outputs and (dx, dw, dbias) of the global loss (reduction mean/sum), for cotangent 1."""
  count = _count(labels, where, s, lay)
  f = lambda x, w, bias: _local(x, w, bias, labels, where, s, lay, count)
  (loss, aux), (dx, dw, db) = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(
      x, _gather_w(w, s, lay), bias)
  return (*_finish(loss, aux, count, s, lay), *_reduce_grads(dx, dw, db, s, lay))


def shard_backward(x, w, bias, labels, where, g, g_lse, s: Static, lay: Layout):
  """(dx, dw, dbias) for per-token cotangents ``g`` of the loss and ``g_lse`` of the lse (reduction="none");
  re-runs the local forward (without the entropy: its cotangent goes to :func:`shard_entropy_backward`)."""
  s = dataclasses.replace(s, opts=s.opts.replace(entropy=False))

  def f(x, w, bias):
    loss, aux = _local(x, w, bias, labels, where, s, lay, None)
    return loss, aux.lse
  _, vjp = jax.vjp(f, x, _gather_w(w, s, lay), bias)
  dx, dw, db = vjp((g.astype(jnp.float32), g_lse.astype(jnp.float32)))
  return _reduce_grads(dx, dw, db, s, lay)


def shard_entropy_backward(x, w, bias, g_ent, s: Static, lay: Layout):
  """(dx, dw, dbias) for per-token cotangents ``g_ent`` of ``aux.entropy``: its own pass and backward
  (:func:`lce_flax._impl.base.entropy`) on this shard, with any reduction of the loss."""
  f = lambda x, w, bias: base.op_entropy(x, w, bias, s.w_layout, s.opts, s.vocab, lay.v)
  _, vjp = jax.vjp(f, x, _gather_w(w, s, lay), bias)
  return _reduce_grads(*vjp(g_ent.astype(jnp.float32)), s, lay)


# ------------------------------------------------------------------------------- the partitioned primitives


def entry_axes(entry) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry (None, an axis name or a tuple of them), as a tuple."""
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _spec(sharding, ndim):
  spec = tuple(getattr(sharding, "spec", ()) or ())
  return spec + (None,) * (ndim - len(spec))


def _layout(s: Static, mesh, x, w) -> Layout:
  xs, ws = _spec(x.sharding, 2), _spec(w.sharding, 2)
  v_dim = 1 - _h_dim(s)
  tok = tuple(a for a in entry_axes(xs[0]) if mesh.shape[a] > 1)
  wh = tuple(a for a in entry_axes(ws[_h_dim(s)]) if mesh.shape[a] > 1)
  # a vocabulary axis that also splits the tokens or H is dropped (the partitioner reshards w to match)
  v = tuple(a for a in entry_axes(ws[v_dim]) if mesh.shape[a] > 1 and a not in tok and a not in wh)
  # uneven shards would be padded with unknown values: refuse rather than count padding as tokens or columns
  for what, n, axes in (("tokens", x.shape[0], tok), ("H of w", w.shape[_h_dim(s)], wh),
                        ("V of w", w.shape[v_dim], v)):
    size = math.prod(mesh.shape[a] for a in axes)
    if n % size:
      raise ValueError(f"lce_flax: {what}={n} is split over mesh axes {axes} of total size {size}, which does not "
                       "divide it; pad it or change the sharding")
  return Layout(tok, wh, v)


def _w_spec(s: Static, lay: Layout) -> P:
  h, v = lay.wh or None, lay.v or None
  return P(h, v) if s.w_layout == "hv" else P(v, h)


def _shardings(s: Static, mesh, lay: Layout, has_bias, has_where):
  tok = P(lay.tok or None)
  wspec = _w_spec(s, lay)
  ns = lambda p: NamedSharding(mesh, p)
  bsh = ns(P(lay.v or None)) if has_bias else None
  args = (ns(P(lay.tok or None, None)), ns(wspec), bsh, ns(tok), ns(tok) if has_where else None)
  return args, ns(tok), ns(P()), ns(wspec)


def _fwd_outs(s, mesh, lay, tok, scal):
  return (tok if s.opts.reduction == "none" else scal, tok, tok, scal, scal) + ((tok,) if s.opts.entropy else ())


def _partition_fwd(s: Static, mesh, arg_shapes, result_shape):
  x, w, bias, _, where = arg_shapes
  lay = _layout(s, mesh, x, w)
  args, tok, scal, _ = _shardings(s, mesh, lay, bias is not None, where is not None)
  lower = lambda x, w, bias, labels, where: shard_forward(x, w, bias, labels, where, s, lay)
  return mesh, lower, _fwd_outs(s, mesh, lay, tok, scal), args


def _partition_grads(s: Static, mesh, arg_shapes, result_shape):
  x, w, bias, _, where = arg_shapes
  lay = _layout(s, mesh, x, w)
  args, tok, scal, wsh = _shardings(s, mesh, lay, bias is not None, where is not None)
  lower = lambda x, w, bias, labels, where: shard_grads(x, w, bias, labels, where, s, lay)
  outs = (*_fwd_outs(s, mesh, lay, tok, scal), args[0], wsh, args[2])
  return mesh, lower, outs, args


def _partition_bwd(s: Static, mesh, arg_shapes, result_shape):
  x, w, bias, _, where, _, _ = arg_shapes
  lay = _layout(s, mesh, x, w)
  args, tok, scal, wsh = _shardings(s, mesh, lay, bias is not None, where is not None)
  lower = lambda x, w, bias, labels, where, g, g_lse: shard_backward(x, w, bias, labels, where, g, g_lse, s, lay)
  return mesh, lower, (args[0], wsh, args[2]), (*args, tok, tok)


def _partition_entropy_bwd(s: Static, mesh, arg_shapes, result_shape):
  x, w, bias, _ = arg_shapes
  lay = _layout(s, mesh, x, w)
  args, tok, _, wsh = _shardings(s, mesh, lay, bias is not None, False)
  lower = lambda x, w, bias, g: shard_entropy_backward(x, w, bias, g, s, lay)
  return mesh, lower, (args[0], wsh, args[2]), (args[0], args[1], args[2], tok)


def _rule(s: Static, has_bias, has_where, results: str, extra: str = "") -> str:
  # x's H ("h") and w's H ("k") are separate factors: w's FSDP sharding is not propagated onto x's H dim.
  w = "k v" if s.w_layout == "hv" else "v k"
  ops = ["n h", w] + (["v"] if has_bias else []) + ["n"] + (["n"] if has_where else []) + ([extra] if extra else [])
  return ", ".join(ops) + " -> " + results


def _fwd_results(s):
  return ("n" if s.opts.reduction == "none" else "") + ", n, n, , " + (", n" if s.opts.entropy else "")


@functools.cache
def _primitives(s: Static, has_bias: bool, has_where: bool):
  w = "k v" if s.w_layout == "hv" else "v k"
  b = "v" if has_bias else None

  def fwd_global(x, w, bias, labels, where):
    return shard_forward(x, w, bias, labels, where, s, Layout((), ()))

  def grads_global(x, w, bias, labels, where):
    return shard_grads(x, w, bias, labels, where, s, Layout((), ()))

  def bwd_global(x, w, bias, labels, where, g, g_lse):
    return shard_backward(x, w, bias, labels, where, g, g_lse, s, Layout((), ()))

  def entropy_bwd_global(x, w, bias, g):
    return shard_entropy_backward(x, w, bias, g, s, Layout((), ()))

  fwd = custom_partitioning(fwd_global)
  fwd.def_partition(functools.partial(_partition_fwd, s), sharding_rule=_rule(s, has_bias, has_where,
                                                                                 _fwd_results(s)))
  grads = custom_partitioning(grads_global)
  gres = _fwd_results(s) + ", n h, " + w + (", " + b if b else "")
  grads.def_partition(functools.partial(_partition_grads, s), sharding_rule=_rule(s, has_bias, has_where, gres))
  bwd = custom_partitioning(bwd_global)
  bres = "n h, " + w + (", " + b if b else "")
  bwd.def_partition(functools.partial(_partition_bwd, s),
                    sharding_rule=_rule(s, has_bias, has_where, bres, "n, n"))
  ent_bwd = custom_partitioning(entropy_bwd_global)
  ent_bwd.def_partition(functools.partial(_partition_entropy_bwd, s),
                        sharding_rule=", ".join(["n h", w] + ([b] if b else []) + ["n"]) + " -> " + bres)
  return {"fwd": fwd, "grads": grads, "bwd": bwd, "entropy_bwd": ent_bwd}


# ------------------------------------------------------------------------------------------ the op


def _shard_map(kind, s: Static, run, *args):
  """The per-shard body ``kind`` under ``jax.shard_map`` on ``run = (mesh, Layout)`` (the explicit form)."""
  mesh, lay = run
  has_bias = args[2] is not None
  tok = P(lay.tok or None)
  wspec = _w_spec(s, lay)
  scal, bspec = P(), P(lay.v or None)
  in_specs = {"fwd": (tok, wspec, bspec, tok, tok), "grads": (tok, wspec, bspec, tok, tok),
              "bwd": (tok, wspec, bspec, tok, tok, tok, tok), "entropy_bwd": (tok, wspec, bspec, tok)}[kind]
  fwd_outs = _fwd_outs(s, mesh, lay, tok, scal)
  grads = (tok, wspec, bspec if has_bias else None)
  body = {"fwd": shard_forward, "grads": shard_grads, "bwd": shard_backward,
          "entropy_bwd": shard_entropy_backward}[kind]
  out_specs = {"fwd": fwd_outs, "grads": (*fwd_outs, *grads), "bwd": grads, "entropy_bwd": grads}[kind]
  return jax.shard_map(lambda *a: body(*a, s, lay), mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                       check_vma=False)(*args)


def _call(kind, s: Static, run, *args):
  """One per-shard body (``kind``: fwd, grads, bwd, entropy_bwd): custom-partitioned (``run`` None) or under
  shard_map."""
  if run is not None:
    return tuple(_shard_map(kind, s, run, *args))
  has_where = kind != "entropy_bwd" and args[4] is not None
  return tuple(_primitives(s, args[2] is not None, has_where)[kind](*args))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _op(x, w, bias, labels, where, s: Static, run=None):
  return _call("fwd", s, run, x, w, bias, labels, where)


def _op_fwd(x, w, bias, labels, where, s: Static, run=None):
  # symbolic_zeros=True wraps each array argument in a CustomVJPPrimal (None stays None)
  x, w, bias, labels, where = (None if a is None else a.value for a in (x, w, bias, labels, where))
  if s.opts.reduction == "none":
    return _call("fwd", s, run, x, w, bias, labels, where), (x, w, bias, labels, where)
  *out, dx, dw, db = _call("grads", s, run, x, w, bias, labels, where)
  # the entropy's backward recomputes from the inputs: they are residuals only when it was computed
  inputs = (x, w, bias) if s.opts.entropy else (None, None, None)
  return tuple(out), (dx, dw, db, labels, where, *inputs)


def _op_bwd(s: Static, run, res, g):
  zero = lambda t: isinstance(t, jax.custom_derivatives.SymbolicZero)
  g_ent = g[5] if s.opts.entropy and not zero(g[5]) else None
  dx, dw, db = _loss_bwd(s, run, res, g, zero)
  if g_ent is not None:  # Σ g_ent·entropy: its own backward, added to the loss's
    x, w, bias = res[:3] if s.opts.reduction == "none" else res[5:]
    ex, ew, eb = _call("entropy_bwd", s, run, x, w, bias, g_ent.astype(jnp.float32))
    add = lambda a, b: b if a is None else a + b
    dx, dw, db = add(dx, ex), add(dw, ew), None if eb is None else add(db, eb)
  if dx is None:  # no cotangent reached any output
    x, w, bias = res[:3] if s.opts.reduction == "none" else res[5:]
    dx, dw, db = jnp.zeros_like(x), jnp.zeros_like(w), None if bias is None else jnp.zeros_like(bias)
  return dx, dw, db, None, None


def _loss_bwd(s: Static, run, res, g, zero):
  """(dx, dw, dbias) from the cotangents of the loss, ``aux.token_loss`` and ``aux.lse``; Nones when all three are
  symbolic zeros and the loss's residuals are not its gradients."""
  g_loss, g_tok, g_lse = g[0], g[1], g[2]
  if s.opts.reduction == "none":
    x, w, bias, labels, where = res
    if zero(g_loss) and zero(g_tok) and zero(g_lse):
      return None, None, None
    dense = lambda t: jnp.zeros(labels.shape, jnp.float32) if zero(t) else t.astype(jnp.float32)
    return _call("bwd", s, run, x, w, bias, labels, where, dense(g_loss) + dense(g_tok), dense(g_lse))
  if not (zero(g_tok) and zero(g_lse)):
    # a fast design also gets here with no context mesh (a token loop in a process with several devices), where
    # mode='lean' runs unpartitioned and differentiates the aux outputs as on one device
    lean = ("; or, with no context mesh and no compiled kernels, mode='lean' (which then runs unpartitioned)"
            if s.opts.design_mode == "fast" else "")
    raise ValueError(f"reduction={s.opts.reduction!r}: on a mesh only the reduced loss is differentiated here; "
                     f"to differentiate aux.token_loss or aux.lse use reduction='none' (and reduce yourself){lean}")
  dx, dw, db = res[:3]
  if zero(g_loss):
    return jnp.zeros_like(dx), jnp.zeros_like(dw), None if db is None else jnp.zeros_like(db)
  dx = (dx.astype(jnp.float32) * g_loss).astype(dx.dtype)
  dw = (dw.astype(jnp.float32) * g_loss).astype(dw.dtype)
  db = None if db is None else (db.astype(jnp.float32) * g_loss).astype(db.dtype)
  return dx, dw, db


# the explicit form's entry (eager shard_map does not run custom_vjps with symbolic zeros: jitted)
run_shard_map = jax.jit(_op, static_argnums=(5, 6))


_op.defvjp(_op_fwd, _op_bwd, symbolic_zeros=True)


def auto_mesh_active() -> bool:
  """True under a context mesh (``jax.set_mesh``) with an Auto axis of size > 1."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return False
  return any(t == jax.sharding.AxisType.Auto and mesh.shape[n] > 1
             for n, t in zip(mesh.axis_names, mesh.axis_types))


def linear_cross_entropy(x, w, labels, *, bias=None, where=None, w_layout="hv", return_aux=False,
                         options: LossOptions):
  """The op (validated arguments) as custom-partitioned primitives; :func:`lce_flax.linear_cross_entropy`
  routes here under an Auto-axis mesh, and for compiled kernels or a token loop in a process with several
  devices."""
  batch_shape = labels.shape
  if x.ndim < 2 or labels.size == 0:
    return base.per_device(x, w, labels, bias=bias, where=where, w_layout=w_layout, return_aux=return_aux,
                           options=options)
  s = Static(options, w_layout, common.vocab_size(w, w_layout))
  x, w = narrow(x, w, options)
  n = math.prod(batch_shape)
  x2, y2 = x.reshape(n, x.shape[-1]), labels.reshape(n)
  wh2 = None if where is None else where.reshape(n)
  loss, aux = outputs(_op(x2, w, bias, y2, wh2, s), batch_shape, options)
  return (loss, aux) if return_aux else loss


def outputs(out, batch_shape, options: LossOptions):
  """``(loss, Aux)`` from the partitioned op's outputs (loss, token loss, lse, counts[, entropy]) for tokens of
  ``batch_shape``."""
  loss, tok, lse, correct, count, *ent = out
  if options.reduction == "none":
    loss = loss.reshape(batch_shape)
  aux = base.Aux(tok.reshape(batch_shape), lse.reshape(batch_shape), correct, count,
                 ent[0].reshape(batch_shape) if ent else None)
  return loss, aux
