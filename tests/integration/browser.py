"""A page of a local web UI (Prefect's) rendered in headless Chromium, for UI checks.

``render_page`` drives Debian's ``chromium`` package through Playwright (the ``playwright`` wheel
brings its own driver; no browser is downloaded). The page is a single-page app that loads its data
from the API after the document has loaded, so nothing is read at "load": the helper polls the
rendered text (``document.body.innerText``, whitespace collapsed) until every expected text is
there, then saves a full-page PNG and returns the visible text.

Every request to a host other than the loopback one is aborted: the Prefect V2 UI starts an
analytics client (amplitude.com) whatever the server's analytics setting, and a test should
neither wait on nor talk to the internet.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

__all__ = ["CHROMIUM_ARGS", "RenderTimeout", "chromium_path", "render_page"]

# A fresh profile (--user-data-dir, given by launch_persistent_context) and no background traffic:
# without these Chromium keeps trying Google hosts, noisily and slowly.
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    # CI containers often have a 64 MB /dev/shm; Chromium then crashes on large pages.
    "--disable-dev-shm-usage",
]

_LOCAL = re.compile(r"^(?:https?|wss?)://(?:127\.0\.0\.1|localhost|\[::1\])(?::\d+)?(?:/|$)")


class RenderTimeout(AssertionError):
    """Texts still missing from the rendered page at the deadline (the message lists them)."""


def chromium_path() -> str | None:
    """The Chromium executable: $MODELOPS_CHROMIUM, else `chromium` on PATH (Debian's package)."""
    explicit = os.environ.get("MODELOPS_CHROMIUM")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    return shutil.which("chromium") or (
        "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None)


def _normalize(text: str) -> str:
    return " ".join(text.split())


def render_page(url: str, *, wait_for: Sequence[str], screenshot: Path, timeout_s: float = 60,
                click_text: Sequence[str] = (), viewport: tuple[int, int] = (1400, 1000),
                local_storage: Mapping[str, str] | None = None) -> str:
    """Open ``url`` in headless Chromium and return the page's visible text once it shows every
    text in ``wait_for``.

    Args:
        url: the page (loopback only: other hosts are blocked).
        wait_for: texts that must all appear in the rendered text; whitespace (line breaks, table
            cell tabs) is collapsed on both sides before comparing, case is kept.
        screenshot: where the full-page PNG goes (parent folders are created). Saved on timeout
            too, to show what was there.
        timeout_s: one deadline for loading, every click and every text.
        click_text: elements to click first, in order, each found by its exact visible text
            (a tab such as ``"Artifacts"``, a card such as an artifact key); each click waits for
            its element to appear and become clickable.
        viewport: window size in CSS pixels; the screenshot covers the whole page.
        local_storage: items set in the page's ``localStorage`` before its scripts run (the
            Prefect UI keeps its sign-in there: ``prefect-password``).

    Returns:
        ``document.body.innerText`` of the final page (not normalized).

    Raises:
        RenderTimeout: listing the missing texts, the page's URL and the start of its text.

    Skips the calling test (pytest.skip) when no Chromium executable is installed.
    """
    executable = chromium_path()
    if executable is None:
        pytest.skip("chromium is not installed (apt-get install chromium, or set MODELOPS_CHROMIUM)")
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    deadline = time.monotonic() + timeout_s

    def left_ms() -> float:
        return max(1.0, (deadline - time.monotonic()) * 1000)

    expected = [_normalize(t) for t in wait_for]
    screenshot = Path(screenshot)
    screenshot.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile, sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            profile, executable_path=executable, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": viewport[0], "height": viewport[1]}, service_workers="block")
        console_errors: list[str] = []
        try:
            context.route(lambda u: not _LOCAL.match(u), lambda route: route.abort("blockedbyclient"))
            if local_storage:
                context.add_init_script(f"Object.entries({json.dumps(dict(local_storage))})"
                                        ".forEach(([k, v]) => window.localStorage.setItem(k, v));")
            page = context.pages[0] if context.pages else context.new_page()
            page.on("console", lambda m: console_errors.append(m.text)
                    if m.type == "error" and "ERR_BLOCKED_BY_CLIENT" not in m.text else None)
            page.on("pageerror", lambda e: console_errors.append(f"uncaught: {e}"))
            page.goto(url, timeout=left_ms())
            for text in click_text:
                target = page.get_by_text(text, exact=True).filter(visible=True).first
                try:
                    target.click(timeout=left_ms())
                except PlaywrightTimeout:
                    _fail(page, screenshot, f"no clickable element with the text {text!r}", url, console_errors)
            try:
                page.wait_for_function(
                    """expected => {
                        const text = (document.body ? document.body.innerText : "").split(/\\s+/).join(" ");
                        return expected.every(t => text.includes(t));
                    }""", arg=expected, timeout=left_ms(), polling=200)
            except PlaywrightTimeout:
                have = _normalize(_body_text(page))
                missing = [t for t in expected if t not in have]
                _fail(page, screenshot, f"missing {missing}", url, console_errors)
            page.screenshot(path=str(screenshot), full_page=True)
            return _body_text(page)
        except PlaywrightError as e:
            if isinstance(e, PlaywrightTimeout):
                raise RenderTimeout(f"{url}: {e}") from None
            raise
        finally:
            context.close()


def _body_text(page) -> str:
    return page.evaluate("() => document.body ? document.body.innerText : ''")


def _fail(page, screenshot: Path, what: str, url: str, console_errors: list[str]) -> None:
    from playwright.sync_api import Error as PlaywrightError

    try:
        page.screenshot(path=str(screenshot), full_page=True)
        shot = f"screenshot: {screenshot}"
    except PlaywrightError as e:  # the page may have crashed; the message matters more
        shot = f"no screenshot ({e})"
    try:
        text = _normalize(_body_text(page))
    except PlaywrightError as e:
        text = f"<unreadable: {e}>"
    errors = "".join(f"\n  console: {m[:300]}" for m in console_errors[-5:])
    raise RenderTimeout(f"{what} after the deadline on {page.url} (opened {url}); {shot}\n"
                        f"page text ({len(text)} chars): {text[:1500]!r}{errors}")
