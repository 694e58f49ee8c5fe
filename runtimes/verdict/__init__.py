"""The verdict on an artifact: its outputs at every planned live shape, run in the plan's order,
judged against golden outputs under the job's rule. One implementation for the job's validate
stage (exporter/validate/) and for the check on a target that has only a bundle
(runtimes/check.py), so both judge alike and write the same report.

What runs and judges an artifact needs torch (judging.py, sessions.py, compare.py); the values
do not (stats.py, report.py, shapes.py), and neither does this package's import: the exporter's
command reads reports and plans into MLflow without loading torch, which only its jobs' worker
processes do.
"""
