"""The benchmark prompts of real text: Python's standard-library documentation, cut to a length drawn from each name.

Each prompt is a module's documentation (its docstring, then its public members' and their
methods', sorted: :func:`module_documentation`), which ships with every Python 3.11; the modules
are :data:`PROMPT_MODULES`, in that fixed sorted order, and each text is truncated to a token
count drawn from the module's name alone (sha256, :func:`prompt_length`), so every machine with
the same Python and tokenizer gets the same prompts. Never random tokens: a codec's effect on a
model's answers is measured on text the model can predict. Used by
:mod:`kvstore.bench.accuracy`; no model is loaded here (the caller passes its tokenizer).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from dataclasses import dataclass
from typing import Any

# Modules whose documentation is long enough (sorted; C-only and GUI modules left out: their docs differ by build).
PROMPT_MODULES = tuple(
    "argparse collections configparser contextlib csv dataclasses difflib doctest email.message enum functools "
    "http.client inspect ipaddress json logging optparse os pathlib pdb random re shutil smtplib statistics "
    "subprocess tarfile tempfile textwrap threading typing unittest.mock urllib.parse uuid zipfile".split()
)


@dataclass(frozen=True)
class Prompt:
    """A prompt of real text: where it comes from, and its token ids."""

    source: str
    ids: list[int]


def module_documentation(name: str) -> str:
    """The docstring of a standard-library module, then each public member's (and its public methods'), sorted."""
    module = importlib.import_module(name)
    parts = [inspect.getdoc(module) or ""]
    for member_name in sorted(dir(module)):
        member = getattr(module, member_name)
        if member_name.startswith("_") or getattr(member, "__module__", None) != module.__name__:
            continue  # private, or imported from elsewhere
        members = [(member_name, member)]
        if inspect.isclass(member):
            members += [
                (f"{member_name}.{attr}", value)
                for attr, value in sorted(vars(member).items())
                if not attr.startswith("_") and callable(value)
            ]
        parts += [f"{title}\n{doc}" for title, value in members if (doc := inspect.getdoc(value))]
    return "\n\n".join(part for part in parts if part)


def prompt_length(source: str, min_tokens: int, max_tokens: int) -> int:
    """A token count in ``min_tokens..max_tokens`` drawn from the name alone: the same on every machine."""
    draw = int.from_bytes(hashlib.sha256(source.encode()).digest()[:8], "big")
    return min_tokens + draw % (max_tokens - min_tokens + 1)


def stdlib_prompts(tokenizer: Any, count: int, min_tokens: int = 1024, max_tokens: int = 2048) -> list[Prompt]:
    """The first ``count`` modules of PROMPT_MODULES whose documentation reaches its drawn length, truncated to it.

    ValueError if fewer than ``count`` do.
    """
    if not 0 < min_tokens <= max_tokens:
        raise ValueError(f"need 0 < min_tokens <= max_tokens, got {min_tokens}..{max_tokens}")
    prompts: list[Prompt] = []
    for name in PROMPT_MODULES:
        if len(prompts) == count:
            break
        try:
            text = module_documentation(name)
        except ImportError:
            continue  # a Python built without it (the selection stays deterministic for a given Python)
        ids = tokenizer(text).input_ids
        length = prompt_length(name, min_tokens, max_tokens)
        if len(ids) >= length:
            prompts.append(Prompt(name, list(ids[:length])))
    if len(prompts) < count:
        raise ValueError(
            f"only {len(prompts)} standard-library modules have {min_tokens}..{max_tokens} tokens of documentation; "
            f"asked for {count}"
        )
    return prompts
