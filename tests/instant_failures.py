"""A pytest plugin (loaded by ``tests/conftest.py``): each failure's test and error line as soon as it fails,
besides pytest's report at the end, so a run cut short (a device call's time limit, a CI timeout) still says which
test failed and why."""

from __future__ import annotations

import pytest

_CONFIG: list[pytest.Config] = []


def pytest_configure(config: pytest.Config) -> None:
    _CONFIG.append(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    _CONFIG.remove(config)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not report.failed or not _CONFIG:
        return
    terminal = _CONFIG[-1].pluginmanager.get_plugin("terminalreporter")
    if terminal is None:
        return
    crash = getattr(report.longrepr, "reprcrash", None)
    message = crash.message if crash is not None else (report.longreprtext.strip().splitlines() or [""])[-1]
    terminal.write_line("")
    terminal.write_line(f"FAILED {report.nodeid} ({report.when}): {message[:500]}", red=True)
