"""The quick test tier: `pytest -m method test_setdiff.py` runs the method's invariants (the
tests of test_setdiff.py's sections before its checkpoint tests: orders, schedule, masks,
network, loss and bound, sampler) in seconds on a CPU, for a forker changing the method. A test
added to those sections joins the tier by where it stands: no marker to remember. CI runs
every test."""

from pathlib import Path

import pytest

# The first banner after the method's sections, in test_setdiff.py
CHECKPOINTS = "# ---- checkpoints"


def method_end() -> int:
    """The 0-based line of test_setdiff.py where the method's sections end."""
    text = Path(__file__).with_name("test_setdiff.py").read_text()
    lines = text.splitlines()
    return next(i for i, line in enumerate(lines) if line.startswith(CHECKPOINTS))


def pytest_collection_modifyitems(items):
    """Marks `method` every test defined before the checkpoint tests. (The compiled sampler's
    tests stand after them, as compiling stands after the method in setdiff.py: a torch.compile
    capture takes 10-30 s on a CPU.)"""
    end = method_end()
    for item in items:
        path, line, _ = item.location  # line: the test's def, 0-based
        ours = Path(path).name == "test_setdiff.py"
        if ours and line < end:
            item.add_marker(pytest.mark.method)
