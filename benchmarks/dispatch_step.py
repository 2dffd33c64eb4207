"""jaxaccum's step over the best peer's on the dispatch-bound configuration
of issue 46, item 8, at this checkout and at another one.

Usage::

  git worktree add /tmp/jaxaccum-030 177c210   # 0.3.0's release commit
  python benchmarks/dispatch_step.py --old /tmp/jaxaccum-030 [--cpus 0-3]

Runs ``step_time.py`` on the dispatch-bound MLP with ``B = 256``, widths
``256,256,256,10``, ``k = 16`` and momentum SGD: the full batch and its A/A
control, jaxaccum with and without its finite check, optax.microbatch and the
hand-written scan. Each checkout runs in a process of its own (``--old`` goes
first on ``PYTHONPATH``, so that its ``jaxaccum`` is the one imported), one
after the other, and writes ``<out>/<name>/step_time.json``. Then the script
prints, per run, jaxaccum's median over the best peer's, with and without the
check, and whether the run's A/A ratio decides it (within 3% of 1,
``benchmarks/README.md``, Methods). It never writes ``benchmarks/results``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Sequence

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _report import aa_decides  # noqa: E402

PEERS = ("optax_microbatch", "hand_scan")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--old", type=pathlib.Path, help="another checkout of jaxaccum to time too"
  )
  parser.add_argument(
    "--out", type=pathlib.Path, default=pathlib.Path("/tmp/jaxaccum-dispatch-step")
  )
  parser.add_argument("--widths", default="256,256,256,10")
  parser.add_argument("--k", default="16")
  parser.add_argument("--rounds", default="21")
  parser.add_argument("--min-time-ms", default="50")
  parser.add_argument("--cpus", help="passed on to step_time.py")
  return parser.parse_args(argv)


def run(args: argparse.Namespace, name: str, old: pathlib.Path | None) -> dict:
  """One ``step_time.py`` run in its own process; its JSON."""
  command = [
    sys.executable,
    str(HERE / "step_time.py"),
    "--models=dispatch_mlp",
    f"--dispatch-widths={args.widths}",
    f"--ks={args.k}",
    "--approaches=jaxaccum_no_skip," + ",".join(PEERS),
    f"--rounds={args.rounds}",
    f"--min-time-ms={args.min_time_ms}",
    f"--out={args.out / name}",
    f"--device-note=issue 46 item 8, {name}",
    "--no-plots",
    *([f"--cpus={args.cpus}"] if args.cpus else []),
  ]
  env = dict(os.environ)
  if old is not None:
    env["PYTHONPATH"] = os.pathsep.join(
      [str(old.resolve()), *filter(None, [env.get("PYTHONPATH")])]
    )
  subprocess.run(command, env=env, check=True)
  return json.loads((args.out / name / "step_time.json").read_text())


def verdict(name: str, results: dict) -> str:
  """jaxaccum's median over the best peer's, with and without the check."""
  (config,) = results["models"]["dispatch_mlp"]["configs"]
  res = {key: r["median_ms"] for key, r in config["approaches"].items()}
  best = min(PEERS, key=res.__getitem__)
  aa = config["aa_ratio"]
  decided = "decided" if aa_decides(aa) else "UNDECIDED (rerun on a quieter machine)"
  return (
    f"{name} (jaxaccum {results['machine']['jaxaccum']}): jaxaccum "
    f"{res['jaxaccum']:.4f} ms, no skip {res['jaxaccum_no_skip']:.4f} ms; best peer "
    f"{best} {res[best]:.4f} ms; jaxaccum / best peer "
    f"{res['jaxaccum'] / res[best]:.3f}, no skip / best peer "
    f"{res['jaxaccum_no_skip'] / res[best]:.3f}; A/A {aa:.3f}, {decided}"
  )


def main(argv: Sequence[str] | None = None) -> None:
  args = parse_args(argv)
  runs = {"this": run(args, "this", None)}
  if args.old is not None:
    runs["old"] = run(args, "old", args.old)
  print()
  for name, results in runs.items():
    print(verdict(name, results))


if __name__ == "__main__":
  main()
