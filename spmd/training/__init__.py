"""The loop that runs a Program: optimizer steps with progress, eval and checkpoints.

`loop` trains from a state to the last step or a stop; `divergence` checks every step's loss
and gradient norm and stops, rolls back or goes on when they diverge; `resume` reopens a run's
checkpoints and data state; `preemption` turns SIGTERM / SIGINT into a clean save. Above
spmd.engine, spmd.io and spmd.observe, which it brings together; below the commands.
"""
