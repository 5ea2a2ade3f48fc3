"""Exit codes every mcore-rl command shares (docs/guides/troubleshooting.md lists them)."""

# (2, a config error, is mcore_rl.config.CONFIG_ERROR_EXIT: the config layer raises it)
# a hang or a dead worker: a phase past its deadline, a rank or engines lost, no Ray cluster
WORKER_FAILED_EXIT_CODE = 3
CHECKPOINT_WRITE_EXIT_CODE = 4  # a checkpoint could not be written; the previous one is intact
# the reward function raised on a sample (task.reward_errors: raise); the last completed step
# is checkpointed
REWARD_FAILED_EXIT_CODE = 5
STOP_EXIT_CODE = 75  # EX_TEMPFAIL: stopped on a signal after writing a checkpoint; requeue me
STOP_TIMEOUT_EXIT_CODE = 76  # stopped on a signal, but no safe point within the grace period
# 128 + SIGINT, as a shell reports a Ctrl-C: stopped by Ctrl-C (after writing a checkpoint,
# or at once on a second Ctrl-C); not "requeue me"
INTERRUPT_EXIT_CODE = 130
