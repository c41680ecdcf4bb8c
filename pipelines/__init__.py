"""Jobs: read → task → write, runners and resume."""
