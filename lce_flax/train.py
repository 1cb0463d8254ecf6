"""A train state and a sharded, jitted train step for any Flax model (linen or NNX) with an lce_flax head.

Shardings come from the parameters' *logical* axis names (``nn.with_logical_partitioning`` in linen,
``out_sharding`` metadata in NNX) mapped onto the mesh by logical axis rules
(:data:`lce_flax.sharding.DEFAULT_RULES` unless given). The state keeps flax's metadata boxes (linen
``LogicallyPartitioned``, NNX ``Variable``), so the optimizer state inherits the names of the parameters it
mirrors and is sharded the same way.

Example (linen; the model's head is :class:`lce_flax.linen.LMHead`, which runs per shard by itself on a mesh of
``AxisType.Explicit`` axes)::

  mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2)
  params = model.init(key, tokens, labels)["params"]          # boxed with logical names
  opt = optax.adamw(3e-4)
  state = TrainState.create(params, opt, mesh=mesh)           # placed by the rules
  loss_fn = lambda params, batch: model.apply({"params": params}, batch["tokens"], batch["labels"])
  step = make_train_step(loss_fn, opt, mesh=mesh, grad_accum_steps=2)
  for batch in batches:                                        # leaves [B, ...], B split over ("data", "fsdp")
    state, metrics = step(state, batch)                        # metrics: loss, grad_norm (+ the loss_fn's aux)

NNX: split once and merge inside the loss::

  graphdef, params = nnx.split(model, nnx.Param)
  loss_fn = lambda params, batch: nnx.merge(graphdef, params)(batch["tokens"], batch["labels"])
  state = TrainState.create(params, opt, mesh=mesh)

(Variables other than ``nnx.Param`` — batch statistics, RNG counters — are not carried by this step.)

Several processes (one per host, or several on one host): call ``jax.distributed.initialize`` first, build the mesh
over ``jax.devices()`` (all processes' devices), give every process the same initial parameters (same key), and
turn each process's own rows of the batch into global arrays with :func:`global_batch`; the step is unchanged::

  jax.distributed.initialize(coordinator_address="localhost:1234", num_processes=2, process_id=i)
  state = TrainState.create(params, opt, mesh=mesh)               # params: the same numbers on every process
  state, metrics = step(state, global_batch(local_rows, mesh))    # local_rows: this process's B / 2 rows
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx, struct
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lce_flax.sharding import DEFAULT_RULES

Rules = Sequence[tuple[str, Any]]


class TrainState(struct.PyTreeNode):
  """``step`` (int32 scalar), ``params`` and ``opt_state``; a pytree, so it passes through ``jit`` whole."""

  step: jax.Array
  params: Any
  opt_state: Any

  @classmethod
  def create(cls, params: Any, optimizer: optax.GradientTransformation, *, mesh: Mesh | None = None,
             rules: Rules | None = None) -> TrainState:
    """Initialises the optimizer and places the whole state by its logical axes (replicated where it has none)."""

    def init(p):
      return cls(step=jnp.zeros((), jnp.int32), params=p, opt_state=optimizer.init(p))

    if mesh is None:
      return jax.jit(init)(params)
    abstract = jax.eval_shape(init, params)
    if jax.process_count() > 1:
      params = _replicated_global(params, mesh)
    with jax.set_mesh(mesh):
      return jax.jit(init, out_shardings=state_shardings(abstract, mesh, rules))(params)


def _replicated_global(tree: Any, mesh: Mesh) -> Any:
  """Leaves that are not yet global arrays of ``mesh`` become replicated global arrays built from this process's
  copy (every process must hold the same numbers, e.g. parameters initialised from the same key)."""
  repl = NamedSharding(mesh, P())

  def put(a):
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
      return a  # already global
    host = np.asarray(a)
    return jax.make_array_from_callback(host.shape, repl, lambda idx: host[idx])

  return jax.tree.map(put, tree)


def is_explicit(mesh: Mesh | None) -> bool:
  """Whether ``mesh`` has ``AxisType.Explicit`` axes (shardings live in the arrays' types)."""
  return mesh is not None and any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def _constrain(x: Any, sharding: Any, mesh: Mesh) -> Any:
  """``with_sharding_constraint`` on Auto meshes; ``reshard`` on Explicit ones (where the former only asserts)."""
  if is_explicit(mesh):
    return jax.tree.map(jax.sharding.reshard, x, sharding)
  return lax.with_sharding_constraint(x, sharding)


def batch_sharding(mesh: Mesh, rules: Rules | None = None) -> NamedSharding:
  """Where :func:`make_train_step` expects the batch: dim 0 split over the batch axes (:func:`batch_axes`)."""
  baxes = batch_axes(mesh, rules)
  return NamedSharding(mesh, P((baxes[0] if len(baxes) == 1 else baxes) if baxes else None))


def process_rows(mesh: Mesh, batch_size: int, rules: Rules | None = None) -> slice:
  """The rows of a global batch of ``batch_size`` that this process's devices hold under :func:`batch_sharding`
  (one contiguous block; what this process loads and passes to :func:`global_batch`)."""
  index = batch_sharding(mesh, rules).addressable_devices_indices_map((batch_size,))
  rows = sorted({r for idx in index.values() for r in range(*idx[0].indices(batch_size))})
  if not rows or rows != list(range(rows[0], rows[-1] + 1)):
    raise ValueError(f"this process's devices hold rows {rows} of the batch: not one contiguous block (order the "
                     "mesh's devices so each process's devices are adjacent along the batch axes)")
  return slice(rows[0], rows[-1] + 1)


def global_batch(local: Any, mesh: Mesh, rules: Rules | None = None) -> Any:
  """This process's rows of the batch (a pytree of ``[b, ...]`` host arrays) → global ``[b·P, ...]`` arrays split
  over the batch axes, for :func:`make_train_step` with several processes (``jax.make_array_from_process_local_data``).

  ``local`` must be the rows :func:`process_rows` names for this process. With one process this is a
  ``device_put`` of the whole batch.
  """
  sharding = batch_sharding(mesh, rules)
  return jax.tree.map(lambda a: jax.make_array_from_process_local_data(sharding, np.asarray(a)), local)


def _is_box(node) -> bool:
  return isinstance(node, (nn.meta.AxisMetadata, nnx.Variable))


def logical_specs(tree: Any) -> Any:
  """The logical ``PartitionSpec`` of every array of ``tree`` (boxes replaced by their specs; plain arrays: P())."""

  def spec(node):
    if isinstance(node, nn.meta.AxisMetadata):
      return node.get_partition_spec()
    if isinstance(node, nnx.Variable):
      return jax.tree.leaves(nnx.get_partition_spec(node))[0]
    return P()

  return jax.tree.map(spec, tree, is_leaf=_is_box)


def _mesh_spec(logical: P, shape: tuple[int, ...], mesh: Mesh, rules: Rules) -> P:
  """Logical names → mesh axes (of size > 1); a dim whose size the mesh axes do not divide is replicated instead."""
  if len(logical) != len(shape):  # e.g. a factored optimizer statistic that lost a dim: replicate it
    return P()
  out = []
  for dim, axes in zip(shape, nn.logical_to_mesh_axes(tuple(logical), rules)):
    names = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
    # axes of size 1 are left out (nothing to split; on an Explicit mesh they would type the array as split)
    names = tuple(a for a in names if a in mesh.shape and mesh.shape[a] > 1)
    if not names or dim % math.prod(mesh.shape[a] for a in names):
      out.append(None)
    else:
      out.append(names[0] if len(names) == 1 else names)
  return P(*out)


def state_shardings(tree: Any, mesh: Mesh, rules: Rules | None = None) -> Any:
  """``NamedSharding`` of every array of ``tree`` (a state, params, or their ``eval_shape``), same structure."""
  rules = tuple(DEFAULT_RULES if rules is None else rules)
  leaves, treedef = jax.tree.flatten(tree)
  # boxes hold exactly one array each, so the specs' leaves line up with the tree's leaves
  specs = jax.tree.leaves(logical_specs(tree), is_leaf=lambda s: isinstance(s, P))
  if len(specs) != len(leaves):
    raise ValueError(f"could not match logical specs ({len(specs)}) to the arrays of the tree ({len(leaves)})")
  return jax.tree.unflatten(
      treedef, [NamedSharding(mesh, _mesh_spec(s, np.shape(a), mesh, rules)) for s, a in zip(specs, leaves)])


def _active_rules(rules: Rules, mesh: Mesh) -> Rules:
  """``rules`` without the mesh axes of size 1, as :func:`state_shardings` places the parameters: flax's
  logical-partitioning metadata then constrains them to the same specs (on an Explicit mesh a constraint that
  names a size-1 axis the array's type does not would fail as an assertion)."""
  def keep(axes):
    if axes is None:
      return None
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    names = tuple(a for a in names if a not in mesh.shape or mesh.shape[a] > 1)
    return names[0] if len(names) == 1 else (names or None)
  return tuple((name, keep(axes)) for name, axes in rules)


def batch_axes(mesh: Mesh, rules: Rules | None = None) -> tuple[str, ...]:
  """The mesh axes the logical "batch" dim maps to (those of size > 1 that exist in ``mesh``)."""
  axes = nn.logical_to_mesh_axes(("batch",), tuple(DEFAULT_RULES if rules is None else rules))[0]
  axes = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
  # size-1 axes are left out: on an Explicit mesh they would still type the batch as split, which the op's
  # local path (token scans) does not accept
  return tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1)


def make_train_step(loss_fn: Callable[..., Any], optimizer: optax.GradientTransformation, *,
                    mesh: Mesh | None = None, rules: Rules | None = None, grad_accum_steps: int = 1,
                    donate: bool = True, has_aux: bool = False,
                    compiler_options: Mapping[str, Any] | None = None,
                    ) -> Callable[[TrainState, Any], tuple[TrainState, dict]]:
  """A jitted ``step(state, batch) -> (state, metrics)``: gradients of ``loss_fn``, one optimizer update.

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux_dict)`` with ``has_aux``); ``params`` as stored
      in the state (linen: boxed, which ``model.apply`` accepts; use ``nn.unbox`` to read arrays directly).
    optimizer: an optax transformation (the one given to :meth:`TrainState.create`).
    mesh: the device mesh; None runs unsharded.
    rules: logical axis rules (default :data:`lce_flax.sharding.DEFAULT_RULES`); also active (with the mesh)
      while the step traces, for ``nn.with_logical_constraint`` inside models.
    grad_accum_steps: micro-batches per step (``lax.scan``); grads and loss are their means. Micro-batch ``i``
      takes rows ``i, i+A, i+2A, …`` of the batch, so each device keeps its own rows: the batch must be
      divisible by ``grad_accum_steps`` × (size of the batch mesh axes).
    donate: donate the incoming state's buffers to the new state.
    has_aux: ``loss_fn`` returns ``(loss, aux)``; aux's leaves (averaged over micro-batches) join the metrics.
    compiler_options: XLA options for compiling the step (``jax.jit(..., compiler_options=...)``), e.g.
      ``{"xla_gpu_enable_analytical_sol_latency_estimator": True}`` (XLA's scheduler with a model of each collective's
      and kernel's time; ``docs/multi_gpu.md`` says where the example trainer's all-reduces sit). An unknown name
      fails the step's compile, naming it.

  Returns:
    ``step(state, batch)``. ``batch`` is a pytree of arrays ``[B, ...]`` split over the batch axes on dim 0.
    Metrics: ``loss``, ``grad_norm`` (global L2 norm of the gradient), ``step`` (before the update).
    ``step.lower(state, batch)`` gives the lowered step (e.g. ``.compile().as_text()``, ``memory_analysis()``).
  """
  if grad_accum_steps < 1:
    raise ValueError(f"{grad_accum_steps=} must be >= 1")
  copts = dict(compiler_options or {})
  rules = tuple(DEFAULT_RULES if rules is None else rules)
  accum = grad_accum_steps
  baxes = batch_axes(mesh, rules) if mesh is not None else ()
  nb = math.prod(mesh.shape[a] for a in baxes) if mesh is not None else 1
  bspec = (baxes[0] if len(baxes) == 1 else baxes) if baxes else None

  def value_and_grad(params, batch):
    out, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(params, batch)
    loss, aux = out if has_aux else (out, {})
    return loss, aux, grads

  def step(state: TrainState, batch):
    if accum == 1:
      loss, aux, grads = value_and_grad(state.params, batch)
    else:
      # [B, ...] -> [A, B/A, ...] taking rows i::A: a device's rows stay on it (no resharding of the batch)
      def split(a):
        shape = (a.shape[0] // accum, accum, *a.shape[1:])
        if is_explicit(mesh):  # keep dim 0's sharding on the outer factor (each device keeps its own rows)
          a = jnp.reshape(a, shape, out_sharding=NamedSharding(mesh, P(bspec)))
        else:
          a = a.reshape(shape)
        return jnp.swapaxes(a, 0, 1)

      micro = jax.tree.map(split, batch)
      zeros = jax.tree.map(jnp.zeros_like, state.params)
      if mesh is not None:
        micro = jax.tree.map(lambda a: _constrain(a, NamedSharding(mesh, P(None, bspec)), mesh), micro)
        # the accumulator lives where the parameters live (1/n of them under FSDP / tensor parallelism)
        zeros = _constrain(zeros, state_shardings(state.params, mesh, rules), mesh)

      def body(carry, mb):
        gsum, lsum = carry
        loss, aux, grads = value_and_grad(state.params, mb)
        return (jax.tree.map(jnp.add, gsum, grads), lsum + loss), aux

      (gsum, lsum), auxs = lax.scan(body, (zeros, jnp.zeros((), jnp.float32)), micro)
      grads = jax.tree.map(lambda g: g / accum, gsum)
      loss = lsum / accum
      aux = jax.tree.map(lambda a: jnp.mean(a, axis=0), auxs)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "step": state.step, **aux}
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

  donate_argnums = (0,) if donate else ()
  if mesh is None:
    return jax.jit(step, donate_argnums=donate_argnums, compiler_options=copts)

  compiled: dict[Any, Callable] = {}

  def jitted(state: TrainState, batch):
    leaves, treedef = jax.tree.flatten(batch)
    for a in leaves:
      if np.ndim(a) < 1 or np.shape(a)[0] % (accum * nb):
        raise ValueError(f"batch leaf of shape {np.shape(a)}: dim 0 must be divisible by grad_accum_steps={accum} x "
                         f"the batch axes {baxes} (size {nb}) = {accum * nb}")
    key = (jax.tree.structure(state), treedef, tuple(np.shape(a) for a in leaves))
    if key not in compiled:
      st = state_shardings(state, mesh, rules)
      bt = jax.tree.unflatten(treedef, [NamedSharding(mesh, P(bspec)) for _ in leaves])
      compiled[key] = jax.jit(step, in_shardings=(st, bt), out_shardings=(st, NamedSharding(mesh, P())),
                              donate_argnums=donate_argnums, compiler_options=copts)
    return compiled[key]

  def sharded_step(state: TrainState, batch):
    fn = jitted(state, batch)
    with jax.set_mesh(mesh), nn.logical_axis_rules(_active_rules(rules, mesh)):
      return fn(state, batch)

  def lower(state: TrainState, batch):
    """``jax.jit(...).lower`` of the step for these arguments (to read its HLO or memory analysis)."""
    fn = jitted(state, batch)
    with jax.set_mesh(mesh), nn.logical_axis_rules(_active_rules(rules, mesh)):
      return fn.lower(state, batch)

  sharded_step.lower = lower
  return sharded_step
