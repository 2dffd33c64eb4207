"""The generated blocks of the three measurements whose scripts live in
``examples/``: ``examples/input_pipeline.py`` (``input_pipeline_device.json``
and ``input_pipeline_pinned_host.json``), ``examples/autopilot.py``
(``autopilot.json``) and ``examples/dp_lm.py`` (``dp_lm.json``, shown in
``examples/README.md``).

Every other benchmark writes its blocks next to the code that measures them
(its ``BLOCKS``); these wait here until the examples carry theirs, so
that ``_report.py`` itself writes no prose about a benchmark.
"""

# The manual's blocks use its typography: multiplication signs.
# ruff: noqa: RUF001

from __future__ import annotations

from typing import Any

from _report import count, date, met, table

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
    f"{', '.join(map(str, results.get('seeds', [])))}: the held-out loss after the "
    "whole budget (mean ± standard deviation over the seeds)."
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
    text = f"**{task}**:\n\n" + table(
      ["run", "held-out loss", "optimizer steps", unit], rows
    )
    g = result.get("goal")
    if g:
      text += (
        "\n\nThe autopilot against `fixed_small`: loss "
        f"{g['loss_gap_to_small']:+.4f} (tolerance {g['loss_tolerance']:.4f}), "
        f"{g['steps_ratio']:.2f} × its optimizer steps (target at most "
        f"{g['steps_ratio_target']:g}); it "
        + ("beats" if g["beats_fixed_large"] else "does not beat")
        + " `fixed_large` and "
        + ("beats" if g["beats_hand_ramp"] else "does not beat")
        + " `hand_ramp`. The goal (both within the tolerance and the steps "
        "target) is " + met(g["met"]) + "."
      )
    parts.append(text)
  parts.append(
    "![held-out loss against tokens and steps, and k](results/autopilot.png)"
  )
  return "\n\n".join(parts)


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
  s, h = r["settings"], r["held_out"]
  args = [a for a in r.get("argv") or [] if a != "--write-results"]
  command = " ".join(["python examples/dp_lm.py", *args])
  rows = [
    [label, f"{h[key]['loss']:.3f}", f"{h[key]['accuracy']:.3f}"]
    for key, label in [
      ("initial", "the initial model"),
      ("unigram", "unigram: the training text's character frequencies"),
      ("dp", f"DP-SGD, ε = {r['epsilon']:.2f} at δ = {r['delta']:g}"),
      ("plain", "the same model without privacy"),
    ]
  ]
  curve = r["curve"]
  steps = ", ".join(
    f"{step}: {dp:.2f} / {plain:.2f}"
    for step, dp, plain in zip(curve["step"], curve["dp"], curve["plain"], strict=True)
  )
  return (
    f"Measured by `{command}` on {date(r['date'])}, a {r['machine']}, jax "
    f"{r['jax']}, in {r['seconds']:.0f} s ({r['cpu_seconds']:.0f} s of CPU; the "
    f"machine was shared, load average {r['load_average'][0]:.0f} at the start "
    f"and {r['load_average'][1]:.0f} at the end): {count(s['parameters'])} parameters "
    f"({s['layers']} blocks of width {s['width']}, {s['heads']} heads), "
    f"{count(r['train_sequences'])} training sequences of at most {s['seq_len']} "
    f"characters, {s['steps']} steps of Poisson draws of "
    f"{s['expected_batch_size']} sequences on average (q = "
    f"{r['sampling_rate']:.4f}, padded to {r['max_batch_size']} = "
    f"{s['num_micro_batches']} micro-batches), σ = {s['noise_multiplier']:g}, "
    f"C = {s['clip_norm']:g}, Adam at {s['learning_rate']:g} in both runs. Epsilon "
    f"{r['epsilon']:.2f} at δ = {r['delta']:g} is dp-accounting's PLD accountant "
    f"(the RDP bound: {r['epsilon_rdp']:.2f}); ghost clipping's clipped sum was "
    f"{r['ghost_check']:.1e} (relative) from per-example clipping's on the first "
    "draw.\n\n"
    + table(
      [
        f"held out: {count(r['held_out_characters'])} characters of "
        f"{count(r['held_out_sequences'])} sequences",
        "loss (nats per character)",
        "next-character accuracy",
      ],
      rows,
    )
    + f"\n\nHeld-out loss along the way, DP-SGD / non-private, by step: {steps}."
  )


#: The generated blocks this file writes from ``input_pipeline_*.json``,
#: ``autopilot.json`` and ``dp_lm.json``, by name (``_report.py`` puts each on its page).
BLOCKS = {
  "input_pipeline machine": input_pipeline_machine,
  "input_pipeline steps": input_pipeline_steps,
  "input_pipeline alone": input_pipeline_alone,
  "autopilot table": autopilot_table,
  "autopilot summary": autopilot_summary,
  "dp_lm result": dp_lm_result,
}
