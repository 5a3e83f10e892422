"""Store configuration: keyword arguments > ``KVSTORE_*`` environment > TOML file > defaults.

Nested keys use ``__`` in the environment (``KVSTORE_DRAM__CAPACITY=8GiB``) and tables in
TOML (``[dram] capacity = "8GiB"``). ``KVSTORE_CONFIG`` names a TOML file to read. A wrong or
unknown key fails at start with a :class:`ConfigError` naming the key and what is valid.
Each section is a pydantic model in its own module: the store's (:mod:`~kvstore.config.sections`),
the backends' (:mod:`~kvstore.config.backend_sections`, and those of backends from other
packages), all read into :class:`StoreConfig` (:mod:`~kvstore.config.store`). Everything is importable from here.
"""

from kvstore.config.backend_sections import (
    BACKEND_ENTRY_POINTS,
    BUILTIN_BACKENDS,
    LOSSY_HELP,
    MULTIPART_MIN,
    SINGLE_PUT_MAX,
    BackendSection,
    DiskConfig,
    RedisConfig,
    RemoteSection,
    S3Config,
)
from kvstore.config.base import (
    CONFIG_FILE_ENV,
    ENV_PREFIX,
    SCRIPT_VARIABLES,
    Capacity,
    Duration,
    Section,
    Size,
    default_cache_dir,
)
from kvstore.config.sections import (
    AdaptiveConfig,
    BreakerConfig,
    DramConfig,
    EncryptionConfig,
    EventsConfig,
    MetricsConfig,
    PlannerConfig,
    TimeoutConfig,
    parse_key,
)
from kvstore.config.store import BackendDeclaration, StoreConfig, backend_catalogue, check_backend_declaration

__all__ = [
    "BACKEND_ENTRY_POINTS",
    "BUILTIN_BACKENDS",
    "CONFIG_FILE_ENV",
    "ENV_PREFIX",
    "LOSSY_HELP",
    "MULTIPART_MIN",
    "SCRIPT_VARIABLES",
    "SINGLE_PUT_MAX",
    "AdaptiveConfig",
    "BackendDeclaration",
    "BackendSection",
    "BreakerConfig",
    "Capacity",
    "DiskConfig",
    "DramConfig",
    "Duration",
    "EncryptionConfig",
    "EventsConfig",
    "MetricsConfig",
    "PlannerConfig",
    "RedisConfig",
    "RemoteSection",
    "S3Config",
    "Section",
    "Size",
    "StoreConfig",
    "TimeoutConfig",
    "backend_catalogue",
    "check_backend_declaration",
    "default_cache_dir",
    "parse_key",
]
