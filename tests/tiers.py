"""Cases of a parametrized test that belong in the slow tier:
``@pytest.mark.parametrize("name", cases(NAMES, slow={"llama": "why"}))``."""

import pytest


def cases(values, slow):
    """``values`` for ``parametrize``, those named in ``slow`` marked with their reason."""
    unknown = set(slow) - set(values)
    assert not unknown, f"slow cases {sorted(unknown)} are not among {list(values)}"
    return [
        pytest.param(v, marks=pytest.mark.slow(reason=slow[v])) if v in slow else v for v in values
    ]
