"""Test-suite configuration: hypothesis profiles.

``ci`` (selected when ``CI`` is set) is derandomized so a CI run is
reproducible; ``dev`` explores fresh examples each run; ``fuzz`` explores
``HYPOTHESIS_MAX_EXAMPLES`` fresh examples per law (2,000 unless set), for a
long hunt. Pick one explicitly with ``HYPOTHESIS_PROFILE=<name>``.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "dev",
    max_examples=100,
    deadline=None,
    print_blob=True,
)
settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "fuzz",
    max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", "2000")),
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
