"""What every OpenAI route of one instance shares: the model it serves, the Triton client, the
per-key usage, the shadow mirror, and the checks each request passes first."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from runtime.frontend.errors import InvalidRequest, ModelNotFound
from runtime.frontend.shadow import ShadowMirror
from runtime.frontend.triton import TritonModel
from runtime.frontend.usage import KeyUsage

__all__ = ["Served"]

log = logging.getLogger("modelops.frontend")

_KINDS = {"embed": "an embedding model", "generate": "a generative model"}


@dataclass
class Served:
    """One instance's model: ``model_id`` (the OpenAI ``model`` name), ``version``, ``task``
    (``embed``, ``generate`` or ``tabular``), the usage per key, the shadow mirror, and the
    Triton client, set once the app's lifespan starts (:attr:`triton`)."""

    model_id: str
    version: str
    task: str
    usage: KeyUsage = field(default_factory=KeyUsage)
    mirror: ShadowMirror | None = None
    clients: dict = field(default_factory=dict)  # "triton", "http": made in the app's lifespan

    @property
    def triton(self) -> TritonModel:
        """The client of this instance's Triton model."""
        return self.clients["triton"]

    def check_model(self, name: str, wanted_task: str) -> None:
        """Refuse a request for another model, or for a task this model does not do.

        Raises:
            ModelNotFound: ``name`` is not this instance's model (404).
            InvalidRequest: the model's task is not ``wanted_task`` (400 naming ``model``).
        """
        if name != self.model_id:
            raise ModelNotFound(f"model {name!r} is not served here (this instance serves {self.model_id!r})",
                                "model", "model_not_found")
        if self.task != wanted_task:
            if self.task == "tabular":
                raise InvalidRequest(f"model {self.model_id!r} is a tabular (XGBoost) model: it is served over KServe "
                                     f"v2 (POST /v2/models/{self.model_id}/infer, or gRPC ModelInfer), not the OpenAI "
                                     "API", "model")
            raise InvalidRequest(f"model {self.model_id!r} is {_KINDS[self.task]}; this endpoint needs "
                                 f"{_KINDS[wanted_task]}", "model")

    @staticmethod
    def log_user(kind: str, *ids: str | None) -> None:
        """Log the end-user ids a request names (``user``, ``safety_identifier``), kept for abuse tracing."""
        for ident in ids:
            if ident:
                log.info("%s request for end user %s", kind, ident)
