"""Eager calls: one jitted program per static configuration.

``jax.value_and_grad`` called outside ``jit`` runs op by op and costs
little. An accumulated step called that way would trace its ``lax.scan``
again on every call, about 60 times the cost. So the public functions compile
their step with ``jax.jit`` and keep it, keyed on everything that is not an
array:

- Python values in keyword arguments (bool, int, float, str, None, tuples of
  them, or any other object) are *static*: ``fun`` sees them as Python values
  (it may branch on them or use them as shapes), and each distinct value
  compiles once. Arrays in keyword arguments are inputs of the program.
- Positional arguments follow ``jax.jit``, except those listed as
  ``static_positions``, whose non-array leaves are static too (the arguments
  that ``jax.value_and_grad`` would pass to ``fun`` untouched).
- Unhashable static values cannot key a cache: such a call compiles for
  itself.

Under an outer transformation (``jit``, ``vmap``, ``grad``) nothing is cached:
the step is traced inline, as part of the caller's program.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.experimental import checkify

PyTree = Any


def is_array(x: Any) -> bool:
  """Whether ``x`` is an array (a jax or numpy array, or a numpy scalar)."""
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


class Statics(NamedTuple):
  """A pytree without its arrays: what a compiled program is for.

  Attributes:
    treedef: the structure of the tree.
    is_array: per leaf, whether it is an array (an input of the program).
    static: per leaf, the leaf itself where it is not an array, else None.
  """

  treedef: Any
  is_array: tuple[bool, ...]
  static: tuple[Any, ...]

  def merge(self, arrays: Sequence[Any]) -> PyTree:
    """The tree, with ``arrays`` put back in their places."""
    it = iter(arrays)
    leaves = [
      next(it) if a else s for a, s in zip(self.is_array, self.static, strict=True)
    ]
    return jax.tree.unflatten(self.treedef, leaves)


def split_statics(tree: PyTree) -> tuple[Statics, list[Any]]:
  """Separates the arrays of ``tree`` from everything else.

  >>> import jax.numpy as jnp
  >>> statics, arrays = split_statics({"train": False, "scale": jnp.ones(())})
  >>> statics.static, len(arrays)
  ((None, False), 1)
  """
  leaves, treedef = jax.tree.flatten(tree)
  flags = tuple(is_array(x) for x in leaves)
  static = tuple(None if a else x for x, a in zip(leaves, flags, strict=True))
  arrays = [x for x, a in zip(leaves, flags, strict=True) if a]
  return Statics(treedef, flags, static), arrays


class Compiled:
  """``fun(config, *args, **kwargs)``, jitted once per static configuration.

  ``config`` is hashable and static (e.g. the shardings a data-parallel step
  was built for). See the module docstring for which arguments are static.

  Args:
    fun: the traced step.
    static_positions: positional arguments whose non-array leaves are static;
      a callable from the number of positional arguments to the positions.
    donate_argnums: positional arguments to donate.
    checked: run the program under ``checkify`` and raise its errors right
      after the call (``value_checks=True``).
  """

  def __init__(
    self,
    fun: Callable[..., Any],
    *,
    static_positions: Callable[[int], Sequence[int]] = lambda n: (),
    donate_argnums: Sequence[int] = (),
    checked: bool = False,
  ):
    self._fun = fun
    self._static_positions = static_positions
    self._donate = tuple(donate_argnums)
    self._checked = checked
    self._cache: dict[Any, Any] = {}

  def _prepare(self, config: Any, args: tuple[Any, ...], kwargs: dict[str, Any]):
    """The jitted program for this configuration, and its inputs.

    The program takes the traced positional arguments as ``jax.jit`` would
    (a static position holds None), keyword arguments whose leaves are all
    arrays by name, and the arrays of mixed keyword arguments in one list,
    so that a program lowered from a call (``.lower(...).compile()``) is
    called like the function, minus its static values.
    """
    positions = tuple(self._static_positions(len(args)))
    dynamic = {
      name: value
      for name, value in kwargs.items()
      if jax.tree.leaves(value) and all(map(is_array, jax.tree.leaves(value)))
    }
    rest = {name: value for name, value in kwargs.items() if name not in dynamic}
    statics, arrays = split_statics(({n: args[n] for n in positions}, rest))
    traced = tuple(None if n in positions else a for n, a in enumerate(args))
    key: Any = (config, len(args), positions, tuple(sorted(dynamic)), statics)
    try:
      jitted = self._cache.get(key)
    except TypeError:  # an unhashable static value: compile for this call
      key, jitted = None, None
    if jitted is None:
      jitted = jax.jit(
        self._program(config, positions, statics), donate_argnums=self._donate
      )
      if key is not None:
        self._cache[key] = jitted
    if arrays:
      dynamic = {**dynamic, _MIXED: arrays}
    return jitted, traced, dynamic

  def _program(self, config: Any, positions: tuple[int, ...], statics: Statics):
    fun = self._fun

    def program(*traced, **dynamic):
      static_args, kwargs = statics.merge(dynamic.pop(_MIXED, []))
      args = tuple(
        static_args[n] if n in positions else a for n, a in enumerate(traced)
      )
      return fun(config, *args, **kwargs, **dynamic)

    if not self._checked:
      return program

    def checked_program(*traced, **dynamic):
      return checkify.checkify(program, errors=checkify.user_checks)(*traced, **dynamic)

    return checked_program

  def __call__(self, config: Any, /, *args: Any, **kwargs: Any) -> Any:
    jitted, traced, dynamic = self._prepare(config, args, kwargs)
    out = jitted(*traced, **dynamic)
    if self._checked:
      error, out = out
      error.throw()
    return out

  def lower(self, config: Any, /, *args: Any, **kwargs: Any) -> Any:
    """``jax.jit(...).lower`` of the program these arguments call."""
    jitted, traced, dynamic = self._prepare(config, args, kwargs)
    return jitted.lower(*traced, **dynamic)

  def trace(self, config: Any, /, *args: Any, **kwargs: Any) -> Any:
    """``jax.jit(...).trace`` of the program these arguments call."""
    jitted, traced, dynamic = self._prepare(config, args, kwargs)
    return jitted.trace(*traced, **dynamic)


_MIXED = "_jaxaccum_keyword_arrays"


class JitWithStaticKwargs:
  """``jax.jit(fun, donate_argnums=...)``, except that Python values passed
  by keyword are static (compiled once per value) and arrays passed by
  keyword are traced. Positional arguments follow ``jax.jit``.

  >>> import jax.numpy as jnp
  >>> step = JitWithStaticKwargs(lambda x, *, train: x * 2 if train else x)
  >>> step(jnp.ones(2), train=True).tolist(), step(jnp.ones(2), train=False).tolist()
  ([2.0, 2.0], [1.0, 1.0])
  """

  def __init__(self, fun: Callable[..., Any], *, donate_argnums: Sequence[int] = ()):
    self.__wrapped__ = fun

    def without_config(_: Any, /, *args: Any, **kwargs: Any) -> Any:
      return fun(*args, **kwargs)

    self._compiled = Compiled(without_config, donate_argnums=donate_argnums)
    # A call without keyword arguments has one program per number of
    # positional arguments (its key in the cache has nothing else that can
    # differ): found here, the call skips building that key.
    self._positional: dict[int, Any] = {}

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    if kwargs:
      return self._compiled(None, *args, **kwargs)
    jitted = self._positional.get(len(args))
    if jitted is None:
      jitted, _, _ = self._compiled._prepare(None, args, kwargs)
      self._positional[len(args)] = jitted
    return jitted(*args)

  def lower(self, *args: Any, **kwargs: Any) -> Any:
    """``jax.jit(...).lower`` of the program these arguments call; its
    compiled form takes the same arguments, minus the static ones."""
    return self._compiled.lower(None, *args, **kwargs)

  def trace(self, *args: Any, **kwargs: Any) -> Any:
    """``jax.jit(...).trace`` of the program these arguments call."""
    return self._compiled.trace(None, *args, **kwargs)
