"""Tasks and projects of scripts/bench_live.py."""
