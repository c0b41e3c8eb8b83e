"""Whether Triton is importable, for tests of the Triton kernels (under the interpreter on CPU).

The test extra installs it; under CI=true a missing Triton fails the import instead of skipping."""

import os

import pytest

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:
    if os.environ.get("CI") == "true":
        raise
    HAVE_TRITON = False

needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install -e '.[test]')")
