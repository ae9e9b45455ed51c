"""asv suites of jacmode: every module bench_*.py in this folder is collected (see ../asv.conf.json)."""
