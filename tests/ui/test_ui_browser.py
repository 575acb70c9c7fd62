"""The chat page at / in a real browser against a real server.

Servers: the slow ``tidal-test`` model (every step >= 50 ms, so a long answer streams for
minutes), one sequence at a time and no queue: a second request is refused with a 503; the same
with an API key; and a fast one (5 ms a step: a 3,000-token answer streams at ~200 chunks a
second, faster than a screen refreshes), which the last test stops to see the page notice.

Set TIDAL_UI_SCREENSHOT=docs/ui.png to save the page (after a stop) where docs/ui.md shows it.
"""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest
from live_server import LiveServer, start_all, stop_all
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

API_KEY = "sk-ui-test"
SERVER_FLAGS = ("--model", "tidal-test", "--min-step-time", "0.05", "--max-num-seqs", "1",
                "--max-queued-requests", "0", "--num-kv-blocks", "256", "--engine-threads", "1",
                "--tokenizer-workers", "1")


FAST_FLAGS = ("--model", "tidal-test", "--min-step-time", "0.005", "--max-num-seqs", "2",
              "--num-kv-blocks", "512", "--engine-threads", "1", "--tokenizer-workers", "1")
LONG_ANSWER = 3000


@pytest.fixture(scope="module")
def servers():
    """The page's server, one that requires an API key and a fast one, started side by side."""
    started = [LiveServer(*SERVER_FLAGS), LiveServer(*SERVER_FLAGS, "--api-key", API_KEY), LiveServer(*FAST_FLAGS)]
    start_all(started)
    yield started
    stop_all(started)


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


def new_chat(driver) -> None:
    driver.find_element(By.ID, "clear").click()
    wait(driver, lambda: not driver.find_elements(By.CSS_SELECTOR, ".message"))


def shown_tokens(answer) -> int:
    """The answer's "~N tokens" while it streams (one per chunk drawn), 0 before its first."""
    stats = answer.find_elements(By.CLASS_NAME, "answer-stats")
    found = re.search(r"~?(\d+) tokens", stats[0].text) if stats else None
    return int(found.group(1)) if found else 0


# Watches the page draw: every write of the conversation's scrollTop with the animation-frame
# callback it happened in (null: outside one), the most frame callbacks the page had waiting at once,
# text in an answer changed or removed instead of appended to, and the answer's length at the moment
# Stop is clicked (a capturing listener runs before the page's).
WATCH_DRAWING = """
const watch = window.watch = {scrolls: [], mostWaiting: 0, rewrites: 0, appended: 0, atStop: null};
let frame = null, calls = 0, waiting = 0;
const raf = window.requestAnimationFrame.bind(window);
window.requestAnimationFrame = (draw) => {
  watch.mostWaiting = Math.max(watch.mostWaiting, ++waiting);
  return raf((time) => { waiting -= 1; frame = ++calls; try { draw(time); } finally { frame = null; } });
};
const list = document.getElementById('messages');
const scrollTop = Object.getOwnPropertyDescriptor(Element.prototype, 'scrollTop');
Object.defineProperty(list, 'scrollTop', {configurable: true, get() { return scrollTop.get.call(this); },
  set(value) { watch.scrolls.push(frame); scrollTop.set.call(this, value); }});
new MutationObserver((records) => {
  for (const r of records) {
    const el = r.target.nodeType === Node.ELEMENT_NODE ? r.target : r.target.parentElement;
    if (!el || !el.closest('.message.assistant .text')) continue;
    if (r.type === 'characterData' || r.removedNodes.length) watch.rewrites += 1;
    else watch.appended += r.addedNodes.length;
  }
}).observe(list, {childList: true, characterData: true, subtree: true});
document.addEventListener('click', (event) => {
  if (event.target.id !== 'stop') return;
  const answers = document.querySelectorAll('.message.assistant .text');
  watch.atStop = answers[answers.length - 1].textContent.length;
}, true);
"""


def answer_length(driver) -> int:
    return driver.execute_script("const a = document.querySelectorAll('.message.assistant .text');"
                                 "return a[a.length - 1].textContent.length;")


def visible_in_conversation(driver, element) -> bool:
    """The element is wholly inside the conversation's visible area and the window."""
    return driver.execute_script(
        "const el = arguments[0].getBoundingClientRect();"
        "const list = document.getElementById('messages').getBoundingClientRect();"
        "return el.top >= list.top - 1 && el.bottom <= list.bottom + 1 && el.bottom <= window.innerHeight;",
        element)


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
    wait(browser, lambda: "401" in last_answer(browser).text)  # the card may be up already, from the page's load
    assert browser.find_element(By.ID, "prompt").get_attribute("value") == ""  # sent again with the key, not given back
    browser.find_element(By.ID, "api-key").send_keys(API_KEY)
    browser.find_element(By.ID, "key-save").click()
    # the refused message is sent again, with the key, and answered
    wait(browser, lambda: "tokens/s" in last_answer(browser).text)
    assert " · 6 tokens · " in wait_answered(browser)


def test_a_3000_token_answer_is_appended_once_a_frame_and_stop_works_at_any_point(servers, browser):
    server = servers[2]
    open_page(browser, server)
    browser.execute_script(WATCH_DRAWING)
    # Stop near the start, in the middle and near the end of a 3,000-token answer streaming at
    # ~200 chunks a second: each time the answer stops growing at the click, and the server aborts it.
    for point in (10, 1350, 2700):
        new_chat(browser)  # the next question carries no 3,000-token history
        server.wait_idle()
        m0 = server.metrics()
        ask(browser, "Tell me a very long story", max_tokens=LONG_ANSWER)
        answer = last_answer(browser)
        wait(browser, lambda: shown_tokens(answer) >= point, timeout=120)
        browser.find_element(By.ID, "stop").click()
        wait(browser, lambda: answer.find_elements(By.CSS_SELECTOR, ".answer-notice.stopped")
             and "Stopped." in answer.find_element(By.CLASS_NAME, "answer-notice").text)
        notice = answer.find_element(By.CLASS_NAME, "answer-notice").text
        assert notice == "Stopped. The server aborted the request and freed its KV cache blocks.", (point, notice)
        at_stop = browser.execute_script("return watch.atStop")
        assert at_stop > 0 and answer_length(browser) == at_stop, point  # not one character after the click
        shown = shown_tokens(answer)
        assert point <= shown < LONG_ANSWER, (point, shown)
        m = server.wait_idle()  # the engine let go of every KV block
        assert aborted(m, "client_cancel") == aborted(m0, "client_cancel") + 1, point
        assert m["tidal:generation_tokens_total"] - m0["tidal:generation_tokens_total"] < LONG_ANSWER, point
        assert not browser.find_element(By.ID, "send").get_attribute("disabled")
    watch = browser.execute_script("return watch")
    # drawn by appending: no text of an answer was ever rewritten, only text nodes added
    assert watch["rewrites"] == 0 and watch["appended"] > 0, watch
    # scrolled at most once a frame: only from a frame callback, once in each, one callback waiting at a time
    frames = watch["scrolls"]
    assert frames and None not in frames, frames[:20]
    assert len(frames) == len(set(frames)), "two scrolls in one frame callback"
    assert watch["mostWaiting"] == 1, watch["mostWaiting"]


def test_a_refused_request_shows_its_error_in_view_and_gives_the_question_back(servers, browser):
    server = servers[2]
    open_page(browser, server)
    new_chat(browser)
    ask(browser, "Fill the conversation", max_tokens=800)  # taller than the conversation's box
    wait_answered(browser)
    assert browser.execute_script("const l = document.getElementById('messages');"
                                  "return l.scrollHeight > l.clientHeight + 200;")
    browser.execute_script("document.getElementById('messages').scrollTop = 0")  # reading from the top
    temperature = browser.find_element(By.ID, "temperature")
    temperature.send_keys("5")
    try:
        ask(browser, "And now?", max_tokens=16)
        answer = last_answer(browser)
        wait(browser, lambda: answer.find_elements(By.CSS_SELECTOR, ".answer-notice.error"))
        error = answer.find_element(By.CLASS_NAME, "answer-notice")
        assert error.text.startswith("Error 400: ") and "temperature" in error.text, error.text
        wait(browser, lambda: visible_in_conversation(browser, error))  # where the user looks, not below the fold
        # the refused question is back in the input, to fix the setting and send again
        assert browser.find_element(By.ID, "prompt").get_attribute("value") == "And now?"
        assert not browser.find_element(By.ID, "send").get_attribute("disabled")
    finally:
        temperature.clear()
        browser.find_element(By.ID, "prompt").clear()


def test_the_temperature_is_the_servers_default_until_one_is_typed(servers, browser):
    open_page(browser, servers[0])
    assert browser.find_element(By.ID, "temperature").get_attribute("value") == ""
    body = browser.execute_script("return requestBody()")
    assert "temperature" not in body  # the server applies its own (the model's) default
    browser.find_element(By.ID, "temperature").send_keys("0.2")
    assert browser.execute_script("return requestBody()")["temperature"] == 0.2
    browser.find_element(By.ID, "temperature").clear()


def panel(driver) -> tuple[str, str, str]:
    return text(driver, "#state-status"), text(driver, "#state-running"), text(driver, "#state-kv")


def test_the_server_panel_says_when_the_server_is_unreachable(servers, browser):
    server = servers[2]  # last test on this server: it is stopped here
    open_page(browser, server)
    wait(browser, lambda: panel(browser) == ("", "0", "0 / 512 blocks (0.0%)"))
    # a hung server: /state never answers, and the panel stops showing the last numbers as if live
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        wait(browser, lambda: panel(browser)[0].startswith("unreachable"))
        status, running, kv = panel(browser)
        assert re.fullmatch(r"unreachable \(last answer \d+ s ago\)", status), status
        assert (running, kv) == ("-", "-")
        assert kv_bar_fraction(browser) == 0
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    wait(browser, lambda: panel(browser) == ("", "0", "0 / 512 blocks (0.0%)"))  # live again
    # a stopped server: the same, and the connection pill says so too
    server.stop()
    wait(browser, lambda: panel(browser)[0].startswith("unreachable") and panel(browser)[1:] == ("-", "-"))
    wait(browser, lambda: text(browser, "#connection") == "not connected")
