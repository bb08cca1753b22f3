"""Where the tests and the repository are, for tests that start workers or read project files."""

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent  # tests/support: helpers and worker scripts
TESTS = SUPPORT.parent
ROOT = TESTS.parent
