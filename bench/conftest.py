"""pytest collects the doctests of the tooling (testpaths); scripts that need optional peers are skipped."""

# asdex/jax and jet are peers timed by hand, not test dependencies; sparse_figure needs matplotlib data.
collect_ignore = ["sparse_asdex.py", "sparse_figure.py", "operators.py"]
