"""What a run leaves on disk: run.db (runstore) and the checkpoints a role resumes from
(checkpoint)."""
