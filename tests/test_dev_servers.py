"""localstack/dev-servers.sh (``kvstore dev-servers``): servers start, settings are printed, a chunk goes through."""

import re
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "localstack" / "dev-servers.sh"


@pytest.mark.parametrize(
    ("args", "tiers"), [((), "s3 (moto), redis"), (("--s3", "seaweedfs", "--no-redis"), "s3 (seaweedfs)")]
)
def test_dev_servers_print_settings_that_work(args, tiers):
    done = subprocess.run(["bash", str(SCRIPT), "--check", *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert f"check: a chunk was stored and read back exactly through {tiers}" in done.stdout
    exported = dict(re.findall(r"^export (\w+)=(\S+)$", done.stdout, re.MULTILINE))
    assert exported["AWS_ENDPOINT_URL_S3"].startswith("http://127.0.0.1:")
    assert exported["KVSTORE_S3__ENABLED"] == "true"
    assert ("REDIS_URL" in exported) == ("--no-redis" not in args)


def test_dev_servers_refuse_an_unknown_s3_server():
    done = subprocess.run(["bash", str(SCRIPT), "--s3", "minio"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "'minio' is not one of 'moto', 'seaweedfs', 'none'" in done.stdout + done.stderr
