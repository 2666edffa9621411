"""The Ray side of a run: the trainer ranks and the rollout workers as actors, the pools that place, watch
and replace them (RayTrainerGroup, RayRolloutPool), the engine thread inside a rollout worker, weight sync
(publish -> transfer -> apply, in `weight_sync`), and checkpoint scheduling over the trainer ranks. Each pool
implements a Protocol of moerl/loop/types.py; nothing here decides what to train on, the loop does.
"""
