import os

# Headless rendering for every test (EGL through Mesa on machines without a GPU).
os.environ.setdefault("MUJOCO_GL", "egl")

import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

ISOLATED = os.environ.get("ROBOPOLICY_TEST_ISOLATED") == "1"
"""True inside a test process started by :func:`run_isolated`."""

only_isolated = pytest.mark.skipif(not ISOLATED, reason="runs in a process of its own (its *_in_a_fresh_process twin)")


def run_isolated(test_file: str, name: str, timeout: float = 600) -> None:
    """Run one test of ``test_file`` in a fresh Python process and fail with its output if it fails.
    For tests that kill Ray workers by their process titles: after many other tests in one
    process, the workers' titles are not always found, and the kill is missed."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{test_file}::{name}"]
    env = {**os.environ, "ROBOPOLICY_TEST_ISOLATED": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(test_file))))
    assert done.returncode == 0, f"{name} failed in its own process:\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
