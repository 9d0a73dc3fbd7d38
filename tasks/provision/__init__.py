"""provision: start serving capacity for a (model_id, version).

``interface.py`` holds the contract; one file per backend (``local.py`` here).
"""

from tasks.provision.interface import Endpoints, Provider
from tasks.provision.local import LocalProvider, deprovision_task, provision_task

__all__ = ["Endpoints", "LocalProvider", "Provider", "deprovision_task", "provision_task"]
