"""A model's identity in the connectors' default namespaces: new weights at the same path, new keys.

The vLLM connector's namespace was once ``vllm:<model path>``; a checkpoint swapped
in place (same shapes, other values) made a fresh engine load the old weights' KV.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvstore import StoreConfig, SyncKVStore
from kvstore.connectors import identity
from kvstore.connectors.hf import HFConnector, layout_for_model, namespace_for_model
from kvstore.connectors.identity import model_identity, weights_fingerprint


@pytest.fixture(autouse=True)
def digest_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test caches file digests in its own directory, not the user's ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kvstore" / "weights.json"


def write_checkpoint(path: Path, values: list[float]) -> Path:
    """A one-tensor safetensors checkpoint (header, then float32 data) with a config.json."""
    path.mkdir(parents=True, exist_ok=True)
    data = struct.pack(f"<{len(values)}f", *values)
    header = json.dumps({"w": {"dtype": "F32", "shape": [len(values)], "data_offsets": [0, len(data)]}}).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + data)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 4}))
    return path


def test_one_changed_weight_value_changes_the_fingerprint_and_nothing_changed_keeps_it(tmp_path):
    model = write_checkpoint(tmp_path / "model", [1.0, 2.0, 3.0, 4.0])
    before = weights_fingerprint(model)
    assert weights_fingerprint(model) == before  # nothing changed: the same
    weights = model / "model.safetensors"
    stat = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-4:] = struct.pack("<f", 4.5)  # one value: same size, same header
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even with the old mtime put back
    assert weights.stat().st_size == stat.st_size
    assert weights_fingerprint(model) != before


def test_an_untouched_checkpoint_is_not_read_again(tmp_path, monkeypatch, digest_cache):
    model = write_checkpoint(tmp_path / "model", [1.0, 2.0])
    first = weights_fingerprint(model)
    assert digest_cache.is_file()
    reads: list[Path] = []
    monkeypatch.setattr(identity, "file_digest", lambda path: reads.append(path) or "x")
    assert weights_fingerprint(model) == first and reads == []


def test_training_leftovers_are_not_part_of_the_identity(tmp_path):
    model = write_checkpoint(tmp_path / "model", [1.0, 2.0])
    before = weights_fingerprint(model)
    (model / "optimizer.pt").write_bytes(os.urandom(4096))  # a Trainer checkpoint's extras: never loaded
    (model / "rng_state_0.pth").write_bytes(os.urandom(64))
    assert weights_fingerprint(model) == before


def test_a_hugging_face_cache_file_is_named_by_its_blob_without_reading_it(tmp_path, monkeypatch):
    """A snapshot entry links to blobs/<sha256>: the name is the content hash, so nothing is read."""
    source = write_checkpoint(tmp_path / "source", [1.0, 2.0])
    blobs, snapshot = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name, sha in (("model.safetensors", "a" * 64), ("config.json", "b" * 40)):
        (blobs / sha).write_bytes((source / name).read_bytes())
        (snapshot / name).symlink_to(blobs / sha)
    reads: list[Path] = []
    monkeypatch.setattr(identity, "file_digest", lambda path: reads.append(path) or "x")
    first = weights_fingerprint(snapshot)
    assert reads == []
    (blobs / ("c" * 64)).write_bytes((source / "model.safetensors").read_bytes())
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(blobs / ("c" * 64))  # a new revision's weights
    assert weights_fingerprint(snapshot) != first and reads == []


def test_the_settings_and_the_revision_are_part_of_the_identity(tmp_path):
    model = str(write_checkpoint(tmp_path / "model", [1.0]))
    base = model_identity(model, {"dtype": "float16"})
    assert model_identity(model, {"dtype": "float16"}) == base
    assert model_identity(model, {"dtype": "bfloat16"}) != base
    assert model_identity(model, {"dtype": "float16", "kv_cache_dtype": "fp8"}) != base
    assert model_identity(model, {"dtype": "float16"}, revision="v2") != base


def test_a_model_not_on_this_machine_is_named_by_its_name_and_revision(caplog):
    a = model_identity("no-such-org/no-such-model", {}, "abc")
    assert a == model_identity("no-such-org/no-such-model", {}, "abc") != model_identity("no-such-org/no-such-model")
    assert "not on this machine" in caplog.text


def tiny_llama(seed: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=1024, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the default init: the output depends on the context
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    return model


def test_hf_weights_swapped_at_the_same_path_never_load_the_old_kv(tmp_path):
    """Engine A caches a prompt on W1; W2 (same shapes) is saved at the same path; engine B on W2
    loads nothing of A's and its output equals plain transformers on W2. With the path alone as
    the namespace (what the vLLM connector used), B would load A's chunks."""
    path, prompt = tmp_path / "model", torch.tensor([[(7 * i) % 64 for i in range(600)]])  # 2 full chunks
    greedy = {"max_new_tokens": 8, "do_sample": False}
    tiny_llama(seed=1).save_pretrained(path)
    config = StoreConfig(dram={"capacity": "16MiB"}, disk={"path": tmp_path / "disk"})
    a = LlamaForCausalLM.from_pretrained(path).eval()
    name_only = f"hf:{path}"  # what a namespace of the path alone amounts to: the same for W1 and W2
    with torch.inference_mode():
        for namespace in (namespace_for_model(a), name_only):
            with SyncKVStore(config, layout_for_model(a), namespace=namespace) as store:
                HFConnector(a, store).generate(prompt, **greedy)
    namespace_a = namespace_for_model(a)
    tiny_llama(seed=2).save_pretrained(path)  # W2: only values differ
    b = LlamaForCausalLM.from_pretrained(path).eval()
    assert namespace_for_model(b) != namespace_a and namespace_for_model(b).startswith(f"hf:{path}#id=")
    with torch.inference_mode():
        plain = b.generate(prompt, **greedy)
        for namespace in (namespace_for_model(b), name_only):
            with SyncKVStore(config, layout_for_model(b), namespace=namespace) as store:
                connector = HFConnector(b, store)
                out = connector.generate(prompt, save=False, **greedy)
            if namespace == name_only:  # the control: B would load A's chunks, and answer otherwise
                assert connector.counters["loaded_chunks"] == 2 and not torch.equal(out, plain)
            else:
                assert connector.counters["loaded_chunks"] == 0 and torch.equal(out, plain)


def test_processes_of_one_engine_that_compute_different_namespaces_stop_it_naming_both():
    """A scheduler and a worker that disagree would lose every chunk silently
    (the worker files it where the scheduler never looks); the engine must not go on."""
    from kvstore.connectors.identity import require_one_namespace
    from kvstore.errors import ConfigError

    require_one_namespace(("worker rank 0", "vllm:m#id=a [L]"), {"the scheduler": "vllm:m#id=a [L]"})
    with pytest.raises(ConfigError) as refused:
        require_one_namespace(
            ("worker rank 1", "vllm:m#id=b [L]"),
            {"the scheduler": "vllm:m#id=a [L]", "worker rank 0": "vllm:m#id=b [L]"},
        )
    message = str(refused.value)
    assert "worker rank 1: 'vllm:m#id=b [L]'" in message and "the scheduler: 'vllm:m#id=a [L]'" in message
    assert "worker rank 0" not in message  # only those that differ are named
    assert "set kvstore_namespace explicitly" in message
