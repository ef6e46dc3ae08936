"""The web console in a real browser (headless Chromium, driven by Playwright) against the
session's stack: paste a key, stream an answer, stop one, read usage, conversations, stored
completions and keys, run a batch and download its output, a prompt of HTML shown as text, and one tenant seeing
nothing of another's. Each view's
screenshot is saved under .artifacts/console/ (not committed; README shows copies)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import expect, sync_playwright

from tests.conftest import MODEL, SLOW_MODEL
from tests.waiting import wait_for_blocking

pytestmark = pytest.mark.stack

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOTS = Path(__file__).resolve().parents[2] / ".artifacts" / "console"
XSS = "<img src=x onerror=alert(1)>"


def test_the_console_is_served_with_a_strict_content_security_policy(stack):
    page = httpx.get(f"{stack.edge_url}/console/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp and "frame-ancestors 'none'" in csp
    assert "unsafe-inline" not in csp and "<script>" not in page.text  # no inline code to allow
    assert httpx.get(f"{stack.edge_url}/console", timeout=10, follow_redirects=True).url.path == "/console/"
    for missing in ("/console/secrets.txt", "/console/..%2Fapp.py", "/console/index.html.bak"):
        assert httpx.get(f"{stack.edge_url}{missing}", timeout=10).status_code == 404


@pytest.fixture(scope="module")
def browser() -> Iterator:
    if CHROMIUM is None:
        pytest.skip("Chromium is not installed (`make test` installs Debian's chromium with apt-get)")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        yield launched
        launched.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    opened = context.new_page()
    opened.dialogs = []  # any alert() would be a script the page ran from data it showed
    opened.on("dialog", lambda dialog: (opened.dialogs.append(dialog.message), dialog.dismiss()))
    yield opened
    context.close()


def new_key(stack, admin: bool = False, tenant: str | None = None) -> str:
    # In a thread of its own: Playwright's sync API keeps an event loop running in this one.
    made = stack.create_key(tenant or f"console-{uuid.uuid4().hex[:8]}", "standard", admin=admin)
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        return thread.submit(asyncio.run, made).result()


def open_console(page, stack, key: str) -> None:
    page.goto(f"{stack.edge_url}/console/")
    page.fill("#key-input", key)
    page.click("#key-use")
    page.wait_for_selector("#pg-model option", state="attached")


def screenshot(page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


def ask(page, prompt: str, model: str = MODEL) -> None:
    page.select_option("#pg-model", model)
    page.fill("#pg-user", prompt)
    page.click("#pg-send")


def reload_until_shown(page, reload: str, rows: str, what: str) -> None:
    """Click ``reload`` until ``rows`` show (the processors store and bill a turn a moment later)."""
    def shown() -> bool:
        page.click(reload)
        page.wait_for_timeout(500)
        return page.locator(rows).count() > 0

    wait_for_blocking(shown, what=what)


def open_the_conversation(page) -> None:
    """The tenant's one conversation, once the transcripts job has stored it."""
    page.click("nav button[data-tab=conversations]")
    reload_until_shown(page, "#conv-refresh", "#conv-list button", "the conversation to be stored")
    page.click("#conv-list button")
    page.wait_for_selector("#conv-turns .turn")


def test_the_playground_streams_an_answer_and_the_key_stays_in_the_tab(page, stack):
    key = new_key(stack)
    open_console(page, stack, key)
    ask(page, "Say something.")
    expect(page.locator("#pg-state")).to_have_text(re.compile("^done"), timeout=30_000)
    assert page.text_content("#pg-state") == "done: stop"
    assert page.text_content("#pg-output").strip()
    assert "time to first token" in page.text_content("#pg-stats") and "tokens/s" in page.text_content("#pg-stats")
    screenshot(page, "playground")
    assert page.evaluate("document.cookie") == ""  # the key is in session storage, not a cookie
    assert key not in page.url and page.evaluate("sessionStorage.getItem('tokenbus.key')") == key


def test_the_playground_shows_function_calls(page, stack):
    open_console(page, stack, new_key(stack))
    page.fill("#pg-tools", json.dumps([{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]))
    ask(page, "What is the weather in Oslo?")
    expect(page.locator("#pg-state")).to_have_text("done: tool_calls", timeout=30_000)
    (call,) = page.locator("#pg-tool-calls li").all_text_contents()
    name, _, arguments = call.partition("(")
    assert name == "get_weather" and set(json.loads(arguments.removesuffix(")"))) == {"city"}
    page.fill("#pg-tools", "[not json")
    page.click("#pg-send")
    expect(page.locator("#error")).to_have_text("Tools must be a JSON array of tools.")


def test_stop_cancels_a_long_generation(page, stack):
    open_console(page, stack, new_key(stack))
    ask(page, "Tell me a long story.", model=SLOW_MODEL)
    expect(page.locator("#pg-state")).to_have_text("streaming", timeout=30_000)
    page.click("#pg-stop")
    expect(page.locator("#pg-state")).to_have_text("stopped", timeout=10_000)
    stopped_at = page.text_content("#pg-output")
    time.sleep(1.0)
    assert page.text_content("#pg-output") == stopped_at  # nothing more arrives
    assert page.is_enabled("#pg-send") and not page.is_enabled("#pg-stop") and page.is_hidden("#error")
    # The generation itself was cancelled (not merely left to the disconnect grace): its turn is
    # stored as incomplete, with about what was shown, far short of the model's 300 tokens.
    open_the_conversation(page)
    assistant = page.locator("#conv-turns .turn").nth(1)
    assert assistant.locator(".meta").text_content().startswith("assistant · incomplete")
    assert len(assistant.locator(".content").text_content().split()) < 150


def test_html_in_a_prompt_is_shown_as_text_in_conversations_and_runs_nothing(page, stack):
    open_console(page, stack, new_key(stack))
    ask(page, XSS)
    expect(page.locator("#pg-state")).to_have_text(re.compile("^done"), timeout=30_000)
    open_the_conversation(page)
    assert page.locator("#conv-list button").count() == 1  # however often the list was loaded
    turns = page.locator("#conv-turns .turn .content").all_text_contents()
    assert turns[0] == XSS and len(turns) == 2  # the prompt, as typed, and the answer
    assert page.locator("#conv-turns img").count() == 0 and page.dialogs == []
    screenshot(page, "conversations")


def test_stored_completions_are_listed_filtered_shown_as_text_and_deleted(page, stack):
    """A playground answer asked to be stored, and two stored through the API with metadata: the
    Stored view lists them newest first, filters by a metadata pair, shows one's messages (a
    prompt of HTML as text) and answer, and deletes it."""
    key = new_key(stack)
    for topic in ("orders", "refunds"):
        httpx.post(f"{stack.edge_url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                   json={"model": MODEL, "messages": [{"role": "user", "content": f"About {topic}."}],
                         "max_tokens": 8, "store": True, "metadata": {"topic": topic}}).raise_for_status()
    open_console(page, stack, key)
    page.check("#pg-store")
    ask(page, XSS)
    expect(page.locator("#pg-state")).to_have_text(re.compile("^done"), timeout=30_000)
    page.click("nav button[data-tab=stored]")
    expect(page.locator("#st-list button")).to_have_count(3)
    newest = page.locator("#st-list button").first
    newest.click()
    page.wait_for_selector("#st-detail .turn")
    turns = page.locator("#st-detail .turn .content").all_text_contents()
    assert turns[0] == XSS and turns[1] == page.text_content("#pg-output")  # what was asked, and the answer
    assert page.locator("#st-detail img").count() == 0 and page.dialogs == []
    screenshot(page, "stored")

    page.fill("#st-key", "topic")
    page.fill("#st-value", "refunds")
    page.click("#st-show")
    expect(page.locator("#st-list button")).to_have_count(1)
    page.locator("#st-list button").click()
    expect(page.locator("#st-detail .meta").first).to_contain_text("topic=refunds")
    assert page.locator("#st-detail .turn .content").first.text_content() == "About refunds."
    page.click("#st-delete")
    expect(page.locator("#st-list button")).to_have_count(0)
    page.fill("#st-key", "")
    page.click("#st-show")
    expect(page.locator("#st-list button")).to_have_count(2)  # the other two stay
    assert page.is_hidden("#error")


def test_usage_shows_the_request_just_made_with_its_cost(page, stack):
    open_console(page, stack, new_key(stack))
    ask(page, "Bill me.")
    expect(page.locator("#pg-state")).to_have_text(re.compile("^done"), timeout=30_000)
    page.click("nav button[data-tab=usage]")
    reload_until_shown(page, "#usage-show", "#usage-table tbody tr", "the billing rollup")
    cells = page.locator("#usage-table tbody tr").first.locator("td").all_text_contents()
    assert cells[1] == MODEL and cells[2] == "standard" and cells[3] == "1" and float(cells[7]) > 0
    assert 0 <= int(cells[5]) < int(cells[4])  # prompt tokens served from the prefix cache, of the prompt
    assert page.locator("#usage-chart rect").count() == 1
    with page.expect_download() as download:
        page.click("#usage-csv")
    csv = Path(download.value.path()).read_text().splitlines()
    assert csv[0].startswith("bucket,model,tier,requests") and len(csv) == 2 and f",{MODEL},standard,1," in csv[1]
    screenshot(page, "usage")


def test_an_admin_creates_and_revokes_a_key_and_the_revoked_key_is_refused(page, stack):
    open_console(page, stack, new_key(stack, admin=True))
    page.click("nav button[data-tab=keys]")
    page.wait_for_selector("#keys-table tbody tr")
    screenshot(page, "keys")
    page.fill("#keys-rpm", "60")
    page.click("#keys-make")
    page.wait_for_selector("#keys-secret:not([hidden])")
    secret = page.text_content("#keys-secret-value")
    assert secret.startswith("tb-")
    assert httpx.get(f"{stack.edge_url}/v1/models", headers={"Authorization": f"Bearer {secret}"}).status_code == 200
    page.wait_for_selector("#keys-table button[data-key]")
    page.click("#keys-table button[data-key]")
    page.wait_for_selector("#keys-table button[data-key]", state="detached")
    assert "revoked" in page.text_content("#keys-table")
    refused = httpx.get(f"{stack.edge_url}/v1/models", headers={"Authorization": f"Bearer {secret}"})
    assert refused.status_code == 401


def test_a_batch_started_from_a_file_runs_and_its_output_downloads(page, stack, tmp_path):
    requests = tmp_path / "requests.jsonl"
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 8}}
             for i in range(3)]
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    open_console(page, stack, new_key(stack))
    page.click("nav button[data-tab=batches]")
    page.set_input_files("#batch-file", str(requests))
    page.click("#batch-start")
    page.wait_for_selector("#batch-table tbody tr")
    cells = page.locator("#batch-table tbody tr").first.locator("td").all_text_contents()
    assert cells[0].startswith("batch_") and cells[2] == "3"
    reload_until_shown(page, "#batch-refresh", "#batch-table button[data-file=output]", "the batch to complete")
    cells = page.locator("#batch-table tbody tr").first.locator("td").all_text_contents()
    assert cells[1:5] == ["completed", "3", "3", "0"]
    screenshot(page, "batches")
    with page.expect_download() as download:
        page.click("#batch-table button[data-file=output]")
    output = [json.loads(line) for line in Path(download.value.path()).read_text().splitlines()]
    assert [line["custom_id"] for line in output] == ["q0", "q1", "q2"] and download.value.suggested_filename.endswith(
        "_output.jsonl")
    requests.write_text("{not json\n")  # a bad file: the batch fails, its line named
    page.set_input_files("#batch-file", str(requests))
    page.click("#batch-start")
    expect(page.locator("#batch-table tbody tr").first.locator("td").nth(1)).to_contain_text("failed (line 1:")
    assert page.dialogs == [] and page.is_hidden("#error")


def test_one_tenant_sees_nothing_of_another(page, stack):
    first = new_key(stack)
    open_console(page, stack, first)
    page.check("#pg-store")  # (a stored completion of its own, too)
    ask(page, "Mine only.")
    expect(page.locator("#pg-state")).to_have_text(re.compile("^done"), timeout=30_000)
    other_tenant = f"console-{uuid.uuid4().hex[:8]}"
    open_console(page, stack, new_key(stack, tenant=other_tenant))
    page.click("nav button[data-tab=conversations]")
    page.wait_for_timeout(1000)
    assert page.locator("#conv-list button").count() == 0
    page.click("nav button[data-tab=usage]")
    page.click("#usage-show")
    page.wait_for_timeout(1000)
    assert page.locator("#usage-table tbody tr").count() == 0
    page.click("nav button[data-tab=batches]")
    page.wait_for_timeout(1000)
    assert page.locator("#batch-table tbody tr").count() == 0
    page.click("nav button[data-tab=stored]")
    page.wait_for_timeout(1000)
    assert page.locator("#st-list button").count() == 0
    page.click("nav button[data-tab=keys]")
    page.wait_for_selector("#keys-self dd")
    assert other_tenant in page.text_content("#keys-self") and page.is_hidden("#keys-admin")
    assert page.is_hidden("#error")  # nothing shown because nothing is there, not because a call failed
