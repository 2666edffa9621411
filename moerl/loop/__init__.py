"""The RL loop, with no Ray in it: the controller (leases, staleness gate, policy version, step scheduling),
the work queue of prompt groups with its leases, and the building of trainer samples from finished groups.
`types` holds what crosses the seams (GroupTask, GroupResult, StepInFlight) and the Protocols of the parts the
controller drives (RolloutPool, TrainerGroup, WeightSync, Checkpoints); `moerl.actors` implements them on Ray
and the unit tests implement them in-process.
"""
