"""How the router spreads one version's requests over its instances: the manifest's ``routing:``.

Policies (decided here, rendered by each router backend):

- ``prefix-affinity`` (the default): requests that share their first part go to the same
  instance, so its prefix cache (vLLM's automatic prefix caching) holds that part once instead
  of on every instance. A request's affinity keys are the ``X-Session-Id`` header, else the
  body's top-level ``user`` field (one key each), else the raw JSON of its prompt field
  (``messages``, ``prompt``, ``input``, ``text_input``, ``query`` or ``text_1``) cut into
  ``prefix_bytes`` chunks, up to 32: two prompts share as many keys as whole chunks they share
  from the start (a system prompt, then a conversation's earlier turns). A request goes to the
  instance that was sent the longest run of its keys, among the instances whose requests in
  flight stay within ``load_bound`` times their share of all in flight (the bound of
  "Consistent Hashing with Bounded Loads", Mirrokni et al. 2018). A prompt no instance holds goes
  to an instance at most at its share of the requests in flight (no cache to gain anywhere, so no
  load to trade: a backlogged instance takes no new prompt while another is below its share),
  and among those to the one holding the fewest keys for its weight (as SGLang's cache-aware
  router sends a new prefix to its smallest prefix tree), so prompts split by weight; equal matches go to the
  least loaded. An instance remembers every key it was sent, so a prompt that overflows
  its instance is held by two and its later requests go to the less loaded of them. A request
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
        prefix_bytes: prefix-affinity only: the size of the chunks a prompt field's raw JSON is
            matched in (16..65536), up to 32 chunks. About 4 bytes a token: 1024 matches requests
            on their first ~250 tokens, then on every further ~250 they share (a system prompt,
            then a conversation's earlier turns).
        load_bound: prefix-affinity only: the most requests in flight an instance may hold, as a
            multiple of its weighted share of all in flight (+1), and still take a request for a
            prefix it holds (1.01..10); past it the request goes to the best-matching instance
            within the bound, and that one holds the prefix too. The default, 2, lets a prefix's
            instance ride out the swings of a few requests in flight: in one run of bench/fleet.py
            (288 chat requests, concurrency 8, two instances) 2 kept each system prompt on one
            instance (TTFT p50 0.68x round-robin's), where 1.25 spread them over both and
            re-prefilled them (TTFT p50 1.36x round-robin's, prefix-cache hits 0.74 against 0.83).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    policy: RoutingPolicy = "prefix-affinity"
    prefix_bytes: int = Field(default=1024, ge=16, le=65536)
    load_bound: float = Field(default=2.0, ge=1.01, le=10)

    @model_validator(mode="before")
    @classmethod
    def _policy_alone(cls, data: Any) -> Any:
        # `routing: round-robin` is the policy alone.
        if isinstance(data, str):
            return {"policy": data}
        if not isinstance(data, (dict, Routing)):
            raise ValueError(f"got {data!r}: give a policy (routing: prefix-affinity | least-request | round-robin) "
                             "or a mapping (routing: {policy: prefix-affinity, prefix_bytes: 1024, load_bound: 2})")
        return data

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
