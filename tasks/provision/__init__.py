"""provision: start serving capacity for a (model_id, version).

``interface.py`` holds the contract; one file per backend: ``local.py`` (processes on this
machine), ``kubernetes.py`` (Deployments and Services on a cluster); ``task.py`` the Prefect task,
on the backend the settings choose (:mod:`tasks.backends`).
"""

from tasks.provision.interface import Endpoints, Provider
from tasks.provision.kubernetes import KubernetesProvider
from tasks.provision.local import LocalProvider
from tasks.provision.task import provision_task

__all__ = ["Endpoints", "KubernetesProvider", "LocalProvider", "Provider", "provision_task"]
