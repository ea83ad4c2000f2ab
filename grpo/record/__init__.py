"""The run's record: its directory and logs (runlog.py), checkpoints and resume (checkpoint.py),
the HTML report (report.py) and sweeps (sweep.py)."""
