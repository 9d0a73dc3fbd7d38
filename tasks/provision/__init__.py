"""provision: start serving capacity for a (model_id, version).

``interface.py`` holds the contract; one file per backend: ``local.py`` (processes on this
machine), ``kubernetes.py`` (Deployments and Services on a cluster); ``task.py`` the Prefect task,
on the backend the settings choose (:mod:`tasks.backends`).

The backends and the task are imported on first use: ``modelops status`` reads instances through
the interface and should not pay for Prefect's and the Kubernetes client's imports (about 2.5 s of
CPU each call here).
"""

from tasks.provision.interface import Endpoints, Provider

__all__ = ["Endpoints", "KubernetesProvider", "LocalProvider", "Provider", "provision_task"]

_LAZY = {"KubernetesProvider": "tasks.provision.kubernetes", "LocalProvider": "tasks.provision.local",
         "provision_task": "tasks.provision.task"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
