"""The rules of ``jaxaccum._inspect.agreement``, one at a time, on HLO text written by
hand: which values differ between devices, along which mesh axes.

Every program here runs on a (2, 4) mesh of axes ``data`` and ``model``
(partition ``p`` at coordinates ``divmod(p, 4)``) and returns one scalar whose
taint is read back as the ``output`` divergence of a replicated output, or
decides a conditional. ``tests/test_agreement.py`` runs the analysis on the
HLO that XLA compiles for jaxaccum's steps.
"""

import numpy as np
import pytest

from jaxaccum._inspect import agreement as _agreement

SHAPE, NAMES = (2, 4), ("data", "model")


def differs(body: str, *, inputs=None) -> tuple[str, ...]:
  """The axes along which the ENTRY's scalar result may differ."""
  text = f"ENTRY %main (p: f32[8]) -> f32[] {{\n{body}\n}}"
  found = _agreement.divergences(
    text, SHAPE, NAMES, input_axes=inputs, output_axes=[frozenset()]
  )
  (only,) = [d for d in found if d.kind == "output"] or [None]
  return () if only is None else only.axes


def test_a_parameter_differs_along_the_axes_it_is_sharded_over():
  sharded = "  ROOT %p = f32[4]{0} parameter(0), sharding={devices=[2,1,4]<=[8] last_tile_dim_replicate}"
  assert differs(sharded) == ("data",)
  replicated = "  ROOT %p = f32[8]{0} parameter(0), sharding={replicated}"
  assert differs(replicated) == ()


def test_the_programs_input_shardings_win_over_a_missing_annotation():
  body = "  ROOT %p = f32[8]{0} parameter(0)"
  assert differs(body) == ("data", "model")  # unknown: anything may differ
  assert differs(body, inputs=[frozenset({1})]) == ("model",)
  assert differs(body, inputs=[frozenset()]) == ()


@pytest.mark.parametrize(
  ("sharding", "axes"),
  [
    ("{devices=[4,2]<=[2,4]T(1,0) last_tile_dim_replicate}", frozenset({1})),
    ("{devices=[2,4]0,1,2,3,4,5,6,7}", frozenset({0, 1})),
    ("{devices=[1,2,4]<=[8] last_tile_dims={replicated}}", frozenset({0})),
    ("{devices=[2,1,4]<=[8] last_tile_dims={manual}}", frozenset({0, 1})),
    ("{maximal device=0}", frozenset()),
    ("{manual}", frozenset({0, 1})),
    # The replicated subgroup is the last of two: only "data" tiles.
    ("{devices=[1,2,4]<=[8] last_tile_dims={manual, replicated}}", frozenset({0})),
    # A tuple's shardings, element by element.
    ("{{replicated}, {devices=[8]<=[8]}}", (frozenset(), frozenset({0, 1}))),
  ],
)
def test_sharding_forms(sharding, axes):
  # mutmut: _agreement.sharding_taint
  assert _agreement.sharding_taint(sharding, _agreement.Grid(SHAPE, NAMES)) == axes


def test_on_one_device_a_value_without_a_sharding_agrees():
  # mutmut: _agreement.sharding_taint
  assert (
    _agreement.sharding_taint(None, _agreement.Grid((1,), ("data",))) == frozenset()
  )
  assert _agreement.sharding_taint(None, _agreement.Grid(SHAPE, NAMES)) == frozenset(
    {0, 1}
  )


def test_device_ids_differ_but_an_offset_table_is_evaluated_per_device():
  """A table lookup by partition-id whose entries repeat along ``data``
  differs along ``model`` only (the partitioner's dynamic-slice offsets)."""
  table = "  %t = s32[8]{0} constant({0, 1, 2, 3, 0, 1, 2, 3})"
  body = f"""  %pid = u32[] partition-id()
{table}
  %off = s32[1]{{0}} dynamic-slice(%t, %pid), dynamic_slice_sizes={{1}}
  ROOT %r = s32[] reshape(%off)"""
  assert differs(body) == ("model",)
  assert differs("  ROOT %pid = u32[] partition-id()") == ("data", "model")
  assert differs("  ROOT %r = u32[] replica-id()") == ()


@pytest.mark.parametrize(
  ("choice", "axes"),
  [
    # The same constant either way: a device-dependent predicate decides nothing.
    ("select(%first, %seven, %seven)", ()),
    ("select(%first, %seven, %zero)", ("data",)),
    # A predicate true everywhere picks its first operand, which varies.
    ("select(%yes, %col, %zero)", ("model",)),
    ("select(%yes, %zero, %col)", ()),
    # clamp(lo, x, hi): the model coordinate clamped to [0, 1], or to [1, 1].
    ("clamp(%zero, %col, %one)", ("model",)),
    ("clamp(%one, %col, %one)", ()),
  ],
)
def test_choices_on_device_ids_are_evaluated(choice, axes):
  # mutmut: _agreement._choice
  body = f"""  %pid = s32[] partition-id()
  %four = s32[] constant(4)
  %row = s32[] divide(%pid, %four)
  %col = s32[] remainder(%pid, %four)
  %zero = s32[] constant(0)
  %one = s32[] constant(1)
  %seven = s32[] constant(7)
  %first = pred[] compare(%row, %zero), direction=EQ
  %yes = pred[] constant(true)
  ROOT %r = s32[] {choice}"""
  assert differs(body) == axes


def test_a_table_lookup_clamps_its_index_as_dynamic_slice_does():
  """Indices past the table's end read its last entry (XLA clamps a
  dynamic-slice's start): devices 3 to 7 read 9, devices 0 to 2 read 5."""
  # mutmut: _agreement._lookup
  body = """  %pid = u32[] partition-id()
  %t = s32[4]{0} constant({5, 5, 5, 9})
  %off = s32[1]{0} dynamic-slice(%t, %pid), dynamic_slice_sizes={1}
  ROOT %r = s32[] reshape(%off)"""
  assert differs(body) == ("data", "model")
  same = body.replace("{5, 5, 5, 9}", "{5, 5, 5, 5}")
  assert differs(same) == ()
  # A negative start reads the first entry: devices 0 to 4 read 5.
  below = """  %pid = s32[] partition-id()
  %four = s32[] constant(4)
  %i = s32[] subtract(%pid, %four)
  %t = s32[4]{0} constant({5, 5, 5, 9})
  %off = s32[1]{0} dynamic-slice(%t, %i), dynamic_slice_sizes={1}
  ROOT %r = s32[] reshape(%off)"""
  assert differs(below) == ("data", "model")


@pytest.mark.parametrize(
  ("root", "axes"),
  [
    # Evaluated through a conversion: the row minus itself, zero everywhere.
    ("subtract(%converted, %row)", ()),
    ("subtract(%reshaped, %row)", ()),
    # -row + row is zero everywhere; +row + row would not be.
    ("add(%minus, %row)", ()),
    # A division by zero is not evaluated: the device ids' taint stays.
    ("divide(%pid, %zero)", ("data", "model")),
  ],
)
def test_unary_ops_and_divisions_of_device_ids(root, axes):
  # mutmut: _agreement._elementwise
  body = f"""  %pid = s32[] partition-id()
  %zero = s32[] constant(0)
  %four = s32[] constant(4)
  %row = s32[] divide(%pid, %four)
  %minus = s32[] negate(%row)
  %converted = s32[] convert(%row)
  %reshaped = s32[] reshape(%row)
  ROOT %r = s32[] {root}"""
  assert differs(body) == axes


def test_arithmetic_on_device_ids_is_evaluated():
  body = """  %pid = u32[] partition-id()
  %four = u32[] constant(4)
  ROOT %row = u32[] divide(%pid, %four)"""
  assert differs(body) == ("data",)  # p // 4 is the data coordinate
  body = """  %pid = u32[] partition-id()
  %four = u32[] constant(4)
  ROOT %col = u32[] remainder(%pid, %four)"""
  assert differs(body) == ("model",)


SHARDED = "  %p = f32[1]{0} parameter(0), sharding={devices=[8]<=[8]}\n"


@pytest.mark.parametrize(
  ("groups", "axes"),
  [
    ("replica_groups={}", ()),  # one group of all: the same everywhere
    ("replica_groups=[1,8]<=[8]", ()),
    ("replica_groups=[2,4]<=[8]", ("data",)),  # groups along model
    ("replica_groups=[4,2]<=[2,4]T(1,0)", ("model",)),  # groups along data
    ("replica_groups={{0,1,2,3},{4,5,6,7}}", ("data",)),
    ("replica_groups=mesh['data'=2,'model'=4] {'data'}", ("model",)),
  ],
)
def test_an_all_reduce_agrees_within_its_groups(groups, axes):
  body = (
    SHARDED
    + f"  ROOT %r = f32[1]{{0}} all-reduce(%p), channel_id=1, {groups}, use_global_device_ids=true, to_apply=%add"
  )
  assert differs(body) == axes


def test_an_all_reduce_without_a_channel_stays_within_each_partition():
  body = (
    SHARDED + "  ROOT %r = f32[1]{0} all-reduce(%p), replica_groups={}, to_apply=%add"
  )
  assert differs(body) == ("data", "model")


def test_splitting_collectives_make_values_differ_along_their_groups():
  replicated = "  %p = f32[8]{0} parameter(0), sharding={replicated}\n"
  scatter = (
    replicated
    + "  ROOT %r = f32[2]{0} reduce-scatter(%p), channel_id=1, replica_groups=[2,4]<=[8], use_global_device_ids=true, dimensions={0}, to_apply=%add"
  )
  assert differs(scatter) == ("model",)
  permute = (
    replicated
    + "  ROOT %r = f32[8]{0} collective-permute(%p), channel_id=1, source_target_pairs={{0,4},{4,0}}"
  )
  assert differs(permute) == ("data",)
  gather = (
    SHARDED
    + "  ROOT %r = f32[8]{0} all-gather(%p), channel_id=1, replica_groups=[1,8]<=[8], use_global_device_ids=true, dimensions={0}"
  )
  assert differs(gather) == ()


def test_tuples_keep_their_elements_apart():
  body = """  %a = f32[8]{0} parameter(0), sharding={replicated}
  %b = f32[1]{0} parameter(1), sharding={devices=[8]<=[8]}
  %t = (f32[8]{0}, f32[1]{0}) tuple(%a, %b)
  %o = (f32[8]{0}, f32[1]{0}) opt-barrier(%t)
  ROOT %g = f32[8]{0} get-tuple-element(%o), index=0"""
  assert differs(body) == ()
  assert differs(body.replace("index=0", "index=1")) == ("data", "model")


LOOP = """%body (c: (s32[], f32[])) -> (s32[], f32[]) {
  %c = (s32[], f32[]) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %x = f32[] get-tuple-element(%c), index=1
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  %pid = u32[] partition-id()
  %f = f32[] convert(%pid)
  %y = f32[] add(%x, %f)
  ROOT %n = (s32[], f32[]) tuple(%j, %y)
}

%cond (c: (s32[], f32[])) -> pred[] {
  %c = (s32[], f32[]) parameter(0)
  %i = s32[] get-tuple-element(%c), index=%INDEX%
  %k = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %k), direction=LT
}
"""


@pytest.mark.parametrize(
  ("index", "decided"), [(0, []), (1, [("while", ("data", "model"))])]
)
def test_a_loop_carries_what_its_body_makes_differ(index, decided):
  """The carry's second element picks up the device id in the body (a fixed
  point over iterations); a condition on the counter agrees, one on that
  element does not."""
  text = (
    LOOP.replace("%INDEX%", str(index))
    + """
ENTRY %main () -> f32[] {
  %zero = s32[] constant(0)
  %x = f32[] constant(0)
  %t = (s32[], f32[]) tuple(%zero, %x)
  %w = (s32[], f32[]) while(%t), condition=%cond, body=%body
  ROOT %r = f32[] get-tuple-element(%w), index=1
}"""
  )
  found = _agreement.divergences(text, SHAPE, NAMES, output_axes=[frozenset()])
  assert [(d.kind, d.axes) for d in found if d.kind != "output"] == decided
  assert [(d.kind, d.axes) for d in found if d.kind == "output"] == [
    ("output", ("data", "model"))
  ]


def test_a_conditional_on_a_differing_value_is_reported_and_taints_its_result():
  text = """%yes (a: f32[]) -> f32[] {
  ROOT %a = f32[] parameter(0)
}

%no (a: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  ROOT %z = f32[] negate(%a)
}

ENTRY %main (p: f32[1]) -> f32[] {
  %p = f32[1]{0} parameter(0), sharding={devices=[2,1,4]<=[8] last_tile_dim_replicate}
  %s = f32[] reshape(%p)
  %zero = f32[] constant(0)
  %c = pred[] compare(%s, %zero), direction=GT
  %one = f32[] constant(1)
  ROOT %r = f32[] conditional(%c, %one, %one), true_computation=%yes, false_computation=%no
}"""
  found = _agreement.divergences(text, SHAPE, NAMES, output_axes=[frozenset()])
  assert sorted((d.kind, d.instruction, d.axes) for d in found) == [
    ("conditional", "r", ("data",)),
    ("output", "output 0", ("data",)),
  ]
  # Checking the model axis only finds nothing: the value agrees along it.
  assert (
    _agreement.divergences(
      text, SHAPE, NAMES, output_axes=[frozenset()], checked=["model"]
    )
    == []
  )


BRANCHES = """%keep (a: f32[]) -> f32[] {
  ROOT %a = f32[] parameter(0)
}

%fixed (a: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  ROOT %z = f32[] constant(0)
}

"""


@pytest.mark.parametrize(
  ("operands", "branches", "axes"),
  [
    # The true branch returns its argument: a value sharded over data.
    ("%sharded, %same", ("keep", "fixed"), ("data",)),
    # The false branch gets the sharded value and drops it.
    ("%same, %sharded", ("keep", "fixed"), ()),
    # The false branch gets the sharded value and returns it.
    ("%same, %sharded", ("fixed", "keep"), ("data",)),
  ],
)
def test_a_conditional_on_an_agreed_predicate_returns_what_its_branches_return(
  operands, branches, axes
):
  """Branch n gets operand n + 1; the result differs where a branch's
  result does, the predicate being the same on every device."""
  # mutmut: _hlo.Instruction.branches, _agreement._Analysis._conditional
  text = (
    BRANCHES
    + f"""ENTRY %main (p: f32[1]) -> f32[] {{
  %p = f32[1]{{0}} parameter(0), sharding={{devices=[2,1,4]<=[8] last_tile_dim_replicate}}
  %sharded = f32[] reshape(%p)
  %same = f32[] constant(1)
  %c = pred[] constant(true)
  ROOT %r = f32[] conditional(%c, {operands}), true_computation=%{branches[0]}, false_computation=%{branches[1]}
}}"""
  )
  found = _agreement.divergences(text, SHAPE, NAMES, output_axes=[frozenset()])
  assert [(d.kind, d.axes) for d in found] == ([("output", axes)] if axes else [])


def test_an_n_way_conditional_follows_each_branch():
  """``branch_computations={...}`` with an index: branch 1 returns the
  argument sharded over model; the others a constant."""
  # mutmut: _hlo.Instruction.branches
  text = (
    BRANCHES
    + """ENTRY %main (p: f32[1]) -> f32[] {
  %p = f32[1]{0} parameter(0), sharding={devices=[4,2]<=[2,4]T(1,0) last_tile_dim_replicate}
  %sharded = f32[] reshape(%p)
  %same = f32[] constant(1)
  %i = s32[] constant(2)
  ROOT %r = f32[] conditional(%i, %same, %sharded, %same), branch_computations={%fixed, %keep, %fixed}
}"""
  )
  found = _agreement.divergences(text, SHAPE, NAMES, output_axes=[frozenset()])
  assert [(d.kind, d.axes) for d in found] == [("output", ("model",))]


def test_fusions_are_followed_into_their_computation():
  """A device id inside a fusion is found there (the partitioner hides
  offsets in fusions)."""
  text = """%fused (x: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %pid = u32[] partition-id()
  %f = f32[] convert(%pid)
  ROOT %y = f32[] add(%x, %f)
}

ENTRY %main () -> f32[] {
  %zero = f32[] constant(0)
  ROOT %r = f32[] fusion(%zero), kind=kLoop, calls=%fused
}"""
  found = _agreement.divergences(text, SHAPE, NAMES, output_axes=[frozenset({0, 1})])
  assert found == []  # sharded over both axes: it may differ
  found = _agreement.divergences(text, SHAPE, NAMES, output_axes=[frozenset({0})])
  assert [(d.kind, d.axes) for d in found] == [("output", ("model",))]


def test_bad_arguments_are_clear_errors():
  text = "ENTRY %main () -> f32[] {\n  ROOT %c = f32[] constant(0)\n}"
  with pytest.raises(ValueError) as caught:
    _agreement.divergences(text, SHAPE, NAMES, checked=["pipeline"])
  assert (
    str(caught.value)
    == "Unknown mesh axes ['pipeline']; the mesh has ('data', 'model')."
  )
  with pytest.raises(ValueError) as caught:
    _agreement.divergences(text, SHAPE, NAMES, output_axes=[frozenset(), frozenset()])
  assert (
    str(caught.value) == "The program has 1 outputs, but 2 output shardings were given."
  )


def test_the_grid_reads_differences_per_axis():
  grid = _agreement.Grid(SHAPE, NAMES)
  assert grid.differs(np.zeros(8)) == frozenset()
  assert grid.differs(np.arange(8) // 4) == frozenset({0})
  assert grid.differs(np.arange(8)) == frozenset({0, 1})
  assert grid.spanned(None) == frozenset()
  assert grid.spanned(((0, 1), (2, 3), (4, 5), (6, 7))) == frozenset()  # half lines
