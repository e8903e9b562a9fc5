"""Stage 1, mid-training: next-token prediction on real code (`corpus`, packed windows of
the standard library) and on transcripts of agent-env's oracle fixing generated bugs in the
policy's own format (`transcripts`), trained by `trainer.Midtrainer`."""
