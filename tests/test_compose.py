"""localstack/docker-compose*.yml, read statically (the test machines have no Docker nor registry).

What would break a user's ``docker compose up`` or leave kvstore pointed at the wrong place: an image
that can no longer be pulled (MinIO's on Docker Hub) or is not pinned, a service with no health check,
a bucket created before its server answers, a required variable Compose would demand from everyone,
and settings in localstack/README.md that differ from what the compose files give the servers.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

LOCALSTACK = Path(__file__).resolve().parents[1] / "localstack"
MAIN = LOCALSTACK / "docker-compose.yml"
OPTIONAL = LOCALSTACK / "docker-compose.localstack.yml"
README = LOCALSTACK / "README.md"
REQUIRED_VARIABLE = re.compile(r"\$\{(\w+):?\?")  # ${NAME:?message} or ${NAME?message}


def services(path: Path) -> dict[str, dict[str, Any]]:
    loaded = yaml.safe_load(path.read_text())
    assert isinstance(loaded, dict) and loaded.get("services"), f"{path.name}: no services"
    return loaded["services"]


ALL = {name: (path, service) for path in (MAIN, OPTIONAL) for name, service in services(path).items()}


def is_bucket_creator(name: str) -> bool:
    """The one-shot services that create the bucket, then exit (no health check: they do not stay up)."""
    return name.endswith("-bucket")


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # the KEY=VALUE list form
        env = dict(item.split("=", 1) for item in env)
    return {key: str(value) for key, value in env.items()}


def published_port(service: dict[str, Any], container_port: int) -> int:
    for mapping in service.get("ports", []):
        *_, host, inside = str(mapping).split(":")
        if int(inside) == container_port:
            return int(host)
    raise AssertionError(f"port {container_port} is not published: {service.get('ports')}")


def readme_exports(text: str) -> dict[str, str]:
    """KEY=VALUE pairs of the ``export`` lines in ``text`` (a later line wins)."""
    pairs: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("export "):
            words = line.split("#", 1)[0].split()[1:]
            pairs.update(word.split("=", 1) for word in words if "=" in word)
    return pairs


def readme_sections() -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """The exports for the default stack (SeaweedFS, Redis), and those of the MinIO and LocalStack sections."""
    text = README.read_text()
    docker = text.split("## With Docker", 1)[1]
    default, rest = docker.split("### MinIO", 1)
    minio, localstack = rest.split("### LocalStack", 1)
    return readme_exports(default), readme_exports(minio), readme_exports(localstack)


def test_every_image_named_and_minio_from_quay_at_a_pinned_release():
    for name, (path, service) in ALL.items():
        image = service.get("image", "")
        assert image, f"{path.name}: {name} has no image"
        if "minio" in image.lower():  # Docker Hub's minio/minio is gone; quay.io keeps the releases
            assert re.fullmatch(r"quay\.io/minio/minio:RELEASE\.[0-9TZ-]+", image), f"{path.name}: {name}: {image}"
    assert services(MAIN)["minio"]["image"].startswith("quay.io/minio/minio:RELEASE.")


def test_minio_is_a_profile_with_its_bucket_and_the_default_stack_is_unchanged():
    main = services(MAIN)
    assert main["minio"]["profiles"] == main["minio-bucket"]["profiles"] == ["minio"]
    assert all("profiles" not in main[name] for name in ("seaweedfs", "seaweedfs-bucket", "redis"))


@pytest.mark.parametrize("name", sorted(ALL))
def test_every_service_has_a_health_check_or_is_the_bucket_creator(name: str):
    path, service = ALL[name]
    if is_bucket_creator(name):
        assert service.get("restart") == "no", f"{path.name}: the one-shot {name} must not be restarted"
        assert "healthcheck" not in service
        return
    check = service.get("healthcheck")
    assert check and not check.get("disable"), f"{path.name}: {name} has no health check"
    assert check["test"][0] in ("CMD", "CMD-SHELL") and len(check["test"]) > 1, check["test"]


def test_bucket_creators_wait_for_a_healthy_s3_server():
    creators = {name: entry for name, entry in ALL.items() if is_bucket_creator(name)}
    assert set(creators) == {"seaweedfs-bucket", "minio-bucket", "localstack-bucket"}
    for name, (path, service) in creators.items():
        depends = service.get("depends_on")
        assert isinstance(depends, dict) and depends, f"{path.name}: {name} must wait for its S3 server"
        (server, condition), *others = depends.items()
        assert not others and condition == {"condition": "service_healthy"}, depends
        assert "healthcheck" in services(path)[server]
        endpoint = environment(service)["AWS_ENDPOINT_URL"]
        assert re.fullmatch(rf"http://{server}:\d+", endpoint), endpoint
        # $$ is a literal $ for the container's shell; a lone $BUCKET would be Compose's, from the host
        command = " ".join(service["command"]) if isinstance(service["command"], list) else service["command"]
        assert "$$BUCKET" in command and not re.search(r"(?<!\$)\$(?!\$)\w", command), command


def test_localstack_needs_its_token_and_only_where_it_runs():
    token = environment(services(OPTIONAL)["localstack"])["LOCALSTACK_AUTH_TOKEN"]
    assert re.fullmatch(r"\$\{LOCALSTACK_AUTH_TOKEN:\?.+\}", token), token
    # Compose resolves every ${...} of a file before applying profiles: a required variable in the
    # default file would stop `docker compose up` for everyone who lacks it.
    assert not REQUIRED_VARIABLE.search(MAIN.read_text()), "docker-compose.yml must start without any variable set"
    assert "localstack" not in services(MAIN)


def test_readme_exports_match_the_compose_files():
    default, minio, localstack = readme_sections()
    main = services(MAIN)
    seaweedfs, creator = environment(main["seaweedfs"]), environment(main["seaweedfs-bucket"])
    assert default["KVSTORE_S3__BUCKET"] == creator["BUCKET"]
    assert environment(services(OPTIONAL)["localstack-bucket"])["BUCKET"] == creator["BUCKET"]
    assert default["KVSTORE_S3__ENABLED"] == default["KVSTORE_REDIS__ENABLED"] == "true"
    assert default["AWS_ACCESS_KEY_ID"] == seaweedfs["AWS_ACCESS_KEY_ID"] == creator["AWS_ACCESS_KEY_ID"]
    assert default["AWS_SECRET_ACCESS_KEY"] == seaweedfs["AWS_SECRET_ACCESS_KEY"] == creator["AWS_SECRET_ACCESS_KEY"]
    assert default["KVSTORE_S3__ENDPOINT_URL"] == f"http://127.0.0.1:{published_port(main['seaweedfs'], 8333)}"
    assert default["KVSTORE_REDIS__URL"] == f"redis://127.0.0.1:{published_port(main['redis'], 6379)}/0"
    port = published_port(services(OPTIONAL)["localstack"], 4566)
    assert localstack["KVSTORE_S3__ENDPOINT_URL"] == f"http://127.0.0.1:{port}"
    # MinIO: the default exports' credentials are its root user, the bucket its creator's, and its own endpoint
    server, creator = environment(main["minio"]), environment(main["minio-bucket"])
    assert (server["MINIO_ROOT_USER"], server["MINIO_ROOT_PASSWORD"]) == (
        default["AWS_ACCESS_KEY_ID"], default["AWS_SECRET_ACCESS_KEY"]
    ) == (creator["AWS_ACCESS_KEY_ID"], creator["AWS_SECRET_ACCESS_KEY"])  # fmt: skip
    assert creator["BUCKET"] == default["KVSTORE_S3__BUCKET"]
    assert minio == {"KVSTORE_S3__ENDPOINT_URL": f"http://127.0.0.1:{published_port(main['minio'], 9000)}"}


def test_readme_names_the_variables_kvstore_reads(monkeypatch: pytest.MonkeyPatch):
    """The README's exports make a StoreConfig with both remote tiers on these servers."""
    from kvstore.config import StoreConfig

    default, _, _ = readme_sections()
    for key in [key for key in os.environ if key.startswith("KVSTORE_")]:
        monkeypatch.delenv(key)
    for key, value in default.items():
        monkeypatch.setenv(key, value)
    config = StoreConfig()
    assert config.s3.enabled and config.s3.bucket == default["KVSTORE_S3__BUCKET"]
    assert config.s3.endpoint_url == default["KVSTORE_S3__ENDPOINT_URL"]
    assert config.redis.enabled and config.redis.url == default["KVSTORE_REDIS__URL"]
