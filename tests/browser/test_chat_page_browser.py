"""The chat page at ``/`` in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``) driven by selenium, against the server as a user runs it, with the
default model and an API key.

``nox -s browser`` installs what these need and runs them; the default test run leaves
them out (the ``browser`` marker). With ``FURNACE_CHAT_SCREENSHOT=docs/images/chat.png``
the conversation test saves the README's screenshot.

Greedy decoding (temperature 0, set in the page's settings) makes the answers of the
135M model fixed, so what they contain can be asserted; the polling below is bounded and
paced, and no assertion is about how long something took.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import httpx
import pytest

from ..served_process import SERVE, ServedProcess, serve_process

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

pytestmark = pytest.mark.browser

KEY = "browser-test-key"
MODEL = "SmolLM2-135M-Instruct"
#: The greedy answer repeats the tag (checked: '<img src="x" onerror="window.xss=1" />...').
INJECTION = "Say this HTML tag back to me: <img src=x onerror=window.xss=1>"
STORY = "Write a very long story about a dragon."
STATS = re.compile(r"(\d+) tokens? · ([\d.]+) tok/s · (\d+) of (\d+) prompt tokens cached")
T = TypeVar("T")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedProcess]:
    logs = tmp_path_factory.mktemp("server")
    # The page sends no max_tokens: a turn reserves KV up to the context, capped here so
    # that it fits the test server's small cache.
    env = {"FURNACE_API_KEY": KEY, "FURNACE_MAX_CONTEXT": "2048"}
    with serve_process(SERVE, logs, env) as served:
        yield served


@pytest.fixture(scope="module")
def driver() -> Iterator[WebDriver]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(argument)  # --no-sandbox: Chromium refuses to run as root without
    options.add_argument("--window-size=1000,720")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    browser = webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))
    try:
        yield browser
    finally:
        browser.quit()


@pytest.fixture
def page(server: ServedProcess, driver: WebDriver) -> Iterator[WebDriver]:
    """The page with the key given, a new chat, greedy decoding; afterwards, no violation
    of the Content-Security-Policy was reported (an inline script or style, say)."""
    driver.get(server.url)
    driver.execute_script(
        f"sessionStorage.clear(); sessionStorage.setItem('furnace-trio.api-key', '{KEY}')"
    )
    driver.refresh()
    wait(driver, lambda d: d.find_element("id", "model").text == MODEL, "the model name")
    driver.find_element("css selector", ".settings summary").click()
    driver.find_element("id", "temperature").send_keys("0")
    yield driver
    violations = [e for e in driver.get_log("browser") if "Content Security Policy" in e["message"]]
    assert not violations


def wait(
    driver: WebDriver, condition: Callable[[WebDriver], T], what: str, timeout_s: float = 120
) -> T:
    """The first truthy ``condition(driver)``, polled every 50 ms; fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition(driver)):
        assert time.monotonic() < deadline, f"{what}: not reached in {timeout_s} s"
        time.sleep(0.05)
    return value


def last_answer(driver: WebDriver) -> dict[str, str]:
    """The last answer's state (streaming, done, stopped, error), text and stats line."""
    return driver.execute_script(  # type: ignore[no-any-return]
        """
        const answers = document.querySelectorAll("#conversation .message.assistant");
        const last = answers[answers.length - 1];
        return last === undefined ? null : {
            state: last.dataset.state,
            text: last.querySelector(".text").textContent,
            stats: last.querySelector(".stats").textContent,
        };
        """
    )


def ask(driver: WebDriver, question: str) -> dict[str, str]:
    """Type ``question`` and Enter; wait for the answer to finish."""
    from selenium.webdriver.common.keys import Keys

    before = count_messages(driver)
    driver.find_element("id", "message").send_keys(question + Keys.ENTER)
    wait(driver, lambda d: count_messages(d) == before + 2, "the question and its answer box")
    answer = wait(driver, lambda d: _finished(last_answer(d)), f"the answer to {question!r}")
    assert answer["state"] == "done", answer
    return answer


def _finished(answer: dict[str, str] | None) -> dict[str, str] | None:
    return answer if answer is not None and answer["state"] != "streaming" else None


def count_messages(driver: WebDriver) -> int:
    return len(driver.find_elements("css selector", "#conversation .message"))


def messages(driver: WebDriver) -> list[tuple[str, str]]:
    return [
        (m.get_attribute("class").split()[1], m.find_element("css selector", ".text").text)
        for m in driver.find_elements("css selector", "#conversation .message")
    ]


def metrics(server: ServedProcess) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    return {
        name: float(value)
        for name, value in re.findall(r"^(furnace_[a-z_]+(?:\{[^}]*\})?) (\S+)$", text, re.M)
    }


def session_id(driver: WebDriver) -> str:
    return driver.execute_script("return sessionStorage.getItem('furnace-trio.session')")  # type: ignore[no-any-return]


def api(server: ServedProcess) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"})


def test_the_page_asks_for_the_api_key(server: ServedProcess, driver: WebDriver) -> None:
    driver.get(server.url)
    driver.execute_script("sessionStorage.clear()")
    driver.refresh()
    form = driver.find_element("id", "key-form")
    wait(driver, lambda d: form.is_displayed(), "the key form after the API's 401")
    assert driver.find_element("id", "model").text == "API key needed"
    driver.find_element("id", "api-key").send_keys("wrong-key\n")
    wait(
        driver, lambda d: "Incorrect" in d.find_element("id", "key-error").text, "the 401's message"
    )
    driver.find_element("id", "api-key").send_keys(KEY + "\n")
    wait(driver, lambda d: d.find_element("id", "model").text == MODEL, "the model name")
    assert not form.is_displayed()
    assert driver.execute_script("return sessionStorage.getItem('furnace-trio.api-key')") == KEY


def test_a_conversation_is_a_session(server: ServedProcess, page: WebDriver) -> None:
    """Enter sends and Shift+Enter does not; answers stream in with their figures; the
    second turn reuses the first one's KV (cached tokens); a reload shows it again."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    box = page.find_element("id", "message")
    ActionChains(page).click(box).send_keys("one").key_down(Keys.SHIFT).send_keys(
        Keys.ENTER
    ).key_up(Keys.SHIFT).send_keys("two").perform()
    assert box.get_property("value") == "one\ntwo" and count_messages(page) == 0
    box.clear()

    first = ask(page, "What is the capital of France?")
    assert "Paris" in first["text"]
    tokens, rate, cached, prompt = STATS.search(first["stats"]).groups()  # type: ignore[union-attr]
    assert int(tokens) > 1 and float(rate) > 0 and int(cached) == 0 and int(prompt) > 0
    second = ask(page, "What is it famous for?")
    _, _, cached, prompt = STATS.search(second["stats"]).groups()  # type: ignore[union-attr]
    assert 0 < int(cached) < int(prompt)  # the first turn's KV, kept by the session

    shown = messages(page)
    assert [role for role, _ in shown] == ["user", "assistant", "user", "assistant"]
    with api(server) as http:
        kept = http.get(f"/v1/sessions/{session_id(page)}").json()
    assert [m["content"] for m in kept["messages"]] == [text for _, text in shown]
    if screenshot := os.environ.get("FURNACE_CHAT_SCREENSHOT"):
        Path(screenshot).parent.mkdir(parents=True, exist_ok=True)
        assert page.save_screenshot(screenshot)
    page.refresh()
    wait(page, lambda d: messages(d) == shown, "the conversation again after a reload")


def test_model_output_is_text(page: WebDriver) -> None:
    """A tag in the model's answer (and in the question) shows as text: the answer's box
    holds one Text node, no element was made from it, and its handler never ran."""
    answer = ask(page, INJECTION)
    assert "<img" in answer["text"] and "onerror" in answer["text"], answer
    assert messages(page)[0] == ("user", INJECTION)
    created = page.execute_script(
        """
        const boxes = [...document.querySelectorAll("#conversation .text")];
        return {
            nodes: boxes.map((box) => [...box.childNodes].map((n) => n.nodeType)),
            elements: [...document.querySelectorAll("#conversation *")].map((e) => e.className),
            images: document.images.length,
            xss: window.xss === undefined ? null : window.xss,
        };
        """
    )
    assert created["nodes"] == [[3], [3]]  # Node.TEXT_NODE, one in each box
    assert set(created["elements"]) == {"message user", "message assistant", "text", "stats"}
    assert created["images"] == 0 and created["xss"] is None


def test_stop_frees_the_sequence(server: ServedProcess, page: WebDriver) -> None:
    """The answer grows across polls; Stop aborts the request (a disconnect) and the
    server frees the sequence; the stopped turn is not kept, and the next one runs."""
    before = metrics(server)
    page.find_element("id", "message").send_keys(STORY + "\n")
    lengths: list[int] = []

    def grown(driver: WebDriver) -> bool:
        answer = last_answer(driver)
        assert answer is not None and answer["state"] == "streaming", answer
        if not lengths or len(answer["text"]) > lengths[-1]:
            lengths.append(len(answer["text"]))
        return len(lengths) >= 4

    wait(page, grown, "the answer growing across polls")
    assert lengths[0] < lengths[1] < lengths[2] < lengths[3]
    assert metrics(server)["furnace_requests_running"] == 1
    page.find_element("id", "stop").click()
    stopped = wait(page, lambda d: _finished(last_answer(d)), "the stopped answer")
    assert stopped["state"] == "stopped" and len(stopped["text"]) >= lengths[-1]
    freed = wait(
        page,
        lambda d: (m := metrics(server))["furnace_requests_running"] == 0 and m,
        "running sequences back to 0",
        timeout_s=30,
    )
    aborted = 'furnace_requests_total{outcome="aborted"}'
    assert freed[aborted] == before.get(aborted, 0) + 1
    with api(server) as http:
        kept = http.get(f"/v1/sessions/{session_id(page)}").json()
    assert kept["turns"] == 0 and kept["messages"] == []  # the stopped turn left nothing
    assert "Paris" in ask(page, "What is the capital of France?")["text"]


def test_new_chat_forgets_the_session(server: ServedProcess, page: WebDriver) -> None:
    ask(page, "What is the capital of France?")
    old = session_id(page)
    page.find_element("id", "new-chat").click()
    assert count_messages(page) == 0 and session_id(page) != old
    with api(server) as http:
        wait(
            page,
            lambda d: http.get(f"/v1/sessions/{old}").status_code == 404,
            "the old session deleted",
            timeout_s=30,
        )
    answer = ask(page, "What is the capital of France?")
    _, _, cached, _ = STATS.search(answer["stats"]).groups()  # type: ignore[union-attr]
    assert session_id(page) != old and int(cached) >= 0
