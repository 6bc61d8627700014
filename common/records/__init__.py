"""What a run leaves on disk: run.db (runstore; walfold folds a WAL a reader left beside it) and
the checkpoints a role resumes from (checkpoint)."""
