"""Exceptions raised by modelops.

Hierarchy::

    ModelopsError
    ├── ManifestError        the announcement is invalid (a field, the source, the weights)
    ├── MaterializeError     weights could not be copied or verified onto the FSx cache
    ├── RuntimeImageError    the pinned runtime could not be resolved, built or probed
    ├── PackageError         the Triton model repository entry could not be written
    ├── ProvisionError       serving capacity did not start
    │   └── ModelLoadError   the instance exited while loading the model (not retried)
    ├── HealthCheckError     a started instance failed a readiness or smoke check
    ├── TrafficError         the router refused a weight change
    └── RegistryError        the registry database cannot be opened

Every message names the field, object or process at fault and what to do about it.
"""

__all__ = [
    "HealthCheckError",
    "ManifestError",
    "ModelLoadError",
    "MaterializeError",
    "ModelopsError",
    "PackageError",
    "ProvisionError",
    "RegistryError",
    "RuntimeImageError",
    "TrafficError",
]


class ModelopsError(Exception):
    """Base class of every error modelops raises on purpose."""


class ManifestError(ModelopsError, ValueError):
    """The model announcement is invalid; nothing has been changed."""


class MaterializeError(ModelopsError):
    """Weights could not be listed, transferred or verified."""


class RuntimeImageError(ModelopsError):
    """The runtime environment could not be built or failed its probe."""


class PackageError(ModelopsError):
    """The model package (Triton model repository entry) could not be written."""


class ProvisionError(ModelopsError):
    """A serving instance did not start or exited early."""


class ModelLoadError(ProvisionError):
    """The serving instance exited while loading the model; the message quotes the cause."""


class HealthCheckError(ModelopsError):
    """A serving instance is up but not healthy."""


class TrafficError(ModelopsError):
    """The router could not be configured."""


class RegistryError(ModelopsError):
    """The registry database cannot be opened as one; the message names the file and the way out."""
