"""Evaluation: pass@k on held-out tasks played by the engine in the real environment
(`evaluate.play_tasks`, shared among engine processes by `replicas`), scored with the
unbiased estimator, per task category and paired between two policies (`passk`)."""
