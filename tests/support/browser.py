"""Headless Chromium for the browser tests (the web chat, upstream llama.cpp as wasm): Debian's chromium and
chromedriver, driven by selenium without its driver download; `make setup` installs both."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tests.support.native import skip_or_fail


@contextmanager
def headless_chromium(script_timeout_s: float, *extra_args: str) -> Iterator[Any]:
    """A selenium driver of headless Chromium whose async scripts may run ``script_timeout_s``; quit at the end."""
    from selenium import webdriver  # a test dependency (pyproject [test]): missing, the suite fails
    from selenium.webdriver.chrome.service import Service

    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        skip_or_fail("chromium and chromedriver are not installed (`make setup` installs Debian's chromium and "
                     "chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", *extra_args):
        options.add_argument(arg)
    drv = webdriver.Chrome(options=options, service=Service(executable_path=driver))  # no selenium-manager download
    drv.set_script_timeout(script_timeout_s)
    try:
        yield drv
    finally:
        drv.quit()
