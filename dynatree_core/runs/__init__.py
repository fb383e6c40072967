"""What a run leaves behind and what it was measured on: one record per iteration and the run's
result (records.py), their summary metrics (metrics.py), the run file the app exports and imports
(run_file.py), the validation of imported run files (validate.py) and of imported comparison
files and benchmark reports (validate_reports.py), and the hardware and library fingerprint every
report carries (environment.py).

May import: errors, core, forward.
"""
