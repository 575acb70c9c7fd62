"""The chat page at / in a real browser against a real server.

Server: the slow ``tidal-test`` model (every step >= 50 ms, so a long answer streams for
minutes), one sequence at a time and no queue: a second request is refused with a 503.

Set TIDAL_UI_SCREENSHOT=docs/ui.png to save the page (after a stop) where docs/ui.md shows it.
"""

from __future__ import annotations

import os
import re

import httpx
import pytest
from live_server import LiveServer, start_all, stop_all
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

API_KEY = "sk-ui-test"
SERVER_FLAGS = ("--model", "tidal-test", "--min-step-time", "0.05", "--max-num-seqs", "1",
                "--max-queued-requests", "0", "--num-kv-blocks", "256", "--engine-threads", "1",
                "--tokenizer-workers", "1")


@pytest.fixture(scope="module")
def servers():
    """The page's server and one that requires an API key, started side by side."""
    pair = [LiveServer(*SERVER_FLAGS), LiveServer(*SERVER_FLAGS, "--api-key", API_KEY)]
    start_all(pair)
    yield pair
    stop_all(pair)


def wait(driver, condition, timeout: float = 20.0):
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition())


def text(driver, css: str) -> str:
    return driver.find_element(By.CSS_SELECTOR, css).text


def last_answer(driver):
    return driver.find_elements(By.CSS_SELECTOR, ".message.assistant")[-1]


def ask(driver, question: str, max_tokens: int) -> None:
    box = driver.find_element(By.ID, "max-tokens")
    box.clear()
    box.send_keys(str(max_tokens))
    driver.find_element(By.ID, "prompt").send_keys(question)
    driver.find_element(By.ID, "send").click()


def wait_answered(driver) -> str:
    """Wait for the last answer to finish; return its stats line (TTFT, tokens, tokens/s)."""
    wait(driver, lambda: not driver.find_elements(By.CSS_SELECTOR, ".message.streaming"))
    return last_answer(driver).find_element(By.CLASS_NAME, "answer-stats").text


def open_page(driver, server: LiveServer) -> None:
    driver.get(server.url + "/")
    wait(driver, lambda: text(driver, "#model") == "tidal-test")  # the /state feed answered


def aborted(metrics: dict[str, float], reason: str) -> float:
    return metrics[f'tidal:requests_aborted_total{{model_name="tidal-test",reason="{reason}"}}']


def kv_bar_fraction(driver) -> float:
    """The KV bar's drawn width over its track's."""
    return driver.execute_script("const bar = document.getElementById('state-kv-bar');"
                                 "return bar.getBoundingClientRect().width / bar.parentElement.clientWidth;")


def test_the_page_connects_on_load_and_has_an_icon(servers, browser):
    open_page(browser, servers[0])
    wait(browser, lambda: text(browser, "#connection") == "connected")  # before any message
    statuses = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "const icon = document.querySelector('link[rel=icon]').href;"
        "Promise.all([icon, '/favicon.ico'].map((url) => fetch(url).then((r) => r.status))).then(done);")
    assert statuses == [200, 200]


def test_a_server_that_needs_a_key_asks_for_it_on_load(servers, browser):
    open_page(browser, servers[1])
    browser.execute_script("sessionStorage.clear()")
    browser.refresh()
    wait(browser, lambda: browser.find_element(By.ID, "key-card").is_displayed())  # before any message
    wait(browser, lambda: text(browser, "#connection") == "not connected")


def test_the_kv_bar_shows_a_few_blocks_of_32768(servers, browser):
    open_page(browser, servers[0])
    fractions = [browser.execute_script(f"return kvBarFraction({used}, 32768)") for used in (0, 1, 8, 64, 32768)]
    assert fractions[0] == 0 and fractions[-1] == 1
    assert 0.05 < fractions[1] < fractions[2] < fractions[3] < 1  # one block is a visible bar; more is longer


def test_chat_streams_and_stop_aborts_the_request_and_frees_its_kv(servers, browser):
    server = servers[0]
    open_page(browser, server)

    ask(browser, "Hello", max_tokens=12)  # a short answer that finishes: usage, TTFT and tokens/s
    stats = wait_answered(browser)
    assert re.fullmatch(r"TTFT \d+ ms · 12 tokens · [\d.]+ tokens/s", stats), stats

    server.wait_idle()
    m0 = server.metrics()
    ask(browser, "Tell me a long story", max_tokens=2000)  # ~100 s at 50 ms a step
    answer = last_answer(browser)
    wait(browser, lambda: len(answer.find_element(By.CLASS_NAME, "text").text) > 20)
    seen = answer.find_element(By.CLASS_NAME, "text").text
    wait(browser, lambda: len(answer.find_element(By.CLASS_NAME, "text").text) > len(seen))  # still arriving
    # the live panel shows the request running and holding KV blocks
    wait(browser, lambda: text(browser, "#state-running") == "1" and not text(browser, "#state-kv").startswith("0 /"))
    m = server.metrics()
    assert m["tidal:num_requests_running"] == 1 and m["tidal:kv_cache_blocks_used"] > 0
    # the KV bar shows those few blocks of 256 (log scale): a linear bar would be under 1% of its track
    wait(browser, lambda: kv_bar_fraction(browser) > 0.1)

    browser.find_element(By.ID, "stop").click()
    wait(browser, lambda: "aborted" in answer.text)
    assert "Stopped. The server aborted the request" in answer.find_element(By.CLASS_NAME, "answer-notice").text
    m = server.wait_idle()  # every KV block free, no request anywhere
    assert aborted(m, "client_cancel") == aborted(m0, "client_cancel") + 1
    assert aborted(m, "client_disconnect") == aborted(m0, "client_disconnect")
    # ...and the page's panel says so: the KV went back, one cancel in the last minute
    wait(browser, lambda: text(browser, "#state-kv").startswith("0 /") and text(browser, "#state-running") == "0")
    wait(browser, lambda: text(browser, '#state-aborted li[data-reason="client_cancel"]') == "client_cancel\n1")
    wait(browser, lambda: kv_bar_fraction(browser) == 0)
    assert not browser.find_element(By.ID, "send").get_attribute("disabled")

    shot = os.environ.get("TIDAL_UI_SCREENSHOT")
    if shot:
        browser.save_screenshot(shot)


def test_full_queue_shows_the_503_and_retry_after(servers, browser):
    server = servers[0]
    open_page(browser, server)
    body = {"model": "tidal-test", "prompt": "hold the only slot", "max_tokens": 2000, "stream": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", server.url + "/v1/completions", json=body) as held:
            assert held.status_code == 200
            lines = held.iter_lines()  # kept: a dropped iterator would close the stream
            next(lines)
            wait(browser, lambda: text(browser, "#state-running") == "1")  # the only slot is taken
            ask(browser, "Hello?", max_tokens=8)
            answer = last_answer(browser)
            wait(browser, lambda: answer.find_elements(By.CSS_SELECTOR, ".answer-notice.error"))
            message = answer.find_element(By.CLASS_NAME, "answer-notice").text
    assert message == "Server busy (503): The request queue is full. Retry after 1 s.", message
    server.wait_idle()
    assert not browser.find_element(By.ID, "send").get_attribute("disabled")


def test_api_key_is_asked_for_then_used(servers, browser):
    server = servers[1]
    open_page(browser, server)
    browser.execute_script("sessionStorage.clear()")
    ask(browser, "Hi", max_tokens=6)
    wait(browser, lambda: browser.find_element(By.ID, "key-card").is_displayed())
    assert "needs an API key" in text(browser, "#key-why")
    assert "401" in last_answer(browser).text
    browser.find_element(By.ID, "api-key").send_keys(API_KEY)
    browser.find_element(By.ID, "key-save").click()
    # the refused message is sent again, with the key, and answered
    wait(browser, lambda: "tokens/s" in last_answer(browser).text)
    assert " · 6 tokens · " in wait_answered(browser)
