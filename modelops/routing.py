"""How the router spreads one version's requests over its instances: the manifest's ``routing:``.

Policies (decided here, rendered by each router backend):

- ``prefix-affinity`` (the default): requests that share their first part go to the same
  instance, so its prefix cache (vLLM's automatic prefix caching) holds that part once instead
  of on every instance. The affinity key is, in order: the ``X-Session-Id`` header, the body's
  top-level ``user`` field, else the first ``prefix_bytes`` bytes of the raw JSON of the prompt
  field (``messages``, ``prompt``, ``input``, ``text_input``, ``query`` or ``text_1``). A key
  seen first goes to the least loaded instance (fewest requests in flight for its weight) and
  stays there while that instance's requests in flight stay within ``load_bound`` times its
  share of all in flight (the bound of "Consistent Hashing with Bounded Loads", Mirrokni et al.
  2018); past the bound the key moves to the least loaded instance and stays there. A request
  with no key goes to the least loaded instance. An instance that fails its readiness check, is
  drained or weighs 0 takes nothing: its keys move at once. Over KServe gRPC (protobuf the router
  does not read) only ``x-session-id`` keys a call.
- ``least-request``: the instance with the fewest requests in flight.
- ``round-robin``: in turn, whatever the request.

While a red-black shift splits a model's traffic between versions, the router's weighted route
balances round-robin so each version's share stays exact; the policy applies to every route that
holds one version (the steady state and ``X-Model-Version`` pins).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

__all__ = ["AFFINITY_FIELDS", "Routing", "RoutingPolicy"]

RoutingPolicy = Literal["prefix-affinity", "least-request", "round-robin"]

# The request fields whose raw JSON starts the affinity key, one per API: chat, completions,
# embeddings/classify, KServe generate, rerank/score.
AFFINITY_FIELDS = ("messages", "prompt", "input", "text_input", "query", "text_1")


class Routing(BaseModel):
    """A model's balancing policy among the instances of one version (see the module docstring);
    ``routing: <policy>`` is short for ``routing: {policy: <policy>}``.

    Fields:
        policy: ``prefix-affinity`` | ``least-request`` | ``round-robin``.
        prefix_bytes: prefix-affinity only: how many bytes of the prompt field's raw JSON make
            the key (16..65536). About 4 bytes a token: 1024 keys on the first ~250 tokens, so
            requests that share a system prompt or a conversation's first turn meet.
        load_bound: prefix-affinity only: the most requests in flight an instance may hold, as a
            multiple of its weighted share of all in flight (+1), before a key placed on it moves
            to the least loaded instance (1.01..10). The default, 2, keeps keys home through the
            swings of a few requests in flight: replaying bench/fleet.py's 288 chat requests at
            concurrency 8 over two instances, 1.25 sent 17 of the 24 system prompts to both
            instances, 2 sent each to one (instance loads 54/46 %).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    policy: RoutingPolicy = "prefix-affinity"
    prefix_bytes: int = Field(default=1024, ge=16, le=65536)
    load_bound: float = Field(default=2.0, ge=1.01, le=10)

    @model_validator(mode="before")
    @classmethod
    def _policy_alone(cls, data: Any) -> Any:
        # `routing: round-robin` is the policy alone.
        return {"policy": data} if isinstance(data, str) else data

    @model_validator(mode="after")
    def _settings_of_the_policy(self) -> "Routing":
        if self.policy != "prefix-affinity":
            for name in _AFFINITY_SETTINGS:
                # A default value is what a dump of this model holds (a registry written before
                # _dump dropped them): only a setting someone changed is refused.
                if name in self.model_fields_set and getattr(self, name) != type(self).model_fields[name].default:
                    raise ValueError(f"{name} is a setting of policy prefix-affinity; policy {self.policy} has "
                                     f"none (remove it)")
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler) -> dict:
        # Another policy's dump holds only its policy, so it validates again (the registry
        # stores manifests as JSON and reads them back on `modelops up`).
        data = handler(self)
        if self.policy != "prefix-affinity":
            for name in _AFFINITY_SETTINGS:
                data.pop(name, None)
        return data


_AFFINITY_SETTINGS = ("prefix_bytes", "load_bound")
