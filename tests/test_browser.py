"""JupyterLab as users meet it, in a real browser.

Starts JupyterLab (``dsv4lab.lab.server_command``) on 127.0.0.1 with a random free port and
a token, serving a scratch copy of the notebooks (so outputs never reach the committed
ones); drives Debian's Chromium with Playwright (the system browser, never a download);
opens 00_tour.ipynb, runs all cells, waits for the kernel to go idle, checks that no cell
shows an error, moves the explorer's concurrency slider and checks that its summary
changed, and saves a screenshot under build/browser/. JupyterLab is shut down whatever
happens. Then it builds `dsv4lab report` (after `dsv4lab run --only 00 --smoke`) and opens
build/html/index.html in the same browser: every executed notebook is listed with its
status, title and summary, every link resolves, and no page shows the NBVAL markers.
Deselect with ``-m 'not browser'``.
"""
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")   # jupyter tooling is absent on some GPU hosts

from dsv4lab import lab

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build"
SHOTS = BUILD / "browser"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
LAB_LOG = SHOTS / "jupyterlab.log"    # the server's log, printed when the tour fails
SUMMARY_SELECTOR = ".widget-html.dsv4lab-anatomy-summary"   # dsv4lab.widgets.tour.SUMMARY_CLASS


def find_chromium() -> Path:
    """Debian's Chromium; apt-get installs it when missing and we may (root, apt-get present)."""
    if CHROMIUM.exists():
        return CHROMIUM
    if shutil.which("apt-get") and hasattr(os, "geteuid") and os.geteuid() == 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (["apt-get", "install", "-y", "-q", "chromium"],
                    ["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "chromium"]):
            subprocess.run(cmd, env=env, capture_output=True, timeout=600)
            if CHROMIUM.exists():
                return CHROMIUM
    pytest.skip("Debian's Chromium (/usr/bin/chromium) is absent and `apt-get install chromium` "
                "was not possible here")


def _get(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read()


def _post(url: str, timeout: float = 5.0):
    req = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status


@pytest.fixture
def jupyterlab(tmp_path):
    """A JupyterLab on a scratch copy of 00_tour; yields (base url, token, work dir)."""
    work = BUILD / "browser" / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    shutil.copy(ROOT / "notebooks" / "00_tour.ipynb", work / "00_tour.ipynb")
    # user settings: render every cell (no windowing, so the DOM holds all outputs) and
    # no news prompt over the page
    settings = tmp_path / "settings" / "@jupyterlab"
    for ext, name, value in (("notebook-extension", "tracker", {"windowingMode": "none"}),
                             ("apputils-extension", "notification", {"fetchNews": "false"})):
        (settings / ext).mkdir(parents=True, exist_ok=True)
        (settings / ext / f"{name}.jupyterlab-settings").write_text(json.dumps(value))
    port, token = lab.free_port(), secrets.token_hex(16)
    cmd = lab.server_command(port, token, work) + [
        f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",
        f"--LabApp.user_settings_dir={tmp_path / 'settings'}"]
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"), "PYTHONUNBUFFERED": "1"}
    LAB_LOG.parent.mkdir(parents=True, exist_ok=True)
    log = LAB_LOG.open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(work),
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited ({proc.returncode}):\n"
                                   + LAB_LOG.read_text()[-3000:])
            try:
                if _get(f"{base}/api/status?token={token}")[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("JupyterLab did not come up in 90 s:\n"
                                   + LAB_LOG.read_text()[-3000:])
            time.sleep(0.5)
        yield base, token, work
    finally:
        try:
            _post(f"{base}/api/shutdown?token={token}")        # shuts its kernels down too
            proc.wait(timeout=20)
        except Exception:
            pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)                  # our own process group
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


@pytest.fixture
def browser():
    chromium = find_chromium()
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(chromium), args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


def _kernels_idle(base: str, token: str) -> bool:
    # While a kernel starts, jupyter_server can answer /api/kernels with a 500 (the kernel's
    # model is not there yet): that is "not idle yet", not a failure.
    try:
        kernels = json.loads(_get(f"{base}/api/kernels?token={token}")[1])
    except urllib.error.HTTPError as e:
        if e.code >= 500:
            return False
        raise
    return bool(kernels) and all(k["execution_state"] == "idle" for k in kernels)


def _wait(cond, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def test_tour_in_jupyterlab_and_the_report(jupyterlab, browser):
    base, token, work = jupyterlab
    SHOTS.mkdir(parents=True, exist_ok=True)
    page = browser.new_page(viewport={"width": 1500, "height": 1000})
    page.set_default_timeout(60_000)
    try:
        _drive_tour(page, base, token, work)
    except Exception:
        page.screenshot(path=str(SHOTS / "00_tour_failure.png"))
        print("JupyterLab's log (tail):\n" + LAB_LOG.read_text()[-4000:], file=sys.stderr)
        raise
    finally:
        page.close()
    _check_report(browser)


def _drive_tour(page, base, token, work):
    page.goto(f"{base}/lab/tree/00_tour.ipynb?token={token}")
    page.locator(".jp-Notebook .jp-Cell").first.wait_for(state="visible", timeout=120_000)
    _wait(lambda: _kernels_idle(base, token), 120, "the kernel to start")
    n_code = sum(c.cell_type == "code" for c in nbformat.read(work / "00_tour.ipynb", as_version=4).cells)

    # Run > Run All Cells
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()

    prompts = page.locator(".jp-CodeCell .jp-InputArea-prompt")

    def all_ran():
        texts = prompts.all_inner_texts()
        return len(texts) == n_code and all(re.search(r"\[\d+\]", t) for t in texts)
    _wait(all_ran, 300, "every code cell to run")
    _wait(lambda: _kernels_idle(base, token), 120, "the kernel to go idle")

    errors = page.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
    tracebacks = [t for t in errors.all_inner_texts() if "Traceback" in t or "Error" in t]
    assert tracebacks == [], f"cells show errors:\n{tracebacks[0][:2000]}"

    # the explorer: a live widget, not its static fallback
    summary = page.locator(SUMMARY_SELECTOR)
    summary.wait_for(state="visible", timeout=60_000)
    summary.scroll_into_view_if_needed()
    before = summary.inner_text()
    assert "concurrency 64" in before, before
    slider = page.locator(".widget-slider", has=page.locator(".widget-label", has_text=re.compile(r"^concurrency$")))
    handle = slider.locator(".noUi-handle").first
    handle.focus()
    page.keyboard.press("ArrowLeft")
    try:
        _wait(lambda: summary.inner_text() != before, 20, "the summary to change (keyboard)")
    except AssertionError:                       # fall back to dragging the handle
        box = handle.bounding_box()
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.mouse.down()
        page.mouse.move(box["x"] - 80, box["y"] + box["height"] / 2, steps=8)
        page.mouse.up()
        _wait(lambda: summary.inner_text() != before, 30, "the summary to change (drag)")
    after = summary.inner_text()
    assert after != before and "concurrency 64" not in after, after
    _wait(lambda: _kernels_idle(base, token), 60, "the kernel to go idle after the slider moved")
    summary.scroll_into_view_if_needed()
    page.screenshot(path=str(SHOTS / "00_tour.png"))

    # save the scratch copy and read it back: no error outputs, every cell executed
    page.locator(".jp-Notebook").first.click()
    page.keyboard.press("Control+s")
    _wait(lambda: _saved_with_outputs(work / "00_tour.ipynb"), 30, "the notebook to be saved")
    nb = nbformat.read(work / "00_tour.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code)
    assert [o for c in code for o in c.outputs if o.output_type == "error"] == []


def _saved_with_outputs(path: Path) -> bool:
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception:
        return False
    return any(c.get("outputs") for c in nb.cells if c.cell_type == "code")


def _check_report(browser):
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    for args in (["run", "--only", "00", "--smoke"], ["report"]):
        proc = subprocess.run([sys.executable, "-m", "dsv4lab.cli", *args], cwd=str(ROOT), env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"dsv4lab {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    executed = BUILD / "notebooks"
    expected = {p.stem for p in executed.glob("*.ipynb")}
    summary = {r["notebook"]: r for r in json.loads((executed / "summary.json").read_text())}
    expected |= set(summary)
    assert "00_tour" in expected

    page = browser.new_page(viewport={"width": 1300, "height": 900})
    js_errors = []
    page.on("pageerror", lambda e: js_errors.append(str(e)))
    try:
        index = BUILD / "html" / "index.html"
        page.goto(index.as_uri())
        rows = page.locator("tr.nb")
        listed = {}
        for i in range(rows.count()):
            row = rows.nth(i)
            listed[row.get_attribute("data-notebook")] = (
                row.locator("td.status").inner_text().strip(),
                row.locator("a").get_attribute("href") if row.locator("a").count() else None)
        assert set(listed) == expected, f"index lists {sorted(listed)}, executed: {sorted(expected)}"
        for name, (status, href) in listed.items():
            assert status in ("pass", "fail"), (name, status)
            if name in summary:
                assert status == summary[name]["status"], name
            if (executed / f"{name}.ipynb").exists():
                assert href, f"{name} has an executed copy but no link"
        assert listed["00_tour"][0] == "pass"
        tour = page.locator('tr.nb[data-notebook="00_tour"]')      # its title and one-line summary
        assert "The tour" in tour.locator("a").inner_text() and tour.locator(".summary").inner_text().strip()
        page.screenshot(path=str(SHOTS / "report_index.png"))
        for name, (_, href) in listed.items():
            if not href:
                continue
            target = (index.parent / href).resolve()
            assert target.is_file(), f"link {href} of {name} does not resolve"
            page.goto(index.as_uri())
            page.locator(f'tr.nb[data-notebook="{name}"] a').click()
            page.wait_for_load_state("load")
            assert page.url == target.as_uri(), (page.url, target)
            assert page.locator(".jp-Notebook, .jp-Cell").count() > 0, f"{href} is not a rendered notebook"
            assert "NBVAL_" not in page.content(), f"{href} shows the notebook tests' markers"
            if name == "00_tour":
                assert "The tour" in page.locator("h1").first.inner_text()
                # the explorer's static fallback stands in for the widget in a static page
                fallback = page.locator(".dsv4lab-anatomy-summary")
                assert fallback.count() == 1 and "tokens/s" in fallback.inner_text()
        assert js_errors == [], js_errors
    finally:
        page.close()
