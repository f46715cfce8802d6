"""Named registries of OBLR-PO's interchangeable parts, selected by a config option (as verl's ``@register_adv_est``).

One :class:`Registry` per option: ``BASELINES`` (``OBLRPOConfig.baseline``, :mod:`oblr_trl.estimators`),
``GRAD_NORM_ESTIMATORS`` (``grad_norm_estimator``, the baseline weights, :mod:`oblr_trl.estimators`) and
``SNR_ESTIMATORS`` (``snr_estimator``, :mod:`oblr_trl.snr_formulas`). Each is a ``dict`` from name to entry, filled at
import by its ``register`` decorator, which refuses a taken name. ``OBLRPOConfig`` validates each option against its
registry, and the trainer selects the entry from it by name at call time, so an entry registered by a user is both
accepted and used.
"""

from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")


class Registry(dict):
    """Entries by name for the config option ``option`` (e.g. ``"baseline"``)."""

    def __init__(self, option: str, kind: str):
        super().__init__()
        self.option = option  # the OBLRPOConfig field that selects an entry
        self.kind = kind  # what an entry is, for messages ("baseline", "SNR estimator")

    def add(self, name: str, entry: T) -> T:
        """Register ``entry`` under ``name``; a taken name raises (an entry is never silently replaced)."""
        if name in self:
            taken = getattr(self[name], "__qualname__", repr(self[name]))
            raise ValueError(f"A {self.kind} named {name!r} is already registered ({taken}).")
        self[name] = entry
        return entry

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: register the decorated function under ``name``."""
        return lambda entry: self.add(name, entry)

    def check(self, name: str) -> None:
        """Raise a ``ValueError`` naming the option and the allowed values where ``name`` is not registered."""
        if name not in self:
            raise ValueError(f"{self.option}={name!r} is not allowed; allowed values: {sorted(self)}.")

    def select(self, name: str):
        """The entry registered under ``name`` (see :meth:`check` for an unknown one)."""
        self.check(name)
        return self[name]
