"""Regions: one Prefect work pool per region, and the wave plan a global rollout follows.

A regions file (YAML, ``settings.regions_file``; default ``<home>/regions.yaml``) names each
region's work pool and the settings its flow runs get (any ``MODELOPS_*`` setting, by its field
name: provider, router and its ports, FSx root, S3 endpoint, registry, home)::

    regions:
      - name: us-east-1                    # the first region: the stack's own settings
        work_pool: modelops-local
      - name: eu-west-1
        work_pool: modelops-eu-west-1
        settings: {home: .modelops/regions/eu-west-1, router_port: 8180, router_grpc_port: 8181}
    waves: [[us-east-1], [eu-west-1]]      # default: the first region alone (canary), then the rest
    bake_s: 30                             # after each wave, its regions are watched this long
    on_failure: keep                       # or rollback: earlier waves go back to what they served
    region_start_timeout_s: 120            # a region's worker must pick up its run within this

A region's settings are the stack's own with its overrides on top, so one region stays the
default and a stack without a regions file is one region, as before.
The flows and CLI that use this: flows/global_rollout.py, tasks/regions.py, docs/regions.md.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from modelops.errors import ModelopsError
from modelops.settings import Settings
from modelops.yamlfile import load_unique

__all__ = ["GLOBAL_EVENT", "Region", "RegionPlan", "RegionsError", "load_regions", "region_env", "region_settings"]

# What `modelops announce` emits once a regions file exists; the global-rollout deployment's trigger.
GLOBAL_EVENT = "modelops.model.announced.global"
_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$")
# Settings that are the stack's, not a region's: one Prefect server and one regions file for all.
_SHARED = frozenset({"prefect_port", "regions_file"})
# Set from the region's own fields (name, work_pool).
_OWN = {"region": "name", "work_pool": "work_pool"}


class RegionsError(ModelopsError, ValueError):
    """A regions file that cannot be used; the message names the field and the fix."""


class Region(BaseModel):
    """One region: its name, the Prefect work pool its regional flow runs go to, and its
    settings overrides (``Settings`` field names, e.g. ``router_port``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="lowercase letters, digits and '-', up to 40 (it names Prefect deployments)")
    work_pool: str = Field(min_length=1, description="the Prefect work pool whose worker runs in this region")
    settings: dict[str, Any] = Field(default_factory=dict, description="MODELOPS_* settings of this region's "
                                     "flow runs, by field name (router_port, fsx_root, home, ...)")
    job_variables: dict[str, Any] = Field(default_factory=dict, description="more job variables of the regional "
                                          "deployments, as the work pool's base job template names them (a "
                                          "Kubernetes pool: image, namespace, service_account_name, cluster_config "
                                          "for a kubeconfig block); the region's settings go in their env")

    @field_validator("name")
    @classmethod
    def _dns_label(cls, v: str) -> str:
        if not _NAME.match(v):
            shown = repr(v) if len(v) <= 60 else f"{v[:40]!r}... ({len(v)} characters)"
            raise ValueError(f"{shown} must be lowercase letters, digits and '-' (1 to 40, no '-' at either end), "
                             "e.g. us-east-1")
        return v

    @field_validator("settings", "job_variables", mode="before")
    @classmethod
    def _none_is_empty(cls, v):
        return {} if v is None else v

    @field_validator("settings")
    @classmethod
    def _known_settings(cls, v: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(v) - set(Settings.model_fields))
        if unknown:
            raise ValueError(f"unknown setting(s) {', '.join(unknown)}: use Settings field names, e.g. router_port "
                             "(MODELOPS_ROUTER_PORT without the prefix, lowercase)")
        shared = sorted(set(v) & _SHARED)
        if shared:
            raise ValueError(f"{', '.join(shared)} cannot differ per region: every region shares the stack's "
                             "Prefect server and regions file")
        if own := sorted(set(v) & set(_OWN)):
            raise ValueError(f"{', '.join(own)}: give the region's {', '.join(_OWN[k] for k in own)} field instead")
        # pydantic reads true as 1 where a number is wanted: a port of 1, a step of 1 %.
        if not_bool := sorted(k for k, value in v.items() if _has_bool(value) and
                              "bool" not in str(Settings.model_fields[k].annotation)):
            raise ValueError(f"{', '.join(not_bool)}: true or false where the setting takes no yes/no value; give "
                             "what the setting takes (docs/regions.md, modelops/settings.py)")
        # Relative to what? Each of the region's processes starts in its own folder.
        if relative := [k for k in ("home", "fsx_root", "runtime_root")
                        if isinstance(v.get(k), str) and not Path(v[k]).expanduser().is_absolute()]:
            got = ", ".join(repr(v[k]) for k in relative)
            raise ValueError(f"{', '.join(relative)} must be absolute paths (got {got})")
        return v


def _has_bool(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_has_bool(x) for x in value.values())
    return isinstance(value, bool) or (isinstance(value, list) and any(_has_bool(x) for x in value))


class RegionPlan(BaseModel):
    """The regions and how a global rollout goes through them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    regions: list[Region] = Field(min_length=1)
    waves: list[list[str]] | None = Field(default=None, description="region names per wave, in order; default "
                                          "the first region alone (the canary region), then all the others")
    # strict: a number, never a bool (YAML's `bake_s: true` would be read as 1) nor a string.
    bake_s: float = Field(default=30.0, ge=0, le=86_400, strict=True, description="seconds each wave's regions "
                          "are watched after their rollouts completed, before the next wave starts")
    on_failure: Literal["keep", "rollback"] = Field(
        default="keep", description="what the regions of earlier waves do when a later wave fails: keep the new "
        "version, or roll back to what they served before (the failing region always rolls back)")
    region_start_timeout_s: float = Field(default=120.0, gt=0, le=3600, strict=True, description="how long a wave "
                                          "waits for a region's worker to start its flow run before it reports the "
                                          "region down")
    region_timeout_s: float = Field(default=3600.0, gt=0, strict=True,
                                    description="the longest one region's run may take")

    @model_validator(mode="after")
    def _consistent(self) -> "RegionPlan":
        names = [r.name for r in self.regions]
        if dup := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"regions: {', '.join(dup)} named twice: give each region its own name")
        pools = [r.work_pool for r in self.regions]
        if dup := sorted({p for p in pools if pools.count(p) > 1}):
            raise ValueError(f"regions: work pool {', '.join(dup)} is given to two regions: each region needs a pool "
                             "of its own, or a worker of one region would run another's flow runs")
        if self.waves is not None:
            if not self.waves or any(not w for w in self.waves):
                raise ValueError("waves: a wave names no region: give each wave at least one region, or leave "
                                 "waves out (first region, then the rest)")
            planned = [n for w in self.waves for n in w]
            if unknown := sorted(set(planned) - set(names)):
                raise ValueError(f"waves: unknown region(s) {', '.join(unknown)}; the regions are {', '.join(names)}")
            if twice := sorted({n for n in planned if planned.count(n) > 1}):
                raise ValueError(f"waves: {', '.join(twice)} in more than one wave: each region goes in one wave")
            if missing := [n for n in names if n not in planned]:
                raise ValueError(f"waves: region(s) {', '.join(missing)} in no wave: add them, or remove the "
                                 "region")
        return self

    def wave_plan(self) -> list[list[Region]]:
        """The waves, as regions: the file's ``waves``, or the first region then the rest."""
        by_name = {r.name: r for r in self.regions}
        if self.waves is not None:
            return [[by_name[n] for n in wave] for wave in self.waves]
        first, rest = self.regions[0], self.regions[1:]
        return [[first], rest] if rest else [[first]]

    def region(self, name: str) -> Region:
        """The region named ``name``.

        Raises:
            RegionsError: no such region (the message lists them)."""
        for r in self.regions:
            if r.name == name:
                return r
        raise RegionsError(f"no region {name!r}; the regions are {', '.join(r.name for r in self.regions)}")


def region_settings(region: Region, base: Settings) -> Settings:
    """The settings a region's flow runs get: ``base`` (the stack's) with the region's overrides.

    Raises:
        RegionsError: an override is not a valid value for its setting (naming it)."""
    data = base.model_dump(exclude_unset=True)
    data.update(region.settings, region=region.name, work_pool=region.work_pool)
    try:
        return Settings(**data)
    except ValidationError as e:
        bad = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']} (got {x.get('input')!r})" for x in e.errors())
        raise RegionsError(f"region {region.name}: settings: {bad}") from None


def region_env(region: Region) -> dict[str, str]:
    """The region's overrides as ``MODELOPS_*`` environment variables (JSON for lists and
    dicts, as pydantic-settings reads them), plus ``MODELOPS_REGION`` and
    ``MODELOPS_WORK_POOL``: what its work pool's job variables give each flow run."""
    import json

    env = {"MODELOPS_REGION": region.name, "MODELOPS_WORK_POOL": region.work_pool}
    for key, value in region.settings.items():
        env[f"MODELOPS_{key.upper()}"] = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return env


def _check_distinct(plan: RegionPlan, base: Settings) -> list[Settings]:
    """Each region's settings, refusing two regions that would share a home, an FSx root or a
    local router port (they would overwrite each other's registry, weights or listener)."""
    resolved = [region_settings(r, base) for r in plan.regions]
    # The stack's own listeners on this machine: a region's router may take none of them.
    seen: dict[tuple[str, object], str] = {("router port", base.prefect_port): "the stack (prefect_port)",
                                           ("router port", base.s3_port): "the stack (s3_port)",
                                           ("router port", base.batch_port): "the stack (batch_port)"}
    for region, s in zip(plan.regions, resolved):
        keys = [("home", s.home_dir), ("fsx_root", s.fsx_dir)]
        if s.router == "haproxy":
            if s.router_port == s.router_grpc_port:
                raise RegionsError(f"region {region.name}: router_port and router_grpc_port are both {s.router_port}: "
                                   "give them two ports")
            keys += [("router port", s.router_port), ("router port", s.router_grpc_port)]
        for what, value in keys:
            if (what, value) in seen:
                field = {"home": "home", "fsx_root": "fsx_root"}.get(what, "router_port/router_grpc_port")
                other = seen[(what, value)]
                raise RegionsError(f"{other if other.startswith('the stack') else f'region {other}'} and region "
                                   f"{region.name} share the {what} {value}: give {region.name} its own "
                                   f"(settings.{field})")
            seen[(what, value)] = region.name
    return resolved


def load_regions(base: Settings, path: Path | None = None) -> RegionPlan | None:
    """Read and check the regions file (``path``, default ``base.regions_path``); None when
    there is none (one region: the stack itself).

    Raises:
        RegionsError: not YAML, a field is invalid, or two regions share a home, an FSx root or
            a router port; the message names the field.
    """
    path = path or base.regions_path
    if not path.is_file():
        return None
    try:
        data = load_unique(path.read_text(), str(path))  # a key given twice is refused, not "last one wins"
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise RegionsError(f"{path}: not a readable YAML (UTF-8) file: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise RegionsError(f"{path}: {'is empty' if data is None else 'is not a mapping'}: it needs `regions:`, a list "
                           "of regions with name and work_pool (docs/regions.md)")
    try:
        plan = RegionPlan.model_validate(data)
    except ValidationError as e:
        raise RegionsError(f"{path}: " + "; ".join(
            f"{'.'.join(map(str, x['loc'])) + ': ' if x['loc'] else ''}{x['msg'].removeprefix('Value error, ')}"
            for x in e.errors())) from None
    try:
        _check_distinct(plan, base)
    except RegionsError as e:
        raise RegionsError(f"{path}: {e}") from None
    return plan
