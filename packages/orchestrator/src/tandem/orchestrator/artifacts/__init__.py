"""What a run leaves on disk: atomic checkpoints for resume (`checkpoint`), one JSONL
record per step (`metrics`), and the reward curve and markdown report (`report`)."""
