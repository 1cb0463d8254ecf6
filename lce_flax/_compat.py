"""The code that depends on the JAX version, in one place.

lce_flax runs beside jax/jaxlib 0.11.2 and 0.12.x (``pyproject.toml``: ``>=0.11.2,<0.13``). CI runs the whole
suite on both (``.ci/jax-0.11.2.txt``, ``.ci/jax-0.12.txt``); the GPU kernels have run on GPUs with 0.11.2, and
on 0.12 they are checked on the CPU only (Pallas interpret mode, and the Mosaic GPU and Triton kernels lowered for
CUDA). The rest of the package writes against the API the two versions share and calls the functions here where
they differ or where the spelling has changed before.

What differs between 0.11.2 and 0.12.0.1 in the APIs lce_flax uses (found by running the suite on both and by
comparing the public signatures of ``jax``, ``jax.lax``, ``jax.sharding``, ``jax.custom_derivatives``,
``jax.experimental.pallas`` and its ``mosaic_gpu`` and ``triton`` modules):

* ``jax.custom_vjp`` / ``jax.custom_jvp``: ``fun`` became a required positional argument. The decorator form
  ``functools.partial(jax.custom_vjp, nondiff_argnums=...)`` used throughout works on both; a bare
  ``jax.custom_vjp(nondiff_argnums=...)`` (no function) would fail on 0.12.
* Pallas Mosaic GPU: ``plgpu.load(src, idx, *, layout=...)`` lost its positional ``idx`` (index the ref with
  ``.at[...]`` instead, as the kernels do); ``CompilerParams`` gained ``is_multi_process``, ``kernel`` gained
  ``cost_estimate``, ``InterpretGPUParams`` gained ``on_race``, and there are new ``plgpu.sum/max/min/prod``,
  ``store``, ``barrier_arrive_and_wait`` and ``alloc_semaphore``. Nothing lce_flax calls changed meaning.
* Pallas: ``pl.DeviceIdType`` is no longer exported from ``jax.experimental.pallas`` and ``device_id_type``
  defaults to None (not used here). The Triton lowering's API is unchanged.
* ``jax.lax``: ``psend``/``precv`` removed (not used); ``lax.pcast(x, axes, to=...)`` and ``jax.shard_map``
  keep their signatures; ``jax.sharding`` gained ``no_collectives``.
* A value's varying manual axes: ``jax.typeof(x).manual_axis_type.varying`` on both (``aval.vma`` before 0.11);
  lce_flax does not read them (its per-shard bodies run under ``check_vma=False`` or ``custom_partitioning``).
* ``jnp.array(obj, dtype, copy=...)``: ``copy`` and later are keyword-only on 0.12.
* ``jax.experimental.custom_partitioning`` and ``jax.sharding.AxisType`` / ``reshard`` / ``get_abstract_mesh``:
  unchanged.
* Flax 0.12.10+ picks its hijax base class by JAX version itself (``HiPrim``), so the same Flax runs on both.
"""

from __future__ import annotations

import jax

# (major, minor, patch) of the running JAX; 0.12.0.1 reads (0, 12, 0).
JAX_VERSION: tuple[int, int, int] = tuple(jax.__version_info__[:3])  # type: ignore[assignment]
