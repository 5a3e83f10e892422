"""The quickstart's and the vLLM page's code, taken from the Markdown and run, so the pages cannot drift.

- docs/quickstart.md: every ``python`` block runs as printed and prints what the page says it
  does; the ``bash`` block's commands run from the clone's root (with this interpreter for
  ``.venv/bin/python``) and store and read back a prompt in S3 and in Redis; the ``toml`` block
  is a valid configuration.
- docs/vllm.md and the README: every ``vllm serve`` command (a GPU build's) is parsed by the tested
  vLLM's own ``serve`` parser, and kvstore reads its options from it as the connector or tier will
  at start (tests/vllm_support/check_serve_commands.py). Starting them needs a GPU and an 8B model;
  the command that runs end to end on this machine is docs/vllm-first-hit.md's
  (tests/test_vllm_first_hit.py).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

from support import check_remote_tier

from kvstore import StoreConfig

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "docs" / "quickstart.md"
SERVER_COMMAND_PAGES = (ROOT / "docs" / "vllm.md", ROOT / "README.md")
SERVER_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "REDIS_URL")


def fenced(page: Path, language: str) -> list[str]:
    """The page's code blocks in ``language``, in order."""
    return re.findall(rf"```{language}\n(.*?)```", page.read_text(), flags=re.DOTALL)


def without_servers(tmp_path: Path) -> dict[str, str]:
    """This environment with no S3 endpoint or Redis URL (the examples then start their own servers)."""
    return {**{k: v for k, v in os.environ.items() if k not in SERVER_VARIABLES}, "TMPDIR": str(tmp_path)}


def run(command: list[str], tmp_path: Path, cwd: Path) -> str:
    done = subprocess.run(
        command, cwd=cwd, env=without_servers(tmp_path), capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, f"{command} failed:\n{done.stdout}\n{done.stderr[-4000:]}"
    return done.stdout


def test_quickstart_python_blocks_run_as_printed(tmp_path: Path) -> None:
    first, engine_thread = fenced(QUICKSTART, "python")
    assert run([sys.executable, "-c", first], tmp_path, tmp_path) == "3 of 3 chunks back after a restart; exact: True\n"
    assert run([sys.executable, "-c", engine_thread], tmp_path, tmp_path) == "3 chunks streamed back, 30 layers\n"


def test_quickstart_remote_tier_commands_run_as_printed(tmp_path: Path) -> None:
    """Each starts its own server (moto; redis-server) and streams the prompt back: the examples' own output says so."""
    (commands,) = fenced(QUICKSTART, "bash")
    lines = [line.partition("#")[0].split() for line in commands.splitlines() if line.strip()]
    assert [line[:2] for line in lines] == [
        [".venv/bin/python", "examples/s3_tier.py"],
        [".venv/bin/python", "examples/redis_tier.py"],
    ]
    s3, redis = (run([sys.executable, *line[1:]], tmp_path, ROOT) for line in lines)
    assert re.search(r"^no S3 endpoint set .*: started moto at http://127\.0\.0\.1:\d+$", s3, re.M), s3
    assert re.search(r"^no REDIS_URL or --url: started redis-server at redis://127\.0\.0\.1:\d+/0$", redis, re.M)
    check_remote_tier(s3, "S3", "objects")
    check_remote_tier(redis, "Redis", "values")
    assert "with ttl 1 s: 4 of 4 chunks written; 1.5 s unread, 0 left" in redis, redis  # expired: the ttl works


def test_quickstart_toml_is_a_valid_configuration() -> None:
    (toml,) = fenced(QUICKSTART, "toml")
    config = StoreConfig(**tomllib.loads(toml))
    assert config.redis.enabled and config.redis.url == "redis://cache-0:6379/0"
    assert config.s3.enabled and config.s3.bucket == "kv-archive"


def test_vllm_server_commands_parse_with_vllm_and_kvstore(vllm_python: Path) -> None:
    commands = [
        shlex.split(block.replace("\\\n", " "))
        for page in SERVER_COMMAND_PAGES
        for block in fenced(page, "bash")
        if block.startswith("vllm serve ")
    ]
    assert len(commands) == 3  # vllm.md: the connector, the tier; the README: the connector
    # Not offline: in offline mode vLLM's engine arguments look the model up in the local Hugging Face cache
    # (to replace its name by a path); nothing here loads or downloads it.
    environment = {**os.environ, "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0"}
    checked = subprocess.run(
        [str(vllm_python), str(ROOT / "tests" / "vllm_support" / "check_serve_commands.py")],
        input=json.dumps(commands), env=environment, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stderr[-4000:]
    assert checked.stdout.splitlines() == [
        "ok KVStoreConnector",
        "ok OffloadingConnector with KVStoreTier",
        "ok KVStoreConnector",
    ], checked.stdout + checked.stderr[-2000:]
