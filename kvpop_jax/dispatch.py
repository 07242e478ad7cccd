"""One dispatcher per op: an XLA reference and kernel back ends behind one signature.

Each op (`attention.kvpop_attention`, `targets.future_attention_log_mass`,
`policy.running_topk_cutoff`) is an `Op`: a small immutable mapping from a back-end name to
an implementation with the reference's signature (tokamax's `IMPLEMENTATIONS`). A call
picks its back end in this order:

  1. `implementation="..."` in the call;
  2. the op's environment variable (`KVPOP_ATTENTION_IMPL`, `KVPOP_FUTURE_LSE_IMPL`,
     `KVPOP_CUTOFF_IMPL`);
  3. the first back end of the op's `auto` order that runs on this platform, accepts the
     call (its `rejects` returns None) and is worth it here (its `preferred` is true), e.g.
     the Pallas kernel on GPU, the XLA reference elsewhere.

A back end named in 1. or 2. that cannot take the call raises, naming the reason; the
automatic choice falls through to the next one instead. Choices are static (shapes, static
arguments, platform), so they happen once per trace.
"""

from __future__ import annotations

import dataclasses
import os
from types import MappingProxyType
from typing import Any, Callable, Mapping

import jax


def _accepts_all(*args, **kwargs) -> str | None:
    del args, kwargs
    return None


def _always(*args, **kwargs) -> bool:
    del args, kwargs
    return True


@dataclasses.dataclass(frozen=True)
class Backend:
    """One implementation of an op.

    fn: the implementation, with the op's signature (minus `implementation`).
    platforms: `jax.default_backend()` names where the automatic choice may pick it
      (empty: everywhere). Naming it explicitly works on any platform (interpret modes).
    rejects: `rejects(*args, **kwargs)` -> None if the back end can take this call, else the
      reason it cannot (static: shapes and static arguments only).
    preferred: `preferred(*args, **kwargs)` -> whether the automatic choice should take it
      for this call (a cost model; a back end named explicitly runs regardless).
    """

    fn: Callable[..., Any]
    platforms: tuple[str, ...] = ()
    rejects: Callable[..., str | None] = _accepts_all
    preferred: Callable[..., bool] = _always


class Op:
    """A named op with its back ends; calling it dispatches (see the module docstring)."""

    def __init__(self, name: str, env_var: str, backends: Mapping[str, Backend], auto: tuple[str, ...]):
        unknown = [b for b in auto if b not in backends]
        if unknown:
            raise ValueError(f"{name}: auto order names unknown back ends {unknown}")
        self.name, self.env_var, self.auto = name, env_var, tuple(auto)
        self.backends = MappingProxyType(dict(backends))

    @property
    def implementations(self) -> tuple[str, ...]:
        return tuple(self.backends)

    def select(self, implementation: str | None, *args, **kwargs) -> str:
        """The back-end name a call with these arguments runs on."""
        # An empty $VAR counts as unset (shell convention); implementation="" is a mistake, named below.
        requested = implementation if implementation is not None else os.environ.get(self.env_var) or None
        if requested is not None:
            if requested not in self.backends:
                source = "implementation" if implementation is not None else f"${self.env_var}"
                raise ValueError(f"{self.name}: {source} must be one of {self.implementations}, got {requested!r}")
            reason = self.backends[requested].rejects(*args, **kwargs)
            if reason is not None:
                raise ValueError(f"{self.name}: back end {requested!r} cannot take this call: {reason}")
            return requested
        platform = jax.default_backend()
        for name in self.auto:
            backend = self.backends[name]
            if backend.platforms and platform not in backend.platforms:
                continue
            if backend.rejects(*args, **kwargs) is None and backend.preferred(*args, **kwargs):
                return name
        raise ValueError(f"{self.name}: no back end of {self.auto} takes this call on {platform}")

    def __call__(self, *args, implementation: str | None = None, **kwargs):
        return self.backends[self.select(implementation, *args, **kwargs)].fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Op({self.name!r}, backends={self.implementations}, auto={self.auto})"
