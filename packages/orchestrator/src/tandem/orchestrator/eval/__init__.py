"""Evaluation: pass@k on held-out tasks played by the engine in the real environment
(`evaluate`), scored with the unbiased estimator, per task category and paired between two
policies (`passk`)."""
