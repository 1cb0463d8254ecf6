"""Named head shapes and the benchmark presets. Pure Python (no JAX, no torch), so both harnesses import it.

A shape is the 2-D problem the op sees: ``B`` tokens (batch × sequence, flattened), hidden size ``H``, vocabulary
``V``. The four LLM shapes are the output heads of GPT-2 small, Llama 3 8B, Qwen3 8B and Gemma 2 2B at a
realistic number of tokens per device.
"""

from __future__ import annotations

import dataclasses

# Dense bf16 matmul rate measured on the H100s the results come from (8192³ products, ~790–798 TFLOP/s). The floor
# of a forward + backward is its 6·B·H·V matmul FLOPs at this rate; of a forward, 2·B·H·V.
PEAK_TFLOPS = 790.0


@dataclasses.dataclass(frozen=True)
class Shape:
  name: str
  B: int  # tokens
  H: int  # hidden size
  V: int  # vocabulary

  def flops(self, factor: int) -> float:
    """``factor``·B·H·V: 2 for a forward, 6 for a forward + backward that forms the gradients from stored (or
    on-chip) logits, 8 for one that recomputes the logits in the backward (the "lean" designs)."""
    return float(factor) * self.B * self.H * self.V

  def floor_ms(self, factor: int = 6) -> float:
    return self.flops(factor) / (PEAK_TFLOPS * 1e12) * 1e3


LLM_SHAPES = (
    Shape("gpt2-small", 16384, 768, 50304),
    Shape("llama3-8b", 8192, 4096, 128256),
    Shape("qwen3-8b", 4096, 4096, 151936),
    Shape("gemma2-2b", 8192, 2304, 256000),
)
LLM = {s.name: s for s in LLM_SHAPES}
# the two largest heads at 32768 tokens (where the plain head's logits take 8.4 and 16.8 GB in bf16)
LLM32K_SHAPES = (Shape("llama3-8b-32k", 32768, 4096, 128256), Shape("gemma2-2b-32k", 32768, 2304, 256000))
# name -> (B, H, V) of every LLM head, the per-kernel benchmarks' shapes (their default: the four of LLM_SHAPES)
HEADS = {s.name: (s.B, s.H, s.V) for s in (*LLM_SHAPES, *LLM32K_SHAPES)}


@dataclasses.dataclass(frozen=True)
class Sweep:
  """Vary one of B, H, V around ``base``, the other two fixed (the classic "time and memory vs n_classes /
  n_tokens / dim" plots)."""

  axis: str  # "B", "H" or "V"
  base: Shape
  values: tuple[int, ...]

  def shapes(self) -> list[Shape]:
    if self.axis not in ("B", "H", "V"):
      raise ValueError(f"axis={self.axis!r} must be 'B', 'H' or 'V'")
    out = []
    for v in self.values:
      s = dataclasses.replace(self.base, **{self.axis: v})
      out.append(dataclasses.replace(s, name=f"sweep-{s.B}x{s.H}x{s.V}"))
    return out


@dataclasses.dataclass(frozen=True)
class Preset:
  """What one run measures. ``reps`` bounds the timed repetitions: each measurement repeats until about
  ``target_s`` seconds are spent, at least ``min_reps`` and at most ``max_reps`` times."""

  name: str
  shapes: tuple[Shape, ...] = ()
  sweeps: tuple[Sweep, ...] = ()
  passes: tuple[str, ...] = ("fwd", "fwdbwd")
  sweep_passes: tuple[str, ...] = ("fwdbwd",)
  min_reps: int = 3
  max_reps: int = 20
  target_s: float = 0.5
  reference: bool = True  # compute an fp32 reference loss per shape (loss_rel_err column)


_SWEEP_BASE = Shape("sweep-base", 8192, 2048, 65536)
_TINY_BASE = Shape("tiny-base", 64, 16, 256)

PRESETS = {
    # CPU, seconds: checks the harness end to end (JSON, tables, plots); times mean nothing.
    "smoke": Preset(
        "smoke",
        shapes=(Shape("tiny-a", 64, 32, 500), Shape("tiny-b", 100, 24, 1000)),
        sweeps=(Sweep("V", _TINY_BASE, (256, 1000)), Sweep("B", _TINY_BASE, (64, 200)),
                Sweep("H", _TINY_BASE, (16, 48))),
        min_reps=1, max_reps=2, target_s=0.05),
    # GPU: the four LLM heads, forward and forward + backward.
    "llm": Preset("llm", shapes=LLM_SHAPES, min_reps=3, max_reps=10, target_s=0.4),
    # GPU: the two largest heads at 32768 tokens.
    "llm32k": Preset("llm32k", shapes=LLM32K_SHAPES, passes=("fwdbwd",), min_reps=3, max_reps=6, target_s=0.5),
    # GPU: time and memory vs V, B and H (forward + backward only) around an 8192×2048×65536 head.
    "sweep": Preset(
        "sweep",
        sweeps=(Sweep("V", _SWEEP_BASE, (16384, 32768, 65536, 131072, 262144)),
                Sweep("B", _SWEEP_BASE, (2048, 4096, 8192, 16384, 32768)),
                Sweep("H", _SWEEP_BASE, (512, 1024, 2048, 4096, 8192))),
        min_reps=3, max_reps=10, target_s=0.3, reference=False),
}


class Named(dict):
  """Shapes by name that also take any ``BxHxV`` (``"2048x2048x65536"``, or a sweep point's name
  ``"sweep-2048x2048x65536"``) as a shape of that size, so that the per-head tools run at any point of a sweep."""

  def __missing__(self, name: str) -> Shape:
    dims = name.removeprefix("sweep-").split("x")
    if len(dims) != 3 or not all(d.isdigit() and int(d) > 0 for d in dims):
      raise KeyError(f"unknown shape {name!r}: one of {', '.join(self)}, or BxHxV (e.g. 2048x2048x65536)")
    return Shape(name, *map(int, dims))


def preset_shapes(preset: Preset) -> list[tuple[Shape, str | None, tuple[str, ...]]]:
  """(shape, sweep axis or None, passes) for every problem of ``preset``, each distinct shape once: a sweep's base
  point is shared by the three sweeps and measured once (tagged with every axis it belongs to, comma-joined)."""
  out: list[tuple[Shape, str | None, tuple[str, ...]]] = [(s, None, preset.passes) for s in preset.shapes]
  seen: dict[tuple[int, int, int], int] = {}
  for sweep in preset.sweeps:
    for s in sweep.shapes():
      key = (s.B, s.H, s.V)
      if key in seen:
        shape, axes, passes = out[seen[key]]
        out[seen[key]] = (shape, f"{axes},{sweep.axis}", passes)
        continue
      seen[key] = len(out)
      out.append((s, sweep.axis, preset.sweep_passes))
  return out
