"""The quick test tier: `pytest -m method test_setdiff.py` runs the method's invariants (the
tests of test_setdiff.py's sections before its checkpoint tests: orders, schedule, masks,
network, loss and bound, sampler) in seconds on a CPU, for a forker changing the method. A test
added to those sections joins the tier by where it stands: no marker to remember. CI runs
every test."""

from pathlib import Path

import pytest

# The first banner after the method's sections, in test_setdiff.py
CHECKPOINTS = "# ---- checkpoints"
# NOTE: left out: a torch.compile capture takes 10-30 s on a CPU (the full suite runs them)
SLOW = ("test_a_compiled_sampler_draws_the_eager_tokens",)


def method_end() -> int:
    """The 0-based line of test_setdiff.py where the method's sections end."""
    text = Path(__file__).with_name("test_setdiff.py").read_text()
    lines = text.splitlines()
    return next(i for i, line in enumerate(lines) if line.startswith(CHECKPOINTS))


def pytest_collection_modifyitems(items):
    """Marks `method` every test defined before the checkpoint tests, the slow ones aside."""
    end = method_end()
    for item in items:
        path, line, name = item.location  # line: the test's def, 0-based
        ours = Path(path).name == "test_setdiff.py"
        slow = name.startswith(SLOW)
        if ours and line < end and not slow:
            item.add_marker(pytest.mark.method)
