"""Worked examples of using mtpdraft end to end (not part of the installed package)."""
