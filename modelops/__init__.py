"""modelops core: manifest schema, registry, settings and the runtime pin.

No Prefect and no vLLM imports here: the control-plane tasks (``tasks``), flows (``flows``)
and the serving runtime (``runtime``) build on this package, never the other way round.
"""

from modelops.errors import (
    HealthCheckError,
    ManifestError,
    MaterializeError,
    ModelopsError,
    PackageError,
    ProvisionError,
    RuntimeImageError,
    TrafficError,
)
from modelops.manifest import Manifest, load_manifest, parse_manifest
from modelops.registry import Registry
from modelops.settings import Settings, get_settings

__all__ = [
    "HealthCheckError",
    "Manifest",
    "ManifestError",
    "MaterializeError",
    "ModelopsError",
    "PackageError",
    "ProvisionError",
    "Registry",
    "RuntimeImageError",
    "Settings",
    "TrafficError",
    "get_settings",
    "load_manifest",
    "parse_manifest",
]
