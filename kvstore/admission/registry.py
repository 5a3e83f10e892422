"""Admission policies by name: what the ``adaptive.policy`` config key (and ``kvstore advise --policy``) takes.

The config key is a ``Literal`` of these names (:data:`AdmissionName`), so a typo fails at start
listing the choices; :func:`make_admission` refuses an unknown name the same way. A new policy is
a module with one :class:`AdmissionPolicy` subclass, added to :data:`BUILTIN_POLICIES` and to
:data:`AdmissionName` (a test checks the two agree); ``kvstore advise`` models the built-in two.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal

from kvstore.admission.base import AdmissionPolicy, HeldBack, SeenBefore, T, _always_seen
from kvstore.admission.second_sighting import SecondSighting
from kvstore.admission.write_through import WriteThrough

AdmissionName = Literal["write-through", "second-sighting"]
"""The names the ``adaptive.policy`` config key accepts."""
DEFAULT_ADMISSION: AdmissionName = "write-through"

BUILTIN_POLICIES: tuple[type[AdmissionPolicy], ...] = (WriteThrough, SecondSighting)
POLICIES: Mapping[str, type[AdmissionPolicy]] = MappingProxyType({policy.name: policy for policy in BUILTIN_POLICIES})


def make_admission(name: str, held_back: HeldBack[T], seen_before: SeenBefore = _always_seen) -> AdmissionPolicy[T]:
    """Policy ``name`` over ``held_back`` (a fresh one, or the one the previous policy had); ValueError if unknown."""
    policy = POLICIES.get(name)
    if policy is None:
        raise ValueError(f"unknown admission policy {name!r}; choose one of: {', '.join(POLICIES)}")
    return policy(held_back, seen_before)
