"""The daemon's dashboard in headless Chromium (Debian's chromium + chromium-driver): it loads,
shows the simulated arm's state changing, and its e-stop button latches the fault in the node."""

import shutil
import tempfile
import time

import pytest

pytest.importorskip("fastapi")
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e .[test])")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                                reason="needs Debian's chromium and chromium-driver (apt-get install chromium "
                                       "chromium-driver; .ci/run installs them)")

TOKEN = "a1b2c3d4e5f60718293a4b5c6d7e8f90"


@pytest.fixture
def browser():
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1200,900"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def daemon(tmp_path):
    from robopolicy.deploy.daemon import Daemon, load_deploy_config

    (tmp_path / "token").write_text(TOKEN)
    cfg = load_deploy_config("configs/deploy/sim_arm.yaml", [
        "api.port=0", f"api.token_file={tmp_path / 'token'}", "recording.enabled=false", "log_file=null",
        "robot.loop.fifo=false", "robot.driver.kwargs.image_size=48"])
    d = Daemon(cfg)
    try:
        d.start()
        yield d
    finally:
        d.shutdown("test")


def _until(predicate, timeout):
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:  # the page re-renders its elements as it polls
            value = predicate()
        except (NoSuchElementException, StaleElementReferenceException):
            value = None
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not true within {timeout}s")


def test_dashboard_shows_the_arm_moving_and_its_estop_latches(daemon, browser):
    from selenium.webdriver.common.by import By

    browser.get(daemon.api.url + "/")
    cell = lambda: browser.find_element(By.CSS_SELECTOR, '#state td[data-joint="0"]').text  # noqa: E731
    first = _until(lambda: cell() not in ("", "-") and cell(), 10)
    _until(lambda: cell() != first, 10)  # the sine policy moves joint 0: the page follows
    _until(lambda: browser.find_element(By.ID, "ready").text == "ready", 5)
    _until(lambda: browser.find_element(By.ID, "cam-front").get_attribute("naturalWidth") not in (None, "0"), 10)

    browser.find_element(By.ID, "estop").click()  # without the token: refused, nothing latched
    _until(lambda: "401" in browser.find_element(By.ID, "message").text, 5)
    assert daemon.node.fault is None

    browser.find_element(By.ID, "token").send_keys(TOKEN)
    browser.find_element(By.ID, "estop").click()
    fault = _until(lambda: daemon.node.fault, 5)
    assert fault.code == "estop"
    _until(lambda: browser.find_element(By.ID, "fault").text == "FAULT estop", 5)
    _until(lambda: "estop" in browser.find_element(By.ID, "faults").text, 5)
    _until(lambda: browser.find_element(By.ID, "ready").text == "not ready", 5)
