"""Shared fixtures: the real KV sample, and real servers for the remote tiers (helpers: tests/support.py)."""

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

# Never the user's ~/.local/state (kvstore's planner keeps its measured rates there by default).
RUN_STATE_HOME = os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="kvstore-test-state-")

# The backend conformance suite lives in the package; its assertions should explain themselves too.
pytest.register_assert_rewrite("kvstore.testing.conformance")

from sglang_env import sglang_python  # noqa: E402, F401 (fixture)
from support import TEST_BUCKET, raw_s3_client, start_server  # noqa: E402
from vllm_engines import (  # noqa: E402, F401 (fixtures)
    tiny_gemma,
    tiny_gemma_sliding,
    tiny_llama,
    tiny_llama_4kv,
    tiny_mla,
    tiny_models,
    vllm_cpu,
    vllm_python,
)

from kvstore.testing.servers import (  # noqa: E402 (after the rewrite hook)
    DevServer,
    MotoServer,
    RedisClusterServer,
    RedisServer,
    S3Server,
    SeaweedFSServer,
)

# ---------------------------------------------------------------------------------------------
# Marks and workers. scripts/test.sh runs the suite on two pytest-xdist workers: the vLLM engine
# tests in two groups of about the same length, each group's tests one after another on one worker
# (so at most two engines share the two cores), the real-model tests on one (SmolLM2 is loaded
# once), every other test wherever a worker is free. The marks (engine, real_model) follow the
# fixtures a test uses; the scheduler sees only test ids, so it groups by the files (and examples)
# that hold those tests.
# ---------------------------------------------------------------------------------------------
ENGINE_GROUPS = {
    "test_vllm.py": "engine_a",
    "test_vllm_tier.py": "engine_a",
    "test_vllm_metrics.py": "engine_a",
    "test_vllm_shapes.py": "engine_b",
    "test_vllm_first_hit.py": "engine_b",
    "test_vllm_events.py": "engine_b",
    "test_vllm_server_commands_parse_with_vllm_and_kvstore": "engine_a",  # tests/test_docs_commands.py
    "test_vllm_prefix_cache_prints_a_row_per_source": "engine_b",  # examples (tests/test_examples.py)
    "test_vllm_config_second_engine_loads_the_prefix_from_disk": "engine_b",
}
ENGINE_EXAMPLES = {name for name in ENGINE_GROUPS if not name.endswith(".py")}
MODEL_FILES = {"test_connector_hf.py", "test_codec_accuracy.py"}
MODEL_EXAMPLES = {"test_hf_prefix_cache_prints_a_row_per_tier"}
# Files and tests the scheduler keeps together on one worker (tests/test_install.py: one wheel, built once).
GROUPS = {**ENGINE_GROUPS, **dict.fromkeys(MODEL_FILES | MODEL_EXAMPLES, "real_model"), "test_install.py": "install"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if "vllm_python" in fixtures or item.originalname in ENGINE_EXAMPLES:
            item.add_marker(pytest.mark.engine)
        elif "smollm2" in fixtures or item.originalname in MODEL_EXAMPLES:
            item.add_marker(pytest.mark.real_model)


def worker_group(nodeid: str) -> str:
    """The unit of work a test belongs to: its group in :data:`GROUPS` (by file or test name), or itself."""
    path, _, name = nodeid.partition("::")
    file, test = path.rpartition("/")[2], name.partition("[")[0]
    return GROUPS.get(file) or GROUPS.get(test) or nodeid


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """xdist's load-scope scheduler with :func:`worker_group` as the scope (biggest groups handed out first).

    Not ``--dist loadgroup``: pytest-xdist 3.8 marks a group by rewriting a test's id, which
    pytest 9.2 no longer lets it do, so every group would be spread over both workers.
    """
    from xdist.scheduler import LoadScopeScheduling

    class EngineGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    return EngineGroups(config, log)


# ---------------------------------------------------------------------------------------------
# Real KV sample for codec and container tests (test_codecs.py, test_format.py).
# ---------------------------------------------------------------------------------------------
REAL_KV_PATH = Path(__file__).resolve().parents[1].parent / "shared" / "kv_smollm2_512tok_bf16bits.npy"
REAL_KV_SHAPE = (30, 2, 512, 3, 64)  # [layer, k_or_v, token, kv_head, head_dim] of SmolLM2-135M


@pytest.fixture(autouse=True)
def _planner_state_of_its_own(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's stores (and the engines it starts) keep the planner's measured rates in a directory of
    their own (``planner.state_dir``'s default follows ``XDG_STATE_HOME``): no test plans with another's rates.
    Module and session fixtures, set up before it, use the run's own directory (:data:`RUN_STATE_HOME`)."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))


@pytest.fixture(scope="session")
def real_kv() -> torch.Tensor:
    """512 tokens of real SmolLM2-135M KV, bf16, shape [30, 2, 512, 3, 64]. Missing file = failure."""
    if not REAL_KV_PATH.is_file():
        pytest.fail(
            f"the real KV sample {REAL_KV_PATH} is missing: codec and format tests need it "
            "(it lives in the shared/ folder beside the repository; see DESIGN.md)",
            pytrace=False,
        )
    bits = np.load(REAL_KV_PATH)  # allow_pickle stays False: the file is plain data
    assert bits.dtype == np.uint16 and bits.shape == REAL_KV_SHAPE, (bits.dtype, bits.shape)
    return torch.from_numpy(bits).view(torch.bfloat16)


@pytest.fixture(scope="session")
def smollm2() -> tuple[object, object]:
    """(tokenizer, model): SmolLM2-135M-Instruct in float32, loaded once per session (~25 s) for every
    test that runs the real model (test_connector_hf.py, test_codec_accuracy.py). Tests only read it."""
    from kvstore.bench.models import load_smollm2  # transformers: imported only where a test needs the model

    return load_smollm2(torch.float32)


# ---------------------------------------------------------------------------------------------
# Real servers (kvstore.testing.servers), one of each per test session. A server that cannot start
# fails the tests that need it: remote-tier tests never skip.
# ---------------------------------------------------------------------------------------------


def _serve(server: DevServer) -> Iterator[DevServer]:
    start_server(server)
    try:
        if isinstance(server, S3Server):
            raw_s3_client(server).create_bucket(Bucket=TEST_BUCKET)
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    yield from _serve(RedisServer())


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterServer]:
    yield from _serve(RedisClusterServer())


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    yield from _serve(MotoServer())


@pytest.fixture(scope="session")
def seaweedfs_server() -> Iterator[SeaweedFSServer]:
    yield from _serve(SeaweedFSServer())
