"""Configuration: one :class:`Settings` object, from YAML plus ``FAIRGATE_*`` env vars.

Precedence: explicit overrides > environment (``FAIRGATE_STORE__REDIS_URL``,
``FAIRGATE_LISTEN__PORT``, …) > YAML file (``--config`` or ``FAIRGATE_CONFIG``) > defaults.
The settings come in groups by concern (``groups.py``); the flat names of before the
groups still work (``legacy.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from gateway.core.backend_names import check_backend_name
from gateway.core.settings.groups import (
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
from gateway.core.settings.legacy import nest, nest_env
from gateway.core.settings.parts import (
    Adapter,
    ApiKey,
    Autoscale,
    Backend,
    ClassConfig,
    Discovery,
    Tenants,
    check_name,
    default_classes,
)
from policies.classes import CLASS_ORDER
from policies.fleet import factor_of


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="FAIRGATE_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    listen: ListenSettings = ListenSettings()
    store: StoreSettings = StoreSettings()
    replicas: ReplicasSettings = ReplicasSettings()
    fleet: FleetSettings = FleetSettings()
    pacing: PacingSettings = PacingSettings()
    routing: RoutingSettings = RoutingSettings()
    fairness: FairnessSettings = FairnessSettings()
    upstream: UpstreamSettings = UpstreamSettings()
    limits: LimitsSettings = LimitsSettings()
    access: AccessSettings = AccessSettings()
    batch: BatchSettings = BatchSettings()
    lora: LoraSettings = LoraSettings()
    operations: OperationsSettings = OperationsSettings()

    backends: list[Backend] = []
    adapters: list[Adapter] = []  # LoRA adapters on the backends' models (docs/adapters.md)
    # backends found by DNS names (a Kubernetes headless Service per pool), beside the
    # configured ones and those added with POST /admin/backends (docs/operations.md)
    discovery: list[Discovery] = []
    api_keys: list[ApiKey] = []
    admin_keys: list[str] = []
    # a key's tenant not listed here: weight 1, no limits; a key naming no tenant belongs
    # to the tenant named after its user, weighing the key's weight unless listed
    # (policies/fairness.tenant_of), so configs without tenants schedule as before
    tenants: Tenants = restart({}, "the fairness policy is built at start")
    classes: dict[str, ClassConfig] = Field(default_factory=default_classes)
    autoscale: Autoscale = Autoscale()
    config_file: Path | None = None  # the YAML this was loaded from (POST /admin/reload)

    @model_validator(mode="before")
    @classmethod
    def _flat_names(cls, values: Any) -> Any:
        """The flat names of before the groups (a dict not read through the sources)."""
        return nest(values) if isinstance(values, Mapping) else values

    @model_validator(mode="after")
    def _names_without_separators(self) -> Settings:
        """The config's names (a key's are checked here, not by :class:`ApiKey`, which
        also holds names read back from Redis and batch records)."""
        named = [(f"api_keys.{i}.{field}", getattr(key, field))
                 for i, key in enumerate(self.api_keys) for field in ("user", "tenant")]
        named += [(f"tenants.{name}", name) for name in self.tenants]
        for where, name in named:
            if name is not None:
                try:
                    check_name(name)
                except ValueError as exc:
                    raise ValueError(f"{where}: {name!r} {exc}") from None
        return self

    @model_validator(mode="after")
    def _backends_named_once(self) -> Settings:
        """Each configured backend by a safe name of its own (a second of one name was
        dropped, unsaid)."""
        first: dict[str, int] = {}
        for i, backend in enumerate(self.backends):
            where = f"backends.{i}.name"
            try:
                check_backend_name(backend.name)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
            if backend.name in first:
                raise ValueError(f"{where}: {backend.name!r} is also the name of "
                                 f"backends.{first[backend.name]}: a name is one backend")
            first[backend.name] = i
        return self

    @model_validator(mode="after")
    def _one_key_per_secret(self) -> Settings:
        """A secret (and a key's id) names one key: a second of the same was kept in
        place of the first, so one of the two users was served as the other."""
        secrets: dict[str, int] = {}
        ids: dict[str, int] = {}
        for i, key in enumerate(self.api_keys):
            if key.key in secrets:
                raise ValueError(f"api_keys.{i}.key: the same secret as "
                                 f"api_keys.{secrets[key.key]}: one secret is one key")
            secrets[key.key] = i
            if key.id is not None and key.id in ids:
                raise ValueError(f"api_keys.{i}.id: {key.id!r} is also the id of "
                                 f"api_keys.{ids[key.id]}")
            if key.id is not None:
                ids[key.id] = i
        for i, admin in enumerate(self.admin_keys):
            if admin in secrets:
                raise ValueError(f"admin_keys.{i}: the same secret as "
                                 f"api_keys.{secrets[admin]}: an admin key is no API key "
                                 "(its holder would be served as that key's user, and "
                                 "that user could run the admin routes)")
        return self

    @model_validator(mode="after")
    def _adapters_on_models(self) -> Settings:
        models, seen = set(self.models()), set()
        for i, adapter in enumerate(self.adapters):
            where = f"adapters.{i}"
            if adapter.base_model not in models:
                raise ValueError(f"{where}: base_model {adapter.base_model!r} is not a "
                                 f"served model ({', '.join(sorted(models)) or 'none'})")
            if adapter.name in models or adapter.name in seen:
                raise ValueError(f"{where}: the name {adapter.name!r} is taken")
            seen.add(adapter.name)
        return self

    @model_validator(mode="after")
    def _cost_factors_of_models(self) -> Settings:
        models = set(self.models())
        adapters = {a.name: a.base_model for a in self.adapters}
        where = "fairness.cost_factors"
        for name in self.fairness.cost_factors:
            if name in adapters:
                raise ValueError(f"{where}: {name!r} is an adapter: its requests count "
                                 f"at its base model's factor ({adapters[name]!r})")
            if name not in models:
                raise ValueError(f"{where}: {name!r} is not a served model "
                                 f"({', '.join(sorted(models)) or 'none'})")
        if self.fairness.fairness_scope == "fleet" and self.store.redis_cluster is not None:
            raise ValueError("fairness.fairness_scope fleet needs one Redis (redis_url or "
                             "redis_sentinel): its counters span models, whose keys a Redis "
                             "Cluster keeps in separate slots")
        return self

    @model_validator(mode="after")
    def _one_store(self) -> Settings:
        stores = [f"store.{name}" for name in ("redis_url", "redis_sentinel", "redis_cluster")
                  if getattr(self.store, name) is not None]
        if len(stores) > 1:
            raise ValueError(f"set one of store.redis_url, store.redis_sentinel and "
                             f"store.redis_cluster, not {' and '.join(stores)}")
        return self

    def cost_factor(self, model: str) -> float:
        """What one unit of the model's service counts for in a fair-share counter: its
        ``cost_factors`` entry (1.0 when absent) in fleet scope, 1.0 in model scope."""
        if self.fairness.fairness_scope != "fleet":
            return 1.0
        return factor_of(self.fairness.cost_factors, model)

    def fleet_models(self) -> list[str]:
        """The models whose fair-share counters are one (fleet scope: every model served;
        model scope: none)."""
        return self.models() if self.fairness.fairness_scope == "fleet" else []

    def embedded_store(self) -> bool:
        """No store configured: the process runs an embedded Valkey server."""
        store = self.store
        return (store.redis_url is None and store.redis_sentinel is None
                and store.redis_cluster is None)

    def failover_wait_s(self) -> float:
        """How long a client waits through a store outage: a Sentinel failover's or a
        cluster shard's bound; 0 with a single Redis (its outage answers 503 at once)."""
        store = self.store
        failover = store.redis_sentinel is not None or store.redis_cluster is not None
        return store.store_failover_wait_s if failover else 0.0

    @field_validator("classes", mode="before")
    @classmethod
    def _merge_class_defaults(cls, value: Any) -> Any:
        """A partial class entry overrides only the fields it names."""
        if not isinstance(value, dict):
            return value
        unknown = set(value) - set(CLASS_ORDER)
        if unknown:
            raise ValueError(f"unknown priority classes: {sorted(unknown)}")
        merged = {name: cfg.model_dump() for name, cfg in default_classes().items()}
        for name, given in value.items():
            given = given.model_dump(exclude_unset=True) if isinstance(given, BaseModel) else given
            merged[name].update(given or {})
        return merged

    def models(self) -> list[str]:
        """The models served: those of the configured backends and of the discovery
        names (a backend added at runtime serves one of these)."""
        return sorted({b.model for b in self.backends} | {d.model for d in self.discovery})

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # a YAML file, when load_settings names one, ranks below the environment; each
        # source's old flat names are moved to their groups before the sources merge
        sources = [_Nested(init_settings, "the overrides"), _LegacyEnv(settings_cls)]
        if settings_cls.model_config.get("yaml_file"):
            sources.append(_NestedYaml(settings_cls))
        return tuple(sources)


class _Nested(PydanticBaseSettingsSource):
    """A source whose values' old flat names are moved to their groups."""

    def __init__(self, inner: PydanticBaseSettingsSource, where: str) -> None:
        super().__init__(inner.settings_cls)
        self.inner, self.where = inner, where

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self.inner.get_field_value(field, field_name)

    def __call__(self) -> dict[str, Any]:
        return nest(self.inner(), self.where)


class _NestedYaml(YamlConfigSettingsSource):
    """The config file, its old flat names moved to their groups."""

    def __call__(self) -> dict[str, Any]:
        return nest(super().__call__(), "the config file")


class _LegacyEnv(EnvSettingsSource):
    """The environment, ``FAIRGATE_<OLD FLAT NAME>`` read as its group's variable."""

    def _load_env_vars(self) -> Mapping[str, str | None]:
        prefix = self.env_prefix if self.case_sensitive else self.env_prefix.lower()
        return nest_env(super()._load_env_vars(), prefix)


def load_settings(config_path: str | Path | None = None, **overrides: Any) -> Settings:
    """Build the settings from a YAML file (or ``FAIRGATE_CONFIG``), env and overrides."""
    path = config_path or os.environ.get("FAIRGATE_CONFIG")
    if path is not None and not Path(path).is_file():
        raise FileNotFoundError(f"config file not found: {path}")

    class _FromFile(Settings):
        model_config = SettingsConfigDict(yaml_file=path)

    if path is not None:
        overrides.setdefault("config_file", Path(path))
    return _FromFile(**overrides)


def leaves() -> dict[str, FieldInfo]:
    """Every setting by its path: a group's fields as ``group.field``, the others (lists,
    tables, autoscale) whole by their name."""
    out: dict[str, FieldInfo] = {}
    for name, info in Settings.model_fields.items():
        kind = info.annotation
        if isinstance(kind, type) and issubclass(kind, Group):
            out.update({f"{name}.{leaf}": sub for leaf, sub in kind.model_fields.items()})
        else:
            out[name] = info
    return out


def restart_fields() -> dict[str, str]:
    """The settings a change of which needs a restart, each with the reason."""
    return {path: why for path, info in leaves().items()
            if (why := restart_reason(info)) is not None}


def value_at(settings: Settings, path: str) -> Any:
    value: Any = settings
    for part in path.split("."):
        value = getattr(value, part)
    return value


def with_values(settings: Settings, values: Mapping[str, Any]) -> Settings:
    """``settings`` with the settings at the paths of ``values`` replaced (unvalidated:
    values taken from another valid :class:`Settings`)."""
    top: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    for path, value in values.items():
        group, _, leaf = path.partition(".")
        if leaf:
            groups.setdefault(group, {})[leaf] = value
        else:
            top[path] = value
    for group, update in groups.items():
        top[group] = getattr(settings, group).model_copy(update=update)
    return settings.model_copy(update=top)


class SettingsHolder:
    """The settings in force: the one object every collaborator reads (``.current``).

    Built once in the composition root (``gateway/services.py``); a reload
    (``gateway/reload.py``) swaps it once, and the collaborators that derive state from
    the settings (gate policies, the starvation floors, …) re-derive it in ``on_swap``.
    """

    __slots__ = ("_derive", "current")

    def __init__(self, settings: Settings) -> None:
        self.current = settings
        self._derive: list[Callable[[Settings], None]] = []

    def on_swap(self, derive: Callable[[Settings], None]) -> None:
        """Run ``derive`` with the new settings after every swap."""
        self._derive.append(derive)

    def swap(self, new: Settings) -> None:
        self.current = new
        for derive in self._derive:
            derive(new)


class ReadsSettings:
    """A collaborator's ``self.settings``: always the holder's current settings, never a
    copy of its own."""

    holder: SettingsHolder

    @property
    def settings(self) -> Settings:
        return self.holder.current
