"""jaxaccum: exact gradient accumulation over micro-batches for JAX and Flax.

The public surface:

- :func:`value_and_grad`, :func:`grad`: drop-ins for ``jax.value_and_grad``
  and ``jax.grad`` that split the batch into micro-batches and accumulate
  inside one ``lax.scan``. :mod:`jaxaccum.nnx` adapts them to Flax NNX.
- :func:`accumulate`: an optax transformation that accumulates across calls
  and runs the inner optimizer once per window; :func:`has_updated`,
  :func:`inner_step` and :func:`window_size` read its state from inside any
  optimizer state; :func:`auto_k`, the batch-size autopilot, sets each
  window's length from the measured critical batch size.
- :func:`make_train_step`: a jitted, donated step with one optimizer update.
- :func:`pipeline`: pipeline parallelism, micro-batches through stages of
  stacked layers on a mesh axis, equal to a ``lax.scan`` over the layers.
- :func:`verify_equivalence`: checks accumulation against the full batch;
  :class:`SharedArgumentWarning`: a key or a batch-sized array that every
  micro-batch would get whole.
- :func:`pad_batch`: pads a ragged batch and masks the padding;
  :func:`merge_micro_batches`: per-example aux back in batch order.
- :func:`plan_micro_batches`, :func:`memory_report`: compile-time memory,
  also for an accelerator you do not have (:func:`compile_target`).
- :func:`scale_lr_linear`, :func:`scale_adam_sqrt`, :func:`warmup`:
  hyperparameters for a larger effective batch; :func:`micro_batch_momentum`:
  BatchNorm's per-step momentum kept over micro-batches
  (:class:`RunningAverageWarning` where a train step may need it).
- :class:`GradientNoise`, :func:`noise_scale_update`,
  :func:`critical_batch_size`: is the larger effective batch worth it?
- :func:`dynamic_loss_scale`: float16 loss scaling, adjusted per window.
- Differentially private training (DP-SGD): ``clip_per_example=`` of
  :func:`value_and_grad` clips each example's gradient (``clip_method=
  "ghost"`` without per-example gradients, :class:`GhostFallbackWarning`
  naming the leaves that still need one); :func:`dp_noise`
  adds the noise once per logical batch; :class:`PoissonSampler` draws
  batches at one padded size; :func:`dp_epsilon` accounts with
  ``dp-accounting``.
- :mod:`jaxaccum.testing`: reading collectives out of compiled HLO, to check
  that a step communicates what it should; ``import jaxaccum`` imports it.
"""

from jaxaccum import nnx as nnx
from jaxaccum import testing as testing
from jaxaccum._aux import merge_micro_batches as merge_micro_batches
from jaxaccum._checks import SharedArgumentWarning as SharedArgumentWarning
from jaxaccum._inspect.equivalence import Deviation as Deviation
from jaxaccum._inspect.equivalence import verify_equivalence as verify_equivalence
from jaxaccum._inspect.memory import MemoryStats as MemoryStats
from jaxaccum._inspect.memory import compiled_memory as compiled_memory
from jaxaccum._inspect.memory import memory_report as memory_report
from jaxaccum._inspect.planner import MicroBatchPlan as MicroBatchPlan
from jaxaccum._inspect.planner import plan_micro_batches as plan_micro_batches
from jaxaccum._inspect.targets import CompileTarget as CompileTarget
from jaxaccum._inspect.targets import compile_target as compile_target
from jaxaccum._noise_scale import GradientNoise as GradientNoise
from jaxaccum._noise_scale import NoiseScaleState as NoiseScaleState
from jaxaccum._noise_scale import critical_batch_size as critical_batch_size
from jaxaccum._noise_scale import noise_scale_init as noise_scale_init
from jaxaccum._noise_scale import noise_scale_update as noise_scale_update
from jaxaccum._optim.accumulate import AccumulateState as AccumulateState
from jaxaccum._optim.accumulate import accumulate as accumulate
from jaxaccum._optim.autopilot import auto_k as auto_k
from jaxaccum._optim.loss_scale import DynamicLossScale as DynamicLossScale
from jaxaccum._optim.loss_scale import dynamic_loss_scale as dynamic_loss_scale
from jaxaccum._optim.opt_state import has_updated as has_updated
from jaxaccum._optim.opt_state import inner_step as inner_step
from jaxaccum._optim.opt_state import window_size as window_size
from jaxaccum._optim.scaling import AdamHyperparams as AdamHyperparams
from jaxaccum._optim.scaling import RunningAverageWarning as RunningAverageWarning
from jaxaccum._optim.scaling import kappa as kappa
from jaxaccum._optim.scaling import micro_batch_momentum as micro_batch_momentum
from jaxaccum._optim.scaling import scale_adam_sqrt as scale_adam_sqrt
from jaxaccum._optim.scaling import scale_lr_linear as scale_lr_linear
from jaxaccum._optim.scaling import warmup as warmup
from jaxaccum._parallel import DataParallel as DataParallel
from jaxaccum._pipeline.pipeline import pipeline as pipeline
from jaxaccum._privacy import ClipPerExample as ClipPerExample
from jaxaccum._privacy import ClipRecord as ClipRecord
from jaxaccum._privacy import ClipWithoutNoiseWarning as ClipWithoutNoiseWarning
from jaxaccum._privacy import DPNoiseState as DPNoiseState
from jaxaccum._privacy import GhostFallbackWarning as GhostFallbackWarning
from jaxaccum._privacy import PoissonSampler as PoissonSampler
from jaxaccum._privacy import dp_epsilon as dp_epsilon
from jaxaccum._privacy import dp_noise as dp_noise
from jaxaccum._split import pad_batch as pad_batch
from jaxaccum._train_step import make_train_step as make_train_step
from jaxaccum._value_and_grad import grad as grad
from jaxaccum._value_and_grad import value_and_grad as value_and_grad

__version__ = "0.4.0"  # the one place: pyproject.toml reads it

__all__ = [
  "AccumulateState",
  "AdamHyperparams",
  "ClipPerExample",
  "ClipRecord",
  "ClipWithoutNoiseWarning",
  "CompileTarget",
  "DPNoiseState",
  "DataParallel",
  "Deviation",
  "DynamicLossScale",
  "GhostFallbackWarning",
  "GradientNoise",
  "MemoryStats",
  "MicroBatchPlan",
  "NoiseScaleState",
  "PoissonSampler",
  "RunningAverageWarning",
  "SharedArgumentWarning",
  "accumulate",
  "auto_k",
  "compile_target",
  "compiled_memory",
  "critical_batch_size",
  "dp_epsilon",
  "dp_noise",
  "dynamic_loss_scale",
  "grad",
  "has_updated",
  "inner_step",
  "kappa",
  "make_train_step",
  "memory_report",
  "merge_micro_batches",
  "micro_batch_momentum",
  "nnx",
  "noise_scale_init",
  "noise_scale_update",
  "pad_batch",
  "pipeline",
  "plan_micro_batches",
  "scale_adam_sqrt",
  "scale_lr_linear",
  "value_and_grad",
  "verify_equivalence",
  "warmup",
  "window_size",
]
