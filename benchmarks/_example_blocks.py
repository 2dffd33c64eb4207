"""The generated blocks of the four measurements whose scripts live in
``examples/``: ``input_pipeline.py`` (``input_pipeline_device.json`` and
``input_pipeline_pinned_host.json``), ``autopilot.py`` (``autopilot.json``),
``dp_lm.py`` and ``fp8_lm.py`` (``dp_lm.json``, ``fp8_lm.json``, shown in
``examples/README.md``).

Every other benchmark writes its blocks next to the code that measures them
(its ``BLOCKS``); these wait here until the examples carry theirs, so
that ``_report.py`` itself writes no prose about a benchmark.
"""

from __future__ import annotations

from typing import Any

from _report import columns, count, date, met, table

# ---------------------------------------------------------------- input pipelines


PIPELINE_STEPS = {
  "resident": "batches already in device memory, cycled",
  "grain_batches_source": "Grain, whole shuffled batches as the source, per-batch augmentation",
  "python_loop": "a synchronous Python loop (numpy shuffle and augmentation, `device_put`)",
  "grain": "Grain, rows as the source (Grain batches them), per-batch augmentation",
  "grain_default_read_threads": "the same with Grain's default read options",
  "grain_1w": "the same with 1 worker process (`mp_prefetch`)",
  "grain_2w": "the same with 2 worker processes",
  "grain_per_example_0w": "Grain, rows, per-example augmentation, no workers",
  "grain_per_example_1w": "the same with 1 worker process",
  "grain_per_example_2w": "the same with 2 worker processes",
  "resident_loss_every_step": "resident batches, the loss read (`float(loss)`) after every step",
  "python_loop_loss_every_step": "the Python loop, the loss read after every step",
}
PIPELINE_ALONE = {
  "batches_per_batch": "whole batches, per-batch augmentation",
  "rows_no_augment": "rows, no augmentation",
  "rows_per_batch": "rows, per-batch augmentation",
  "rows_per_example_0w": "rows, per-example augmentation, no workers",
  "rows_per_example_1w": "the same with 1 worker process",
  "rows_per_example_2w": "the same with 2 worker processes",
}


def input_pipeline_machine(runs: dict[str, Any]) -> str:
  """Each run: its command, and the training it timed."""
  header = ["batch in", "command", "measured", "machine", "jax", "steps"]
  header += ["batch (micro-batches)", "test accuracy", "final loss", "steps/s"]
  rows = [
    [
      f"`{placement}`",
      f"`{r['command']}`",
      date(r["date"]),
      r["machine"],
      r["jax"],
      r["steps"],
      f"{r['batch_size']} ({r['num_micro_batches']})",
      f"{r['test_accuracy']:.3f}",
      f"{r['final_loss']:.4f}",
      f"{r['train_steps_per_s']:.0f}",
    ]
    for placement, r in runs.items()
  ]
  return table(header, rows)


def input_pipeline_steps(runs: dict[str, Any]) -> str:
  placements = list(runs)
  rows = []
  for key, label in PIPELINE_STEPS.items():
    if not all(key in r["steps_per_s"] for r in runs.values()):
      continue
    rows.append([label, *(f"{r['steps_per_s'][key]:.0f}" for r in runs.values())])
  header = ["fed from", *(f"steps/s, batch in `{p}` memory" for p in placements)]
  return table(header, rows)


def input_pipeline_alone(runs: dict[str, Any]) -> str:
  placements = list(runs)
  rows = []
  for key, label in PIPELINE_ALONE.items():
    if not all(key in r["batches_per_s"] for r in runs.values()):
      continue
    rows.append(
      [
        label,
        *(f"{r['batches_per_s'][key]:,.0f}" for r in runs.values()),
        *(f"{1e3 * r['first_batch_s'][key]:,.0f}" for r in runs.values()),
      ]
    )
  header = [
    "pipeline alone",
    *(f"batches/s ({p} run)" for p in placements),
    *(f"ms to the first batch ({p} run)" for p in placements),
  ]
  return table(header, rows)


# ---------------------------------------------------------------- autopilot


def autopilot_table(results: dict[str, Any]) -> str:
  parts = [
    f"Run on {results.get('date', '?')} ({results.get('machine', '?')}, "
    f"{results.get('backend', '?')} backend), jax {results.get('jax', '?')}, seeds "
    f"{', '.join(map(str, results.get('seeds', [])))}:"
  ]
  for task, result in results["tasks"].items():
    unit = result.get("token_unit", "tokens")
    rows = [
      [
        f"`{name}`",
        f"{r['final_loss_mean']:.4f} ± {r['final_loss_std']:.4f}",
        count(r["optimizer_steps"]),
        count(r["tokens"]),
      ]
      for name, r in result["runs"].items()
    ]
    parts.append(
      f"**{task}**:\n\n"
      + table(["run", "held-out loss", "optimizer steps", unit], rows)
    )
  goals = [(task, r["goal"]) for task, r in results["tasks"].items() if r.get("goal")]
  parts.append(
    columns(
      goals,
      {
        "task": lambda x: x[0],
        "loss − `fixed_small`'s": lambda x: f"{x[1]['loss_gap_to_small']:+.4f}",
        "tolerance": lambda x: f"{x[1]['loss_tolerance']:.4f}",
        "steps ÷ `fixed_small`'s": lambda x: f"{x[1]['steps_ratio']:.2f}",
        "target": lambda x: f"≤ {x[1]['steps_ratio_target']:g}",
        "beats `fixed_large`": lambda x: yes(x[1]["beats_fixed_large"]),
        "beats `hand_ramp`": lambda x: yes(x[1]["beats_hand_ramp"]),
        "goal": lambda x: met(x[1]["met"]),
      },
    )
  )
  parts.append(
    "![held-out loss against tokens and steps, and k](results/autopilot.png)"
  )
  return "\n\n".join(parts)


def yes(ok: bool) -> str:
  return "yes" if ok else "no"


def autopilot_summary(results: dict[str, Any]) -> str:
  rows = [
    [
      task,
      f"{result['runs']['autopilot']['final_loss_mean']:.3f}",
      f"{result['runs']['fixed_small']['final_loss_mean']:.3f}",
      f"{result['goal']['steps_ratio']:.2f}",
      result.get("token_unit", "tokens"),
    ]
    for task, result in results["tasks"].items()
    if result.get("goal")
  ]
  header = ["task", "autopilot: held-out loss", "small fixed batch: held-out loss"]
  header += ["autopilot's optimizer steps ÷ the small batch's", "at equal"]
  return (
    "The autopilot against the small fixed batch, "
    f"{len(results.get('seeds', []))} seeds each, from `examples/autopilot.py`:\n\n"
    + table(header, rows)
    + "\n\n![held-out loss against tokens and steps, and k for each schedule]"
    "(../benchmarks/results/autopilot.png)"
    + "\n\nThe four schedules, how they are compared and the goal each "
    "run is held to: "
    "[benchmarks/README.md](../benchmarks/README.md#the-batch-size-autopilot-examplesautopilotpy)."
  )


# ---------------------------------------------------------------- DP language model


def dp_lm_result(r: dict[str, Any]) -> str:
  s, h, load = r["settings"], r["held_out"], r["load_average"]
  args = [a for a in r.get("argv") or [] if a != "--write-results"]
  run = columns(
    [r],
    {
      "measured": lambda r: (
        f"`{' '.join(['python examples/dp_lm.py', *args])}`, {date(r['date'])}"
      ),
      "machine": lambda r: f"{r['machine']}, jax {r['jax']}",
      "s (CPU s)": lambda r: f"{r['seconds']:.0f} ({r['cpu_seconds']:.0f})",
      "load average": lambda r: f"{load[0]:.0f} to {load[1]:.0f}",
      "parameters": lambda r: (
        f"{count(s['parameters'])} ({s['layers']} × {s['width']}, {s['heads']} heads)"
      ),
      "sequences": lambda r: f"{count(r['train_sequences'])} of ≤ {s['seq_len']}",
      "steps × draw": lambda r: (
        f"{s['steps']} × {s['expected_batch_size']} "
        f"(q = {r['sampling_rate']:.4f}, padded to {r['max_batch_size']} = "
        f"{s['num_micro_batches']} micro-batches)"
      ),
      "σ, C, Adam": lambda r: (
        f"{s['noise_multiplier']:g}, {s['clip_norm']:g}, {s['learning_rate']:g}"
      ),
      "ε at δ (RDP)": lambda r: (
        f"{r['epsilon']:.2f} at {r['delta']:g} ({r['epsilon_rdp']:.2f})"
      ),
      "ghost vs vmap": lambda r: f"{r['ghost_check']:.1e}",
    },
  )
  rows = [
    [label, f"{h[key]['loss']:.3f}", f"{h[key]['accuracy']:.3f}"]
    for key, label in [
      ("initial", "the initial model"),
      ("unigram", "unigram: the training text's character frequencies"),
      ("dp", f"DP-SGD, ε = {r['epsilon']:.2f} at δ = {r['delta']:g}"),
      ("plain", "the same model without privacy"),
    ]
  ]
  held_out = (
    f"held out: {count(r['held_out_characters'])} characters of "
    f"{count(r['held_out_sequences'])} sequences"
  )
  curve = r["curve"]
  along = table(
    ["step", *map(str, curve["step"])],
    [
      ["DP-SGD", *(f"{x:.2f}" for x in curve["dp"])],
      ["non-private", *(f"{x:.2f}" for x in curve["plain"])],
    ],
  )
  header = [held_out, "loss (nats per character)", "next-character accuracy"]
  return "\n\n".join([run, table(header, rows), along])


# ---------------------------------------------------------------- FP8 language model


FP8_RUNS = {"fp8": "FP8 dense layers", "bf16": "bfloat16 dense layers"}


def fp8_lm_result(r: dict[str, Any]) -> str:
  """The FP8 run's loss curve beside the bfloat16 run's, every tenth of it."""
  s, curves = r["settings"], r["curves"]
  args = [a for a in r.get("argv") or [] if a != "--write-results"]
  steps = len(curves["fp8"])
  at = sorted({*range(0, steps, max(steps // 10, 1)), steps - 1})
  run = (
    f"`{' '.join(['python examples/fp8_lm.py', *args])}`, {date(r['date'])}, "
    f"jax {r['jax']}, {r['seconds']:.0f} s; k = {s['num_micro_batches']}, "
    f"{s['batch_size']} sequences of {s['seq_len']} per step; FP8 metadata "
    f"against the full batch's at every step: {r['metadata_deviation']:.1e} "
    "(relative, at most)"
  )
  curve = table(
    ["step", *(str(i + 1) for i in at)],
    [[name, *(f"{curves[key][i]:.3f}" for i in at)] for key, name in FP8_RUNS.items()],
  )
  return f"{run}\n\n{curve}"


#: The blocks written from the examples' JSON, by name (for ``_report.py``).
BLOCKS = {
  "input_pipeline machine": input_pipeline_machine,
  "input_pipeline steps": input_pipeline_steps,
  "input_pipeline alone": input_pipeline_alone,
  "autopilot table": autopilot_table,
  "autopilot summary": autopilot_summary,
  "dp_lm result": dp_lm_result,
  "fp8_lm result": fp8_lm_result,
}
