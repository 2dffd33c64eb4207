"""Inspection: compiled HLO read (collectives, loops, the agreement of
devices' decisions), compile-time memory and the planner, compile-only
accelerator targets, and ``verify_equivalence``."""
