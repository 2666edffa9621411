"""Training: the RL policy loss (`moerl.train.loss`), one trainer rank (`moerl.train.trainer`), FSDP2/EP
sharding (`moerl.train.parallel`) and their torch-free config sections (`moerl.train.config`).

Deliberately imports nothing: `moerl.config` imports `moerl.train.config`, and must not pull in torch.
"""
