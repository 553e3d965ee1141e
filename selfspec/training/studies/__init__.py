"""Studies: the scaling table of one long run, the learning-rate sweep, the draft-accuracy measures. What scripts/
and the device program's evaluation stage run; nothing else in the package imports them (tests/test_layout.py)."""
