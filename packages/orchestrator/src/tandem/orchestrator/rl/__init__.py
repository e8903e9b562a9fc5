"""The RL loop and its rules: the run (`loop.RLRun`), THE staleness rule (`staleness`), one
module per schedule (`async_schedule`, `sync_schedule`, `pipelined_schedule`, chosen in
`schedule`), where groups come from (`groups`), which carry a signal (`signal`), publish
retries (`publishing`), what a run reports (`summary`, `step_log`) and its hooks (`hooks`).

The loop drives the engines, the trainer and the weight sink only through
`tandem.orchestrator.protocols`; it imports no backend, engine or trainer.
"""
