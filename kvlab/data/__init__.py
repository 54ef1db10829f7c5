"""Text kvlab ships: Jane Austen's *Persuasion*, chapters 1-4 (1818, public domain), taken from
Debian's r-cran-janeaustenr 1.0.0-1. It is the default text of ``kvlab evict`` and the fixed
calibration text of fp8 KV caches."""

from pathlib import Path

PERSUASION = Path(__file__).parent / "persuasion-ch1-4.txt"
