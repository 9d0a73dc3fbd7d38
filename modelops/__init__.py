"""modelops core: manifest schema, registry, settings and the runtime pin.

No Prefect and no vLLM imports here: the control-plane tasks (``tasks``), flows (``flows``)
and the serving runtime (``runtime``) build on this package, never the other way round.
"""

from importlib import import_module

# Resolved on first use (PEP 562), so the serving runtime can import the schema modules it
# shares with the control plane (archive, io_contract) without SQLAlchemy or Prefect.
_EXPORTS = {
    "HealthCheckError": "modelops.errors",
    "ManifestError": "modelops.errors",
    "MaterializeError": "modelops.errors",
    "ModelopsError": "modelops.errors",
    "PackageError": "modelops.errors",
    "ProvisionError": "modelops.errors",
    "RuntimeImageError": "modelops.errors",
    "TrafficError": "modelops.errors",
    "Manifest": "modelops.manifest",
    "load_manifest": "modelops.manifest",
    "parse_manifest": "modelops.manifest",
    "Registry": "modelops.registry",
    "Settings": "modelops.settings",
    "get_settings": "modelops.settings",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'modelops' has no attribute {name!r}")


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
