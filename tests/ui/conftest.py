"""A real browser for the chat page's tests: Debian's chromium driven by selenium.

Nothing is downloaded: the driver and browser are the system's (apt: chromium
chromium-driver; .ci/run installs them). Without them these tests skip, unless
TIDAL_REQUIRE_BROWSER=1 (set by .ci/run) makes that a failure.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1280,860")


def _system_browser() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


@pytest.fixture(scope="session")
def browser():
    found = _system_browser()
    if found is None:
        message = "chromium and chromedriver are not installed (apt-get install chromium chromium-driver)"
        if os.environ.get("TIDAL_REQUIRE_BROWSER") == "1":
            pytest.fail(message)
        pytest.skip(message)
    os.environ["SE_OFFLINE"] = "true"  # selenium must never try to fetch a browser or driver
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="tidal-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = found[0]
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(found[1]), options=options)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)
