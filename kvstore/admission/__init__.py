"""Admission policies: which chunk put into DRAM is written to which tier below it, and when.

See :mod:`kvstore.eviction` for the other half (what leaves a tier), :mod:`kvstore.admission.base`
for the contract, :mod:`kvstore.admission.registry` for the names, and ``docs/admission.md``.
"""

from kvstore.admission.base import AdmissionPolicy, HeldBack, SeenBefore
from kvstore.admission.registry import DEFAULT_ADMISSION, POLICIES, AdmissionName, make_admission
from kvstore.admission.second_sighting import SecondSighting
from kvstore.admission.write_through import WriteThrough

__all__ = [
    "DEFAULT_ADMISSION",
    "POLICIES",
    "AdmissionName",
    "AdmissionPolicy",
    "HeldBack",
    "SecondSighting",
    "SeenBefore",
    "WriteThrough",
    "make_admission",
]
