"""``jaxaccum._inspect.hlo``, the one reader of XLA's HLO text, on programs written
by hand: which collectives a step runs, how many bytes each delivers and how
often it runs per call.

``jaxaccum.testing`` re-exports ``collectives`` and ``bytes_communicated``;
the structure tests (``test_parallel.py``, ``test_meshes.py``,
``test_targets.py``) read compiled steps with them, so a miscount here
would pass or fail those for the wrong reason.
"""

import pytest

from jaxaccum import testing
from jaxaccum._inspect import hlo as _hlo

ADD = """%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
"""


def found(text):
  return [
    (c.op, c.computation, c.bytes, c.executions, c.in_loop)
    for c in _hlo.collectives(text)
  ]


@pytest.mark.parametrize(
  ("type_text", "size"),
  [
    ("f32[4,8]{1,0}", 128),
    ("bf16[3]{0}", 6),
    ("pred[5]{0}", 5),
    ("s8[2,2]{1,0}", 4),
    ("u32[]", 4),
    ("f64[2]{0}", 16),
    ("c64[2]{0}", 16),
    ("f8e4m3fn[8]{0}", 8),
    ("(f32[2]{0}, (bf16[4]{0}, s32[]))", 8 + 8 + 4),
    ("token[]", 0),  # no bytes on the wire
    ("(token[], f32[2]{0})", 8),
  ],
)
def test_the_bytes_of_an_hlo_type(type_text, size):
  # mutmut: _hlo._shape_bytes
  assert _hlo._shape_bytes(type_text) == size


def test_a_tuple_type_splits_at_its_top_level_only():
  # mutmut: _hlo._top_level
  assert _hlo._top_level("(f32[2,3]{1,0}, (s32[], u32[]), bf16[4]{0})") == [
    "f32[2,3]{1,0}",
    "(s32[], u32[])",
    "bf16[4]{0}",
  ]
  assert _hlo._top_level("  f32[2]{0} ") == ["f32[2]{0}"]
  assert _hlo._top_level("()") == []
  assert _hlo._top_level("(f32[2]{0},s32[])") == ["f32[2]{0}", "s32[]"]


@pytest.mark.parametrize(
  ("op", "type_text", "size"),
  [
    # Asynchronous starts return (inputs, outputs): only the outputs count.
    ("all-gather-start", "(f32[8]{0}, f32[64]{0})", 256),
    ("all-gather-start", "((f32[8]{0}, bf16[8]{0}), (f32[64]{0}, bf16[64]{0}))", 384),
    ("reduce-scatter-start", "(f32[64]{0}, f32[8]{0})", 32),
    ("all-to-all-start", "(f32[16]{0}, f32[16]{0})", 64),
    # A permute's output is its second element, on the GPU and on the TPU.
    ("collective-permute-start", "(f32[1024]{0}, f32[1024]{0})", 4096),
    ("collective-permute-start", "(f32[1024]{0}, f32[512]{0}, u32[], u32[])", 2048),
    # Synchronous collectives: the result.
    ("all-reduce", "f32[10]{0}", 40),
    ("all-reduce-start", "bf16[10]{0}", 20),
    ("all-gather", "(f32[8]{0}, f32[8]{0})", 64),
  ],
)
def test_a_collective_counts_the_bytes_it_delivers(op, type_text, size):
  # mutmut: _hlo._result_bytes
  assert _hlo._result_bytes(op, type_text) == size


NESTED = (
  ADD
  + """%inner_body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %ar = f32[8]{0} all-reduce(%x), channel_id=1, replica_groups={{0,1},{2,3}}, to_apply=%add
  ROOT %t = (s32[], f32[8]) tuple(%i, %ar)
}

%inner_cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%outer_body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %w = (s32[], f32[8]) while(%p), condition=%inner_cond, body=%inner_body
  %x = f32[8]{0} get-tuple-element(%w), index=1
  %g = f32[32]{0} all-gather(%x), channel_id=2, replica_groups=[1,4]<=[4], dimensions={0}
  ROOT %t = (s32[], f32[8]) tuple(%i, %x)
}

%outer_cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %w = (s32[], f32[8]) while(%t), condition=%outer_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"4"}}
  %r = f32[8]{0} all-reduce(%a), channel_id=3, replica_groups={}, to_apply=%add
  ROOT %x = f32[8]{0} get-tuple-element(%w), index=1
}
"""
)


def test_loops_multiply_their_trip_counts_from_the_backend_or_the_condition():
  """The outer loop's count comes from XLA's backend config (4), the inner
  one's from its condition, ``counter < 3`` (the TPU's form): the inner
  all-reduce runs 12 times per call, the outer all-gather 4 times. They are
  listed in the order the walk meets them."""
  # mutmut: _hlo.collectives
  assert found(NESTED) == [
    ("all-reduce", "inner_body", 32, 12, True),
    ("all-gather", "outer_body", 128, 4, True),
    ("all-reduce", "main", 32, 1, False),
  ]
  assert testing.bytes_communicated(NESTED) == 32 * 12 + 128 * 4 + 32
  groups = [c.groups for c in _hlo.collectives(NESTED)]
  assert groups == [((0, 1), (2, 3)), ((0, 1, 2, 3),), ()]


def test_loops_are_listed_where_they_run_with_their_trip_counts():
  """Every while loop once per place it runs: the outer one (4 trips, from
  the backend config) in the entry, the inner one (3, from its condition)
  entered 4 times; each holds the computations it calls, and each
  collective names the loops around it, outermost first."""
  # mutmut: _hlo.read, _hlo._trip_count
  assert [
    (w.name, w.computation, w.trip_count, w.executions, w.outer)
    for w in _hlo.loops(NESTED)
  ] == [("w", "main", 4, 1, ()), ("w", "outer_body", 3, 4, ("w",))]
  outer, inner = _hlo.loops(NESTED)
  assert outer.computations == {
    "outer_body",
    "outer_cond",
    "inner_body",
    "inner_cond",
    "add",
  }
  assert inner.computations == {"inner_body", "inner_cond", "add"}
  assert [c.loops for c in _hlo.collectives(NESTED)] == [("w", "w"), ("w",), ()]
  unknown = NESTED.replace(', backend_config={"known_trip_count":{"n":"4"}}', "")
  assert [w.trip_count for w in _hlo.loops(unknown)] == [None, 3]


@pytest.mark.parametrize(
  ("attributes", "groups"),
  [
    ("replica_groups={{0,2},{1,3}}, to_apply=%add", ((0, 2), (1, 3))),
    ("replica_groups=[2,2]<=[4], to_apply=%add", ((0, 1), (2, 3))),
    ("replica_groups=[2,2]<=[2,2], to_apply=%add", ((0, 1), (2, 3))),
    ("replica_groups=[2,2]<=[2,2]T(1,0), to_apply=%add", ((0, 2), (1, 3))),
    (
      "replica_groups=[2,4]<=[2,2,2]T(0,2,1), to_apply=%add",
      ((0, 2, 1, 3), (4, 6, 5, 7)),
    ),
    ("replica_groups=mesh['a'=2,'b'=2] {'b'}, dimensions={0}", ((0, 1), (2, 3))),
    ("to_apply=%add", None),
  ],
)
def test_replica_groups_in_every_form_xla_prints(attributes, groups):
  # mutmut: _hlo.replica_groups, _hlo._iota
  assert _hlo.replica_groups(attributes) == groups


@pytest.mark.parametrize(
  ("groups", "axes", "spans"),
  [
    (((0, 1), (2, 3)), [0], False),  # pairs along the second axis of (2, 2)
    (((0, 1), (2, 3)), [1], True),
    (((0, 2), (1, 3)), [0], True),
    ((), [0], True),  # replica_groups={}: one group of every device
    ((), [1], True),
    (None, [0], True),  # not listed: it may span anything
  ],
)
def test_a_collective_spans_the_axes_its_groups_cross(groups, axes, spans):
  # mutmut: _hlo.Collective.spans
  c = _hlo.Collective("all-reduce", "main", 4, 1, False, groups)
  assert c.spans((2, 2), axes) == spans


def test_a_loop_without_a_known_count_counts_once():
  # mutmut: _hlo.collectives
  text = NESTED.replace(', backend_config={"known_trip_count":{"n":"4"}}', "")
  assert [(c.op, c.executions) for c in _hlo.collectives(text)] == [
    ("all-reduce", 3),
    ("all-gather", 1),
    ("all-reduce", 1),
  ]


CALLS = (
  ADD
  + """%fused (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %ar = f32[8]{0} all-reduce(%x), channel_id=1, replica_groups={}, to_apply=%add
}

%yes (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %p = f32[8]{0} collective-permute(%x), channel_id=2, source_target_pairs={{0,1},{1,0}}
}

%no (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %g = f32[16]{0} all-gather(%x), channel_id=3, replica_groups={{0,1}}, dimensions={0}
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %f = f32[8]{0} fusion(%a), kind=kLoop, calls=%fused
  %f2 = f32[8]{0} fusion(%a), kind=kLoop, calls=%fused
  %c = pred[] constant(true)
  %two = f32[8]{0} conditional(%c, %a, %a), true_computation=%yes, false_computation=%no
  %i = s32[] constant(1)
  %s = (f32[8]{0}, f32[64]{0}) all-gather-start(%a), channel_id=4, replica_groups={}, dimensions={0}
  ROOT %n = f32[8]{0} conditional(%i, %a, %a), branch_computations={%no, %yes}
}
"""
)


def test_called_computations_are_read_at_every_call_site():
  """A fusion's computation, called twice, counts twice; both branches of a
  conditional count (either may run), in the true/false and the n-way
  forms; none of them is in a loop. An asynchronous start counts its
  output."""
  # mutmut: _hlo.collectives, _hlo._called
  assert found(CALLS) == [
    ("all-reduce", "fused", 32, 1, False),
    ("all-reduce", "fused", 32, 1, False),
    ("collective-permute", "yes", 32, 1, False),
    ("all-gather", "no", 64, 1, False),
    ("all-gather-start", "main", 256, 1, False),  # its output only
    ("all-gather", "no", 64, 1, False),
    ("collective-permute", "yes", 32, 1, False),
  ]


def test_a_computation_that_calls_itself_is_read_once():
  # mutmut: _hlo.collectives
  text = (
    ADD
    + """%loop (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %ar = f32[8]{0} all-reduce(%x), replica_groups={}, to_apply=%add
  ROOT %again = f32[8]{0} call(%ar), to_apply=%loop
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  ROOT %c = f32[8]{0} call(%a), to_apply=%loop
}
"""
  )
  assert found(text) == [("all-reduce", "loop", 32, 1, False)]
