"""runtime.engine.openai_engine's request limits (modelops.limits) and a request's budget: counted over
every prompt before the first reaches the engine, and its prompts taking turns in its slots."""

from __future__ import annotations

import asyncio

import pytest

from runtime.engine.openai_engine import RequestLimits, ServingOptions, _Budget

LIMITS = RequestLimits(tokens=6000, slots=4, share=0.5, max_num_seqs=8)


def test_limits_resolve_from_the_serving_options():
    assert RequestLimits.of(ServingOptions("m"), max_model_len=2048, max_num_seqs=16) == \
        RequestLimits(tokens=4 * 2048, slots=8, share=0.5, max_num_seqs=16)  # the defaults: 4 contexts, half
    assert RequestLimits.of(ServingOptions("m", max_request_tokens=100, max_request_share=0.1), 2048, 4).slots == 1


def test_a_request_at_the_budget_passes_and_one_token_over_is_named():
    assert LIMITS.over_tokens(6000, 1, "max_tokens") == ""
    why = LIMITS.over_tokens(6001, 3, "max_completion_tokens")
    assert "6001 tokens of work" in why and "at most 6000" in why and "over 3 prompts" in why
    assert "lower max_completion_tokens or n, or send fewer prompts" in why
    assert LIMITS.over_slots(4) == "" and "n=5 needs 5 of this engine's 8 sequence slots" in LIMITS.over_slots(5)


def test_the_budget_sums_every_prompt_and_refuses_n_before_tokens():
    budget = _Budget(LIMITS)
    for _ in range(3):
        budget.count(prompt_tokens=10, n=2, max_tokens=1000)
    assert budget.tokens == 3 * (10 + 2 * 1000) == 6030 and budget.prompts == 3
    message, field = budget.refusal(2, "max_tokens")
    assert field == "max_tokens" and "6030 tokens" in message and "over 3 prompts" in message
    assert budget.refusal(5, "max_tokens")[1] == "n"
    ok = _Budget(LIMITS)
    ok.count(10, 2, 2995)
    assert ok.refusal(2, "max_tokens") is None  # exactly 6000


def test_a_list_of_prompts_never_holds_more_than_its_slots():
    async def run() -> list[int]:
        budget, peak = _Budget(LIMITS), []

        async def prompt(n: int) -> None:
            await budget.hold(n)
            peak.append(budget.in_use)
            await asyncio.sleep(0.01)
            budget.release(n)

        await asyncio.gather(*(prompt(2) for _ in range(5)), prompt(4), prompt(1))
        return peak

    peak = asyncio.run(run())
    assert len(peak) == 7 and max(peak) == 4


@pytest.mark.parametrize("n", [1, 4])
def test_a_prompt_that_fits_alone_is_never_starved(n):
    async def run() -> None:
        budget = _Budget(LIMITS)
        await budget.hold(4)
        waiter = asyncio.ensure_future(budget.hold(n))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        budget.release(4)
        await asyncio.wait_for(waiter, 1)

    asyncio.run(run())


def test_kserve_generate_is_held_to_the_context_n_and_the_budget_before_the_engine():
    """A null max_tokens is the rest of the context (the engine's reading), not 0."""
    from runtime.engine.openai_engine import OpenAIServer

    server = object.__new__(OpenAIServer)
    server._tokenizer = type("Tok", (), {"encode": staticmethod(lambda text: list(range(len(text.split()))))})()
    server.limits, server.max_model_len = RequestLimits(tokens=300, slots=4, share=0.5, max_num_seqs=8), 512
    prompt = "one two three"  # 3 tokens
    assert server.kserve_refusal(prompt, {"max_tokens": 297}) == ""  # exactly the budget
    assert "300" in server.kserve_refusal(prompt, {"max_tokens": 298}) and "301 tokens" in \
        server.kserve_refusal(prompt, {"max_tokens": 298})
    assert "512 tokens of work" in server.kserve_refusal(prompt, {"max_tokens": None})  # 3 + 509: over 300
    assert "maximum context length is 512" in server.kserve_refusal(prompt, {"max_tokens": 510})
    assert server.kserve_refusal(prompt, {}) == ""  # vLLM's default, 16
    for bad in ("10", 1000.0, 0, -3, True):
        assert "sampling_parameters.max_tokens" in server.kserve_refusal(prompt, {"max_tokens": bad})
    for n in (2, 0, True, "1"):
        assert "sampling_parameters.n" in server.kserve_refusal(prompt, {"n": n})
