"""The rollout side: token-level episodes (`episode`), GRPO groups (`group`), the task
source and cursor (`tasks`, `curriculum`), and `local.LocalRollouts`, one engine in this
process that plays groups and follows the weight stream (what every backend runs).
"""
