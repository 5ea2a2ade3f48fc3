"""Exit codes every mcore-rl command shares (docs/guides/troubleshooting.md lists them)."""

STOP_EXIT_CODE = 75  # EX_TEMPFAIL: stopped on a signal after writing a checkpoint; requeue me
STOP_TIMEOUT_EXIT_CODE = 76  # stopped on a signal, but no safe point within the grace period
