"""The trainer's side: GRPO steps on scored groups, and the weights they publish.

`trainer.RLTrainer` takes one optimizer step per call (`tandem.grpo.GRPOStep`) with
router replay; `collate` turns samples into a batch, `scoring` and `prefix_scoring` compute
the trainer's log-probs (each group's common prefix once), `agreement` measures how far they
are from the engine's, `sharding` holds the FSDP layout, and `weights` publishes every
policy version through delta-sync. Nothing here imports the inference side: the sampling
transform both share lives in `tandem.moe_determinism.logprobs`.
"""
