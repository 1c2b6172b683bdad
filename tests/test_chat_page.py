"""The chat page at `/`: served as one self-contained file, and driven in headless Chromium against a live
server (a streamed reply, an error shown, a stopped stream the server aborts)."""

import re
import shutil
import time
from pathlib import Path

import httpx
import pytest
from starlette.testclient import TestClient

from gateway.app import GatewayConfig, build_app
from tests.conftest import free_port, parse_metrics, wait_for_metrics

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
CHROMEDRIVER = shutil.which("chromedriver")


def test_the_page_is_served_whole_and_fetches_nothing_from_elsewhere():
    r = TestClient(build_app(GatewayConfig(api_keys=("k",)))).get("/")  # no key needed for the page itself
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert "<title>Orcinus chat</title>" in page and "/v1/chat/completions" in page
    # No script, style, font or image from another origin: the page must work offline.
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page), "the page loads something from elsewhere"
    assert "@import" not in page and "import(" not in page
    # The API key lives in sessionStorage (this tab) unless "remember" is ticked; the other settings persist.
    assert 'for (const id of ["system", "temperature", "max_tokens"])' in page
    assert "sessionStorage.setItem(KEY" in page and 'id="remember_key"' in page
    assert "localStorage.removeItem(KEY)" in page


@pytest.fixture(scope="module")
def browser(request):
    # Skipped where the browser is missing, with the reason; under --require-browser (.ci/run) a failure instead.
    missing = pytest.fail if request.config.getoption("--require-browser") else pytest.skip
    if CHROMIUM is None or CHROMEDRIVER is None:
        missing(
            "no Chromium and chromedriver here (Debian: apt-get install chromium chromium-driver; "
            ".ci/run installs them)"
        )
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as e:
        missing(f"selenium is not installed (pip install -e '.[test]'): {e}")

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,800"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.implicitly_wait(0)
    yield driver
    driver.quit()


def wait_until(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")


def set_field(driver, field: str, value: str) -> None:
    driver.execute_script(
        "const e = document.getElementById(arguments[0]); e.value = arguments[1];e.dispatchEvent(new Event('change'));",
        field,
        value,
    )


def send(driver, text: str) -> None:
    driver.find_element("id", "prompt").send_keys(text)
    driver.find_element("id", "send").click()


def last_reply(driver):
    replies = driver.find_elements("css selector", ".msg.assistant")
    return replies[-1] if replies else None


def test_chat_in_a_browser_streams_shows_errors_and_stops(browser, server, request, tmp_path):
    metrics = lambda: parse_metrics(httpx.get(f"{server}/metrics").text)
    aborted_before = metrics().get("orcinus_requests_aborted_total", 0.0)
    browser.get(server + "/")
    wait_until(lambda: "model: SmolLM2" in browser.find_element("id", "model").text, 30, "the model's name")

    # One whole turn: the reply streams in and ends with its token count.
    set_field(browser, "temperature", "0")
    set_field(browser, "max_tokens", "8")
    send(browser, "What is the capital of France?")
    wait_until(lambda: last_reply(browser).get_attribute("data-state") == "done", 120, "the first reply")
    first = last_reply(browser).text
    assert re.search(r"\n\d+ tokens, [\d.]+ tok/s, finish: (length|stop)$", first), first
    assert first.split("\n")[0].strip(), "the reply has no text"

    # An error is shown, not swallowed: max_tokens 0 is a 400 in OpenAI's shape.
    set_field(browser, "max_tokens", "0")
    send(browser, "Hello?")
    wait_until(lambda: last_reply(browser).get_attribute("data-state") == "error", 30, "the error")
    assert last_reply(browser).text.startswith("Error 400: "), last_reply(browser).text

    # A long reply, stopped while it streams: the server aborts it and frees its KV blocks.
    set_field(browser, "max_tokens", "400")
    send(browser, "Tell me a long story about a lighthouse keeper and his cat.")
    wait_until(
        lambda: last_reply(browser).get_attribute("data-state") == "streaming" and last_reply(browser).text,
        120,
        "streamed text",
    )
    browser.find_element("id", "stop").click()
    wait_until(lambda: last_reply(browser).get_attribute("data-state") == "stopped", 30, "the stop")
    after = wait_for_metrics(
        metrics,
        lambda m: (
            m.get("orcinus_requests_aborted_total", 0.0) == aborted_before + 1
            and m["orcinus_requests_running"] == 0
            and m["orcinus_kv_blocks_used"] == 0
        ),
        30,
        "the abort in /metrics",
    )
    assert after["orcinus_requests_aborted_total"] == aborted_before + 1
    assert len(browser.find_elements("css selector", ".msg.user")) == 3

    shot = tmp_path / "chat_page.png"
    browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    if request.config.getoption("--screenshots"):
        out = Path(request.config.getoption("--screenshots"))
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, out / "chat_page.png")


@pytest.fixture
def keyed_page():
    """A keyed server without an engine (lifespan off): enough for the page's model name, which /v1/models gives."""
    import threading

    import uvicorn

    port = free_port()
    config = uvicorn.Config(
        build_app(GatewayConfig(api_keys=("sekrit",))), port=port, lifespan="off", log_level="error"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 30, "the server")
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_the_model_name_shows_once_the_key_is_entered(browser, keyed_page):
    browser.get(keyed_page + "/")
    wait_until(lambda: "401" in browser.find_element("id", "model").text, 30, "the 401 without a key")
    set_field(browser, "api_key", "sekrit")
    wait_until(lambda: browser.find_element("id", "model").text == "model: SmolLM2-135M-Instruct", 30, "the name")


def test_an_enter_that_confirms_an_input_method_candidate_sends_nothing(browser, keyed_page):
    browser.get(keyed_page + "/")
    set_field(browser, "prompt", "こんにちは")
    enter = "document.getElementById('prompt').dispatchEvent(new KeyboardEvent('keydown', {key: 'Enter', bubbles: true, isComposing: arguments[0]}))"
    browser.execute_script(enter, True)
    assert browser.find_element("id", "prompt").get_property("value") == "こんにちは"
    assert not browser.find_elements("css selector", ".msg.user")
    browser.execute_script(enter, False)
    wait_until(lambda: browser.find_elements("css selector", ".msg.user"), 30, "the message sent")
    assert browser.find_element("id", "prompt").get_property("value") == ""
