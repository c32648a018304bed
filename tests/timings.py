"""What a test may assert of a measured time, or of a rate or ratio computed from measured times."""
from __future__ import annotations

import math


def measured(x) -> bool:
    """A finite, non-negative number. Never assert more of a timing: on a loaded machine a fitted or subtracted
    one can come out 0, and a bound on one says how busy the machine was. A wrong sign, a NaN, an infinity (a
    division by a missing time), None or a string still fail."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
