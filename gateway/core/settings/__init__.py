"""Configuration: one :class:`Settings` object in groups by concern (``groups.py``), from
YAML plus ``FAIRGATE_*`` env vars (``model.py``); the parts that are values of their own
(``parts.py``); the flat names of before the groups (``legacy.py``)."""

from gateway.core.settings.groups import (
    GROUPS,
    AccessSettings,
    BatchSettings,
    FairnessSettings,
    FleetSettings,
    Group,
    LimitsSettings,
    ListenSettings,
    LoraSettings,
    OperationsSettings,
    PacingSettings,
    ReplicasSettings,
    RoutingSettings,
    StoreSettings,
    UpstreamSettings,
    restart,
    restart_reason,
)
from gateway.core.settings.legacy import FLAT
from gateway.core.settings.model import (
    ReadsSettings,
    Settings,
    SettingsHolder,
    leaves,
    load_settings,
    restart_fields,
    value_at,
    with_values,
)
from gateway.core.settings.parts import (
    END_USER_SEPARATOR,
    MAX_LIMIT,
    NAME_SEPARATORS,
    OWNER_SEPARATOR,
    Adapter,
    ApiKey,
    Autoscale,
    Backend,
    ClassConfig,
    Discovery,
    HostPort,
    PoolFields,
    RedisCluster,
    RedisSentinel,
    Tenant,
    UsageLimits,
    addresses,
    check_name,
    default_classes,
    end_user_name,
    is_end_user,
    owner_id,
)

__all__ = [
    "END_USER_SEPARATOR", "FLAT", "GROUPS", "MAX_LIMIT", "NAME_SEPARATORS", "OWNER_SEPARATOR",
    "AccessSettings", "Adapter", "ApiKey", "Autoscale", "Backend", "BatchSettings",
    "ClassConfig", "Discovery", "FairnessSettings", "FleetSettings", "Group", "HostPort",
    "LimitsSettings", "ListenSettings", "LoraSettings", "OperationsSettings", "PacingSettings",
    "PoolFields", "ReadsSettings", "RedisCluster", "RedisSentinel", "ReplicasSettings",
    "RoutingSettings", "Settings", "SettingsHolder", "StoreSettings", "Tenant",
    "UpstreamSettings", "UsageLimits", "addresses", "check_name", "default_classes",
    "end_user_name", "is_end_user", "leaves", "load_settings", "owner_id", "restart",
    "restart_fields", "restart_reason", "value_at", "with_values",
]
